"""Adaptive reads: the tracker's rules, and a sampled series that integrates like the full one."""

from __future__ import annotations

import itertools

import anyio
import pytest

from zeus_async.aggregate.windows import WindowResult
from zeus_async.clock import FakeClock
from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload, RandomWorkload
from zeus_async.events import GpuSample, Measurement
from zeus_async.runtime import Runtime
from zeus_async.runtime.change_tracker import ChangeTracker
from zeus_async.testing import sim_pynvml

MS = 1_000_000
S = 1_000_000_000


def feed(tracker: ChangeTracker, values: dict[int, float], until: int) -> list[int]:
    """Drive ``tracker`` over ticks ``0..until`` with a field whose value at tick t is the
    latest ``values`` entry at or before t; return the ticks it asked to read."""
    read: list[int] = []
    current = 0.0
    for tick in range(until + 1):
        current = values.get(tick, current)
        if tracker.wants(tick):
            read.append(tick)
            tracker.observe(tick, current)
    return read


def refreshes(period: int, first: int, until: int, *, shift: dict[int, int] | None = None) -> dict:
    """A field that takes a new value every ``period`` ticks (some refreshes moved by ``shift``)."""
    out: dict[int, float] = {}
    for n, tick in enumerate(range(first, until + 1, period)):
        out[tick + (shift or {}).get(n, 0)] = float(n + 1)
    return out


def test_tracker_locks_after_equal_intervals_and_reads_guard_plus_refresh() -> None:
    tracker = ChangeTracker(lock_after=3)
    read = feed(tracker, refreshes(10, 5, 200), 200)
    assert tracker.period == 10
    # Every tick until the 4th change (tick 35) locked the period; then the tick before each
    # refresh and the refresh itself.
    assert read[:36] == list(range(36))
    assert read[36:] == [t for r in range(45, 201, 10) for t in (r - 1, r)]
    assert tracker.unbracketed == 0


def test_tracker_widens_its_guard_when_a_refresh_comes_early() -> None:
    tracker = ChangeTracker(lock_after=3)
    # The 6th refresh (tick 65) comes one tick early, at 64: the guard read (64) sees it.
    values = refreshes(10, 5, 300, shift={6: -1})
    read = feed(tracker, values, 300)
    assert tracker.unbracketed == 1
    assert tracker.guard == 2
    assert 63 not in read and 64 in read  # not bracketed: that change is counted, not hidden
    # Learnt again with a wider guard: two reads before each refresh from then on.
    assert tracker.period == 10
    assert read[-3:] == [293, 294, 295]


def test_tracker_relearns_once_the_widest_guard_is_not_enough() -> None:
    tracker = ChangeTracker(lock_after=3, max_guard=1)
    read = feed(tracker, refreshes(10, 5, 70, shift={6: -1}), 70)
    assert tracker.unbracketed == 1 and tracker.period is None
    assert read[-6:] == list(range(65, 71))  # every tick again


def test_a_refresh_flipping_across_a_tick_locks_with_a_wider_guard() -> None:
    tracker = ChangeTracker(lock_after=3)
    # Refreshes land on tick 10k+5 or, every other time, one tick earlier: gaps of 9 and 11.
    values = refreshes(10, 5, 400, shift={n: -1 for n in range(1, 40, 2)})
    read = feed(tracker, values, 400)
    assert (tracker.period, tracker.guard) == (10, 2)
    assert tracker.unbracketed == 0  # every change bracketed, on either side of the boundary
    assert len(read) < 0.45 * 401
    # Gaps further apart than two ticks never lock.
    wild = ChangeTracker(lock_after=3)
    feed(wild, {t: float(t) for t in (5, 13, 25, 32, 45, 53, 65)}, 70)
    assert wild.period is None


def test_a_widened_guard_narrows_again_after_refreshes_on_time() -> None:
    tracker = ChangeTracker(lock_after=3, narrow_after=50)
    # One early refresh (tick 64) widens the guard; the next 50 come on their expected tick.
    read = feed(tracker, refreshes(10, 5, 1200, shift={6: -1}), 1200)
    assert tracker.unbracketed == 1
    assert tracker.guard == 1
    # Guard 2 (three reads per refresh) from the stall until the 50th refresh on time (75,
    # 85, ..., 565), then the tick before each refresh and the refresh.
    assert [t for t in read if 480 <= t <= 580] == [
        *(t for r in range(485, 566, 10) for t in (r - 2, r - 1, r)),
        574,
        575,
    ]
    assert read[-4:] == [1184, 1185, 1194, 1195]  # then the tick before and the refresh
    # A refresh that keeps flipping across a tick boundary keeps the wider guard: every early
    # change resets the count, and none goes unbracketed.
    flipping = ChangeTracker(lock_after=3, narrow_after=5)
    values = refreshes(10, 5, 2000, shift={n: -1 for n in range(1, 200, 4)})
    feed(flipping, values, 2000)
    assert (flipping.guard, flipping.unbracketed) == (2, 0)
    with pytest.raises(ValueError):
        ChangeTracker(narrow_after=0)


def test_tracker_reads_every_tick_while_the_value_holds_still() -> None:
    tracker = ChangeTracker(lock_after=3)
    values = refreshes(10, 5, 100)  # refreshes up to tick 95, then nothing changes
    read = feed(tracker, values, 300)
    assert tracker.period is None  # a whole period past the expected refresh: unlocked
    assert read[-100:] == list(range(201, 301))


def test_tracker_never_skips_fast_or_irregular_fields() -> None:
    fast = ChangeTracker(lock_after=3, min_period=3)
    assert feed(fast, refreshes(2, 0, 100), 100) == list(range(101))
    irregular = ChangeTracker(lock_after=3)
    values = {t: float(t) for t in (3, 10, 14, 25, 31, 40, 52, 57, 70, 74)}
    assert feed(irregular, values, 80) == list(range(81))


def test_tracker_reset_and_failed_reads_drop_the_bracket() -> None:
    tracker = ChangeTracker(lock_after=3)
    feed(tracker, refreshes(10, 5, 60), 60)
    assert tracker.period == 10
    tracker.reset()
    assert tracker.period is None and tracker.wants(61) and tracker.wants(62)
    tracker.observe(61, 1.0)
    tracker.observe(62, None)  # failed read
    tracker.observe(63, 2.0)  # a change, but the tick before it was not read
    assert tracker.period is None and tracker.unbracketed == 0
    # A tick the sampler woke too late for: the change after it is not the rule's miss.
    locked = ChangeTracker(lock_after=3)
    feed(locked, refreshes(10, 5, 60), 60)
    locked.missed()
    locked.observe(66, 99.0)
    assert (locked.unbracketed, locked.period) == (0, 10)
    with pytest.raises(ValueError):
        ChangeTracker(min_period=1)


async def _sample(
    config: SimConfig, wall_start_ns: int, adaptive: bool
) -> tuple[list[GpuSample], Runtime, list[Measurement]]:
    clock = FakeClock(wall_start_ns=wall_start_ns)
    fields: dict[str, float | None] = {"power_w": None, "energy_j": None, "temperature_c": 0.05}
    samples: list[GpuSample] = []
    windows: list[Measurement] = []
    results: list[WindowResult] = []
    try:
        async with Runtime(
            backend="sim",
            cpus=None,
            sim_config=config,
            clock=clock,
            fields=fields,
            adaptive_reads=adaptive,
            windows=True,
        ) as rt:
            stream = rt.subscribe()

            async def collect() -> None:
                async for event in stream:
                    if isinstance(event, GpuSample):
                        samples.append(event)

            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                # Windows long and short, at fixed stream times (after the learning phase).
                for begin_ms, end_ms in ((1003, 2207), (2311, 2329), (2400, 2475)):
                    await clock.sleep_until(begin_ms * MS)
                    async with rt.window(f"w{begin_ms}") as w:
                        await clock.sleep_until(end_ms * MS)
                    assert w.result is not None
                    results.append(w.result)
                # Wait on the fake clock: a real-time poll (wait_async) lets the clock run on
                # meanwhile, by however far this machine's speed allows.
                for r in results:
                    while not r.done():
                        await clock.sleep_until(clock.monotonic_ns() + 10 * MS)
                    windows.append(r.wait(0))
                await clock.sleep_until(3 * S + 5 * MS)
                tg.cancel_scope.cancel()
    finally:
        sim_pynvml.uninstall()
    return samples, rt, windows


def _series(samples: list[GpuSample], gpu: int, field: str) -> list[tuple[int, float]]:
    return [(s.t_ns, v) for s in samples if s.gpu == gpu and (v := getattr(s, field)) is not None]


def _trapezoid(series: list[tuple[int, float]], t0: int, t1: int) -> float:
    pts = [(t, v) for t, v in series if t0 <= t <= t1]
    return sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in itertools.pairwise(pts))


@pytest.mark.anyio
@pytest.mark.parametrize("phase_ms", [0, 3, 9])
async def test_adaptive_series_integrates_exactly_like_the_full_one(phase_ms: int) -> None:
    """Same simulated node and fake clock, read on every tick and adaptively: the adaptive
    series is a subset of the full one, every skipped read repeated the value on both sides of
    it, so trapezoid integrals agree exactly; it needs far fewer reads."""
    config = SimConfig(
        num_gpus=2,
        seed=3,
        power_noise_w=2.0,
        workload=RandomWorkload(seg_min_s=0.05, seg_max_s=0.5),
    )
    # The sim refreshes on a 100 ms wall grid: ``phase_ms`` puts it at that offset from ticks.
    start = 1_760_000_000 * S + phase_ms * MS
    full, _, full_windows = await _sample(config, start, adaptive=False)
    sparse, rt, sparse_windows = await _sample(config, start, adaptive=True)
    stats = [s.stats for s in rt.samplers]
    assert sum(s.reads for s in stats) < 0.45 * len(full)
    assert sum(s.skipped_ticks for s in stats) > 0
    assert all(s.missed_ticks == 0 for s in stats)
    assert sum(s.unbracketed_changes for s in rt.samplers) == 0
    for gpu in (0, 1):
        for field in ("power_w", "energy_j"):
            whole = _series(full, gpu, field)
            part = _series(sparse, gpu, field)
            assert set(part) <= set(whole)
            assert len(part) < len(whole) / 2
            # Between two adaptive samples, the full series only repeats their common value.
            kept = {t for t, _ in part}
            run_value: float | None = None
            for t, v in whole:
                if t in kept:
                    run_value = v
                else:
                    assert v == run_value, (gpu, field, t)
            t0, t1 = part[0][0], part[-1][0]
            assert _trapezoid(part, t0, t1) == pytest.approx(_trapezoid(whole, t0, t1), rel=1e-12)
        # Untracked fields keep their own period.
        assert _series(sparse, gpu, "temperature_c") == _series(full, gpu, "temperature_c")
    # Windows (counter, split inside counter periods by the instant-power readings) agree.
    assert [round((m.end_ns - m.start_ns) / MS) for m in sparse_windows] == [1204, 18, 75]
    for a, b in zip(full_windows, sparse_windows, strict=True):
        assert a.methods == b.methods
        assert a.methods["gpu:0"] == "counter+interpolated"
        for gpu in (0, 1):
            assert a.gpu_energy_j[gpu] > 0
            assert b.gpu_energy_j[gpu] == pytest.approx(a.gpu_energy_j[gpu], rel=1e-9)


@pytest.mark.anyio
async def test_adaptive_reads_read_every_tick_when_power_holds_still() -> None:
    config = SimConfig(num_gpus=1, seed=1, workload=ConstantWorkload(util=0.5))
    full, _, _ = await _sample(config, 1_760_000_000 * S + 4 * MS, adaptive=False)
    sparse, rt, _ = await _sample(config, 1_760_000_000 * S + 4 * MS, adaptive=True)
    # Instant power never changes, so nothing tells when it refreshes: read on every tick.
    assert _series(sparse, 0, "power_w") == _series(full, 0, "power_w")
    # The energy counter moves at each refresh: its reads are skipped as usual.
    assert len(_series(sparse, 0, "energy_j")) < len(_series(full, 0, "energy_j")) / 2
    assert rt.samplers[0].trackers["power_w"].period is None


# -- on by default where the energy counter is expensive to read ------------------------------


async def _adaptive_per_gpu(config: SimConfig, adaptive_reads: bool | None) -> list[bool]:
    clock = FakeClock()
    try:
        async with Runtime(
            backend="sim",
            cpus=None,
            sim_config=config,
            clock=clock,
            adaptive_reads=adaptive_reads,
        ) as rt:
            await clock.sleep_until(clock.monotonic_ns() + 50 * MS)
            return [bool(s.trackers) for s in rt.samplers]
    finally:
        sim_pynvml.uninstall()


@pytest.mark.anyio
async def test_adaptive_reads_turn_on_where_reading_the_energy_counter_is_expensive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from zeus_async.devices.sim_config import H100_DRIVER_580_COSTS, sim_preset

    # Reads cost what a real H100 with driver 580 was measured at: 3.8 ms per energy read.
    expensive = sim_preset("nvidia", num_gpus=2, **H100_DRIVER_580_COSTS)  # type: ignore[arg-type]
    with caplog.at_level("INFO", logger="zeus_async.runtime.runtime"):
        assert await _adaptive_per_gpu(expensive, None) == [True, True]
    assert "reading its energy counter costs 3." in caplog.text
    # Asked for explicitly, either way, it is as asked.
    assert await _adaptive_per_gpu(expensive, False) == [False, False]
    # Free reads (the simulator's default): every tick, as before.
    assert await _adaptive_per_gpu(SimConfig(num_gpus=2), None) == [False, False]
    assert await _adaptive_per_gpu(SimConfig(num_gpus=2), True) == [True, True]
