"""Scrape latency of the exporter's HTTP server while hostile clients hold connections.

    python bench/hostile/bench_scrape_hostile.py [--scrapes 200] [--interval 0.06] [--trickle-s 4]
                                         [--scrape-timeout 45] [--exporter-source FILE]

The exporter (8 GPUs x 50 tracked pids, as ``bench_exporter.py``) serves ``/metrics`` from
its own process with the default settings (10 s to send a complete request, 4 workers).
From this process, per scenario: ``N`` slow clients ("slowloris": each sends one byte of a
request every ``--trickle-s`` seconds, from its own loopback address 127.0.0.x so the per-peer
cap does not help, and reconnects as soon as the server closes it), or 8 idle connections
(open, never send); then ``--scrapes`` scrapes, one every ``--interval`` seconds (a new
connection each, urllib, ``--scrape-timeout``), timed end to end. With the defaults a scenario
lasts about 12 s, past the 10 s deadline, so the table also shows the slow connections the
server cut and how long they had lived.

``--exporter-source`` loads ``PrometheusExporter`` from another copy of
``zeus_async/exporters/prometheus.py`` (e.g. ``git show HEAD:zeus_async/exporters/prometheus.py
> /tmp/old.py``) to measure the code before a change (use fewer scrapes: it times out). Prints
a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

HOST = "node1"
T0 = 1_763_000_000_000_000_000
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: node1\r\nUser-Agent: slow\r\nAccept: */*\r\n\r\n"


def _exporter_class(source: str | None) -> Any:
    if source is None:
        from zeus_async.exporters import PrometheusExporter

        return PrometheusExporter
    name = "zeus_async.exporters._bench_prometheus"  # relative imports resolve in the package
    spec = importlib.util.spec_from_file_location(name, source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.PrometheusExporter


def _serve(source: str | None) -> None:
    from zeus_async.events import GpuSample, ProcessSample

    exporter = _exporter_class(source)()
    exporter.add(
        GpuSample(HOST, T0, g, power_w=312.5 + g, energy_j=1.5e6, temperature_c=61.0)
        for g in range(8)
    )
    exporter.add(
        ProcessSample(HOST, T0, 1000 + p, cpu_frac=0.125, memory_rss_bytes=2_000_000_000)
        for p in range(50)
    )
    exporter.add(
        ProcessSample(HOST, T0, 1000 + p, gpu=g, gpu_sm_frac=0.5, attributed_power_w=150.0)
        for p in range(50)
        for g in range(8)
    )
    print(exporter.serve(0), flush=True)
    sys.stdin.read()
    exporter.close()


class _Slow:
    """``n`` slowloris clients, one thread: a byte each every ``every_s``, reconnecting."""

    def __init__(self, port: int, n: int, every_s: float, idle: bool) -> None:
        self.port, self.every_s, self.idle = port, every_s, idle
        self.socks: list[tuple[socket.socket, float, int]] = []
        self.cut_lifetimes: list[float] = []
        self.n = n
        self._stop = threading.Event()
        for i in range(n):
            self.socks.append(self._connect(i))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _connect(self, i: int) -> tuple[socket.socket, float, int]:
        source = ("127.0.0.1", 0) if self.idle else (f"127.0.{1 + i // 250}.{2 + i % 250}", 0)
        sock = socket.create_connection(("127.0.0.1", self.port), source_address=source)
        sock.setblocking(False)
        return sock, time.monotonic(), 0

    def _run(self) -> None:
        next_byte = time.monotonic()
        while not self._stop.wait(0.05):
            now = time.monotonic()
            send = not self.idle and now >= next_byte
            if send:
                next_byte = now + self.every_s
            for i, (sock, opened, sent) in enumerate(self.socks):
                try:
                    closed = sock.recv(4096) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    self.cut_lifetimes.append(now - opened)
                    sock.close()
                    self.socks[i] = self._connect(i)
                elif send:
                    try:
                        sock.send(REQUEST[sent % (len(REQUEST) - 4) :][:1])
                        self.socks[i] = (sock, opened, sent + 1)
                    except OSError:
                        pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock, _, _ in self.socks:
            sock.close()


def _scrape(port: int, timeout: float) -> float | None:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            body = r.read()
    except OSError:
        return None
    assert b"zeus_gpu_power_watts" in body
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.06)
    parser.add_argument("--trickle-s", type=float, default=4.0)
    parser.add_argument("--scrape-timeout", type=float, default=45.0)
    parser.add_argument("--exporter-source", default=None)
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "server":
        return _serve(args.exporter_source)
    cmd = [sys.executable, __file__, "--role", "server"]
    if args.exporter_source:
        cmd += ["--exporter-source", args.exporter_source]
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdin is not None
    port = int(server.stdout.readline())
    label = args.exporter_source or "this tree"
    print(
        f"exporter: {label}; {args.scrapes} scrapes, one every {args.interval * 1e3:g} ms; "
        f"slow clients send a byte every {args.trickle_s:g} s\n"
    )
    print("| clients | p50 | p99 | max | timed out | slow connections cut (lived) | scenario |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    try:
        for what, n, idle in (("none", 0, False), ("8 slow", 8, False), ("64 slow", 64, False),
                              ("8 idle", 8, True)):  # fmt: skip
            slow = _Slow(port, n, args.trickle_s, idle)
            time.sleep(1.0)  # the slow clients have sent their first byte
            started = time.monotonic()
            got: list[float] = []
            timeouts = 0
            for _ in range(args.scrapes):
                t = time.monotonic()
                s = _scrape(port, args.scrape_timeout)
                if s is None:
                    timeouts += 1
                    s = args.scrape_timeout
                got.append(s)
                time.sleep(max(0.0, args.interval - (time.monotonic() - t)))
            took = time.monotonic() - started
            slow.close()
            got.sort()
            p99 = got[min(len(got) - 1, round(0.99 * (len(got) - 1)))]
            cut = slow.cut_lifetimes
            lived = f" ({min(cut):.1f}-{max(cut):.1f} s)" if cut else ""
            print(
                f"| {what} | {statistics.median(got) * 1e3:.1f} ms | {p99 * 1e3:.1f} ms "
                f"| {got[-1] * 1e3:.1f} ms | {timeouts} | {len(cut)}{lived} | {took:.1f} s |"
            )
    finally:
        server.stdin.close()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
