"""The figure's options: its layouts, the heatmap's statistics, sizes, and their checks.

:data:`Layout` and :data:`HeatmapStat` name what ``layout=`` and ``heatmap_stat=`` accept;
``"auto"`` picks a layout by the number of GPUs (:data:`OVERLAY_MAX`, :data:`MULTIPLES_MAX`).
"""

from __future__ import annotations

import logging
from typing import Final, Literal

from ...errors import ConfigError

logger = logging.getLogger(__name__)


#: How the GPUs are laid out; see the package docstring.
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


#: Default figure width (in) at any dpi: ``width_px`` defaults to ``dpi`` times this.
_WIDTH_IN = 11.0
#: Narrowest figure ``width_px`` accepts.
_MIN_WIDTH_PX = 200


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
