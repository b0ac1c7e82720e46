"""The bus subscriber: receives frames on a ZeroMQ SUB socket, decodes them and reports every gap.

Loss accounting (see ``docs/wire-format.md``, "Sequence numbers"):

* A subscriber of **every** topic (``""`` among its topics) follows the stream sequence number of
  each stream: every frame of the stream reaches it, so a jump from the expected ``seq`` to a
  larger one is exactly the number of frames lost, including frames lost at the tail of a burst
  (the next heartbeat reveals them).
* A **topic-filtered** subscriber never sees the frames of the other topics, so the stream
  sequence has legitimate holes; it follows the per-(stream, topic) sequence number instead,
  which is exact for every topic it receives. A loss at the end of a topic's traffic is reported
  when the next frame of that topic arrives.

In both modes counting starts at the first frame received from a stream (or topic): frames
published before the subscription took effect are not losses. Use :meth:`Subscriber.wait_ready`
before relying on a complete stream: it returns once the publisher acknowledged the
subscription by sending its StreamInfo (the slow-joiner handshake).

Malformed frames are counted in :attr:`SubscriberStats.decode_errors` and logged; they never end
the iteration. The socket is served with anyio primitives (``anyio.wait_readable`` on
``ZMQ_FD``), so the subscriber runs on asyncio and on trio. One task should iterate a
subscriber at a time (one task owns each socket).
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import CodecError, ConfigError
from ..events import Event, Heartbeat, StreamInfo
from ._sockets import poll_in, socket_fd
from .codec import Frame, FrameDecoder, FrameHeader, unpack_header
from .curve import CurveClientKeys, apply_client_keys

__all__ = ["StreamStats", "Subscriber", "SubscriberStats"]

logger = logging.getLogger(__name__)

_FAILURES = frozenset(
    {
        zmq.EVENT_HANDSHAKE_FAILED_AUTH,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    }
)
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | functools.reduce(operator.or_, _FAILURES)

#: The largest sequence jump counted as lost frames (2**32: over a day of a stream publishing
#: 40,000 frames a second). A larger one comes from a damaged or forged header: the frame is a
#: decode error and the expected number stays where it was.
MAX_SEQ_JUMP = 2**32

#: A stream with no frame for this long (heartbeats come every second by default) and no FINAL
#: has gone silent: its tail is unknown.
SILENT_AFTER_S = 3.0

#: Topic prefix of StreamInfo / Heartbeat frames; always subscribed.
STREAM_TOPIC_PREFIX = "stream/"


@dataclass
class StreamStats:
    """What one subscriber knows about one stream (one publisher instance).

    Attributes:
        stream_id: The stream's UUID.
        host: Host id from the stream's StreamInfo or Heartbeat ("" until one arrived).
        info: The latest StreamInfo received, or ``None``.
        last_heartbeat: The latest Heartbeat received, or ``None``.
        frames_received: Frames received from this stream (valid header).
        events_received: Events decoded from them.
        frames_lost: Frames the sequence numbers show as missing.
        out_of_order: Frames whose sequence number was lower than expected (duplicates).
        finished: The stream's final frame (publisher shut down) was received.
        next_seq: Next expected stream sequence number (subscribers of every topic).
        next_topic_seq: Next expected topic sequence number per topic (filtered subscribers).
    """

    stream_id: str
    host: str = ""
    info: StreamInfo | None = None
    last_heartbeat: Heartbeat | None = None
    frames_received: int = 0
    events_received: int = 0
    frames_lost: int = 0
    out_of_order: int = 0
    finished: bool = False
    next_seq: int | None = None
    next_topic_seq: dict[str, int] = field(default_factory=dict)
    last_frame_at: float = 0.0

    def silent(self, now: float, silent_after_s: float = SILENT_AFTER_S) -> bool:
        """No FINAL, and no frame for ``silent_after_s``: the publisher is gone or cut off."""
        return not self.finished and now - self.last_frame_at > silent_after_s

    def describe(self, now: float, silent_after_s: float = SILENT_AFTER_S) -> str:
        """One line for people: frames received and lost, and whether the tail is known.

        Frames lost after the last one received are known only from the stream's end (the
        FINAL frame, whose sequence number counts them); a stream with no FINAL is reported
        as still running (a frame within ``silent_after_s``) or as gone silent, its tail
        unknown, never as complete.
        """
        who = f"stream {self.stream_id[:8]} ({self.host or '?'})"
        head = f"{who}: {self.frames_received} frame(s) received, {self.frames_lost} lost"
        if self.finished:
            return head + " (ended; tail counted)"
        if not self.silent(now, silent_after_s):
            return head + " so far (still running; later frames not counted)"
        return head + " before it went silent with no end of stream: tail unknown"


@dataclass
class SubscriberStats:
    """Counters of one :class:`Subscriber`, over all streams.

    Attributes:
        frames_received: Frames with a valid header.
        events_received: Events decoded.
        frames_lost: Sum of the gaps in the sequence numbers (every stream).
        decode_errors: Messages that failed to decode (bad header or payload).
        unknown_events: Events skipped because their tag is unknown to this build.
        buffer_dropped: Frames dropped from the subscriber's own buffer while waiting for
            readiness (also counted in ``frames_lost``).
        handshakes: Connections whose ZMTP/CURVE handshake succeeded.
        handshake_failures: Handshakes refused (CURVE authentication denied, security
            mechanism mismatch, ...): a subscriber that receives nothing says why.
        last_handshake_error: Description of the latest failure ("" if none).
        streams: Per-stream detail, by stream id.
    """

    frames_received: int = 0
    events_received: int = 0
    frames_lost: int = 0
    decode_errors: int = 0
    unknown_events: int = 0
    buffer_dropped: int = 0
    handshakes: int = 0
    handshake_failures: int = 0
    last_handshake_error: str = ""
    streams: dict[str, StreamStats] = field(default_factory=dict)


class Subscriber:
    """Receives and decodes events from one or more publishers (or proxies).

    Use as an async context manager::

        async with Subscriber("tcp://node1:5556", topics=["gpu/"]) as sub:
            await sub.wait_ready()
            async for event in sub:
                ...

    Args:
        endpoints: Endpoint(s) to connect to.
        topics: Topic prefixes to receive; ``""`` receives everything. ``stream/`` is always
            subscribed too, for the readiness handshake and heartbeats, but its frames are only
            yielded when one of ``topics`` covers them.
        curve: Client keys, to connect to a CURVE server.
        rcvhwm: ZeroMQ receive high-water mark, in frames.
        max_buffered_frames: Bound on frames buffered while :meth:`wait_ready` runs.
        gap_log_interval_s: Minimum interval between two gap warnings (the counts are summed).
        context: ZeroMQ context; by default the subscriber creates and terminates its own.

    Raises:
        ConfigError: Invalid argument.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        topics: Sequence[str] = ("",),
        curve: CurveClientKeys | None = None,
        rcvhwm: int = 10_000,
        max_buffered_frames: int = 10_000,
        gap_log_interval_s: float = 1.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not eps:
            raise ConfigError("Subscriber needs at least one endpoint")
        for ep in eps:
            if "://" not in ep:
                raise ConfigError(f"endpoint must look like transport://address, got {ep!r}")
        if isinstance(topics, str):
            raise ConfigError("topics must be a sequence of prefixes, not one string")
        if not topics:
            raise ConfigError("Subscriber needs at least one topic prefix ('' for all)")
        if rcvhwm < 0 or max_buffered_frames < 1:
            raise ConfigError("rcvhwm must be >= 0 and max_buffered_frames >= 1")
        self._endpoints = eps
        self._topics = tuple(dict.fromkeys(topics))
        self._all_topics = "" in self._topics
        self._curve = curve
        self._rcvhwm = rcvhwm
        self._max_buffered = max_buffered_frames
        self._gap_interval = gap_log_interval_s
        self._context = context
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._fd = -1
        self._monitor: zmq.Socket[Any] | None = None
        self._decoder = FrameDecoder()
        self._buffer: deque[Frame] = deque()
        self._ready: dict[str, StreamInfo] = {}
        self._closed = False
        self._recv_scope: anyio.CancelScope | None = None
        self._gaps_unlogged = 0
        self._last_gap_log = -math.inf
        self.stats = SubscriberStats()

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Subscriber:
        self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self) -> None:
        """Create the socket, subscribe and connect (done by ``async with``).

        Raises:
            ConfigError: A connect failed (bad endpoint), or already opened.
        """
        if self._sock is not None or self._closed:
            raise ConfigError("Subscriber already opened")
        ctx: zmq.Context[Any] = self._context if self._context is not None else zmq.Context()
        sock: zmq.Socket[Any] = ctx.socket(zmq.SUB, socket_class=zmq.Socket)
        monitor: zmq.Socket[Any] = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            for topic in self._topics:
                sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            if not any(STREAM_TOPIC_PREFIX.startswith(t) for t in self._topics):
                sock.setsockopt(zmq.SUBSCRIBE, STREAM_TOPIC_PREFIX.encode())
            if self._curve is not None:
                apply_client_keys(sock, self._curve)
            # Watch handshakes before connecting, so no outcome can be missed.
            monitor_addr = f"inproc://zeus-async-monitor-{uuid.uuid4()}"
            sock.monitor(monitor_addr, _HANDSHAKE_EVENTS)
            monitor.setsockopt(zmq.LINGER, 0)
            monitor.connect(monitor_addr)
            for ep in self._endpoints:
                try:
                    sock.connect(ep)
                except zmq.ZMQError as exc:
                    raise ConfigError(f"subscriber cannot connect to {ep!r}: {exc}") from exc
        except BaseException:
            sock.close(linger=0)
            monitor.close(linger=0)
            if self._context is None:
                ctx.term()
            raise
        self._ctx = ctx
        self._sock = sock
        self._monitor = monitor
        self._fd = socket_fd(sock)

    def close(self) -> None:
        """Close the subscriber (idempotent); iteration then ends.

        May be called from another task than the one receiving: that task is woken and closes
        the socket itself (a file descriptor must not be closed while a task waits on it).
        """
        if self._closed:
            return
        self._closed = True
        if self._gaps_unlogged:
            self._log_gaps(force=True)
        if self._recv_scope is not None:
            self._recv_scope.cancel()  # the receiving task calls _release() on its way out
        else:
            self._release()

    def _close_requested(self) -> bool:
        # A method, not the attribute: close() may flip it while this task awaits.
        return self._closed

    def _release(self) -> None:
        if self._sock is not None:
            if self._monitor is not None:
                self._sock.monitor(None, 0)
                self._monitor.close(linger=0)
                self._monitor = None
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None and self._context is None:
            self._ctx.term()
        self._ctx = None

    # ------------------------------------------------------------------ properties

    @property
    def topics(self) -> tuple[str, ...]:
        """The topic prefixes this subscriber yields."""
        return self._topics

    @property
    def ready_streams(self) -> dict[str, StreamInfo]:
        """Streams whose StreamInfo was received (the handshake completed), by stream id."""
        return dict(self._ready)

    # ------------------------------------------------------------------ receiving

    async def wait_ready(self, streams: int = 1, timeout: float | None = None) -> None:
        """Wait until StreamInfo frames from ``streams`` distinct streams have arrived.

        Each publisher (re)sends its StreamInfo whenever it sees a new subscription covering
        it, so once this returns, this subscriber's subscriptions are in force at those
        publishers and nothing they publish from then on is missed silently. Frames received
        meanwhile are kept for iteration.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            anyio.ClosedResourceError: The subscriber is closed.
        """
        try:
            with anyio.fail_after(timeout):
                while len(self._ready) < streams:
                    frame = await self._receive_any()
                    if frame is not None:
                        self._buffer.append(frame)
                        if len(self._buffer) > self._max_buffered:
                            self._drop_buffered()
        except TimeoutError:
            self._poll_monitor()
            why = (
                f"; {self.stats.handshake_failures} handshake failure(s), latest: "
                f"{self.stats.last_handshake_error}"
                if self.stats.handshake_failures
                else ""
            )
            raise TimeoutError(
                f"{len(self._ready)} of {streams} stream(s) ready after {timeout} s{why}"
            ) from None

    async def wait_handshake(self, timeout: float | None = None) -> bool:
        """Wait for the outcome of the first connection handshake (security included).

        Returns:
            ``True`` once a connection completed its handshake, ``False`` once one was
            refused (wrong or unauthorized CURVE keys, plain client to a CURVE server, ...;
            see :attr:`SubscriberStats.last_handshake_error`). Outcomes already seen count.

        Raises:
            TimeoutError: No outcome within ``timeout`` seconds (e.g. nobody listening).
            anyio.ClosedResourceError: The subscriber is closed.
        """
        with anyio.fail_after(timeout):
            while True:
                monitor = self._monitor
                if monitor is None:
                    raise anyio.ClosedResourceError
                self._poll_monitor()
                if self.stats.handshakes:
                    return True
                if self.stats.handshake_failures:
                    return False
                await anyio.wait_readable(socket_fd(monitor))

    async def receive_frame(self) -> Frame:
        """Return the next frame whose topic matches one of :attr:`topics`.

        Raises:
            anyio.ClosedResourceError: The subscriber is closed.
        """
        if self._buffer:
            await anyio.lowlevel.checkpoint()
            return self._buffer.popleft()
        while True:
            frame = await self._receive_any()
            if frame is not None:
                return frame

    async def frames(self) -> AsyncIterator[Frame]:
        """Iterate over frames (``async for frame in sub.frames()``); ends when closed.

        Each :class:`~zeus_async.bus.codec.Frame` is (topic, header, events): the batch API,
        cheaper per event than iterating events one by one.
        """
        while True:
            try:
                frame = await self.receive_frame()
            except anyio.ClosedResourceError:
                return
            yield frame

    def __aiter__(self) -> AsyncIterator[Event]:
        """Iterate over events, frame after frame; ends when the subscriber is closed."""
        return self._iter_events()

    async def _iter_events(self) -> AsyncIterator[Event]:
        # An async generator: its C-level asend is about twice as cheap per item as a Python
        # __anext__ coroutine. It never yields inside a cancel scope, so abandoning it is safe.
        while True:
            try:
                frame = await self.receive_frame()
            except anyio.ClosedResourceError:
                return
            for event in frame.events:
                yield event

    async def _receive_any(self) -> Frame | None:
        """Receive and process one message; return it if the user should see it."""
        sock = self._sock
        if sock is None or self._closed:
            raise anyio.ClosedResourceError
        checkpointed = False
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                pass
            if poll_in(sock):  # also re-arms the edge-triggered ZMQ_FD
                continue
            self._poll_monitor()
            try:
                # The deadline only makes handshake failures visible while nothing arrives.
                with anyio.CancelScope(deadline=anyio.current_time() + 1.0) as scope:
                    self._recv_scope = scope
                    await anyio.wait_readable(self._fd)
            finally:
                self._recv_scope = None
                if self._close_requested():
                    self._release()
            if self._sock is None:  # closed (and released) while waiting
                raise anyio.ClosedResourceError
            checkpointed = True
        if not checkpointed:
            await anyio.lowlevel.checkpoint()
        return self._process(parts)

    def _poll_monitor(self) -> None:
        """Account for (and log) the handshake outcomes reported by the socket monitor."""
        monitor = self._monitor
        if monitor is None:
            return
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.stats.handshakes += 1
                continue
            if kind not in _FAILURES:
                continue
            endpoint = bytes(event["endpoint"]).decode(errors="replace")
            value = event["value"]
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = f"authentication refused by the server (ZAP status {value})"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                why = f"protocol error {value:#x} (security mechanism mismatch?)"
            else:
                why = f"handshake failed ({os.strerror(value)}; security mismatch?)"
            self.stats.handshake_failures += 1
            self.stats.last_handshake_error = f"{endpoint}: {why}"
            n = self.stats.handshake_failures
            if n <= 3 or n & (n - 1) == 0:
                logger.warning("subscriber cannot connect to %s: %s (#%d)", endpoint, why, n)

    def _process(self, parts: list[zmq.Frame]) -> Frame | None:
        stats = self.stats
        if len(parts) != 3:
            return self._decode_error(f"a frame has 3 parts, got {len(parts)}")
        topic_f, header_f, payload_f = parts
        payload = payload_f.buffer  # zero-copy view of the (large) payload
        try:
            topic = topic_f.bytes.decode()
            header = unpack_header(header_f.bytes)
        except (CodecError, UnicodeDecodeError) as exc:
            return self._decode_error(str(exc))
        st = stats.streams.get(header.stream_id)
        if st is None:
            st = stats.streams[header.stream_id] = StreamStats(header.stream_id)
        if st.finished and header.flags & 1:
            return None  # a copy of the FINAL frame already taken (publishers repeat it)
        if not self._track(st, topic, header):
            return self._decode_error(
                f"stream {header.stream_id} seq {header.seq}: implausible sequence jump"
            )
        st.last_frame_at = time.monotonic()
        st.frames_received += 1
        stats.frames_received += 1
        decoder = self._decoder
        unknown = decoder.unknown_events
        try:
            events = decoder.decode_payload(payload, header.event_count)
        except CodecError as exc:
            return self._decode_error(f"stream {header.stream_id} seq {header.seq}: {exc}")
        if decoder.unknown_events != unknown:
            stats.unknown_events += decoder.unknown_events - unknown
        n = len(events)
        st.events_received += n
        stats.events_received += n
        if header.flags & 1:
            st.finished = True
        if topic.startswith(STREAM_TOPIC_PREFIX):
            for ev in events:
                if isinstance(ev, StreamInfo):
                    st.info = ev
                    st.host = ev.host
                    if ev.stream_id not in self._ready:
                        logger.debug("stream %s (%s) ready", ev.stream_id, ev.host)
                    self._ready[ev.stream_id] = ev
                elif isinstance(ev, Heartbeat):
                    st.last_heartbeat = ev
                    st.host = ev.host
                    if header.flags & 1 and ev.topic_frames is not None:
                        self._count_topic_tails(st, ev.topic_frames)
        if topic.startswith(self._topics):
            return Frame(topic, header, events)
        return None

    def _track(self, st: StreamStats, topic: str, header: FrameHeader) -> bool:
        """Account the frame's sequence number; ``False`` when it is implausible (a jump of
        more than :data:`MAX_SEQ_JUMP` frames: a damaged or forged header, not a loss)."""
        if self._all_topics:
            seq = header.seq
            expected = st.next_seq
        else:
            seq = header.topic_seq
            expected = st.next_topic_seq.get(topic)
        if expected is not None and seq - expected > MAX_SEQ_JUMP:
            return False
        if self._all_topics:
            st.next_seq = seq + 1 if expected is None or seq >= expected else expected
        else:
            st.next_topic_seq[topic] = seq + 1 if expected is None or seq >= expected else expected
        if expected is None or seq == expected:
            return True
        if seq < expected:
            st.out_of_order += 1
            return True
        lost = seq - expected
        st.frames_lost += lost
        self.stats.frames_lost += lost
        self._gaps_unlogged += lost
        self._log_gaps(st=st, topic=topic)
        return True

    def _count_topic_tails(self, st: StreamStats, published: dict[str, int]) -> None:
        """At a stream's end, a topic-filtered subscriber counts the frames of each topic it
        follows that were published after the last one it received (the FINAL heartbeat says
        how many each topic had); a subscriber of every topic has them from the FINAL's seq."""
        if self._all_topics:
            return
        lost = 0
        for topic, expected in st.next_topic_seq.items():
            count = published.get(topic)
            if count is not None and count > expected and count - expected <= MAX_SEQ_JUMP:
                lost += count - expected
                st.next_topic_seq[topic] = count
        if lost:
            st.frames_lost += lost
            self.stats.frames_lost += lost
            self._gaps_unlogged += lost
            self._log_gaps(st=st, topic="(tail)")

    def _log_gaps(
        self, *, force: bool = False, st: StreamStats | None = None, topic: str = ""
    ) -> None:
        now = time.monotonic()
        if not force and now - self._last_gap_log < self._gap_interval:
            return
        where = (
            f" (latest: stream {st.stream_id} host {st.host or '?'} topic {topic})" if st else ""
        )
        logger.warning(
            "subscriber lost %d frame(s)%s; %d lost in total",
            self._gaps_unlogged,
            where,
            self.stats.frames_lost,
        )
        self._gaps_unlogged = 0
        self._last_gap_log = now

    def _drop_buffered(self) -> None:
        frame = self._buffer.popleft()
        self.stats.buffer_dropped += 1
        self.stats.frames_lost += 1
        st = self.stats.streams.get(frame.header.stream_id)
        if st is not None:
            st.frames_lost += 1
        self._gaps_unlogged += 1
        self._log_gaps()

    def _decode_error(self, message: str) -> Frame | None:
        self.stats.decode_errors += 1
        n = self.stats.decode_errors
        if n <= 10 or n & (n - 1) == 0:  # the first ten, then at powers of two
            logger.warning("subscriber: malformed frame #%d dropped: %s", n, message)
        return None
