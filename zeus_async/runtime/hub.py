"""The hub: fans events out to in-process consumers and to non-blocking sinks.

Two kinds of destination, with different guarantees (DESIGN.md invariant 4):

* **Consumers** get a bounded memory stream each. Delivery is lossless and back-pressured: when
  a consumer's buffer is full, :meth:`Hub.publish` waits for it (and with it the sampler that
  produced the event), so nothing is dropped silently.
  A consumer that handles events in bulk (the recorder) can take them as **batches**
  (:meth:`Hub.subscribe_batches`): same guarantees, but handing an event over is one list
  append instead of a memory-stream round trip, and the consumer wakes once per batch.
* **Sinks** are synchronous, non-blocking callables (the ZeroMQ publisher's ``publish``). They
  must never block; a sink that raises is logged, counted and detached.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Protocol

import anyio
import anyio.lowlevel
from anyio.abc import ObjectReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream

from ..events import Event

__all__ = ["EventBatches", "Hub", "HubStats"]

logger = logging.getLogger(__name__)

Sink = Callable[[Event], None]


class HubStats:
    """Counters of a hub (plain attributes, read them at any time)."""

    __slots__ = ("consumer_waits", "events", "sink_errors")

    def __init__(self) -> None:
        self.events = 0
        self.consumer_waits = 0
        self.sink_errors = 0


class _SendEnd(Protocol):
    def send_nowait(self, item: Event, /) -> None: ...

    async def send(self, item: Event, /) -> None: ...

    def close(self) -> None: ...


class EventBatches:
    """The receiving end of a batched consumer (:meth:`Hub.subscribe_batches`).

    ``async for batch in batches`` yields non-empty lists of events, in publication order, each
    holding everything published since the previous batch was taken (at most ``max_buffer``
    events: the publisher waits while the buffer is full). Iteration ends after the last event
    once the hub closes. Use it as an async context manager, or call :meth:`aclose`, to
    unsubscribe; a publisher then stops delivering to it.
    """

    def __init__(self, max_buffer: int) -> None:
        if max_buffer < 1:
            raise ValueError(f"max_buffer must be at least 1, got {max_buffer!r}")
        self.max_buffer = max_buffer
        self._room = max_buffer  # 0 once closed at either end, so send_nowait takes one branch
        self._buf: list[Event] = []
        self._eof = False  # the hub closed the stream
        self._closed = False  # the consumer unsubscribed
        self._ready: anyio.Event | None = None  # set when events arrive or the hub closes
        self._space: anyio.Event | None = None  # set when a batch is taken
        #: Batches taken so far (a stall watchdog's sign of progress).
        self.taken = 0

    # -- the hub's side (the send-stream protocol Hub uses for every consumer) ----------------

    def send_nowait(self, item: Event, /) -> None:
        buf = self._buf
        if len(buf) < self._room:  # the fast path: one comparison, one append
            buf.append(item)
            if self._ready is not None:
                self._wake_receiver()
            return
        if self._closed:
            raise anyio.BrokenResourceError
        if self._eof:
            raise anyio.ClosedResourceError
        raise anyio.WouldBlock

    async def send(self, item: Event, /) -> None:
        while True:
            try:
                self.send_nowait(item)
            except anyio.WouldBlock:
                if self._space is None:
                    self._space = anyio.Event()
                await self._space.wait()
            else:
                await anyio.lowlevel.checkpoint()
                return

    def close(self) -> None:
        """End of stream, called by the hub: the consumer drains, then iteration stops."""
        self._eof = True
        self._room = 0
        self._wake_receiver()

    # -- the consumer's side -------------------------------------------------------------------

    def _wake_receiver(self) -> None:
        ready = self._ready
        if ready is not None:
            self._ready = None
            ready.set()

    @property
    def pending(self) -> int:
        """Events buffered and not yet taken."""
        return len(self._buf)

    def take_nowait(self) -> list[Event]:
        """Everything buffered now (possibly an empty list), without waiting."""
        batch, self._buf = self._buf, []
        if batch:
            self.taken += 1
        space = self._space
        if space is not None and batch:
            self._space = None
            space.set()
        return batch

    async def receive_batch(self) -> list[Event]:
        """Wait for at least one event and take everything buffered.

        Raises:
            anyio.EndOfStream: The hub closed and every event was taken.
            anyio.ClosedResourceError: This end was closed by the consumer.
        """
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            if self._buf:
                batch = self.take_nowait()
                await anyio.lowlevel.checkpoint()
                return batch
            if self._eof:
                raise anyio.EndOfStream
            ready = self._ready = anyio.Event()
            await ready.wait()

    def __aiter__(self) -> EventBatches:
        return self

    async def __anext__(self) -> list[Event]:
        try:
            return await self.receive_batch()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Unsubscribe: buffered events are dropped and publishers stop delivering here."""
        self._closed = True
        self._room = 0
        self._buf = []
        if self._space is not None:
            self._space.set()
        self._wake_receiver()

    async def __aenter__(self) -> EventBatches:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class Hub:
    """Fan-out point between producers (samplers, windows) and consumers (aggregators, sinks)."""

    def __init__(self) -> None:
        self._consumers: list[_SendEnd] = []
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

    def subscribe_batches(self, max_buffer: int = 16384) -> EventBatches:
        """Register a lossless consumer that takes events in batches (see :class:`EventBatches`).

        Same guarantees as :meth:`subscribe`, at a fraction of the cost per event.
        """
        if self._closed:
            raise RuntimeError("hub is closed")
        batches = EventBatches(max_buffer)
        self._consumers.append(batches)
        return batches

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
        consumers = self._consumers
        if len(consumers) == 1:  # the common case (one recorder or one aggregator), inlined
            try:
                consumers[0].send_nowait(event)
            except anyio.WouldBlock:
                return 0
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                del consumers[0]
            return -1
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
                # Several deliveries may wait on one stream: the first to see it closed
                # takes it out; the others find the next consumer where it was.
                consumers = self._consumers
                for i, c in enumerate(consumers):
                    if c is stream:
                        del consumers[i]
                        index = i
                        break
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


async def feed_batches(
    stream: EventBatches | ObjectReceiveStream[Event], add: Callable[[Sequence[Event]], None]
) -> None:
    """Hand every event of ``stream`` to ``add`` until it ends: a batch at a time from an
    :class:`EventBatches` (``start_consumer(..., batched=True)``), one by one from a plain
    stream. What the exporters' ``run`` consumers share."""
    if isinstance(stream, EventBatches):
        async for batch in stream:
            add(batch)
    else:
        async for event in stream:
            add((event,))
