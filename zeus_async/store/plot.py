"""Plot a recording: per-GPU power over time, measurement windows and power-limit changes.

:func:`power_figure` reads a recording with :class:`~zeus_async.store.RecordingReader` and
returns a :class:`matplotlib.figure.Figure` (a notebook shows it as it is);
:func:`plot_power` draws the same figure to one image (PNG, SVG, PDF, ... chosen by the file
suffix). The figure shows:

* the power of every GPU over time (``GpuSample.power_w``; a GPU that never reported instant
  power is drawn from ``avg_power_w`` instead and labelled ``(avg)``), in one of three
  layouts (``layout=``):

  - ``"overlay"``: one line per GPU on one power axes;
  - ``"multiples"``: small multiples, one short power axes per GPU, stacked, sharing the time
    and the power axis, each labelled with its GPU on the left;
  - ``"heatmap"``: one row per GPU, time across, colour = power (the ``max`` or ``mean`` of
    each pixel column, ``heatmap_stat=``); columns with no reading are left grey;
  - ``"auto"`` (the default): overlay up to :data:`OVERLAY_MAX` GPUs, small multiples up to
    :data:`MULTIPLES_MAX`, a heatmap above.

  Lines are reduced to the pixels they are drawn on: a series with more than two samples per
  pixel column of its axes keeps only the lowest and highest sample of each column (in time
  order), so peaks and dips of a single sample survive, and a gap in the readings (over 10x
  the median sampling period) stays a break in the line;
* every measurement window, shaded over the power axes (overlay and small multiples) in one
  colour per window name (where windows overlap, the innermost -- shortest -- one is shaded),
  and drawn as bars in a strip below, one block of lanes per name, so nested and overlapping
  windows stay apart. Windows come from ``WindowOpen``/``WindowClose`` edges and
  ``Measurement`` events (whose exact start/end win when both are present); cancelled windows
  are left out and a window still open at the end of the recording runs to its end, hatched.
  Names that differ only by a trailing number (``step-0``, ``step-1``, ...) share a colour and
  one legend entry;
* power-limit changes (``PowerLimitChange``) as a dashed step line per GPU, on the power axis
  (the limit is in W too, so it reads directly against the power it caps): on the shared axes
  of the overlay, on each GPU's own axes of the small multiples; on the heatmap, a marker on
  the GPU's row at each change.

The time axis is in seconds, minutes or hours since the first event, whichever reads best for
the length of the recording. The title defaults to the recording's host and start time (and says
"SIMULATED GPUs" for a recording of the simulator); a file
that needed recovery (torn tail, corrupt frames; see :class:`~zeus_async.store.RecoveryReport`)
says so in the subtitle.

matplotlib is an optional dependency (``pip install 'zeus_async[plot]'``). It is imported only
when plotting, and only through :class:`matplotlib.figure.Figure` and the Agg canvas, so no GUI
backend is touched and matplotlib's global state (``pyplot``, the backend) is left alone.
"""

from __future__ import annotations

import bisect
import datetime as dt
import heapq
import itertools
import logging
import math
import os
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from ..errors import ConfigError
from ..events import GpuSample, Measurement, PowerLimitChange, WindowClose, WindowOpen
from .outputs import claim_output
from .progress import Progress, ProgressTicker
from .reader import RecordingReader, RecoveryReport

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    import numpy.typing as npt
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage
    from matplotlib.lines import Line2D

    _Floats: TypeAlias = npt.NDArray[np.float64]
    _Ints: TypeAlias = npt.NDArray[np.intp]
    #: A line drawn empty, to be filled once the layout says how many pixels its axes has.
    _Pending: TypeAlias = tuple[Axes, Line2D, _Floats, _Floats]

__all__ = [
    "HEATMAP_STATS",
    "LAYOUTS",
    "MULTIPLES_MAX",
    "OVERLAY_MAX",
    "HeatmapStat",
    "Layout",
    "plot_power",
    "power_figure",
]

logger = logging.getLogger(__name__)

#: How the GPUs are laid out; see the module docstring.
Layout = Literal["auto", "overlay", "multiples", "heatmap"]
#: Every :data:`Layout`, ``"auto"`` first.
LAYOUTS: Final[tuple[Layout, ...]] = ("auto", "overlay", "multiples", "heatmap")
#: What colours a pixel column of the heatmap: its highest or its mean power.
HeatmapStat = Literal["max", "mean"]
#: Every :data:`HeatmapStat`.
HEATMAP_STATS: Final[tuple[HeatmapStat, ...]] = ("max", "mean")
#: ``layout="auto"`` overlays up to this many GPUs on one axes ...
OVERLAY_MAX: Final = 4
#: ... draws up to this many as small multiples, and more as a heatmap.
MULTIPLES_MAX: Final = 16

_MISSING_MPL = "plotting needs matplotlib: pip install 'zeus_async[plot]'"
#: Window names in one family share a colour and a legend entry.
_NUMBERED = re.compile(r"^(.*?\D)[-_.:#/ ]?\d+$")
#: Distinct names with one stem before they are grouped into a family.
_FAMILY_MIN = 3
#: Legend entries for windows before the rest are drawn grey as "other windows".
_MAX_FAMILIES = 10
#: Colours of window families (matplotlib's qualitative "Set2", then "Dark2").
_WINDOW_COLOURS = (
    "#66c2a5",
    "#fc8d62",
    "#8da0cb",
    "#e78ac3",
    "#a6d854",
    "#ffd92f",
    "#e5c494",
    "#1b9e77",
    "#d95f02",
    "#7570b3",
)
_OTHER_COLOUR = "#b3b3b3"
#: Power and limit colours of the small multiples (each GPU has its own axes).
_MULTIPLE_COLOUR = "C0"
_LIMIT_COLOUR = "#b2182b"
#: Background of the heatmap: where a GPU has no reading.
_NO_DATA_COLOUR = "#d9d9d9"
#: Default figure width (in) at any dpi: ``width_px`` defaults to ``dpi`` times this.
_WIDTH_IN = 11.0
#: Narrowest figure ``width_px`` accepts.
_MIN_WIDTH_PX = 200
#: Height (in) of each GPU's axes in the small multiples, and of each heatmap row.
_MULTIPLE_IN = 0.75
_ROW_IN = 0.3
#: Power-limit changes on the heatmap are labelled with their value up to this many.
_MAX_LIMIT_LABELS = 24
#: A gap in a GPU's readings is over this many median sampling periods (and at least
#: :data:`_MIN_GAP_S`): the line breaks there, the heatmap holds no value across it.
_GAP_PERIODS = 10.0
_MIN_GAP_S = 1e-3
#: Windows narrower than this fraction of the time axis get no name written on their bar.
_MIN_LABEL_FRAC = 0.06
#: Approximate width of one character of a bar label, as a fraction of the time axis.
_CHAR_FRAC = 0.0075


@dataclass
class _Series:
    t_ns: list[int] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    avg_t_ns: list[int] = field(default_factory=list)
    avg_power_w: list[float] = field(default_factory=list)


@dataclass
class _Window:
    name: str
    start_ns: int
    end_ns: int | None = None
    cancelled: bool = False
    exact: bool = False  # start/end from a Measurement


@dataclass
class _Span:
    name: str
    family: str
    start_s: float
    end_s: float
    unclosed: bool
    lane: int = 0


@dataclass
class _Data:
    gpus: dict[int, _Series] = field(default_factory=dict)
    windows: dict[tuple[str, int], _Window] = field(default_factory=dict)
    limits: dict[int, list[PowerLimitChange]] = field(default_factory=dict)
    first_ns: int | None = None
    last_ns: int | None = None
    report: RecoveryReport = field(default_factory=RecoveryReport)


def _read(reader: RecordingReader, progress: Progress | None = None) -> _Data:
    data = _Data()
    ticker = ProgressTicker(reader, progress)
    first: int | None = None
    last: int | None = None
    for event in reader:
        t = event.t_ns
        if first is None or t < first:
            first = t
        if last is None or t > last:
            last = t
        if isinstance(event, GpuSample):
            series = data.gpus.setdefault(event.gpu, _Series())
            if event.power_w is not None:
                series.t_ns.append(t)
                series.power_w.append(event.power_w)
            if event.avg_power_w is not None:
                series.avg_t_ns.append(t)
                series.avg_power_w.append(event.avg_power_w)
        elif isinstance(event, WindowOpen):
            key = (event.host, event.window_id)
            win = data.windows.get(key)
            if win is None:
                data.windows[key] = _Window(event.name, t)
            elif not win.exact:
                win.start_ns = t
        elif isinstance(event, WindowClose):
            key = (event.host, event.window_id)
            win = data.windows.setdefault(key, _Window(event.name, t))
            win.cancelled = win.cancelled or event.cancelled
            if not win.exact:
                win.end_ns = t
        elif isinstance(event, Measurement):
            key = (event.host, event.window_id)
            win = data.windows.setdefault(key, _Window(event.name, event.start_ns))
            win.start_ns, win.end_ns, win.exact = event.start_ns, event.end_ns, True
            first = event.start_ns if first is None else min(first, event.start_ns)
        elif isinstance(event, PowerLimitChange):
            data.limits.setdefault(event.gpu, []).append(event)
        ticker.tick()
    ticker.finish()
    data.first_ns, data.last_ns = first, last
    data.report = reader.report
    return data


def _families(names: Sequence[str]) -> dict[str, str]:
    """Map each window name to its family: names that differ by a trailing number share one."""
    stems: dict[str, set[str]] = {}
    for name in names:
        m = _NUMBERED.match(name)
        if m:
            stems.setdefault(m.group(1).rstrip("-_.:#/ "), set()).add(name)
    out = {name: name for name in names}
    for stem, members in stems.items():
        if len(members) >= _FAMILY_MIN and stem not in out:
            for name in members:
                out[name] = f"{stem}-*"
    return out


class _Row:
    """Non-overlapping intervals of one lane of the window strip, sorted by start."""

    __slots__ = ("ends", "starts")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def fits(self, a: float, b: float) -> bool:
        i = bisect.bisect_right(self.starts, a)
        if i > 0 and self.ends[i - 1] > a:
            return False
        return i == len(self.starts) or self.starts[i] >= b

    def add(self, a: float, b: float) -> None:
        i = bisect.bisect_right(self.starts, a)
        self.starts.insert(i, a)
        self.ends.insert(i, b)


def _assign_lanes(by_family: dict[str, list[_Span]]) -> int:
    """Lay windows out in lanes, one block of lanes per family; returns the number of lanes.

    Within a family, windows go greedily to the first of its own sub-lanes free at their start
    (one sub-lane unless windows of one name overlap). Families are placed longest (median
    duration) first, each block at the lowest lanes where none of its windows overlaps a window
    already there: containers end up above what they contain, and every window of a family
    stays in the same row rather than being scattered into gaps.
    """
    rows: list[_Row] = []

    def median_len(spans: list[_Span]) -> float:
        lengths = sorted(s.end_s - s.start_s for s in spans)
        return lengths[len(lengths) // 2]

    families = sorted(
        by_family, key=lambda f: (-median_len(by_family[f]), min(s.start_s for s in by_family[f]))
    )
    for fam in families:
        sub: list[list[_Span]] = []
        sub_ends: list[float] = []
        for span in sorted(by_family[fam], key=lambda s: (s.start_s, s.start_s - s.end_s)):
            for j, end in enumerate(sub_ends):
                if end <= span.start_s:
                    sub[j].append(span)
                    sub_ends[j] = span.end_s
                    break
            else:
                sub.append([span])
                sub_ends.append(span.end_s)
        base = 0
        while not all(
            base + j >= len(rows) or all(rows[base + j].fits(s.start_s, s.end_s) for s in group)
            for j, group in enumerate(sub)
        ):
            base += 1
        for j, group in enumerate(sub):
            while base + j >= len(rows):
                rows.append(_Row())
            for span in group:
                span.lane = base + j
                rows[base + j].add(span.start_s, span.end_s)
    return len(rows)


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


def _time_unit(duration_s: float) -> tuple[float, str]:
    """Seconds per unit of the time axis, and its name: s up to 20 min, min up to 10 h, h."""
    if duration_s <= 1200.0:
        return 1.0, "s"
    if duration_s <= 36000.0:
        return 60.0, "min"
    return 3600.0, "h"


def _innermost(spans: Sequence[_Span]) -> list[tuple[float, float, str]]:
    """Partition the windowed time into ``(start, end, family)`` of the shortest covering window.

    Shading only the innermost window at each instant keeps nested and overlapping windows from
    blending into an unreadable mix of colours (the strip shows every window); adjacent pieces
    of one family are merged. A sweep over the window edges with a heap keyed by duration.
    """
    edges = sorted({s.start_s for s in spans} | {s.end_s for s in spans})
    by_start = sorted(range(len(spans)), key=lambda i: spans[i].start_s)
    active: list[tuple[float, int]] = []
    out: list[tuple[float, float, str]] = []
    nxt = 0
    for a, b in itertools.pairwise(edges):
        while nxt < len(by_start) and spans[by_start[nxt]].start_s <= a:
            i = by_start[nxt]
            heapq.heappush(active, (spans[i].end_s - spans[i].start_s, i))
            nxt += 1
        while active and spans[active[0][1]].end_s <= a:
            heapq.heappop(active)
        if not active:
            continue
        family = spans[active[0][1]].family
        if out and out[-1][2] == family and out[-1][1] == a:
            out[-1] = (out[-1][0], b, family)
        else:
            out.append((a, b, family))
    return out


def _default_title(reader: RecordingReader) -> str:
    header = reader.header
    simulated = header.meta.get("simulated") == "true"
    parts = ["GPU power (SIMULATED GPUs)" if simulated else "GPU power"]
    parts.append(header.host or reader.path.name)
    if header.start_wall_ns:
        start = dt.datetime.fromtimestamp(header.start_wall_ns / 1e9, tz=dt.timezone.utc)
        parts.append(start.strftime("%Y-%m-%d %H:%M:%S UTC"))
    return " — ".join(parts)


def _recovery_note(report: RecoveryReport) -> str | None:
    if report.clean:
        return None
    bits = []
    if report.corrupt_frames:
        n = len(report.corrupt_frames)
        bits.append(f"{n} corrupt frame{'s' if n != 1 else ''} skipped")
    if report.torn_tail_offset is not None:
        bits.append(f"torn tail of {report.torn_tail_bytes} B dropped")
    return "recovered from a damaged file: " + ", ".join(bits)


@dataclass
class _Line:
    """One GPU's power, ready to draw; times in units of the time axis."""

    gpu: int
    label: str
    x: _Floats  # sorted, with a NaN break in each gap
    y: _Floats
    readings_x: _Floats  # the readings alone, without NaN (the heatmap's)
    readings_y: _Floats
    hold: float  # the longest step between readings that is not a gap
    limit_x: list[float] = field(default_factory=list)  # power-limit steps
    limit_y: list[float] = field(default_factory=list)
    changes: list[tuple[float, float]] = field(default_factory=list)  # (time, new limit W)


@dataclass
class _Plot:
    """What a figure draws, whatever its layout; times in units of the time axis."""

    lines: list[_Line]
    spans: list[_Span]
    by_family: dict[str, list[_Span]]
    order: list[str]  # families, by first start
    colours: dict[str, str]
    lanes: int
    duration: float
    unit: str
    top_w: float  # the highest power or limit drawn
    samples: int
    title: str
    note: str | None
    path: Path


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401  (raises first when matplotlib is absent)
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:
        raise ConfigError(_MISSING_MPL) from exc


def _check_args(layout: str, heatmap_stat: str, width_px: int | None, dpi: int) -> None:
    if dpi < 1:
        raise ConfigError(f"dpi must be at least 1, got {dpi!r}")
    if width_px is not None and width_px < _MIN_WIDTH_PX:
        raise ConfigError(f"width_px must be at least {_MIN_WIDTH_PX}, got {width_px!r}")
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r} (use one of {', '.join(LAYOUTS)})")
    if heatmap_stat not in HEATMAP_STATS:
        raise ConfigError(
            f"unknown heatmap_stat {heatmap_stat!r} (use one of {', '.join(HEATMAP_STATS)})"
        )


def _resolve_layout(layout: Layout, gpus: int) -> Layout:
    """``"auto"``: overlay up to :data:`OVERLAY_MAX` GPUs, small multiples up to
    :data:`MULTIPLES_MAX`, a heatmap above; any other layout is itself."""
    if layout != "auto":
        return layout
    if gpus <= OVERLAY_MAX:
        return "overlay"
    return "multiples" if gpus <= MULTIPLES_MAX else "heatmap"


def _prepare(
    reader: RecordingReader, data: _Data, gpus: Collection[int] | None, title: str | None
) -> _Plot:
    """Select the GPUs, turn readings into arrays on the time axis, windows into spans."""
    import numpy as np

    available = sorted(data.gpus)
    if gpus is not None:
        missing = sorted(set(gpus) - set(available))
        if missing:
            raise ConfigError(
                f"GPU(s) {missing} not in recording {reader.path}; it has GPUs {available}"
            )
        selected = sorted(set(gpus))
    else:
        selected = available
    plotted = [g for g in selected if data.gpus[g].t_ns or data.gpus[g].avg_t_ns]
    if not plotted or data.first_ns is None or data.last_ns is None:
        raise ConfigError(
            f"recording {reader.path} has no GPU power samples"
            + (f" for GPU(s) {selected}" if gpus is not None and available else "")
            + "; nothing to plot"
        )
    t0, t_end = data.first_ns, data.last_ns
    unit_s, unit = _time_unit((t_end - t0) / 1e9)

    def at(t_ns: int) -> float:
        return (t_ns - t0) / 1e9 / unit_s

    lines: list[_Line] = []
    samples = 0
    top = 0.0
    for g in plotted:
        series = data.gpus[g]
        if series.t_ns:
            t_ns, watts, label = series.t_ns, series.power_w, f"GPU {g}"
        else:
            t_ns, watts, label = series.avg_t_ns, series.avg_power_w, f"GPU {g} (avg)"
            logger.info("GPU %d has no instant power in %s; plotting avg_power_w", g, reader.path)
        samples += len(t_ns)
        t = np.asarray(t_ns, dtype=np.int64)
        w = np.asarray(watts, dtype=np.float64)
        if len(t) > 1 and bool(np.any(t[1:] < t[:-1])):  # frames written out of order
            by_time = np.argsort(t, kind="stable")
            t, w = t[by_time], w[by_time]
        secs = (t - t0) / 1e9
        valid = ~np.isnan(w)
        if valid.any():
            top = max(top, float(np.max(w[valid])))
        limit_s = _gap_limit(secs[valid])
        xs, ys = _with_gaps(secs, w, limit_s)
        line = _Line(g, label, xs / unit_s, ys, secs[valid] / unit_s, w[valid], limit_s / unit_s)
        changes = sorted(data.limits.get(g, []), key=lambda c: c.t_ns)
        if changes:
            if changes[0].previous_w is not None:
                line.limit_x.append(0.0)
                line.limit_y.append(changes[0].previous_w)
            for c in changes:
                line.limit_x.append(at(c.t_ns))
                line.limit_y.append(c.power_limit_w)
                line.changes.append((at(c.t_ns), c.power_limit_w))
            line.limit_x.append(at(t_end))
            line.limit_y.append(line.limit_y[-1])
            top = max(top, *line.limit_y)
        lines.append(line)

    # Windows -> spans on the time axis, grouped into families.
    spans: list[_Span] = []
    kept = [w for w in data.windows.values() if not w.cancelled]
    families = _families(sorted({w.name for w in kept}))
    for win in kept:
        end = win.end_ns if win.end_ns is not None else t_end
        spans.append(
            _Span(
                win.name,
                families[win.name],
                at(win.start_ns),
                at(max(end, win.start_ns)),
                win.end_ns is None,
            )
        )
    by_family: dict[str, list[_Span]] = {}
    for span in spans:
        by_family.setdefault(span.family, []).append(span)
    lanes = _assign_lanes(by_family)
    order = sorted(by_family, key=lambda f: min(s.start_s for s in by_family[f]))
    colours: dict[str, str] = {}
    for i, fam in enumerate(order):
        colours[fam] = _WINDOW_COLOURS[i] if i < _MAX_FAMILIES else _OTHER_COLOUR
    return _Plot(
        lines=lines,
        spans=spans,
        by_family=by_family,
        order=order,
        colours=colours,
        lanes=lanes,
        duration=at(t_end),
        unit=unit,
        top_w=top if math.isfinite(top) and top > 0 else 1.0,
        samples=samples,
        title=title if title is not None else _default_title(reader),
        note=_recovery_note(data.report),
        path=reader.path,
    )


def power_figure(
    recording: str | os.PathLike[str],
    *,
    title: str | None = None,
    gpus: Collection[int] | None = None,
    layout: Layout = "auto",
    heatmap_stat: HeatmapStat = "max",
    width_px: int | None = None,
    dpi: int = 120,
    progress: Progress | None = None,
) -> Figure:
    """Draw per-GPU power over time, with measurement windows and power limits, as a Figure.

    The figure is a bare :class:`matplotlib.figure.Figure` on the Agg canvas (no ``pyplot``):
    a notebook shows it as the value of a cell; ``fig.savefig(...)`` writes it. Its lines hold
    at most about two points per pixel column of ``width_px`` (see the module docstring), so
    it stays light however long the recording is; it is not redrawn finer when resized.

    Args:
        recording: The recording file (written by ``Recorder``, ``monitor --record``, ...).
        title: Figure title; default: host and start time of the recording.
        gpus: Plot only these GPU indices; ``None`` = every GPU in the recording.
        layout: ``"overlay"``, ``"multiples"`` (one small axes per GPU), ``"heatmap"`` (one row
            per GPU, colour = power) or ``"auto"``: overlay up to :data:`OVERLAY_MAX` GPUs,
            small multiples up to :data:`MULTIPLES_MAX`, a heatmap above.
        heatmap_stat: What colours a pixel column of the heatmap: the ``"max"`` power of the
            readings in it (a one-reading spike shows) or their ``"mean"``.
        width_px: Width of the figure in pixels; default: 11 in at ``dpi``. The height
            follows the layout and the number of GPUs.
        dpi: Pixels per inch of the figure.
        progress: ``progress(done_bytes, total_bytes)`` over the recording's read
            (:mod:`~zeus_async.store.progress`).

    Returns:
        The figure.

    Raises:
        ConfigError: matplotlib is not installed; the recording holds no GPU power samples (for
            the selected GPUs); a GPU in ``gpus`` is not in the recording; an unknown
            ``layout`` or ``heatmap_stat``; ``dpi < 1``; ``width_px < 200``.
        CodecError: The recording's header is unreadable (see ``RecordingReader``).
        OSError: The recording cannot be read.
    """
    _need_matplotlib()
    _check_args(layout, heatmap_stat, width_px, dpi)
    return _figure(recording, title, gpus, layout, heatmap_stat, width_px, dpi, progress)[0]


def plot_power(
    recording: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    title: str | None = None,
    gpus: Collection[int] | None = None,
    layout: Layout = "auto",
    heatmap_stat: HeatmapStat = "max",
    width_px: int | None = None,
    dpi: int = 120,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Draw per-GPU power over time, with measurement windows and power limits, to an image.

    The image is :func:`power_figure`'s figure, saved.

    Args:
        recording: The recording file (written by ``Recorder``, ``monitor --record``, ...).
        out: The image to write; the format follows the suffix (``.png``, ``.svg``, ``.pdf``;
            none: ``.png`` is added). An existing file is refused unless ``overwrite``; the
            recording itself (or a part of it) always is.
        title: Figure title; default: host and start time of the recording.
        gpus: Plot only these GPU indices; ``None`` = every GPU in the recording.
        layout: ``"auto"``, ``"overlay"``, ``"multiples"`` or ``"heatmap"`` (see
            :func:`power_figure`).
        heatmap_stat: ``"max"`` or ``"mean"`` power per pixel column of the heatmap.
        width_px: Width of the image in pixels; default: 11 in at ``dpi``.
        dpi: Resolution of raster output.
        progress: ``progress(done_bytes, total_bytes)`` over the recording's read
            (:mod:`~zeus_async.store.progress`).

    Returns:
        The path of the image written.

    Raises:
        ConfigError: matplotlib is not installed; the recording holds no GPU power samples (for
            the selected GPUs); a GPU in ``gpus`` is not in the recording; an unknown
            ``layout``, ``heatmap_stat`` or image format; ``dpi < 1``; ``width_px < 200``.
        CodecError: The recording's header is unreadable (see ``RecordingReader``).
        OSError: The recording cannot be read or the image cannot be written.
    """
    _need_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    _check_args(layout, heatmap_stat, width_px, dpi)
    path = Path(out)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    claim_output(
        path,
        inputs=[recording],
        overwrite=overwrite,
        what="image",
        force_hint="--force or overwrite=True",
    )
    formats = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise ConfigError(
            f"cannot draw {path}: unknown image format {path.suffix!r} "
            f"(use one of {', '.join('.' + f for f in sorted(formats))})"
        )
    fig, plot, chosen = _figure(
        recording, title, gpus, layout, heatmap_stat, width_px, dpi, progress
    )
    fig.savefig(path, dpi=dpi)
    logger.info(
        "wrote %s (%d GPU(s) as %s, %d window(s))", path, len(plot.lines), chosen, len(plot.spans)
    )
    return path


def _figure(
    recording: str | os.PathLike[str],
    title: str | None,
    gpus: Collection[int] | None,
    layout: Layout,
    heatmap_stat: HeatmapStat,
    width_px: int | None,
    dpi: int,
    progress: Progress | None,
) -> tuple[Figure, _Plot, Layout]:
    """The figure of :func:`power_figure` (arguments checked), what it draws and its layout."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    reader = RecordingReader(recording)
    plot = _prepare(reader, _read(reader, progress), gpus, title)
    chosen = _resolve_layout(layout, len(plot.lines))
    width_in = (width_px if width_px is not None else _WIDTH_IN * dpi) / dpi
    fig = Figure(figsize=(width_in, _height(plot, chosen)), dpi=dpi)
    FigureCanvasAgg(fig)
    if chosen == "multiples":
        fig.set_layout_engine("constrained", h_pad=0.02, hspace=0.0)
    else:
        fig.set_layout_engine("constrained")
    pending: list[_Pending] = []
    image: AxesImage | None = None
    if chosen == "overlay":
        top, bottom = _draw_overlay(fig, plot, pending)
    elif chosen == "multiples":
        top, bottom = _draw_multiples(fig, plot, pending)
    else:
        top, bottom, image = _draw_heatmap(fig, plot, heatmap_stat)
    bottom.set_xlabel(f"time since first event ({plot.unit})")

    fig.suptitle(plot.title, fontsize="large")
    shown = f"{plot.duration:.1f} {plot.unit}"
    n, w = len(plot.lines), len(plot.spans)
    sub = (
        f"{n} GPU{'s' if n != 1 else ''} · {shown} · {plot.samples} samples · "
        f"{w} window{'s' if w != 1 else ''}"
    )
    top.set_title(sub, fontsize="small", color="dimgray", loc="left")
    if plot.note is not None:
        top.set_title(plot.note, fontsize="small", color=_LIMIT_COLOUR, loc="right")
        logger.warning("plotting %s: %s", plot.path, plot.note)

    # The lines and the heatmap are filled in once the layout has placed the axes: one bucket
    # per pixel column of the axes they are drawn on. Nothing that moves the layout depends on
    # them (the limits of every axis are set already).
    engine = fig.get_layout_engine()
    if engine is not None:
        engine.execute(fig)
    for ax, artist, xs, ys in pending:
        lo, hi = ax.get_xlim()
        px, py = _decimate(xs, ys, max(1, math.ceil(ax.bbox.width)), lo, hi)
        artist.set_data(px, py)
    if image is not None and image.axes is not None:
        lo, hi = image.axes.get_xlim()
        columns = max(1, round(image.axes.bbox.width))
        image.set_data(
            np.vstack(
                [
                    _column_stat(
                        line.readings_x, line.readings_y, columns, lo, hi, heatmap_stat, line.hold
                    )
                    for line in plot.lines
                ]
            )
        )
    return fig, plot, chosen


def _strip_in(plot: _Plot) -> float:
    """Height (in) of the window strip of the small multiples and the heatmap; 0: none."""
    return 0.2 * min(plot.lanes, 8) + 0.3 if plot.spans else 0.0


def _height(plot: _Plot, layout: Layout) -> float:
    """Height (in) of the figure for ``plot`` in ``layout`` (not ``"auto"``)."""
    n = len(plot.lines)
    if layout == "overlay":
        return 5.5 + (0.25 * min(plot.lanes, 8) if plot.spans else 0.0)
    if layout == "multiples":
        return 1.4 + _MULTIPLE_IN * n + _strip_in(plot)
    return 1.6 + max(2.0, _ROW_IN * n) + _strip_in(plot)


def _time_axes(fig: Figure, plot: _Plot, rows: Sequence[float]) -> tuple[list[Axes], Axes | None]:
    """Axes stacked in one column sharing the time axis, ``rows`` high (in, relative); the
    window strip is added below them when there are windows, and drawn. Returns the axes
    above the strip, and the strip."""
    ratios = [*rows, _strip_in(plot)] if plot.spans else list(rows)
    grid = fig.subplots(len(ratios), 1, sharex=True, squeeze=False, height_ratios=ratios)
    axes: list[Axes] = list(grid[:, 0])
    axes[0].set_xlim(0.0, plot.duration if plot.duration > 0 else 1.0)
    if not plot.spans:
        return axes, None
    strip = axes.pop()
    _draw_strip(
        strip, plot.spans, plot.by_family, plot.order, plot.colours, plot.lanes, plot.duration
    )
    return axes, strip


def _shade(ax: Axes, plot: _Plot) -> None:
    """Shade the innermost window at each instant over ``ax``, in its family's colour. Each
    family is one collection of full-height spans (what axvspan draws, without one patch per
    window)."""
    from matplotlib.collections import PolyCollection

    pieces: dict[str, list[list[tuple[float, float]]]] = {}
    for a, b, fam in _innermost(plot.spans):
        pieces.setdefault(fam, []).append([(a, 0.0), (a, 1.0), (b, 1.0), (b, 0.0)])
    for fam, verts in pieces.items():
        shade = PolyCollection(
            verts,
            transform=ax.get_xaxis_transform(),
            facecolors=plot.colours[fam],
            edgecolors="none",
            alpha=0.22,
            zorder=0,
        )
        ax.add_collection(shade, autolim=False)


def _draw_limits(ax: Axes, line: _Line, colour: str, label: str, markersize: float) -> None:
    """A GPU's power limit as a dashed step line, from its previous value where known, with a
    marker at each change."""
    if not line.changes:
        return
    ax.plot(
        line.limit_x,
        line.limit_y,
        drawstyle="steps-post",
        linestyle="--",
        linewidth=1.4,
        color=colour,
        label=label,
        zorder=4,
    )
    ax.plot(
        [c[0] for c in line.changes],
        [c[1] for c in line.changes],
        linestyle="none",
        marker="v",
        markersize=markersize,
        color=colour,
        markeredgecolor="black",
        markeredgewidth=0.5,
        zorder=5,
    )


def _draw_overlay(fig: Figure, plot: _Plot, pending: list[_Pending]) -> tuple[Axes, Axes]:
    """Every GPU's power on one axes, the window strip below; returns the top and bottom axes."""
    ratio = max(0.9, min(0.3 * plot.lanes + 0.4, 3.0))
    if plot.spans:
        grid = fig.subplots(2, 1, sharex=True, height_ratios=[4.0, ratio])
        ax, strip = grid[0], grid[1]
        _draw_strip(
            strip, plot.spans, plot.by_family, plot.order, plot.colours, plot.lanes, plot.duration
        )
    else:
        ax, strip = fig.subplots(), None
    ax.set_xlim(0.0, plot.duration if plot.duration > 0 else 1.0)
    _shade(ax, plot)
    for i, line in enumerate(plot.lines):
        (artist,) = ax.plot([], [], color=f"C{i % 10}", linewidth=0.9, label=line.label, zorder=3)
        pending.append((ax, artist, line.x, line.y))
    for i, line in enumerate(plot.lines):
        _draw_limits(ax, line, f"C{i % 10}", f"GPU {line.gpu} power limit", 6.0)
    ax.set_ylim(0.0, plot.top_w * 1.05)
    ax.set_ylabel("power (W)")
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="GPUs")
    return ax, strip if strip is not None else ax


def _draw_multiples(fig: Figure, plot: _Plot, pending: list[_Pending]) -> tuple[Axes, Axes]:
    """One short power axes per GPU, stacked, sharing time and power; the window strip below.
    Returns the top and bottom axes."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    axes, strip = _time_axes(fig, plot, [_MULTIPLE_IN] * len(plot.lines))
    for ax in axes[1:]:
        ax.sharey(axes[0])
    for ax, line in zip(axes, plot.lines, strict=True):
        _shade(ax, plot)
        (artist,) = ax.plot([], [], color=_MULTIPLE_COLOUR, linewidth=0.8, zorder=3)
        pending.append((ax, artist, line.x, line.y))
        _draw_limits(ax, line, _LIMIT_COLOUR, "power limit", 4.0)
        ax.set_ylabel(line.label, rotation=0, ha="right", va="center", fontsize="small")
        ax.tick_params(axis="y", labelsize="x-small")
        ax.grid(True, alpha=0.3, linewidth=0.6)
    # Shared: set once. The 0 W tick is left unlabelled, so that neighbours' labels never meet.
    axes[0].set_ylim(0.0, plot.top_w * 1.08)
    axes[0].yaxis.set_major_locator(MaxNLocator(nbins=3, prune="lower"))
    fig.supylabel("power (W)", fontsize="small")
    handles = [Line2D([], [], color=_MULTIPLE_COLOUR, linewidth=0.8, label="power")]
    if any(line.changes for line in plot.lines):
        handles.append(
            Line2D(
                [],
                [],
                color=_LIMIT_COLOUR,
                linestyle="--",
                marker="v",
                markeredgecolor="black",
                markeredgewidth=0.5,
                label="power limit",
            )
        )
    axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return axes[0], strip if strip is not None else axes[-1]


def _draw_heatmap(fig: Figure, plot: _Plot, stat: HeatmapStat) -> tuple[Axes, Axes, AxesImage]:
    """One row per GPU, colour = power per pixel column (the image is filled in later), a
    marker at each power-limit change; the window strip below. Returns the top and bottom
    axes and the image."""
    import numpy as np
    from matplotlib.colors import Normalize

    n = len(plot.lines)
    axes, strip = _time_axes(fig, plot, [max(2.0, _ROW_IN * n)])
    ax = axes[0]
    x_end = plot.duration if plot.duration > 0 else 1.0
    image = ax.imshow(
        np.full((n, 1), np.nan),
        cmap="viridis",
        norm=Normalize(0.0, plot.top_w),
        aspect="auto",
        interpolation="nearest",
        extent=(0.0, x_end, n - 0.5, -0.5),
    )
    ax.set_facecolor(_NO_DATA_COLOUR)
    ax.set_yticks(range(n), [line.label for line in plot.lines], fontsize="small")
    ax.tick_params(axis="y", length=0)
    # The colour bar hangs on the axes (an inset), next to it whatever the strip's legend needs.
    bar = ax.inset_axes((1.012, 0.0, 0.012, 1.0))
    fig.colorbar(image, cax=bar, label=f"power (W), {stat}\nper pixel column")
    bar.tick_params(labelsize="x-small")
    marks = [(t, row, w) for row, line in enumerate(plot.lines) for t, w in line.changes]
    if marks:
        ax.plot(
            [t for t, _, _ in marks],
            [row - 0.2 for _, row, _ in marks],
            linestyle="none",
            marker="v",
            markersize=6,
            color="white",
            markeredgecolor="black",
            markeredgewidth=0.6,
            label="power-limit change",
            zorder=5,
        )
        if len(marks) <= _MAX_LIMIT_LABELS:
            for t, row, w in marks:
                ax.text(
                    t,
                    row - 0.2,
                    f" {w:.0f} W",
                    fontsize="xx-small",
                    va="center",
                    bbox={"facecolor": "white", "alpha": 0.6, "edgecolor": "none", "pad": 0.5},
                    clip_on=True,
                    zorder=5,
                )
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="x-small", frameon=False)
    ax.set_xlim(0.0, x_end)
    ax.set_ylim(n - 0.5, -0.5)
    return ax, strip if strip is not None else ax, image


def _draw_strip(
    strip: Axes,
    spans: Sequence[_Span],
    by_family: dict[str, list[_Span]],
    order: Sequence[str],
    colours: dict[str, str],
    lanes: int,
    duration: float,
) -> None:
    """Windows as bars, one lane per nesting level, with names on bars wide enough to hold one."""
    from matplotlib.patches import Patch

    scale = duration if duration > 0 else 1.0
    width_min = _MIN_LABEL_FRAC * scale
    # White separators between adjacent bars only while bars are wider than a few pixels.
    thin_edges = len(spans) <= 300
    handles = []

    for i, fam in enumerate(order):
        members = by_family[fam]
        colour = colours[fam]
        for unclosed in (False, True):
            group = [s for s in members if s.unclosed == unclosed]
            for lane in sorted({s.lane for s in group}):
                bars = [(s.start_s, s.end_s - s.start_s) for s in group if s.lane == lane]
                strip.broken_barh(
                    bars,
                    (lanes - 1 - lane + 0.1, 0.8),
                    facecolors=colour,
                    edgecolors="white" if len(bars) > 1 and thin_edges else colour,
                    linewidth=0.4,
                    alpha=0.9,
                    hatch="//" if unclosed else None,
                )
        if i < _MAX_FAMILIES:
            notes = [f"{len(members)} windows"] if len(members) > 1 else []
            n_open = sum(s.unclosed for s in members)
            if n_open:
                notes.append("unclosed" if len(members) == 1 else f"{n_open} unclosed")
            label = f"{fam} ({', '.join(notes)})" if notes else fam
            hatch = "//" if n_open else None
            handles.append(Patch(facecolor=colour, alpha=0.9, hatch=hatch, label=label))
    if len(order) > _MAX_FAMILIES:
        rest = sum(len(by_family[f]) for f in order[_MAX_FAMILIES:])
        handles.append(Patch(facecolor=_OTHER_COLOUR, label=f"other windows ({rest})"))
    for span in spans:
        if span.end_s - span.start_s >= max(width_min, len(span.name) * _CHAR_FRAC * scale):
            strip.text(
                (span.start_s + span.end_s) / 2,
                lanes - 1 - span.lane + 0.5,
                span.name,
                ha="center",
                va="center",
                fontsize="x-small",
                clip_on=True,
            )
    strip.set_ylim(0.0, float(lanes))
    strip.set_yticks([])
    strip.set_ylabel("windows", fontsize="small")
    strip.grid(True, axis="x", alpha=0.3, linewidth=0.6)
    strip.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
        title="windows",
    )
