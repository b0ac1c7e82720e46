"""The node agent with several real client processes; leases; typed errors; the private dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeus_async import Monitor
from zeus_async._paths import ensure_private_dir
from zeus_async.devices.sim_config import SimConfig
from zeus_async.errors import ConfigError, LeaseConflictError
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import sim_env, start_node_agent

CONFIG = SimConfig(num_gpus=2, seed=11)


def _env(**extra: str) -> dict[str, str]:
    return sim_env(CONFIG, **extra)


@pytest.fixture
def node_agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[str]]:
    monkeypatch.setenv("ZEUS_ASYNC_SIM", CONFIG.to_json())
    proc = start_node_agent(_env())
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)


CLIENT = """
import sys, time
from zeus_async import Monitor
m = Monitor()
assert m._process is not None and m._process.attached, "not attached"
print("gpus", m.gpu_indices, flush=True)
with m.window("step") as w:
    time.sleep(0.3)
print("energy", sorted(w.result.gpu_energy), flush=True)
m.set_power_limit(300).result(timeout=30)
print("capped", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_ranks_share_one_agent_and_leases_conflict(
    node_agent: subprocess.Popen[str],
) -> None:
    # Rank 1 of a torchrun job: its own GPU by default, measured by the node agent.
    rank1 = subprocess.Popen(
        [sys.executable, "-c", CLIENT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(LOCAL_RANK="1", RANK="1"),
    )
    try:
        assert rank1.stdout is not None
        lines = [rank1.stdout.readline() for _ in range(3)]
        assert lines[0].strip() == "gpus [1]", (lines, rank1.stderr.read() if rank1.stderr else "")
        assert lines[1].strip() == "energy [1]"
        assert lines[2].strip() == "capped"
        assert read_sim_node_state(CONFIG)[1].power_limit_w == 300.0

        # This process is another client of the same agent (rank 0 asks for both GPUs).
        with Monitor(gpu_indices=[0, 1]) as mon:
            assert mon._process is not None and mon._process.attached
            with pytest.raises(LeaseConflictError, match=r"gpu:1's power limit is held by"):
                mon.set_power_limit(250, [1]).result(timeout=30)
            mon.set_power_limit(250, [0]).result(timeout=30)  # GPU 0 is free
            assert read_sim_node_state(CONFIG)[0].power_limit_w == 250.0

            rank1.kill()  # the agent sees it die and restores its lease
            rank1.wait(timeout=20)
            deadline = time.monotonic() + 10
            while read_sim_node_state(CONFIG)[1].power_limit_w != 700.0:
                assert time.monotonic() < deadline, read_sim_node_state(CONFIG)
                time.sleep(0.05)
            mon.set_power_limit(250, [1]).result(timeout=30)  # free now
        # Closing the monitor released its leases.
        assert [g.power_limit_w for g in read_sim_node_state(CONFIG)] == [700.0, 700.0]
    finally:
        if rank1.poll() is None:
            rank1.kill()
        rank1.communicate(timeout=20)
    # Agent stop: still running and clean.
    assert node_agent.poll() is None


@pytest.mark.slow
def test_attached_client_gets_its_gpus_checked_and_measured_alone(
    node_agent: subprocess.Popen[str],
) -> None:
    with pytest.raises(ConfigError, match=r"GPU index\(es\) \[5\] out of range: 2 GPU"):
        Monitor(gpu_indices=[5])
    with Monitor(gpu_indices=[1]) as mon:
        assert mon._process is not None and mon._process.attached
        assert mon.gpu_indices == [1] and [d.key for d in mon.gpu_devices] == ["gpu:1"]
        with mon.window("mine") as w:
            time.sleep(0.05)
        assert w.result is not None and set(w.result.methods) == {"gpu:1"}


@pytest.mark.slow
def test_agent_sigterm_restores_its_clients_settings(node_agent: subprocess.Popen[str]) -> None:
    with Monitor() as mon:
        mon.set_power_limit(400).result(timeout=30)
        mon.set_sm_clocks(1200, [0]).result(timeout=30)
        node_agent.send_signal(signal.SIGTERM)
        node_agent.wait(timeout=20)
        state = read_sim_node_state(CONFIG)
        assert all(g.is_default(CONFIG) for g in state), state


@pytest.mark.slow
def test_attached_client_sees_the_agent_die_and_restores(
    node_agent: subprocess.Popen[str],
) -> None:
    with Monitor() as mon:
        mon.set_power_limit(400).result(timeout=30)
        mon.set_sm_clocks(1200, [0]).result(timeout=30)
        mon.begin_window("in flight")
        node_agent.kill()  # SIGKILL: the agent restores nothing itself
        node_agent.wait(timeout=20)
        # The client notices at once (a pidfd), not at a timeout.
        deadline = time.monotonic() + 5
        with pytest.raises(RuntimeError, match=r"the agent \(pid \d+\) exited"):
            while time.monotonic() < deadline:
                mon.end_window("in flight").wait(timeout=1)
                mon.begin_window("in flight")
        # The client restored the dead agent's journal (no new agent needed).
        state = read_sim_node_state(CONFIG)
        assert all(g.is_default(CONFIG) for g in state), state
        with pytest.raises(RuntimeError, match="exited"):
            mon.begin_window("after")
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5  # closing does not wait for a goodbye from the dead


def test_bad_arguments_are_refused_in_the_callers_process(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        Monitor(backend="sim", cpu_indices=[], record=tmp_path / "missing" / "run.zarc")
    assert info.value.filename == str(tmp_path / "missing" / "run.zarc")
    with pytest.raises(IsADirectoryError):
        Monitor(backend="sim", cpu_indices=[], log_file=tmp_path)
    with Monitor(backend="sim", cpu_indices=[], sim_config=CONFIG) as mon:
        with pytest.raises(TypeError, match="window key must be a str"):
            mon.begin_window(123)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="outside the supported range"):
            mon.set_power_limit(5).result(timeout=30)
        with pytest.raises(ConfigError, match="SM clock"):
            mon.set_sm_clocks(-1).result(timeout=30)
        with mon.window("still fine") as w:
            pass
        assert set(w.result.gpu_energy) == {0, 1}  # the agent survived every bad call


def test_private_dir_is_checked(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    with pytest.raises(ConfigError, match="group or others"):
        ensure_private_dir(open_dir)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="symbolic link"):
        ensure_private_dir(link)
    fresh = ensure_private_dir(tmp_path / "fresh")
    assert fresh.stat().st_mode & 0o777 == 0o700
    if os.getuid() == 0:
        squatted = tmp_path / "squatted"
        squatted.mkdir(mode=0o700)
        os.chown(squatted, 65534, -1)  # made by another user first
        with pytest.raises(ConfigError, match="belongs to uid 65534"):
            ensure_private_dir(squatted)
