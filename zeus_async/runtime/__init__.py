"""The anyio runtime: samplers, hub, and embedding in a background thread."""

from __future__ import annotations

from .embedded import EmbeddedRuntime as EmbeddedRuntime
from .hub import Hub as Hub
from .processes import ProcessTracking as ProcessTracking
from .runtime import DEFAULT_GPU_FIELDS as DEFAULT_GPU_FIELDS
from .runtime import Runtime as Runtime
from .sampler import Sampler as Sampler
from .sampler_process import SamplerProcess as SamplerProcess

__all__ = [
    "DEFAULT_GPU_FIELDS",
    "EmbeddedRuntime",
    "Hub",
    "ProcessTracking",
    "Runtime",
    "Sampler",
    "SamplerProcess",
]
