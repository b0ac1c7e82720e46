"""Running per-device totals over a live or replayed stream (what ``zeus-async monitor`` shows).

Energy is taken from the energy counter when samples carry it (with the partial counter
periods at both ends filled in from power samples) and otherwise integrated from power samples
with the trapezoid rule; each device's :attr:`DeviceTotals.method` says which, so the figures
never pretend to be more exact than they are.
"""

from __future__ import annotations

import logging

from ..events import DeviceFault, Event, GpuSample, RaplSample

__all__ = ["DeviceTotals", "LiveTotals"]

logger = logging.getLogger(__name__)


class DeviceTotals:
    """Latest readings and accumulated energy of one device.

    Energy from a counter that updates only every ~100 ms (NVML on recent GPUs) is exact
    between two observed updates but says nothing about the partial periods at either end of
    the span. Those ends are filled in from the integrated power samples, so a short span is
    never reported as 0 J and a long one is not short by up to one counter period
    (method ``counter+interpolated``).
    """

    __slots__ = (
        "_changes",
        "_cum_j",
        "_first_change",
        "_first_counter",
        "_last_change",
        "_last_counter",
        "_last_power",
        "dropped",
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
        # Cumulative trapezoid energy of the power samples, at the latest power sample.
        self._cum_j = 0.0
        self._last_power: tuple[int, float] | None = None
        self.power_samples = 0
        self._last_counter: float | None = None
        self._first_counter: float | None = None
        self._changes = 0
        # (t_ns, counter J, cumulative integrated J at that time) of counter updates.
        self._first_change: tuple[int, float, float] | None = None
        self._last_change: tuple[int, float, float] | None = None
        self.fault: str | None = None
        #: Samples ignored because they were not later than the previous one (a duplicate, or
        #: one delivered out of order): they cannot be placed in the running totals.
        self.dropped = 0

    def add_power(self, t_ns: int, power_w: float) -> None:
        """Account one power sample (trapezoid rule between consecutive samples)."""
        if self._last_power is not None:
            t0, p0 = self._last_power
            if t_ns > t0:
                self._cum_j += (p0 + power_w) / 2 * (t_ns - t0) / 1e9
        self._last_power = (t_ns, power_w)
        self.power_samples += 1

    def add_counter(self, t_ns: int, energy_j: float, *, fine: bool = False) -> None:
        """Account one energy-counter reading; call after :meth:`add_power` of the same time.

        Args:
            t_ns: Time of the reading.
            energy_j: Counter value.
            fine: The counter updates far faster than it is sampled (RAPL, ~1 ms), so every
                reading is a valid reference point, including the first.
        """
        if self._first_counter is None:
            self._first_counter = energy_j
        if fine or (self._last_counter is not None and energy_j != self._last_counter):
            self._changes += 1
            # The counter moved between the previous reading and this one: its value is the
            # energy up to that update, known to within one sample period.
            change = (t_ns, energy_j, self._cum_j)
            if self._first_change is None:
                self._first_change = change
            self._last_change = change
        self._last_counter = energy_j

    @property
    def method(self) -> str:
        """``counter``, ``counter+interpolated``, ``integrated`` or ``unavailable``."""
        if self._first_change is not None:
            return "counter+interpolated" if self.power_samples >= 2 else "counter"
        if self.power_samples >= 2:
            return "integrated"
        return "unavailable"

    @property
    def energy_j(self) -> float | None:
        """Energy over the observed span, or ``None`` when it cannot be known."""
        fc, lc = self._first_change, self._last_change
        if fc is not None and lc is not None:
            counted = lc[1] - fc[1]
            head = fc[2]
            if (
                self._changes >= 3
                and self._first_counter is not None
                and self.first_t_ns is not None
                and fc[0] > self.first_t_ns
            ):
                # The first counter period, (u0, u1], is known in energy (first update minus
                # the first reading) and, from the regular update cadence, in length; the part
                # of it after the first sample is taken in proportion to time.
                period_ns = (lc[0] - fc[0]) / (self._changes - 1)
                fraction = min(1.0, (fc[0] - self.first_t_ns) / period_ns)
                head = (fc[1] - self._first_counter) * fraction
            elif self.power_samples < 2:
                head = 0.0
            # The tail after the last update is integrated from power samples.
            tail = self._cum_j - lc[2] if self.power_samples >= 2 else 0.0
            return head + counted + tail
        if self.power_samples >= 2:
            return self._cum_j
        return None

    @property
    def duration_s(self) -> float:
        if self.first_t_ns is None or self.last_t_ns is None:
            return 0.0
        return (self.last_t_ns - self.first_t_ns) / 1e9


class LiveTotals:
    """Consumes events and keeps :class:`DeviceTotals` per device of each host.

    A device is its host and its key: ``gpu:0`` of ``node1`` and ``gpu:0`` of ``node2`` are two
    devices (a stream through a proxy, a replay of a multi-host recording). :attr:`devices`
    names them by the bare key (``gpu:0``, ``cpu:0/package``) while one host is seen, and with
    the host appended (``gpu:0@node1``) once there are several, as
    :class:`~zeus_async.store.analysis.Recording` does.
    """

    def __init__(self) -> None:
        self._by_host: dict[tuple[str, str], DeviceTotals] = {}
        self._hosts: set[str] = set()
        self.events = 0

    @property
    def devices(self) -> dict[str, DeviceTotals]:
        """Totals per device name (``gpu:0``, or ``gpu:0@node1`` when several hosts)."""
        if len(self._hosts) <= 1:
            return {key: t for (_, key), t in self._by_host.items()}
        return {f"{key}@{host}": t for (host, key), t in self._by_host.items()}

    def _get(self, host: str, key: str) -> DeviceTotals:
        totals = self._by_host.get((host, key))
        if totals is None:
            totals = self._by_host[(host, key)] = DeviceTotals(key)
            self._hosts.add(host)
        return totals

    def add(self, event: Event) -> None:
        """Account one event (events of other kinds are ignored)."""
        self.events += 1
        if isinstance(event, GpuSample):
            totals = self._get(event.host, f"gpu:{event.gpu}")
            if not self._stamp(totals, event.t_ns):
                return
            for field in event.__struct_fields__[3:]:
                value = getattr(event, field)
                if value is not None:
                    totals.last[field] = value
            if event.power_w is not None:
                totals.add_power(event.t_ns, event.power_w)
            if event.energy_j is not None:
                totals.add_counter(event.t_ns, event.energy_j)
            totals.fault = None
        elif isinstance(event, RaplSample):
            totals = self._get(event.host, f"cpu:{event.package}/{event.domain}")
            if not self._stamp(totals, event.t_ns):
                return
            if event.power_w is not None:
                totals.last["power_w"] = event.power_w
            # RAPL counters update every ~1 ms: the counter alone is exact enough.
            totals.add_counter(event.t_ns, event.energy_j, fine=True)
            totals.fault = None
        elif isinstance(event, DeviceFault):
            prefix = event.device
            hit = False
            for (host, key), totals in self._by_host.items():
                if host == event.host and (key == prefix or key.startswith(prefix + "/")):
                    totals.fault = event.kind
                    hit = True
            if not hit:
                self._get(event.host, event.device).fault = event.kind

    @staticmethod
    def _stamp(totals: DeviceTotals, t_ns: int) -> bool:
        """Take ``t_ns`` as the device's latest time; ``False`` (and counted) when it is not
        later than the previous sample's."""
        if totals.first_t_ns is None:
            totals.first_t_ns = t_ns
        elif totals.last_t_ns is not None and t_ns <= totals.last_t_ns:
            totals.dropped += 1
            return False
        totals.last_t_ns = t_ns
        return True
