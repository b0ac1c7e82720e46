"""Adaptive power-limit profiling: its settings, and the per-step statistics that end it early.

:class:`AdaptiveOptions` says when a warmup has settled, when a limit is known well enough and
when descending stops; :class:`_StepStats` gathers one limit's per-step windows (outliers left
out) and answers the first two, for
:class:`~zeus_async.optimizer.power_limit.GlobalPowerLimitOptimizer` (``adaptive=True``).
"""

from __future__ import annotations

import collections
import logging
import math
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from ..aggregate.windows import WindowResult

__all__ = ["OUTLIER_FACTOR", "AdaptiveOptions"]

logger = logging.getLogger(__name__)


class AdaptiveOptions(msgspec.Struct, frozen=True):
    """Settings of adaptive profiling.

    A warmup ends (before ``warmup_steps``) once two consecutive steps, from the second after
    the limit change on, differ by at most twice ``tolerance`` in time and in energy. A limit's
    profiling stops once at least ``min_steps`` per-step measurements are in and the 95 %
    confidence half-widths of the mean step time and the mean step energy are both within
    ``tolerance`` of the means (or after ``profile_steps``). Steps slower than
    :data:`OUTLIER_FACTOR` times the median (a host stall, a checkpoint save) are left out; the
    measurement is the per-step means times ``profile_steps``, so it compares with full
    profiles. Descending stops when the selector's choice can no longer change, assuming step
    time does not fall and the selector's cost is unimodal as the limit drops: for
    ``MaxSlowdownConstraint`` at the first limit slower than allowed; for the others once the
    latest ``patience`` limits all cost more than the best by more than twice ``tolerance``.
    """

    tolerance: float = 0.01
    min_steps: int = 6
    patience: int = 2


def _t95(n: int) -> float:
    """Two-sided 95 % Student-t quantile for ``n - 1`` degrees of freedom."""
    table = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
    return table.get(n - 1, 2.23 if n - 1 < 15 else 2.0 if n - 1 < 60 else 1.96)


class _Running:
    """Mean and variance of a stream of values, updated in O(1) (Welford)."""

    __slots__ = ("m2", "mean", "n")

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    def cv(self) -> float:
        """Sample standard deviation over mean."""
        if self.n < 2 or self.mean <= 0:
            return math.inf
        return math.sqrt(self.m2 / (self.n - 1)) / self.mean


#: Adaptive mode: a step slower than this multiple of the median step is an outlier (a stall
#: of the host, a checkpoint save, a data-loader hiccup) and left out of the estimates.
OUTLIER_FACTOR = 1.5


class _StepStats:
    """Per-step windows of one warmed-up or profiled limit (adaptive mode)."""

    def __init__(self) -> None:
        self.pending: collections.deque[WindowResult] = collections.deque()
        self.steps: list[tuple[float, float]] = []  # (time s, energy J) per finished step
        self.last: tuple[tuple[float, float] | None, tuple[float, float] | None] = (None, None)
        self._kept: tuple[_Running, _Running, int] | None = None

    def collect(self) -> None:
        pending = self.pending
        while pending and pending[0].done():
            result = pending.popleft()
            try:
                m = result.wait(0)
            except Exception:  # a cancelled or failed step window: skip it
                continue
            if m.gpu_energy_j:
                step = (m.time_s, sum(m.gpu_energy_j.values()))
                self.steps.append(step)
                self.last = (self.last[1], step)
                self._kept = None

    def kept(self) -> tuple[_Running, _Running, int]:
        """Time and energy statistics of the steps that are not outliers, and their count."""
        if self._kept is None:
            times = sorted(t for t, _ in self.steps)
            limit = OUTLIER_FACTOR * times[len(times) // 2] if times else math.inf
            t_run, e_run = _Running(), _Running()
            for t, e in self.steps:
                if t <= limit:
                    t_run.add(t)
                    e_run.add(e)
            self._kept = (t_run, e_run, len(self.steps) - t_run.n)
        return self._kept

    @property
    def n(self) -> int:
        return self.kept()[0].n

    def steady(self, tolerance: float) -> bool:
        """The last two steps' time and energy differ by at most ``tolerance`` (relative)."""
        a, b = self.last
        if a is None or b is None:
            return False
        return all(abs(x - y) <= tolerance * max(abs(x), abs(y)) for x, y in zip(a, b, strict=True))

    def relative_half_widths(self) -> tuple[float, float]:
        """95 % confidence half-widths of the mean step time and energy (outliers left out),
        relative to the means."""
        t_run, e_run, _ = self.kept()
        n = t_run.n
        if n < 2:
            return math.inf, math.inf
        t = _t95(n) / math.sqrt(n)
        return t * t_run.cv(), t * e_run.cv()
