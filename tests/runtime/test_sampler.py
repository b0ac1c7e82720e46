"""Sampler cadence, per-field periods, late reads, faults — all under a fake clock."""

from __future__ import annotations

import anyio
import pytest

from zeus_async.clock import FakeClock
from zeus_async.errors import ConfigError, DeviceLostError
from zeus_async.events import DeviceFault, Event, GpuSample, StreamInfo
from zeus_async.runtime import Hub, Runtime, Sampler
from zeus_async.runtime.sampler import field_ratios
from zeus_async.testing.fakes import ScriptedGpu

pytestmark = pytest.mark.anyio

MS = 1_000_000


async def run_for(clock: FakeClock, seconds: float, *samplers: Sampler) -> None:
    async with anyio.create_task_group() as tg:
        for s in samplers:
            await tg.start(s.run)
        await clock.sleep_until(clock.monotonic_ns() + round(seconds * 1e9))
        tg.cancel_scope.cancel()


async def test_cadence_is_on_a_drift_free_grid() -> None:
    clock = FakeClock()
    events: list[Event] = []

    async def publish(e: Event) -> None:
        events.append(e)

    gpu = ScriptedGpu(0, clock)
    sampler = Sampler(gpu, publish, clock, host="h", period_s=0.01, fields={"power_w": None})
    await run_for(clock, 1.005, sampler)
    times = [t for t, _ in gpu.reads]
    assert len(times) == 101
    # Reads at 0, 10, ..., 1000 ms: exactly on the grid, never drifting.
    assert times[:101] == [k * 10 * MS for k in range(101)]
    assert sampler.stats.missed_ticks == 0
    assert all(isinstance(e, GpuSample) and e.power_w == 100.0 for e in events)
    walls = [e.t_ns for e in events]
    assert walls[1] - walls[0] == 10 * MS


async def test_per_field_periods() -> None:
    clock = FakeClock()

    async def publish(e: Event) -> None:
        pass

    gpu = ScriptedGpu(0, clock)
    sampler = Sampler(
        gpu,
        publish,
        clock,
        host="h",
        period_s=0.01,
        fields={"power_w": None, "energy_j": 0.02, "temperature_c": 0.05, "unknown": 1.0},
    )
    await run_for(clock, 0.099, sampler)
    assert [f for _, f in gpu.reads] == [
        ("power_w", "energy_j", "temperature_c"),
        ("power_w",),
        ("power_w", "energy_j"),
        ("power_w",),
        ("power_w", "energy_j"),
        ("power_w", "temperature_c"),
        ("power_w", "energy_j"),
        ("power_w",),
        ("power_w", "energy_j"),
        ("power_w",),
    ]


async def test_slow_reads_skip_ticks_and_stay_on_grid() -> None:
    clock = FakeClock()

    async def publish(e: Event) -> None:
        pass

    # Each read consumes 25 ms of a 10 ms period: reads land on every third grid point.
    gpu = ScriptedGpu(0, clock, read_cost_s=0.025)
    sampler = Sampler(
        gpu, publish, clock, host="h", period_s=0.01, fields={"power_w": None}, offload_after_s=1
    )
    await run_for(clock, 0.1, sampler)
    times = [t for t, _ in gpu.reads]
    assert times[:4] == [0, 30 * MS, 60 * MS, 90 * MS]
    # Every read skips the two grid points it overran.
    assert sampler.stats.missed_ticks == 2 * len(gpu.reads)
    assert not sampler.stats.offloaded


async def test_a_slow_device_moves_to_a_worker_thread() -> None:
    clock = FakeClock()
    events: list[Event] = []

    async def publish(e: Event) -> None:
        events.append(e)

    gpu = ScriptedGpu(0, clock, read_cost_s=0.006)
    sampler = Sampler(
        gpu,
        publish,
        clock,
        host="h",
        period_s=0.01,
        fields={"power_w": None},
        offload_after_s=0.005,
    )
    await run_for(clock, 0.025, sampler)
    # Reads at 0, 10, 20 ms; the third slow read (6 ms > 5 ms) moved the device off the loop.
    assert sampler.stats.slow_reads == 3 and sampler.stats.offloaded
    assert len(events) >= 3


async def test_fault_becomes_event_backs_off_and_recovers() -> None:
    clock = FakeClock()
    events: list[Event] = []

    async def publish(e: Event) -> None:
        events.append(e)

    def fail(now: int) -> DeviceLostError | None:
        return DeviceLostError("fell off the bus", device="gpu:0") if now < 250 * MS else None

    bad = ScriptedGpu(0, clock, fail=fail)
    good = ScriptedGpu(1, clock)
    s_bad = Sampler(
        bad, publish, clock, host="h", period_s=0.01, fields={"power_w": None}, backoff_s=(0.1, 1)
    )
    s_good = Sampler(good, publish, clock, host="h", period_s=0.01, fields={"power_w": None})
    await run_for(clock, 0.5, s_bad, s_good)
    faults = [e for e in events if isinstance(e, DeviceFault)]
    # Failing reads at 0 ms, then after 100 ms and 200 ms back-offs: 0, 100, 300 (ok).
    assert [t for t, _ in bad.reads[:3]] == [0, 100 * MS, 300 * MS]
    assert [(f.kind, f.retry_in_s) for f in faults] == [("gpu_lost", 0.1), ("gpu_lost", 0.2)]
    assert faults[0].device == "gpu:0"
    # The healthy GPU never missed a beat.
    assert [t for t, _ in good.reads][:50] == [k * 10 * MS for k in range(50)]
    bad_samples = [e for e in events if isinstance(e, GpuSample) and e.gpu == 0]
    assert bad_samples and bad_samples[0].t_ns == clock.wall_ns() - 500 * MS + 300 * MS


def test_field_ratio_errors() -> None:
    with pytest.raises(ConfigError, match="positive"):
        field_ratios(0, {"power_w": None}, ["power_w"])
    with pytest.raises(ConfigError, match="shorter than the base"):
        field_ratios(0.1, {"power_w": 0.01}, ["power_w"])
    with pytest.raises(ConfigError, match="must be positive"):
        field_ratios(0.1, {"power_w": -1.0}, ["power_w"])
    assert field_ratios(0.01, {"power_w": None, "x": 1.0}, ["power_w"]) == {"power_w": 1}


def test_sampler_rejects_device_without_requested_fields() -> None:
    clock = FakeClock()

    async def publish(e: Event) -> None:
        pass

    with pytest.raises(ConfigError, match="none of the requested fields"):
        Sampler(ScriptedGpu(0, clock), publish, clock, host="h", period_s=0.01, fields={"x": None})


async def test_hub_is_lossless_under_a_slow_consumer() -> None:
    hub = Hub()
    stream = hub.subscribe(max_buffer=1)
    received: list[int] = []

    async def consume() -> None:
        async with stream:
            async for e in stream:
                assert isinstance(e, GpuSample)
                received.append(e.t_ns)
                await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for i in range(200):
            await hub.publish(GpuSample("h", i, 0))
        hub.close()
    assert received == list(range(200))
    assert hub.stats.consumer_waits > 0


async def test_hub_detaches_a_failing_sink() -> None:
    hub = Hub()
    seen: list[Event] = []

    def bad(e: Event) -> None:
        raise RuntimeError("boom")

    hub.add_sink(bad)
    hub.add_sink(seen.append)
    await hub.publish(GpuSample("h", 1, 0))
    await hub.publish(GpuSample("h", 2, 0))
    assert len(seen) == 2 and hub.stats.sink_errors == 1


async def test_runtime_drains_consumers_in_order_at_shutdown() -> None:
    clock = FakeClock()
    gpus = [ScriptedGpu(i, clock) for i in range(3)]
    got: list[Event] = []

    async def consumer(stream: anyio.abc.ObjectReceiveStream[Event]) -> None:
        async for e in stream:
            got.append(e)
            await anyio.sleep(0)

    async with Runtime(gpus, clock=clock, host="node1", period_s=0.01, consumers=[consumer]) as rt:
        await clock.sleep_until(clock.monotonic_ns() + 100 * MS)
    # Every event the hub accepted reached the consumer (nothing lost at shutdown).
    samples = [e for e in got if isinstance(e, GpuSample)]
    assert len(got) == rt.hub.stats.events
    assert isinstance(got[0], StreamInfo) and [d.key for d in got[0].devices] == [
        "gpu:0",
        "gpu:1",
        "gpu:2",
    ]
    assert len(samples) == len(got) - 1 and len(samples) >= 30
    per_gpu = {i: [e.t_ns for e in samples if e.gpu == i] for i in range(3)}
    for ts in per_gpu.values():
        assert ts == sorted(ts) and len(ts) >= 10
    assert all(g.closed is False for g in gpus)  # devices passed in are not closed by the runtime
