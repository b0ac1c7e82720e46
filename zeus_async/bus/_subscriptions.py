"""Limits on what the subscribers of an XPUB socket can make it hold, shared by the publisher and
the proxy's downstream socket.

A subscriber sends one message per topic prefix, and ZeroMQ keeps every prefix in a table (about
190 bytes each); the process reading the messages keeps its own view. A client sending 300,000
subscriptions would make both grow without bound, and, through a proxy, make every publisher
behind it hold them too. So:

* :func:`limit_intake` keeps the socket's receive high-water mark small (a flood stays in the
  flooder's buffers, not in this process) and drops the connection of a message longer than
  :data:`MAX_SUBSCRIPTION_BYTES` (``ZMQ_MAXMSGSIZE``); the reader handles at most
  :data:`SUBSCRIPTION_BATCH` messages per turn of its loop.
* :class:`SubscriptionLimits` counts, per connection, its distinct prefixes. ZeroMQ gives each
  message the file descriptor of the connection it came on (``ZMQ_SRCFD``); the descriptor and
  the socket's inode identify a connection (descriptors are reused, inodes are not). A connection
  that would hold more than ``max_per_connection``, or push the total past ``max_total`` (then
  the connection holding the most goes), is disconnected: ``shutdown`` of a duplicate of its
  descriptor, after checking it is still a connection of this socket, and ZeroMQ forgets its
  subscriptions. A ``SUB`` socket reconnects and subscribes again by itself; one that floods
  again is dropped again.
* Unsubscribes carry no descriptor. With ``ZMQ_XPUB_VERBOSE`` ZeroMQ reports one when the last
  connection holding the prefix unsubscribed or left, so :meth:`SubscriptionLimits.unsubscribed`
  discounts the prefix from every connection still counted with it (a connection that
  unsubscribed while another held the prefix stays counted with it until then).

Connections without a descriptor (``inproc://``: this process's own code) are not counted. A
descriptor closed and reused by another connection of the socket between ZeroMQ reading a
message and the limiter handling it would charge the message to the new connection: at worst
that one is dropped too (and reconnects).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from ..errors import ConfigError

__all__ = [
    "MAX_SUBSCRIPTION_BYTES",
    "SUBSCRIPTION_BATCH",
    "SUBSCRIPTION_RCVHWM",
    "SubscriptionLimits",
    "limit_intake",
]

logger = logging.getLogger(__name__)

#: Subscription messages a socket's owner handles per turn of its loop, at most, before it turns
#: to its other work (sending frames, the samplers sharing its event loop).
SUBSCRIPTION_BATCH = 256
#: Receive high-water mark of an XPUB socket (subscription messages per connection queued inside
#: ZeroMQ): small, so a flood stays in the flooder's buffers, not in this process.
SUBSCRIPTION_RCVHWM = 16
#: Longest subscription message accepted (``0x01`` + the prefix); ZeroMQ drops the connection of
#: a longer one.
MAX_SUBSCRIPTION_BYTES = 4096

_LOG_INTERVAL_S = 5.0

#: A connection: its file descriptor and the socket's inode (fds are reused, inodes are not).
_Conn = tuple[int, int]


class LimitStats(Protocol):
    """The counters a :class:`SubscriptionLimits` keeps (on the owner's stats object)."""

    subscriptions_refused: int
    connections_dropped: int


def limit_intake(sock: zmq.Socket[Any]) -> None:
    """Small receive high-water mark and longest subscription message on an XPUB socket."""
    sock.setsockopt(zmq.RCVHWM, SUBSCRIPTION_RCVHWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)


class SubscriptionLimits:
    """Counts the distinct topic prefixes of each connection of one XPUB socket and disconnects
    the connections past the caps.

    Args:
        max_per_connection: Distinct prefixes one connection may hold; one more disconnects it.
        max_total: Distinct prefixes of all connections together (summed per connection); past
            it the connection holding the most is disconnected.
        stats: Where to count refused subscriptions and dropped connections.
        name: Who owns the socket, for the log (``publisher <id>``, ``proxy``).

    Attributes:
        endpoint: The socket's bound endpoint (set once bound): a descriptor is shut down only
            if its local address is this endpoint.
        on_orphaned: Called with each prefix no counted connection holds any more because its
            last holder was disconnected or closed (the proxy unsubscribes it upstream).

    Raises:
        ConfigError: A cap below 1.
    """

    def __init__(
        self,
        *,
        max_per_connection: int,
        max_total: int,
        stats: LimitStats,
        name: str,
    ) -> None:
        if max_per_connection < 1 or max_total < 1:
            raise ConfigError("max_topics_per_connection and max_topics must be >= 1")
        self.endpoint = ""
        self.on_orphaned: Callable[[bytes], None] | None = None
        self._max_conn = max_per_connection
        self._max_total = max_total
        self._stats = stats
        self._name = name
        # Per connection its distinct prefixes, per prefix the connections counted with it, the
        # sum of the former, and the connections dropped (until their descriptor is closed).
        self._conns: dict[_Conn, set[bytes]] = {}
        self._holders: dict[bytes, list[_Conn]] = {}
        self._total = 0
        self._dropped: set[_Conn] = set()
        self._last_log = -math.inf

    @property
    def total(self) -> int:
        """Distinct prefixes counted, summed over the connections."""
        return self._total

    def subscribe(self, frame: zmq.Frame, prefix: bytes) -> bool:
        """Count ``prefix`` against the connection ``frame`` came on and the total.

        Returns ``False`` if refused (counted in ``subscriptions_refused``): the connection was,
        or is now, dropped.
        """
        conn = _conn_of(frame)
        if conn is None:
            return True  # this process's own sockets
        if conn is False or conn in self._dropped:
            self._stats.subscriptions_refused += 1
            return False
        assert isinstance(conn, tuple)
        topics = self._conns.setdefault(conn, set())
        if prefix in topics:
            return True
        if len(topics) >= self._max_conn:
            self._drop(conn, f"more than {self._max_conn} topic prefixes")
            self._stats.subscriptions_refused += 1
            return False
        if self._total >= self._max_total:
            self.forget_closed()
        if self._total >= self._max_total:
            top = max(self._conns, key=lambda c: len(self._conns[c]))
            self._drop(top, f"the most of {self._max_total} topic prefixes in total")
            if top == conn:
                self._stats.subscriptions_refused += 1
                return False
        topics = self._conns.setdefault(conn, topics)
        topics.add(prefix)
        self._holders.setdefault(prefix, []).append(conn)
        self._total += 1
        return True

    def unsubscribed(self, prefix: bytes) -> None:
        """ZeroMQ reported ``prefix`` unsubscribed: no connection holds it any more."""
        for conn in self._holders.pop(prefix, ()):
            self._conns[conn].discard(prefix)
            self._total -= 1

    def forget_closed(self) -> None:
        """Stop counting connections whose descriptor was closed (or now is another socket)."""
        for conn in [c for c in self._conns if not _is_open(c)]:
            self._release(conn)
        self._dropped = {c for c in self._dropped if _is_open(c)}

    def _release(self, conn: _Conn) -> None:
        """Stop counting ``conn``; report the prefixes it was the last to hold."""
        topics = self._conns.pop(conn, set())
        self._total -= len(topics)
        for prefix in topics:
            holders = self._holders[prefix]
            holders.remove(conn)
            if not holders:
                del self._holders[prefix]
                if self.on_orphaned is not None:
                    self.on_orphaned(prefix)

    def _drop(self, conn: _Conn, why: str) -> None:
        """Disconnect ``conn`` (ZeroMQ then forgets its subscriptions) and stop counting it."""
        self._release(conn)
        self._dropped.add(conn)
        fd, inode = conn
        try:
            if os.fstat(fd).st_ino != inode:
                return  # closed meanwhile: ZeroMQ has already forgotten it
            with socket.socket(fileno=os.dup(fd)) as peer:
                if not self._is_our_end(peer.getsockname()):  # pragma: no cover - defensive
                    return
                peer.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        self._stats.connections_dropped += 1
        now = time.monotonic()
        if now - self._last_log >= _LOG_INTERVAL_S:
            self._last_log = now
            logger.warning(
                "%s on %s dropped a subscriber connection: %s (%d dropped so far)",
                self._name,
                self.endpoint,
                why,
                self._stats.connections_dropped,
            )

    def _is_our_end(self, name: Any) -> bool:
        """Whether ``name`` (a connection's local address) is the socket's endpoint."""
        scheme, _, where = self.endpoint.partition("://")
        if scheme == "tcp" and isinstance(name, tuple):
            return str(name[1]) == where.rpartition(":")[2]
        if scheme == "ipc":
            if isinstance(name, bytes):  # an abstract socket: b"\0name" for "ipc://@name"
                return name == b"\0" + where[1:].encode()
            return bool(name == where)
        return False  # pragma: no cover - only tcp and ipc connections carry a descriptor


def _conn_of(frame: zmq.Frame) -> _Conn | bool | None:
    """The connection ``frame`` came on; ``None`` when ZeroMQ gave no descriptor (``inproc://``,
    an unsubscribe); ``False`` when the descriptor is no longer a socket (closed since)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (fd, st.st_ino) if stat.S_ISSOCK(st.st_mode) else False


def _is_open(conn: _Conn) -> bool:
    try:
        return os.fstat(conn[0]).st_ino == conn[1]
    except OSError:
        return False
