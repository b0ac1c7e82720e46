"""LiveTotals against the simulator's ground truth (fake clock, sim backend)."""

from __future__ import annotations

import anyio
import pytest

from zeus_async.aggregate import LiveTotals
from zeus_async.clock import FakeClock
from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_config import GpuOverride
from zeus_async.devices.sim_workload import RandomWorkload
from zeus_async.events import DeviceFault, Event, GpuSample, RaplSample
from zeus_async.runtime import Runtime
from zeus_async.testing import sim_pynvml

pytestmark = pytest.mark.anyio


async def test_counter_plus_interpolation_matches_ground_truth() -> None:
    clock = FakeClock(wall_start_ns=1_750_000_000_123_456_789)
    config = SimConfig(
        num_gpus=3,
        workload=RandomWorkload(seg_min_s=0.05, seg_max_s=0.4),
        gpus=(GpuOverride(), GpuOverride(), GpuOverride(pre_volta=True)),
        seed=3,
    )
    totals = LiveTotals()

    async def consume(stream: anyio.abc.ObjectReceiveStream[Event]) -> None:
        async for e in stream:
            totals.add(e)

    try:
        async with Runtime(
            backend="sim", cpus=None, sim_config=config, clock=clock, consumers=[consume]
        ) as rt:
            await clock.sleep_until(clock.monotonic_ns() + 10_345_000_000)
            node = sim_pynvml.current_node()
    finally:
        sim_pynvml.uninstall()
    for gpu in range(3):
        t = totals.devices[f"gpu:{gpu}"]
        assert t.first_t_ns is not None and t.last_t_ns is not None
        truth = node.truth_energy_j(gpu, t.first_t_ns, t.last_t_ns)
        assert t.energy_j is not None
        err = abs(t.energy_j - truth) / truth
        if gpu < 2:
            # The counter's updates inside the span, power samples for the partial counter
            # periods at its ends.
            assert t.method == "counter+extrapolated"
            assert err < 0.001, (gpu, t.energy_j, truth)
        else:
            assert t.method == "integrated"  # pre-Volta: no counter
            assert err < 0.05, (gpu, t.energy_j, truth)
    assert rt.backend == "sim"


def test_short_span_is_never_zero() -> None:
    # Two samples 20 ms apart inside one 100 ms counter period: counter unchanged.
    totals = LiveTotals()
    totals.add(GpuSample("h", 0, 0, power_w=300.0, energy_j=1000.0))
    totals.add(GpuSample("h", 20_000_000, 0, power_w=300.0, energy_j=1000.0))
    t = totals.devices["gpu:0"]
    assert t.method == "integrated"
    assert t.energy_j == pytest.approx(6.0)


def test_counter_updates_with_interpolated_ends() -> None:
    totals = LiveTotals()
    # Power 100 W throughout; the counter moves at 50 ms (+5 J) and 150 ms (+10 J).
    seq = [(0, 0.0), (40, 0.0), (60, 5.0), (140, 5.0), (160, 15.0), (200, 15.0)]
    for ms, e in seq:
        totals.add(GpuSample("h", ms * 1_000_000, 0, power_w=100.0, energy_j=e))
    t = totals.devices["gpu:0"]
    # Only two updates: no cadence to size the first period, so the ends are integrated:
    # 5 J up to the first update (seen between 40 and 60 ms), 10 J counted, 5 J after 150 ms.
    assert t.method == "counter+extrapolated"
    assert t.energy_j == pytest.approx(5.0 + 10.0 + 5.0)


def test_first_counter_period_is_apportioned_by_time() -> None:
    totals = LiveTotals()
    # The counter updates every 100 ms, at 95, 195, 295 and 395 ms (+20 J each: 200 W); the
    # first reading, at 0 ms, shows the value of the update at -5 ms. Until the first update
    # the power reading is stale (500 W, the period before), as on H100s. The first period,
    # (-5, 95], is taken from the counter in proportion to time, not from that reading.
    for ms in range(0, 401, 10):
        energy = 100.0 + 20.0 * sum(1 for u in (95, 195, 295, 395) if u < ms)
        power = 500.0 if ms < 100 else 200.0
        totals.add(GpuSample("h", ms * 1_000_000, 0, power_w=power, energy_j=energy))
    t = totals.devices["gpu:0"]
    # 19 J of the first period, 60 J counted, 1 J after the last update (395 ms).
    assert t.energy_j == pytest.approx(19.0 + 60.0 + 1.0)
    assert t.method == "counter+extrapolated"
    assert t.duration_s == pytest.approx(0.4)


def test_rapl_and_faults() -> None:
    totals = LiveTotals()
    totals.add(RaplSample("h", 0, 0, "package", 0.0))
    totals.add(RaplSample("h", 10_000_000, 0, "package", 0.5, power_w=50.0))
    totals.add(RaplSample("h", 20_000_000, 0, "dram", 0.0))
    totals.add(DeviceFault("h", 30_000_000, "cpu:0", "no_permission", "denied"))
    pkg = totals.devices["cpu:0/package"]
    assert pkg.energy_j == pytest.approx(0.5) and pkg.method == "counter+interpolated"
    assert pkg.fault == "no_permission" and totals.devices["cpu:0/dram"].fault == "no_permission"
    totals.add(DeviceFault("h", 1, "gpu:5", "gpu_lost", "gone"))
    assert totals.devices["gpu:5"].fault == "gpu_lost"
    assert totals.devices["gpu:5"].energy_j is None


def test_hosts_are_part_of_a_devices_identity() -> None:
    # Two hosts' gpu:0 through one proxy: two devices, not one with interleaved samples.
    totals = LiveTotals()
    t0 = 1_700_000_000_000_000_000
    for k in range(101):  # 1 s: node1 at 100 W, node2 at 300 W
        totals.add(GpuSample("node1", t0 + k * 10_000_000, 0, power_w=100.0))
        totals.add(GpuSample("node2", t0 + k * 10_000_000 + 1, 0, power_w=300.0))
    devices = totals.devices
    assert sorted(devices) == ["gpu:0@node1", "gpu:0@node2"]
    assert devices["gpu:0@node1"].energy_j == pytest.approx(100.0)
    assert devices["gpu:0@node2"].energy_j == pytest.approx(300.0)
    assert devices["gpu:0@node1"].dropped == 0
    totals.add(DeviceFault("node2", t0 + 2 * 10**9, "gpu:0", "gpu_lost", "gone"))
    assert totals.devices["gpu:0@node2"].fault == "gpu_lost"
    assert totals.devices["gpu:0@node1"].fault is None
    single = LiveTotals()
    single.add(GpuSample("node1", t0, 0, power_w=100.0))
    assert list(single.devices) == ["gpu:0"]  # one host: bare keys


def test_devices_are_listed_in_one_order() -> None:
    # The order of every table (inspect, monitor, replay): GPUs by number, then CPU domains;
    # one device of several hosts together.
    totals = LiveTotals()
    for host in ("b", "a"):
        for gpu in (10, 2):
            totals.add(GpuSample(host, 0, gpu, power_w=1.0))
        totals.add(RaplSample(host, 0, 0, "package", 0.0))
    assert list(totals.devices) == [
        "gpu:2@a",
        "gpu:2@b",
        "gpu:10@a",
        "gpu:10@b",
        "cpu:0/package@a",
        "cpu:0/package@b",
    ]
