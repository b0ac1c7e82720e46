"""Totals of a recording from array-backed histories: the same figures, to the bit.

:meth:`DeviceHistory.from_arrays` keeps its samples as numpy arrays behind
:class:`~zeus_async.aggregate.arraylist.ArrayList` (each value converted where a query reads
it) instead of converting millions of values into lists up front. Every figure must stay the
one the sample-by-sample estimator gives (``docs/energy-methods.md``: one estimator behind
every total): the arithmetic is the same Python arithmetic on the same Python scalars, so the
figures are compared with ``==`` (no tolerance), on random series with gaps, duplicates,
out-of-order samples, counter resets, late counter observations, NaN readings and lost
devices, and on recorded data.
"""

from __future__ import annotations

import bisect
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zeus_async.aggregate.arraylist import ArrayList
from zeus_async.aggregate.history import DeviceHistory, add_sample, history_key
from zeus_async.events import GpuSample, RaplSample
from zeus_async.store import RecordingReader, write_recording
from zeus_async.store.analysis import Recording

DATA = Path(__file__).parent.parent / "data"
T0 = 1_700_000_000_000_000_000
_STATE = ("_pt", "_pw", "_pc", "_ct", "_cb", "_ce", "_cp")

Sample = tuple[int, float | None, float | None]


def _same(a: Any, b: Any) -> bool:
    """Equal to the bit, of the same type (NaN equals NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _listed(history: DeviceHistory) -> DeviceHistory:
    """``history`` with its arrays turned into real lists: what from_arrays held before."""
    for name in _STATE:
        value = getattr(history, name)
        assert isinstance(value, ArrayList | list), name
        setattr(history, name, list(value))
    return history


def _build(
    samples: list[Sample], fine: bool, *, listed: bool = False, lag: float = 0.0
) -> DeviceHistory:
    t = np.array([s[0] for s in samples], dtype=np.int64)
    p = np.array([np.nan if s[1] is None else s[1] for s in samples], dtype=np.float64)
    c = np.array([np.nan if s[2] is None else s[2] for s in samples], dtype=np.float64)
    history = DeviceHistory.from_arrays(
        "gpu:0", t, p, c, fine_counter=fine, reading_lag_s=lag, reading_window_s=lag / 2
    )
    return _listed(history) if listed else history


def _sequential(samples: list[Sample], fine: bool, lag: float = 0.0) -> DeviceHistory:
    history = DeviceHistory("gpu:0", fine_counter=fine, reading_lag_s=lag, reading_window_s=lag / 2)
    for t, p, c in samples:
        # A NaN reading counts as none (as add_sample and from_arrays read it).
        p = None if p is not None and math.isnan(p) else p
        if p is not None or c is not None:
            history.add(t, p, c)
    return history


def _series(rng: random.Random, n: int, refreshed: bool = False) -> list[Sample]:
    """A GPU-like series: a counter every ~100 ms read at ~10 ms, power in steps and ramps,
    with late wake-ups, skipped reads, duplicates, samples out of order, missing fields,
    NaN readings and counter resets. ``refreshed``: the power reading changes only with the
    counter (H100-like: the head model's evidence)."""
    out: list[Sample] = []
    t = T0 + rng.randrange(10**9)
    counter = rng.uniform(0, 1e6)
    power = rng.uniform(50, 700)
    next_update = t + rng.randrange(100_000_000)
    for _ in range(n):
        r = rng.random()
        step = 10_000_000 + rng.randrange(-500_000, 500_000)
        if r < 0.02:
            step *= rng.randrange(3, 40)  # a late wake-up, skipped reads
        t += step
        if not refreshed and rng.random() < 0.1:
            power = max(0.0, power + rng.uniform(-200, 200))
        if refreshed and next_update <= t:
            power = max(0.0, power + rng.uniform(-200, 200))
        while next_update <= t:
            counter += power * 0.1
            next_update += 100_000_000
            if rng.random() < 0.003:
                counter = rng.uniform(0, 100.0)  # a reset (driver reload): the counter drops
        p: float | None = power
        c: float | None = counter
        if rng.random() < 0.05:
            p = None
        elif rng.random() < 0.005:
            p = math.nan
        if rng.random() < 0.05:
            c = None
        stamp = t
        if rng.random() < 0.01:
            stamp = t - rng.randrange(0, 50_000_000)  # a duplicate or a sample out of order
        out.append((stamp, p, c))
    return out


def _queries(rng: random.Random, lo: int, hi: int, k: int) -> list[tuple[int, int]]:
    out = [(lo, hi), (lo, lo), (hi, hi), (lo - 10**9, hi + 10**9)]
    for _ in range(k):
        a, b = sorted(rng.randrange(lo - 10**8, hi + 10**8) for _ in range(2))
        out.append((a, b))
        short = rng.randrange(lo, hi + 1)
        out.append((short, short + rng.randrange(1, 30_000_000)))
    return out


def _assert_same_figures(rng: random.Random, a: DeviceHistory, b: DeviceHistory) -> None:
    sa, sb = a.span_energy(), b.span_energy()
    assert _same(sa.energy_j, sb.energy_j) and sa.method == sb.method
    assert _same(sa.error_j, sb.error_j)
    if a.first_t_ns is None or a.last_t_ns is None:
        return
    lo, hi = a.first_t_ns, a.last_t_ns
    for t0, t1 in _queries(rng, lo, hi, 12):
        ea, eb = a.energy(t0, t1), b.energy(t0, t1)
        assert _same(ea.energy_j, eb.energy_j), (t0, t1, ea, eb)
        assert ea.method == eb.method and _same(ea.error_j, eb.error_j), (t0, t1, ea, eb)
    times = sorted(rng.randrange(lo, hi + 1) for _ in range(20))
    assert a.cumulative(times) == b.cumulative(times)
    assert a.covers((lo + hi) // 2) == b.covers((lo + hi) // 2)
    assert a.power_readings == b.power_readings
    assert a.fresh_power(321.5) == b.fresh_power(321.5)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("fine", [False, True])
def test_array_backed_history_gives_the_list_figures_to_the_bit(seed: int, fine: bool) -> None:
    rng = random.Random(seed * 2 + fine)
    # Every third series H100-like (the head model), every other with lagging readings.
    samples = _series(rng, rng.choice([3, 30, 400, 2500]), refreshed=seed % 3 == 0)
    lag = 0.05 if seed % 2 else 0.0
    arrays = _build(samples, fine, lag=lag)
    assert isinstance(arrays._pt, ArrayList) or not arrays._pt
    listed = _build(samples, fine, listed=True, lag=lag)
    sequential = _sequential(samples, fine, lag)
    for name in _STATE:
        x, y = getattr(arrays, name), getattr(sequential, name)
        assert len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y, strict=True)), name
    q = random.Random(seed)
    _assert_same_figures(q, arrays, listed)
    q = random.Random(seed)
    _assert_same_figures(q, arrays, sequential)


@pytest.mark.parametrize("seed", range(10))
def test_lost_devices_and_later_changes_keep_the_figures(seed: int) -> None:
    rng = random.Random(100 + seed)
    samples = _series(rng, 600)
    arrays, sequential = _build(samples, False), _sequential(samples, False)
    assert arrays.first_t_ns is not None and arrays.last_t_ns is not None
    lost = rng.randrange(arrays.first_t_ns, arrays.last_t_ns)
    arrays.mark_lost(lost)
    sequential.mark_lost(lost)
    _assert_same_figures(random.Random(seed), arrays, sequential)
    # Samples added after the load (the lists are then real lists) and a trim.
    t = arrays.last_t_ns
    for k in range(1, 50):
        for h in (arrays, sequential):
            h.add(t + k * 10_000_000, 200.0 + k, None if k % 3 else 1e7 + k)
    _assert_same_figures(random.Random(seed), arrays, sequential)
    cut = (arrays.first_t_ns + t) // 2
    arrays.trim_before(cut)
    sequential.trim_before(cut)
    for name in _STATE:
        x, y = getattr(arrays, name), getattr(sequential, name)
        assert len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y, strict=True)), name
    assert _same(arrays.energy(cut, t).energy_j, sequential.energy(cut, t).energy_j)


def test_array_list_reads_as_the_list() -> None:
    for values in (
        np.array([5, -3, 7, 2**62, 9], dtype=np.int64),
        np.array([1.5, math.nan, -0.0, 1e300, 2.25]),
    ):
        lazy: ArrayList[Any] = ArrayList(values)
        plain = values.tolist()
        assert len(lazy) == len(plain) and bool(lazy)
        assert (lazy == plain) is (values.dtype.kind == "i")  # NaN != NaN, as between lists
        for i in range(-len(plain), len(plain)):
            assert _same(lazy[i], plain[i]), i
        for s in (slice(1, 3), slice(None, None, -2), slice(-2, None), slice(7, 9)):
            part = lazy[s]
            assert type(part) is list and len(part) == len(plain[s])
            assert all(_same(x, y) for x, y in zip(part, plain[s], strict=True))
        with pytest.raises(IndexError):
            lazy[len(plain)]
        with pytest.raises(IndexError):
            lazy[-len(plain) - 1]
        assert [_same(x, y) for x, y in zip(lazy, plain, strict=True)] == [True] * len(plain)
        assert all(_same(x, y) for x, y in zip(reversed(lazy), reversed(plain), strict=True))
        assert lazy.array is values
        assert np.array_equal(np.asarray(lazy), values, equal_nan=True)
    ordered: ArrayList[int] = ArrayList(np.array([10, 20, 20, 30], dtype=np.int64))
    for x in (5, 10, 15, 20, 25, 30, 35):
        assert bisect.bisect_right(ordered, x) == bisect.bisect_right([10, 20, 20, 30], x)
        assert bisect.bisect_left(ordered, x) == bisect.bisect_left([10, 20, 20, 30], x)
    # A change turns it into a list of its own; the array is left as it was.
    values = np.array([1.0, 2.0, 3.0])
    lazy = ArrayList(values)
    del lazy[:1]
    lazy.append(4.0)
    lazy[0] = 9.0
    assert lazy == [9.0, 3.0, 4.0] and lazy.array is None
    assert values.tolist() == [1.0, 2.0, 3.0]


def test_the_history_keeps_its_own_arrays() -> None:
    t = np.arange(T0, T0 + 50 * 10_000_000, 10_000_000, dtype=np.int64)
    p = np.full(50, 100.0)
    history = DeviceHistory.from_arrays("gpu:0", t, p, None)
    before = history.span_energy().energy_j
    t += 10**9  # the caller's arrays changed after the load
    p *= 2
    assert history.span_energy().energy_j == before == pytest.approx(100.0 * 0.49)
    assert history._pt[0] == T0


def _sequential_totals(path: Path, rec: Recording) -> dict[str, tuple[float | None, str]]:
    """Each device's span energy from histories fed sample by sample (add_sample)."""
    info = rec.device_info()
    histories: dict[str, DeviceHistory] = {}
    for event in RecordingReader(path):
        if not isinstance(event, GpuSample | RaplSample):
            continue
        key = history_key(event)
        history = histories.get(key)
        if history is None:
            d = info.get(key)
            history = histories[key] = DeviceHistory(
                key,
                fine_counter=isinstance(event, RaplSample),
                reading_lag_s=d.power_reading_lag_s if d else 0.0,
                reading_window_s=d.power_reading_window_s if d else 0.0,
            )
        add_sample(history, event)
    out = {}
    for key, history in histories.items():
        estimate = history.span_energy()
        out[key] = (estimate.energy_j, estimate.method)
    return out


@pytest.mark.parametrize("name", ["sim_windows.zarc", "sim_windows_torn.zarc"])
def test_recorded_totals_are_the_sample_by_sample_totals(name: str) -> None:
    path = DATA / name
    rec = Recording(path)
    totals = rec.totals()
    expected = _sequential_totals(path, rec)
    assert totals.devices and set(totals.devices) == set(expected)
    for key, total in totals.devices.items():
        assert _same(total.energy_j, expected[key][0]), key
        assert total.method == expected[key][1], key


def _synthetic(seed: int) -> list[GpuSample | RaplSample]:
    rng = random.Random(seed)
    events: list[GpuSample | RaplSample] = []
    gpus = [_series(rng, 700) for _ in range(3)]
    for g, series in enumerate(gpus):
        for t, p, c in series:
            events.append(GpuSample("node-01", t, g, power_w=p, energy_j=c, avg_power_w=None))
    package = 0.0
    for k in range(200):
        package += rng.uniform(1, 20)
        stamp = T0 + k * 100_000_000 - (30_000_000 if k % 37 == 5 else 0)
        events.append(RaplSample("node-01", stamp, 0, "package", package, None))
    return events


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("version", [2, 3])
def test_synthetic_totals_and_windows_are_the_sample_by_sample_figures(
    tmp_path: Path, seed: int, version: int
) -> None:
    path = tmp_path / "r.zarc"
    write_recording(path, _synthetic(seed), format_version=version)
    rec = Recording(path)
    totals = rec.totals()
    expected = _sequential_totals(path, rec)
    assert set(totals.devices) == set(expected) == {"gpu:0", "gpu:1", "gpu:2", "cpu:0/package"}
    for key, total in totals.devices.items():
        assert _same(total.energy_j, expected[key][0]), key
        assert total.method == expected[key][1], key
    # Windows inside a device's span: the array-backed history against the listed one.
    rng = random.Random(seed)
    for key in ("gpu:0", "gpu:2"):
        first, last = totals.devices[key].start_ns, totals.devices[key].end_ns
        listed = _listed(
            DeviceHistory.from_arrays(
                key,
                rec._column(key, "t_ns"),
                rec._column(key, "power_w"),
                rec._column(key, "energy_j"),
            )
        )
        for _ in range(20):
            t0, t1 = sorted(rng.randrange(first, last + 1) for _ in range(2))
            a, b = rec.energy(key, t0, t1), listed.energy(t0, t1)
            assert _same(a.energy_j, b.energy_j) and a.method == b.method, (t0, t1)


@pytest.mark.parametrize("fine", [False, True])
def test_duplicates_in_an_ordered_series_are_dropped_as_add_drops_them(fine: bool) -> None:
    rng = random.Random(5)
    ordered = sorted({s[0]: s for s in _series(rng, 800)}.values())
    samples: list[Sample] = []
    for k, (t, p, c) in enumerate(ordered):
        samples.append((t, p, c))
        if k % 9 == 4:  # the same instant again, other values: dropped
            samples.append((t, 999.0, None if c is None else c + 50.0))
    arrays, sequential = _build(samples, fine), _sequential(samples, fine)
    assert arrays.dropped == sequential.dropped > 80
    for name in _STATE:
        x, y = getattr(arrays, name), getattr(sequential, name)
        assert len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y, strict=True)), name
    _assert_same_figures(random.Random(5), arrays, sequential)
