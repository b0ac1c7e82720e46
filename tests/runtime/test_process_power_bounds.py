"""Attributed GPU power never exceeds the GPU's power (issue 34: a 0 % SM process got 316 W on
a GPU drawing 69 W; six processes on three idle GPUs summed to 754 W while the GPUs drew 207 W).
"""

from __future__ import annotations

from collections import defaultdict

import anyio
import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices.base import GpuProcesses
from zeus_async.devices.processes import HostStat
from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload
from zeus_async.events import GpuSample, ProcessSample
from zeus_async.runtime import ProcessTracking, Runtime
from zeus_async.runtime.processes import EnergyMeter, ProcessAttributor
from zeus_async.testing.fakes import FakeProcessSource

GIB = 1 << 30
MS = 1_000_000
S = 1_000_000_000
T0 = 1_760_000_000 * S
HOST = HostStat(0.0, 1, GIB, GIB)


def test_power_is_the_gpus_reported_power_not_counter_steps_over_read_to_read_time() -> None:
    """An idle 69 W GPU read as adaptive reads do (only the two ticks before each 100 ms counter
    refresh and the one that shows it), attributed every 50 ms just after a read: the counter's
    increase over the read-to-read time gave its one process 690 W and 0 W in turn."""
    meter = EnergyMeter()
    att = ProcessAttributor("h")
    reading = GpuProcesses({7: GIB}, {}, 0)  # idle: the only process gets all of it
    powers: list[float | None] = []
    for tick in range(200):  # 10 ms ticks
        t = T0 + tick * 10 * MS
        if tick % 10 in (8, 9, 0):
            meter.add(GpuSample("h", t, 0, power_w=69.0, energy_j=6.9 * (tick // 10)))
        if tick % 5 == 4:  # the process sampler, 1 ms after the reads at 40 and 90 ms
            (sample,) = att.tick(t + MS, HOST, {}, {0: reading}, {7}, meter.snapshot())
            powers.append(sample.attributed_power_w)
    assert max(p for p in powers if p is not None) <= 69.0 * (1 + 1e-12)  # was 690 W
    assert powers[0] is None  # the pair's first sample
    assert powers[1:] == [pytest.approx(69.0, rel=1e-12)] * (len(powers) - 1)
    # the energy still comes from the counter: every joule it counted after the first tick
    assert sample.attributed_energy_j == pytest.approx(6.9 * 19)
    assert len(powers) == 40


def test_shares_on_an_idle_gpu_add_up_to_at_most_one() -> None:
    """One process whose memory the driver does not report took an equal share on top of the
    memory shares of the others (1/2 + 1/3 + 1/2 of the GPU)."""
    att = ProcessAttributor("h")
    reading = GpuProcesses({1: GIB, 2: None, 99: GIB}, {}, 0)
    att.tick(T0, HOST, {}, {0: reading}, {1, 2, 99}, {("gpu", 0): (T0, 0.0)})
    out = att.tick(T0 + S, HOST, {}, {0: reading}, {1, 2, 99}, {("gpu", 0): (T0 + S, 90.0)})
    assert [s.gpu_power_share_frac for s in out] == [pytest.approx(1 / 3)] * 3
    assert [s.attributed_power_w for s in out] == [pytest.approx(30.0)] * 3
    assert sum(s.attributed_energy_j or 0.0 for s in out) == pytest.approx(90.0)


def test_a_process_at_0_percent_sm_on_a_busy_gpu_gets_nothing() -> None:
    att = ProcessAttributor("h")
    reading = GpuProcesses({1: 8 * GIB, 2: GIB}, {2: 0.4}, 0)  # 1 holds memory, 2 computes
    att.tick(T0, HOST, {}, {0: reading}, {1, 2}, {("gpu", 0): (T0, 0.0)})
    out = att.tick(T0 + S, HOST, {}, {0: reading}, {1, 2}, {("gpu", 0): (T0 + S, 300.0)})
    assert [(s.pid, s.attributed_power_w) for s in out] == [(1, 0.0), (2, 300.0)]


@pytest.mark.anyio
async def test_idle_simulated_gpus_with_adaptive_reads_never_attribute_more_than_they_draw() -> (
    None
):
    """The measured case, end to end: three idle simulated GPUs, two processes on each, the
    default 10 ms sampling with adaptive reads and a 50 ms process period."""
    clock = FakeClock(wall_start_ns=T0)
    sim = SimConfig(num_gpus=3, workload=ConstantWorkload(util=0.0))
    samples: list[ProcessSample] = []
    gpu_power: dict[int, set[float]] = defaultdict(set)

    async def consumer(stream: anyio.abc.ObjectReceiveStream[object]) -> None:
        async for event in stream:
            if isinstance(event, ProcessSample) and event.gpu is not None:
                samples.append(event)
            elif isinstance(event, GpuSample) and event.power_w is not None:
                gpu_power[event.gpu].add(event.power_w)

    tracking = ProcessTracking(pids=(), gpu_all=True, period_s=0.05)
    async with Runtime(backend="sim", cpus=None, clock=clock, sim_config=sim, host="h",
                       adaptive_reads=True, processes=tracking,
                       process_source=FakeProcessSource(stats={}),
                       consumers=[consumer]):  # fmt: skip
        while len({s.t_ns for s in samples}) < 60:
            await anyio.sleep(0)  # the fake clock jumps whenever every task waits on it
    assert dict(gpu_power) == {0: {70.0}, 1: {70.0}, 2: {70.0}}  # the idle power, steady
    per_gpu: dict[tuple[int, int], list[float]] = defaultdict(list)
    for s in samples:
        if s.attributed_power_w is not None:
            assert s.gpu_sm_frac == 0.0
            per_gpu[(s.t_ns, s.gpu or 0)].append(s.attributed_power_w)
    assert max(sum(watts) for watts in per_gpu.values()) <= 70.0 * (1 + 1e-12)  # was 700 W
    for watts in per_gpu.values():
        assert len(watts) == 2 and max(watts) < 70.0
        assert sum(watts) == pytest.approx(70.0, rel=1e-12)
    assert len(per_gpu) >= 3 * 59  # every GPU in every period but the pairs' first
