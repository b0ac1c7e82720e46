"""Running per-device totals over a live or replayed stream (what ``zeus-async monitor`` shows).

Each device's energy is its :meth:`DeviceHistory.span_energy
<zeus_async.aggregate.history.DeviceHistory.span_energy>`: the estimator of the measurement
windows and of ``inspect``/``Recording.totals()``, on a bounded history (constant memory however
long the stream), so ``monitor``, ``replay`` and ``inspect`` give the same figure for the same
samples, to the last bit. :attr:`DeviceTotals.method` says how it was obtained
(``docs/energy-methods.md``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ..events import DeviceFault, Event, GpuSample, RaplSample
from .history import DeviceHistory, EnergyEstimate, add_sample, history_key

__all__ = ["DeviceTotals", "LiveTotals", "device_order"]

logger = logging.getLogger(__name__)

_KIND_ORDER = {"gpu": 0, "cpu": 1, "proc": 2}


def device_order(name: str) -> tuple[Any, ...]:
    """Sort key of a device name, the order every table lists devices in: GPUs, then CPU
    domains, then processes; numbers compared as numbers (``gpu:2`` before ``gpu:10``), and
    the same device of several hosts together (``gpu:0@a``, ``gpu:0@b``, ``gpu:1@a``)."""
    parts: list[Any] = re.split(r"(\d+)", name)
    parts[1::2] = [int(p) for p in parts[1::2]]
    return (_KIND_ORDER.get(name.split(":", 1)[0], 9), *parts)


class DeviceTotals:
    """Latest readings and accumulated energy of one device.

    Args:
        key: Device key (``gpu:0``, ``cpu:0/package``).
        fine_counter: The energy counter updates far faster than it is sampled (RAPL).
    """

    __slots__ = ("_seen_t_ns", "fault", "history", "key", "last")

    def __init__(self, key: str, *, fine_counter: bool = False) -> None:
        self.key = key
        self.history = DeviceHistory(key, fine_counter=fine_counter, bounded=True)
        #: The latest value of every reading (for display).
        self.last: dict[str, float | int | None] = {}
        self.fault: str | None = None
        self._seen_t_ns: int | None = None

    def _fresh(self, t_ns: int) -> bool:
        """Whether a sample at ``t_ns`` is later than every one before (else it is stale)."""
        if self._seen_t_ns is not None and t_ns <= self._seen_t_ns:
            return False
        self._seen_t_ns = t_ns
        return True

    @property
    def estimate(self) -> EnergyEstimate:
        """Energy over the device's span and how it was obtained."""
        return self.history.span_energy()

    @property
    def energy_j(self) -> float | None:
        """Energy over the observed span, or ``None`` when it cannot be known."""
        return self.estimate.energy_j

    @property
    def method(self) -> str:
        """How :attr:`energy_j` was obtained (``docs/energy-methods.md``)."""
        return self.estimate.method

    @property
    def first_t_ns(self) -> int | None:
        """Time of the device's first sample with power or energy."""
        return self.history.first_t_ns

    @property
    def last_t_ns(self) -> int | None:
        """Time of its latest one."""
        return self.history.last_t_ns

    @property
    def dropped(self) -> int:
        """Samples ignored for not being later than the previous one (duplicates, out of
        order): they cannot be placed in the totals."""
        return self.history.dropped

    @property
    def duration_s(self) -> float:
        first, last = self.first_t_ns, self.last_t_ns
        if first is None or last is None:
            return 0.0
        return (last - first) / 1e9


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
        """Totals per device name (``gpu:0``, or ``gpu:0@node1`` when several hosts), in
        :func:`device_order`."""
        if len(self._hosts) <= 1:
            named = {key: t for (_, key), t in self._by_host.items()}
        else:
            named = {f"{key}@{host}": t for (host, key), t in self._by_host.items()}
        return {name: named[name] for name in sorted(named, key=device_order)}

    def _get(self, host: str, key: str, *, fine: bool = False) -> DeviceTotals:
        totals = self._by_host.get((host, key))
        if totals is None:
            totals = self._by_host[(host, key)] = DeviceTotals(key, fine_counter=fine)
            self._hosts.add(host)
        return totals

    def add(self, event: Event) -> None:
        """Account one event (events of other kinds are ignored)."""
        self.events += 1
        if isinstance(event, GpuSample):
            totals = self._get(event.host, history_key(event))
            add_sample(totals.history, event)
            if totals._fresh(event.t_ns):
                for field in event.__struct_fields__[3:]:
                    value = getattr(event, field)
                    if value is not None:
                        totals.last[field] = value
                totals.fault = None
        elif isinstance(event, RaplSample):
            totals = self._get(event.host, history_key(event), fine=True)
            add_sample(totals.history, event)
            if totals._fresh(event.t_ns):
                if event.power_w is not None:
                    totals.last["power_w"] = event.power_w
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
