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

The parts, each importing only those listed before it:

* :mod:`.options`: the layouts and heatmap statistics, and the checks of the arguments;
* :mod:`.reduce`: series reduced to the pixel columns they are drawn on, gaps in readings;
* :mod:`.windows`: window families, lanes of the window strip, innermost shading;
* :mod:`.data`: from a recording to the lines and window spans a figure draws;
* :mod:`.layouts`: the overlay, small multiples and heatmap, and the window strip;
* :mod:`.figure`: :func:`power_figure` and :func:`plot_power`.
"""

from __future__ import annotations

import logging

from .data import _default_title as _default_title
from .figure import plot_power, power_figure
from .options import HEATMAP_STATS, LAYOUTS, MULTIPLES_MAX, OVERLAY_MAX, HeatmapStat, Layout
from .options import _resolve_layout as _resolve_layout
from .reduce import _column_stat as _column_stat
from .reduce import _decimate as _decimate
from .windows import _assign_lanes as _assign_lanes
from .windows import _families as _families
from .windows import _innermost as _innermost
from .windows import _Span as _Span

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
