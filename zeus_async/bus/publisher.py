"""The bus publisher: batches events per topic into frames and sends them on a ZeroMQ XPUB socket.

Design:

* :meth:`Publisher.publish` is synchronous and never blocks or raises: it appends the event to
  the open batch of its topic. A batch is flushed when it holds ``max_batch_events`` events, or
  when its timer expires, whichever comes first. The timer starts with the batch's first event
  and expires at ``max(first event, previous frame of the topic + flush_interval_s)``: never
  more than ``flush_interval_s`` after the first event, and immediately when the topic has been
  quiet for ``flush_interval_s``. A topic thus sends at most one timer-flushed frame per
  interval (batching under load) while a lone event goes out at once (latency when idle).
* :meth:`Publisher.run` is the one task that owns the socket. It binds, reports readiness
  through ``task_status.started(publisher)``, then sleeps until the socket is readable
  (subscriptions), a batch is due, a heartbeat is due, or :meth:`publish` wakes it (by
  cancelling the scope it waits in). It is built on anyio primitives only
  (``anyio.wait_readable`` on the socket's ``ZMQ_FD``), so it runs on asyncio and on trio.
* Readiness handshake: the socket is an XPUB with ``XPUB_VERBOSE``, so it sees every
  subscription message, including duplicates from a second subscriber or relayed by a proxy.
  Whenever a new subscription would receive the stream's ``stream/<host>`` topic, the
  publisher (re)sends the :class:`~zeus_async.events.StreamInfo` frame; a subscriber that got it
  knows its subscriptions are in force (see :meth:`Subscriber.wait_ready`).
* Loss: ZeroMQ drops frames for a subscriber whose queue is at its high-water mark; those drops
  are detected by that subscriber from the sequence numbers. Frames this publisher itself could
  not hand to ZeroMQ (pending-buffer overflow, an event that cannot be encoded, a send error)
  still consume their sequence numbers, so they appear as gaps downstream too, and are counted in
  :attr:`PublisherStats.frames_dropped_local`.
* Nobody listening: a frame whose topic matches no current subscription is sequenced (it
  consumes its stream and topic sequence numbers, as a frame ZeroMQ filters out would) but
  neither encoded nor handed to ZeroMQ, so publishing costs little while no subscriber is
  connected. The publisher knows the subscriptions from the XPUB socket: with ``XPUB_VERBOSE``
  every subscribe message arrives, and an unsubscribe arrives when the last subscriber of that
  prefix leaves (or disconnects). Counted in :attr:`PublisherStats.frames_unsubscribed`.
* Heartbeats: every ``heartbeat_s`` a :class:`~zeus_async.events.Heartbeat` frame reports how
  many frames and events were sequenced before it (so ``frames_published`` equals the
  heartbeat's own stream sequence number). On shutdown the pending batches are flushed and a
  final heartbeat with the ``FINAL`` header flag is sent.
* Hostile subscribers: the socket task shares the event loop with the samplers, so its work
  per turn is bounded: it handles at most :data:`SUBSCRIPTION_BATCH` subscription messages,
  then sends what is due and yields (a flood of 300,000 subscriptions used to hold the loop,
  and sampling, for over a second). ZeroMQ takes subscription messages off the connections
  (and into its own table, about 190 bytes per distinct prefix) whenever the socket is used;
  with a small receive high-water mark and ``recv()`` (not ``ZMQ_EVENTS``) per message, it
  takes them roughly as fast as this task handles them. The limits themselves are those of
  :mod:`._subscriptions` (shared with the proxy's downstream socket): a message longer than
  4,096 bytes drops its connection, and a connection that would hold more than
  ``max_topics_per_connection`` distinct prefixes, or push the total past ``max_topics`` (then
  the connection holding the most goes), is disconnected, which makes ZeroMQ forget its
  subscriptions. So the memory held for subscriptions is bounded; counted in
  :attr:`PublisherStats.connections_dropped` and ``subscriptions_refused``. A client that
  reconnects and floods again is dropped again, and costs a bounded share of the loop.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import zmq
from anyio.abc import TaskStatus

from .._threads import run_sync
from ..clock import Clock, RealClock
from ..errors import CodecError, ConfigError
from ..events import Event, GpuSample, Heartbeat, StreamInfo, event_topic
from ._endpoints import check_bind_endpoint, default_endpoint, is_local_endpoint
from ._sockets import last_endpoint, poll_in, socket_fd
from ._subscriptions import SUBSCRIPTION_BATCH, SubscriptionLimits, limit_intake
from .codec import FLAG_FINAL, FrameEncoder, parse_stream_id
from .curve import CurveServerKeys, apply_server_keys, start_authenticator

__all__ = ["Publisher", "PublisherStats"]

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 5.0


#: How long a closing publisher with subscribers keeps re-sending its FINAL frame, and how
#: often (see ``Publisher._send_final``).
FINAL_WAIT_S = 0.5
FINAL_GAP_S = 0.05


@dataclass
class PublisherStats:
    """Counters of one :class:`Publisher`.

    Attributes:
        frames_sent: Frames handed to ZeroMQ (data, stream info and heartbeats).
        events_sent: Events in those frames.
        frames_dropped_local: Frames sequenced but never handed to ZeroMQ (pending overflow,
            unencodable events, send errors); subscribers see them as gaps.
        events_dropped_local: Events in those frames, plus events published after shutdown.
        subscriptions: Subscribe messages received (each subscriber sends one per topic prefix).
        unsubscriptions: Unsubscribe messages received.
        stream_infos_sent: StreamInfo frames sent (readiness handshakes).
        heartbeats_sent: Heartbeat frames sent.
        foreign_stream_events: StreamInfo and Heartbeat events of *other* streams handed to
            :meth:`publish` (a replayed recording's) and not sent: a stream describes itself.
        frames_unsubscribed: Frames sequenced but not sent because no subscription matched
            their topic (not losses: no subscriber was there to receive them).
        events_unsubscribed: Events in those frames.
        subscriptions_refused: Subscribe messages not taken into account: past a connection's
            or the total cap of topic prefixes, or from a connection dropped for that.
        connections_dropped: Connections disconnected for holding too many topic prefixes.
    """

    frames_sent: int = 0
    events_sent: int = 0
    frames_dropped_local: int = 0
    events_dropped_local: int = 0
    subscriptions: int = 0
    unsubscriptions: int = 0
    stream_infos_sent: int = 0
    heartbeats_sent: int = 0
    foreign_stream_events: int = 0
    frames_unsubscribed: int = 0
    events_unsubscribed: int = 0
    subscriptions_refused: int = 0
    connections_dropped: int = 0


class Publisher:
    """Publishes events on a ZeroMQ XPUB socket, batched per topic, with sequence numbers.

    Args:
        endpoint: Where to bind. Defaults to an ipc socket in a private per-user directory
            (:func:`default_endpoint`). ``tcp://127.0.0.1:*`` (or ``:0``) binds a random port;
            read the result from :attr:`endpoint` once bound. Endpoints reachable from other hosts
            (``tcp://*:port``, a non-loopback address) log a warning without CURVE.
        host: Host id, stamped on the stream's StreamInfo and Heartbeat events (no ``/``).
        stream_id: UUID of this stream; a fresh ``uuid4`` by default. Give a new id to every
            publisher instance: subscribers track sequence numbers per stream id.
        stream_info: Description of the stream sent on each new subscription (same ``host``);
            its ``stream_id`` is replaced by this publisher's. Defaults to host, pid and argv.
        curve: Server keys to make the socket a CURVE server.
        require_curve: Refuse (``ConfigError``) to bind an endpoint reachable from other hosts
            without CURVE.
        max_batch_events: Flush a topic's batch when it holds this many events.
        flush_interval_s: Flush a batch at most this long after its first event, and at once if
            the topic sent no frame for this long (0: always at the next turn of the loop).
        heartbeat_s: Period of Heartbeat frames.
        sndhwm: ZeroMQ send high-water mark per subscriber, in frames.
        max_pending_events: Bound on the events of full batches waiting for the socket task
            (only reached when that task cannot run); beyond it the oldest full batches are
            dropped (counted, and visible as gaps downstream). Open batches are bounded by
            ``max_batch_events`` each.
        linger_s: How long closing the socket may wait to deliver queued frames.
        max_topics_per_connection: Distinct topic prefixes one connection may subscribe to;
            one more disconnects it (ZeroMQ then forgets its subscriptions).
        max_topics: Distinct prefixes of all connections together (summed per connection);
            past it the connection holding the most is disconnected.
        context: ZeroMQ context to use; by default the publisher creates (and terminates) its
            own, which also hosts its CURVE authenticator.
        clock: Source of wall-clock stamps for StreamInfo and Heartbeat.

    Raises:
        ConfigError: Invalid argument.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        host: str,
        stream_id: str | None = None,
        stream_info: StreamInfo | None = None,
        curve: CurveServerKeys | None = None,
        require_curve: bool = False,
        max_batch_events: int = 1024,
        flush_interval_s: float = 0.001,
        heartbeat_s: float = 1.0,
        sndhwm: int = 10_000,
        max_pending_events: int = 100_000,
        linger_s: float = 0.25,
        max_topics_per_connection: int = 4096,
        max_topics: int = 65536,
        context: zmq.Context[Any] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not host or "/" in host:
            raise ConfigError(f"host must be non-empty and contain no '/', got {host!r}")
        if max_batch_events < 1:
            raise ConfigError("max_batch_events must be >= 1")
        if not (flush_interval_s >= 0 and math.isfinite(flush_interval_s)):
            raise ConfigError("flush_interval_s must be a finite number >= 0")
        if not (heartbeat_s > 0 and math.isfinite(heartbeat_s)):
            raise ConfigError("heartbeat_s must be a finite number > 0")
        if sndhwm < 0:
            raise ConfigError("sndhwm must be >= 0")
        if max_pending_events < max_batch_events:
            raise ConfigError("max_pending_events must be >= max_batch_events")
        if linger_s < 0:
            raise ConfigError("linger_s must be >= 0")
        self._endpoint = endpoint if endpoint is not None else default_endpoint()
        is_local_endpoint(self._endpoint)  # a malformed endpoint fails here, not in run()
        self._host = host
        self._clock: Clock = clock if clock is not None else RealClock()
        sid = parse_stream_id(stream_id) if stream_id is not None else None
        self._encoder = FrameEncoder(sid if sid is not None else str(uuid.uuid4()))
        self._stream_id = self._encoder.stream_id
        if stream_info is None:
            stream_info = StreamInfo(
                host=host,
                t_ns=self._clock.wall_ns(),
                stream_id=self._stream_id,
                pid=os.getpid(),
                argv=list(sys.argv),
            )
        if stream_info.host != host:
            raise ConfigError(f"stream_info.host {stream_info.host!r} differs from host {host!r}")
        self._stream_info = msgspec.structs.replace(stream_info, stream_id=self._stream_id)
        self._stream_topic = event_topic(self._stream_info)
        self._stream_topic_b = self._stream_topic.encode()
        self._curve = curve
        self._require_curve = require_curve
        self._max_batch = max_batch_events
        self._interval = flush_interval_s
        self._heartbeat_s = heartbeat_s
        self._sndhwm = sndhwm
        self._max_pending = max_pending_events
        self._linger_ms = round(linger_s * 1000)
        self._context = context
        self.stats = PublisherStats()
        self._limits = SubscriptionLimits(
            max_per_connection=max_topics_per_connection,
            max_total=max_topics,
            stats=self.stats,
            name=f"publisher {self._stream_id}",
        )

        # Batching state (touched by publish() and the socket task, both on the loop thread).
        self._open: dict[str, list[Event]] = {}  # topic -> its open batch
        self._open_t: dict[str, float] = {}  # topic -> time.monotonic() deadline of its batch
        self._last_sent: dict[str, float] = {}  # topic -> time.monotonic() of its last frame
        self._wait_until = -math.inf  # deadline of the socket task's sleep (-inf: not asleep)
        self._gpu_topics: dict[str, dict[int, str]] = {}  # host -> gpu -> topic
        self._ready: deque[tuple[str, list[Event]]] = deque()
        self._ready_events = 0  # events in self._ready
        self._info_due = False
        # Topic prefixes subscribed to now, and per topic whether one of them matches it.
        self._subscribed: set[bytes] = set()
        self._wanted: dict[str, bool] = {}
        self._budget = SUBSCRIPTION_BATCH  # what is left of this turn's subscription budget
        self._wake_pending = False
        self._wait_scope: anyio.CancelScope | None = None
        self._started = False
        self._closed = False
        self._closed_drop_logged = False
        self._sock: zmq.Socket[Any] | None = None
        self._last_drop_log = -math.inf
        self._drops_unlogged = 0

    # ------------------------------------------------------------------ properties

    @property
    def endpoint(self) -> str:
        """The endpoint: as configured before binding, the resolved one (real port) after."""
        return self._endpoint

    @property
    def stream_id(self) -> str:
        """This stream's UUID (canonical text)."""
        return self._stream_id

    @property
    def host(self) -> str:
        """Host id of the stream."""
        return self._host

    @property
    def stream_topic(self) -> str:
        """Topic of the stream's StreamInfo and Heartbeat frames (``stream/<host>``)."""
        return self._stream_topic

    @property
    def pending_events(self) -> int:
        """Events queued here (open and full batches) that the socket task has not sent yet."""
        return self._ready_events + sum(len(batch) for batch in self._open.values())

    @property
    def stream_info(self) -> StreamInfo:
        """The StreamInfo sent on each new subscription."""
        return self._stream_info

    # ------------------------------------------------------------------ producer side

    def publish(self, event: Event) -> None:
        """Queue one event for sending. Never blocks, never raises for a bus condition.

        Call from the event loop thread (not thread-safe).
        """
        self.publish_many((event,))

    def publish_many(self, events: Iterable[Event]) -> None:
        """Queue many events; same semantics as :meth:`publish`, less overhead per event.

        The hot path of the bus: per event it only computes the topic (cached for GPU
        samples) and appends to that topic's open batch; a full batch moves to the ready queue
        of the socket task.
        """
        if self._closed:
            self._drop_closed(sum(1 for _ in events))
            return
        open_ = self._open
        open_t = self._open_t
        ready = self._ready
        max_batch = self._max_batch
        gpu_topics = self._gpu_topics
        wake = False
        for event in events:
            if type(event) is GpuSample:
                try:
                    topic = gpu_topics[event.host][event.gpu]
                except KeyError:
                    topic = self._gpu_topic(event)
            else:
                if type(event) in (StreamInfo, Heartbeat):
                    # Another stream's description or liveness (a replayed recording, a
                    # relay): inside this stream it would lie about whose frames these are.
                    # This publisher sends its own.
                    assert isinstance(event, (StreamInfo, Heartbeat))
                    if event.stream_id != self._stream_id:
                        self.stats.foreign_stream_events += 1
                        continue
                topic = event_topic(event)
            batch = open_.get(topic)
            if batch is not None:
                batch.append(event)
                if len(batch) < max_batch:
                    continue
                del open_[topic]
                del open_t[topic]
            else:
                batch = [event]
                if max_batch > 1:
                    now = time.monotonic()
                    deadline = self._last_sent.get(topic, -math.inf) + self._interval
                    if deadline < now:
                        deadline = now
                    open_[topic] = batch
                    open_t[topic] = deadline
                    if deadline < self._wait_until:
                        wake = True  # the socket task sleeps past this batch's deadline
                    continue
            ready.append((topic, batch))
            self._ready_events += len(batch)
            if self._ready_events > self._max_pending:
                self._shed()
            wake = True
        if wake:
            self._wake()

    def _gpu_topic(self, event: GpuSample) -> str:
        topic = event_topic(event)
        if len(self._gpu_topics) > 4096:
            self._gpu_topics.clear()
        self._gpu_topics.setdefault(event.host, {})[event.gpu] = topic
        return topic

    def update_stream_info(self, info: StreamInfo) -> None:
        """Replace the stream description (its ``stream_id`` is forced to this stream's) and
        send it to the current subscribers.

        Raises:
            ConfigError: ``info.host`` is not this publisher's host.
        """
        if info.host != self._host:
            raise ConfigError(f"stream_info.host {info.host!r} differs from host {self._host!r}")
        self._stream_info = msgspec.structs.replace(info, stream_id=self._stream_id)
        self._info_due = True
        self._wake()

    def _wake(self) -> None:
        self._wake_pending = True
        scope = self._wait_scope
        if scope is not None:
            self._wait_scope = None
            self._wait_until = -math.inf
            scope.cancel()

    def _drop_closed(self, n: int) -> None:
        if not self._closed_drop_logged:
            self._closed_drop_logged = True
            logger.warning(
                "publisher %s is closed: dropping events published after shutdown", self._stream_id
            )
        self.stats.events_dropped_local += n

    def _shed(self) -> None:
        """Drop the oldest ready batches until the ready queue is within the bound."""
        while self._ready_events > self._max_pending and self._ready:
            topic, events = self._ready.popleft()
            self._ready_events -= len(events)
            self._encoder.skip(topic, len(events))
            self._count_drop(len(events), "ready events exceed max_pending_events")

    def _count_drop(self, events: int, why: str) -> None:
        self.stats.frames_dropped_local += 1
        self.stats.events_dropped_local += events
        self._drops_unlogged += 1
        now = time.monotonic()
        if now - self._last_drop_log >= _LOG_INTERVAL_S:
            logger.warning(
                "publisher %s dropped %d frame(s) locally (%s); %d in total",
                self._stream_id,
                self._drops_unlogged,
                why,
                self.stats.frames_dropped_local,
            )
            self._last_drop_log = now
            self._drops_unlogged = 0

    # ------------------------------------------------------------------ socket task

    async def run(self, *, task_status: TaskStatus[Publisher] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, report readiness, and serve the socket until cancelled.

        Use ``publisher = await task_group.start(publisher.run)``. On cancellation the pending
        batches are flushed, a final heartbeat (``FINAL`` flag) is sent and the socket is closed
        with the configured linger.

        Raises:
            ConfigError: Bad or insecure endpoint, bind failure, or ``run`` called twice.
        """
        if self._started:
            raise ConfigError("Publisher.run() can only be called once")
        self._started = True
        check_bind_endpoint(
            self._endpoint,
            curve=self._curve is not None,
            require_curve=self._require_curve,
            what="publisher",
        )
        own_context = self._context is None
        ctx: zmq.Context[Any] = zmq.Context() if self._context is None else self._context
        auth = None
        sock: zmq.Socket[Any] = ctx.socket(zmq.XPUB, socket_class=zmq.Socket)
        bound = False
        try:
            sock.setsockopt(zmq.LINGER, self._linger_ms)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
            limit_intake(sock)
            if self._curve is not None:
                auth = start_authenticator(ctx, self._curve)
                apply_server_keys(sock, self._curve)
            try:
                sock.bind(self._endpoint)
            except zmq.ZMQError as exc:
                raise ConfigError(f"publisher cannot bind {self._endpoint!r}: {exc}") from exc
            bound = True
            self._endpoint = self._limits.endpoint = last_endpoint(sock)
            self._sock = sock
            logger.info("publisher %s bound to %s", self._stream_id, self._endpoint)
            task_status.started(self)
            await self._serve(sock)
        finally:
            self._closed = True
            self._wait_scope = None
            if bound:
                self._final_flush()
            self._sock = None
            sock.close(linger=self._linger_ms)
            if auth is not None:
                auth.stop()
            if own_context:
                with anyio.CancelScope(shield=True):
                    await run_sync(ctx.term)  # on this thread at interpreter exit

    async def _serve(self, sock: zmq.Socket[Any]) -> None:
        fd = socket_fd(sock)
        next_heartbeat = time.monotonic() + self._heartbeat_s
        while True:
            self._wake_pending = False
            self._budget = SUBSCRIPTION_BATCH
            now = time.monotonic()
            self._service(sock, now)
            if now >= next_heartbeat:
                self._send_heartbeat(sock)
                self._limits.forget_closed()
                next_heartbeat = now + self._heartbeat_s
            # Unless the turn's budget ran out (subscriptions still queued: come back after the
            # other tasks had a turn), the last socket call read ZMQ_EVENTS without POLLIN, so
            # the edge-triggered ZMQ_FD will signal the next subscription message.
            more = self._drain_subscriptions(sock)
            if more or self._wake_pending or self._ready or self._info_due:
                await anyio.lowlevel.checkpoint()
                continue
            due = next_heartbeat
            if self._open:
                due = min(due, min(self._open_t.values()))
            delay = due - time.monotonic()
            if delay <= 0:
                await anyio.lowlevel.checkpoint()
                continue
            with anyio.CancelScope(deadline=anyio.current_time() + delay) as scope:
                self._wait_scope = scope
                self._wait_until = due
                await anyio.wait_readable(fd)
            self._wait_scope = None
            self._wait_until = -math.inf

    def _service(self, sock: zmq.Socket[Any], now: float) -> None:
        """Handle subscriptions, then send ready batches and batches whose timer expired."""
        self._drain_subscriptions(sock)
        ready = self._ready
        while ready:
            topic, events = ready.popleft()
            self._ready_events -= len(events)
            self._send(sock, topic, events)
        if self._open:
            open_, open_t = self._open, self._open_t
            for topic, deadline in list(open_t.items()):
                if deadline <= now:
                    events = open_.pop(topic)
                    del open_t[topic]
                    self._send(sock, topic, events)

    def _drain_subscriptions(self, sock: zmq.Socket[Any]) -> bool:
        """Read queued (un)subscriptions, within the turn's budget; send StreamInfo if a new one
        covers it.

        Returns ``True`` when the budget ran out with messages still queued (the caller must
        yield and call again, not wait on ``ZMQ_FD``); otherwise returns after reading
        ``ZMQ_EVENTS`` without ``POLLIN``, so the edge-triggered ``ZMQ_FD`` will signal the
        next subscription message.
        """
        while True:
            # recv() until EAGAIN, not poll_in() before each: reading ZMQ_EVENTS makes ZeroMQ
            # take more messages off the connections every time, recv() every 100 messages.
            while True:
                if self._budget <= 0:
                    self._send_info_if_due(sock)  # a flood must not hold back the handshake
                    return True
                try:
                    frame = sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    if poll_in(sock):  # arrived meanwhile
                        continue
                    break
                except zmq.ZMQError as exc:  # pragma: no cover - defensive
                    logger.warning("publisher %s: recv failed: %s", self._stream_id, exc)
                    return False
                self._budget -= 1
                self._on_subscription(frame)
            if not self._send_info_if_due(sock):
                return False
            # The send may have consumed the FD edge of a newly arrived subscription: look again.

    def _send_info_if_due(self, sock: zmq.Socket[Any]) -> bool:
        if not self._info_due:
            return False
        self._info_due = False
        self._send(sock, self._stream_topic, [self._stream_info])
        self.stats.stream_infos_sent += 1
        return True

    def _on_subscription(self, frame: zmq.Frame) -> None:
        msg = frame.bytes
        if msg[:1] == b"\x01":
            self.stats.subscriptions += 1
            prefix = msg[1:]
            if not self._limits.subscribe(frame, prefix):
                return
            if prefix not in self._subscribed:
                self._subscribed.add(prefix)
                self._wanted.clear()
            if self._stream_topic_b.startswith(prefix):
                self._info_due = True
        elif msg[:1] == b"\x00":
            self.stats.unsubscriptions += 1
            prefix = msg[1:]
            # ZeroMQ reports an unsubscribe once the last subscriber of the prefix left.
            self._limits.unsubscribed(prefix)
            if prefix in self._subscribed:
                self._subscribed.discard(prefix)
                self._wanted.clear()

    def _is_wanted(self, topic: str) -> bool:
        """Whether a current subscription matches ``topic`` (one of its prefixes is one)."""
        wanted = self._wanted.get(topic)
        if wanted is None:
            if len(self._wanted) > 4096:
                self._wanted.clear()
            topic_b = topic.encode()
            subscribed = self._subscribed
            wanted = self._wanted[topic] = any(
                topic_b[:i] in subscribed for i in range(len(topic_b) + 1)
            )
        return wanted

    def _send(self, sock: zmq.Socket[Any], topic: str, events: list[Event], flags: int = 0) -> None:
        if not self._is_wanted(topic):
            self._encoder.skip(topic, len(events))
            self.stats.frames_unsubscribed += 1
            self.stats.events_unsubscribed += len(events)
            self._sent_now(topic)
            return
        try:
            topic_b, header, payload = self._encoder.encode(topic, events, flags=flags)
        except CodecError as exc:
            logger.error(
                "publisher %s cannot encode a frame of %s: %s", self._stream_id, topic, exc
            )
            self._encoder.skip(topic, len(events))
            self._count_drop(len(events), "unencodable event")
            return
        try:
            sock.send(topic_b, zmq.SNDMORE | zmq.NOBLOCK)
            sock.send(header, zmq.SNDMORE | zmq.NOBLOCK)
            sock.send(payload, zmq.NOBLOCK, copy=len(payload) < 65536)
        except zmq.Again:
            self._count_drop(len(events), "socket would block")
            return
        except zmq.ZMQError as exc:
            self._count_drop(len(events), f"send failed: {exc}")
            return
        self.stats.frames_sent += 1
        self.stats.events_sent += len(events)
        self._sent_now(topic)

    def _sent_now(self, topic: str) -> None:
        """Note that ``topic`` sent a frame now (its next batch is timed from here)."""
        last_sent = self._last_sent
        if len(last_sent) > 4096:  # forget quiet topics (their next batch is due at once anyway)
            horizon = time.monotonic() - self._interval
            for t in [t for t, ts in last_sent.items() if ts < horizon]:
                del last_sent[t]
        last_sent[topic] = time.monotonic()

    def _heartbeat(self, *, final: bool = False) -> Heartbeat:
        return Heartbeat(
            host=self._host,
            t_ns=self._clock.wall_ns(),
            stream_id=self._stream_id,
            events_published=self._encoder.events,
            frames_published=self._encoder.seq,
            topic_frames=self._encoder.topic_counts() if final else None,
        )

    def _send_heartbeat(self, sock: zmq.Socket[Any], flags: int = 0) -> None:
        self._send(sock, self._stream_topic, [self._heartbeat()], flags)
        self.stats.heartbeats_sent += 1

    def _send_final(self, sock: zmq.Socket[Any]) -> None:
        """The FINAL heartbeat, then the same frame (same sequence number) again while
        subscribers are connected, every :data:`FINAL_GAP_S` for :data:`FINAL_WAIT_S`.

        A subscriber slower than the stream has a full queue when the publisher stops, and a
        PUB socket drops what does not fit: a single FINAL would be lost exactly when frames
        before it were, and the loss at the tail would go uncounted. A subscriber also loses
        what it has not read yet when the publisher's connection closes. The copies keep the
        stream open a little longer and land once the subscriber has read a little;
        subscribers take the first and ignore the copies. One further behind sees no FINAL and
        reports its tail as unknown (``docs/wire-format.md``).
        """
        parts = self._encoder.encode(
            self._stream_topic, [self._heartbeat(final=True)], flags=FLAG_FINAL
        )
        self.stats.heartbeats_sent += 1
        listening = self.stats.subscriptions > self.stats.unsubscriptions
        copies = round(FINAL_WAIT_S / FINAL_GAP_S) if listening else 0
        for attempt in range(1 + copies):
            if attempt:
                time.sleep(FINAL_GAP_S)
            try:
                sock.send_multipart(parts, zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if not attempt:
                self.stats.frames_sent += 1
                self.stats.events_sent += 1

    def _final_flush(self) -> None:
        """On shutdown: send everything pending, then the FINAL heartbeat."""
        sock = self._sock
        if sock is None:  # pragma: no cover - only called when bound
            return
        try:
            self._service(sock, math.inf)
            self._send_final(sock)
        except zmq.ZMQError as exc:  # pragma: no cover - defensive
            logger.warning("publisher %s: final flush failed: %s", self._stream_id, exc)
        logger.info(
            "publisher %s closed: %d frames / %d events sent, %d frames dropped locally",
            self._stream_id,
            self.stats.frames_sent,
            self.stats.events_sent,
            self.stats.frames_dropped_local,
        )
