"""Restore trials: how often every power limit and clock lock comes back, per way a job stops.

    python bench/agent/bench_agent.py --trials 20

Each trial starts ``zeus_async.testing.restore_job`` in its own process group (a Monitor with
a private agent that caps both simulated GPUs to their minimum limit and locks GPU 0's clock),
stops it one way, and reads the simulated node's state from this process (the node-wide state
file, as a driver would show it). "Restored" means every GPU is back at its defaults within
15 s. The SIGKILL-of-everything row counts restores made by the next ``zeus-async agent
--restore``. The stalled-target row records into a pipe that a reader holds open and never
reads (``ZEUS_ASYNC_STALL_S=1``). Prints a Markdown table.

    python bench/agent/bench_agent.py --parts ranks,edges

``ranks``: a node agent samples 8 simulated GPUs at 100 Hz while 1, 2, 4 and 8 rank processes
attach to it (``LOCAL_RANK``; each measures its own GPU, one window per 100 ms step); the
agent's CPU (% of one core) per rank count, beside the same ranks each with its own private
agent (the wave-1 world: every rank samples every GPU). ``edges``: window begin+end on the
caller's thread (4 GPUs, sync off, median of 2,000 pairs, 1 ms apart, each first in turn): a
Monitor attached to a node agent, one with a private agent, and a floor (the same steps
written bare), interleaved in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil

from zeus_async.devices.sim_config import SimConfig
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import sim_env, start_node_agent, start_restore_job

CONFIG = SimConfig(num_gpus=2, seed=3)


def _env(config: SimConfig = CONFIG, **extra: str) -> dict[str, str]:
    return sim_env(config, **extra)


def _restored() -> tuple[bool, bool]:
    state = read_sim_node_state(CONFIG)
    limits = all(g.power_limit_w == CONFIG.power_limit_default_w for g in state)
    clocks = all(g.locked_sm_clocks_mhz is None for g in state)
    return limits, clocks


def _wait(timeout_s: float = 15.0) -> tuple[bool, bool]:
    deadline = time.monotonic() + timeout_s
    while True:
        limits, clocks = _restored()
        if (limits and clocks) or time.monotonic() > deadline:
            return limits, clocks
        time.sleep(0.01)


def _group(sig: int) -> Callable[[subprocess.Popen[str], int], float | None]:
    def stop(proc: subprocess.Popen[str], agent: int) -> None:
        os.killpg(proc.pid, sig)

    return stop


def _kill_job(proc: subprocess.Popen[str], agent: int) -> None:
    proc.kill()


def _kill_job_unreaped(proc: subprocess.Popen[str], agent: int) -> None:
    # The launcher captures the job's output and reads it to the end before it reaps (as
    # subprocess.run(capture_output=True) does): the job stays a zombie meanwhile.
    proc.kill()


def _kill_agent(proc: subprocess.Popen[str], agent: int) -> None:
    os.kill(agent, signal.SIGKILL)


def _kill_all(proc: subprocess.Popen[str], agent: int) -> None:
    os.kill(agent, signal.SIGKILL)
    proc.kill()
    proc.wait()
    subprocess.run(
        [sys.executable, "-m", "zeus_async", "agent", "--restore"],
        env=_env(),
        capture_output=True,
        check=False,
    )


@contextmanager
def _no_target() -> Iterator[tuple[list[str], dict[str, str]]]:
    yield [], {}


@contextmanager
def _disk_full() -> Iterator[tuple[list[str], dict[str, str]]]:
    yield ["--record", "/dev/full"], {}


@contextmanager
def _stalled_pipe() -> Iterator[tuple[list[str], dict[str, str]]]:
    # A reader that holds the pipe open and never reads: after 4 KiB every write blocks.
    with tempfile.TemporaryDirectory() as tmp:
        fifo = os.path.join(tmp, "run.zarc")
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            fcntl.fcntl(reader, 1031, 4096)  # F_SETPIPE_SZ
            yield ["--record", fifo], {"ZEUS_ASYNC_STALL_S": "1"}
        finally:
            os.close(reader)


def _fill(directory: str) -> None:
    """Write zeros into ``directory`` until its file system has no block left."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    chunk = b"\0" * 65536
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError:
                if len(chunk) == 1:
                    return
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


@contextmanager
def _full_private_dir() -> Iterator[tuple[list[str], dict[str, str]]]:
    # The private directory (journal, board, socket) a 4 MiB tmpfs that fills up once the
    # job has changed its settings; the simulated driver's state on a tmpfs of its own (on a
    # real node the driver keeps its settings in the GPU, not on this disk). Needs root.
    with tempfile.TemporaryDirectory() as tmp:
        private = os.path.join(tmp, "private")
        sim = os.path.join(private, "sim")
        os.mkdir(private, 0o700)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", private], check=True
        )
        try:
            os.mkdir(sim, 0o700)
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", sim], check=True
            )
            before = os.environ.get("ZEUS_ASYNC_DIR")
            os.environ["ZEUS_ASYNC_DIR"] = private  # where _restored() reads the node
            try:
                yield [], {"ZEUS_ASYNC_DIR": private}
            finally:
                if before is None:
                    del os.environ["ZEUS_ASYNC_DIR"]
                else:
                    os.environ["ZEUS_ASYNC_DIR"] = before
                subprocess.run(["umount", "-l", sim], check=False)
        finally:
            subprocess.run(["umount", "-l", private], check=False)


def _fill_then_ctrl_c(proc: subprocess.Popen[str], agent: int) -> float:
    _fill(os.environ["ZEUS_ASYNC_DIR"])
    time.sleep(1.0)  # windows go on being measured on the full disk
    if proc.poll() is not None or not _alive(agent):
        raise RuntimeError("the job or its agent died on the full disk")
    os.killpg(proc.pid, signal.SIGINT)
    return time.monotonic()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


Setup = Callable[[], "contextlib.AbstractContextManager[tuple[list[str], dict[str, str]]]"]
KINDS: dict[str, tuple[Setup, float, Callable[[subprocess.Popen[str], int], float | None]]] = {
    "Ctrl-C to the process group": (_no_target, 0.0, _group(signal.SIGINT)),
    "SIGTERM to the process group": (_no_target, 0.0, _group(signal.SIGTERM)),
    "SIGKILL of the training process": (_no_target, 0.0, _kill_job),
    "SIGKILL of the training process, never reaped, output captured": (
        _no_target,
        0.0,
        _kill_job_unreaped,
    ),
    "SIGKILL of its agent (the job restores)": (_no_target, 0.0, _kill_agent),
    "SIGKILL of job and agent, then agent --restore": (_no_target, 0.0, _kill_all),
    "disk full under record= (then Ctrl-C)": (_disk_full, 0.5, _group(signal.SIGINT)),
    "private directory fills up while running (then Ctrl-C)": (
        _full_private_dir,
        0.0,
        _fill_then_ctrl_c,
    ),
    "stalled record= target, a full pipe (then Ctrl-C)": (
        _stalled_pipe,
        2.0,
        _group(signal.SIGINT),
    ),
}


def _dump_hung(*pids: int) -> None:
    """A job that did not stop: its stacks (py-spy, when installed) on stderr, to debug."""
    import shutil

    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    for pid in pids:
        print(f"--- process {pid} did not stop; its stacks:", file=sys.stderr, flush=True)
        subprocess.run([spy, "dump", "--pid", str(pid)], check=False, timeout=60)


def trial(
    setup: Setup, wait_s: float, stop: Callable[[subprocess.Popen[str], int], float | None]
) -> tuple[bool, bool, float]:
    """One job stopped one way: (limits restored, clocks restored, seconds from the stop until
    both were, or until the 15 s wait gave up)."""
    with setup() as (args, env):
        proc, agent_pid = start_restore_job(*args, env=_env(**env), stderr=subprocess.PIPE)
        try:
            time.sleep(wait_s)
            t0 = time.monotonic()
            t0 = stop(proc, agent_pid) or t0  # a stop that waits first says when it stopped
            if stop is not _kill_job_unreaped and stop is not _kill_agent:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    _dump_hung(proc.pid, agent_pid)
                    return False, False, float("nan")
            limits, clocks = _wait()
            took = time.monotonic() - t0
            if stop is _kill_job_unreaped:
                proc.communicate(timeout=10)  # the pipes reach their end: nothing holds them
            return limits, clocks, took
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


# -- node sampling CPU with attached ranks ----------------------------------------------------

RANKS_CONFIG = SimConfig(num_gpus=8, seed=3)
RANK = """
import sys, time
from zeus_async import Monitor
m = Monitor(agent=sys.argv[1] == "node")
print("ready", m._process.attached, m.gpu_indices, flush=True)
while True:
    if sys.argv[2] == "windows":
        with m.window("step"):
            time.sleep(0.1)
    else:
        time.sleep(0.1)
"""


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _agents_of(procs: list[subprocess.Popen[str]]) -> list[int]:
    """The private agents the rank processes started (their children's sessions differ)."""
    rank_pids = {p.pid for p in procs}
    found = []
    for proc in psutil.process_iter(["ppid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["ppid"] in rank_pids and "zeus_async.agent.server" in cmd:
            found.append(proc.pid)
    return found


def _start_ranks(n: int, mode: str, windows: bool = True) -> list[subprocess.Popen[str]]:
    procs = []
    for rank in range(n):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK, mode, "windows" if windows else "idle"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=_env(RANKS_CONFIG, LOCAL_RANK=str(rank), RANK=str(rank)),
            )
        )
    for rank, p in enumerate(procs):
        assert p.stdout is not None
        line = p.stdout.readline()
        want = f"ready {mode == 'node'} [{rank}]" if mode == "node" else "ready False"
        if not line.startswith(want):
            raise RuntimeError(f"rank {rank} ({mode}) did not start: {line!r}")
    return procs


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def bench_ranks(duration_s: float, counts: list[int]) -> None:
    node = start_node_agent(_env(RANKS_CONFIG), "--period", "0.01", stderr=subprocess.DEVNULL)
    rows = []
    try:
        for n in counts:
            row: dict[str, float] = {}
            for mode in ("idle", "node", "private"):
                procs = _start_ranks(n, "node" if mode == "idle" else mode, mode != "idle")
                try:
                    agents = [node.pid] if mode != "private" else _agents_of(procs)
                    if mode == "private" and len(agents) != n:
                        raise RuntimeError(f"found {len(agents)} private agents for {n} ranks")
                    time.sleep(1.0)  # past start-up
                    ranks = [p.pid for p in procs]
                    a0, r0, t0 = _cpu_s(agents), _cpu_s(ranks), time.monotonic()
                    time.sleep(duration_s)
                    a1, r1, t1 = _cpu_s(agents), _cpu_s(ranks), time.monotonic()
                    row[f"{mode}_agent"] = (a1 - a0) / (t1 - t0)
                    row[f"{mode}_ranks"] = (r1 - r0) / (t1 - t0)
                finally:
                    _stop(procs)
            rows.append((n, row))
            print(f"  {n} rank(s) measured", file=sys.stderr, flush=True)
    finally:
        node.send_signal(signal.SIGTERM)
        node.communicate(timeout=30)
    first = rows[0][1]
    print(
        f"\n8 simulated GPUs sampled at 100 Hz; {duration_s:g} s per cell; CPU as % of one "
        "core (user + system). Sampling: ranks attached, no windows. With windows: each rank "
        "one window per 100 ms step on its own GPU. Private: each rank its own agent "
        "(every rank samples every GPU), windows as before.\n"
    )
    print(
        "| ranks | node agent, sampling | vs one rank | node agent, with windows | vs one rank "
        "| ranks' own CPU (all) | private agents (all) | vs one rank |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, row in rows:
        print(
            f"| {n} | {row['idle_agent'] * 100:.1f} % "
            f"| {row['idle_agent'] / first['idle_agent']:.2f}x "
            f"| {row['node_agent'] * 100:.1f} % "
            f"| {row['node_agent'] / first['node_agent']:.2f}x "
            f"| {row['node_ranks'] * 100:.1f} % | {row['private_agent'] * 100:.1f} % "
            f"| {row['private_agent'] / first['private_agent']:.2f}x |"
        )


# -- window begin+end on an attached client -----------------------------------------------------


class _BareEdges:
    """The least a begin+end that queues its edges for another thread can do: read the clock,
    take a lock, keep the open window in a dict, encode an edge, append it to a queue."""

    def __init__(self) -> None:
        import collections
        import threading

        import msgspec

        from zeus_async.agent.protocol import Edge

        self._edge = Edge
        self._enc = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, int]] = {}
        self.sent: collections.deque[bytes] = collections.deque()

    def begin_window(self, key: str, sync_execution: bool = False) -> None:
        t_ns = time.time_ns()
        with self._lock:
            self._open[key] = (t_ns, 1)
            self.sent.append(self._enc.encode(self._edge(True, key, 1, t_ns)))

    def end_window(self, key: str, sync_execution: bool = False) -> None:
        t_ns = time.time_ns()
        with self._lock:
            self._open.pop(key)
            self.sent.append(self._enc.encode(self._edge(False, key, 1, t_ns)))


def bench_edges(n: int) -> None:
    from zeus_async import Monitor

    config = SimConfig(num_gpus=4, seed=3)
    os.environ["ZEUS_ASYNC_SIM"] = config.to_json()
    node = start_node_agent(_env(config), stderr=subprocess.DEVNULL)
    try:
        attached = Monitor(agent=True, gpu_indices=[0, 1, 2, 3], cpu_indices=[])
        private = Monitor(agent=False, backend="sim", cpu_indices=[], sim_config=config)
        assert attached._process is not None and attached._process.attached
        assert private._process is not None and not private._process.attached
        floor = _BareEdges()
        samples: dict[str, list[float]] = {k: [] for k in ("attached", "private", "floor")}
        try:
            pair = (("attached", attached), ("private", private), ("floor", floor))
            for i in range(n):
                # Each first in turn: the first after a sleep runs on cold caches.
                for name, mon in pair[i % 3 :] + pair[: i % 3]:
                    t = time.perf_counter()
                    mon.begin_window(f"c{i}", sync_execution=False)
                    mon.end_window(f"c{i}", sync_execution=False)
                    samples[name].append(time.perf_counter() - t)
                floor.sent.clear()
                time.sleep(0.001)
        finally:
            attached.close()
            private.close()
    finally:
        node.send_signal(signal.SIGTERM)
        node.communicate(timeout=30)
    print(f"\n| begin+end, 4 GPUs, sync off ({n} pairs, interleaved) | median µs | p90 µs |")
    print("|---|---:|---:|")
    for name, label in (
        ("attached", "attached to a node agent"),
        ("private", "private agent"),
        ("floor", "floor: the same steps bare (clock, lock, dict, msgpack edge, queue)"),
    ):
        xs = sorted(samples[name])
        print(
            f"| {label} | {statistics.median(xs) * 1e6:.1f} | {xs[int(0.9 * len(xs))] * 1e6:.1f} |"
        )


def bench_restore(trials: int, only: str | None) -> None:
    print(f"{trials} trials per row; 2 simulated GPUs; limit capped on both, clock on one\n")
    print(
        "| how the job stopped | power limits restored | clock locks restored "
        "| time to restore, median | max |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, (setup, wait_s, stop) in KINDS.items():
        if only and only not in name:
            continue
        limits = clocks = 0
        times = []
        for _ in range(trials):
            ok_limits, ok_clocks, took = trial(setup, wait_s, stop)
            limits += 2 if ok_limits else 0
            clocks += 1 if ok_clocks else 0
            times.append(took)
        print(
            f"| {name} | {limits}/{2 * trials} | {clocks}/{trials} "
            f"| {statistics.median(times):.2f} s | {max(times):.2f} s |",
            flush=True,
        )


def main() -> None:
    # Started in the background by a shell (`... &`), this process ignores SIGINT, and its
    # children would inherit that: the Ctrl-C rows would measure jobs that cannot be stopped.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="restore", help="restore,ranks,edges")
    parser.add_argument("--trials", type=int, default=20, help="restore: trials per row")
    parser.add_argument("--only", default=None, help="restore: rows whose name contains this")
    parser.add_argument("--duration", type=float, default=10.0, help="ranks: seconds per row")
    parser.add_argument("--ranks", default="1,2,4,8", help="ranks: rank counts")
    parser.add_argument("--pairs", type=int, default=2000, help="edges: begin+end pairs")
    args = parser.parse_args()
    os.environ["ZEUS_ASYNC_DIR"] = tempfile.mkdtemp(prefix="zb-agent-")
    for part in args.parts.split(","):
        if part == "restore":
            bench_restore(args.trials, args.only)
        elif part == "ranks":
            bench_ranks(args.duration, [int(x) for x in args.ranks.split(",")])
        elif part == "edges":
            bench_edges(args.pairs)
        else:
            raise SystemExit(f"unknown part {part!r} (restore, ranks, edges)")


if __name__ == "__main__":
    main()
