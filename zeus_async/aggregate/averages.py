"""Window energy from a driver's sliding power average, for devices without an energy counter.

Some devices that must integrate power also publish a sliding average on a regular grid: NVML's
``NVML_FI_DEV_POWER_AVERAGE`` in the MODULE power scope of a Grace superchip (GH200, GB200) is
the mean over the last second, refreshed every 100 ms on the driver's grid. With ``g_k`` the
grid instants, ``P`` the refresh period, ``W = n P`` the averaging window and ``A_k`` the
average published at ``g_k``, the energy of the *piece* ``e_k = ∫ p`` over ``(g_{k-1}, g_k]``
satisfies::

    e_{k-n+1} + ... + e_k = A_k W

so any ``n`` consecutive pieces are known exactly, and ``e_k - e_{k-n} = (A_k - A_{k-1}) W``.
The pieces are known up to an ``n``-periodic sequence that sums to zero; the instant power
readings (an H100-like sensor: the mean of the head of each period) give a first guess ``h_k``
of every piece, and the guesses are adjusted by least squares (the smallest change of the
guesses, in the sum of squares, that makes every run of ``n`` pieces add up to its average's
integral). A window ``[a, b]`` is then whole pieces plus two partial ones, each split at the
window's edge by the instant readings (a head level and one step to the next piece's head,
keeping the piece's energy, as the counter periods of an H100 are split, :mod:`.periods`).
Runs of ``n`` whole pieces inside the window are taken straight from the averages, so a window
whose length is a whole number of seconds and whose edges lie on the grid is exact, and one
that is a whole number of seconds long is exact up to how its two edge pieces are split.

The grid is not reported: its phase is where the average changes, somewhere between the sample
before and the sample that saw the change; the brackets of many changes are intersected
(:meth:`AverageReadings.grid`), and what is left of the phase's uncertainty is in the bound.

The error bound (:meth:`AverageReadings.energy`) adds, per edge, the widest the split of the
edge piece can be off while the power stays within the levels read around it (every level read
within half a second where the head model does not fit the piece: a level the heads did not
see), the grid phase's uncertainty times the levels' spread, and for the pieces that are not a
whole run of ``n`` the widest their sum can be off within the levels around them.
"""

from __future__ import annotations

import bisect
import logging
import math

__all__ = ["AverageReadings"]

logger = logging.getLogger(__name__)

#: Pieces before (and after, where the data reaches) each window edge whose guesses the least
#: squares adjustment uses: 10 s of 100 ms pieces.
_CONTEXT = 100
#: Readings either side of a window's middle whose changes are intersected to find the grid
#: phase (20 s at 100 Hz).
_BRACKETS = 2000
#: Windows longer than this many pieces with an average missing in between are integrated.
_MOST_PIECES = 3000
#: Pieces either side of an edge piece whose readings bound a level no head saw.
_HIDDEN_REACH = 5
#: Resolution of a reported average (W): NVML reports mW.
_RESOLUTION_W = 1e-3


class AverageReadings:
    """The sliding-average readings of one device and the window energy they give.

    Args:
        window_ns: The averaging window (``DeviceInfo.power_average_window_s``).
        period_ns: How often the average is refreshed, on the driver's grid
            (``DeviceInfo.power_average_period_s``); the window must be a whole number of
            periods.
        head_ns: How long a head of each period the instant readings average
            (``DeviceInfo.power_reading_window_s``; 0: split the edge pieces in proportion
            to time).
    """

    def __init__(self, window_ns: int, period_ns: int, head_ns: int = 0) -> None:
        if period_ns <= 0 or window_ns < period_ns or window_ns % period_ns:
            raise ValueError("the averaging window must be a whole number of refresh periods")
        self.window_ns = window_ns
        self.period_ns = period_ns
        self.n = window_ns // period_ns
        self.head_ns = min(max(head_ns, 0), period_ns)
        self.t: list[int] = []
        self.w: list[float] = []
        # What the last estimate used: the guess of each piece (W) and which readings describe
        # which piece (see _guesses).
        self._guess: dict[int, float] = {}
        self._lag = 0
        #: Readings ignored for not being later than the previous one.
        self.dropped = 0

    # -- writing ----------------------------------------------------------------------------

    def add(self, t_ns: int, avg_w: float) -> None:
        """One average reading (the caller holds the history's lock)."""
        if avg_w != avg_w:
            return
        if self.t and t_ns <= self.t[-1]:
            self.dropped += 1
            return
        self.t.append(t_ns)
        self.w.append(avg_w)

    def trim_before(self, t_ns: int) -> None:
        """Forget readings older than ``t_ns`` (keeping one before it)."""
        i = bisect.bisect_left(self.t, t_ns) - 1
        if i > 0:
            del self.t[:i], self.w[:i]

    # -- the grid ---------------------------------------------------------------------------

    def grid(self, around_ns: int) -> tuple[int, float] | None:
        """The grid's phase (an instant on it, ns) and its uncertainty (half the width of the
        phases every change bracket allows, ns), from the changes of the average nearest to
        ``around_ns``; ``None`` with no change seen through a bracket narrower than a period.
        """
        t, w, period = self.t, self.w, self.period_ns
        if len(t) < 2:
            return None
        mid = bisect.bisect_left(t, around_ns)
        lo, hi = max(1, mid - _BRACKETS), min(len(t), mid + _BRACKETS)
        feasible: tuple[float, float] | None = None
        for i in range(lo, hi):
            if w[i] == w[i - 1]:
                continue
            a, b = t[i - 1], t[i]  # a refresh in (a, b]
            if b - a >= period:
                continue
            if feasible is None:
                feasible = (float(a), float(b))
                continue
            f0, f1 = feasible
            centre = (f0 + f1) / 2
            shift = round((centre - (a + b) / 2) / period) * period
            n0, n1 = max(f0, a + shift), min(f1, b + shift)
            if n0 < n1:
                feasible = (n0, n1)
            # else: a bracket at odds with the others (a stamp taken late): passed over
        if feasible is None:
            return None
        f0, f1 = feasible
        return math.floor((f0 + f1) / 2), (f1 - f0) / 2

    # -- reading ----------------------------------------------------------------------------

    def energy(
        self, t0_ns: int, t1_ns: int, pt: list[int], pw: list[float]
    ) -> tuple[float, float] | None:
        """Energy over ``[t0_ns, t1_ns]`` (J) and its error bound (J), from the averages and the
        instant readings ``pt``/``pw``; ``None`` where the averages do not cover the window
        (before the first average's window, or after the last average read)."""
        if t1_ns <= t0_ns or not self.t:
            return None
        found = self.grid((t0_ns + t1_ns) // 2)
        if found is None:
            return None
        phase, spread = found
        period, n = self.period_ns, self.n
        # Piece k is (g_{k-1}, g_k] with g_k = phase + k * period.
        ka = -((phase - t0_ns) // period)  # ceil((t0 - phase) / period)
        kb = -((phase - t1_ns) // period)
        averages = self._averages(phase, ka - _CONTEXT - n, kb + _CONTEXT)
        if not averages:
            return None
        first, last = min(averages), max(averages)
        if ka < first - n + 1 or kb > last or (kb - ka > _MOST_PIECES):
            return None
        # Pieces ka .. kb - 1 whole, less the part of piece ka before t0, plus the part of
        # piece kb up to t1. Whole runs of n pieces from ka on come straight from the
        # averages; the pieces left over, and the two edge pieces, from the adjusted guesses.
        runs = (kb - ka) // n
        ends = [ka - 1 + (m + 1) * n for m in range(runs)]
        if all(k in averages for k in ends):
            exact = sum(averages[k] for k in ends) * self.window_ns / 1e9
            rest = range(ka + runs * n, kb)
        else:
            exact, ends = 0.0, []
            rest = range(ka, kb)
        pieces, levels = self._pieces(phase, averages, sorted({ka, kb, *rest}), pt, pw)
        if pieces is None:
            return None
        energy = exact
        error = len(ends) * _RESOLUTION_W * self.window_ns / 1e9
        if rest:
            est = sum(pieces[k] for k in rest)
            low = min(levels[k][0] for k in rest)
            high = max(levels[k][1] for k in rest)
            length = len(rest) * period / 1e9
            energy += est
            error += max(est - low * length, high * length - est, 0.0)
        for k, t, sign in ((ka, t0_ns, -1.0), (kb, t1_ns, 1.0)):
            part, bound = self._partial(k, t - (phase + (k - 1) * period), pieces, levels)
            energy += sign * part
            low, high = levels[k]
            error += bound + (high - low) * spread / 1e9
        return energy, error

    def _averages(self, phase: int, k0: int, k1: int) -> dict[int, float]:
        """The average published at each grid instant ``g_k``, ``k0 <= k <= k1``, that was read
        (the last reading stamped in ``[g_k, g_{k+1})``)."""
        t, w, period = self.t, self.w, self.period_ns
        i0 = bisect.bisect_left(t, phase + k0 * period)
        i1 = bisect.bisect_left(t, phase + (k1 + 1) * period)
        out: dict[int, float] = {}
        for i in range(i0, i1):
            out[(t[i] - phase) // period] = w[i]
        return out

    def _guesses(
        self, phase: int, k0: int, k1: int, pt: list[int], pw: list[float], lag: int
    ) -> dict[int, float]:
        """Mean instant reading per piece ``k0..k1``: the readings stamped in ``[g_j,
        g_{j+1})`` stand for piece ``j + lag`` (``lag`` 0: the head of the period that just
        ended, as an H100's sensor; 1: their own moment)."""
        period = self.period_ns
        i0 = bisect.bisect_left(pt, phase + (k0 - lag) * period)
        i1 = bisect.bisect_left(pt, phase + (k1 - lag + 1) * period)
        sums: dict[int, list[float]] = {}
        for i in range(i0, i1):
            k = (pt[i] - phase) // period + lag
            acc = sums.setdefault(k, [0.0, 0.0])
            acc[0] += pw[i]
            acc[1] += 1.0
        return {k: s / c for k, (s, c) in sums.items()}

    def _pieces(
        self,
        phase: int,
        averages: dict[int, float],
        wanted: list[int],
        pt: list[int],
        pw: list[float],
    ) -> tuple[dict[int, float] | None, dict[int, tuple[float, float]]]:
        """The adjusted energy of each piece in ``wanted`` (and of its neighbours), with the
        range of power levels each may hold (W): least squares around each group of wanted
        pieces (see the module docstring)."""
        import numpy as np

        n, period = self.n, self.period_ns
        p_s = period / 1e9
        first, last = min(averages), max(averages)
        pieces: dict[int, float] = {}
        levels: dict[int, tuple[float, float]] = {}
        self._guess, self._lag = {}, 0
        # Groups of wanted pieces close enough to share one adjustment.
        groups: list[list[int]] = []
        for k in wanted:
            if groups and k - groups[-1][-1] <= _CONTEXT:
                groups[-1].append(k)
            else:
                groups.append([k])
        for group in groups:
            k0 = max(group[0] - _CONTEXT, first - n + 1)
            k1 = min(group[-1] + _CONTEXT, last)
            # Which readings describe which piece: the shift whose guesses fit the averages.
            best: tuple[float, int, dict[int, float]] | None = None
            for lag in (0, 1):
                g = self._guesses(phase, k0 - 1, k1 + 1, pt, pw, lag)
                miss = 0.0
                rows = 0
                for k in range(k0 + n - 1, k1 + 1):
                    a = averages.get(k)
                    if a is None or any(j not in g for j in range(k - n + 1, k + 1)):
                        continue
                    miss += abs(sum(g[j] for j in range(k - n + 1, k + 1)) / n - a)
                    rows += 1
                score = miss / rows if rows else math.inf
                if best is None or score < best[0]:
                    best = (score, lag, g)
            assert best is not None
            _, lag, guess = best
            self._lag = lag
            self._guess.update(guess)
            size = k1 - k0 + 1
            if size <= 0:
                return None, levels
            # A piece no reading describes: the nearest average stands in for it.
            h = np.empty(size)
            for j in range(size):
                k = k0 + j
                value = guess.get(k)
                if value is None:
                    near = min(averages, key=lambda m: abs(m - k))
                    value = averages[near]
                h[j] = value * p_s
            rows_k = [k for k in range(k0 + n - 1, k1 + 1) if k in averages]
            e = h
            if rows_k:
                c = np.zeros((len(rows_k), size))
                s = np.empty(len(rows_k))
                for r, k in enumerate(rows_k):
                    c[r, k - n + 1 - k0 : k - k0 + 1] = 1.0
                    s[r] = averages[k] * self.window_ns / 1e9
                lam = np.linalg.solve(c @ c.T, s - c @ h)
                e = h + c.T @ lam
            for j in range(size):
                pieces[k0 + j] = float(e[j])
            for k in group:
                if k not in pieces:
                    return None, levels
                seen = [guess[j] for j in (k - 1, k, k + 1, k + 2) if j in guess]
                mean = pieces[k] / p_s
                low, high = min([*seen, mean]), max([*seen, mean])
                if not self._fits(k, pieces, guess):
                    reach = range(k - _HIDDEN_REACH, k + _HIDDEN_REACH + 1)
                    wide = [guess[j] for j in reach if j in guess]
                    wide += [pieces[j] / p_s for j in reach if j in pieces]
                    low, high = min([low, *wide]), max([high, *wide])
                levels[k] = (max(low, 0.0), high)
        return pieces, levels

    def _fits(self, k: int, pieces: dict[int, float], guess: dict[int, float]) -> bool:
        """Whether piece ``k`` is its head level and at most one step to the next head's."""
        h, c = guess.get(k), guess.get(k + 1)
        if h is None or c is None:
            return False
        length, head = self.period_ns / 1e9, self.head_ns / 1e9
        tail_e, tail_l = pieces[k] - h * head, length - head
        if tail_l <= 0:
            return True
        mean = tail_e / tail_l
        return min(h, c) - 1e-6 <= mean <= max(h, c) + 1e-6

    def _partial(
        self,
        k: int,
        offset_ns: int,
        pieces: dict[int, float],
        levels: dict[int, tuple[float, float]],
    ) -> tuple[float, float]:
        """Energy of piece ``k`` up to ``offset_ns`` into it, and how far off it can be while
        the power stays within the piece's levels."""
        length = self.period_ns / 1e9
        x = min(max(offset_ns / 1e9, 0.0), length)
        energy = pieces[k]
        guess = self._guess
        h, c = guess.get(k, math.nan), guess.get(k + 1, math.nan)
        part = energy * x / length
        if self._lag == 0 and self.head_ns > 0 and h == h:
            part = _head_split(energy, h, c, x, length, self.head_ns / 1e9)
        low, high = levels[k]
        lo = max(low * x, energy - high * (length - x))
        hi = min(high * x, energy - low * (length - x))
        bound = max(part - lo, hi - part, 0.0)
        return part, bound


def _head_split(energy: float, h: float, c: float, x: float, length: float, w: float) -> float:
    """Energy of a piece (``energy`` over ``length`` s) up to ``x`` s into it: a head at ``h``
    for ``w`` s, then one step to the next head's level ``c`` placed so that the energies add
    up (uniform over the tail where that does not fit), as :meth:`CounterPeriods._period_partial
    <zeus_async.aggregate.periods.CounterPeriods._period_partial>` splits a counter period."""
    w = min(w, length)
    tail_e, tail_l = energy - h * w, length - w
    if tail_e < 0 or tail_l <= 0:
        return energy * x / length
    step = (tail_e - c * tail_l) / (h - c) if c == c and abs(h - c) > 1e-9 else -1.0
    segments: list[tuple[float, float, float]] = [(0.0, w, h)]
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
