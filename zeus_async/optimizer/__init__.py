"""Optimizers that act on the measured stream: GPU power limits (:mod:`.power_limit`)."""

from __future__ import annotations

import logging

from .power_limit import (
    AdaptiveOptions,
    Done,
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    OptimumSelector,
    PowerLimitMeasurement,
    PowerLimitProfile,
    Profiling,
    Ready,
    Time,
    Warmup,
    ZeusCost,
    zeus_cost,
)

__all__ = [
    "AdaptiveOptions",
    "Done",
    "Energy",
    "GlobalPowerLimitOptimizer",
    "MaxSlowdownConstraint",
    "OptimumSelector",
    "PowerLimitMeasurement",
    "PowerLimitProfile",
    "Profiling",
    "Ready",
    "Time",
    "Warmup",
    "ZeusCost",
    "zeus_cost",
]

logger = logging.getLogger(__name__)
