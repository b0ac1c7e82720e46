"""XSUB → XPUB forwarder: one endpoint that relays many node publishers to many subscribers.

The proxy connects an XSUB socket to every node publisher and binds an XPUB socket for the
subscribers. Frames travel downstream byte for byte (stream ids and sequence numbers are
preserved end to end, so a subscriber behind the proxy detects gaps exactly as if connected
directly). A frame the proxy drops (a slow downstream subscriber at its high-water mark) is a
gap in the sequence numbers like any other.

Subscriptions travel upstream, after the limits a publisher applies to its own subscribers
(:mod:`._subscriptions`): a client flooding the proxy with subscriptions is disconnected *at the
proxy*. Forwarded as they were (libzmq's ``zmq_proxy``), 300,000 subscriptions would reach
every publisher on the proxy's one connection, whose cap would then cut the proxy, and every
subscriber behind it, again after each reconnect (the XSUB resends what it holds). So:

* The XPUB socket is ``XPUB_VERBOSE``: the proxy sees every subscribe message, with the
  connection it came on. It counts each connection's distinct prefixes against
  ``max_topics_per_connection`` and ``max_topics`` in total (the connection holding the most
  going first), and forwards a prefix upstream the first time any connection takes it; upstream
  thus holds at most ``max_topics`` distinct prefixes (by default a publisher's cap per
  connection: a default publisher never cuts the proxy).
* A subscribe for a prefix already forwarded goes upstream again only if a publisher answers it
  with its StreamInfo (a prefix of ``stream/<host>``), at most once per prefix per turn of the
  loop: the readiness handshake works through the proxy for every subscriber, and a client
  repeating such a prefix sends the publishers one message per turn, not one per message.
* ZeroMQ reports an unsubscribe once the last downstream connection holding the prefix left; it
  goes upstream then. A prefix whose last holder the limits disconnected is unsubscribed
  upstream at once. Other messages from subscribers are not forwarded.

libzmq's proxy cannot filter subscriptions, so the forwarding loop is this module's, in a worker
thread: it polls both sockets, handles at most :data:`~._subscriptions.SUBSCRIPTION_BATCH`
subscription messages and :data:`FRAME_BATCH` frames per turn (a flood neither stops nor much
delays the frames), and is stopped through a control socket when the calling task is cancelled.
Counters are in :class:`ProxyStats`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import zmq
from anyio.abc import TaskStatus

from ..errors import ConfigError
from ._endpoints import check_bind_endpoint
from ._sockets import last_endpoint, poll_in
from ._subscriptions import SUBSCRIPTION_BATCH, SubscriptionLimits, limit_intake
from .curve import (
    CurveClientKeys,
    CurveServerKeys,
    apply_client_keys,
    apply_server_keys,
    start_authenticator,
)
from .subscriber import STREAM_TOPIC_PREFIX

__all__ = ["ProxyStats", "run_proxy"]

logger = logging.getLogger(__name__)

#: Frames (multipart messages) the loop forwards per turn, at most, before it looks at the
#: subscriptions and the control socket again.
FRAME_BATCH = 1024
#: How often the loop stops counting downstream connections that closed.
_SWEEP_S = 1.0

_STREAM_PREFIX = STREAM_TOPIC_PREFIX.encode()
# The sugar layer's ``Socket.send`` adds Python-level checks for DRAFT options on every call;
# skipping them makes forwarding a frame about a fifth cheaper.
_send = zmq.backend.Socket.send


@dataclass
class ProxyStats:
    """Counters of one :func:`run_proxy` (updated by its forwarding thread).

    Attributes:
        frames_forwarded: Frames (multipart messages) received upstream and sent downstream.
        subscriptions: Subscribe messages from downstream connections.
        unsubscriptions: Unsubscribe messages from the downstream socket (ZeroMQ reports one
            when the last connection holding the prefix unsubscribed or left).
        subscriptions_refused: Subscribe messages not forwarded because their connection was,
            or was then, disconnected for holding too many topic prefixes.
        connections_dropped: Downstream connections disconnected for that.
        upstream_subscribes: Subscribe messages sent upstream (new prefixes, and repeats of a
            prefix a publisher answers with its StreamInfo).
        upstream_unsubscribes: Prefixes unsubscribed upstream.
        upstream_topics: Distinct prefixes subscribed upstream now.
    """

    frames_forwarded: int = 0
    subscriptions: int = 0
    unsubscriptions: int = 0
    subscriptions_refused: int = 0
    connections_dropped: int = 0
    upstream_subscribes: int = 0
    upstream_unsubscribes: int = 0
    upstream_topics: int = 0


def _asks_stream_info(prefix: bytes) -> bool:
    """Whether a publisher answers a subscription to ``prefix`` with its StreamInfo: it is a
    prefix of some ``stream/<host>`` topic (a host has no ``/``)."""
    if len(prefix) <= len(_STREAM_PREFIX):
        return _STREAM_PREFIX.startswith(prefix)
    return prefix.startswith(_STREAM_PREFIX) and b"/" not in prefix[len(_STREAM_PREFIX) :]


class _Forwarder:
    """The proxy's loop, on its worker thread: frames downstream, limited and deduplicated
    subscriptions upstream."""

    def __init__(
        self,
        frontend: zmq.Socket[Any],
        backend: zmq.Socket[Any],
        control: zmq.Socket[Any],
        limits: SubscriptionLimits,
        stats: ProxyStats,
    ) -> None:
        self._frontend = frontend
        self._backend = backend
        self._control = control
        self._limits = limits
        self._stats = stats
        self._upstream: set[bytes] = set()  # the prefixes subscribed upstream

    # The counters change before the message leaves: whoever sees it upstream sees them too.

    def unsubscribe_upstream(self, prefix: bytes) -> None:
        """Unsubscribe ``prefix`` upstream, if it is subscribed there."""
        if prefix in self._upstream:
            self._upstream.discard(prefix)
            self._stats.upstream_unsubscribes += 1
            self._stats.upstream_topics = len(self._upstream)
            self._frontend.send(b"\x00" + prefix)

    def _subscribe_upstream(self, prefix: bytes) -> None:
        again = prefix in self._upstream
        self._upstream.add(prefix)
        self._stats.upstream_subscribes += 1
        self._stats.upstream_topics = len(self._upstream)
        self._frontend.send(b"\x01" + prefix)
        if again:
            # The XSUB counts the subscribes of a prefix and passes an unsubscribe upstream
            # only when the count falls to 0: this one brings it back to 1 and goes no further.
            self._frontend.send(b"\x00" + prefix)

    def run(self) -> None:
        """Forward until the control socket says stop."""
        frontend, backend, control = self._frontend, self._backend, self._control
        poller = zmq.Poller()
        for sock in (frontend, backend, control):
            poller.register(sock, zmq.POLLIN)
        busy = False
        sweep_at = time.monotonic() + _SWEEP_S
        while True:
            wait_ms = 0 if busy else max(0, round((sweep_at - time.monotonic()) * 1000))
            ready = [sock for sock, _ in poller.poll(wait_ms)]
            if control in ready:
                return
            busy = False
            if backend in ready:
                busy = self._subscriptions()
            if frontend in ready:
                busy = self._frames() or busy
            now = time.monotonic()
            if now >= sweep_at:
                self._limits.forget_closed()
                sweep_at = now + _SWEEP_S

    def _frames(self) -> bool:
        """Forward up to :data:`FRAME_BATCH` frames; ``True`` if more may be queued."""
        frontend, backend = self._frontend, self._backend
        recv = frontend.recv
        n = 0
        try:
            while n < FRAME_BATCH:
                # The poll said a frame is there. While a few frames came at a time, asking
                # ZeroMQ whether another is costs less than the EAGAIN of an empty queue.
                if 0 < n < 4 and not poll_in(frontend):
                    break
                part = recv(zmq.NOBLOCK, copy=False)
                # An XPUB never blocks a send (a subscriber at its high-water mark loses the
                # frame), and the other parts of a message arrive with its first.
                while part.more:
                    _send(backend, part, zmq.SNDMORE, copy=False)
                    part = recv(0, copy=False)
                _send(backend, part, 0, copy=False)
                n += 1
        except zmq.Again:
            pass
        self._stats.frames_forwarded += n
        return n == FRAME_BATCH

    def _subscriptions(self) -> bool:
        """Handle up to :data:`SUBSCRIPTION_BATCH` subscription messages; ``True`` if more may
        be queued."""
        recv = self._backend.recv
        limits, stats, upstream = self._limits, self._stats, self._upstream
        again: dict[bytes, None] = {}  # handshake repeats, sent once each after the batch
        more = True
        for _ in range(SUBSCRIPTION_BATCH):
            try:
                frame = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                more = False
                break
            msg = frame.bytes
            kind, prefix = msg[:1], msg[1:]
            if kind == b"\x01":
                stats.subscriptions += 1
                if not limits.subscribe(frame, prefix):
                    continue
                if prefix not in upstream:
                    self._subscribe_upstream(prefix)
                elif _asks_stream_info(prefix):
                    again[prefix] = None
            elif kind == b"\x00":
                stats.unsubscriptions += 1
                limits.unsubscribed(prefix)
                self.unsubscribe_upstream(prefix)
        for prefix in again:
            if prefix in upstream:
                self._subscribe_upstream(prefix)
        return more


async def run_proxy(
    in_endpoints: Sequence[str],
    out_endpoint: str,
    *,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    curve: CurveServerKeys | None = None,
    upstream_curve: CurveClientKeys | Mapping[str, CurveClientKeys] | None = None,
    require_curve: bool = False,
    hwm: int = 10_000,
    linger_s: float = 0.25,
    max_topics_per_connection: int = 4096,
    max_topics: int = 4096,
    stats: ProxyStats | None = None,
    context: zmq.Context[Any] | None = None,
) -> None:
    """Forward frames from node publishers to subscribers until cancelled.

    Use ``endpoint = await task_group.start(run_proxy, [...], "tcp://127.0.0.1:*")``: the
    task reports the resolved downstream endpoint once bound and connected.

    Args:
        in_endpoints: Publisher endpoints to connect to (upstream).
        out_endpoint: Endpoint to bind for subscribers (downstream); same security policy as
            the publisher's.
        task_status: Receives the resolved ``out_endpoint``.
        curve: Server keys for the downstream socket.
        upstream_curve: Client keys to connect to CURVE publishers: one set for all, or a
            mapping from endpoint to keys (endpoints absent from it connect without CURVE).
        require_curve: Refuse to bind a non-local ``out_endpoint`` without CURVE.
        hwm: High-water mark of both sockets, in frames.
        linger_s: Linger of both sockets on close.
        max_topics_per_connection: Distinct topic prefixes one downstream connection may
            subscribe to; one more disconnects it.
        max_topics: Distinct prefixes of all downstream connections together, and so at most
            upstream; past it the connection holding the most is disconnected. Keep it at most
            the publishers' ``max_topics_per_connection`` (both 4,096 by default), or a
            publisher disconnects the proxy when it is reached.
        stats: Counters to update (a fresh :class:`ProxyStats` if not given).
        context: ZeroMQ context; by default the proxy creates and terminates its own.

    Raises:
        ConfigError: No upstream endpoint, bad or insecure endpoint, bind/connect failure, a
            topic cap below 1.
    """
    if isinstance(in_endpoints, str):
        in_endpoints = [in_endpoints]
    if not in_endpoints:
        raise ConfigError("run_proxy needs at least one upstream endpoint")
    check_bind_endpoint(
        out_endpoint, curve=curve is not None, require_curve=require_curve, what="proxy"
    )
    stats = stats if stats is not None else ProxyStats()
    limits = SubscriptionLimits(
        max_per_connection=max_topics_per_connection,
        max_total=max_topics,
        stats=stats,
        name="proxy",
    )
    linger_ms = round(linger_s * 1000)
    own_context = context is None
    ctx: zmq.Context[Any] = zmq.Context() if context is None else context
    frontend: zmq.Socket[Any] = ctx.socket(zmq.XSUB, socket_class=zmq.Socket)
    backend: zmq.Socket[Any] = ctx.socket(zmq.XPUB, socket_class=zmq.Socket)
    control: zmq.Socket[Any] = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
    control_peer: zmq.Socket[Any] = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
    auth = None
    try:
        for s in (frontend, backend, control, control_peer):
            s.setsockopt(zmq.LINGER, linger_ms)
        frontend.setsockopt(zmq.RCVHWM, hwm)
        frontend.setsockopt(zmq.SNDHWM, hwm)  # subscriptions: at most max_topics, and repeats
        backend.setsockopt(zmq.SNDHWM, hwm)
        backend.setsockopt(zmq.XPUB_VERBOSE, 1)
        limit_intake(backend)
        if curve is not None:
            auth = start_authenticator(ctx, curve)
            apply_server_keys(backend, curve)
        try:
            backend.bind(out_endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"proxy cannot bind {out_endpoint!r}: {exc}") from exc
        resolved = limits.endpoint = last_endpoint(backend)
        plan = [
            (ep, upstream_curve.get(ep) if isinstance(upstream_curve, Mapping) else upstream_curve)
            for ep in in_endpoints
        ]
        # Each connect snapshots the socket's security options: plain connections first, then
        # each CURVE one with its own server key.
        plan.sort(key=lambda item: item[1] is not None)
        for ep, keys in plan:
            if keys is not None:
                apply_client_keys(frontend, keys)
            try:
                frontend.connect(ep)
            except zmq.ZMQError as exc:
                raise ConfigError(f"proxy cannot connect to {ep!r}: {exc}") from exc
        control_addr = f"inproc://zeus-async-proxy-{uuid.uuid4()}"
        control.bind(control_addr)
        control_peer.connect(control_addr)
        forwarder = _Forwarder(frontend, backend, control_peer, limits, stats)
        limits.on_orphaned = forwarder.unsubscribe_upstream

        def forward() -> None:
            # The sockets were created on the loop thread; starting and joining this thread are
            # the full memory barriers ZeroMQ requires to migrate them.
            try:
                forwarder.run()
            except zmq.ContextTerminated:  # pragma: no cover - context closed under us
                pass

        logger.info("proxy %s -> %s running", ", ".join(in_endpoints), resolved)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, forward)
            task_status.started(resolved)
            try:
                await anyio.sleep_forever()
            finally:
                # Stops the forwarding thread; the task group then waits for it to return.
                control.send(b"TERMINATE")
    finally:
        for s in (frontend, backend, control, control_peer):
            s.close(linger=linger_ms)
        if auth is not None:
            auth.stop()
        if own_context:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(ctx.term)
        logger.info("proxy to %s stopped", out_endpoint)
