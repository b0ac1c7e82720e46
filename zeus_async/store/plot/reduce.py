"""Reduction of power series to the pixels they are drawn on, and gaps in the readings.

:func:`_decimate` keeps the lowest and highest sample of each pixel column of a line,
:func:`_column_stat` gives each pixel column of the heatmap one value, and :func:`_with_gaps`
breaks a line where readings are missing. numpy is imported when they run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .options import HeatmapStat

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    import numpy.typing as npt

    _Floats: TypeAlias = npt.NDArray[np.float64]
    _Ints: TypeAlias = npt.NDArray[np.intp]

logger = logging.getLogger(__name__)


#: A gap in a GPU's readings is over this many median sampling periods (and at least
#: :data:`_MIN_GAP_S`): the line breaks there, the heatmap holds no value across it.
_GAP_PERIODS = 10.0
_MIN_GAP_S = 1e-3


def _column_bounds(xs: _Floats, columns: int, lo: float, hi: float) -> _Ints:
    """Where each of ``columns`` pixel columns across ``[lo, hi]`` begins in the sorted ``xs``,
    then ``len(xs)``: column ``k`` holds ``xs[b[k]:b[k + 1]]`` (any x before ``lo`` is in the
    first, any after ``hi`` in the last). O(columns log n), whatever n."""
    import numpy as np

    edges = lo + (hi - lo) * (np.arange(1, columns) / columns)
    inner = np.searchsorted(xs, edges, side="left")
    return np.concatenate(([0], inner, [len(xs)])).astype(np.intp)


def _first_hits(mask: npt.NDArray[np.bool_], starts: _Ints) -> _Ints:
    """The first index where ``mask`` holds in each group of indices (``starts``: where each
    begins, sorted) that has one, in order."""
    import numpy as np

    hits = np.flatnonzero(mask)
    group = np.searchsorted(starts, hits, side="right")
    first = np.ones(len(hits), dtype=bool)
    first[1:] = group[1:] != group[:-1]
    return hits[first]


def _decimate(
    xs: Sequence[float] | _Floats,
    ys: Sequence[float] | _Floats,
    buckets: int,
    lo: float | None = None,
    hi: float | None = None,
) -> tuple[_Floats, _Floats]:
    """At most ~``2 * buckets`` points: the min and max of each time bucket, in time order.

    ``buckets`` pixel columns span ``[lo, hi]`` (default: the first and last x); ``xs`` must be
    sorted (and not NaN). A series of at most ``2 * buckets`` points is returned as it is.
    Keeps the envelope (peaks and dips) a line of that many pixels can show: the first lowest
    and first highest sample of each column. A NaN in ``ys`` is a break in the line and is
    kept, and the samples on either side of it are never merged into one point. O(n) in
    numpy, a few passes over the samples.
    """
    import numpy as np

    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    n = len(x)
    if n <= 2 * buckets:
        return x, y
    lo = float(x[0]) if lo is None else lo
    hi = float(x[-1]) if hi is None else hi
    breaks = np.flatnonzero(np.isnan(y))
    # Groups: the pixel columns, cut at every break; each break is a group of its own.
    starts = np.unique(
        np.concatenate((_column_bounds(x, buckets, lo, hi)[:-1], breaks, breaks + 1))
    )
    starts = starts[starts < n]
    sizes = np.diff(np.append(starts, n))
    # A break's group has a NaN min and max, which nothing equals: no hit, dropped here.
    low = _first_hits(y == np.repeat(np.minimum.reduceat(y, starts), sizes), starts)
    high = _first_hits(y == np.repeat(np.maximum.reduceat(y, starts), sizes), starts)
    keep = np.concatenate((low, high[high != low], breaks))
    keep.sort()
    return x[keep], y[keep]


def _gap_limit(xs: _Floats) -> float:
    """The longest step between two readings that is not a gap (see :data:`_GAP_PERIODS`);
    ``xs`` in seconds, sorted."""
    import numpy as np

    if len(xs) < 3:
        return math.inf
    return max(_GAP_PERIODS * float(np.median(np.diff(xs))), _MIN_GAP_S)


def _with_gaps(xs: _Floats, ys: _Floats, limit: float) -> tuple[_Floats, _Floats]:
    """Insert a NaN break where readings are missing (a step over ``limit``), so the line does
    not draw a made-up ramp across time with no readings. The break sits midway across the
    gap, so the x stay sorted."""
    import numpy as np

    if len(xs) < 2:
        return xs, ys
    where = np.flatnonzero(np.diff(xs) > limit) + 1
    if not len(where):
        return xs, ys
    mid = (xs[where - 1] + xs[where]) / 2
    return np.insert(xs, where, mid), np.insert(ys, where, np.nan)


def _column_stat(
    xs: _Floats,
    ys: _Floats,
    columns: int,
    lo: float,
    hi: float,
    stat: HeatmapStat,
    hold: float,
) -> _Floats:
    """One value per pixel column across ``[lo, hi]``: the ``stat`` of the readings in it.

    ``xs`` sorted, without NaN. A column with no reading of its own takes the last reading
    before it when the next one follows within ``hold`` (a reading lasts until the next,
    unless a gap parts them); otherwise it is NaN (drawn as "no reading").
    """
    import numpy as np

    out = np.full(columns, np.nan)
    if not len(xs):
        return out
    bounds = _column_bounds(xs, columns, lo, hi)
    counts = np.diff(bounds)
    filled = np.flatnonzero(counts)
    starts = bounds[filled]
    if stat == "max":
        out[filled] = np.maximum.reduceat(ys, starts)
    else:
        out[filled] = np.add.reduceat(ys, starts) / counts[filled]
    empty = np.flatnonzero(counts == 0)
    if len(empty) and len(xs) > 1:
        centres = lo + (empty + 0.5) * ((hi - lo) / columns)
        before = np.searchsorted(xs, centres, side="right") - 1
        ok = (before >= 0) & (before < len(xs) - 1)
        ok[ok] = xs[before[ok] + 1] - xs[before[ok]] <= hold
        out[empty[ok]] = ys[before[ok]]
    return out
