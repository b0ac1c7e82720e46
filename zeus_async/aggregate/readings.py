"""What a device's power readings describe, judged online against its energy counter.

:class:`SensorModel` says how a GPU's instant-power reading relates to its counter (H100s: the
reading refreshed with the counter averages the head of the period that just ended), and
:class:`_ReadingEvidence` weighs, at each counter update, how the readings moved against the
counter periods' exact mean power: its verdict (``instant``, ``lagging``, ``averaged`` or
``unknown``) is :attr:`~zeus_async.aggregate.history.DeviceHistory.power_readings`, and decides
how :class:`~zeus_async.aggregate.history.DeviceHistory` shares a period's energy out
(:mod:`.periods`).
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["SensorModel"]

logger = logging.getLogger(__name__)

_NAN = float("nan")
#: What the power readings describe (:attr:`DeviceHistory.power_readings`): a counter period
#: counts as evidence when its mean power differs from the previous period's by at least
#: _SWING_W and _SWING_FRAC of the larger (a power that does not move tells nothing); the
#: verdict needs _MIN_SWINGS such periods and is final after _MAX_SWINGS. Readings that move
#: less than _SMOOTH_RATIO of the swings, or stray from both their own period's mean power and
#: the previous one's by more than _STRAY_RATIO of them, are averaged; readings whose mean
#: strays from the previous period's by at most _LAGGING_RATIO of the swings (and less than
#: from their own period's) describe the previous period. Measured on the simulator (10 ms
#: reads, square and random loads, with and without stalls): 1 s averages move 0.0-0.17 of
#: the swings (or, settling after a step just before the stream began, stray 4x from both);
#: instant and H100 readings move 0.68 and more and stray at most 1.1x from the nearer; H100
#: readings stray 0.0-0.34 from the previous period, 0.9 and more from their own; instant
#: readings the other way round.
_SWING_W, _SWING_FRAC = 2.0, 0.05
_MIN_SWINGS, _MAX_SWINGS = 5, 64
_LAGGING_RATIO, _SMOOTH_RATIO, _STRAY_RATIO = 0.5, 0.5, 1.5
#: Counter periods whose median gives the period length the evidence divides by (and the
#: usual bracket width), and the fewest it starts with.
_PERIODS_MEDIAN, _PERIODS_LEAST = 9, 3


class SensorModel:
    """How a GPU's instant-power reading relates to its energy counter.

    Defaults describe H100s as measured (and as the simulator models them): the counter
    updates every ~100 ms, and the instant-power reading, refreshed at the same moment,
    averages the first 25 ms of the counter period that just ended. A history uses this only
    after checking it online (``min_evidence`` power changes, ``min_agreement`` of them
    coinciding with counter updates); otherwise energy inside a counter period is split in
    proportion to time.

    Args:
        head_window_s: Length of the averaged head of each period (0 disables the model).
        min_evidence: Power-reading changes to see before trusting the model.
        min_agreement: Fraction of them that must coincide with counter updates.
    """

    __slots__ = ("head_window_s", "min_agreement", "min_evidence")

    def __init__(
        self, head_window_s: float = 0.025, min_evidence: int = 5, min_agreement: float = 0.9
    ) -> None:
        self.head_window_s = head_window_s
        self.min_evidence = min_evidence
        self.min_agreement = min_agreement


class _ReadingEvidence:
    """What a device's power readings describe, judged online against its energy counter.

    At each counter update, the period it ends has an exact mean power ``M`` (its energy over
    the period length, the median of recent update intervals), and the power readings taken
    while it ran (from the sample after the previous update to the one that saw this one) a
    mean ``R``. Each period whose ``M`` moved from the previous period's (a *swing*) is
    evidence, once the next period is in too:

    * ``d0``: how far that period's ``R`` strays from its ``M``. Instant readings follow their
      own period: small.
    * ``d1``: how far the next period's ``R`` strays from it. Readings that describe the
      period before the last update (an H100's: the head of that period) follow it: small.
    * ``moves``: how much ``R`` moved across the swing (the larger of its steps into and out
      of the period). Instant and lagging readings move as much as ``M``; a 1 s average, over
      ten periods, about a tenth of it.

    Periods bounded by a bracket over twice the usual width (a stall) are no evidence.

    Updated by :meth:`DeviceHistory.add` (and :meth:`DeviceHistory.from_arrays`, with the
    same arithmetic in the same order), so that every history holding the same samples
    agrees, bounded or not, trimmed or not.
    """

    __slots__ = (
        "d0",
        "d1",
        "diffs",
        "last",
        "moves",
        "narrow",
        "pending",
        "pn",
        "prev_m",
        "prev_r",
        "psum",
        "swing",
        "swings",
        "widths",
    )

    def __init__(self) -> None:
        self.diffs: collections.deque[int] = collections.deque(maxlen=_PERIODS_MEDIAN)
        # The last brackets' widths, and whether the last update's was narrow.
        self.widths: collections.deque[int] = collections.deque(maxlen=_PERIODS_MEDIAN)
        self.narrow = False
        self.last: tuple[int, float] | None = None  # the last update: raw instant, value
        self.prev_m = self.prev_r = _NAN  # the last period's M and R
        # The last period, when it was a swing: (|M - previous M|, M, R, previous R).
        self.pending: tuple[float, float, float, float] | None = None
        self.psum, self.pn = 0.0, 0  # running sum and count of the readings at that update
        self.swing = self.d0 = self.d1 = self.moves = 0.0
        self.swings = 0

    def state(self) -> tuple[object, ...]:
        """Everything it holds (two that hold the same were fed the same)."""
        return tuple(
            list(value) if isinstance(value, collections.deque) else value
            for value in (getattr(self, name) for name in self.__slots__)
        )

    @classmethod
    def from_arrays(
        cls,
        ct: npt.NDArray[np.int64],
        ce: npt.NDArray[np.float64],
        psum: npt.NDArray[np.float64],
        pn: npt.NDArray[np.int64],
        width: npt.NDArray[np.int64],
    ) -> _ReadingEvidence:
        """What :meth:`update` of each update in turn leaves, from arrays (one entry per
        update: raw instant, value, running sum and count of the readings, bracket width):
        the same arithmetic on the same values, a loop only over the evidence itself."""
        import numpy as np

        self = cls()
        n = len(ct)
        if not n:
            return self
        nan = np.nan
        # Mean of the readings since the previous update.
        psum_prev = np.concatenate(([0.0], psum[:-1]))
        pn_prev = np.concatenate(([0], pn[:-1]))
        got = pn > pn_prev
        r = np.full(n, nan)
        r[got] = (psum[got] - psum_prev[got]) / (pn[got] - pn_prev[got])
        # Narrow brackets: within twice the median of the last (up to 9, at least 3) widths.
        narrow = np.zeros(n, dtype=bool)
        median_w = _running_median(width, _PERIODS_MEDIAN, _PERIODS_LEAST)
        narrow[_PERIODS_LEAST - 1 :] = width[_PERIODS_LEAST - 1 :] <= 2 * median_w
        # Mean power of each period (from the second update on), where both brackets are
        # narrow and it spans one period of the median interval.
        m = np.full(n, nan)
        if n > 1:
            diff = ct[1:] - ct[:-1]  # diff[k - 1] ends at update k
            period = _running_median(diff, _PERIODS_MEDIAN, _PERIODS_LEAST)  # from k = 3 on
            k = np.arange(_PERIODS_LEAST, n)
            if len(k):
                d, per = diff[k - 1], period
                ok = narrow[k - 1] & narrow[k] & (per > 0)
                ok[ok] = np.rint(d[ok] / per[ok]) == 1
                m[k[ok]] = (ce[k[ok]] - ce[k[ok] - 1]) / per[ok] * 1e9
        prev_m = np.concatenate(([nan, nan], m[1:-1]))[:n]
        prev_r = np.concatenate(([nan, nan], r[1:-1]))[:n]
        finite = ~np.isnan(m) & ~np.isnan(r)
        both = finite & ~np.isnan(prev_m) & ~np.isnan(prev_r)
        step = np.abs(m - prev_m)
        swing = np.zeros(n, dtype=bool)
        swing[both] = step[both] >= np.maximum(
            _SWING_W, _SWING_FRAC * np.maximum(m[both], prev_m[both])
        )
        # Evidence is taken at the update after a swing, where that one has M and R.
        events = np.flatnonzero(swing[:-1] & finite[1:])[:_MAX_SWINGS] + 1
        for k in events.tolist():
            j = k - 1
            self.swing += float(step[j])
            self.d0 += abs(float(r[j]) - float(m[j]))
            self.d1 += abs(float(r[k]) - float(m[j]))
            self.moves += max(abs(float(r[j]) - float(prev_r[j])), abs(float(r[k]) - float(r[j])))
        self.swings = len(events)
        # The rest of the state: as after the last update (or, once final, after the one
        # that made it so, for what only the evidence keeps).
        end = int(events[-1]) if self.swings >= _MAX_SWINGS else n - 1
        self.last = (int(ct[-1]), float(ce[-1]))
        self.psum, self.pn = float(psum[-1]), int(pn[-1])
        self.widths.extend(width[-_PERIODS_MEDIAN:].tolist())
        self.narrow = bool(narrow[-1])
        if end >= 1:
            self.diffs.extend((ct[1 : end + 1] - ct[:end])[-_PERIODS_MEDIAN:].tolist())
            self.prev_m, self.prev_r = float(m[end]), float(r[end])
            if swing[end]:
                self.pending = (float(step[end]), float(m[end]), float(r[end]), float(prev_r[end]))
        return self

    def note(
        self, t_ns: int, counter_j: float, psum: float, pn: int, width: int
    ) -> tuple[tuple[int, float] | None, float, bool]:
        """What every update changes, evidence or not: the previous update, the mean of the
        readings since it, and whether its bracket was narrow."""
        last, self.last = self.last, (t_ns, counter_j)
        r = (psum - self.psum) / (pn - self.pn) if pn > self.pn else _NAN
        self.psum, self.pn = psum, pn
        widths = self.widths
        widths.append(width)
        was_narrow = self.narrow
        # A bracket over twice the usual width (a stall, skipped reads) leaves the update's
        # instant, and which readings fell in which period, too uncertain to judge by.
        self.narrow = len(widths) >= _PERIODS_LEAST and (
            width <= 2 * sorted(widths)[len(widths) // 2]
        )
        return last, r, was_narrow

    def update(self, t_ns: int, counter_j: float, psum: float, pn: int, width: int) -> None:
        """Counter update seen at raw instant ``t_ns`` (value ``counter_j``) through a bracket
        ``width`` ns wide, with the running sum and count of every power reading so far (that
        of the sample that saw it too)."""
        last, r, was_narrow = self.note(t_ns, counter_j, psum, pn, width)
        if last is None or self.swings >= _MAX_SWINGS:
            return
        diff = t_ns - last[0]
        diffs = self.diffs
        diffs.append(diff)
        m = _NAN
        if len(diffs) >= _PERIODS_LEAST and was_narrow and self.narrow:
            period = sorted(diffs)[len(diffs) // 2]
            # A bracket that spans two updates gives no period of its own.
            if period > 0 and round(diff / period) == 1:
                m = (counter_j - last[1]) / period * 1e9
        pending, self.pending = self.pending, None
        if pending is not None and m == m and r == r:
            swing, m_s, r_s, r_before = pending
            self.swing += swing
            self.d0 += abs(r_s - m_s)
            self.d1 += abs(r - m_s)
            self.moves += max(abs(r_s - r_before), abs(r - r_s))
            self.swings += 1
        prev_m, prev_r = self.prev_m, self.prev_r
        self.prev_m, self.prev_r = m, r
        if m == m and r == r and prev_m == prev_m and prev_r == prev_r:
            swing = abs(m - prev_m)
            if swing >= max(_SWING_W, _SWING_FRAC * max(m, prev_m)):
                self.pending = (swing, m, r, prev_r)

    def verdict(self) -> str:
        """``instant``, ``lagging``, ``averaged`` or ``unknown`` (see
        :attr:`DeviceHistory.power_readings`)."""
        if self.swings < _MIN_SWINGS:
            return "unknown"
        if self.moves < _SMOOTH_RATIO * self.swing:
            return "averaged"
        if min(self.d0, self.d1) > _STRAY_RATIO * self.swing:
            return "averaged"  # far from both periods: a longer past (an average settling)
        if self.d1 <= _LAGGING_RATIO * self.swing and self.d1 < self.d0:
            return "lagging"
        return "instant"


def _running_median(values: npt.NDArray[np.int64], most: int, least: int) -> npt.NDArray[np.int64]:
    """For each index from ``least - 1`` on: the element at ``len // 2`` of the sorted last
    ``most`` values up to it (fewer at the start), as ``sorted(deque)[len // 2]`` gives."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    n = len(values)
    out = np.zeros(max(n - least + 1, 0), dtype=values.dtype)
    for i in range(least - 1, min(most - 1, n)):
        out[i - least + 1] = sorted(values[: i + 1].tolist())[(i + 1) // 2]
    if n >= most:
        out[most - least :] = np.sort(sliding_window_view(values, most), axis=1)[:, most // 2]
    return out
