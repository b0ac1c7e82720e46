"""A step weight learnt from the GPU's own energy: the ``steps`` policy's ``step_weight="fit"``.

The ``steps`` policy splits a step's power above the GPU's base power in proportion to each
request's weight in the step. The right weight is what the request's work in the step costs,
which depends on the model and the device (a decode token's reads of the KV cache cost as
much as its own compute at a context of a few hundred tokens on one device, thousands on
another): no fixed weight fits every device. The meter sees each step's composition and the
GPU's measured energy, so it can learn it. The model: over a stretch of time on one GPU,

    energy - base power * duration = a * P + b * D + c * DC + d * PA

with ``P`` the prefill tokens of the steps in it, ``D`` their decode tokens, ``DC`` the sum
over the decode tokens of their context (the KV cache each reads) and ``PA`` the sum over the
prefill tokens of what each attends to (the context before the chunk plus, causally, half the
chunk). ``a, b, c, d >= 0`` (non-negative least squares: no work gives energy back), fitted
over stretches of at least ``interval_s`` (the energy counter updates every 100 ms and steps
last ~10-50 ms: one step's energy is not measurable, a second's is), with exponential
forgetting (``half_life_s``) so the fit follows a change (another model loaded, clocks). The
weight of a request in a step is then ``a * p + b * d + c * d * ctx + d * p * (ctx + p / 2)``
(joules of its work, as the model says); until ``min_intervals`` stretches are in and the
features are not collinear, :func:`~.attribution.default_step_weight`.

Cost: O(features^2) per stretch (the normal equations, updated), O(1) per step (its features
summed, once); the fit itself (15 subsets of 4 columns, each a Cholesky of at most 4 x 4) once
per stretch.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from .attribution import StepEntry, default_step_weight

__all__ = ["FEATURES", "StepWeightFit", "step_features"]

logger = logging.getLogger(__name__)

#: The model's columns (see the module docstring).
FEATURES: Final = ("prefill", "decode", "decode_context", "prefill_attention")
_N: Final = len(FEATURES)


def step_features(entry: StepEntry) -> tuple[float, float, float, float]:
    """One entry's ``(P, D, DC, PA)`` (see the module docstring)."""
    p = float(entry.prefill_tokens)
    d = float(entry.decode_tokens)
    ctx = float(entry.context_len)
    return p, d, d * ctx, p * (ctx + p / 2)


class StepWeightFit:
    """The ``steps`` policy's weight, fitted to a GPU's energy (see the module docstring).

    The meter feeds it: :meth:`add_step` for each step it takes (its interval, GPUs and
    entries), :meth:`update` for each GPU at each settle (the settled interval's energy and
    the base power); :meth:`weight` is the step weight.

    Args:
        interval_s: Seconds of settled time per fitted stretch (per GPU), at least.
        half_life_s: The forgetting: a stretch's influence halves every this many seconds
            of stretches after it.
        min_intervals: Stretches needed before the fit is used (in all, not forgotten).
        min_pivot: The smallest pivot of the normalised normal equations (1 - R^2 of a
            column on the others) for the fit to be used: below, columns are collinear.
        fallback: The weight until then.
        max_pending: Steps waiting for a settle per GPU, at most (the oldest dropped).
    """

    def __init__(
        self,
        *,
        interval_s: float = 0.5,
        half_life_s: float = 120.0,
        min_intervals: int = 20,
        min_pivot: float = 1e-6,
        fallback: Callable[[StepEntry], float] = default_step_weight,
        max_pending: int = 100_000,
    ) -> None:
        if not (interval_s > 0 and half_life_s > 0 and min_intervals >= 1 and min_pivot > 0):
            raise ValueError("interval_s, half_life_s, min_pivot must be > 0, min_intervals >= 1")
        self.interval_s = interval_s
        self.half_life_s = half_life_s
        self.min_intervals = min_intervals
        self.min_pivot = min_pivot
        self.fallback = fallback
        self._max_pending = max_pending
        #: The normal equations, forgotten: sum of x x^T, of x y; the forgotten count.
        self._gram = [[0.0] * _N for _ in range(_N)]
        self._rhs = [0.0] * _N
        self.count = 0.0
        #: Stretches fitted in all.
        self.intervals = 0
        #: Per GPU, steps not yet settled: [start_ns, end_ns, P, D, DC, PA].
        self._pending: dict[int, list[list[float]]] = {}
        #: Per GPU, the stretch being summed: [seconds, energy above base, P, D, DC, PA].
        self._bucket: dict[int, list[float]] = {}
        #: The fitted ``(a, b, c, d)`` (J per unit of each of :data:`FEATURES`), or
        #: ``None`` while the fallback weight is used.
        self.coefficients: tuple[float, float, float, float] | None = None

    # -- the weight ---------------------------------------------------------------------

    def weight(self, entry: StepEntry) -> float:
        """The entry's weight: its work's energy as fitted (J), or the fallback's."""
        k = self.coefficients
        if k is None:
            return self.fallback(entry)
        p = float(entry.prefill_tokens)
        d = float(entry.decode_tokens)
        ctx = float(entry.context_len)
        return k[0] * p + k[1] * d + k[2] * d * ctx + k[3] * p * (ctx + p / 2)

    def as_dict(self) -> dict[str, float] | None:
        """The coefficients by feature name (``None`` before the fit is used)."""
        k = self.coefficients
        return None if k is None else dict(zip(FEATURES, k, strict=True))

    # -- the data -----------------------------------------------------------------------

    def add_step(
        self, start_ns: int, end_ns: int, gpus: Iterable[int], entries: Iterable[StepEntry]
    ) -> None:
        """A step the meter took: its features, waiting for the settle of its interval."""
        p = d = dc = pa = 0.0
        for e in entries:
            f = step_features(e)
            p += f[0]
            d += f[1]
            dc += f[2]
            pa += f[3]
        if not (p or d):
            return
        for g in gpus:
            pending = self._pending.setdefault(g, [])
            if len(pending) >= self._max_pending:
                del pending[: len(pending) // 2]
            pending.append([float(start_ns), float(end_ns), p, d, dc, pa])

    def update(
        self, gpu: int, start_ns: int, end_ns: int, energy_j: float | None, base_w: float
    ) -> None:
        """GPU ``gpu``'s settled ``[start_ns, end_ns]``: its energy (``None``: not measured;
        its steps are dropped) and base power. The steps ending by ``end_ns`` go in whole,
        one across it in part (by time); a stretch of ``interval_s`` makes a row."""
        pending = self._pending.get(gpu)
        f = [0.0] * _N
        if pending:
            keep: list[list[float]] = []
            for st in pending:
                s0, s1 = st[0], st[1]
                if s1 <= end_ns:
                    share = 1.0
                elif s0 < end_ns:
                    share = (end_ns - s0) / (s1 - s0)
                    rest = 1.0 - share
                    keep.append([float(end_ns), s1, *(x * rest for x in st[2:])])
                else:
                    keep.append(st)
                    continue
                for j in range(_N):
                    f[j] += share * st[2 + j]
            self._pending[gpu] = keep
        if energy_j is None or not math.isfinite(energy_j) or end_ns <= start_ns:
            self._bucket.pop(gpu, None)
            return
        seconds = (end_ns - start_ns) / 1e9
        bucket = self._bucket.get(gpu)
        if bucket is None:
            bucket = self._bucket[gpu] = [0.0] * (2 + _N)
        bucket[0] += seconds
        bucket[1] += energy_j - base_w * seconds
        for j in range(_N):
            bucket[2 + j] += f[j]
        if bucket[0] >= self.interval_s:
            del self._bucket[gpu]
            self._row(bucket[2:], bucket[1], bucket[0])

    def _row(self, x: Sequence[float], y: float, seconds: float) -> None:
        if not any(x):
            return  # idle: nothing to learn
        keep = 0.5 ** (seconds / self.half_life_s)
        gram, rhs = self._gram, self._rhs
        for i in range(_N):
            xi = x[i]
            rhs[i] = keep * rhs[i] + xi * y
            row = gram[i]
            for j in range(_N):
                row[j] = keep * row[j] + xi * x[j]
        self.count = keep * self.count + 1.0
        self.intervals += 1
        if self.intervals >= self.min_intervals:
            self._refit()

    # -- the fit --------------------------------------------------------------------------

    def _refit(self) -> None:
        """Non-negative least squares on the normal equations: the best of the unconstrained
        fits on each subset of the columns whose coefficients all come out positive (the
        constrained optimum is one of them, with 4 columns 15 to try)."""
        gram, rhs = self._gram, self._rhs
        seen = [j for j in range(_N) if gram[j][j] > 0.0]
        if not seen:
            return
        scale = {j: math.sqrt(gram[j][j]) for j in seen}
        # Normalised: unit diagonal (the columns' units differ by orders of magnitude).
        c = {(i, j): gram[i][j] / (scale[i] * scale[j]) for i in seen for j in seen}
        h = {j: rhs[j] / scale[j] for j in seen}
        if _solve(seen, c, h, self.min_pivot) is None:
            self.coefficients = None  # collinear columns: not identifiable
            return
        best: dict[int, float] | None = None
        best_gain = 0.0
        for size in range(1, len(seen) + 1):
            for subset in itertools.combinations(seen, size):
                beta = _solve(subset, c, h, 1e-12)
                if beta is None or any(b <= 0.0 for b in beta.values()):
                    continue
                gain = math.fsum(beta[j] * h[j] for j in subset)  # -objective at the fit
                if gain > best_gain:
                    best, best_gain = beta, gain
        if best is None:
            self.coefficients = None  # nothing above base to explain
            return
        k = [0.0] * _N
        for j, b in best.items():
            k[j] = b / scale[j]
        self.coefficients = (k[0], k[1], k[2], k[3])


def _solve(
    cols: Sequence[int], c: dict[tuple[int, int], float], h: dict[int, float], min_pivot: float
) -> dict[int, float] | None:
    """``C[cols, cols] beta = h[cols]`` by Cholesky; ``None`` when a pivot is below
    ``min_pivot`` (the columns collinear)."""
    n = len(cols)
    low = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            s = c[cols[i], cols[j]] - math.fsum(low[i][k] * low[j][k] for k in range(j))
            if i == j:
                if not s >= min_pivot:
                    return None
                low[i][i] = math.sqrt(s)
            else:
                low[i][j] = s / low[j][j]
    z = [0.0] * n
    for i in range(n):
        z[i] = (h[cols[i]] - math.fsum(low[i][k] * z[k] for k in range(i))) / low[i][i]
    beta = [0.0] * n
    for i in reversed(range(n)):
        beta[i] = (z[i] - math.fsum(low[k][i] * beta[k] for k in range(i + 1, n))) / low[i][i]
    return dict(zip(cols, beta, strict=True))
