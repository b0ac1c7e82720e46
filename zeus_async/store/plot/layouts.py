"""The layouts drawn on a figure: overlay, small multiples, heatmap, and the window strip.

Each ``_draw_*`` lays out its axes and draws everything but the power lines and the heatmap's
image, which are left empty (``pending``) to be filled once the layout engine has placed the
axes and their width in pixels is known.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .data import _Line, _Plot
from .options import HeatmapStat, Layout
from .windows import _MAX_FAMILIES, _OTHER_COLOUR, _innermost, _Span

if TYPE_CHECKING:
    from typing import TypeAlias

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage
    from matplotlib.lines import Line2D

    from .reduce import _Floats

    #: A line drawn empty, to be filled once the layout says how many pixels its axes has.
    _Pending: TypeAlias = tuple[Axes, Line2D, _Floats, _Floats]

logger = logging.getLogger(__name__)


#: Power and limit colours of the small multiples (each GPU has its own axes).
_MULTIPLE_COLOUR = "C0"
_LIMIT_COLOUR = "#b2182b"
#: Background of the heatmap: where a GPU has no reading.
_NO_DATA_COLOUR = "#d9d9d9"


#: Height (in) of each GPU's axes in the small multiples, and of each heatmap row.
_MULTIPLE_IN = 0.75
_ROW_IN = 0.3
#: Power-limit changes on the heatmap are labelled with their value up to this many.
_MAX_LIMIT_LABELS = 24


#: Windows narrower than this fraction of the time axis get no name written on their bar.
_MIN_LABEL_FRAC = 0.06
#: Approximate width of one character of a bar label, as a fraction of the time axis.
_CHAR_FRAC = 0.0075


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
