"""A node agent tracking processes (``zeus-async agent --gpu-processes``) labels each process's
series with the workload it works for: a process of a Slurm job announced by its prolog
(``zeus-async job start``), its environment naming the job, with ``workload="slurm:<id>"``; a
plain process with its user's, ``workload="uid:<uid>"``. Real processes, simulated GPUs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zeus_async.devices.sim import SimConfig
from zeus_async.testing.procs import sim_env, start_node_agent_ready

JOB = "77"


@pytest.fixture
def children() -> Iterator[tuple[int, int]]:
    """Two ``sleep`` processes: one of job 77 (``SLURM_JOB_ID`` in its environment), one in
    no job."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    job = subprocess.Popen(["sleep", "600"], env={**base, "SLURM_JOB_ID": JOB})
    plain = subprocess.Popen(["sleep", "600"], env=base)
    try:
        yield job.pid, plain.pid
    finally:
        for child in (job, plain):
            child.kill()
            child.wait()


def _process_series(port: int) -> dict[tuple[str, int, str | None], str | None]:
    """(sample name, pid, gpu) -> the workload label of each process series on ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[tuple[str, int, str | None], str | None] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("zeus_process_") and s.labels.get("kind", "rss") == "rss":
                key = (s.name, int(s.labels["pid"]), s.labels.get("gpu"))
                out[key] = s.labels.get("workload")
    return out


def test_process_series_name_their_job_or_their_user(
    tmp_path: Path, children: tuple[int, int]
) -> None:
    job_pid, plain_pid = children
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    env = sim_env(SimConfig(num_gpus=2, seed=3, process_pids=children), ZEUS_ASYNC_DIR=str(d))
    agent, line = start_node_agent_ready(
        env, "--gpu-processes", "--process-period", "0.2", "--prometheus-port", "0"
    )
    try:
        found = re.search(r"metrics on port (\d+)", line)
        assert found is not None, line
        port = int(found.group(1))
        started = subprocess.run(
            [sys.executable, "-m", "zeus_async", "job", "start", "--job", JOB, "--gpus", "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert started.returncode == 0, started.stderr
        want = {job_pid: f"slurm:{JOB}", plain_pid: f"uid:{os.getuid()}"}
        deadline = time.monotonic() + 30
        while True:
            got = _process_series(port)
            pids = {pid for _, pid, _ in got}
            gpu_pairs = {(pid, gpu) for name, pid, gpu in got if gpu is not None}
            wrong = {key: w for key, w in got.items() if w != want.get(key[1])}
            if pids == set(want) and len(gpu_pairs) == 4 and not wrong:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        agent.send_signal(signal.SIGINT)
        agent.communicate(timeout=30)
    # Every series of each process, on the host and on each GPU, names its workload.
    assert wrong == {}
    assert pids == set(want)
    names = {name for name, _, _ in got}
    assert "zeus_process_memory_bytes" in names and "zeus_process_gpu_memory_bytes" in names
    assert gpu_pairs == {(job_pid, "0"), (job_pid, "1"), (plain_pid, "0"), (plain_pid, "1")}
