"""AMD power caps come back however a job stops (sim-amd backend): real processes, the node's
state read from outside as amd-smi would show it (the node-wide state beneath sim_amdsmi)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from zeus_async.devices.sim_config import sim_preset
from zeus_async.testing import read_sim_node_state, sim_amdsmi
from zeus_async.testing.procs import (
    finish,
    pid_gone,
    sim_env,
    sim_node_restored,
    start_restore_job,
    wait_sim_node_restored,
)

CONFIG = sim_preset("amd", num_gpus=2, seed=37)

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return sim_env(CONFIG)


def _caps_seen_through_amdsmi() -> list[float]:
    """The power caps (W) as a fresh amdsmi session on this node shows them."""
    code = (
        "import amdsmi; amdsmi.amdsmi_init(); "
        "print(*[amdsmi.amdsmi_get_power_cap_info(h)['power_cap'] / 1e6 "
        "for h in amdsmi.amdsmi_get_processor_handles()])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**_env(), **sim_amdsmi.shim_env(CONFIG)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [float(v) for v in out.stdout.split()]


def _start() -> tuple[subprocess.Popen[str], int]:
    proc, agent_pid = start_restore_job("--backend", "sim-amd", env=_env())
    state = read_sim_node_state(CONFIG)
    assert [g.power_limit_w for g in state] == [400.0, 400.0]
    assert [g.locked_sm_clocks_mhz for g in state] == [None, None]  # AMD: no clock lock
    return proc, agent_pid


def _kill_job_and_agent(proc: subprocess.Popen[str], agent_pid: int) -> None:
    os.kill(agent_pid, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=20)
    assert pid_gone(agent_pid)


def test_the_cap_is_seen_through_amdsmi_and_restored_on_ctrl_c() -> None:
    proc, agent_pid = _start()
    try:
        assert _caps_seen_through_amdsmi() == [400.0, 400.0]
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=20)
        wait_sim_node_restored(CONFIG)
        assert pid_gone(agent_pid)
        assert _caps_seen_through_amdsmi() == [750.0, 750.0]
    finally:
        finish(proc)


def test_sigterm_to_the_process_group_restores() -> None:
    proc, agent_pid = _start()
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
        wait_sim_node_restored(CONFIG)
        assert pid_gone(agent_pid)
    finally:
        finish(proc)


def test_sigkill_of_the_job_restores() -> None:
    proc, agent_pid = _start()
    try:
        proc.kill()
        proc.wait(timeout=20)
        wait_sim_node_restored(CONFIG)
        assert pid_gone(agent_pid)
    finally:
        finish(proc)


def test_sigkill_of_everything_is_restored_at_the_next_start() -> None:
    proc, agent_pid = _start()
    try:
        _kill_job_and_agent(proc, agent_pid)
        assert not sim_node_restored(CONFIG)  # nobody was left to do it
        code = "from zeus_async import Monitor; Monitor(backend='sim-amd', cpu_indices=[]).close()"
        subprocess.run([sys.executable, "-c", code], env=_env(), check=True, timeout=60)
        assert sim_node_restored(CONFIG)
    finally:
        finish(proc)


def test_sigkill_of_everything_is_restored_by_agent_restore() -> None:
    proc, agent_pid = _start()
    try:
        _kill_job_and_agent(proc, agent_pid)
        assert not sim_node_restored(CONFIG)
        out = subprocess.run(
            [sys.executable, "-m", "zeus_async", "agent", "--restore"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert "2 setting(s) found to restore" in out.stdout, out.stdout
        assert sim_node_restored(CONFIG)
    finally:
        finish(proc)
