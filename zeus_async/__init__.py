"""zeus_async: event-driven measurement and optimization of GPU energy."""

from __future__ import annotations

__version__ = "0.1.0"
