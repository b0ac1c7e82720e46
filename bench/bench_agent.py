"""Restore trials: how often every power limit and clock lock comes back, per way a job stops.

    python bench/bench_agent.py --trials 20

Each trial starts ``zeus_async.testing.restore_job`` in its own process group (a Monitor with
a private agent that caps both simulated GPUs to their minimum limit and locks GPU 0's clock),
stops it one way, and reads the simulated node's state from this process (the node-wide state
file, as a driver would show it). "Restored" means every GPU is back at its defaults within
15 s. The SIGKILL-of-everything row counts restores made by the next ``zeus-async agent
--restore``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from zeus_async.devices.sim_config import SimConfig
from zeus_async.testing import read_sim_node_state

ROOT = Path(__file__).resolve().parents[1]
CONFIG = SimConfig(num_gpus=2, seed=3)


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        ZEUS_ASYNC_SIM=CONFIG.to_json(),
        PYTHONPATH=str(ROOT),
    )


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
        time.sleep(0.05)


def _group(sig: int) -> Callable[[subprocess.Popen[str], int], None]:
    def stop(proc: subprocess.Popen[str], agent: int) -> None:
        os.killpg(proc.pid, sig)

    return stop


def _kill_job(proc: subprocess.Popen[str], agent: int) -> None:
    proc.kill()


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


KINDS: dict[str, tuple[list[str], Callable[[subprocess.Popen[str], int], None]]] = {
    "Ctrl-C to the process group": ([], _group(signal.SIGINT)),
    "SIGTERM to the process group": ([], _group(signal.SIGTERM)),
    "SIGKILL of the training process": ([], _kill_job),
    "SIGKILL of job and agent, then agent --restore": ([], _kill_all),
    "disk full under record= (then Ctrl-C)": (["--record", "/dev/full"], _group(signal.SIGINT)),
}


def trial(args: list[str], stop: Callable[[subprocess.Popen[str], int], None]) -> tuple[bool, bool]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeus_async.testing.restore_job", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("capped"):
            raise RuntimeError(f"job did not start: {line!r}")
        if args:
            time.sleep(0.5)
        stop(proc, int(line.split()[1]))
        proc.wait(timeout=30)
        return _wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    os.environ["ZEUS_ASYNC_DIR"] = tempfile.mkdtemp(prefix="zb-agent-")
    print(f"{args.trials} trials per row; 2 simulated GPUs; limit capped on both, clock on one\n")
    print("| how the job stopped | power limits restored | clock locks restored |")
    print("|---|---:|---:|")
    for name, (extra, stop) in KINDS.items():
        limits = clocks = 0
        for _ in range(args.trials):
            ok_limits, ok_clocks = trial(extra, stop)
            limits += 2 if ok_limits else 0
            clocks += 1 if ok_clocks else 0
        n = args.trials
        print(f"| {name} | {limits}/{2 * n} | {clocks}/{n} |", flush=True)


if __name__ == "__main__":
    main()
