"""One sampler task per device, on a drift-free deadline schedule.

Deadlines lie on a fixed grid (``start + k * period``) of the injected clock, so the cadence
does not drift with the time each read takes. A tick that is already past when the previous
read returns is skipped and counted (``missed_ticks``), never run late in a burst.

Each field has its own period, a whole multiple of the base period (e.g. power every 10 ms,
temperature every 500 ms); a tick reads only the fields due on it.

Reads run inline on the event loop thread: a device read costs microseconds (one NVML call per
GPU per tick for power), far less than handing it to a worker thread. A device whose reads take
longer than ``offload_after_s`` three times is moved to a worker thread for good, so a slow or
hung driver call cannot keep stalling the other samplers or window edges (one slow read can be
the process being descheduled, so it is not enough on its own).

With ``adaptive=True`` the power and energy fields read on every tick get a
:class:`~zeus_async.runtime.change_tracker.ChangeTracker` each: once a field's refresh period is
learnt, the ticks on which it can only repeat its last value are not read (see that module for
why the published series then integrates exactly like the full one). A tick with nothing left
to read does not wake the task at all.

A :class:`~zeus_async.errors.DeviceError` becomes a :class:`~zeus_async.events.DeviceFault`
event; the device then backs off (exponentially, capped) and retries while the others keep
sampling.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import anyio
from anyio.abc import TaskStatus

from ..clock import Clock, RealClock
from ..devices.base import Device
from ..errors import ConfigError, DeviceError, NotSupportedError
from ..events import DeviceFault, Event
from .change_tracker import ADAPTIVE_FIELDS, ChangeTracker
from .hub import Hub

__all__ = ["Sampler", "SamplerStats", "field_ratios"]


def _fast_sleeper(clock: Clock) -> Callable[[int], Awaitable[None]]:
    """``clock.sleep_until``, short-circuited to ``asyncio.sleep`` for the real clock on asyncio.

    anyio's generic sleep adds a few layers per call; at 100 Hz per device that is measurable.
    """
    if not isinstance(clock, RealClock):
        return clock.sleep_until
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # not on asyncio (trio)
        return clock.sleep_until
    monotonic_ns = time.monotonic_ns

    def sleep_until(deadline_ns: int) -> Awaitable[None]:
        delay = (deadline_ns - monotonic_ns()) / 1e9
        return asyncio.sleep(delay if delay > 0 else 0)

    return sleep_until


logger = logging.getLogger(__name__)

Publish = Callable[[Event], Awaitable[None]]

_SLOW_READS_BEFORE_OFFLOAD = 3


class SamplerStats:
    """Counters of one sampler."""

    __slots__ = ("errors", "missed_ticks", "offloaded", "reads", "skipped_ticks", "slow_reads")

    def __init__(self) -> None:
        self.reads = 0
        self.slow_reads = 0
        self.missed_ticks = 0
        #: Ticks not read because adaptive reads had nothing to ask for on them.
        self.skipped_ticks = 0
        self.errors = 0
        self.offloaded = False


def field_ratios(
    period_s: float, fields: Mapping[str, float | None], available: Sequence[str]
) -> dict[str, int]:
    """Map each sampled field to its period as a multiple of the base period.

    Args:
        period_s: Base period in seconds.
        fields: Field name to its own period in seconds (``None``: the base period).
        available: Fields the device can read; requested fields it lacks are left out.

    Raises:
        ConfigError: A period that is not positive, or shorter than the base period.
    """
    if not period_s > 0 or not math.isfinite(period_s):
        raise ConfigError(f"sampling period must be a positive number of seconds, got {period_s!r}")
    ratios: dict[str, int] = {}
    for name, field_period in fields.items():
        if name not in available:
            continue
        if field_period is None:
            ratios[name] = 1
            continue
        if not field_period > 0 or not math.isfinite(field_period):
            raise ConfigError(f"period of field {name!r} must be positive, got {field_period!r}")
        if field_period < period_s * (1 - 1e-9):
            raise ConfigError(
                f"period of field {name!r} ({field_period} s) is shorter than the base "
                f"period ({period_s} s)"
            )
        ratios[name] = max(1, round(field_period / period_s))
    return ratios


class Sampler:
    """Samples one device on a deadline schedule and publishes what it reads.

    Args:
        device: The device to read.
        publish: The :class:`Hub` to deliver to (fast path: no await unless a consumer is
            full), or a coroutine function delivering one event.
        clock: Time source and sleeper.
        host: Host id stamped on events.
        period_s: Base period.
        fields: Field name to period (``None`` = base period); fields the device lacks are
            ignored.
        offload_after_s: Three reads slower than this move the device to a worker thread.
        backoff_s: ``(first, max)`` delay before retrying a failed device.
        grid_origin_ns: Monotonic time the deadline grid is anchored to. Samplers of one
            runtime share it, so devices with the same period wake in the same loop turn
            (one wakeup per tick instead of one per device). Default: the sampler's start.
        adaptive: Skip the reads of power and energy fields that can only repeat the last
            value (:mod:`~zeus_async.runtime.change_tracker`).
    """

    def __init__(
        self,
        device: Device,
        publish: Publish | Hub,
        clock: Clock,
        *,
        host: str,
        period_s: float,
        fields: Mapping[str, float | None],
        offload_after_s: float = 0.02,
        backoff_s: tuple[float, float] = (0.1, 5.0),
        grid_origin_ns: int | None = None,
        adaptive: bool = False,
    ) -> None:
        self.device = device
        self._hub = publish if isinstance(publish, Hub) else None
        self._publish: Publish = publish.publish if isinstance(publish, Hub) else publish
        self._clock = clock
        self._host = host
        self._period_ns = round(period_s * 1e9)
        ratios = field_ratios(period_s, fields, device.fields)
        if not ratios:
            raise ConfigError(
                f"{device.key}: none of the requested fields {sorted(fields)} is readable "
                f"(it has {list(device.fields)})"
            )
        self._ratios = ratios
        self._cycle = math.lcm(*ratios.values())
        self._due_cache: dict[int, tuple[str, ...]] = {}
        self._offload_after_ns = round(offload_after_s * 1e9)
        self._backoff = backoff_s
        self._origin = grid_origin_ns
        self.stats = SamplerStats()
        #: Field name to its tracker (adaptive reads; fields read on every tick only).
        self.trackers: dict[str, ChangeTracker] = {
            name: ChangeTracker()
            for name, ratio in ratios.items()
            if adaptive and ratio == 1 and name in ADAPTIVE_FIELDS
        }
        self._untracked_ratios = sorted(
            {r for name, r in ratios.items() if name not in self.trackers}
        )

    @property
    def unbracketed_changes(self) -> int:
        """Changes adaptive reads saw only after skipped ticks (see :class:`ChangeTracker`)."""
        return sum(t.unbracketed for t in self.trackers.values())

    def _due(self, tick: int) -> tuple[str, ...]:
        phase = tick % self._cycle
        due = self._due_cache.get(phase)
        if due is None:
            due = tuple(f for f, r in self._ratios.items() if phase % r == 0)
            self._due_cache[phase] = due
        trackers = self.trackers
        if trackers:
            due = tuple(f for f in due if f not in trackers or trackers[f].wants(tick))
        return due

    def _next_tick(self, tick: int) -> int:
        """The first tick at or after ``tick`` with a field to read."""
        trackers = self.trackers
        if not trackers:
            return tick
        # A tracker's next wanted tick, or the next multiple of an untracked field's ratio
        # (ratios divide the cycle, so that is when the field is due): no tick-by-tick scan.
        nxt = min(t.next_wanted(tick) for t in trackers.values())
        for ratio in self._untracked_ratios:
            nxt = min(nxt, -(-tick // ratio) * ratio)
        self.stats.skipped_ticks += nxt - tick
        return nxt

    def _observe(self, tick: int, due: tuple[str, ...], events: Sequence[Event]) -> None:
        sample = events[0] if events else None
        for name in due:
            tracker = self.trackers.get(name)
            if tracker is not None:
                tracker.observe(tick, getattr(sample, name, None))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Sample until cancelled. Signals readiness after the first successful read attempt."""
        clock = self._clock
        period = self._period_ns
        now = clock.monotonic_ns()
        if self._origin is None or self._origin > now:
            start, tick = now, 0
        else:
            # The first grid point at or after now.
            start = self._origin
            tick = -(-(now - start) // period)
        failures = 0
        started = False
        hub = self._hub
        device = self.device
        host = self._host
        stats = self.stats
        sleep_until = _fast_sleeper(clock)
        offload_after = self._offload_after_ns
        while True:
            due = self._due(tick)
            try:
                if stats.offloaded:
                    events = await self._read_offloaded(due)
                else:
                    t0 = clock.monotonic_ns()
                    events = device.read(due, host, clock.wall_ns())
                    if clock.monotonic_ns() - t0 > offload_after:
                        self._slow_read()
            except DeviceError as exc:
                failures += 1
                stats.errors += 1
                delay = min(self._backoff[0] * 2 ** (failures - 1), self._backoff[1])
                await self._fault(exc, delay)
                if not started:
                    task_status.started()
                    started = True
                for tracker in self.trackers.values():
                    tracker.reset()  # ticks go unread: learn the refresh again
                # Resume on the grid after the back-off.
                resume = clock.monotonic_ns() + round(delay * 1e9)
                await sleep_until(resume)
                tick = max(tick + 1, -(-(clock.monotonic_ns() - start) // period))
                continue
            if failures:
                logger.info("%s: reading again after %d failure(s)", device.key, failures)
                failures = 0
            stats.reads += 1
            if self.trackers:
                self._observe(tick, due, events)
            for event in events:
                if hub is not None:
                    index = hub.try_publish(event)
                    if index >= 0:
                        await hub.resume(event, index)
                else:
                    await self._publish(event)
            if not started:
                task_status.started()
                started = True
            tick = self._next_tick(tick + 1)
            deadline = start + tick * period
            now = clock.monotonic_ns()
            if now >= deadline:
                # Late: skip to the next grid point in the future.
                skipped = (now - deadline) // period + 1
                stats.missed_ticks += skipped
                for tracker in self.trackers.values():
                    tracker.missed()
                tick = self._next_tick(tick + skipped)
                deadline = start + tick * period
            await sleep_until(deadline)

    def _slow_read(self) -> None:
        self.stats.slow_reads += 1
        if self.stats.slow_reads < _SLOW_READS_BEFORE_OFFLOAD:
            logger.debug("%s: slow read (%d)", self.device.key, self.stats.slow_reads)
            return
        self.stats.offloaded = True
        logger.warning(
            "%s: %d reads took over %.1f ms; reading this device on a worker thread from now on",
            self.device.key,
            self.stats.slow_reads,
            self._offload_after_ns / 1e6,
        )

    async def _read_offloaded(self, due: tuple[str, ...]) -> Sequence[Event]:
        wall = self._clock.wall_ns()
        return await anyio.to_thread.run_sync(self.device.read, due, self._host, wall)

    async def _fault(self, exc: DeviceError, retry_in_s: float) -> None:
        level = logging.DEBUG if isinstance(exc, NotSupportedError) else logging.WARNING
        logger.log(level, "%s: %s (retry in %.2f s)", self.device.key, exc, retry_in_s)
        await self._publish(
            DeviceFault(
                host=self._host,
                t_ns=self._clock.wall_ns(),
                device=self.device.key,
                kind=exc.kind,
                message=str(exc),
                retry_in_s=retry_in_s,
            )
        )
