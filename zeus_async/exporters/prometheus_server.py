"""The HTTP server of ``PrometheusExporter.serve``, which hostile clients cannot hold up.

One selector thread owns every socket (accepts, reads requests without blocking, writes
answers), a few workers turn complete requests into responses in memory, and every client is
bounded: time to send its request, time to read the answer, request size, connections in all
and per peer, so slow, idle or numerous clients cannot delay a scrape
(``bench/hostile/bench_scrape_hostile.py``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import selectors
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

logger = logging.getLogger(__name__)


#: Threads answering requests, at most (a scrape takes a few ms: Prometheus needs one).
_WORKERS = 4
#: Seconds a connection has, from its accept, to send a complete request (headers), in all:
#: a client that trickles bytes is closed then, however often it sends.
_IDLE_TIMEOUT_S = 10.0
#: Seconds a response may take to be written out, in all (a client that does not read).
_WRITE_TIMEOUT_S = 10.0
#: Open connections, at most, in all and per peer address; a connection beyond closes the
#: oldest one still waiting for its request (or is closed itself when none is).
_MAX_CONNECTIONS = 512
_MAX_PER_PEER = 32
#: Longest request (request line and headers) read; a longer one is answered 431 and closed.
_MAX_REQUEST_BYTES = 16384

_READING, _WORKING, _WRITING = range(3)
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)


class _Conn:
    """One client connection of :class:`_Server`, and where its request stands."""

    __slots__ = ("address", "buf", "deadline", "out", "peer", "sock", "state")

    def __init__(self, sock: socket.socket, address: Any, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.peer = str(address[0]) if isinstance(address, tuple) else str(address)
        self.deadline = deadline
        self.state = _READING
        self.buf = bytearray()  # the request, as read so far
        self.out = memoryview(b"")  # the response, what is left to write


class _Server(WSGIServer):
    """A WSGI server that slow, idle or numerous clients cannot hold up.

    One thread owns every socket: it accepts connections, reads each request without
    blocking until its headers are complete, and writes each response without blocking; the
    pool of :data:`_WORKERS` threads only turns complete requests into responses (in
    memory), so no client can tie a worker up. Bounds, each closing the connection:

    * a request must be complete within ``idle_timeout_s`` of the accept, in all (a client
      trickling a byte every few seconds, "slowloris", is cut then), and a response written
      within ``write_timeout_s``;
    * a request longer than ``max_request_bytes`` is answered 431;
    * at most ``max_connections`` connections in all and ``max_per_peer`` per peer address:
      one more closes the oldest of them still waiting for its request (or is closed itself).

    So 2,000 idle clients or 64 trickling ones cost sockets and no thread, and a scrape is
    answered at once (prometheus_client's server keeps a thread per connection; ours before
    gave a connection to a worker at its first byte, and 8 trickling clients held all 4).
    """

    idle_timeout_s = _IDLE_TIMEOUT_S
    write_timeout_s = _WRITE_TIMEOUT_S
    max_connections = _MAX_CONNECTIONS
    max_per_peer = _MAX_PER_PEER
    max_request_bytes = _MAX_REQUEST_BYTES
    request_queue_size = _MAX_CONNECTIONS  # the listen backlog (socketserver's default is 5)

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.setblocking(False)  # accept until none is pending
        self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="zeus-prometheus-req")
        self._selector: selectors.BaseSelector = selectors.DefaultSelector()
        self._conns: dict[socket.socket, _Conn] = {}  # in the order accepted
        self._per_peer: dict[str, int] = {}
        # Responses made by the workers, for the selector thread to write; a byte on the
        # socket pair wakes it.
        self._done: deque[_Conn] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        #: Connections closed without a complete request: past the deadline, or to make room
        #: (figures for tests).
        self.idle_closed = 0
        #: Of those, closed to make room (or refused) under the connection caps.
        self.evicted = 0
        #: Requests longer than ``max_request_bytes``.
        self.oversized = 0

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        selector = self._selector
        selector.register(self.socket, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, events in selector.select(poll_interval):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._take_responses()
                    else:
                        conn = cast(_Conn, key.data)
                        if conn.sock not in self._conns:
                            continue  # closed earlier in this round
                        if events & selectors.EVENT_READ and conn.state == _READING:
                            self._read(conn)
                        elif events & selectors.EVENT_WRITE and conn.state == _WRITING:
                            self._write(conn)
                self._expire(time.monotonic())
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            selector.close()
            self._stopped.set()

    # -- connections (selector thread) -----------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self.get_request()
            except OSError:  # none pending (BlockingIOError), or a failed accept
                return
            sock.setblocking(False)
            self._admit(sock, address)

    def _admit(self, sock: socket.socket, address: Any) -> None:
        conn = _Conn(sock, address, time.monotonic() + self.idle_timeout_s)
        room = self._per_peer.get(conn.peer, 0) < self.max_per_peer or self._evict(conn.peer)
        room = room and (len(self._conns) < self.max_connections or self._evict(None))
        if not room:  # every connection is being answered: refuse this one
            self.evicted += 1
            self.idle_closed += 1
            self.shutdown_request(sock)
            return
        self._conns[sock] = conn
        self._per_peer[conn.peer] = self._per_peer.get(conn.peer, 0) + 1
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _evict(self, peer: str | None) -> bool:
        """Close the oldest connection still waiting for its request (of ``peer``, if given)."""
        for conn in self._conns.values():
            if conn.state == _READING and (peer is None or conn.peer == peer):
                self.evicted += 1
                self.idle_closed += 1
                self._close(conn)
                return True
        return False

    def _read(self, conn: _Conn) -> None:
        buf = conn.buf
        try:
            data = conn.sock.recv(self.max_request_bytes + 1 - len(buf))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client left (or failed)
            self._close(conn)
            return
        seen = max(0, len(buf) - 3)
        buf += data
        if buf.find(b"\r\n\r\n", seen) < 0 and buf.find(b"\n\n", seen) < 0:
            if len(buf) > self.max_request_bytes:
                self.oversized += 1
                with contextlib.suppress(OSError):
                    conn.sock.send(_TOO_LARGE)
                self._close(conn)
            return
        conn.state = _WORKING  # complete: a worker makes the response
        self._selector.unregister(conn.sock)
        self._pool.submit(self._respond, conn)

    def _take_responses(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        now = time.monotonic()
        while self._done:
            conn = self._done.popleft()
            if conn.sock not in self._conns:
                continue
            if not conn.out:
                self._close(conn)
                continue
            conn.state = _WRITING
            conn.deadline = now + self.write_timeout_s
            self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)
            self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline < now]:
            if conn.state == _READING:
                self.idle_closed += 1
                self._close(conn)
            elif conn.state == _WRITING:
                self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        left = self._per_peer[conn.peer] - 1
        if left:
            self._per_peer[conn.peer] = left
        else:
            del self._per_peer[conn.peer]
        if conn.state != _WORKING:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        self.shutdown_request(conn.sock)

    # -- responses (worker threads) --------------------------------------------------------------

    def _respond(self, conn: _Conn) -> None:
        """Run the WSGI app on a complete request; the selector thread writes the answer."""
        try:
            handler: _QuietHandler = cast(Any, self.RequestHandlerClass)(conn, conn.address, self)
            conn.out = memoryview(handler.response)
        except Exception:
            logger.debug("a metrics request failed", exc_info=True)
        self._done.append(conn)
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            self._wake_w.send(b"\0")

    def shutdown(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._stopped.wait(5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def server_close(self) -> None:
        super().server_close()
        if hasattr(self, "_wake_r"):  # activated (a failed bind closes before that)
            self._wake_r.close()
            self._wake_w.close()


class _QuietHandler(WSGIRequestHandler):
    """Answers a request read by :class:`_Server` (``request`` is its ``_Conn``) into memory,
    and does not log requests."""

    response = b""

    def setup(self) -> None:
        conn = cast(_Conn, self.request)
        self.connection = conn.sock
        self.rfile = io.BytesIO(bytes(conn.buf))
        self.wfile = io.BytesIO()

    def finish(self) -> None:
        self.response = cast(io.BytesIO, self.wfile).getvalue()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _best_family(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family to bind ``addr`` with (IPv6 for ``::``), and the address to bind."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return family, str(sockaddr[0])
