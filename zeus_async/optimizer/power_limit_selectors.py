"""Power-limit measurements, the profile file that holds them, and the selectors that pick a limit.

A :class:`PowerLimitMeasurement` is the energy and time of one limit's profiled steps; an
:class:`OptimumSelector` picks the limit from them: Zeus's :class:`Energy`, :class:`Time`,
:class:`ZeusCost` (:func:`zeus_cost`) and :class:`MaxSlowdownConstraint`.
:class:`PowerLimitProfile` is the file ``profile_path`` holds. Used by
:class:`~zeus_async.optimizer.power_limit.GlobalPowerLimitOptimizer`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated, Protocol

import msgspec

__all__ = [
    "Energy",
    "MaxSlowdownConstraint",
    "OptimumSelector",
    "PositiveFloat",
    "PositiveInt",
    "PowerLimitMeasurement",
    "PowerLimitProfile",
    "Time",
    "ZeusCost",
    "zeus_cost",
]

logger = logging.getLogger(__name__)

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class PowerLimitMeasurement(msgspec.Struct, frozen=True):
    """Energy (J, all GPUs) and time (s) of the profiled steps at one power limit (W).

    Raises:
        ValueError: A value that is not positive (also when decoding a profile).
    """

    power_limit: PositiveInt
    energy: PositiveFloat
    time: PositiveFloat

    def __post_init__(self) -> None:
        if not (self.power_limit > 0 and self.energy > 0 and self.time > 0):
            raise ValueError(f"power limit, energy and time must be positive: {self!r}")


class PowerLimitProfile(msgspec.Struct):
    """The file ``profile_path`` holds: every measurement, highest limit first."""

    measurements: list[PowerLimitMeasurement]


class OptimumSelector(Protocol):
    """Picks the power limit (W) from profiling measurements."""

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int: ...


def _nonempty(measurements: Sequence[PowerLimitMeasurement]) -> None:
    if not measurements:
        raise ValueError("no measurements to select a power limit from")


class Energy:
    """The limit with the least energy."""

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        _nonempty(measurements)
        return min(measurements, key=lambda m: m.energy).power_limit

    def cost(
        self, m: PowerLimitMeasurement, measurements: Sequence[PowerLimitMeasurement]
    ) -> float:
        return m.energy


class Time:
    """The limit with the shortest time (ties, and noise among equal times, favour the first
    profiled, i.e. the higher limit)."""

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        _nonempty(measurements)
        return min(measurements, key=lambda m: m.time).power_limit

    def cost(
        self, m: PowerLimitMeasurement, measurements: Sequence[PowerLimitMeasurement]
    ) -> float:
        return m.time


def zeus_cost(energy: float, time: float, eta_knob: float, max_power: float) -> float:
    """Zeus's energy-time cost: ``eta · energy + (1 - eta) · max_power · time``."""
    return eta_knob * energy + (1 - eta_knob) * max_power * time


class ZeusCost:
    """The limit minimizing :func:`zeus_cost`, with ``max_power`` = the highest profiled limit
    times ``world_size``.

    Raises:
        ValueError: ``eta_knob`` outside [0, 1] or ``world_size < 1``.
    """

    def __init__(self, eta_knob: float, world_size: int = 1) -> None:
        if not 0.0 <= eta_knob <= 1.0:
            raise ValueError(f"eta_knob must be between 0 and 1 (inclusive), got {eta_knob!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size!r}")
        self.eta_knob = eta_knob
        self.world_size = world_size

    def cost(
        self, m: PowerLimitMeasurement, measurements: Sequence[PowerLimitMeasurement]
    ) -> float:
        max_power = max(x.power_limit for x in measurements) * self.world_size
        return zeus_cost(m.energy, m.time, self.eta_knob, max_power)

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        _nonempty(measurements)
        return min(measurements, key=lambda m: self.cost(m, measurements)).power_limit


class MaxSlowdownConstraint:
    """The lowest limit whose time is within ``factor`` times the time at the highest limit.

    Raises:
        ValueError: ``factor < 1``.
    """

    def __init__(self, factor: float) -> None:
        if not factor >= 1.0:
            raise ValueError(f"the slowdown factor must be at least 1.0, got {factor!r}")
        self.factor = factor

    def select(self, measurements: Sequence[PowerLimitMeasurement]) -> int:
        _nonempty(measurements)
        top = max(measurements, key=lambda m: m.power_limit)
        return min(m.power_limit for m in measurements if m.time <= self.factor * top.time)
