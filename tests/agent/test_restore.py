"""Hardware settings come back however a job stops: real processes, node state read from outside.

Each test starts ``zeus_async.testing.restore_job`` (a Monitor that caps every simulated GPU to
its minimum limit and locks GPU 0's clock) in its own process group, stops it one way, and then
reads the simulated node's state the way a driver would show it: from this process, through
the node-wide state file (``zeus_async.testing.read_sim_node_state``).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeus_async.devices.sim_config import SimConfig
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import (
    finish,
    pid_gone,
    sim_env,
    sim_node_restored,
    start_restore_job,
    wait_sim_node_restored,
)

CONFIG = SimConfig(num_gpus=2, seed=7)

pytestmark = pytest.mark.slow

F_SETPIPE_SZ = 1031  # fcntl: set a pipe's capacity (Linux)


def _env(**extra: str) -> dict[str, str]:
    return sim_env(CONFIG, **extra)


def _start(*args: str, **env: str) -> tuple[subprocess.Popen[str], int]:
    proc, agent_pid = start_restore_job(*args, env=_env(**env))
    state = read_sim_node_state(CONFIG)
    assert [g.power_limit_w for g in state] == [200.0, 200.0]
    assert state[0].locked_sm_clocks_mhz == (990, 990)
    return proc, agent_pid


def _kill_job_and_agent(proc: subprocess.Popen[str], agent_pid: int) -> None:
    """SIGKILL of everything: nobody is left to restore."""
    os.kill(agent_pid, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=20)
    assert pid_gone(agent_pid)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_to_the_process_group_restores(sig: int) -> None:
    proc, agent_pid = _start()
    try:
        os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C, Slurm or docker stop do
        proc.wait(timeout=20)
        wait_sim_node_restored(CONFIG)
        assert pid_gone(agent_pid)
    finally:
        finish(proc)


def test_sigkill_of_the_training_process_restores() -> None:
    proc, agent_pid = _start()
    try:
        proc.kill()  # the OOM killer
        proc.wait(timeout=20)
        wait_sim_node_restored(CONFIG)
        assert pid_gone(agent_pid)
    finally:
        finish(proc)


def test_sigkill_of_everything_is_restored_at_the_next_agent_start() -> None:
    proc, agent_pid = _start()
    try:
        _kill_job_and_agent(proc, agent_pid)
        assert not sim_node_restored(CONFIG)  # nobody was left to do it
        out = subprocess.run(
            [sys.executable, "-m", "zeus_async", "agent", "--restore"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert "3 setting(s) found to restore" in out.stdout, out.stdout
        assert sim_node_restored(CONFIG)
    finally:
        finish(proc)


def test_a_new_monitor_restores_what_a_killed_job_left() -> None:
    proc, agent_pid = _start()
    try:
        _kill_job_and_agent(proc, agent_pid)
        code = "from zeus_async import Monitor; Monitor(backend='sim', cpu_indices=[]).close()"
        subprocess.run([sys.executable, "-c", code], env=_env(), check=True, timeout=60)
        assert sim_node_restored(CONFIG)
    finally:
        finish(proc)


def test_disk_full_keeps_sampling_and_restores() -> None:
    # /dev/full answers every write with ENOSPC: the recording fails, nothing else does.
    proc, _ = _start("--record", "/dev/full")
    try:
        time.sleep(1.0)
        assert proc.poll() is None  # still measuring windows
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        wait_sim_node_restored(CONFIG)
    finally:
        finish(proc)
    assert "recorder failed" in err and "No space left on device" in err, err
    assert "Traceback" not in err.split("KeyboardInterrupt")[0] or "recorder" in err


def test_stalled_target_keeps_sampling_and_restores(tmp_path: Path) -> None:
    # A recording into a pipe that a reader holds open and never reads: after 4 KiB every
    # write blocks forever, as on a hung file system.
    fifo = tmp_path / "run.zarc"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.fcntl(reader, F_SETPIPE_SZ, 4096)
        proc, agent = _start("--record", str(fifo), "--print-windows", ZEUS_ASYNC_STALL_S="0.5")
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()  # the first thing the agent says: the stall
            assert "recorder failed" in line and "made no progress for 0.5 s" in line, line
            assert proc.stdout is not None
            for _ in range(20):  # windows go on being measured
                line = proc.stdout.readline()
                assert line.startswith("window ") and float(line.split()[1]) > 0, line
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            proc.communicate(timeout=20)
            wait_sim_node_restored(CONFIG)
            assert time.monotonic() - t0 < 5  # nobody waited for the hung write
            assert pid_gone(agent)
        finally:
            finish(proc)
    finally:
        os.close(reader)


def test_thread_sampler_killed_is_restored_at_the_next_start() -> None:
    proc, _ = _start("--thread")
    try:
        proc.kill()
        proc.wait(timeout=20)
        assert not sim_node_restored(CONFIG)  # the settings lived in the killed process
        code = "from zeus_async import Monitor; Monitor(backend='sim', cpu_indices=[]).close()"
        subprocess.run([sys.executable, "-c", code], env=_env(), check=True, timeout=60)
        assert sim_node_restored(CONFIG)
    finally:
        finish(proc)
