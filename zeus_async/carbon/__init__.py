"""Carbon intensity and electricity price sources, and their integration against energy.

Every figure zeus_async measures is in joules; this package turns them into kWh, grams
CO2-equivalent and money, stating the intensity, its source, the PUE and the overhead used::

    from zeus_async.carbon import CarbonConfig, footprint

    source = CarbonConfig(source="table", zone="FR", pue=1.2).open()
    fp = footprint(energy_between, t0_ns, t1_ns, source, pue=1.2)
    fp.co2e_g, fp.source   # 12.3, "table:FR:2023 (Ember / Our World in Data)"

It depends only on the package's lowest layers (errors, clock), so anything may use it.
See ``docs/carbon.md``.
"""

from __future__ import annotations

from ._types import (
    J_PER_KWH,
    Footprint,
    Intensity,
    IntensitySource,
    IntensityUnavailableError,
    SourcedSteps,
)
from .config import SOURCES, CarbonConfig
from .electricitymaps import TOKEN_ENV_VAR, ElectricityMapsIntensity, default_cache_dir
from .integrate import footprint, footprint_of, step_cuts
from .sources import (
    WORLD,
    ConstantIntensity,
    FileIntensity,
    PricedIntensity,
    TableIntensity,
    TableZone,
    table_about,
    zones,
)

__all__ = [
    "J_PER_KWH",
    "SOURCES",
    "TOKEN_ENV_VAR",
    "WORLD",
    "CarbonConfig",
    "ConstantIntensity",
    "ElectricityMapsIntensity",
    "FileIntensity",
    "Footprint",
    "Intensity",
    "IntensitySource",
    "IntensityUnavailableError",
    "PricedIntensity",
    "SourcedSteps",
    "TableIntensity",
    "TableZone",
    "default_cache_dir",
    "footprint",
    "footprint_of",
    "step_cuts",
    "table_about",
    "zones",
]
