"""A node agent on a busy cluster node: what workloads and tracked processes cost.

    .venv/bin/python bench/agent/bench_cluster_agent.py

A simulated node of 8 GPUs sampled at 100 Hz, 20 Slurm jobs announced by their prologs
(``zeus-async job start``, a real CLI process each): jobs 1-8 hold one GPU each, jobs 9-20
none (CPU jobs sharing the node), and 200 tracked processes, 10 per job: real ``sleep``
children whose environment carries their job's ``SLURM_JOB_ID``. The simulated driver lists
the first process of each GPU job on every GPU (the simulator has one process list for all
GPUs), so there are 8 x 8 per-process GPU series where a real node would show 8: an upper
bound. Four node agents (``python -c`` running :func:`zeus_async.agent.server.serve`, the
``zeus-async agent`` entry, with an :class:`AgentConfig` that tracks the 200 pids) run at
the same time, each in its own directory, so that they see the same moment of the same
machine:

* **full**: workloads on (``--workload-expire``), the 200 processes tracked, each process's
  samples and series naming its workload (``workload="slurm:5003"``);
* **no workloads**: ``workloads=False``, the 200 processes tracked (jobs are refused);
* **no processes**: workloads on, no process tracked;
* **neither**: workloads off, no process tracked (sampling alone);
* with ``--baseline DIR`` (another source tree, e.g. ``git archive HEAD | tar -x -C DIR``),
  **full @ baseline**: the full agent run from that tree's ``zeus_async``, beside the others,
  for a before/after of a change in one run.

Measured:

1. each agent's CPU (% of one core: ``utime + stime`` of ``/proc/<pid>/stat`` over a steady
   window after a warm-up) and memory (``/proc/<pid>/smaps_rollup``: RSS, PSS, and USS =
   private clean + dirty; the four agents share library pages, so PSS is lower than one agent
   alone would show; USS is not);
2. scraping ``/metrics`` of the full agent at that size (urllib, one connection a scrape):
   median and p99 time, response size, series, and the agent's CPU per scrape;
3. the label bound: 1,000 more jobs started and ended on the full agent
   (:func:`zeus_async.agent.client.agent_request`, ``job_start``/``job_end``), each on one
   GPU (``i % 8``); ``zeus_workload_gpu_energy_joules_total`` series and all series, scraped
   every 0.25 s: the largest, at the last end, and ``--workload-expire`` + 3 s later (the
   ledger ticks every second).

Prints Markdown tables. ``--window``, ``--warmup``, ``--churn``, ``--scrapes`` scale it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import msgspec

from zeus_async.agent.client import agent_request
from zeus_async.agent.protocol import AgentConfig, Control, JobSpec
from zeus_async.devices.sim_config import SimConfig
from zeus_async.runtime.processes import ProcessTracking
from zeus_async.testing.procs import sim_env

GPUS = 8
JOBS = 20
GPU_JOBS = 8
PER_JOB = 10
FIRST_JOB = 5000
TICK_S = os.sysconf("SC_CLK_TCK")
WORKLOAD_SERIES = "zeus_workload_gpu_energy_joules_total{"

#: Runs an agent as ``zeus-async agent`` does (its ready line, then serve until a signal),
#: with any :class:`AgentConfig`: ``python -m zeus_async.agent.server`` prints no ready line.
LAUNCH = (
    "import logging, sys, msgspec\n"
    "from zeus_async.agent.protocol import AgentConfig\n"
    "from zeus_async.agent.server import serve\n"
    "logging.basicConfig(level=logging.WARNING, format='agent: %(message)s')\n"
    "sys.exit(serve(msgspec.json.decode(sys.argv[1], type=AgentConfig), ready_line=True))\n"
)


class Agent:
    """One node agent process in a directory of its own."""

    def __init__(self, name: str, root: Path, cfg: AgentConfig, env: dict[str, str]) -> None:
        self.name = name
        self.endpoint = cfg.endpoint
        self.log = open(root / "agent.log", "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, msgspec.json.encode(cfg).decode()],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=root,  # not this tree: `-c` puts the working directory first on sys.path
        )
        self.port = 0

    def ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"metrics on port (\d+)", line)
        if found is None:
            self.proc.kill()
            self.proc.wait()
            self.log.seek(0)
            raise RuntimeError(f"agent {self.name} did not start: {line!r} {self.log.read()!r}")
        self.port = int(found.group(1))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        self.log.close()


def _pids_of(pid: int) -> list[int]:
    """``pid`` and its descendants (an agent runs threads, but count any child too)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants (``/proc/<pid>/stat``)."""
    total = 0
    for p in _pids_of(pid):
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    return total / TICK_S


def memory_mib(pid: int) -> tuple[float, float, float]:
    """(RSS, PSS, USS) of ``pid`` in MiB, from ``/proc/<pid>/smaps_rollup``."""
    kb: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        kb[key] = int(value.split()[0])
    return (
        kb["Rss"] / 1024,
        kb["Pss"] / 1024,
        (kb["Private_Clean"] + kb["Private_Dirty"]) / 1024,
    )


def scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body


def series(body: bytes) -> tuple[int, int]:
    """(workload energy series, all series) in a scrape."""
    lines = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
    return sum(ln.startswith(WORKLOAD_SERIES) for ln in lines), len(lines)


def series_by_kind(body: bytes) -> str:
    """How many series of each kind a scrape holds (GPU, process, process on a GPU...)."""
    kinds = ("zeus_gpu_", "zeus_process_gpu_", "zeus_process_", "zeus_workload_")
    counts = dict.fromkeys(kinds, 0)
    other = 0
    for ln in body.decode().splitlines():
        if not ln or ln.startswith("#"):
            continue
        kind = next((k for k in kinds if ln.startswith(k)), None)
        if kind is None:
            other += 1
        else:
            counts[kind] += 1
    parts = [f"{k.rstrip('_')}_*: {n}" for k, n in counts.items()]
    return ", ".join([*parts, f"other: {other}"])


def _job_gpus(j: int) -> str:
    return str(j) if j < GPU_JOBS else ""


def announce(agent: Agent, env: dict[str, str]) -> None:
    """The 20 prologs: ``zeus-async job start`` each, all at once."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "zeus_async",
                "job",
                "start",
                "--job",
                str(FIRST_JOB + j),
                "--gpus",
                _job_gpus(j),
                "--user",
                f"user{j % 5}",
                "--uid",
                str(2000 + j % 5),
                "--partition",
                "gpu" if j < GPU_JOBS else "cpu",
                "--agent",
                agent.endpoint,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for j in range(JOBS)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"job start failed ({p.returncode}): {out}{err}")


def churn(agent: Agent, jobs: int, expire_s: float) -> dict[str, int]:
    """``jobs`` jobs started and ended, one GPU each; the series counts seen meanwhile."""
    counts: dict[str, int] = {"max_wl": 0, "max_all": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            wl, total = series(scrape(agent.url))
            counts["max_wl"] = max(counts["max_wl"], wl)
            counts["max_all"] = max(counts["max_all"], total)
            stop.wait(0.25)

    def job(i: int) -> None:
        spec = JobSpec(job_id=str(100_000 + i), gpus=[str(i % GPUS)], user="churn", uid=3000)
        agent_request(agent.endpoint, Control(seq=1, op="job_start", job=spec), timeout_s=60)
        end = Control(seq=2, op="job_end", job=JobSpec(job_id=spec.job_id))
        agent_request(agent.endpoint, end, timeout_s=60)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    # One client per GPU at a time (the agent runs controls one after another anyway).
    with futures.ThreadPoolExecutor(GPUS) as pool:
        for f in [pool.submit(job, i) for i in range(jobs)]:
            f.result()
    counts["seconds"] = round(time.monotonic() - t0)
    counts["end_wl"], counts["end_all"] = series(scrape(agent.url))
    time.sleep(expire_s + 3)
    stop.set()
    watcher.join()
    counts["after_wl"], counts["after_all"] = series(scrape(agent.url))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--window", type=float, default=20.0, help="CPU window (s)")
    parser.add_argument("--warmup", type=float, default=5.0, help="before the window (s)")
    parser.add_argument("--scrapes", type=int, default=200, help="scrapes timed")
    parser.add_argument("--churn", type=int, default=1000, help="jobs started and ended")
    parser.add_argument("--expire", type=float, default=10.0, help="--workload-expire (s)")
    parser.add_argument("--period", type=float, default=0.01, help="sampling period (s)")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help="also run the full agent from the zeus_async of this source tree",
    )
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="zb-cluster-"))
    children: list[subprocess.Popen[bytes]] = []
    agents: list[Agent] = []
    try:
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        for j in range(JOBS):
            job_env = {
                **base,
                "SLURM_JOB_ID": str(FIRST_JOB + j),
                "SLURM_JOB_USER": f"user{j % 5}",
                "SLURM_JOB_PARTITION": "gpu" if j < GPU_JOBS else "cpu",
            }
            if j < GPU_JOBS:
                job_env["SLURM_JOB_GPUS"] = str(j)
            for _ in range(PER_JOB):
                children.append(subprocess.Popen(["sleep", "100000"], env=job_env))
        pids = tuple(c.pid for c in children)
        on_gpus = tuple(pids[j * PER_JOB] for j in range(GPU_JOBS))
        sim = SimConfig(num_gpus=GPUS, seed=3, process_pids=on_gpus)
        tracking = ProcessTracking(pids=pids)
        variants = {
            "full": (True, tracking),
            "no workloads": (False, tracking),
            "no processes": (True, None),
            "neither": (False, None),
        }
        if args.baseline is not None:
            variants["full @ baseline"] = (True, tracking)
        envs = {}
        for i, (name, (workloads, processes)) in enumerate(variants.items()):
            root = tmp / f"agent{i}"
            root.mkdir(mode=0o700)
            envs[name] = sim_env(sim, ZEUS_ASYNC_DIR=str(root))
            if name == "full @ baseline":
                envs[name]["PYTHONPATH"] = str(args.baseline.resolve())
            cfg = AgentConfig(
                endpoint=f"ipc://{root}/agent.sock",
                backend="sim",
                period_s=args.period,
                fields={"power_w": None, "energy_j": None},
                node=True,
                workloads=workloads,
                processes=processes,
                prometheus_port=0,
                workload_expire_s=args.expire,
                host=f"bench-{i}",
            )
            agents.append(Agent(name, root, cfg, envs[name]))
        for a in agents:
            a.ready()
        for a in agents:
            if variants[a.name][0]:
                announce(a, envs[a.name])
        time.sleep(args.warmup)
        before = {a.name: cpu_s(a.proc.pid) for a in agents}
        t0 = time.monotonic()
        time.sleep(args.window)
        after = {a.name: cpu_s(a.proc.pid) for a in agents}
        wall = time.monotonic() - t0
        rows = []
        for a in agents:
            rss, pss, uss = memory_mib(a.proc.pid)
            body = scrape(a.url)
            wl, total = series(body)
            cpu = (after[a.name] - before[a.name]) / wall * 100
            rows.append((a.name, cpu, rss, pss, uss, wl, total, len(body)))
        full = agents[0]
        for a in agents[1:]:
            a.stop()

        # Scrape time at that size.
        times = []
        size = 0
        c0 = cpu_s(full.proc.pid)
        s0 = time.monotonic()
        for _ in range(args.scrapes):
            t = time.perf_counter()
            body = scrape(full.url)
            times.append(time.perf_counter() - t)
            size = len(body)
        scrape_cpu = (cpu_s(full.proc.pid) - c0) / args.scrapes
        scrape_wall = time.monotonic() - s0
        wl_now, all_now = series(body)

        counts = churn(full, args.churn, args.expire)
    finally:
        for a in agents:
            a.stop()
        for c in children:
            c.kill()
            c.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"\n{GPUS} simulated GPUs at {1 / args.period:g} Hz; {JOBS} Slurm jobs announced by "
        f"`zeus-async job start` ({GPU_JOBS} holding one GPU each, {JOBS - GPU_JOBS} none); "
        f"{len(pids)} tracked `sleep` processes ({PER_JOB} a job, `SLURM_JOB_ID` in their "
        f"environment); the {len(agents)} agents at once, CPU over {wall:.1f} s after a "
        f"{args.warmup:g} s warm-up; CPU as % of one core (user + system).\n"
    )
    print(
        "| agent | workloads | tracked processes | CPU | RSS MiB | PSS MiB | USS MiB "
        "| workload series | all series | /metrics |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, cpu, rss, pss, uss, wl, total, size_b in rows:
        workloads, processes = variants[name]
        print(
            f"| {name} | {'on' if workloads else 'off'} "
            f"| {len(pids) if processes is not None else 0} | {cpu:.1f} % | {rss:.1f} "
            f"| {pss:.1f} | {uss:.1f} | {wl} | {total} | {size_b / 1024:.1f} KiB |"
        )
    ordered = sorted(times)
    print(
        f"\n| /metrics of the full agent ({args.scrapes} scrapes, urllib) | median | p99 "
        "| response | series | agent CPU a scrape |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| {GPUS} GPUs, {len(pids)} processes, {JOBS} jobs ({all_now} series, {wl_now} "
        f"workload) | {statistics.median(ordered) * 1e3:.2f} ms "
        f"| {ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3:.2f} ms "
        f"| {size / 1024:.0f} KiB | {all_now} | {scrape_cpu * 1e3:.2f} ms |"
    )
    print(f"\nSeries: {series_by_kind(body)}; {args.scrapes} scrapes took {scrape_wall:.1f} s.")
    print(
        f"\n| {args.churn:,} jobs started and ended (1 GPU each, `--workload-expire "
        f"{args.expire:g}`, {counts['seconds']} s) | largest | at the last end "
        f"| {args.expire + 3:g} s after |"
    )
    print("|---|---:|---:|---:|")
    print(
        f"| `zeus_workload_gpu_energy_joules_total` series | {counts['max_wl']} "
        f"| {counts['end_wl']} | {counts['after_wl']} |"
    )
    print(f"| all series | {counts['max_all']} | {counts['end_all']} | {counts['after_all']} |")


if __name__ == "__main__":
    main()
