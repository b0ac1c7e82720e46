"""What users configure about carbon and cost: the source, zone, price, PUE and overhead."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from ..errors import ConfigError
from ._types import Footprint, IntensitySource
from .electricitymaps import ElectricityMapsIntensity
from .integrate import check_factors, footprint, footprint_of
from .sources import ConstantIntensity, FileIntensity, PricedIntensity, TableIntensity

logger = logging.getLogger(__name__)

__all__ = ["SOURCES", "CarbonConfig"]

SOURCES = ("table", "constant", "electricitymaps", "file")


class CarbonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Carbon and cost settings (JSON/TOML friendly: ``msgspec.convert(mapping, CarbonConfig)``).

    Attributes:
        source: ``"table"`` (the shipped yearly table, offline; the default), ``"constant"``
            (``g_per_kwh``), ``"electricitymaps"`` (the API, token in ``ELECTRICITYMAPS_TOKEN``,
            falling back to the table) or ``"file"`` (a CSV time series, ``file``).
        zone: ISO 3166-1 country code or region (``"FR"``, ``"US-CA"``); ``""`` with the
            table: the world average. Never guessed over the network.
        g_per_kwh: Intensity for ``source="constant"``.
        price_per_kwh: Price of one kWh; with the table or Electricity Maps it prices every
            step (they give no price); with a file it prices the rows without one.
        currency: ISO 4217 code of ``price_per_kwh``.
        file: CSV path for ``source="file"``.
        pue: Power usage effectiveness of the site (``>= 1``).
        overhead: Further fraction on top of the PUE (``>= 0``).
    """

    source: str = "table"
    zone: str = ""
    g_per_kwh: float | None = None
    price_per_kwh: float | None = None
    currency: str = ""
    file: str = ""
    pue: float = 1.0
    overhead: float = 0.0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(
                f"carbon: unknown source {self.source!r}; choose one of {', '.join(SOURCES)}"
            )
        check_factors(self.pue, self.overhead)
        if self.source == "constant" and self.g_per_kwh is None:
            raise ConfigError("carbon: source 'constant' needs g_per_kwh")
        if self.source == "file" and not self.file:
            raise ConfigError("carbon: source 'file' needs file (a CSV path)")
        if self.source == "electricitymaps" and not self.zone.strip():
            raise ConfigError(
                "carbon: source 'electricitymaps' needs zone (e.g. 'FR'); it is never guessed"
            )
        if self.g_per_kwh is not None and self.source != "constant":
            raise ConfigError(
                f"carbon: g_per_kwh is only for source 'constant', not {self.source!r}"
            )

    def open(self) -> IntensitySource:
        """The configured source (reads the file / checks the zone now).

        Raises:
            ConfigError: An unknown zone, an unreadable or bad file, a bad price.
        """
        source: IntensitySource
        if self.source == "constant":
            assert self.g_per_kwh is not None
            return ConstantIntensity(self.g_per_kwh, self.price_per_kwh, self.currency)
        if self.source == "table":
            source = TableIntensity(self.zone)
        elif self.source == "electricitymaps":
            source = ElectricityMapsIntensity(self.zone)
        else:
            source = FileIntensity(self.file)
        if self.price_per_kwh is not None:
            source = PricedIntensity(source, self.price_per_kwh, self.currency)
        return source

    def footprint(
        self,
        energy_between: Callable[[int, int], float],
        t0_ns: int,
        t1_ns: int,
        source: IntensitySource | None = None,
    ) -> Footprint:
        """:func:`~zeus_async.carbon.footprint` with this PUE and overhead (``source``: one
        opened before, to reuse its caches; default :meth:`open`)."""
        return footprint(
            energy_between,
            t0_ns,
            t1_ns,
            source if source is not None else self.open(),
            pue=self.pue,
            overhead=self.overhead,
        )

    def footprint_of(
        self, energy_j: float, t0_ns: int, t1_ns: int, source: IntensitySource | None = None
    ) -> Footprint:
        """:func:`~zeus_async.carbon.footprint_of` (energy spread uniformly in time) with this
        PUE and overhead."""
        return footprint_of(
            energy_j,
            t0_ns,
            t1_ns,
            source if source is not None else self.open(),
            pue=self.pue,
            overhead=self.overhead,
        )
