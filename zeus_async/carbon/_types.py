"""The carbon package's records and the interface every intensity source implements."""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import msgspec

from ..errors import ZeusAsyncError

logger = logging.getLogger(__name__)

__all__ = [
    "Footprint",
    "Intensity",
    "IntensitySource",
    "IntensityUnavailableError",
    "SourcedSteps",
]

#: Joules in one kilowatt-hour.
J_PER_KWH = 3.6e6


class IntensityUnavailableError(ZeusAsyncError):
    """A source could not answer and has no fallback (an Electricity Maps source built with
    ``fallback=None`` whose request failed). The message names the source and why."""


class Intensity(msgspec.Struct, frozen=True):
    """One step of a step function: the grid's carbon intensity (and price) in force from
    ``start_ns`` until the next step's ``start_ns`` (the last step: until further notice).

    Attributes:
        start_ns: Wall-clock time (ns since the epoch) from which this step is in force.
        g_per_kwh: Grid carbon intensity, grams CO2-equivalent per kWh.
        price_per_kwh: Price of one kWh in ``currency``; ``None`` when unknown.
        currency: ISO 4217 code of the price, ``""`` when there is no price.
    """

    start_ns: int
    g_per_kwh: float
    price_per_kwh: float | None = None
    currency: str = ""


@runtime_checkable
class IntensitySource(Protocol):
    """Where carbon intensity (and price) come from.

    ``name`` says which source and zone answers, e.g. ``"constant"``,
    ``"table:FR:2023 (Ember / Our World in Data)"``, ``"electricitymaps:FR"``,
    ``"file:prices.csv"``; every :class:`Footprint` carries it.

    ``steps(t0_ns, t1_ns)`` returns the steps covering ``[t0_ns, t1_ns]``, sorted by
    ``start_ns``, the first with ``start_ns <= t0_ns``.
    """

    name: str

    def steps(self, t0_ns: int, t1_ns: int) -> list[Intensity]: ...


@runtime_checkable
class SourcedSteps(Protocol):
    """A source whose answer may come from somewhere else than itself (a fallback).

    ``steps_with_source`` returns the steps and the name of what answered, e.g.
    ``"electricitymaps:FR (fallback: HTTP 429, retry after 60 s) -> table:FR:2023 (...)"``.
    :func:`~zeus_async.carbon.footprint` uses it when a source has it.
    """

    name: str

    def steps(self, t0_ns: int, t1_ns: int) -> list[Intensity]: ...

    def steps_with_source(self, t0_ns: int, t1_ns: int) -> tuple[list[Intensity], str]: ...


class Footprint(msgspec.Struct, frozen=True):
    """Emissions and cost of the energy measured over one interval.

    Attributes:
        energy_j: Measured (IT) energy, joules.
        kwh: Energy charged to the grid: ``energy_j / 3.6e6 * pue * (1 + overhead)``.
        co2e_g: Grams CO2-equivalent, ``kwh`` weighted by the intensity in force when each
            joule was drawn.
        cost: Money in ``currency``; ``None`` when the source has no price for part of the
            interval where energy was drawn.
        currency: ISO 4217 code of ``cost``, ``""`` when ``cost`` is ``None``.
        g_per_kwh: Effective (energy-weighted) intensity, ``co2e_g / kwh`` (the intensity at
            the start of the interval when no energy was drawn).
        source: The source's name; ``"... (fallback: <reason>) -> <fallback's name>"`` when a
            fallback answered.
        pue: Power usage effectiveness applied.
        overhead: Further fraction applied on top of the PUE (cooling, distribution losses).
    """

    energy_j: float
    kwh: float
    co2e_g: float
    cost: float | None
    currency: str
    g_per_kwh: float
    source: str
    pue: float
    overhead: float
