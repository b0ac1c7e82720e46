"""Replaying a recording into the pipeline: a runtime's hub, a ZeroMQ publisher, any callable.

A :class:`Replayer` reads a recording and publishes its events in file order with their
recorded timestamps untouched, paced on a :class:`~zeus_async.clock.Clock`:

* ``speed=1.0`` (default): at the original pace — event ``i`` goes out when
  ``(t_i - t_0) / speed`` has passed on the clock since the replay started;
* ``speed=X``: X times faster (``0.5``: half speed);
* ``speed=None``: as fast as the destination takes them.

Into a :class:`~zeus_async.runtime.Runtime` (``await replayer.into_runtime(rt)``) delivery is
lossless and back-pressured like a sampler's; its consumers (window aggregation with
:class:`~zeus_async.aggregate.windows.ReplayedWindows`, optimizers, a recorder) see the stream
as they would live. Onto ZeroMQ (``await replayer.to_publisher(pub)``) the publisher's rules
apply: frames are sequenced and a slow subscriber sees counted gaps, never silent loss; at
``speed=None`` the replay waits for the publisher to drain so none is dropped locally.

Under a :class:`~zeus_async.clock.FakeClock` with ``autojump`` a paced replay takes no real time,
which is how tests replay recordings (see :func:`replay_events`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from ..clock import Clock, RealClock
from ..errors import ConfigError
from ..events import Event
from .progress import Progress, ProgressTicker
from .reader import RecordingReader

if TYPE_CHECKING:
    from ..bus.publisher import Publisher
    from ..runtime.runtime import Runtime

__all__ = ["Replayer", "replay_events"]

logger = logging.getLogger(__name__)

#: Events handed to the destination between two checkpoints of an unpaced replay.
_CHUNK = 4096


class Replayer:
    """Publishes the events of a recording (or of any event iterable) at a chosen pace.

    Args:
        source: A recording path, an open :class:`RecordingReader`, or events in order.
        speed: Pace factor (``1.0`` original pace); ``None`` for as fast as possible.
        clock: Clock of the pacing (default: the real clock).
        kinds: Replay only these event kinds (see :meth:`RecordingReader.events`).
        devices: Replay only events about these devices (``"gpu:0"``, ...).
        progress: ``progress(done_bytes, total_bytes)`` over the recording (ignored for an
            event iterable).

    Attributes:
        events_published: Events handed to the destination so far.
        first_t_ns: ``t_ns`` of the first event replayed (``None`` before it).

    Raises:
        ConfigError: ``speed`` not positive, or an unknown kind.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | RecordingReader | Iterable[Event],
        *,
        speed: float | None = 1.0,
        clock: Clock | None = None,
        kinds: Collection[str] | None = None,
        devices: Collection[str] | None = None,
        progress: Progress | None = None,
    ) -> None:
        if speed is not None and not speed > 0:
            raise ConfigError(
                f"speed must be positive (or None for as fast as possible), got {speed!r}"
            )
        self.speed = speed
        self.clock: Clock = clock or RealClock()
        self.events_published = 0
        self.first_t_ns: int | None = None
        self.reader: RecordingReader | None = None
        self._ticker: ProgressTicker | None = None
        if isinstance(source, (str, os.PathLike)):
            source = RecordingReader(source)
        if isinstance(source, RecordingReader):
            self.reader = source
            self._ticker = ProgressTicker(source, progress)
            self._events: Iterator[Event] = source.events(kinds=kinds, devices=devices)
        else:
            if kinds is not None or devices is not None:
                raise ConfigError("kinds/devices filters need a recording, not an event iterable")
            self._events = iter(source)

    async def run(
        self,
        publish: Callable[[Event], Awaitable[None]],
        *,
        wait_room: Callable[[], Awaitable[None]] | None = None,
    ) -> int:
        """Replay every event into ``publish`` (awaited per event); returns the count.

        ``wait_room`` (optional) is awaited between chunks of an unpaced replay, for
        destinations that need to drain.
        """
        if self.events_published:
            raise RuntimeError("a Replayer replays its source once")
        clock = self.clock
        speed = self.speed
        start_mono = clock.monotonic_ns()
        t0: int | None = None
        ticker = self._ticker
        n = 0
        for event in self._events:
            if t0 is None:
                t0 = self.first_t_ns = event.t_ns
            if speed is not None:
                due = start_mono + round((event.t_ns - t0) / speed)
                if due > clock.monotonic_ns():
                    await clock.sleep_until(due)
            await publish(event)
            n += 1
            self.events_published = n
            if n % _CHUNK == 0:
                if ticker is not None:
                    ticker.tick()
                if speed is None:
                    if wait_room is not None:
                        await wait_room()
                    await anyio.lowlevel.checkpoint()
        if ticker is not None:
            ticker.finish()
        if self.reader is not None:
            self.reader.report.warn(self.reader.path, "replayed")
        logger.info("replayed %d events", n)
        return n

    async def into_runtime(self, runtime: Runtime, *, max_pending: int = 65536) -> int:
        """Publish into ``runtime``'s hub (lossless, back-pressured); returns the count.

        When the runtime publishes on ZeroMQ, an unpaced replay also waits for its publisher
        to drain below ``max_pending`` queued events, so none is dropped locally.
        """
        publisher = runtime.publisher
        if publisher is None:
            return await self.run(runtime.publish)
        n = await self.run(runtime.publish, wait_room=_drained(publisher, max_pending))
        await _drained(publisher, 0)()
        return n

    async def to_publisher(self, publisher: Publisher, *, max_pending: int = 65536) -> int:
        """Publish onto ZeroMQ through a running ``publisher``; returns the count.

        An unpaced replay waits whenever more than ``max_pending`` events are queued in the
        publisher, so nothing is dropped locally; subscribers' own limits still apply.
        """

        async def publish(event: Event) -> None:
            publisher.publish(event)

        n = await self.run(publish, wait_room=_drained(publisher, max_pending))
        await _drained(publisher, 0)()
        return n


def _drained(publisher: Publisher, max_pending: int) -> Callable[[], Awaitable[None]]:
    async def wait() -> None:
        while publisher.pending_events > max_pending:
            await anyio.sleep(0.001)

    return wait


async def replay_events(
    runtime: Runtime,
    source: str | os.PathLike[str] | RecordingReader | Iterable[Event],
    *,
    speed: float | None = 1.0,
) -> int:
    """Replay ``source`` into ``runtime`` on the runtime's clock; returns the count.

    With a ``FakeClock(autojump=True)`` runtime a paced replay runs faster than real time and
    deterministically — the helper tests use (see ``tests/conftest.py``).
    """
    return await Replayer(source, speed=speed, clock=runtime.clock).into_runtime(runtime)
