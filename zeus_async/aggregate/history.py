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
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from ..events import GpuSample, Measurement, RaplSample

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "DeviceHistory",
    "EnergyEstimate",
    "SensorModel",
    "add_sample",
    "history_key",
    "window_measurement",
]

logger = logging.getLogger(__name__)

_NAN = float("nan")
_FIT_RADIUS = 10
#: Most refined update instants a history remembers (see DeviceHistory._refined).
_CACHE_MAX = 256
#: Counter updates after which the span's start values are final (the grid fits around the first
#: updates no longer change), and how many a bounded history keeps.
_SETTLED = 2 * _FIT_RADIUS + 4
#: Samples between two compactions of a bounded history.
_COMPACT_EVERY = 1024
#: An edge whose samples around it are this many typical sample intervals apart came late.
LATE_FACTOR = 3.0
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

_Lead = tuple[float, float, float, float, float, float]
#: How energy is shared out inside a counter period: the head model, the power readings, a line.
_Split = Literal["head", "power", "time"]
_SPLITS: tuple[_Split, ...] = ("time", "power", "head")


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
    elif event.energy_j == event.energy_j:
        history.add(event.t_ns, None, event.energy_j)


def window_measurement(
    *,
    host: str,
    t_ns: int,
    name: str,
    window_id: int,
    start_ns: int,
    end_ns: int,
    figures: Mapping[str, EnergyEstimate],
    lost: list[str] | None = None,
) -> Measurement:
    """A window's :class:`~zeus_async.events.Measurement` from one figure per device key
    (``gpu:0``, ``cpu:0/package``, ``cpu:0/dram``): a GPU's method is kept even without a
    figure (``unavailable``); a CPU domain without one is left out."""
    gpu: dict[int, float] = {}
    cpu: dict[int, float] = {}
    dram: dict[int, float] = {}
    methods: dict[str, str] = {}
    errors: dict[str, float] = {}
    for key, estimate in figures.items():
        energy = estimate.energy_j
        if key.startswith("gpu:"):
            methods[key] = estimate.method
            if energy is not None:
                gpu[int(key[4:])] = energy
        elif energy is not None:
            package, _, domain = key.partition("/")
            (cpu if domain == "package" else dram)[int(package[4:])] = energy
            methods[key] = estimate.method
        if energy is not None:
            errors[key] = estimate.error_j
    return Measurement(
        host=host,
        t_ns=t_ns,
        name=name,
        window_id=window_id,
        start_ns=start_ns,
        end_ns=end_ns,
        time_s=(end_ns - start_ns) / 1e9,
        gpu_energy_j=gpu,
        cpu_energy_j=cpu or None,
        dram_energy_j=dram or None,
        methods=methods,
        lost=lost or [],
        error_j=errors,
    )


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


class _Memo:
    """Per-pass memory of one history's refined update instants, merged spans and power
    integrals at period edges (:meth:`DeviceHistory.cumulative`): many instants in the same
    counter periods then cost one bisect and a split each, for the same figures."""

    __slots__ = ("_cums", "_history", "_merged", "_refined")

    def __init__(self, history: DeviceHistory) -> None:
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


class EnergyEstimate:
    """Energy over an interval, how it was obtained, and what its edges leave uncertain.

    ``error_j`` (windows only; 0 elsewhere) bounds what the data around the interval's two
    edges leaves open, assuming power moves monotonically between two readings: an edge
    between readings ``p_a`` and ``p_b`` contributes ``|p_b - p_a|`` times the part of their
    gap inside the interval; an edge past the last reading, that reading's power times the
    stretch extrapolated; an edge inside counter periods whose update instants are unknown
    (late samples, see :meth:`DeviceHistory.energy`), the difference between splitting their
    energy by time and by power. Exact counter periods between the edges add nothing.
    """

    __slots__ = ("energy_j", "error_j", "method")

    def __init__(self, energy_j: float | None, method: str, error_j: float = 0.0) -> None:
        self.energy_j = energy_j
        self.method = method
        self.error_j = error_j

    def __repr__(self) -> str:
        return f"EnergyEstimate({self.energy_j!r}, {self.method!r}, error_j={self.error_j!r})"


class DeviceHistory:
    """Samples of one device, kept as parallel lists sorted by time.

    Args:
        key: Device key (``gpu:0``, ``cpu:0/package``).
        fine_counter: The counter updates much faster than it is sampled (RAPL): every reading
            is an exact point of the cumulative energy.
        sensor: How the instant-power readings relate to the counter.
        bounded: Keep only what :meth:`span_energy` needs (constant memory over any length of
            stream); :meth:`energy` of earlier intervals is then no longer available.
    """

    def __init__(
        self,
        key: str,
        *,
        fine_counter: bool = False,
        sensor: SensorModel | None = None,
        bounded: bool = False,
    ) -> None:
        self.key = key
        self.fine_counter = fine_counter
        self.bounded = bounded
        self.sensor = sensor if sensor is not None else SensorModel()
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
    ) -> DeviceHistory:
        """A history holding exactly what :meth:`add` of each sample in turn would hold, built
        with array operations (the offline analysis's load path, :mod:`zeus_async.store`).

        Args:
            key: Device key.
            t_ns: Sample times, in arrival order.
            power_w: Power of each sample, NaN where the sample has none; ``None``: no power.
            counter_j: Counter of each sample, NaN where the sample has none; ``None``: none.
            fine_counter, sensor: As for the constructor.

        NaN means no value (as :func:`add_sample` reads NaN readings). Samples with neither
        value are skipped, as :func:`add_sample` skips them; a sample not
        later than the previous one taken is dropped (counted in :attr:`dropped`), as
        :meth:`add` drops it. Every list, counter and flag equals the sequential result to the
        last bit (the trapezoid sums are accumulated left to right, as :meth:`add` does).
        """
        import numpy as np

        self = cls(key, fine_counter=fine_counter, sensor=sensor)
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
        t, pw, ce, has_p, has_c = t[some], pw[some], ce[some], has_p[some], has_c[some]
        if not len(t):
            return self
        # add() takes a sample only when it is later than every sample taken before it.
        before = np.maximum.accumulate(t)
        keep = np.ones(len(t), dtype=bool)
        keep[1:] = t[1:] > before[:-1]
        self.dropped = int(len(t) - np.count_nonzero(keep))
        t, pw, ce, has_p, has_c = t[keep], pw[keep], ce[keep], has_p[keep], has_c[keep]
        self.first_t_ns = int(t[0])
        self.last_t_ns = int(t[-1])
        # Power samples and their running trapezoid integral (left to right, as add() sums).
        pt, pv = t[has_p], pw[has_p]
        reading_sums = np.zeros(0)
        if len(pt):
            steps = (pv[:-1] + pv[1:]) / 2 * (pt[1:] - pt[:-1]) / 1e9
            cum = np.empty(len(pt))
            cum[0] = 0.0
            np.cumsum(steps, out=cum[1:])
            self._pt, self._pw, self._pc = pt.tolist(), pv.tolist(), cum.tolist()
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
                self._ct, self._cb, self._ce = tc.tolist(), tc.tolist(), cv.tolist()
                self._cp = [_NAN] * len(tc)
            else:
                moved = np.flatnonzero(cv[1:] != cv[:-1]) + 1
                if len(moved):
                    at = rows[moved]
                    ct = (tc[moved - 1] + tc[moved]) // 2
                    self._ct_first = int(ct[0])
                    self._ct, self._cb = ct.tolist(), tc[moved - 1].tolist()
                    self._ce = cv[moved].tolist()
                    self._cp = np.where(has_p[at], pw[at], np.nan).tolist()
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
                if self._first_reading is None:
                    self._first_reading = (t_ns, counter_j)
                if self.fine_counter:
                    if not self._ct:
                        self._ct_first = t_ns
                    self._ct.append(t_ns)
                    self._cb.append(t_ns)
                    self._ce.append(counter_j)
                    self._cp.append(_NAN)
                elif self._last_counter is not None and counter_j != self._last_counter:
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
                        self._reading_sum,
                        self._readings,
                        t_ns - self._last_counter_t,
                    )
                    if power_changed:
                        self.power_changes_with_counter += 1
                # (The first reading of a coarse counter belongs to an earlier, unknown update
                # instant, so it is no interpolation point.)
                self._last_counter = counter_j
                self._last_counter_t = t_ns
            if power_changed:
                self.power_changes += 1
            self.last_t_ns = t_ns
            if self.bounded:
                self._since_compact += 1
                if self._since_compact >= _COMPACT_EVERY:
                    self._since_compact = 0
                    self._compact()

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

    def _counter_start(self) -> float:
        """Where the counter's coverage starts: the lead-in's start, else the first update."""
        lead = self._lead_in()
        if lead is not None:
            return lead[0]
        assert self._ct_first is not None
        return self._ct_first

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
        update after that. Without: a power sample at or after ``t_ns``.
        """
        with self._lock:
            ct = self._ct
            if self.has_counter and (ct or not self.fine_counter):
                split = "power" if self.fine_counter else self._split()
                if split == "head" or (split == "time" and bisect.bisect_right(ct, t_ns) >= 2):
                    # The period holding t_ns is split using the next period: its head
                    # reading (the head model), or its mean power (the sloped split, which
                    # the first two periods do without).
                    return len(ct) >= 2 and ct[-2] >= t_ns
                return bool(ct) and ct[-1] >= t_ns
            return bool(self._pt) and self._pt[-1] >= t_ns

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
        err0, late0 = self._edge_error(t0_ns, estimate.method, begin=True)
        err1, late1 = self._edge_error(t1_ns, estimate.method, begin=False)
        energy, method = estimate.energy_j, estimate.method
        if method.startswith("counter") and energy <= 0 and self._pt and t1_ns > t0_ns:
            power = self._integral(t0_ns, t1_ns)
            if power > 0:
                energy, method, late0 = power, "integrated", True
        if late0 or late1:
            method += ", late"
        return EnergyEstimate(energy, method, err0 + err1)

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
        if self._head_model_active():
            return "head"
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
        period between a low and a high one leans towards each, as a step inside it does.
        """
        ce = self._ce
        t_p, t_n = refined(i - 2), refined(i + 1)
        length = (t_b - t_a) / 1e9
        if t_p >= t_a or t_n <= t_b:
            return (ce[i] - ce[i - 1]) * offset / (t_b - t_a)
        mean = (ce[i] - ce[i - 1]) / length
        before = (ce[i - 1] - ce[i - 2]) / ((t_a - t_p) / 1e9)
        after = (ce[i + 1] - ce[i]) / ((t_n - t_b) / 1e9)
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
        x = offset / 1e9
        return mean * x + slope * x * (x - length) / 2

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

    def _typical_interval(self, i: int) -> float:
        """The median interval between power readings around reading ``i``."""
        pt = self._pt
        lo, hi = max(0, i - 8), min(len(pt), i + 9)
        if hi - lo < 3:
            return math.inf
        gaps = sorted(pt[k + 1] - pt[k] for k in range(lo, hi - 1))
        return float(gaps[len(gaps) // 2])

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
        if self._lead is not None:
            return self._lead
        ct, first = self._ct, self._first_reading
        if self.fine_counter or first is None or len(ct) < 3 or self._ct_trimmed:
            return None
        if first[0] != self.first_t_ns:
            # The counter was first read after the span began: the head stays integrated from
            # power (and a bounded history need not keep the samples before that reading).
            return None
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
