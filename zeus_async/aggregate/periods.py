"""Counter periods of a device's history: when each update happened, how its energy is shared.

A coarse energy counter (a GPU's) is exact at its update instants, which samples only bracket.
:class:`CounterPeriods`, the part of :class:`~zeus_async.aggregate.history.DeviceHistory` that
reads its counter points, fits the instants to a regular update grid
(:meth:`CounterPeriods._refined`), merges the periods around updates seen only through wide
brackets (late wake-ups), extends the counter back over the lead-in period before the first
observed update, and gives the counter at any instant with each period's exact energy shared
out inside it by the head model, the integrated power readings or a sloped line
(:meth:`CounterPeriods._split`), as the readings' verdict (:mod:`.readings`) allows. It holds no
samples of its own: :class:`~zeus_async.aggregate.history.DeviceHistory` fills the lists it
reads.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable
from typing import Literal

from .readings import _NAN, SensorModel, _ReadingEvidence

__all__ = ["CounterPeriods"]

logger = logging.getLogger(__name__)

_FIT_RADIUS = 10
#: Most refined update instants a history remembers (see DeviceHistory._refined).
_CACHE_MAX = 256
#: A period between a low and a high neighbour is split as one step unless the power goes on
#: changing the same way beyond a neighbour by this fraction of the jump across the period.
_STEP_TREND = 0.25
#: ... and only where the neighbours differ by this fraction of the larger one at least.
_STEP_MIN = 0.05
#: ... and only where every update involved was seen within this fraction of a period.
_STEP_BRACKET = 0.1

#: A phase constraint is widened by this fraction of the period on each side (a read's stamp
#: is taken a little before the counter is read).
_PHASE_SLACK = 0.005
#: Two neighbouring read intervals whose energies agree within this fraction say how much
#: energy one update holds (:meth:`CounterPeriods._phase_scan`).
_COUNT_TOL = 0.08

_Lead = tuple[float, float, float, float, float, float]


def _phase_arcs(
    arcs: list[tuple[float, float]] | None, lo: float, hi: float, period: int
) -> list[tuple[float, float]] | None:
    """The phases (in ``[0, period)``) of ``arcs`` (``None``: all) that put a grid instant in
    ``(lo, hi]``, widened by :data:`_PHASE_SLACK` periods on each side: ``None`` where that
    allows every phase (no constraint), an empty list where it contradicts ``arcs``."""
    if hi <= lo:
        return None  # a count the interval cannot hold (two updates in one period's time)
    slack = _PHASE_SLACK * period
    lo, hi = lo - slack, hi + slack
    if hi - lo >= period:
        return None
    a = lo % period
    b = a + (hi - lo)
    new = [(a, min(b, float(period)))] + ([(0.0, b - period)] if b > period else [])
    if arcs is None:
        return new
    return [
        (max(x0, y0), min(x1, y1)) for x0, x1 in arcs for y0, y1 in new if max(x0, y0) < min(x1, y1)
    ]


#: How energy is shared out inside a counter period: the head model, the power readings, a line.
_Split = Literal["head", "power", "time"]
_SPLITS: tuple[_Split, ...] = ("time", "power", "head")


class _Memo:
    """Per-pass memory of one history's refined update instants, merged spans and power
    integrals at period edges (:meth:`DeviceHistory.cumulative`): many instants in the same
    counter periods then cost one bisect and a split each, for the same figures."""

    __slots__ = ("_cums", "_history", "_merged", "_refined")

    def __init__(self, history: CounterPeriods) -> None:
        self._history = history
        self._refined: dict[int, float] = {}
        self._merged: dict[int, tuple[int, int] | None] = {}
        self._cums: dict[float, float] = {}

    def refined(self, k: int) -> float:
        value = self._refined.get(k)
        if value is None:
            value = self._refined[k] = self._history._refined(k)
        return value

    def merged(self, i: int) -> tuple[int, int] | None:
        if i in self._merged:
            return self._merged[i]
        value = self._merged[i] = self._history._merged(i)
        return value

    def cum(self, t: float) -> float:
        value = self._cums.get(t)
        if value is None:
            value = self._cums[t] = self._history._cum(t)
        return value


class CounterPeriods:
    """The counter-period arithmetic of :class:`~zeus_async.aggregate.history.DeviceHistory`
    (its base class): every method reads the lists and caches the history keeps, under the
    history's lock (taken by the public methods of the history, never here)."""

    # Set by DeviceHistory.__init__ (see there for what each holds).
    fine_counter: bool
    counter_period_ns: int
    sensor: SensorModel
    first_t_ns: int | None
    power_changes: int
    power_changes_with_counter: int
    _pt: list[int]
    _pw: list[float]
    _pc: list[float]
    _ct: list[int]
    _cb: list[int]
    _ce: list[float]
    _cp: list[float]
    _refined_cache: dict[tuple[int, int, int, float], float]
    _typical_cache: dict[tuple[int, int], float]
    _evidence: _ReadingEvidence
    _ct_first: int | None
    _first_reading: tuple[int, float] | None
    _lead: _Lead | None
    _ct_trimmed: bool
    _pin_cum: dict[float, float]
    _pin_counter: dict[tuple[float, _Split], float]
    _phase_arcs: list[tuple[float, float]] | None
    _phase_upto: int

    def _counter_start(self) -> float:
        """Where the counter's coverage starts: the lead-in's start, else the first update."""
        lead = self._lead_in()
        if lead is not None:
            return lead[0]
        assert self._ct_first is not None
        return self._ct_first

    def _head_model_active(self) -> bool:
        """Whether the instant-power readings behave as :class:`SensorModel` says.

        Evidence: the reported power changes (almost) only in samples that also observe an
        energy-counter update, i.e. the instant reading is refreshed with the counter; and the
        readings are not shown to describe anything else (:attr:`power_readings` is
        ``lagging``, or ``unknown`` while the power has not moved enough to tell): a 1 s
        average refreshed with the counter passes the first test, and is ``averaged`` once
        the power has swung a few times.
        """
        if not self.sensor.head_window_s:
            return False
        return self._refreshed_with_counter() and self._evidence.verdict() in (
            "lagging",
            "unknown",
        )

    def _refreshed_with_counter(self) -> bool:
        """Whether the power readings change (almost) only in samples that also observe a
        counter update: they are refreshed with the counter, so they describe a period that
        has ended (the head of the last one, or the last second), not the moment."""
        sensor = self.sensor
        if self.fine_counter:
            return False
        changes = self.power_changes
        return (
            changes >= sensor.min_evidence
            and self.power_changes_with_counter >= sensor.min_agreement * changes
        )

    def _split(self) -> _Split:
        """How energy is shared out inside a counter period: by the head model (``head``), by
        the integrated power readings (``power``) unless they are shown to describe the past
        (``averaged``, or ``lagging`` without the head model), else along a line through the
        period's mean power (``time``, :meth:`_sloped`)."""
        if self.fine_counter and self.counter_period_ns and self._pt:
            # A counter exact at every read (it updates far faster): fresh power readings
            # place a window edge between two reads.
            return "power"
        if self._head_model_active():
            return "head"
        if self._grid_phase() is not None:
            # The device's update grid: each period's energy is exact at 10 ms-like steps,
            # finer than reads whose power is the counter's own mean since the last read.
            return "time"
        if (
            not self.fine_counter
            and self._pt
            and self._evidence.verdict() in ("instant", "unknown")
        ):
            return "power"
        return "time"

    def _counter_at(self, t_ns: float, split: _Split, memo: _Memo | None = None) -> float:
        """Cumulative energy at ``t_ns`` from the counter points (clamped at the ends), a
        period's energy shared out as ``split`` says (:meth:`_split`).

        ``memo`` (:meth:`cumulative`) remembers the refined update instants, merged spans and
        power integrals at period edges across the calls of one pass: the same figures."""
        refined = self._refined if memo is None else memo.refined
        merged = self._merged if memo is None else memo.merged
        pinned = self._pin_counter.get((t_ns, split))
        if pinned is not None:
            return pinned
        lead = self._lead_in()
        if lead is not None and t_ns < lead[2]:
            # Inside the lead-in period, which ends at the first observed update.
            start, c0, u1, c1, h, nxt = lead
            offset = max(t_ns - start, 0.0)
            energy, length = c1 - c0, u1 - start
            if split != "head":
                return c0 + energy * offset / length
            return c0 + self._period_partial(energy, h, nxt, offset, length)
        ct, ce, cp = self._ct, self._ce, self._cp
        i = bisect.bisect_right(ct, t_ns)
        if not self.fine_counter and len(ct) > 1 and self._grid_phase() is not None:
            # The device's grid puts an update anywhere in its bracket, not only near the
            # bracket's middle: an instant between the first (last) update and that midpoint.
            if i == 0 and t_ns >= refined(0):
                i = 1
            elif i == len(ct) and t_ns < refined(i - 1):
                i -= 1
        t_a = t_b = 0.0
        if 0 < i < len(ct) and not self.fine_counter:
            # The raw instants are midpoints of the sample interval that saw each update;
            # the refined ones come from the regular update grid around them.
            t_a, t_b = refined(i - 1), refined(i)
            if t_ns < t_a and i >= 2:
                i -= 1
                t_a, t_b = refined(i - 1), t_a
            elif t_ns >= t_b and i + 1 < len(ct):
                i += 1
                t_a, t_b = t_b, refined(i)
        elif 0 < i < len(ct):
            t_a, t_b = ct[i - 1], ct[i]
        if 0 < i < len(ct) and not self.fine_counter:
            span = merged(i)
            if span is not None:
                # Split by the readings as before unless they are shown to describe the
                # past without the head model (a 1 s average).
                return self._merged_at(t_ns, *span, by_power=split != "time", memo=memo)
        if i == 0:
            return ce[0]
        if i == len(ct):
            return ce[-1]
        if t_b <= t_a:
            # Two updates fitted to one instant (an irregular counter): a step there.
            return ce[i] if t_ns >= t_b else ce[i - 1]
        offset = min(max(t_ns - t_a, 0), t_b - t_a)
        if split != "head":
            if split == "power" and self.fine_counter and self.counter_period_ns:
                # Exact readings: the energy between two reads shared by the power readings.
                share = offset / (t_b - t_a)
                if self._pt:
                    cum = self._cum if memo is None else memo.cum
                    whole = cum(t_b) - cum(t_a)
                    if whole > 0:
                        share = (self._cum(t_ns) - cum(t_a)) / whole
                return ce[i - 1] + (ce[i] - ce[i - 1]) * share
            if split == "power":
                return self._merged_at(t_ns, i - 1, i, by_power=True, memo=memo)
            if not self.fine_counter and 2 <= i < len(ct) - 1:
                return ce[i - 1] + self._sloped(i, t_a, t_b, offset, refined)
            return ce[i - 1] + (ce[i] - ce[i - 1]) * offset / (t_b - t_a)
        nxt = cp[i + 1] if i + 1 < len(cp) else _NAN
        return ce[i - 1] + self._period_partial(ce[i] - ce[i - 1], cp[i], nxt, offset, t_b - t_a)

    def _sloped(
        self, i: int, t_a: float, t_b: float, offset: float, refined: Callable[[int], float]
    ) -> float:
        """Energy of counter period ``i`` (from ``t_a`` to ``t_b``) up to ``offset`` ns into
        it, without power readings that describe it: the power taken as a straight line
        through the period's mean, its slope from the neighbouring periods' mean powers and
        limited so that it makes no new peak or trough and no negative power (the monotonized
        central limiter of finite-volume schemes). The period's energy is kept exactly. Where
        the neighbours are level with it the line is flat (a split in proportion to time); a
        period between a low and a high one leans towards each. Where that period is one step
        between two levels (:meth:`_step_between`: a square wave, a kernel starting or ending)
        the power is taken as that step instead, placed where it keeps the period's energy.
        """
        ce = self._ce
        t_p, t_n = refined(i - 2), refined(i + 1)
        length = (t_b - t_a) / 1e9
        if t_p >= t_a or t_n <= t_b:
            return (ce[i] - ce[i - 1]) * offset / (t_b - t_a)
        mean = (ce[i] - ce[i - 1]) / length
        before = (ce[i - 1] - ce[i - 2]) / ((t_a - t_p) / 1e9)
        after = (ce[i + 1] - ce[i]) / ((t_n - t_b) / 1e9)
        x = offset / 1e9
        if ((before < mean < after) or (before > mean > after)) and self._step_between(
            i, before, after, refined
        ):
            # One step between the neighbours' levels, placed where it keeps the period's
            # energy: what a kernel starting or ending inside the period looks like.
            at = (after - mean) / (after - before) * length
            return before * x if x < at else before * at + after * (x - at)
        left, right = 2 * (mean - before) / length, 2 * (after - mean) / length
        central = (after - before) / (2 * length)
        if left > 0 and right > 0:
            slope = min(left, right, central)
        elif left < 0 and right < 0:
            slope = max(left, right, central)
        else:
            slope = 0.0
        # No negative power at either end of the period.
        cap = 2 * max(mean, 0.0) / length
        slope = max(-cap, min(cap, slope))
        return mean * x + slope * x * (x - length) / 2

    def _step_between(
        self, i: int, before: float, after: float, refined: Callable[[int], float]
    ) -> bool:
        """Whether counter period ``i``, whose mean lies between its neighbours', looks like
        one step between two levels rather than part of a slope: the power does not go on
        changing the same way beyond either neighbour (by a quarter of the jump across the
        period or more). A smooth swing continues beyond its neighbours and keeps the sloped
        split; a square wave or a kernel boundary does not. Without the period after the
        next (the end of the history), the side before decides."""
        ce = self._ce
        jump = after - before
        if i < 3 or abs(jump) < _STEP_MIN * max(abs(before), abs(after)):
            return False  # level neighbours: a wobble of the readings, not a step
        ct, cb = self._ct, self._cb
        sharp = _STEP_BRACKET * (refined(i) - refined(i - 1))
        if any(ct[k] - cb[k] > sharp for k in range(i - 3, min(i + 3, len(ct)))):
            return False  # an update seen through a late read: the means are not sharp enough
        t0, t1 = refined(i - 3), refined(i - 2)
        if not t0 < t1:
            return False
        outer_before = (ce[i - 2] - ce[i - 3]) / ((t1 - t0) / 1e9)
        if (before - outer_before) / jump >= _STEP_TREND:
            return False
        if i + 2 >= len(ce):
            return True
        t2, t3 = refined(i + 1), refined(i + 2)
        if not t2 < t3:
            return False
        outer_after = (ce[i + 2] - ce[i + 1]) / ((t3 - t2) / 1e9)
        return (outer_after - after) / jump < _STEP_TREND

    def _wide(self, k: int) -> bool:
        """Whether update ``k`` was seen through a bracket over twice as wide as is typical
        around it (a late wake-up, skipped reads): where in it the update happened is not
        known well enough to split energy there."""
        ct, cb = self._ct, self._cb
        lo, hi = max(0, k - _FIT_RADIUS), min(len(ct), k + _FIT_RADIUS + 1)
        if hi - lo < 5:
            return False
        key = (ct[lo], ct[hi - 1])
        typical = self._typical_cache.get(key)
        if typical is None:
            half = sorted(ct[i] - cb[i] for i in range(lo, hi))
            typical = self._typical_cache[key] = max(half[len(half) // 2], 1000)
        return ct[k] - cb[k] > 2 * typical

    def _merged(self, i: int) -> tuple[int, int] | None:
        """The counter points bounding the period ``(i - 1, i)`` once updates seen only through
        wide brackets are passed over (``None`` when neither end is one)."""
        last = len(self._ct) - 1
        j0, j1 = i - 1, i
        while j0 > 0 and self._wide(j0):
            j0 -= 1
        while j1 < last and self._wide(j1):
            j1 += 1
        if (j0, j1) == (i - 1, i) and not self._wide(j0) and not self._wide(j1):
            return None
        return j0, j1

    def _merged_at(
        self, t_ns: float, j0: int, j1: int, *, by_power: bool, memo: _Memo | None = None
    ) -> float:
        """The counter at ``t_ns`` inside the merged periods ``j0 .. j1``: their exact energy
        split in proportion to the integrated power readings (``by_power``, when there are
        any), else to time."""
        ce = self._ce
        refined = self._refined if memo is None else memo.refined
        cum_edge = self._cum if memo is None else memo.cum
        t_a, t_b = refined(j0), refined(j1)
        if t_b <= t_a:
            return ce[j1] if t_ns >= t_b else ce[j0]
        t = min(max(t_ns, t_a), t_b)
        share = (t - t_a) / (t_b - t_a)
        if by_power and self._pt:
            whole = cum_edge(t_b) - cum_edge(t_a)
            if whole > 0:
                share = (self._cum(t) - cum_edge(t_a)) / whole
        return ce[j0] + (ce[j1] - ce[j0]) * share

    def _lead_in(self) -> _Lead | None:
        """The counter period that ends at the first observed update: ``(start, first
        reading, first update's instant, its value, head power, next head power)``.

        A coarse counter's first reading holds the value of an update before it (an instant
        no sample saw), so it is no interpolation point by itself; but updates come on a
        regular grid, so that update lies one period before the first observed one (and no
        later than the reading). With it, the counter covers the span from its first reading
        on, and the first partial period is apportioned like any other instead of being
        integrated from the power readings (which on H100s describe the period before). Needs
        three observed updates and a counter reading in the span's first sample; kept once
        final (the grid fit around the first update is).
        """
        ct, first = self._ct, self._first_reading
        phase = self._grid_phase()
        if self._lead is not None and phase is None:
            return self._lead
        if self.fine_counter or first is None or len(ct) < 3 or self._ct_trimmed:
            return None
        if first[0] != self.first_t_ns:
            # The counter was first read after the span began: the head stays integrated from
            # power (and a bounded history need not keep the samples before that reading).
            return None
        if phase is not None:
            # The device's grid: the lead-in starts at the last update at or before the first
            # reading, whose value the reading holds.
            period = self.counter_period_ns
            start = math.floor((first[0] - phase) / period) * period + phase
            u1 = self._refined(0)
            if start >= u1:
                return None
            return (start, first[1], u1, self._ce[0], self._cp[0], self._cp[1])
        n = min(len(ct), _FIT_RADIUS + 1)
        diffs = sorted(ct[i + 1] - ct[i] for i in range(n - 1))
        period = diffs[len(diffs) // 2]
        u1 = self._refined(0)
        start = min(u1 - period, float(first[0]))
        if period <= 0 or start >= u1:
            return None
        lead = (start, first[1], u1, self._ce[0], self._cp[0], self._cp[1])
        if len(ct) > _FIT_RADIUS + 1:
            self._lead = lead
        return lead

    def _refined(self, k: int) -> float:
        """Update instant ``k`` from a regular grid fitted to its neighbours' brackets.

        Counter updates lie on a regular grid, so a weighted least-squares line
        ``instant = a + b * period_index`` through up to ``_FIT_RADIUS`` updates on each side
        averages the half-bracket error of single midpoints away. Falls back to the midpoint
        with too few neighbours.
        """
        ct = self._ct
        phase = self._grid_phase()
        if phase is not None:
            # The device's period on its fitted phase: the last grid instant at or before the
            # read that saw the update.
            period = self.counter_period_ns
            read = 2 * ct[k] - self._cb[k]
            return float(math.floor((read - phase) / period) * period + phase)
        lo, hi = max(0, k - _FIT_RADIUS), min(len(ct), k + _FIT_RADIUS + 1)
        key = (ct[lo], ct[k], ct[hi - 1], self._ce[k])
        cache = self._refined_cache
        value = cache.get(key)
        if value is None:
            if len(cache) >= _CACHE_MAX:
                cache.clear()
                self._typical_cache.clear()
            value = cache[key] = self._fit(k, lo, hi)
        return value

    def _phase_constrain(self, lo: float, hi: float) -> None:
        """An update instant of the device's grid lies in ``(lo, hi]``: keep the phases
        (instants modulo :attr:`counter_period_ns`) that allow it. Where none is left the
        bracket contradicts the earlier ones (a stamp off, an update of no energy): the phase
        is anchored on it anew."""
        arcs = _phase_arcs(self._phase_arcs, lo, hi, self.counter_period_ns)
        if arcs is not None and not arcs:
            logger.debug("counter grid phase re-anchored at %d ns", int(lo))
            arcs = _phase_arcs(None, lo, hi, self.counter_period_ns)
        if arcs is not None:
            self._phase_arcs = arcs

    def _phase_scan(self) -> tuple[float, float] | None:
        """Read the counter points not read yet for the grid's phase; returns the constraint
        the last one gives as far as can be told yet (its count judged by the energy of the
        interval before it alone), which is not kept.

        A read interval ``(a, b]`` holding ``n`` updates of period ``P`` puts the first of them
        in ``(max(a, b - n P), min(a + P, b - (n - 1) P)]``. The count is certain where the
        interval is shorter than the period (an observed update: one; none seen: none, see
        :meth:`DeviceHistory.add`); where it is up to 1.5 periods long, it is one or two, told
        apart by the energy where both neighbouring intervals (each up to 1.5 periods long,
        so that two neighbours never both hold two) agree on what one update holds.
        """
        ct, cb, ce = self._ct, self._cb, self._ce
        period = self.counter_period_ns
        start = bisect.bisect_right(ct, self._phase_upto)
        n_ct = len(ct)
        for i in range(start, n_ct):
            a, b = cb[i], 2 * ct[i] - cb[i]
            length = b - a
            if length < period:
                self._phase_constrain(a, b)
            elif i >= 2 and 2 * length < 3 * period and 2 * (ct[i - 1] - cb[i - 1]) < 3 * period:
                before = ce[i - 1] - ce[i - 2]
                last = i + 1 >= n_ct
                after = before if last else ce[i + 1] - ce[i]
                unit = (before + after) / 2
                if (
                    unit > 0
                    and abs(before - after) <= _COUNT_TOL * unit
                    and (last or 2 * (ct[i + 1] - cb[i + 1]) < 3 * period)
                ):
                    ratio = (ce[i] - ce[i - 1]) / unit
                    n = (
                        1
                        if abs(ratio - 1) <= _COUNT_TOL
                        else 2
                        if abs(ratio - 2) <= 2 * _COUNT_TOL
                        else 0
                    )
                    if n:
                        bounds = max(a, b - n * period), min(a + period, b - (n - 1) * period)
                        if last:
                            return bounds  # read again with the next interval's energy
                        self._phase_constrain(*bounds)
            if i + 1 >= n_ct and length >= period:
                break  # its count waits for the next interval
            self._phase_upto = ct[i]
        return None

    def _grid_phase(self) -> float | None:
        """The phase (update instants modulo :attr:`counter_period_ns`) of the device's update
        grid, for a coarse counter whose period the device says (issue 37), else ``None``.

        Fixed by the read intervals whose update count is certain (:meth:`_phase_scan`): the
        middle of the widest arc of phases they allow, as far as can be from the reads that
        bound it (reads that keep their phase against the grid leave a wide arc, where every
        phase counts the updates alike; drifting ones narrow it). ``None`` (the grid learned
        from the samples) until some interval constrains it.
        """
        period = self.counter_period_ns
        if not period or self.fine_counter:
            return None
        pending = self._phase_scan()
        arcs = self._phase_arcs
        if pending is not None:
            arcs = _phase_arcs(arcs, *pending, period) or arcs
        if not arcs:
            return None
        arcs = sorted(arcs)
        a, b = max(arcs, key=lambda arc: arc[1] - arc[0])
        if len(arcs) > 1 and arcs[0][0] == 0.0 and arcs[-1][1] == period:
            # One arc across the period's end, split in two.
            head, tail = arcs[0], arcs[-1]
            if head[1] + period - tail[0] > b - a:
                return (tail[0] + head[1] + period) / 2 % period
        return (a + b) / 2

    def _fit(self, k: int, lo: int, hi: int) -> float:
        """The instant of update ``k`` on the grid fitted to updates ``lo`` to ``hi - 1``.

        Each update is known to lie in its bracket ``(cb, 2 * ct - cb]``; the midpoint ``ct``
        is off by up to half the bracket. A bracket more than twice the neighbourhood's median
        width (a late wake-up, skipped reads) weighs ``(2 * median / width) ** 2``; the others
        weigh 1 (a sample's stamp is only as good as the wake-up behind it, so a narrower
        bracket is not trusted more than a typical one). Grid indices are counted from the
        nearest bracket that is not wide: a wide one's midpoint can sit half a period from its
        update and round to the wrong index. A wide bracket's own instant is the last grid
        instant inside it (a bracket that spans two refreshes reached its counter value at the
        later one).
        """
        ct, cb = self._ct, self._cb
        if hi - lo < 5:
            return float(ct[k])
        diffs = sorted(ct[i + 1] - ct[i] for i in range(lo, hi - 1))
        period = diffs[len(diffs) // 2]
        if period <= 0:
            return float(ct[k])
        half = [ct[i] - cb[i] for i in range(lo, hi)]
        typical = max(sorted(half)[len(half) // 2], 1000)
        ref = min(range(lo, hi), key=lambda i: (half[i - lo] > 2 * typical, abs(i - k)))
        xs = [round((ct[i] - ct[ref]) / period) for i in range(lo, hi)]
        ys = [ct[i] - ct[ref] for i in range(lo, hi)]
        ws = [1.0 if h <= 2 * typical else (2 * typical / h) ** 2 for h in half]
        sw = sum(ws)
        mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
        my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
        sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
        if sxx == 0:
            return float(ct[k])
        slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / sxx
        intercept = my - slope * mx
        if half[k - lo] > 2 * typical and slope > 0:
            start, end = cb[k] - ct[ref], 2 * ct[k] - cb[k] - ct[ref]
            last = intercept + slope * math.floor((end - intercept) / slope)
            if last > start:
                return ct[ref] + last
        return ct[ref] + my - slope * (mx - xs[k - lo])

    def _period_partial(
        self, energy: float, h: float, c: float, offset_ns: float, length_ns: float
    ) -> float:
        """Energy of a counter period (``energy`` over ``length_ns``) up to ``offset_ns``.

        The period's energy ``E`` is exact. Its head power ``h`` (the mean over the first
        ``head_window_s``) was reported by the sample that observed the update ending it; the
        next period's head ``c`` by the one that observed the next update. The tail is taken as one
        step from ``h`` to ``c`` placed so that the energies add up to ``E`` — exact for
        piecewise-constant power with at most one step in the tail — and uniform when that
        does not fit.
        """
        length = length_ns / 1e9
        x = offset_ns / 1e9
        w = min(self.sensor.head_window_s, length)
        if h != h or length <= 0:  # NaN: no head reading
            return energy * x / length if length > 0 else 0.0
        tail_e = energy - h * w
        tail_l = length - w
        if tail_e < 0 or tail_l <= 0:
            return energy * x / length
        segments: list[tuple[float, float, float]] = [(0.0, w, h)]
        step = (tail_e - c * tail_l) / (h - c) if c == c and abs(h - c) > 1e-9 else -1.0
        if 0.0 <= step <= tail_l:
            segments += [(w, w + step, h), (w + step, length, c)]
        else:
            segments.append((w, length, tail_e / tail_l))
        total = 0.0
        for a, b, power in segments:
            if x <= a:
                break
            total += power * (min(x, b) - a)
        return total

    def _cum(self, t_ns: float) -> float:
        """Cumulative integrated power at ``t_ns`` (power held constant outside the samples)."""
        pinned = self._pin_cum.get(t_ns)
        if pinned is not None:
            return pinned
        pt, pw, pc = self._pt, self._pw, self._pc
        i = bisect.bisect_right(pt, t_ns)
        if i == 0:
            return pc[0] - pw[0] * (pt[0] - t_ns) / 1e9
        if i == len(pt):
            return pc[-1] + pw[-1] * (t_ns - pt[-1]) / 1e9
        t_a, t_b = pt[i - 1], pt[i]
        p_a, p_b = pw[i - 1], pw[i]
        f = (t_ns - t_a) / (t_b - t_a)
        p_t = p_a + (p_b - p_a) * f
        return pc[i - 1] + (p_a + p_t) / 2 * (t_ns - t_a) / 1e9

    def _integral(self, t0_ns: float, t1_ns: float) -> float:
        if t1_ns <= t0_ns:
            return 0.0
        return self._cum(t1_ns) - self._cum(t0_ns)
