"""Aggregation of event streams: running totals (and, later, measurement windows)."""

from __future__ import annotations

from .live import DeviceTotals as DeviceTotals
from .live import LiveTotals as LiveTotals

__all__ = ["DeviceTotals", "LiveTotals"]
