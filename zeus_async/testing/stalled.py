"""Synthetic energy-counter streams with stalled reads, for tests and benchmarks of windows
whose samples came late (``tests/aggregate/test_late_edges.py``,
``bench/windows/bench_late_edges.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from ..aggregate.history import DeviceHistory, EnergyEstimate

__all__ = ["short_windows", "stalled_stream"]

MS = 1_000_000
_PERIOD = 100 * MS


def stalled_stream(
    rng: random.Random, *, stall_share: float, stall_max_ms: float, square: bool
) -> tuple[DeviceHistory, Callable[[float], float]]:
    """A device's history over 3 s: a 100 ms energy counter, reads every 10 ms (±25 %
    jitter), a share ``stall_share`` of them stalled for 20 ms to ``stall_max_ms``; power
    constant (70 W) or a 70/300 W square wave (85 ms halves) whose readings lag 5 ms. Returns
    the history and the exact energy from time 0 (J at ns)."""
    phase = rng.uniform(0, _PERIOD)

    def power(t: float) -> float:
        return 70.0 if not square or (t // (85 * MS)) % 2 == 0 else 300.0

    def energy(t: float) -> float:
        if not square:
            return 70.0 * t / 1e9
        n = int(t // (85 * MS))
        full = sum(70.0 if k % 2 == 0 else 300.0 for k in range(n)) * 0.085
        return full + power(t) * (t - n * 85 * MS) / 1e9

    h = DeviceHistory("gpu:0")
    t = 0
    while t < 3_000 * MS:
        stalled = rng.random() < stall_share
        gap = rng.uniform(20, stall_max_ms) * MS if stalled else 10 * MS
        t += int(gap * rng.uniform(0.8, 1.3))
        k = int((t - phase) // _PERIOD)
        update = phase + k * _PERIOD
        h.add(t, power(t - 5 * MS), 1000.0 + (energy(update) if k >= 0 else 0.0))
    return h, energy


def short_windows(
    rng: random.Random, count: int, **stream: bool | float
) -> Iterator[tuple[EnergyEstimate, float]]:
    """``count`` random 2-5 ms windows between 1 s and 2.5 s of one :func:`stalled_stream`:
    each window's figure, and the truth."""
    h, energy = stalled_stream(rng, **stream)  # type: ignore[arg-type]
    for _ in range(count):
        t0 = int(rng.uniform(1_000, 2_500) * MS)
        t1 = t0 + int(rng.uniform(2, 5) * MS)
        yield h.energy(t0, t1), energy(t1) - energy(t0)
