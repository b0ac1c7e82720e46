"""One estimator: every total and window comes from ``DeviceHistory``, and the bounded history of
the running totals gives bit for bit what a history that keeps everything gives."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from zeus_async.aggregate import LiveTotals, history
from zeus_async.aggregate.history import DeviceHistory
from zeus_async.events import GpuSample


@contextlib.contextmanager
def _compact_every(n: int) -> Iterator[None]:
    """Compact a bounded history every ``n`` samples (instead of 1024): short streams then
    go through many compactions."""
    saved = history._COMPACT_EVERY
    history._COMPACT_EVERY = n
    try:
        yield
    finally:
        history._COMPACT_EVERY = saved


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    n=st.integers(min_value=1, max_value=600),
    fine=st.booleans(),
    every=st.integers(min_value=1, max_value=40),
    update_every=st.sampled_from([0, 3, 10]),
    counter_from=st.integers(min_value=0, max_value=100),
    p_missing=st.sampled_from([0.0, 0.1, 0.5]),
    p_duplicate=st.sampled_from([0.0, 0.05]),
)
def test_bounded_history_gives_the_unbounded_figure_bit_for_bit(
    seed: int,
    n: int,
    fine: bool,
    every: int,
    update_every: int,
    counter_from: int,
    p_missing: float,
    p_duplicate: float,
) -> None:
    """After every sample of a random stream: noisy times, duplicates, missing power or
    counter readings, a counter that updates regularly (``update_every``) or at random, and
    one that is first read well after the span's start (``counter_from``)."""
    rng = random.Random(seed)
    kept = DeviceHistory("gpu:0", fine_counter=fine)
    bounded = DeviceHistory("gpu:0", fine_counter=fine, bounded=True)
    t, counter, power = 1_000_000_000, 5_000.0, 300.0
    with _compact_every(every):
        for k in range(n):
            if rng.random() >= p_duplicate:
                t += rng.randrange(1_000_000, 20_000_000)
            if rng.random() < 0.1:
                power = rng.uniform(0.0, 800.0)
            moves = k % update_every == 0 if update_every else rng.random() < 0.3
            if moves:
                counter += 0.5 + power / 100
            reading = counter if k >= counter_from and rng.random() >= p_missing else None
            watts = power if rng.random() >= p_missing else None
            if watts is None and reading is None:
                continue
            kept.add(t, watts, reading)
            bounded.add(t, watts, reading)
            a, b = kept.span_energy(), bounded.span_energy()
            assert (a.energy_j, a.method) == (b.energy_j, b.method), k
    assert bounded.dropped == kept.dropped


def test_bounded_history_stays_small_over_a_long_stream() -> None:
    rng = random.Random(4)
    kept = DeviceHistory("gpu:0")
    bounded = DeviceHistory("gpu:0", bounded=True)
    counter = 0.0
    power = 300.0
    # 100,000 samples every 10 ms (1000 s), the counter updating every 100 ms.
    for k in range(100_000):
        t = k * 10_000_000 + rng.randrange(-1_000_000, 1_000_000)
        if k % 10 == 3:
            counter += power * 0.1
            power = rng.uniform(70.0, 700.0)
        kept.add(t, power, counter)
        bounded.add(t, power, counter)
    assert bounded.span_energy().energy_j == kept.span_energy().energy_j
    assert len(kept._pt) == 100_000
    # What is left: the counter points of the grid fit and the samples since the oldest one,
    # plus at most one compaction's worth.
    assert len(bounded._ct) <= history._SETTLED + history._COMPACT_EVERY // 10 + 1
    assert len(bounded._pt) <= 10 * history._SETTLED + history._COMPACT_EVERY + 10


def test_pre_volta_and_rapl_are_bounded_too() -> None:
    with _compact_every(16):
        gpu = DeviceHistory("gpu:0", bounded=True)
        gpu_kept = DeviceHistory("gpu:0")
        rapl = DeviceHistory("cpu:0/package", fine_counter=True, bounded=True)
        rapl_kept = DeviceHistory("cpu:0/package", fine_counter=True)
        for k in range(5_000):
            t = k * 1_000_000
            gpu.add(t, 100.0 + k % 7, None)
            gpu_kept.add(t, 100.0 + k % 7, None)
            rapl.add(t, None, k * 0.05)
            rapl_kept.add(t, None, k * 0.05)
    assert gpu.span_energy().method == "integrated"
    assert gpu.span_energy().energy_j == gpu_kept.span_energy().energy_j
    assert rapl.span_energy().method == "counter+interpolated"
    assert rapl.span_energy().energy_j == rapl_kept.span_energy().energy_j
    assert len(gpu._pt) <= 17 and len(rapl._ct) <= history._SETTLED + 16


def test_span_energy_is_energy_over_the_span() -> None:
    h = DeviceHistory("gpu:0")
    for k in range(300):
        h.add(k * 10_000_000, 200.0 + (k // 37) * 50, 1000.0 + 2.0 * (k // 10))
    assert h.first_t_ns is not None and h.last_t_ns is not None
    a, b = h.span_energy(), h.energy(h.first_t_ns, h.last_t_ns)
    assert (a.energy_j, a.method) == (b.energy_j, b.method)


def test_live_totals_feed_samples_without_readings_only_to_the_display() -> None:
    totals = LiveTotals()
    totals.add(GpuSample("h", 0, 0, temperature_c=40.0))
    totals.add(GpuSample("h", 10_000_000, 0, power_w=100.0))
    totals.add(GpuSample("h", 20_000_000, 0, power_w=100.0))
    t = totals.devices["gpu:0"]
    assert t.last["temperature_c"] == 40.0
    # The span is that of the samples with power or energy, as in Recording.totals().
    assert (t.first_t_ns, t.last_t_ns, t.energy_j) == (10_000_000, 20_000_000, 1.0)
