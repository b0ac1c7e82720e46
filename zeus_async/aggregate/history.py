"""Per-device sample histories and the energy estimators that read them.

A :class:`DeviceHistory` keeps, for one device, the power samples (with their cumulative
trapezoid integral) and the points where its energy counter was seen to move. Energy over any
interval ``[t0, t1]`` then comes from the best source that covers it:

* **counter** (Volta+ GPUs, RAPL): the counter is exact at its update instants. An update is
  observed by the first sample after it, so its instant is estimated as the midpoint between
  that sample and the previous one (error ≤ half a sample period). Between two updates the
  cumulative energy is interpolated linearly in time — the period's energy is exact, only its
  distribution inside the period is assumed uniform. This never reports 0 J for a window
  shorter than the counter period.
* **integrated** (pre-Volta GPUs, or no counter update yet around the interval): power samples
  integrated with the trapezoid rule, held constant beyond the first and last sample.

Histories are appended from the runtime's thread and read from any thread, under a lock.
"""

from __future__ import annotations

import bisect
import logging
import threading

__all__ = ["DeviceHistory", "EnergyEstimate"]

logger = logging.getLogger(__name__)


class EnergyEstimate:
    """Energy over an interval and how it was obtained."""

    __slots__ = ("energy_j", "method")

    def __init__(self, energy_j: float | None, method: str) -> None:
        self.energy_j = energy_j
        self.method = method

    def __repr__(self) -> str:
        return f"EnergyEstimate({self.energy_j!r}, {self.method!r})"


class DeviceHistory:
    """Samples of one device, kept as parallel lists sorted by time.

    Args:
        key: Device key (``gpu:0``, ``cpu:0/package``).
        fine_counter: The counter updates much faster than it is sampled (RAPL): every reading
            is an exact point of the cumulative energy.
    """

    def __init__(self, key: str, *, fine_counter: bool = False) -> None:
        self.key = key
        self.fine_counter = fine_counter
        self._lock = threading.Lock()
        # Power samples: time, power, cumulative trapezoid energy at that time.
        self._pt: list[int] = []
        self._pw: list[float] = []
        self._pc: list[float] = []
        # Counter points: estimated update time, counter value.
        self._ct: list[int] = []
        self._ce: list[float] = []
        self._last_counter: float | None = None
        self._last_counter_t: int | None = None
        self.last_t_ns: int | None = None
        self.lost_at_ns: int | None = None
        self.has_counter = False
        self.counter_updates = 0

    # -- writing (runtime thread) -------------------------------------------------------------

    def add(self, t_ns: int, power_w: float | None, counter_j: float | None) -> None:
        """Record one sample (either field may be missing)."""
        with self._lock:
            if self.last_t_ns is not None and t_ns < self.last_t_ns:
                return  # out of order: ignore rather than corrupt the sorted lists
            if power_w is not None:
                if self._pt:
                    t_prev, p_prev = self._pt[-1], self._pw[-1]
                    cum = self._pc[-1] + (p_prev + power_w) / 2 * (t_ns - t_prev) / 1e9
                else:
                    cum = 0.0
                self._pt.append(t_ns)
                self._pw.append(power_w)
                self._pc.append(cum)
            if counter_j is not None:
                self.has_counter = True
                if self.fine_counter:
                    self._ct.append(t_ns)
                    self._ce.append(counter_j)
                elif self._last_counter is not None and counter_j != self._last_counter:
                    assert self._last_counter_t is not None
                    self._ct.append((self._last_counter_t + t_ns) // 2)
                    self._ce.append(counter_j)
                    self.counter_updates += 1
                # (The first reading of a coarse counter belongs to an earlier, unknown update
                # instant, so it is no interpolation point.)
                self._last_counter = counter_j
                self._last_counter_t = t_ns
            self.last_t_ns = t_ns

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
                del self._ct[:j], self._ce[:j]

    # -- reading (any thread) -----------------------------------------------------------------

    def covers(self, t_ns: int) -> bool:
        """Whether data after ``t_ns`` has arrived so that an interval ending there is final.

        With a counter: an update after ``t_ns`` was observed. Without: a power sample at or
        after ``t_ns``.
        """
        with self._lock:
            if self.has_counter and (self._ct or not self.fine_counter):
                return bool(self._ct) and self._ct[-1] >= t_ns
            return bool(self._pt) and self._pt[-1] >= t_ns

    def energy(self, t0_ns: int, t1_ns: int) -> EnergyEstimate:
        """Energy over ``[t0_ns, t1_ns]`` from the best source covering it."""
        if t1_ns < t0_ns:
            raise ValueError("interval ends before it starts")
        with self._lock:
            ct, ce = self._ct, self._ce
            if len(ct) >= 2 and ct[0] <= t0_ns and ct[-1] >= t1_ns:
                e = _interp(ct, ce, t1_ns) - _interp(ct, ce, t0_ns)
                return EnergyEstimate(e, "counter+interpolated")
            if len(ct) >= 2 and self._pt and ct[0] <= t1_ns:
                # Counter covers part of the interval: counter inside, power at the ends.
                lo, hi = max(t0_ns, ct[0]), min(t1_ns, ct[-1])
                e = _interp(ct, ce, hi) - _interp(ct, ce, lo)
                e += self._integral(t0_ns, lo) + self._integral(hi, t1_ns)
                return EnergyEstimate(e, "counter+extrapolated")
            if self._pt:
                return EnergyEstimate(self._integral(t0_ns, t1_ns), "integrated")
            return EnergyEstimate(None, "unavailable")

    def _cum(self, t_ns: int) -> float:
        """Cumulative integrated power at ``t_ns`` (power held constant outside the samples)."""
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

    def _integral(self, t0_ns: int, t1_ns: int) -> float:
        if t1_ns <= t0_ns:
            return 0.0
        return self._cum(t1_ns) - self._cum(t0_ns)


def _interp(ts: list[int], es: list[float], t_ns: int) -> float:
    i = bisect.bisect_right(ts, t_ns)
    if i == 0:
        return es[0]
    if i == len(ts):
        return es[-1]
    t_a, t_b = ts[i - 1], ts[i]
    return es[i - 1] + (es[i] - es[i - 1]) * (t_ns - t_a) / (t_b - t_a)
