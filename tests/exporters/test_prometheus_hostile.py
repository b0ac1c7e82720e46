"""The exporter's HTTP server under hostile clients, over real sockets: clients that trickle
their request a byte at a time ("slowloris"), never read their answer, send oversized
requests or open many connections cannot delay a scrape, and are closed by their deadline or
by the connection caps."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from zeus_async.events import GpuSample, ProcessSample
from zeus_async.exporters import PrometheusExporter, prometheus

H = "node1"
T0 = 1_763_000_000_000_000_000


def exporter_with(pids: int) -> PrometheusExporter:
    """8 GPUs, and ``pids`` processes on each (the body grows ~1 KiB per process and GPU)."""
    exporter = PrometheusExporter()
    exporter.add(GpuSample(H, T0, gpu, power_w=300.0 + gpu, energy_j=1e6) for gpu in range(8))
    exporter.add(
        ProcessSample(H, T0, pid, gpu=gpu, gpu_sm_frac=0.5, attributed_power_w=150.0)
        for gpu in range(8)
        for pid in range(pids)
    )
    return exporter


@pytest.fixture
def serving() -> Iterator[Callable[[int], tuple[PrometheusExporter, int]]]:
    """Serve an exporter with ``pids`` processes per GPU on a free port; closed after."""
    started: list[PrometheusExporter] = []

    def serve(pids: int = 1) -> tuple[PrometheusExporter, int]:
        exporter = exporter_with(pids)
        started.append(exporter)
        return exporter, exporter.serve(0)

    yield serve
    for exporter in started:
        exporter.close()


def scrape_s(port: int) -> float:
    """Seconds one scrape takes (asserting it is complete)."""
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body = resp.read()
    assert body.endswith(b"\n") and b'zeus_gpu_power_watts{gpu="7",host="node1"} 307.0' in body
    return time.monotonic() - started


def is_closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(65536) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def wait_closed(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def server_of(exporter: PrometheusExporter) -> prometheus._Server:
    server = exporter._server
    assert isinstance(server, prometheus._Server)
    return server


@pytest.mark.parametrize("slow", [8, 64])
def test_scrapes_answer_within_1s_while_slow_clients_trickle_and_they_are_cut_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
    serving: Callable[[int], tuple[PrometheusExporter, int]],
    slow: int,
) -> None:
    """Each slow client sends a byte of its request every 0.25 s. Before, the 10 s timeout was
    per read and a worker took the connection at its first byte: 8 of them held the 4
    workers for good and every scrape timed out. Now a request must be complete within the
    deadline (1.5 s here, 10 s by default) and a worker only sees complete requests."""
    deadline_s = 1.5
    monkeypatch.setattr(prometheus._Server, "idle_timeout_s", deadline_s)
    exporter, port = serving(1)
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(slow)]
    opened = time.monotonic()
    closed_at: dict[int, float] = {}
    done = threading.Event()

    def trickle() -> None:
        request = b"GET /metrics HTTP/1.1\r\nHost: a-very-slow-client\r\n"
        sent = 0
        while len(closed_at) < slow and not done.wait(0.25 if sent else 0):
            for i, sock in enumerate(clients):
                if i not in closed_at and is_closed(sock):
                    closed_at[i] = time.monotonic()
                elif i not in closed_at:
                    try:
                        sock.send(request[sent % len(request) : sent % len(request) + 1])
                    except OSError:
                        closed_at[i] = time.monotonic()
            sent += 1

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        latencies = [scrape_s(port) for _ in range(20)]
        assert time.monotonic() - opened < deadline_s, "scrapes must run while they trickle"
        trickler.join(timeout=deadline_s + 5)
    finally:
        done.set()
        for sock in clients:
            sock.close()
    assert max(latencies) < 1.0
    # Every slow client was closed by the deadline (or, past the 32 per peer, to make room).
    assert len(closed_at) == slow
    assert max(closed_at.values()) - opened < deadline_s + 1.0
    assert server_of(exporter).idle_closed >= slow


def test_idle_connections_do_not_delay_scrapes(
    serving: Callable[[int], tuple[PrometheusExporter, int]],
) -> None:
    """8 connections that never send a byte (the default 10 s deadline)."""
    _, port = serving(1)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        assert max(scrape_s(port) for _ in range(20)) < 1.0
        assert not any(is_closed(sock) for sock in idle)
    finally:
        for sock in idle:
            sock.close()


def test_clients_that_never_read_their_answer_hold_no_worker(
    monkeypatch: pytest.MonkeyPatch,
    serving: Callable[[int], tuple[PrometheusExporter, int]],
) -> None:
    """8 clients ask for a 6.8 MB answer with a 4 KiB receive buffer and never read. Before,
    a worker wrote each answer itself (blocking until the timeout): the 4 workers stuck.
    Now the selector thread writes what the sockets take, scrapes go on, and the readers are
    closed once the write deadline passes."""
    monkeypatch.setattr(prometheus._Server, "write_timeout_s", 1.0)
    exporter, port = serving(6500)
    assert len(exporter.render()) > 6 * 2**20  # twice what loopback buffers for a non-reader
    readers = []
    for _ in range(8):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        readers.append(sock)
    try:
        for sock in readers:  # every answer is made and being written
            sock.settimeout(30)
            assert sock.recv(1, socket.MSG_PEEK) == b"H"
        writing = time.monotonic()
        # The processes go stale (no sample for 60 s of event time): scrapes are small again.
        exporter.add(GpuSample(H, T0 + 60 * 10**9, gpu, power_w=300.0 + gpu) for gpu in range(8))
        assert max(scrape_s(port) for _ in range(5)) < 1.0
        # Closed at the deadline (the server stops writing): reading the rest ends there.
        assert all(wait_closed(sock, 5.0) for sock in readers)
        assert time.monotonic() - writing < 1.0 + 2.0
    finally:
        for sock in readers:
            sock.close()


def test_an_oversized_request_is_answered_431(
    serving: Callable[[int], tuple[PrometheusExporter, int]],
) -> None:
    exporter, port = serving(1)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Padding: " + b"x" * 20_000)
        sock.settimeout(5)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert server_of(exporter).oversized == 1
    # A request just under the bound is answered.
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = b"GET /metrics HTTP/1.1\r\nX-Padding: "
        padding = b"x" * (prometheus._MAX_REQUEST_BYTES - len(head) - 4)
        sock.sendall(head + padding + b"\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.0 200 OK")


def test_connections_are_capped_per_peer_oldest_waiting_first(
    monkeypatch: pytest.MonkeyPatch,
    serving: Callable[[int], tuple[PrometheusExporter, int]],
) -> None:
    monkeypatch.setattr(prometheus._Server, "max_per_peer", 4)
    exporter, port = serving(1)
    other = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
    mine = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    try:
        server = server_of(exporter)
        with_deadline = time.monotonic() + 5
        while server.evicted < 6 and time.monotonic() < with_deadline:
            time.sleep(0.01)
        assert server.evicted == 6
        # The 6 oldest of 127.0.0.1 went; the 4 newest, and 127.0.0.2's one, are open.
        assert [wait_closed(sock, 2.0) for sock in mine[:6]] == [True] * 6
        assert not any(is_closed(sock) for sock in [*mine[6:], other])
        assert scrape_s(port) < 1.0  # makes room by closing mine[6]
        assert wait_closed(mine[6], 2.0) and not is_closed(other)
    finally:
        for sock in [*mine, other]:
            sock.close()


def test_connections_are_capped_in_total(
    monkeypatch: pytest.MonkeyPatch,
    serving: Callable[[int], tuple[PrometheusExporter, int]],
) -> None:
    monkeypatch.setattr(prometheus._Server, "max_connections", 5)
    exporter, port = serving(1)
    socks = [
        socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{2 + i}", 0))
        for i in range(7)
    ]
    try:
        server = server_of(exporter)
        with_deadline = time.monotonic() + 5
        while server.evicted < 2 and time.monotonic() < with_deadline:
            time.sleep(0.01)
        assert [wait_closed(sock, 2.0) for sock in socks[:2]] == [True, True]
        assert not any(is_closed(sock) for sock in socks[2:])
        assert server.evicted == 2
    finally:
        for sock in socks:
            sock.close()
