"""Plot a recording: per-GPU power over time, measurement windows and power-limit changes.

:func:`plot_power` reads a recording with :class:`~zeus_async.store.RecordingReader` and writes
one image (PNG, SVG, PDF, ... chosen by the file suffix):

* the power of every GPU over time, one line each (``GpuSample.power_w``; a GPU that never
  reported instant power is drawn from ``avg_power_w`` instead and labelled ``(avg)``);
* every measurement window, shaded over the power axes in one colour per window name (where
  windows overlap, the innermost -- shortest -- one is shaded), and drawn as bars in a strip
  below, one block of lanes per name, so nested and overlapping windows stay apart. Windows come
  from ``WindowOpen``/``WindowClose`` edges and ``Measurement`` events (whose exact start/end
  win when both are present); cancelled windows are left out and a window still open at the end
  of the recording runs to its end, hatched. Names that differ only by a trailing number
  (``step-0``, ``step-1``, ...) share a colour and one legend entry;
* power-limit changes (``PowerLimitChange``) as a dashed step line per GPU, on the power axis
  (the limit is in W too, so it reads directly against the power it caps).

The title defaults to the recording's host and start time; a file that needed recovery (torn
tail, corrupt frames; see :class:`~zeus_async.store.RecoveryReport`) says so in the subtitle.

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
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..events import GpuSample, Measurement, PowerLimitChange, WindowClose, WindowOpen
from .outputs import claim_output
from .progress import Progress, ProgressTicker
from .reader import RecordingReader, RecoveryReport

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_power"]

logger = logging.getLogger(__name__)

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
#: Time buckets a long power series is reduced to (min and max of each) before drawing.
_BUCKETS = 2000
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


def _decimate(xs: list[float], ys: list[float], buckets: int) -> tuple[list[float], list[float]]:
    """At most ~``2 * buckets`` points: the min and max of each time bucket, in time order.

    Keeps the envelope (peaks and dips) a line of that many pixels can show, and NaN breaks.
    """
    if len(xs) <= 4 * buckets:
        return xs, ys
    x0 = xs[0]
    width = (xs[-1] - x0) / buckets or 1.0
    out_x: list[float] = []
    out_y: list[float] = []
    cur = -1
    lo = hi = -1  # indices of the current bucket's min and max

    def flush() -> None:
        if lo < 0:
            return
        for i in sorted({lo, hi}):
            out_x.append(xs[i])
            out_y.append(ys[i])

    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if math.isnan(y):
            flush()
            out_x.append(x)
            out_y.append(y)
            cur, lo, hi = -1, -1, -1
            continue
        b = int((x - x0) / width)
        if b != cur:
            flush()
            cur, lo, hi = b, i, i
        elif y < ys[lo]:
            lo = i
        elif y > ys[hi]:
            hi = i
    flush()
    return out_x, out_y


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


def _with_gaps(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """Insert NaN breaks where samples are missing (a gap over 10x the median period), so the
    line does not draw a made-up ramp across time with no readings."""
    if len(xs) < 3:
        return xs, ys
    periods = sorted(b - a for a, b in itertools.pairwise(xs))
    limit = max(10.0 * periods[len(periods) // 2], 1e-3)
    out_x: list[float] = [xs[0]]
    out_y: list[float] = [ys[0]]
    for i in range(1, len(xs)):
        if xs[i] - xs[i - 1] > limit:
            out_x.append(math.nan)
            out_y.append(math.nan)
        out_x.append(xs[i])
        out_y.append(ys[i])
    return out_x, out_y


def _default_title(reader: RecordingReader) -> str:
    header = reader.header
    parts = ["GPU power"]
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


def plot_power(
    recording: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    title: str | None = None,
    gpus: Collection[int] | None = None,
    dpi: int = 120,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Draw per-GPU power over time, with measurement windows and power limits, to an image.

    Args:
        recording: The recording file (written by ``Recorder``, ``monitor --record``, ...).
        out: The image to write; the format follows the suffix (``.png``, ``.svg``, ``.pdf``;
            none: ``.png`` is added). An existing file is refused unless ``overwrite``; the
            recording itself (or a part of it) always is.
        title: Figure title; default: host and start time of the recording.
        gpus: Plot only these GPU indices; ``None`` = every GPU in the recording.
        dpi: Resolution of raster output.
        progress: ``progress(done_bytes, total_bytes)`` over the recording's read
            (:mod:`~zeus_async.store.progress`).

    Returns:
        The path of the image written.

    Raises:
        ConfigError: matplotlib is not installed; the recording holds no GPU power samples (for
            the selected GPUs); a GPU in ``gpus`` is not in the recording; ``dpi < 1``.
        CodecError: The recording's header is unreadable (see ``RecordingReader``).
        OSError: The recording cannot be read or the image cannot be written.
    """
    try:
        import matplotlib  # noqa: F401  (raises first when matplotlib is absent)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(_MISSING_MPL) from exc
    if dpi < 1:
        raise ConfigError(f"dpi must be at least 1, got {dpi!r}")
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

    reader = RecordingReader(recording)
    data = _read(reader, progress)
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

    def sec(t_ns: int) -> float:
        return (t_ns - t0) / 1e9

    # Windows -> spans in seconds, grouped into families.
    spans: list[_Span] = []
    kept = [w for w in data.windows.values() if not w.cancelled]
    families = _families(sorted({w.name for w in kept}))
    for w in kept:
        end = w.end_ns if w.end_ns is not None else t_end
        spans.append(
            _Span(
                w.name,
                families[w.name],
                sec(w.start_ns),
                sec(max(end, w.start_ns)),
                w.end_ns is None,
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

    # Figure: power axes on top, a window strip below when there are windows.
    fig = Figure(figsize=(11.0, 5.5 + (0.25 * min(lanes, 8) if spans else 0.0)), dpi=dpi)
    FigureCanvasAgg(fig)
    fig.set_layout_engine("constrained")
    strip: Axes | None = None
    if spans:
        ratio = max(0.9, min(0.3 * lanes + 0.4, 3.0))
        ax, strip = fig.subplots(
            2, 1, sharex=True, gridspec_kw={"height_ratios": [4.0, ratio], "hspace": 0.02}
        )
    else:
        ax = fig.subplots()

    # Shading: the innermost window at each instant, in its family's colour. Each family is one
    # collection of full-height spans (what axvspan draws, without one patch per window).
    pieces: dict[str, list[list[tuple[float, float]]]] = {}
    for a, b, fam in _innermost(spans):
        pieces.setdefault(fam, []).append([(a, 0.0), (a, 1.0), (b, 1.0), (b, 0.0)])
    for fam, verts in pieces.items():
        shade = PolyCollection(
            verts,
            transform=ax.get_xaxis_transform(),
            facecolors=colours[fam],
            edgecolors="none",
            alpha=0.22,
            zorder=0,
        )
        ax.add_collection(shade, autolim=False)

    # Power lines.
    gpu_colour: dict[int, str] = {}
    n_samples = 0
    for i, g in enumerate(plotted):
        series = data.gpus[g]
        colour = f"C{i % 10}"
        gpu_colour[g] = colour
        if series.t_ns:
            xs, ys, label = series.t_ns, series.power_w, f"GPU {g}"
        else:
            xs, ys, label = series.avg_t_ns, series.avg_power_w, f"GPU {g} (avg)"
            logger.info("GPU %d has no instant power in %s; plotting avg_power_w", g, reader.path)
        n_samples += len(xs)
        if any(b < a for a, b in itertools.pairwise(xs)):  # frames written out of order
            idx = sorted(range(len(xs)), key=xs.__getitem__)
            xs, ys = [xs[i] for i in idx], [ys[i] for i in idx]
        px, py = _decimate(*_with_gaps([sec(t) for t in xs], ys), buckets=_BUCKETS)
        ax.plot(px, py, color=colour, linewidth=0.9, label=label, zorder=3)

    # Power limits: a dashed step line per GPU, from its previous value where known.
    for g in plotted:
        changes = sorted(data.limits.get(g, []), key=lambda c: c.t_ns)
        if not changes:
            continue
        xs_l: list[float] = []
        ys_l: list[float] = []
        if changes[0].previous_w is not None:
            xs_l.append(0.0)
            ys_l.append(changes[0].previous_w)
        for c in changes:
            xs_l.append(sec(c.t_ns))
            ys_l.append(c.power_limit_w)
        xs_l.append(sec(t_end))
        ys_l.append(ys_l[-1])
        ax.plot(
            xs_l,
            ys_l,
            drawstyle="steps-post",
            linestyle="--",
            linewidth=1.4,
            color=gpu_colour[g],
            label=f"GPU {g} power limit",
            zorder=4,
        )
        ax.plot(
            [sec(c.t_ns) for c in changes],
            [c.power_limit_w for c in changes],
            linestyle="none",
            marker="v",
            markersize=6,
            color=gpu_colour[g],
            markeredgecolor="black",
            markeredgewidth=0.5,
            zorder=5,
        )

    duration = sec(t_end)
    ax.set_xlim(0.0, duration if duration > 0 else 1.0)
    ax.set_ylim(bottom=0.0)
    ax.set_ylabel("power (W)")
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="GPUs")

    if strip is not None:
        _draw_strip(strip, spans, by_family, order, colours, lanes, duration)
        strip.set_xlabel("time since first event (s)")
    else:
        ax.set_xlabel("time since first event (s)")

    fig.suptitle(title if title is not None else _default_title(reader), fontsize="large")
    sub = (
        f"{len(plotted)} GPU{'s' if len(plotted) != 1 else ''} · {duration:.1f} s · "
        f"{n_samples} samples · {len(spans)} window{'s' if len(spans) != 1 else ''}"
    )
    note = _recovery_note(data.report)
    ax.set_title(sub, fontsize="small", color="dimgray", loc="left")
    if note is not None:
        ax.set_title(note, fontsize="small", color="#b2182b", loc="right")
        logger.warning("plotting %s: %s", reader.path, note)

    fig.savefig(path, dpi=dpi)
    logger.info("wrote %s (%d GPU(s), %d window(s))", path, len(plotted), len(spans))
    return path


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
