"""Per-device sample histories and the energy estimators that read them.

A :class:`DeviceHistory` keeps, for one device, the power samples (with their cumulative
trapezoid integral) and the points where its energy counter was seen to move. Energy over any
interval ``[t0, t1]`` then comes from the best source that covers it:

* **counter** (Volta+ GPUs, RAPL): the counter is exact at its update instants. An update is
  observed by the first sample after it, so its instant lies in the *bracket* between that
  sample and the previous one; the instant is taken from a regular update grid fitted to the
  brackets around it. A bracket widened by a late wake-up or by skipped reads counts little in
  that fit, and its own update is put on the last grid instant inside it; where such updates
  leave the split unknown, the periods around them are merged (see :meth:`DeviceHistory.energy`
  on late edges). Each period's energy is exact; how it is shared out inside the period
  depends on what the power readings describe, judged online against the counter
  (:attr:`DeviceHistory.power_readings`): in proportion to the integrated readings where they
  describe their own moment (``instant``); where they follow :class:`SensorModel` (H100-like:
  the reading refreshed with the counter averages the head of the period, ``lagging``), as a
  head level plus at most one step to the next period's head level, fitted to the exact
  period energy; otherwise (a 1 s average, ``averaged``; too little evidence; no readings)
  along a line through the period's mean power leaning towards its neighbours'. Readings
  that describe the past never split a period. This never reports 0 J for a window shorter
  than the counter period.
* **integrated** (pre-Volta GPUs, or no counter update yet around the interval): power samples
  integrated with the trapezoid rule, held constant beyond the first and last sample.
* **counter** (a counter but no power samples): the counter between its first and last observed
  updates; the partial periods at the ends are unknown and left out.

The same estimator gives every energy figure: measurement windows (:meth:`DeviceHistory.energy`),
the running totals of ``monitor``/``replay`` and the totals of ``inspect``/``Recording``
(:meth:`DeviceHistory.span_energy`, the device's whole span). A *bounded* history (the running
totals) forgets samples the span's energy no longer needs and keeps the few start-of-span values
it does need, computed once they are final, so it gives bit-for-bit the figure a history that
kept everything would.

Histories are appended from the runtime's thread and read from any thread, under a lock.

The parts, each in its own module: what the power readings describe (:mod:`.readings`), the
counter periods' instants and how each period's energy is shared out (:mod:`.periods`, the base
class of :class:`DeviceHistory`), and the figures with their uncertainty (:mod:`.estimate`).
This module keeps the samples (writing, trimming, compacting) and answers from them.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from ..events import GpuSample, RaplSample
from .arraylist import ArrayList
from .averages import AverageReadings
from .estimate import EnergyEstimate, window_measurement
from .periods import _FIT_RADIUS, _SPLITS, CounterPeriods, _Lead, _Memo, _Split
from .readings import _NAN, SensorModel, _ReadingEvidence

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "DeviceHistory",
    "EnergyEstimate",
    "SensorModel",
    "add_sample",
    "history_key",
    "reads_exact",
    "window_measurement",
]

logger = logging.getLogger(__name__)

#: Counter updates after which the span's start values are final (the grid fits around the first
#: updates no longer change), and how many a bounded history keeps.
_SETTLED = 2 * _FIT_RADIUS + 4
#: Read intervals of two counter periods or more after which a device's counter is taken as
#: exact at every reading (DeviceHistory._decide_exact, reads_exact).
_EXACT_READS = 3
#: Samples between two compactions of a bounded history.
_COMPACT_EVERY = 1024
#: An edge whose samples around it are this many typical sample intervals apart came late.
LATE_FACTOR = 3.0


def history_key(event: GpuSample | RaplSample) -> str:
    """The device a sample belongs to: ``gpu:0``, ``cpu:0/package``."""
    if isinstance(event, GpuSample):
        return f"gpu:{event.gpu}"
    return f"cpu:{event.package}/{event.domain}"


def add_sample(history: DeviceHistory, event: GpuSample | RaplSample) -> None:
    """Account one sample in its device's history: every estimator is fed by this.

    A NaN reading counts as no reading (a recording written elsewhere may hold one; our
    samplers never publish one), so one bad value never turns every later figure into NaN.
    """
    if isinstance(event, GpuSample):
        power, energy = event.power_w, event.energy_j
        if power is not None and power != power:
            power = None
        if energy is not None and energy != energy:
            energy = None
        if power is not None or energy is not None:
            history.add(event.t_ns, power, energy)
        if event.avg_power_w is not None and history.averages is not None:
            history.add_average(event.t_ns, event.avg_power_w)
    elif event.energy_j == event.energy_j:
        history.add(event.t_ns, None, event.energy_j)


def reads_exact(
    period_s: float, t_ns: npt.NDArray[np.int64], counter_j: npt.NDArray[np.float64] | None
) -> bool:
    """Whether a counter of update period ``period_s`` (0: unknown) is exact at every reading
    in these samples: its first :data:`_EXACT_READS` read intervals (NaN: no read; fewer
    where there are fewer) are two periods long or more, as :meth:`DeviceHistory.add`
    decides."""
    if period_s <= 0 or counter_j is None:
        return False
    import numpy as np

    t = np.asarray(t_ns, dtype=np.int64)[~np.isnan(np.asarray(counter_j, dtype=np.float64))]
    gaps = np.diff(np.unique(t))[:_EXACT_READS]
    return bool(len(gaps)) and bool((gaps >= 2 * round(period_s * 1e9)).all())


def _owned(values: npt.NDArray[Any], given: object) -> npt.NDArray[Any]:
    """``values``, copied where they may be the caller's array ``given`` (or a view of it)."""
    import numpy as np

    if given is not None and np.may_share_memory(values, given):
        copied: npt.NDArray[Any] = values.copy()
        return copied
    return values


def _lazy(values: npt.NDArray[Any]) -> list[Any]:
    """An array as one of the lists :meth:`DeviceHistory.from_arrays` fills: an
    :class:`~.arraylist.ArrayList` (a list's behaviour, each value converted where it is read,
    the same Python scalar ``tolist`` gives; the first change makes it a real list)."""
    return cast("list[Any]", ArrayList(values))


#: :meth:`DeviceHistory.bracket_errors` takes the lowest power of the readings within this
#: many brackets' lengths of the bracket (0: inside it).
_BRACKET_SEEN = 0.0


class DeviceHistory(CounterPeriods):
    """Samples of one device, kept as parallel lists sorted by time.

    Args:
        key: Device key (``gpu:0``, ``cpu:0/package``).
        fine_counter: The counter updates much faster than it is sampled (RAPL): every reading
            is an exact point of the cumulative energy.
        sensor: How the instant-power readings relate to the counter.
        bounded: Keep only what :meth:`span_energy` needs (constant memory over any length of
            stream); :meth:`energy` of earlier intervals is then no longer available.
        reading_lag_s: The most a power reading can describe power earlier than its timestamp
            (the device's ``DeviceInfo.power_reading_lag_s``): integrated stretches of a
            window widen their ``error_j`` by it (:meth:`_lag_error`).
        reading_window_s: Each reading is a mean over a window this long, within the lag
            (``DeviceInfo.power_reading_window_s``; 0: unknown or a point reading).
        average_window_s, average_period_s: The device's ``avg_power_w`` is a sliding mean
            over ``average_window_s``, refreshed every ``average_period_s`` on the driver's
            grid (``DeviceInfo.power_average_window_s``/``_period_s``; 0: no such average).
            Where there is no energy counter, windows then take their energy from the
            averages (:class:`~zeus_async.aggregate.averages.AverageReadings`, method
            ``integrated+average``); counter-based figures never use them.
        counter_period_s: How often the counter updates, as the device says
            (``DeviceInfo.energy_counter_period_s``; 0: unknown, learned from the samples).
            Where the first three read intervals are two periods long or more
            (:func:`reads_exact`: an MI300's 1 ms counter read every 10 ms) every reading is
            an exact point, as with ``fine_counter``, and a window edge between two reads is
            placed by the power readings at both; otherwise (Apple's 10 ms counter read every
            ~10 ms) the updates lie on the device's grid, its phase fixed by the read
            intervals whose update count is certain (:meth:`_grid_phase`), and learned from
            the samples as without a period until some interval says it.
    """

    def __init__(
        self,
        key: str,
        *,
        fine_counter: bool = False,
        sensor: SensorModel | None = None,
        bounded: bool = False,
        reading_lag_s: float = 0.0,
        reading_window_s: float = 0.0,
        average_window_s: float = 0.0,
        average_period_s: float = 0.0,
        counter_period_s: float = 0.0,
    ) -> None:
        self.key = key
        self.fine_counter = fine_counter
        period = float(counter_period_s)
        #: The counter's update period as the device says it, in ns (0: unknown).
        self.counter_period_ns = round(period * 1e9) if period > 0 else 0
        # Whether the second counter read is still to say if each reading is exact (add()).
        self._exact_undecided = bool(self.counter_period_ns) and not fine_counter
        # The reads held back meanwhile, with what _coarse_read needs of each (_decide_exact).
        self._exact_pending: list[tuple[int, float, float | None, bool, float, int]] = []
        # The known period's grid phase (CounterPeriods._grid_phase): the phases the brackets
        # allow so far (None: no constraint yet) and the last counter point read for them.
        self._phase_arcs: list[tuple[float, float]] | None = None
        self._phase_upto = -1
        self.bounded = bounded
        lag = max(float(reading_lag_s), 0.0) if reading_lag_s == reading_lag_s else 0.0
        window = max(float(reading_window_s), 0.0) if reading_window_s == reading_window_s else 0.0
        #: The readings' lag and averaging window, in ns (the window no longer than the lag).
        self.reading_lag_ns = round(lag * 1e9)
        self.reading_window_ns = min(round(window * 1e9), self.reading_lag_ns)
        self.sensor = sensor if sensor is not None else SensorModel()
        #: The driver's sliding average, where the device reports one (see the arguments).
        self.averages: AverageReadings | None = None
        avg_window = round(average_window_s * 1e9) if average_window_s > 0 else 0
        avg_period = round(average_period_s * 1e9) if average_period_s > 0 else 0
        if avg_window and avg_period and avg_window % avg_period == 0:
            self.averages = AverageReadings(avg_window, avg_period, self.reading_window_ns)
        self._lock = threading.Lock()
        # Power samples: time, power, cumulative trapezoid energy at that time.
        self._pt: list[int] = []
        self._pw: list[float] = []
        self._pc: list[float] = []
        # Counter points: estimated update time (the midpoint of its bracket), the bracket's
        # start (the previous counter reading; the end is 2 * ct - cb, to 1 ns), counter value,
        # and the power reported by the sample that observed the update (NaN if none).
        self._ct: list[int] = []
        self._cb: list[int] = []
        self._ce: list[float] = []
        self._cp: list[float] = []
        # _refined() results by fit neighbourhood (first, own and last raw instant, and the
        # counter value): both edges of a short window, and the end of one window and the start
        # of the next, ask for the same points again. Cleared when it grows past _CACHE_MAX.
        self._refined_cache: dict[tuple[int, int, int, float], float] = {}
        # Typical half-bracket of a fit neighbourhood (first and last raw instant), see _wide.
        self._typical_cache: dict[tuple[int, int], float] = {}
        self._last_power: float | None = None
        # Sensor-model evidence: instant-power changes, and how many came with a counter update.
        self.power_changes = 0
        self.power_changes_with_counter = 0
        # What the readings describe (see power_readings), and every reading's running sum.
        self._evidence = _ReadingEvidence()
        self._reading_sum = 0.0
        self._readings = 0
        self._last_counter: float | None = None
        self._last_counter_t: int | None = None
        self.first_t_ns: int | None = None
        self.last_t_ns: int | None = None
        # The first counter instant ever (ct[0] before any trimming), the first reading of the
        # counter (time, value), the lead-in period once final (see _lead_in), and whether
        # counter points were dropped (the lead-in can no longer be computed).
        self._ct_first: int | None = None
        self._first_reading: tuple[int, float] | None = None
        self._lead: _Lead | None = None
        self._ct_trimmed = False
        # Values at the span's start, kept by a bounded history once they are final: the
        # cumulative integral at a time, and the counter at a time (per way of splitting).
        self._pin_cum: dict[float, float] = {}
        self._pin_counter: dict[tuple[float, _Split], float] = {}
        self._since_compact = 0
        #: Samples ignored for not being later than the previous one.
        self.dropped = 0
        self.lost_at_ns: int | None = None
        self.has_counter = False
        self.counter_updates = 0

    @classmethod
    def from_arrays(
        cls,
        key: str,
        t_ns: npt.NDArray[np.int64],
        power_w: npt.NDArray[np.float64] | None,
        counter_j: npt.NDArray[np.float64] | None,
        *,
        fine_counter: bool = False,
        sensor: SensorModel | None = None,
        reading_lag_s: float = 0.0,
        reading_window_s: float = 0.0,
    ) -> DeviceHistory:
        """A history holding exactly what :meth:`add` of each sample in turn would hold, built
        with array operations (the offline analysis's load path, :mod:`zeus_async.store`).

        Args:
            key: Device key.
            t_ns: Sample times, in arrival order.
            power_w: Power of each sample, NaN where the sample has none; ``None``: no power.
            counter_j: Counter of each sample, NaN where the sample has none; ``None``: none.
            fine_counter, sensor, reading_lag_s, reading_window_s: As for the constructor.

        NaN means no value (as :func:`add_sample` reads NaN readings). Samples with neither
        value are skipped, as :func:`add_sample` skips them; a sample not
        later than the previous one taken is dropped (counted in :attr:`dropped`), as
        :meth:`add` drops it. Every list, counter and flag equals the sequential result to the
        last bit (the trapezoid sums are accumulated left to right, as :meth:`add` does).
        """
        import numpy as np

        self = cls(
            key,
            fine_counter=fine_counter,
            sensor=sensor,
            reading_lag_s=reading_lag_s,
            reading_window_s=reading_window_s,
        )
        t = np.asarray(t_ns, dtype=np.int64)
        n = len(t)
        nan = np.full(n, np.nan)
        pw = nan if power_w is None else np.asarray(power_w, dtype=np.float64)
        ce = nan if counter_j is None else np.asarray(counter_j, dtype=np.float64)
        if len(pw) != n or len(ce) != n:
            raise ValueError("t_ns, power_w and counter_j must have the same length")
        has_p = ~np.isnan(pw)
        has_c = ~np.isnan(ce)
        some = has_p | has_c
        if not some.all():  # (every sample has a value: nothing to take out, no copies)
            t, pw, ce, has_p, has_c = t[some], pw[some], ce[some], has_p[some], has_c[some]
        if not len(t):
            return self
        # add() takes a sample only when it is later than every sample taken before it.
        keep = np.ones(len(t), dtype=bool)
        keep[1:] = t[1:] > t[:-1]
        if not keep.all():  # (in order, each later than the previous: each later than all)
            before = np.maximum.accumulate(t)
            keep[1:] = t[1:] > before[:-1]
            t, pw, ce, has_p, has_c = t[keep], pw[keep], ce[keep], has_p[keep], has_c[keep]
        self.dropped = int(len(keep) - np.count_nonzero(keep))
        self.first_t_ns = int(t[0])
        self.last_t_ns = int(t[-1])
        # Power samples and their running trapezoid integral (left to right, as add() sums).
        every_p = bool(has_p.all())
        pt, pv = (t, pw) if every_p else (t[has_p], pw[has_p])
        # The arrays kept are the history's own, never the caller's.
        pt, pv = _owned(pt, t_ns), _owned(pv, power_w)
        reading_sums = np.zeros(0)
        if len(pt):
            steps = (pv[:-1] + pv[1:]) / 2 * (pt[1:] - pt[:-1]) / 1e9
            cum = np.empty(len(pt))
            cum[0] = 0.0
            np.cumsum(steps, out=cum[1:])
            # Kept as arrays, each value converted where a query reads it (ArrayList: the same
            # Python scalars tolist() gives, without building millions of them up front).
            self._pt, self._pw, self._pc = _lazy(pt), _lazy(pv), _lazy(cum)
            self._last_power = float(pv[-1])
            # Running sums of the readings, added left to right as add() adds them.
            reading_sums = np.cumsum(pv)
            self._reading_sum, self._readings = float(reading_sums[-1]), len(pv)
        # Where the power reading changed from the previous reading.
        changed = np.zeros(len(t), dtype=bool)
        if len(pt) > 1:
            changed[np.flatnonzero(has_p)[1:]] = pv[1:] != pv[:-1]
        self.power_changes = int(np.count_nonzero(changed))
        rows = np.flatnonzero(has_c)
        if len(rows):
            self.has_counter = True
            tc, cv = t[rows], ce[rows]
            self._first_reading = (int(tc[0]), float(cv[0]))
            self._last_counter, self._last_counter_t = float(cv[-1]), int(tc[-1])
            if fine_counter:
                self._ct_first = int(tc[0])
                tc, cv = _owned(tc, t_ns), _owned(cv, counter_j)
                self._ct, self._cb, self._ce = _lazy(tc), _lazy(tc), _lazy(cv)
                self._cp = [_NAN] * len(tc)
            else:
                moved = np.flatnonzero(cv[1:] != cv[:-1]) + 1
                if len(moved):
                    at = rows[moved]
                    ct = (tc[moved - 1] + tc[moved]) // 2
                    self._ct_first = int(ct[0])
                    self._ct, self._cb = _lazy(ct), _lazy(tc[moved - 1])
                    self._ce = _lazy(cv[moved])
                    self._cp = _lazy(np.where(has_p[at], pw[at], np.nan))
                    self.counter_updates = len(moved)
                    self.power_changes_with_counter = int(np.count_nonzero(changed[at]))
                    counts = np.cumsum(has_p)[at]
                    sums = np.zeros(len(counts))
                    if len(reading_sums):
                        sums = np.where(counts > 0, reading_sums[np.maximum(counts - 1, 0)], 0.0)
                    self._evidence = _ReadingEvidence.from_arrays(
                        ct, cv[moved], sums, counts, tc[moved] - tc[moved - 1]
                    )
        return self

    # -- writing (runtime thread) -------------------------------------------------------------

    def add(self, t_ns: int, power_w: float | None, counter_j: float | None) -> None:
        """Record one sample (either field may be missing)."""
        with self._lock:
            if self.last_t_ns is not None and t_ns <= self.last_t_ns:
                # A duplicate or a sample out of order: ignored (counted) rather than corrupt
                # the sorted lists or make a zero-length interval.
                self.dropped += 1
                return
            if self.first_t_ns is None:
                self.first_t_ns = t_ns
            if power_w is not None:
                if self._pt:
                    t_prev, p_prev = self._pt[-1], self._pw[-1]
                    cum = self._pc[-1] + (p_prev + power_w) / 2 * (t_ns - t_prev) / 1e9
                else:
                    cum = 0.0
                self._pt.append(t_ns)
                self._pw.append(power_w)
                self._pc.append(cum)
                self._reading_sum += power_w
                self._readings += 1
            power_changed = (
                power_w is not None and self._last_power is not None and power_w != self._last_power
            )
            if power_w is not None:
                self._last_power = power_w
            if counter_j is not None:
                self.has_counter = True
                held = False
                if self._first_reading is None:
                    self._first_reading = (t_ns, counter_j)
                elif self._exact_undecided:
                    held = self._decide_exact(t_ns, counter_j, power_w, power_changed)
                if held:
                    pass  # read once the reads' spacing has said what the counter is
                elif self.fine_counter:
                    if not self._ct:
                        self._ct_first = t_ns
                    self._ct.append(t_ns)
                    self._cb.append(t_ns)
                    self._ce.append(counter_j)
                    self._cp.append(_NAN)
                    self._last_counter = counter_j
                    self._last_counter_t = t_ns
                else:
                    self._coarse_read(
                        t_ns, counter_j, power_w, power_changed, self._reading_sum, self._readings
                    )
            if power_changed:
                self.power_changes += 1
            self.last_t_ns = t_ns
            if self.bounded:
                self._since_compact += 1
                if self._since_compact >= _COMPACT_EVERY:
                    self._since_compact = 0
                    self._compact()

    def _coarse_read(
        self,
        t_ns: int,
        counter_j: float,
        power_w: float | None,
        power_changed: bool,
        reading_sum: float,
        readings: int,
    ) -> None:
        """One reading of a coarse counter: a counter point where it changed (its bracket from
        the previous read), with the readings' sum and count as of that read."""
        if self._last_counter is not None and counter_j != self._last_counter:
            assert self._last_counter_t is not None
            if not self._ct:
                self._ct_first = (self._last_counter_t + t_ns) // 2
            instant = (self._last_counter_t + t_ns) // 2
            self._ct.append(instant)
            self._cb.append(self._last_counter_t)
            self._ce.append(counter_j)
            self._cp.append(power_w if power_w is not None else _NAN)
            self.counter_updates += 1
            self._evidence.update(
                instant,
                counter_j,
                reading_sum,
                readings,
                t_ns - self._last_counter_t,
            )
            if power_changed:
                self.power_changes_with_counter += 1
        elif (
            self.counter_period_ns
            and self._last_counter_t is not None
            and t_ns - self._last_counter_t < self.counter_period_ns
        ):
            # No update in a read interval shorter than the period: no grid instant
            # in it, which pins the grid's phase (issue 37).
            self._phase_constrain(t_ns, self._last_counter_t + self.counter_period_ns)
        # (The first reading of a coarse counter belongs to an earlier, unknown update
        # instant, so it is no interpolation point.)
        self._last_counter = counter_j
        self._last_counter_t = t_ns

    def _decide_exact(
        self, t_ns: int, counter_j: float, power_w: float | None, power_changed: bool
    ) -> bool:
        """A counter read while it is still to say whether every reading is an exact point
        (``fine_counter``): so where the device's counter period is at most half the spacing
        of the first :data:`_EXACT_READS` read intervals (one long first interval, a sampler
        starting late, does not make a 10 ms counter read every 10 ms exact). Returns whether
        this read is held back until then; a read interval under two periods ends the wait,
        and the reads held back are read as a coarse counter's."""
        first = self._first_reading
        assert first is not None and not self._ct
        pending = self._exact_pending
        prev = pending[-1][0] if pending else first[0]
        if t_ns - prev < 2 * self.counter_period_ns:
            self._exact_undecided = False
            self._exact_pending = []
            for read in pending:
                self._coarse_read(*read)
            return False
        pending.append((t_ns, counter_j, power_w, power_changed, self._reading_sum, self._readings))
        if len(pending) < _EXACT_READS:
            return True
        self._exact_undecided = False
        self._exact_pending = []
        self.fine_counter = True
        self._ct_first = first[0]
        for t, c in [first, *((read[0], read[1]) for read in pending[:-1])]:
            self._ct.append(t)
            self._cb.append(t)
            self._ce.append(c)
            self._cp.append(_NAN)
        return False

    def set_counter_period(self, period_s: float) -> None:
        """Say the counter's update period (``counter_period_s``) of a history filled by
        :meth:`from_arrays` (whose ``fine_counter`` says, by :func:`reads_exact`, whether each
        reading is exact)."""
        with self._lock:
            self.counter_period_ns = round(period_s * 1e9) if period_s > 0 else 0
            self._exact_undecided = False
            self._exact_pending = []
            self._refined_cache.clear()
            self._lead = None
            self._phase_arcs, self._phase_upto = None, -1

    def add_average(self, t_ns: int, avg_w: float) -> None:
        """Record one reading of the driver's sliding average (``avg_power_w``); ignored where
        the history was not told the average's window (:attr:`averages` is ``None``)."""
        if self.averages is None:
            return
        with self._lock:
            self.averages.add(t_ns, avg_w)

    def _compact(self) -> None:
        """Pin the span's start values, then drop what :meth:`span_energy` no longer needs.

        The span's energy reads its start at two points, the first sample ``t0`` and ``lo``
        (the later of ``t0`` and the start of the counter's coverage), and its end at the last
        counter instant and the last sample. The start values are pinned once final: at once
        without a counter; with one, once the grid fit around its first updates no longer
        changes (:data:`_SETTLED` updates), and until then nothing is dropped.
        """
        t0 = self.first_t_ns
        if t0 is None:
            return
        pt, ct, pins = self._pt, self._ct, self._pin_cum
        cut: float
        if self.has_counter:
            if len(ct) < (2 if self.fine_counter else _SETTLED):
                return
            lo = max(t0, self._counter_start())
            if (lo, "time") not in self._pin_counter:
                for split in _SPLITS:
                    self._pin_counter[(lo, split)] = self._counter_at(lo, split)
            if pt and lo > pt[-1]:
                return
            for point in (t0, lo):
                if pt and point not in pins:
                    pins[point] = self._cum(point)
            if len(ct) > _SETTLED:
                drop = len(ct) - _SETTLED
                del ct[:drop], self._cb[:drop], self._ce[:drop], self._cp[:drop]
                self._ct_trimmed = True
            cut = self._cb[0]  # the power samples around the counter points kept
        elif pt:
            if t0 not in pins:
                pins[t0] = self._cum(t0)
            cut = pt[-1]
        else:
            return
        i = bisect.bisect_right(pt, cut) - 1
        if i > 0:
            del pt[:i], self._pw[:i], self._pc[:i]

    def mark_lost(self, t_ns: int) -> None:
        """The device failed at ``t_ns``: later windows cannot wait for it."""
        with self._lock:
            if self.lost_at_ns is None:
                self.lost_at_ns = t_ns

    def trim_before(self, t_ns: int) -> None:
        """Forget samples older than ``t_ns`` (keeping one point before it for interpolation)."""
        with self._lock:
            i = bisect.bisect_left(self._pt, t_ns) - 1
            if i > 0:
                del self._pt[:i], self._pw[:i], self._pc[:i]
            if self.averages is not None:
                self.averages.trim_before(t_ns)
            j = bisect.bisect_left(self._ct, t_ns) - 1
            if j > 0:
                self._ct_trimmed = True
                del self._ct[:j], self._cb[:j], self._ce[:j], self._cp[:j]

    # -- reading (any thread) -----------------------------------------------------------------

    @property
    def power_readings(self) -> str:
        """What the power readings describe, judged online against the energy counter
        (:class:`_ReadingEvidence`): ``averaged`` (a smoothed past, a 1 s average: they never
        split a counter period), ``lagging`` (the counter period before the last update, as an
        H100's instant reading does: the head model may use them, nothing else), ``instant``
        (neither: their own moment; they share a period's energy out) or ``unknown`` (the
        power has not moved enough to tell; they share it out, as the ``power_w`` of the
        NVML backend is an instant reading, and where the period means do not move a 1 s
        average does not either)."""
        with self._lock:
            return self._evidence.verdict()

    def fresh_power(self, reading_w: float) -> float:
        """The freshest mean power the data gives, for a provisional figure (the power board
        integrates it), given the latest power reading: that reading, except where readings
        are shown to describe the past (``lagging``: the head of the period before the last
        counter update; ``averaged``: the last second; or, before a verdict, refreshed only
        with the counter), where the mean power of the last counter period, between its
        fitted update instants, is fresher."""
        with self._lock:
            ct, ce = self._ct, self._ce
            if self.fine_counter or len(ct) < 2:
                return reading_w
            verdict = self._evidence.verdict()
            past = verdict in ("lagging", "averaged") or (
                verdict == "unknown" and self._refreshed_with_counter()
            )
            if not past:
                return reading_w
            k = len(ct) - 1
            u_a, u_b = self._refined(k - 1), self._refined(k)
            if u_b <= u_a:
                return reading_w
            return (ce[k] - ce[k - 1]) / (u_b - u_a) * 1e9

    def covers(self, t_ns: int) -> bool:
        """Whether data after ``t_ns`` has arrived so that an interval ending there is final.

        With a counter: an update after ``t_ns`` was observed, and where the period holding
        ``t_ns`` is split with the next period's data (the head model, the sloped split), the
        update after that. Without: a power sample at or after ``t_ns`` plus the readings' lag
        (:attr:`reading_lag_ns`: the readings that describe the power just before ``t_ns``).
        """
        with self._lock:
            ct = self._ct
            if self.has_counter and (ct or not self.fine_counter):
                split = "power" if self.fine_counter else self._split()
                if not self.fine_counter and len(ct) > 1 and self._grid_phase() is not None:
                    # The device's grid (issue 37) puts an update anywhere in its bracket: the
                    # updates after t_ns are the grid's instants, not the brackets' midpoints.
                    need = 1
                    if split == "time" and bisect.bisect_right(ct, t_ns) >= 2:
                        need = 3
                    elif split == "head":
                        need = 2
                    return len(ct) >= need and self._refined(len(ct) - need) >= t_ns
                if split == "time" and bisect.bisect_right(ct, t_ns) >= 2:
                    # The period holding t_ns is split using the next two periods' mean
                    # powers (the sloped split and its step test, which the first two
                    # periods do without).
                    return len(ct) >= 3 and ct[-3] >= t_ns
                if split == "head":
                    # The period holding t_ns is split using the next period's head reading.
                    return len(ct) >= 2 and ct[-2] >= t_ns
                return bool(ct) and ct[-1] >= t_ns
            return bool(self._pt) and self._pt[-1] >= t_ns + self.reading_lag_ns

    def energy(self, t0_ns: int, t1_ns: int) -> EnergyEstimate:
        """Energy over ``[t0_ns, t1_ns]`` from the best source covering it, with the
        uncertainty its edges leave (:class:`EnergyEstimate`).

        When the samples around an edge came late or not at all (a gap of more than
        :data:`LATE_FACTOR` typical sample intervals, or counter updates seen only through such
        gaps), the method gets the suffix ``, late`` and ``error_j`` says how much is at stake.
        A counter split that would leave a window nothing while the power readings around it
        show the device drawing power is replaced by those readings (``integrated, late``).

        A device lost (:meth:`mark_lost`) contributes no energy after the loss: an interval
        that starts at or after it is 0 J (method ``lost``), one that ends after it is
        measured up to it (suffix ``, lost``).
        """
        if t1_ns < t0_ns:
            raise ValueError("interval ends before it starts")
        with self._lock:
            lost = self.lost_at_ns
            if lost is not None and t1_ns > lost:
                if t0_ns >= lost:
                    return EnergyEstimate(0.0, "lost")
                before = self._energy_locked(t0_ns, lost)
                if before.energy_j is None:
                    return before
                return EnergyEstimate(before.energy_j, f"{before.method}, lost", before.error_j)
            return self._energy_locked(t0_ns, t1_ns)

    def _energy_locked(self, t0_ns: int, t1_ns: int) -> EnergyEstimate:
        """:meth:`energy` without the loss, under the lock."""
        estimate = self._energy(t0_ns, t1_ns)
        if estimate.energy_j is None:
            return estimate
        if estimate.method == "integrated" and self.averages is not None and not self.has_counter:
            # No counter, but the driver's sliding average: pieces of its refresh grid.
            found = self.averages.energy(t0_ns, t1_ns, self._pt, self._pw)
            if found is not None:
                return EnergyEstimate(found[0], "integrated+average", found[1])
        err0, late0 = self._edge_error(t0_ns, estimate.method, begin=True)
        err1, late1 = self._edge_error(t1_ns, estimate.method, begin=False)
        energy, method = estimate.energy_j, estimate.method
        lag = self._lag_error(t0_ns, t1_ns, method)
        if method.startswith("counter") and energy <= 0 and self._pt and t1_ns > t0_ns:
            power = self._integral(t0_ns, t1_ns)
            if power > 0:
                energy, method, late0 = power, "integrated", True
                lag = self._lag_error(t0_ns, t1_ns, method)
        if late0 or late1:
            method += ", late"
        return EnergyEstimate(energy, method, err0 + err1 + lag)

    def cumulative(self, times: Sequence[int]) -> tuple[list[float], str] | None:
        """Energy from ``times[0]`` to each of ``times`` (sorted), in one pass: the estimator
        of :meth:`energy` over the whole range (counter where it covers the range, else the
        integrated power readings), so energies of adjacent intervals are differences that add
        up, bit for bit, to the whole. For splitting one stretch among many intervals (the
        request meter's segments); ``None`` when no data covers it."""
        if not times:
            return [], "unavailable"
        t0, t1 = times[0], times[-1]
        with self._lock:
            ct, pt = self._ct, self._pt
            if len(ct) >= 2:
                first = self._counter_start()
                if first < t1 and ct[-1] > t0 and (pt or (first <= t0 and ct[-1] >= t1)):
                    split = self._split()
                    memo = _Memo(self)
                    # Counter inside [lo, hi], integrated power outside: energy()'s
                    # counter+extrapolated, as one cumulative function.
                    lo, hi = max(t0, first), min(t1, ct[-1])
                    c_lo = self._counter_at(lo, split, memo)
                    f_lo = self._integral(t0, lo)
                    f_hi = f_lo + self._counter_at(hi, split, memo) - c_lo
                    out = []
                    for t in times:
                        if t <= lo:
                            out.append(self._integral(t0, t))
                        elif t <= hi:
                            out.append(f_lo + self._counter_at(t, split, memo) - c_lo)
                        else:
                            out.append(f_hi + self._integral(hi, t))
                    covered = lo == t0 and hi == t1
                    return out, "counter+interpolated" if covered else "counter+extrapolated"
            if pt:
                base = self._cum(t0)
                return [self._cum(t) - base for t in times], "integrated"
        return None

    def edge_errors(self, times: Sequence[int], method: str) -> tuple[list[float], list[float]]:
        """Per time of ``times`` (sorted), what :meth:`energy` adds to ``error_j`` for a
        window beginning there and for one ending there, for a window of ``method`` (what
        :meth:`cumulative` named): :meth:`_edge_error`'s figures for many edges at once,
        one bracket of readings at a time (without the readings' lag, which :meth:`energy`
        adds per window)."""
        m = len(times)
        begins = [0.0] * m
        ends = [0.0] * m
        right, left = bisect.bisect_right, bisect.bisect_left
        with self._lock:
            pt, pw = self._pt, self._pw
            n = len(pt)
            k = 0
            while n and k < m:  # the power readings' part, bracket by bracket
                i = right(pt, times[k])
                if i == 0:  # before the first reading: none
                    k = left(times, pt[0], k)
                    continue
                if i == n:  # past the last one: extrapolated at its power
                    if method != "counter+interpolated":
                        for j in range(k, m):
                            begins[j] = ends[j] = pw[-1] * (times[j] - pt[-1]) / 1e9
                    break
                k2 = left(times, pt[i], k)
                d = pw[i] - pw[i - 1]
                if d:
                    d, t_a, t_b = abs(d) / 1e9, pt[i - 1], pt[i]
                    for j in range(k, k2):
                        begins[j] = d * (t_b - times[j])
                        ends[j] = d * (times[j] - t_a)
                k = k2
            ct = self._ct
            c = len(ct)
            k = 0
            coarse = n and not self.fine_counter and c >= 2 and method.startswith("counter")
            while coarse and k < m:  # counter updates seen only through wide brackets
                i = right(ct, times[k])
                if i == 0:
                    k = left(times, ct[0], k)
                    continue
                if i == c:
                    break
                k2 = left(times, ct[i], k)
                span = self._merged(i)
                if span is not None:
                    for j in range(k, k2):
                        by_power = self._merged_at(times[j], *span, by_power=True)
                        by_time = self._merged_at(times[j], *span, by_power=False)
                        begins[j] += abs(by_power - by_time)
                        ends[j] += abs(by_power - by_time)
                k = k2
        return begins, ends

    def bracket_errors(self, times: Sequence[int]) -> list[float]:
        """Per time of ``times`` (sorted), a bound (J) on how far the counter's split of the
        update bracket around it (``[t_a, t_b]``, its energy ``dE`` exact) can be from the
        truth: ``dE - p_lo * (t_b - t_a)``, the bracket's energy above the lowest power the
        readings in it show (``p_lo``, or its mean power where lower). That much could lie
        anywhere in the bracket: a power field that samples part of each period (an H100's
        25 ms in every 100 ms) or lags misses a short burst altogether, and nothing bounds
        the power from above but the device's limit, which the history does not know. (The
        floor is the readings' own: a bracket whose readings all miss a dip below them is
        not covered; readings from the neighbouring brackets as well, which would cover it,
        make the bound several times looser where the power steps.) What
        :meth:`edge_errors` leaves out (it counts the readings' own step at an edge). 0
        outside the counter's brackets and with a counter exact at every read. For the
        request meter's ``error_j`` (windows' edges use :meth:`_edge_error`)."""
        m = len(times)
        out = [0.0] * m
        right, left = bisect.bisect_right, bisect.bisect_left
        with self._lock:
            ct, ce, pt, pw = self._ct, self._ce, self._pt, self._pw
            c = len(ct)
            if c < 2 or not pt or self.fine_counter:
                return out
            refined = self._refined
            known: dict[int, float] = {}  # refined update instants asked for
            brackets: dict[int, float] = {}
            i_at = -1
            t_a = t_b = 0.0
            for j, t in enumerate(times):
                if not t_a <= t < t_b:  # (times sorted: most fall in the last bracket)
                    i = right(ct, t)
                    if i == 0 or i == c:
                        continue
                    t_a = known.get(i - 1) or known.setdefault(i - 1, refined(i - 1))
                    t_b = known.get(i) or known.setdefault(i, refined(i))
                    if t < t_a and i >= 2:  # (as the split does: the refined update instants)
                        i -= 1
                        t_a, t_b = known.get(i - 1) or known.setdefault(i - 1, refined(i - 1)), t_a
                    elif t >= t_b and i + 1 < c:
                        i += 1
                        t_a, t_b = t_b, known.get(i) or known.setdefault(i, refined(i))
                    i_at = i
                got = brackets.get(i_at)
                if got is None:
                    length = t_b - t_a
                    energy = ce[i_at] - ce[i_at - 1]
                    got = 0.0
                    if length > 0:
                        mean = energy / (length / 1e9)
                        lo = left(pt, t_a - _BRACKET_SEEN * length)
                        seen = pw[lo : right(pt, t_b + _BRACKET_SEEN * length, lo)]
                        p_lo = min(min(seen, default=mean), mean)
                        got = max(energy - max(p_lo, 0.0) * length / 1e9, 0.0)
                    brackets[i_at] = got
                out[j] = got
        return out

    def span_energy(self) -> EnergyEstimate:
        """Energy over the device's own span, from its first to its last sample.

        What :meth:`energy` gives for ``[first_t_ns, last_t_ns]``, exactly, bounded or not:
        the one figure of a device's total in ``monitor``, ``replay``, ``inspect`` and
        :meth:`~zeus_async.store.analysis.Recording.totals`.
        """
        with self._lock:
            if self.first_t_ns is None or self.last_t_ns is None:
                return EnergyEstimate(None, "unavailable")
            return self._energy(self.first_t_ns, self.last_t_ns)

    def _energy(self, t0_ns: int, t1_ns: int) -> EnergyEstimate:
        ct = self._ct
        split = self._split()
        if len(ct) >= 2:
            first = self._counter_start()
            if first <= t0_ns and ct[-1] >= t1_ns:
                e = self._counter_at(t1_ns, split) - self._counter_at(t0_ns, split)
                return EnergyEstimate(e, "counter+interpolated")
            if first < t1_ns and ct[-1] > t0_ns:
                # Counter covers part of the interval: counter inside, power at the ends.
                lo, hi = max(t0_ns, first), min(t1_ns, ct[-1])
                e = self._counter_at(hi, split) - self._counter_at(lo, split)
                if not self._pt:
                    # No power samples to fill in the ends: the counter's part only.
                    return EnergyEstimate(e, "counter")
                e += self._integral(t0_ns, lo) + self._integral(hi, t1_ns)
                return EnergyEstimate(e, "counter+extrapolated")
        if self._pt:
            return EnergyEstimate(self._integral(t0_ns, t1_ns), "integrated")
        return EnergyEstimate(None, "unavailable")

    def _typical_interval(self, i: int) -> float:
        """The median interval between power readings around reading ``i``."""
        pt = self._pt
        lo, hi = max(0, i - 8), min(len(pt), i + 9)
        if hi - lo < 3:
            return math.inf
        gaps = sorted(pt[k + 1] - pt[k] for k in range(lo, hi - 1))
        return float(gaps[len(gaps) // 2])

    def _lag_error(self, t0_ns: int, t1_ns: int, method: str) -> float:
        """What lagged or averaged power readings (:attr:`reading_lag_ns`) leave open in the
        integrated stretches of ``[t0_ns, t1_ns]`` (J): the whole interval (``integrated``),
        or its ends outside the counter's coverage (``counter+extrapolated``); 0 without lag.

        A change of the readings between two samples ``t_k < t_{k+1}`` stands for a change
        of the power at some instant ``tau``; the trapezoid puts it at their midpoint. Where a
        reading describes power up to ``lag`` before its timestamp, as a mean over ``window``,
        the change shows up ``d`` after ``tau`` with ``d`` from ``window / 2 - gap / 2`` to
        ``lag - window / 2 + gap / 2`` (``gap = t_{k+1} - t_k``: where between the two samples
        it came), and each change moves the stretch's energy by ``dP * d``: the changes in
        the readings taken from the last one at or before the stretch's start to the first at
        or after its end plus the lag (those that can describe power inside it), with ``d`` at
        its worst for rises and falls alike, bound the error. A constant lag leaves the
        difference of the power at the two ends times the lag (energy that crossed an edge);
        one that varies from reading to reading (a conversion cycle's sample-and-hold) adds
        every change times the spread of ``d``.
        """
        lag = self.reading_lag_ns
        pt = self._pt
        if lag <= 0 or not pt or t1_ns <= t0_ns:
            return 0.0
        stretches: list[tuple[float, float]]
        if method.startswith("integrated"):
            stretches = [(t0_ns, t1_ns)]
        elif method.startswith("counter+extrapolated") and len(self._ct) >= 2:
            lo, hi = max(t0_ns, self._counter_start()), min(t1_ns, self._ct[-1])
            stretches = [(t0_ns, lo), (hi, t1_ns)]
        else:
            return 0.0
        pw, window = self._pw, self.reading_window_ns
        d_lo, d_hi = window / 2, lag - window / 2
        error = 0.0
        for a, b in stretches:
            if b <= a:
                continue
            i0 = max(bisect.bisect_right(pt, a) - 1, 0)
            i1 = min(bisect.bisect_left(pt, b + lag), len(pt) - 1)
            # Worst case for an error upwards (every rise late, every fall early) and downwards.
            up = down = 0.0
            for k in range(i0, i1):
                change = pw[k + 1] - pw[k]
                if not change:
                    continue
                half = (pt[k + 1] - pt[k]) / 2
                late, early = d_hi + half, d_lo - half
                if change > 0:
                    up += change * late
                    down -= change * early
                else:
                    up += change * early
                    down -= change * late
            error += max(up, down, 0.0) / 1e9
        return error

    def _edge_error(self, t_ns: int, method: str, *, begin: bool) -> tuple[float, bool]:
        """What the data around one window edge leaves uncertain (J), and whether it came
        late (see :class:`EnergyEstimate` and :meth:`energy`)."""
        error, late = 0.0, False
        pt, pw = self._pt, self._pw
        if pt:
            i = bisect.bisect_right(pt, t_ns)
            typical = self._typical_interval(min(i, len(pt) - 1))
            if 0 < i < len(pt):
                t_a, t_b = pt[i - 1], pt[i]
                part = (t_b - t_ns) if begin else (t_ns - t_a)
                error += abs(pw[i] - pw[i - 1]) * part / 1e9
                # A long gap between equal readings hides nothing (adaptive reads skip those).
                late = pw[i] != pw[i - 1] and t_b - t_a > LATE_FACTOR * typical
            elif i == len(pt) and method != "counter+interpolated":
                # Past the last reading, extrapolated at its power.
                error += pw[-1] * (t_ns - pt[-1]) / 1e9
                late = t_ns - pt[-1] > LATE_FACTOR * typical
        ct = self._ct
        if not self.fine_counter and len(ct) >= 2 and method.startswith("counter"):
            i = bisect.bisect_right(ct, t_ns)
            if 0 < i < len(ct):
                span = self._merged(i)
                if span is not None:
                    late = True
                    if self._pt:
                        by_power = self._merged_at(t_ns, *span, by_power=True)
                        by_time = self._merged_at(t_ns, *span, by_power=False)
                        error += abs(by_power - by_time)
        return error, late
