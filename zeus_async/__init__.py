"""zeus_async: event-driven measurement and optimization of GPU energy."""

from __future__ import annotations

from .aggregate.windows import WindowResult as WindowResult
from .monitor import Monitor as Monitor
from .monitor import ProfilingResult as ProfilingResult
from .runtime import EmbeddedRuntime as EmbeddedRuntime
from .runtime import Runtime as Runtime

__version__ = "0.1.0"

__all__ = ["EmbeddedRuntime", "Monitor", "ProfilingResult", "Runtime", "WindowResult"]
