"""The hub: fans events out to in-process consumers and to non-blocking sinks.

Two kinds of destination, with different guarantees (DESIGN.md invariant 4):

* **Consumers** get a bounded memory stream each. Delivery is lossless and back-pressured: when
  a consumer's buffer is full, :meth:`Hub.publish` waits for it (and with it the sampler that
  produced the event), so nothing is dropped silently.
* **Sinks** are synchronous, non-blocking callables (the ZeroMQ publisher's ``publish``). They
  must never block; a sink that raises is logged, counted and detached.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..events import Event

__all__ = ["Hub", "HubStats"]

logger = logging.getLogger(__name__)

Sink = Callable[[Event], None]


class HubStats:
    """Counters of a hub (plain attributes, read them at any time)."""

    __slots__ = ("consumer_waits", "events", "sink_errors")

    def __init__(self) -> None:
        self.events = 0
        self.consumer_waits = 0
        self.sink_errors = 0


class Hub:
    """Fan-out point between producers (samplers, windows) and consumers (aggregators, sinks)."""

    def __init__(self) -> None:
        self._consumers: list[MemoryObjectSendStream[Event]] = []
        self._sinks: tuple[Sink, ...] = ()
        self._closed = False
        self.stats = HubStats()

    def subscribe(self, max_buffer: int = 4096) -> MemoryObjectReceiveStream[Event]:
        """Register a lossless consumer; returns the stream it reads events from.

        The stream ends (``EndOfStream``) when the hub is closed, after every event published
        before the close was delivered. Closing the receive end unsubscribes.
        """
        if self._closed:
            raise RuntimeError("hub is closed")
        send, receive = anyio.create_memory_object_stream[Event](max_buffer)
        self._consumers.append(send)
        return receive

    def add_sink(self, sink: Sink) -> None:
        """Register a synchronous, non-blocking sink (e.g. ``Publisher.publish``)."""
        self._sinks = (*self._sinks, sink)

    def remove_sink(self, sink: Sink) -> None:
        """Detach a sink registered with :meth:`add_sink` (no error if absent)."""
        self._sinks = tuple(s for s in self._sinks if s is not sink)

    @property
    def consumer_count(self) -> int:
        return len(self._consumers)

    def try_publish(self, event: Event) -> int:
        """Deliver without waiting as far as possible (the samplers' fast path).

        Returns ``-1`` when every sink and consumer got the event, else the index of the first
        consumer whose buffer is full; the caller must then ``await resume(event, index)``,
        which waits for that consumer and delivers to the rest. No coroutine is created on
        the fast path.
        """
        self.stats.events += 1
        for sink in self._sinks:
            self._call_sink(sink, event)
        return self._deliver(event, 0)

    async def resume(self, event: Event, index: int) -> None:
        """Finish a delivery that :meth:`try_publish` left at consumer ``index``."""
        while index >= 0:
            if index >= len(self._consumers):
                return
            stream = self._consumers[index]
            self.stats.consumer_waits += 1
            try:
                await stream.send(event)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._consumers.remove(stream)
                index -= 1
            index = self._deliver(event, index + 1)

    def _deliver(self, event: Event, start: int) -> int:
        consumers = self._consumers
        i = start
        while i < len(consumers):
            try:
                consumers[i].send_nowait(event)
            except anyio.WouldBlock:
                return i
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                del consumers[i]
                continue
            i += 1
        return -1

    async def publish(self, event: Event) -> None:
        """Deliver one event to every sink and consumer, waiting on full consumer buffers."""
        index = self.try_publish(event)
        if index >= 0:
            await self.resume(event, index)

    def _call_sink(self, sink: Sink, event: Event) -> None:
        try:
            sink(event)
        except Exception:
            self.stats.sink_errors += 1
            logger.exception("event sink %r failed; detaching it", sink)
            self.remove_sink(sink)

    def close(self) -> None:
        """End every consumer stream (they drain what is buffered, then see ``EndOfStream``)."""
        self._closed = True
        for stream in self._consumers:
            stream.close()
        self._consumers.clear()
