"""Running per-device totals over a live or replayed stream (what ``zeus-async monitor`` shows).

Energy is taken from the GPU energy counter when samples carry it (difference between the last
and first counter value seen) and otherwise integrated from power samples with the trapezoid
rule; each device's :attr:`DeviceTotals.method` says which, so the figures never pretend to be
more exact than they are.
"""

from __future__ import annotations

import logging

from ..events import DeviceFault, Event, GpuSample, RaplSample

__all__ = ["DeviceTotals", "LiveTotals"]

logger = logging.getLogger(__name__)


class DeviceTotals:
    """Latest readings and accumulated energy of one device."""

    __slots__ = (
        "_integrated_j",
        "_last_power",
        "counter_first_j",
        "counter_last_j",
        "fault",
        "first_t_ns",
        "key",
        "last",
        "last_t_ns",
        "power_samples",
    )

    def __init__(self, key: str) -> None:
        self.key = key
        self.last: dict[str, float | int | None] = {}
        self.first_t_ns: int | None = None
        self.last_t_ns: int | None = None
        self.counter_first_j: float | None = None
        self.counter_last_j: float | None = None
        self._integrated_j = 0.0
        self._last_power: tuple[int, float] | None = None
        self.power_samples = 0
        self.fault: str | None = None

    def add_power(self, t_ns: int, power_w: float) -> None:
        if self._last_power is not None:
            t0, p0 = self._last_power
            if t_ns > t0:
                self._integrated_j += (p0 + power_w) / 2 * (t_ns - t0) / 1e9
        self._last_power = (t_ns, power_w)
        self.power_samples += 1

    def add_counter(self, energy_j: float) -> None:
        if self.counter_first_j is None:
            self.counter_first_j = energy_j
        self.counter_last_j = energy_j

    @property
    def method(self) -> str:
        """``counter``, ``integrated`` or ``unavailable``."""
        if self.counter_first_j is not None:
            return "counter"
        if self.power_samples >= 2:
            return "integrated"
        return "unavailable"

    @property
    def energy_j(self) -> float | None:
        """Energy over the observed span, or ``None`` when it cannot be known."""
        if self.counter_first_j is not None and self.counter_last_j is not None:
            return self.counter_last_j - self.counter_first_j
        if self.power_samples >= 2:
            return self._integrated_j
        return None

    @property
    def duration_s(self) -> float:
        if self.first_t_ns is None or self.last_t_ns is None:
            return 0.0
        return (self.last_t_ns - self.first_t_ns) / 1e9


class LiveTotals:
    """Consumes events and keeps :class:`DeviceTotals` per device key (``gpu:0``, ``cpu:0``)."""

    def __init__(self) -> None:
        self.devices: dict[str, DeviceTotals] = {}
        self.events = 0

    def _get(self, key: str) -> DeviceTotals:
        totals = self.devices.get(key)
        if totals is None:
            totals = self.devices[key] = DeviceTotals(key)
        return totals

    def add(self, event: Event) -> None:
        """Account one event (events of other kinds are ignored)."""
        self.events += 1
        if isinstance(event, GpuSample):
            totals = self._get(f"gpu:{event.gpu}")
            self._stamp(totals, event.t_ns)
            for field in event.__struct_fields__[3:]:
                value = getattr(event, field)
                if value is not None:
                    totals.last[field] = value
            if event.energy_j is not None:
                totals.add_counter(event.energy_j)
            if event.power_w is not None:
                totals.add_power(event.t_ns, event.power_w)
            totals.fault = None
        elif isinstance(event, RaplSample):
            totals = self._get(f"cpu:{event.package}/{event.domain}")
            self._stamp(totals, event.t_ns)
            totals.add_counter(event.energy_j)
            if event.power_w is not None:
                totals.last["power_w"] = event.power_w
            totals.fault = None
        elif isinstance(event, DeviceFault):
            prefix = event.device
            for key, totals in self.devices.items():
                if key == prefix or key.startswith(prefix + "/"):
                    totals.fault = event.kind
            if event.device not in self.devices and not any(
                k.startswith(event.device + "/") for k in self.devices
            ):
                self._get(event.device).fault = event.kind

    @staticmethod
    def _stamp(totals: DeviceTotals, t_ns: int) -> None:
        if totals.first_t_ns is None:
            totals.first_t_ns = t_ns
        totals.last_t_ns = t_ns
