"""Per-call NVML costs in the simulator, as measured on a real H100 (driver 580.159.04):
the energy counter's CPU, the power-limit read, set latencies and the SM clock's settling."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.devices.sim_config import H100_DRIVER_580_COSTS, sim_preset
from zeus_async.devices.sim_workload import ConstantWorkload
from zeus_async.testing import _sim_nvml_base as _b
from zeus_async.testing import sim_pynvml

NS = 1_000_000_000
MS = 1_000_000
T0 = 1_760_000_000_000_000_000


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    sim_pynvml.uninstall()


def _handle(config: SimConfig, clock: FakeClock | None = None) -> Any:
    sim_pynvml.install(SimNode(config, clock or FakeClock(wall_start_ns=T0), shared_state=False))
    sim_pynvml.nvmlInit()
    return sim_pynvml.nvmlDeviceGetHandleByIndex(0)


def _cpu_ns(fn: Callable[[], Any], n: int = 5) -> float:
    """CPU of this thread per call (the burn releases the GIL but runs on this thread)."""
    start = time.thread_time_ns()
    for _ in range(n):
        fn()
    return (time.thread_time_ns() - start) / n


def test_defaults_cost_nothing_and_the_profile_holds_the_measured_figures() -> None:
    cfg = SimConfig()
    assert (
        cfg.energy_call_latency_s,
        cfg.power_limit_call_latency_s,
        cfg.set_power_limit_latency_s,
        cfg.clock_settle_s,
    ) == (0.0, 0.0, 0.0, 0.0)
    assert H100_DRIVER_580_COSTS == {
        "call_latency_s": 4e-6,
        "energy_call_latency_s": 3.84e-3,
        "power_limit_call_latency_s": 146e-6,
        "set_power_limit_latency_s": 9e-3,
        "set_clock_latency_s": 11e-3,
        "clock_settle_s": 20e-3,
    }
    profiled = sim_preset("nvidia", **H100_DRIVER_580_COSTS)
    assert profiled.energy_call_latency_s == 3.84e-3 and profiled.clock_settle_s == 0.02


def test_energy_reads_burn_the_energy_cost_and_power_reads_do_not() -> None:
    h = _handle(SimConfig(num_gpus=1, energy_call_latency_s=0.004))
    energy = _cpu_ns(lambda: sim_pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
    field = _cpu_ns(lambda: sim_pynvml.nvmlDeviceGetFieldValues(h, [_b.FI_TOTAL_ENERGY]))
    both = _cpu_ns(  # one charge per call, whatever the number of energy ids
        lambda: sim_pynvml.nvmlDeviceGetFieldValues(
            h, [(_b.FI_POWER_INSTANT, 0), _b.FI_TOTAL_ENERGY, _b.FI_ENERGY]
        )
    )
    power = _cpu_ns(lambda: sim_pynvml.nvmlDeviceGetFieldValues(h, [(_b.FI_POWER_INSTANT, 0)]))
    usage = _cpu_ns(lambda: sim_pynvml.nvmlDeviceGetPowerUsage(h))
    # Busy-waiting on the wall clock: this thread's CPU is that, less what a loaded machine
    # gave to other processes meanwhile.
    for cost in (energy, field, both):
        assert 2.8 * MS <= cost < 12 * MS
    assert power < 1 * MS and usage < 1 * MS


def test_energy_reads_are_free_by_default() -> None:
    h = _handle(SimConfig(num_gpus=1))
    assert _cpu_ns(lambda: sim_pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) < 1 * MS


def test_power_limit_read_cost() -> None:
    h = _handle(SimConfig(num_gpus=1, power_limit_call_latency_s=0.003))
    cost = _cpu_ns(lambda: sim_pynvml.nvmlDeviceGetPowerManagementLimit(h))
    assert 2.1 * MS <= cost < 9 * MS
    assert _cpu_ns(lambda: sim_pynvml.nvmlDeviceGetEnforcedPowerLimit(h)) < 1 * MS  # unmeasured


def test_setting_the_power_limit_blocks_for_its_latency() -> None:
    h = _handle(SimConfig(num_gpus=1, set_power_limit_latency_s=0.03))
    start = time.perf_counter_ns()
    sim_pynvml.nvmlDeviceSetPowerManagementLimit(h, 300_000)
    assert time.perf_counter_ns() - start >= 30 * MS
    assert sim_pynvml.nvmlDeviceGetPowerManagementLimit(h) == 300_000  # in force on return


def test_the_sm_clock_settles_after_the_lock_call_returns() -> None:
    clock = FakeClock(wall_start_ns=T0)
    cfg = SimConfig(num_gpus=1, workload=ConstantWorkload(util=1.0), clock_settle_s=0.02)
    h = _handle(cfg, clock)
    assert sim_pynvml.nvmlDeviceGetClockInfo(h, 1) == 1980
    sim_pynvml.nvmlDeviceSetGpuLockedClocks(h, 990, 990)
    assert sim_pynvml.nvmlDeviceGetClockInfo(h, 1) == 1980  # not yet
    clock.advance_sync(0.019)
    assert sim_pynvml.nvmlDeviceGetClockInfo(h, 1) == 1980
    clock.advance_sync(0.001)
    assert sim_pynvml.nvmlDeviceGetClockInfo(h, 1) == 990  # 20 ms after the call returned
    node = sim_pynvml.current_node()
    assert node is not None  # the power follows the clock: full power until it settled
    assert node.truth_power_w(0, T0 + 19 * MS) == pytest.approx(700.0)
    assert node.truth_power_w(0, T0 + 20 * MS) < 200.0


def test_without_settling_the_lock_is_read_at_once() -> None:
    clock = FakeClock(wall_start_ns=T0)
    h = _handle(SimConfig(num_gpus=1, workload=ConstantWorkload(util=1.0)), clock)
    sim_pynvml.nvmlDeviceSetGpuLockedClocks(h, 990, 990)
    assert sim_pynvml.nvmlDeviceGetClockInfo(h, 1) == 990
