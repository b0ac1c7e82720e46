"""Aggregation of event streams: running totals (and, later, measurement windows)."""

from __future__ import annotations

from .history import DeviceHistory as DeviceHistory
from .history import EnergyEstimate as EnergyEstimate
from .live import DeviceTotals as DeviceTotals
from .live import LiveTotals as LiveTotals
from .windows import WindowResult as WindowResult
from .windows import WindowTracker as WindowTracker

__all__ = [
    "DeviceHistory",
    "DeviceTotals",
    "EnergyEstimate",
    "LiveTotals",
    "WindowResult",
    "WindowTracker",
]
