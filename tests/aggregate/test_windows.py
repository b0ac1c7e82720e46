"""Measurement windows against the simulator's ground truth (fake clock, sim backend)."""

from __future__ import annotations

import random
from collections.abc import Callable

import anyio
import pytest

from zeus_async.aggregate import DeviceHistory, WindowResult, WindowTracker
from zeus_async.aggregate.history import SensorModel
from zeus_async.clock import FakeClock
from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_config import GpuOverride
from zeus_async.devices.sim_workload import ConstantWorkload, SquareWorkload
from zeus_async.events import (
    DeviceInfo,
    Event,
    GpuSample,
    Measurement,
    WindowClose,
    WindowOpen,
)
from zeus_async.runtime import Runtime
from zeus_async.testing import sim_pynvml

pytestmark = pytest.mark.anyio

MS = 1_000_000


def square_config(**kw: object) -> SimConfig:
    return SimConfig(
        num_gpus=2,
        workload=SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1),
        seed=5,
        **kw,  # type: ignore[arg-type]
    )


async def run_windows(
    config: SimConfig, spans_ms: list[tuple[int, int]], *, gap_ms: int = 500
) -> tuple[list[WindowResult], list[Event], object]:
    """Open/close windows at given (start offset, length) ms under a fake clock."""
    clock = FakeClock(wall_start_ns=1_760_000_000_000_000_000 + 3 * MS)
    seen: list[Event] = []

    async def collect(stream: anyio.abc.ObjectReceiveStream[Event]) -> None:
        async for e in stream:
            seen.append(e)

    results: list[WindowResult] = []
    try:
        async with Runtime(
            backend="sim",
            cpus=None,
            sim_config=config,
            clock=clock,
            windows=True,
            consumers=[collect],
        ) as rt:
            assert rt.tracker is not None
            await clock.sleep_until(clock.monotonic_ns() + gap_ms * MS)
            for offset, length in spans_ms:
                await clock.sleep_until(clock.monotonic_ns() + offset * MS)
                async with rt.window(f"w{len(results)}") as w:
                    await clock.sleep_until(clock.monotonic_ns() + length * MS)
                assert w.result is not None
                results.append(w.result)
            for r in results:
                await r.wait_async()
            node = sim_pynvml.current_node()
    finally:
        sim_pynvml.uninstall()
    return results, seen, node


@pytest.mark.parametrize("length_ms", [20, 50, 200, 1000, 3000])
async def test_window_energy_is_close_to_ground_truth(length_ms: int) -> None:
    spans = [(k * 13, length_ms) for k in range(6)]
    results, _, node = await run_windows(square_config(), spans)
    for r in results:
        m = r.wait(0)
        for gpu in (0, 1):
            truth = node.truth_energy_j(gpu, r.start_ns, r.end_ns)  # type: ignore[attr-defined]
            err = abs(m.gpu_energy_j[gpu] - truth)
            assert m.methods[f"gpu:{gpu}"] == "counter+interpolated"
            # Exact counter periods; only the split of the two edge periods is estimated:
            # at most one counter period of the power swing (70 W .. 700 W) per edge.
            assert err <= 2 * 0.1 * 630 + 1e-6, (length_ms, gpu, m.gpu_energy_j[gpu], truth)
            if length_ms >= 1000:
                assert err / truth < 0.01


async def test_short_window_is_never_zero_and_edges_are_published() -> None:
    results, seen, _ = await run_windows(square_config(), [(0, 5)])
    r = results[0]
    assert r.time == pytest.approx(0.005)
    assert all(e > 0 for e in r.gpu_energy.values())
    kinds = [type(e) for e in seen if isinstance(e, WindowOpen | WindowClose | Measurement)]
    assert kinds == [WindowOpen, WindowClose, Measurement]
    m = next(e for e in seen if isinstance(e, Measurement))
    assert m.gpu_energy_j == r.gpu_energy and m.name == "w0"


async def test_pre_volta_gpu_is_integrated() -> None:
    config = SimConfig(
        num_gpus=2,
        workload=ConstantWorkload(util=0.6),
        gpus=(GpuOverride(pre_volta=True), GpuOverride()),
        seed=5,
    )
    results, _, node = await run_windows(config, [(0, 1000)])
    m = results[0].wait(0)
    assert m.methods == {"gpu:0": "integrated", "gpu:1": "counter+interpolated"}
    truth = node.truth_energy_j(0, m.start_ns, m.end_ns)  # type: ignore[attr-defined]
    assert m.gpu_energy_j[0] == pytest.approx(truth, rel=1e-6)  # constant power: exact


async def test_gpu_lost_mid_window_still_closes() -> None:
    # lost_at_s counts from epoch_ns: the loss lands 0.9 s after the clock starts, inside
    # the window that spans 0.5 s .. 1.5 s.
    start = 1_760_000_000_000_000_000 + 3 * MS
    config = square_config(epoch_ns=start, gpus=(GpuOverride(), GpuOverride(lost_at_s=0.9)))
    results, _, _ = await run_windows(config, [(0, 1000)])
    m = results[0].wait(0)
    assert "gpu:1" in m.lost and "gpu:0" not in m.lost
    assert m.gpu_energy_j[0] > 0


async def test_one_second_windows_within_half_a_percent() -> None:
    spans = [(k * 13 + 7, 1000) for k in range(8)]
    results, _, node = await run_windows(square_config(), spans)
    rel = []
    for r in results:
        m = r.wait(0)
        for gpu in (0, 1):
            truth = node.truth_energy_j(gpu, r.start_ns, r.end_ns)  # type: ignore[attr-defined]
            rel.append(abs(m.gpu_energy_j[gpu] - truth) / truth)
    assert sum(rel) / len(rel) < 0.005


async def test_the_pump_runs_only_when_there_is_something_to_do() -> None:
    clock = FakeClock(wall_start_ns=1_760_000_000_000_000_000 + 3 * MS)
    samples: list[int] = []

    async def collect(stream: anyio.abc.ObjectReceiveStream[Event]) -> None:
        async for e in stream:
            if isinstance(e, GpuSample):
                samples.append(e.t_ns)

    pumps: list[int] = []
    try:
        async with Runtime(
            backend="sim",
            cpus=None,
            sim_config=square_config(),
            clock=clock,
            windows=True,
            consumers=[collect],
        ) as rt:
            tracker = rt.tracker
            assert tracker is not None
            pump = tracker.pump

            def counted(*, force: bool = False) -> None:
                pumps.append(clock.wall_ns())
                pump(force=force)

            tracker.pump = counted  # type: ignore[method-assign]
            # Sampling every 10 ms with no window: the pump's own poll only (every 0.1 s).
            t0 = clock.monotonic_ns()
            await clock.sleep_until(t0 + 2000 * MS)
            assert 15 <= len(pumps) <= 21
            # A closed window: the pump runs on the samples that follow (the data that can
            # complete the window), and the one that does finalizes it at once.
            async with rt.window("w") as w:
                await clock.sleep_until(clock.monotonic_ns() + 50 * MS)
            assert w.result is not None
            while not w.result.done():
                await clock.sleep_until(clock.monotonic_ns() + 10 * MS)
            m = w.result.wait(0)
            assert m.t_ns in samples
            assert m.t_ns - m.end_ns < 300 * MS
            assert set(p for p in pumps if w.result.end_ns < p < m.t_ns) <= set(samples)
    finally:
        sim_pynvml.uninstall()


def test_histories_are_trimmed_while_no_window_closes() -> None:
    clock = FakeClock(wall_start_ns=1_760_000_000_000_000_000)
    tracker = WindowTracker(
        clock, "h", [DeviceInfo("gpu:0", "sim", has_energy_counter=True)], history_s=30.0
    )
    for i in range(4_500):  # 45 s of 10 ms samples, the counter moving every 100 ms
        clock.set_ns(i * 10 * MS)
        tracker.add(GpuSample("h", clock.wall_ns(), 0, power_w=300.0, energy_j=30.0 * (i // 10)))
        if i % 10 == 0:
            tracker.pump()
    history = tracker.histories["gpu:0"]
    oldest = history._pt[0] - clock.wall_ns()
    # 30 s kept, trimmed at least every second (one point before the cut is kept).
    assert -32_000 * MS <= oldest <= -30_000 * MS
    assert len(history._pt) <= 3_200
    # An open window keeps its data however old.
    tracker.open("long", t_ns=clock.wall_ns() - 31_000 * MS)
    clock.set_ns(clock.monotonic_ns() + 2_000 * MS)
    tracker.pump()
    assert history._pt[0] - clock.wall_ns() == oldest - 2_000 * MS


def _feed_h100_like(h: DeviceHistory, power_at: Callable[[float], float], seconds: float) -> None:
    """Feed :func:`_h100_like_samples` to ``h``."""
    for sample in _h100_like_samples(power_at, seconds):
        h.add(*sample)


def _h100_like_samples(
    power_at: Callable[[float], float], seconds: float
) -> list[tuple[int, float, float]]:
    """Samples every 10 ms of an H100-like sensor: counter and head reading refreshed every
    100 ms; the head reading averages the first 25 ms of the period that just ended."""

    def energy(t0: float, t1: float, dt: float = 1e-4) -> float:
        n = round((t1 - t0) / dt)
        return sum(power_at(t0 + (i + 0.5) * dt) for i in range(n)) * dt

    period_e: list[float] = []
    heads: list[float] = []
    for k in range(round(seconds / 0.1)):
        period_e.append(energy(k * 0.1, k * 0.1 + 0.1))
        heads.append(energy(k * 0.1, k * 0.1 + 0.025) / 0.025)
    out = []
    for i in range(round(seconds / 0.01)):
        t = i * 0.01 + 0.005
        k = int(t / 0.1)  # periods completed
        counter = sum(period_e[:k])
        head = heads[k - 1] if k >= 1 else power_at(0)
        out.append((round(t * 1e9), head, counter))
    return out


def test_head_model_reconstructs_a_step_inside_a_period_exactly() -> None:
    # 100 W, stepping to 400 W at 2.263 s (inside the tail of the period 2.2-2.3 s); before
    # it, 30 W more every other counter period keeps the readings changing and shows that
    # they describe the period before the last update (the model's evidence).
    def power(t: float) -> float:
        return 400.0 if t >= 2.263 else 100.0 + 30.0 * (int(t / 0.1 + 1e-9) % 2)

    h = DeviceHistory("gpu:0")
    _feed_h100_like(h, power, 3.0)
    assert h.power_readings == "lagging"
    assert h._head_model_active()
    est = h.energy(round(2.21e9), round(2.29e9))
    truth = 100.0 * (2.263 - 2.21) + 400.0 * (2.29 - 2.263)
    # Exact up to the estimate of the update instants (midpoints, within 5 ms here: 0 ms).
    assert est.energy_j == pytest.approx(truth, rel=1e-3)
    # Before the step: 4 J. Splitting the period in proportion to time would say 8.44 J,
    # the sloped split (a line through the mean, 211 W, leaning 1350 W/s from the
    # neighbours, 130 W and 400 W) 7.36 J; without the head model, the period is one step
    # from its neighbours' levels, 130 W to 400 W, placed 70 ms in to keep the mean: 5.2 J.
    before = h.energy(round(2.21e9), round(2.25e9)).energy_j
    assert before == pytest.approx(100.0 * 0.04, rel=1e-3)
    linear = DeviceHistory("gpu:0", sensor=SensorModel(head_window_s=0.0))
    _feed_h100_like(linear, power, 3.0)
    assert not linear._head_model_active()
    assert linear.energy(round(2.21e9), round(2.25e9)).energy_j == pytest.approx(5.2, rel=1e-3)


def test_without_power_readings_a_period_is_one_step_or_a_slope() -> None:
    # No head model (readings that describe the past): a period between two flat levels is
    # one step placed to keep its energy; a period inside a steady ramp keeps the sloped split.
    def step(t: float) -> float:
        # Until 1.5 s, 30 W more every other period shows what the readings describe.
        if t < 1.5:
            return 100.0 + 30.0 * (int(t / 0.1 + 1e-9) % 2)
        return 400.0 if t >= 2.263 else 100.0

    h = DeviceHistory("gpu:0", sensor=SensorModel(head_window_s=0.0))
    _feed_h100_like(h, step, 3.0)
    assert not h._head_model_active() and h._split() == "time"
    # Mean 211 W: the step from 100 W to 400 W sits 63 ms into the period, as it does.
    assert h.energy(round(2.21e9), round(2.25e9)).energy_j == pytest.approx(4.0, rel=1e-3)
    assert h.energy(round(2.25e9), round(2.29e9)).energy_j == pytest.approx(
        100.0 * 0.013 + 400.0 * 0.027, rel=1e-3
    )

    def ramp(t: float) -> float:
        return 100.0 + 1000.0 * t  # 1000 W/s: the power goes on rising beyond each neighbour

    r = DeviceHistory("gpu:0", sensor=SensorModel(head_window_s=0.0))
    _feed_h100_like(r, ramp, 3.0)
    # The line through the period's mean with the neighbours' slope: exact on a ramp.
    truth = 100.0 * 0.04 + 500.0 * (2.25**2 - 2.21**2)
    assert r.energy(round(2.21e9), round(2.25e9)).energy_j == pytest.approx(truth, rel=1e-3)


def test_head_model_stays_off_when_readings_do_not_follow_the_counter() -> None:
    h = DeviceHistory("gpu:0")
    # Power changes every 30 ms while the counter moves every 100 ms: not the H100 model.
    for i in range(300):
        t = i * 10 * MS
        h.add(t, 100.0 + (i // 3) % 2 * 50.0, 10.0 * (t // (100 * MS)))
    assert h.power_changes > 50
    assert not h._head_model_active()


def test_history_interpolation_exact_values() -> None:
    h = DeviceHistory("gpu:0")
    # Samples every 10 ms at 100 W; counter moves by 10 J at 100 ms and 200 ms.
    for k in range(0, 26):
        t = k * 10 * MS
        counter = 1000.0 + 10.0 * (t // (100 * MS))
        h.add(t, 100.0, counter)
    # Update instants estimated at the midpoints 95 ms and 195 ms.
    est = h.energy(120 * MS, 170 * MS)
    assert est.method == "counter+interpolated"
    assert est.energy_j == pytest.approx(5.0)
    assert h.covers(190 * MS) and not h.covers(196 * MS)
    # Outside the counter points: power integration for the uncovered parts.
    est = h.energy(50 * MS, 150 * MS)
    assert est.method == "counter+extrapolated"
    assert est.energy_j == pytest.approx(4.5 + 5.5)
    with pytest.raises(ValueError):
        h.energy(2, 1)
    assert DeviceHistory("gpu:9").energy(0, 1).method == "unavailable"


def test_remembered_update_instants_never_change_a_result() -> None:
    """A history that has answered many queries (and remembers refined update instants)
    gives exactly the energies of a fresh history holding the same samples, while samples
    keep arriving and old ones are trimmed."""

    def power(t: float) -> float:
        return 150.0 + 90.0 * ((t * 2.1) % 1.0) + (int(t / 0.1 + 1e-9) % 3)

    # Sampling jitter (up to +-3 ms), so that refined update instants depend on how many
    # neighbours a fit had.
    rng = random.Random(7)
    samples = [(t + rng.randint(-3, 3) * MS, p, c) for t, p, c in _h100_like_samples(power, 5.0)]
    live = DeviceHistory("gpu:0")
    trimmed_to: int | None = None
    checked = 0
    for n, sample in enumerate(samples, 1):
        live.add(*sample)
        if n % 41 == 0 and n > 200:
            trimmed_to = samples[n - 160][0]
            live.trim_before(trimmed_to)
        if n % 3 or n < 60:
            continue
        fresh = DeviceHistory("gpu:0")
        for s in samples[:n]:
            fresh.add(*s)
        if trimmed_to is not None:
            fresh.trim_before(trimmed_to)
        end = sample[0] - 15 * MS
        for length in (20 * MS, 45 * MS, 130 * MS, 700 * MS):
            start = max(end - length, fresh._ct[0])
            a, b = live.energy(start, end), fresh.energy(start, end)
            assert (a.energy_j, a.method) == (b.energy_j, b.method)
            checked += 1
    assert live._head_model_active() and live._refined_cache
    assert checked > 500


def test_a_widened_bracket_does_not_move_the_update_grid() -> None:
    """A counter update seen only after skipped reads (a stall, or adaptive reads' guard read
    coming late) is known to ~100 ms instead of 10 ms. Its instant comes from the grid that
    the narrow brackets around it pin down, so windows with an edge in its periods keep the
    accuracy of the others — also when the window is measured as soon as it is covered (the
    wide bracket near the end of the history, where a fit leans on it most), and when the
    stall spans two updates (the counter value belongs to the later one)."""
    period, phase, watts = 100 * MS, 37 * MS, 300.0

    def counter(t: int) -> float:
        return 30.0 * ((t - phase) // period + 1) if t >= phase else 0.0

    # (last read before the gap, first read after it, reads until): the update at 937 ms is
    # seen 94 ms after the read before it (bracket midpoint 44 ms early); then the update at
    # 937 ms and the one at 1037 ms are both first seen at 1043 ms.
    for gap_end, until in ((943, 1050), (943, 3000), (1043, 1150), (1043, 3000)):
        h = DeviceHistory("gpu:0")
        for i in range(until // 10):
            t = i * 10 * MS + 3 * MS
            if not 850 * MS < t < gap_end * MS:
                h.add(t, watts, counter(t))
        errors, late = [], 0
        for t1 in range(840, 1036, 7):
            t0_ns, t1_ns = (t1 - 400) * MS, t1 * MS
            est = h.energy(t0_ns, t1_ns)
            # An edge in the stalled stretch is said to be: its samples came late.
            assert est.method in ("counter+interpolated", "counter+interpolated, late")
            late += est.method.endswith(", late")
            assert est.energy_j is not None
            errors.append(abs(est.energy_j / (watts * 0.4) - 1))
        # 0.02 % at most here; fitted from midpoints alone, the update instants were off by
        # up to 7 ms (1.7 % of these windows) and, across the two-update stall, a whole
        # period (25 %).
        assert max(errors) < 0.002, (gap_end, until, max(errors))
        assert late > 0


def test_window_measures_only_the_gpus_it_names() -> None:
    clock = FakeClock(wall_start_ns=1_760_000_000_000_000_000)
    devices = [DeviceInfo(f"gpu:{g}", "sim", has_energy_counter=True) for g in range(3)]
    tracker = WindowTracker(clock, "h", devices)
    t0 = clock.wall_ns()
    for i in range(101):  # 1 s, each GPU at a steady (g + 1) * 100 W
        for g in range(3):
            energy = (g + 1) * 100.0 * i / 100
            tracker.add(
                GpuSample("h", t0 + i * 10 * MS, g, power_w=(g + 1) * 100.0, energy_j=energy)
            )
    tracker.open("one", t_ns=t0 + 100 * MS, gpus=frozenset({1}))
    tracker.open("all", t_ns=t0 + 100 * MS)
    only = tracker.close("one", t_ns=t0 + 600 * MS)
    every = tracker.close("all", t_ns=t0 + 600 * MS)
    clock.set_ns(1 * 10**9)
    tracker.pump()
    assert only.done() and every.done()
    assert only.gpu_energy == pytest.approx({1: 100.0})
    assert set(only.methods) == {"gpu:1"}
    assert every.gpu_energy == pytest.approx({0: 50.0, 1: 100.0, 2: 150.0})


def test_replayed_windows_measure_their_own_hosts_devices() -> None:
    from zeus_async.aggregate.windows import ReplayedWindows

    t0 = 1_760_000_000_000_000_000
    replayed = ReplayedWindows(follow_recorded=False)
    events: list[Event] = []
    for i in range(101):  # 1 s; gpu:0 of node1 at 100 W, gpu:0 of node2 at 300 W
        t = t0 + i * 10 * MS
        events.append(GpuSample("node1", t, 0, power_w=100.0, energy_j=1.0 * i))
        events.append(GpuSample("node2", t + 1, 0, power_w=300.0, energy_j=3.0 * i))
    events.insert(20, WindowOpen("node1", t0 + 100 * MS, "w", 1))
    events.insert(21, WindowOpen("node2", t0 + 100 * MS, "w", 2))
    events.insert(180, WindowClose("node1", t0 + 600 * MS, "w", 1))
    events.insert(181, WindowClose("node2", t0 + 600 * MS, "w", 2))
    for e in events:
        replayed.add(e)
    results = {m.host: m for m in replayed.finish()}
    assert results["node1"].gpu_energy_j == pytest.approx({0: 50.0})
    assert results["node2"].gpu_energy_j == pytest.approx({0: 150.0})
