"""Energy per inference request: a meter for servers and the attribution of each GPU's energy
to the requests it served (:mod:`.attribution`), with an ASGI middleware (:mod:`.asgi`) and
Prometheus histograms (:mod:`.metrics`). See ``docs/requests.md``."""

from __future__ import annotations

from .attribution import (
    POLICIES,
    Attribution,
    GpuAttribution,
    RequestEnergy,
    RequestSpan,
    StepEntry,
    StepSpan,
    attribute,
    default_step_weight,
)
from .clocks import ClockMap
from .fit import StepWeightFit
from .meter import MeterTotals, RequestMeter

__all__ = [
    "POLICIES",
    "Attribution",
    "ClockMap",
    "GpuAttribution",
    "MeterTotals",
    "RequestEnergy",
    "RequestMeter",
    "RequestSpan",
    "StepEntry",
    "StepSpan",
    "StepWeightFit",
    "attribute",
    "default_step_weight",
]
