"""Scripted devices for tests of the runtime (no simulator, no NVML).

:class:`ScriptedGpu` returns :class:`~zeus_async.events.GpuSample` values computed from the
injected clock, can fail on a schedule, and can make reads "slow" by advancing a fake clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence

from ..aggregate.history import DeviceHistory
from ..clock import Clock, FakeClock
from ..devices.processes import HostStat, ProcessStat
from ..errors import DeviceError
from ..events import DeviceInfo, Event, GpuSample

__all__ = ["FakeProcessSource", "ScriptedGpu", "SquareWaveFeed", "realistic_gpu_samples"]

logger = logging.getLogger(__name__)

_FIELDS = ("power_w", "energy_j", "temperature_c")


class ScriptedGpu:
    """A fake GPU device whose readings are functions of the clock.

    Args:
        index: GPU index.
        clock: Clock the readings follow (a :class:`FakeClock` for ``read_cost_s``).
        power_w: Constant power; energy is ``power_w * elapsed``.
        fail: Returns an error to raise for a given monotonic ns, or ``None``.
        read_cost_s: Fake time each read consumes (advances a :class:`FakeClock`).
    """

    def __init__(
        self,
        index: int,
        clock: Clock,
        *,
        power_w: float = 100.0,
        fail: Callable[[int], DeviceError | None] | None = None,
        read_cost_s: float = 0.0,
    ) -> None:
        self.index = index
        self._clock = clock
        self._power = power_w
        self._fail = fail
        self._cost = read_cost_s
        self.reads: list[tuple[int, tuple[str, ...]]] = []
        self.closed = False

    @property
    def key(self) -> str:
        return f"gpu:{self.index}"

    @property
    def fields(self) -> tuple[str, ...]:
        return _FIELDS

    def describe(self) -> DeviceInfo:
        return DeviceInfo(key=self.key, name="Scripted GPU", arch="hopper", has_energy_counter=True)

    def read(self, fields: Collection[str], host: str, t_ns: int) -> Sequence[Event]:
        now = self._clock.monotonic_ns()
        self.reads.append((now, tuple(fields)))
        if self._cost and isinstance(self._clock, FakeClock):
            self._clock.advance_sync(self._cost)
        if self._fail is not None:
            error = self._fail(now)
            if error is not None:
                raise error
        return [
            GpuSample(
                host=host,
                t_ns=t_ns,
                gpu=self.index,
                power_w=self._power if "power_w" in fields else None,
                energy_j=self._power * now / 1e9 if "energy_j" in fields else None,
                temperature_c=50.0 if "temperature_c" in fields else None,
            )
        ]

    def close(self) -> None:
        self.closed = True


def realistic_gpu_samples(
    n: int,
    *,
    gpus: int = 8,
    host: str = "node-01",
    t0_ns: int | None = None,
    step_ns: int = 1,
) -> list[Event]:
    """``n`` fully populated :class:`~zeus_async.events.GpuSample` events cycling over
    ``gpus`` GPUs, for benchmarks of the bus and of recordings (realistic sizes and values)."""
    t0 = time.time_ns() if t0_ns is None else t0_ns
    return [
        GpuSample(
            host=host,
            t_ns=t0 + i * step_ns,
            gpu=i % gpus,
            power_w=250.0 + (i % 97),
            avg_power_w=248.5,
            energy_j=1.0e6 + i * 0.35,
            temperature_c=61.0 + (i % 7),
            sm_clock_hz=1.98e9,
            utilization_frac=0.97,
            memory_used_bytes=42_000_000_000 + i,
            power_limit_w=700.0,
        )
        for i in range(n)
    ]


class FakeProcessSource:
    """A scripted :class:`~zeus_async.devices.processes.ProcessSource` (no ``/proc``).

    Tests set :attr:`host_stat`, :attr:`stats` (pid to :class:`ProcessStat`; a pid absent from
    it does not exist) and :attr:`tree` (pid to its direct children) between ticks.
    """

    def __init__(
        self,
        host: HostStat | None = None,
        stats: dict[int, ProcessStat] | None = None,
        tree: dict[int, list[int]] | None = None,
    ) -> None:
        self.host_stat = host or HostStat(0.0, 4, 16 << 30, 8 << 30)
        self.stats: dict[int, ProcessStat] = dict(stats or {})
        self.tree: dict[int, list[int]] = dict(tree or {})
        self.descendant_calls = 0
        self.smaps_calls = 0
        self.forgotten: list[int] = []

    def host(self) -> HostStat:
        return self.host_stat

    def process(self, pid: int, smaps: bool = True) -> ProcessStat | None:
        self.smaps_calls += smaps and pid in self.stats
        return self.stats.get(pid)

    def descendants(self, pid: int) -> list[int]:
        self.descendant_calls += 1
        out: list[int] = []
        stack = list(self.tree.get(pid, ()))
        while stack:
            child = stack.pop(0)
            if child in self.stats:
                out.append(child)
                stack.extend(self.tree.get(child, ()))
        return out

    def forget(self, pids: Iterable[int]) -> None:
        self.forgotten.extend(pids)


class SquareWaveFeed:
    """Readings of one GPU whose power alternates between ``low_w`` and ``high_w`` every
    ``half_period_ns`` from ``t0_ns``, one every ``every_ns``, with an exact energy counter,
    into a consumer (``add``: a request meter) and into :attr:`reference`, a history of the
    same readings to check the consumer's figures against. :meth:`to` feeds up to a time."""

    def __init__(
        self,
        add: Callable[[GpuSample], object],
        *,
        gpu: int = 0,
        t0_ns: int,
        half_period_ns: int,
        every_ns: int,
        low_w: float = 100.0,
        high_w: float = 600.0,
    ) -> None:
        self._add = add
        self.gpu = gpu
        self.reference = DeviceHistory(f"gpu:{gpu}")
        self._t0, self._half, self._every = t0_ns, half_period_ns, every_ns
        self._low, self._high = low_w, high_w
        self.next = t0_ns
        self.joules = 0.0

    def to(self, t_ns: int) -> None:
        while self.next <= t_ns:
            high = ((self.next - self._t0) // self._half) % 2
            p = self._high if high else self._low
            s = GpuSample("h", self.next, self.gpu, power_w=p, energy_j=self.joules)
            self.joules += p * self._every / 1e9
            self._add(s)
            self.reference.add(s.t_ns, s.power_w, s.energy_j)
            self.next += self._every
