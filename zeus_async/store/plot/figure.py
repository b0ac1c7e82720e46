"""The power figure of a recording: :func:`power_figure` and :func:`plot_power`.

Reads the recording (:mod:`.data`), draws the chosen layout (:mod:`.layouts`), then fills the
lines and the heatmap at the resolution the laid-out axes have (:mod:`.reduce`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import ConfigError
from ..outputs import claim_output
from ..progress import Progress
from ..reader import RecordingReader
from .data import _Plot, _prepare, _read
from .layouts import _LIMIT_COLOUR, _draw_heatmap, _draw_multiples, _draw_overlay, _height
from .options import _WIDTH_IN, HeatmapStat, Layout, _check_args, _resolve_layout
from .reduce import _column_stat, _decimate

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage

    from .layouts import _Pending

logger = logging.getLogger(__name__)


_MISSING_MPL = "plotting needs matplotlib: pip install 'zeus_async[plot]'"


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401  (raises first when matplotlib is absent)
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:
        raise ConfigError(_MISSING_MPL) from exc


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
    at most about two points per pixel column of ``width_px`` (see the package docstring), so
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
