"""Node-wide settable state of the simulator: shared by processes, outliving them, like a driver.

Most tests run real processes (``python -c``); they inherit the test's fresh ``ZEUS_ASYNC_DIR``
(tests/conftest.py), so the state never leaks between tests.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices import sim_state
from zeus_async.devices.sim import ConstantWorkload, GpuOverride, SimConfig, SimNode
from zeus_async.errors import ConfigError
from zeus_async.testing import (
    SimGpuState,
    read_sim_node_state,
    reset_sim_node_state,
    sim_node_state_path,
    sim_pynvml,
)

NS = 1_000_000_000
E0 = 1_700_000_000 * NS

CONFIG = SimConfig(num_gpus=4, seed=5, workload=ConstantWorkload(util=1.0))


def run_python(code: str, config: SimConfig = CONFIG, timeout: float = 60.0) -> str:
    """Run ``code`` in a fresh interpreter simulating ``config``; its stdout."""
    env = {**os.environ, **sim_pynvml.shim_env(config)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def popen_python(code: str, *args: str, config: SimConfig = CONFIG) -> subprocess.Popen[str]:
    """Start ``code`` in a fresh interpreter simulating ``config`` (pipes for stdin and out)."""
    env = {**os.environ, **sim_pynvml.shim_env(config)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


SET_THROUGH_NVML = """
    import pynvml
    pynvml.nvmlInit()
    h0, h2 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(2)
    pynvml.nvmlDeviceSetPowerManagementLimit(h0, 300_000)
    pynvml.nvmlDeviceSetGpuLockedClocks(h2, 990, 1500)
    pynvml.nvmlDeviceSetPersistenceMode(h2, 0)
    pynvml.nvmlShutdown()
"""

READ_THROUGH_NVML = """
    import json
    import pynvml
    from zeus_async.testing import sim_pynvml
    pynvml.nvmlInit()
    node = sim_pynvml.current_node()
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        out.append([
            pynvml.nvmlDeviceGetPowerManagementLimit(h),
            node.gpus[i].locked_sm_clocks_mhz,
            pynvml.nvmlDeviceGetPersistenceMode(h),
        ])
    print(json.dumps(out))
"""


def read_in_fresh_process(config: SimConfig = CONFIG) -> list[list[object]]:
    out: list[list[object]] = json.loads(run_python(READ_THROUGH_NVML, config))
    return out


# -- state outlives the process that set it ---------------------------------------------------


@pytest.mark.slow
def test_settings_outlive_the_process_that_made_them(monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_in_fresh_process() == [[700_000, None, 1]] * 4
    run_python(SET_THROUGH_NVML)  # exits before anything reads
    assert read_in_fresh_process() == [
        [300_000, None, 1],
        [700_000, None, 1],
        [700_000, [990, 1500], 0],
        [700_000, None, 1],
    ]
    states = read_sim_node_state(CONFIG)
    assert [
        (s.gpu, s.power_limit_w, s.locked_sm_clocks_mhz, s.persistence_mode) for s in states
    ] == [
        (0, 300.0, None, True),
        (1, 700.0, None, True),
        (2, 700.0, (990, 1500), False),
        (3, 700.0, None, True),
    ]
    assert [s.is_default(CONFIG) for s in states] == [False, True, False, True]
    assert states[1].changed_ns is None and states[3].changed_ns is None
    now = time.time_ns()
    assert states[0].changed_ns is not None and now - 60 * NS < states[0].changed_ns <= now
    # The default config comes from ZEUS_ASYNC_SIM, as in SimNode.from_env, else SimConfig().
    monkeypatch.setenv("ZEUS_ASYNC_SIM", CONFIG.to_json())
    assert read_sim_node_state() == states
    monkeypatch.delenv("ZEUS_ASYNC_SIM")
    assert read_sim_node_state() == [SimGpuState(i, 700.0, None, True, None) for i in range(4)]


@pytest.mark.slow
def test_restoring_in_one_process_is_seen_by_the_next() -> None:
    run_python(SET_THROUGH_NVML)
    run_python(
        """
        import pynvml
        pynvml.nvmlInit()
        h0, h2 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(2)
        pynvml.nvmlDeviceSetPowerManagementLimit(
            h0, pynvml.nvmlDeviceGetPowerManagementDefaultLimit(h0))
        pynvml.nvmlDeviceResetGpuLockedClocks(h2)
        pynvml.nvmlDeviceSetPersistenceMode(h2, 1)
        """
    )
    assert read_in_fresh_process() == [[700_000, None, 1]] * 4
    assert all(s.is_default(CONFIG) for s in read_sim_node_state(CONFIG))


@pytest.mark.slow
def test_reset_puts_the_defaults_back_for_new_and_running_processes() -> None:
    run_python(SET_THROUGH_NVML)
    node = SimNode(CONFIG)  # a simulator already running when the reset happens
    assert node.gpus[0].power_limit_w == 300.0 and not node.gpus[2].persistence_mode
    reset_sim_node_state(CONFIG)
    assert read_sim_node_state(CONFIG) == [
        SimGpuState(i, 700.0, None, True, None) for i in range(4)
    ]
    assert read_in_fresh_process() == [[700_000, None, 1]] * 4
    assert node.gpus[0].power_limit_w == 700.0
    assert node.gpus[2].locked_sm_clocks_mhz is None and node.gpus[2].persistence_mode
    # and a change after the reset is seen again
    node.gpus[1].set_power_limit_w(450.0)
    assert read_in_fresh_process()[1] == [450_000, None, 1]


# -- concurrency ------------------------------------------------------------------------------

HAMMER = """
    import sys
    from zeus_async.devices.sim import SimNode
    gpu = int(sys.argv[1])
    node = SimNode.from_env()
    g = node.gpus[gpu]
    sys.stdin.readline()  # start together
    bad = 0
    for k in range(150):
        watts = 200.0 + gpu * 100 + k
        g.set_power_limit_w(watts)
        g.lock_sm_clocks_mhz(345 + 10 * k, 1980)
        # nobody else sets this GPU: any other value means a write lost ours
        if g.power_limit_w != watts or g.locked_sm_clocks_mhz != (345 + 10 * k, 1980):
            bad += 1
    print(bad)
"""


@pytest.mark.slow
def test_concurrent_changes_to_different_gpus_are_all_kept() -> None:
    procs = [popen_python(HAMMER, str(gpu)) for gpu in (0, 1, 3)]
    time.sleep(1.0)  # let all three import and build their nodes
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "0"
    states = read_sim_node_state(CONFIG)
    assert [s.power_limit_w for s in states] == [349.0, 449.0, 700.0, 649.0]
    lock = (345 + 10 * 149, 1980)
    assert [s.locked_sm_clocks_mhz for s in states] == [lock, lock, None, lock]


# -- a running process sees another process's change ------------------------------------------

WATCH = """
    import json, sys, time
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    before = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_POWER_INSTANT])[0].value.uiVal
    energy = [pynvml.nvmlDeviceGetTotalEnergyConsumption(h)]
    print(json.dumps({"ready": before}), flush=True)
    sys.stdin.readline()  # the limit has been set
    t0 = time.monotonic()
    after = before
    while time.monotonic() - t0 < 10.0:
        energy.append(pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
        f = pynvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_POWER_INSTANT])[0]
        after = f.value.uiVal
        if after <= 300_000:
            break
        time.sleep(0.001)
    waited = time.monotonic() - t0
    limit = pynvml.nvmlDeviceGetPowerManagementLimit(h)
    monotonic = all(a <= b for a, b in zip(energy, energy[1:]))
    print(json.dumps({"after": after, "waited": waited, "limit": limit, "monotonic": monotonic}))
"""


@pytest.mark.slow
def test_a_running_process_sees_another_process_lower_the_limit() -> None:
    watcher = popen_python(WATCH)
    assert watcher.stdout is not None and watcher.stdin is not None
    try:
        ready = json.loads(watcher.stdout.readline() or "{}")
        assert ready == {"ready": 700_000}  # full utilization, uncapped
        run_python(
            """
            import pynvml
            pynvml.nvmlInit()
            pynvml.nvmlDeviceSetPowerManagementLimit(pynvml.nvmlDeviceGetHandleByIndex(0), 300_000)
            """
        )
        watcher.stdin.write("set\n")
        watcher.stdin.flush()
        out, err = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate()
    assert watcher.returncode == 0, err
    result = json.loads(out)
    assert result["limit"] == 300_000
    assert result["after"] <= 300_000  # the power drops under the new limit...
    # ...within a look at the file (50 ms) and an instant-power update (100 ms), plus slack
    assert result["waited"] < 2.0
    assert result["monotonic"]  # the energy counter never went back


# -- in-process behaviour ----------------------------------------------------------------------

FAKE = SimConfig(num_gpus=2, epoch_ns=E0, counter_origin_ns=E0, workload=ConstantWorkload(util=1.0))


def test_nodes_of_one_config_share_state_in_a_process_too() -> None:
    a = SimNode(FAKE, FakeClock(E0))
    b = SimNode(FAKE, FakeClock(E0))
    a.gpus[1].set_power_limit_w(250.0)
    assert b.gpus[1].power_limit_w == 250.0  # a setting read looks at the file every time
    assert b.gpus[0].power_limit_w == 700.0
    c = SimNode(FAKE, FakeClock(E0))  # a new node starts from the node state
    assert c.gpus[1].power_limit_w == 250.0
    other = SimNode(msgspec.structs.replace(FAKE, seed=1), FakeClock(E0))  # another node
    assert other.gpus[1].power_limit_w == 700.0
    assert other.state_path != a.state_path


def test_without_shared_state_settings_stay_in_the_node() -> None:
    a = SimNode(FAKE, FakeClock(E0), shared_state=False)
    a.gpus[0].set_power_limit_w(250.0)
    a.gpus[0].set_persistence_mode(False)
    assert a.state_path is None
    assert (a.gpus[0].power_limit_w, a.gpus[0].persistence_mode) == (250.0, False)
    assert SimNode(FAKE, FakeClock(E0)).gpus[0].power_limit_w == 700.0
    assert not sim_node_state_path(FAKE).exists()


def test_a_shim_child_with_a_pinned_origin_shares_the_parent_node_state() -> None:
    parent = SimNode(SimConfig(num_gpus=1))  # counter origin left to the node (None)
    with sim_pynvml.patched_pynvml(parent):
        child_cfg = SimConfig.from_json(sim_pynvml.shim_env()["ZEUS_ASYNC_SIM"])
    assert child_cfg.counter_origin_ns == parent.counter_origin_ns
    assert sim_node_state_path(child_cfg) == parent.state_path


def test_a_change_elsewhere_is_dated_at_its_time_but_after_what_was_reported() -> None:
    clock_a, clock_b = FakeClock(E0), FakeClock(E0)
    a, b = SimNode(FAKE, clock_a), SimNode(FAKE, clock_b)
    # b has reported the energy counter at 10 s; a lowers the limit, dated 5 s
    clock_a.advance_sync(20.0)
    clock_b.advance_sync(20.0)
    reported = b.gpus[0].energy_counter_mj(E0 + 10 * NS)
    a.gpus[0].set_power_limit_w(300.0, t_ns=E0 + 5 * NS)
    a.gpus[1].set_power_limit_w(300.0, t_ns=E0 + 5 * NS)
    assert b.gpus[0].power_limit_w == 300.0
    assert b.gpus[0].energy_counter_mj(E0 + 10 * NS) == reported == 7_000_000  # not rewritten
    assert b.truth_power_w(0, E0 + 9 * NS) == 700.0
    assert b.truth_power_w(0, E0 + 10 * NS) == 300.0
    # what b never reported on takes the change at the time it was made: GPU 1 matches a
    assert b.truth_energy_j(1, E0, E0 + 20 * NS) == a.truth_energy_j(1, E0, E0 + 20 * NS)
    assert b.truth_power_w(1, E0 + 5 * NS) == 300.0
    # a change dated in b's future takes effect at b's now
    clock_a.advance_sync(100.0)
    a.gpus[1].set_power_limit_w(400.0)
    assert b.gpus[1].power_limit_w == 400.0
    assert b.truth_power_w(1, E0 + 20 * NS) == 400.0


def test_the_read_path_looks_at_the_file_at_most_every_50_ms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = SimNode(FAKE, FakeClock(E0))
    calls = []
    real = sim_state.NodeStateFile.stat_key

    def counting(self: sim_state.NodeStateFile) -> sim_state.FileKey:
        calls.append(time.monotonic())
        return real(self)

    monkeypatch.setattr(sim_state.NodeStateFile, "stat_key", counting)
    gpu = node.gpus[0]
    start = time.monotonic()
    reads = 0
    while time.monotonic() - start < 0.3:
        gpu.energy_counter_mj(E0 + reads * 1000)
        gpu.instant_power_mw(E0)
        gpu.sm_clock_mhz(E0)
        node.truth_power_w(0, E0)
        reads += 4
    assert reads > 1000
    assert 1 <= len(calls) <= 0.3 / 0.05 + 2
    assert all(b - a >= 0.049 for a, b in itertools.pairwise(calls))


def test_persistence_is_a_method_and_nvml_sets_it_node_wide() -> None:
    node = SimNode(FAKE, FakeClock(E0))
    with sim_pynvml.patched_pynvml(node) as nv:
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(1)
        nv.nvmlDeviceSetPersistenceMode(h, 0)
        assert nv.nvmlDeviceGetPersistenceMode(h) == 0
    with pytest.raises(AttributeError):
        node.gpus[1].persistence_mode = True  # type: ignore[misc]
    assert [s.persistence_mode for s in read_sim_node_state(FAKE)] == [True, False]


def test_stored_values_are_clamped_to_the_config(caplog: pytest.LogCaptureFixture) -> None:
    path = sim_node_state_path(FAKE)
    gpus = {
        0: {"power_limit_w": 9999.0, "locked_sm_clock_min_mhz": 1, "locked_sm_clock_max_mhz": 9999,
            "persistence_mode": False, "changed_ns": E0},
        1: {"power_limit_w": 1.0, "locked_sm_clock_min_mhz": 1500, "locked_sm_clock_max_mhz": 900,
            "persistence_mode": True, "changed_ns": E0},
    }  # fmt: skip
    path.write_text(json.dumps({"version": 1, "gpus": gpus}))
    node = SimNode(FAKE, FakeClock(E0 + NS))
    assert node.gpus[0].power_limit_w == 700.0
    assert node.gpus[0].locked_sm_clocks_mhz == (345, 1980)
    assert node.gpus[1].power_limit_w == 200.0
    assert node.gpus[1].locked_sm_clocks_mhz is None  # a reversed range is no lock
    # an unreadable file counts as the defaults, with one warning; the next set replaces it
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="zeus_async.devices.sim_state"):
        assert node.gpus[0].power_limit_w == 700.0
        assert node.gpus[1].power_limit_w == 700.0
        assert read_sim_node_state(FAKE)[0].power_limit_w == 700.0
    assert sum("cannot decode" in r.message for r in caplog.records) == 2  # node + reader
    node.gpus[1].set_power_limit_w(333.0)
    assert [s.power_limit_w for s in read_sim_node_state(FAKE)] == [700.0, 333.0]
    path.write_text(json.dumps({"version": 99, "gpus": {}}))
    with caplog.at_level(logging.WARNING, logger="zeus_async.devices.sim_state"):
        assert node.gpus[1].power_limit_w == 700.0
    assert any("format version 99" in r.message for r in caplog.records)


def test_no_permission_and_unsupported_gpus_are_never_written() -> None:
    cfg = SimConfig(num_gpus=2, gpus=(GpuOverride(no_permission=True),))
    node = SimNode(cfg, FakeClock(E0))
    with sim_pynvml.patched_pynvml(node) as nv:
        nv.nvmlInit()
        with pytest.raises(nv.NVMLError_NoPermission):
            nv.nvmlDeviceSetPowerManagementLimit(nv.nvmlDeviceGetHandleByIndex(0), 300_000)
    assert not sim_node_state_path(cfg).exists()


# -- the state directory -----------------------------------------------------------------------


def test_the_state_lives_in_a_private_directory(private_dir: Path) -> None:
    node = SimNode(FAKE, FakeClock(E0))
    node.gpus[0].set_power_limit_w(300.0)
    path = node.state_path
    assert path is not None and path.parent == private_dir / "sim"
    assert path.name == f"node-{sim_state.node_key(FAKE)}.json"
    assert len(sim_state.node_key(FAKE)) == 16
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    for p in (path, path.with_suffix(".lock")):
        assert stat.S_IMODE(os.stat(p).st_mode) & 0o077 == 0
    assert sorted(p.name for p in path.parent.iterdir()) == [
        path.name,
        path.with_suffix(".lock").name,
    ]


def test_a_sim_directory_open_to_others_is_refused(private_dir: Path) -> None:
    (private_dir / "sim").mkdir(mode=0o700)
    os.chmod(private_dir / "sim", 0o755)
    with pytest.raises(ConfigError, match="mode 755"):
        SimNode(FAKE, FakeClock(E0))
    SimNode(FAKE, FakeClock(E0), shared_state=False)  # needs no directory


def test_each_version_of_the_file_has_a_new_key(tmp_path: Path) -> None:
    """Readers compare ``(inode, mtime, size)``: a freed inode is reused at once and mtimes tick
    every few ms, so the writer must move the mtime forward itself."""
    sf = sim_state.NodeStateFile(FAKE, tmp_path)
    state = sim_state.NodeState(gpus={0: sim_state.GpuState(
        power_limit_w=300.0, persistence_mode=True, changed_ns=0)})  # fmt: skip
    keys = []
    with sf.locked():
        for _ in range(200):
            keys.append(sf.write(state))  # same size every time
            assert sf.stat_key() == keys[-1]
    assert len(set(keys)) == len(keys)
    assert all(a[1] < b[1] for a, b in itertools.pairwise(keys))
