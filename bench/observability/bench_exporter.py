"""Prometheus exporter: scrape cost with 8 GPUs x 50 tracked pids, and the cost of add().

Feeds a :class:`PrometheusExporter` the latest state of a busy node: GPU samples (every field)
for 8 GPUs, RAPL samples for 2 packages x 3 domains, host-side process samples for 50 pids
(every field), per-GPU process samples for every (pid, GPU) pair (400: the worst case) and a
few finished windows. Then times a scrape three ways: ``render()`` (the exporter's own text
writer), ``generate_latest(registry)`` (prometheus_client formatting the same collector, for
comparison) and a real HTTP GET of ``/metrics`` from ``serve()`` with urllib. Also times
``add()`` for one batch of 8 GPU samples and for one period of process samples.

Then the same node under dcgm-exporter's names (``names="dcgm"``), and the series and memory
the exporter holds after 10,000 distinct window names, with the default cap and without one.

Run: ``.venv/bin/python bench/observability/bench_exporter.py [--repeat N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from zeus_async.events import Event, GpuSample, Measurement, ProcessSample, RaplSample
from zeus_async.exporters import PrometheusExporter

HOST = "node1"
T0 = 1_763_000_000_000_000_000
GPUS = 8
PIDS = 50
TARGET_MS = 10.0


def gpu_samples(t_ns: int) -> list[Event]:
    return [
        GpuSample(
            HOST,
            t_ns,
            g,
            power_w=312.5 + g,
            avg_power_w=305.25 + g,
            energy_j=1.5e6 + 1000.0 * g,
            temperature_c=61.0,
            sm_clock_hz=1.98e9,
            utilization_frac=0.97,
            memory_used_bytes=72_000_000_000 + g,
            power_limit_w=700.0,
        )
        for g in range(GPUS)
    ]


def process_samples(t_ns: int) -> list[Event]:
    events: list[Event] = []
    for i in range(PIDS):
        pid = 10_000 + i
        events.append(
            ProcessSample(
                HOST,
                t_ns,
                pid,
                cpu_frac=0.0125,
                memory_rss_bytes=2_000_000_000 + i,
                memory_pss_bytes=1_900_000_000 + i,
                memory_uss_bytes=1_800_000_000 + i,
                memory_frac=0.0078,
                cpu_share_frac=0.02,
                cpu_power_w=3.5,
                cpu_energy_j=1234.5 + i,
                dram_power_w=0.75,
                dram_energy_j=321.25 + i,
            )
        )
        for g in range(GPUS):
            events.append(
                ProcessSample(
                    HOST,
                    t_ns,
                    pid,
                    gpu=g,
                    gpu_sm_frac=0.02,
                    gpu_memory_bytes=1_400_000_000,
                    attributed_power_w=6.25,
                    gpu_sm_share_frac=0.02,
                    gpu_memory_share_frac=0.02,
                    gpu_power_share_frac=0.02,
                    attributed_energy_j=4321.5 + i,
                )
            )
    return events


def other_samples(t_ns: int) -> list[Event]:
    events: list[Event] = [
        RaplSample(HOST, t_ns, p, d, energy_j=98_765.5 + p, power_w=120.5)
        for p in range(2)
        for d in ("package", "core", "dram")
    ]
    for k, name in enumerate(("train_step", "eval", "epoch")):
        events.append(
            Measurement(
                HOST,
                t_ns,
                name,
                k,
                t_ns - 1_000_000_000,
                t_ns,
                1.0,
                gpu_energy_j={g: 300.0 + g for g in range(GPUS)},
                cpu_energy_j={0: 120.0, 1: 118.0},
                dram_energy_j={0: 20.0, 1: 19.0},
            )
        )
    return events


def timings_ms(repeat: int, fn: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="scrapes timed per case")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    exporter = PrometheusExporter()
    exporter.add(gpu_samples(T0) + other_samples(T0) + process_samples(T0))
    body = exporter.render()
    series = sum(1 for line in body.splitlines() if not line.startswith(b"#"))
    assert body == generate_latest(exporter.registry), "render() differs from prometheus_client"
    out: dict[str, Any] = {"repeat": args.repeat, "series": series, "bytes": len(body)}

    port = exporter.serve(0)
    url = f"http://127.0.0.1:{port}/metrics"

    def http_get() -> None:
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert len(resp.read()) == len(body)

    cases: list[tuple[str, str, Callable[[], object]]] = [
        ("render() (exporter's text writer)", "render", exporter.render),
        ("HTTP GET /metrics via serve() (urllib)", "http", http_get),
        (
            "generate_latest(registry) (prometheus_client's writer, for comparison)",
            "generate_latest",
            lambda: generate_latest(exporter.registry),
        ),
        (
            "collect() alone (families for prometheus_client)",
            "collect",
            lambda: list(exporter.collect()),
        ),
    ]
    try:
        for _, key, fn in cases:
            fn()  # warm up
            runs = timings_ms(args.repeat, fn)
            out[key] = {"median_ms": statistics.median(runs), "best_ms": min(runs)}
    finally:
        exporter.close()

    # add(): one batch of 8 GPU samples (one 100 Hz tick), and one period of process samples.
    batch = gpu_samples(T0 + 10_000_000)
    procs = process_samples(T0 + 10_000_000)
    loops = 20_000
    t0 = time.perf_counter()
    for _ in range(loops):
        exporter.add(batch)
    out["add_gpu_us_per_event"] = (time.perf_counter() - t0) / (loops * len(batch)) * 1e6
    t0 = time.perf_counter()
    for _ in range(200):
        exporter.add(procs)
    out["add_process_us_per_event"] = (time.perf_counter() - t0) / (200 * len(procs)) * 1e6

    print(
        f"\n### Prometheus exporter scrape ({GPUS} GPUs x {PIDS} pids, {series:,} series, "
        f"{len(body) / 1e3:.0f} kB, {args.repeat} runs)\n"
    )
    print("| case | series exported | median ms | best ms | target ms | pass |")
    print("|---|---:|---:|---:|---:|---|")
    for name, key, _ in cases:
        r = out[key]
        target = TARGET_MS if key in ("render", "http") else None
        verdict = "-" if target is None else ("yes" if r["median_ms"] <= target else "NO")
        print(
            f"| {name} | {series:,} | {r['median_ms']:.2f} | {r['best_ms']:.2f} | "
            f"{'-' if target is None else f'{target:.0f}'} | {verdict} |"
        )
    print(
        f"\nadd(): {out['add_gpu_us_per_event']:.2f} µs/event for a batch of {len(batch)} GPU "
        f"samples (all fields); {out['add_process_us_per_event']:.2f} µs/event for a batch of "
        f"{len(procs)} process samples"
    )
    out["dcgm"] = dcgm_scrape(args.repeat)
    d = out["dcgm"]
    print(
        f"\nWith dcgm-exporter's names (`names='dcgm'`, same node, {d['series']:,} series): "
        f"render() median {d['render_ms']:.2f} ms, HTTP GET median {d['http_ms']:.2f} ms"
    )
    out["otlp"] = otlp_export(20)
    o = out["otlp"]
    print(
        f"\nOTLP/HTTP export of the same node to a local receiver ({o['bytes'] / 1e3:.0f} kB a "
        "request; GPUs, RAPL and windows: OTLP carries no process series yet): "
        f"median {o['median_ms']:.1f} ms per export interval (SDK thread), "
        f"best {o['best_ms']:.1f} ms"
    )
    out["idle"] = idle_clients(2000)
    i = out["idle"]
    print(
        f"\n2,000 idle clients connected: {i['threads_added']} thread(s) added "
        f"(was one per connection), a scrape meanwhile took {i['scrape_ms']:.1f} ms"
    )
    out["windows"] = window_names(10_000)
    print("\n| 10,000 distinct window names, 8 GPUs each | window series | exporter memory MB |")
    print("|---|---:|---:|")
    for label, key in (("capped (default max_windows=1000)", "capped"), ("uncapped", "uncapped")):
        w = out["windows"][key]
        print(f"| {label} | {w['series']:,} | {w['mb']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def dcgm_scrape(repeat: int) -> dict[str, float]:
    """The same node exported under dcgm-exporter's names: render() and an HTTP GET."""
    from zeus_async.events import DeviceInfo, StreamInfo

    exporter = PrometheusExporter(names="dcgm")
    devices = [
        DeviceInfo(f"gpu:{g}", "NVIDIA H100 80GB HBM3", uuid=f"GPU-{g:08x}") for g in range(GPUS)
    ]
    exporter.add([StreamInfo(HOST, T0, "s", devices=devices)])
    exporter.add(gpu_samples(T0) + other_samples(T0) + process_samples(T0))
    body = exporter.render()
    port = exporter.serve(0)
    url = f"http://127.0.0.1:{port}/metrics"

    def http_get() -> None:
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert len(resp.read()) == len(body)

    try:
        http_get()
        render = statistics.median(timings_ms(repeat, exporter.render))
        http = statistics.median(timings_ms(repeat, http_get))
    finally:
        exporter.close()
    series = sum(1 for line in body.splitlines() if not line.startswith(b"#"))
    return {"series": series, "render_ms": render, "http_ms": http}


def otlp_export(repeat: int) -> dict[str, float]:
    """One OTLP export (``force_flush``: collect, encode, POST, answer) of the busy node, to a
    receiver in this process that only reads the request."""
    import http.server
    import threading

    from zeus_async.exporters.otlp import OtlpExporter

    sizes: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            sizes.append(len(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    exporter = OtlpExporter(f"http://127.0.0.1:{server.server_address[1]}", interval_s=3600)
    try:
        exporter.add(gpu_samples(T0) + other_samples(T0) + process_samples(T0))
        exporter.flush()
        runs = timings_ms(repeat, exporter.flush)
    finally:
        exporter.close()
        server.shutdown()
    return {"median_ms": statistics.median(runs), "best_ms": min(runs), "bytes": sizes[-1]}


def idle_clients(count: int) -> dict[str, float]:
    """Threads the server adds for ``count`` clients that connect and send nothing, and the
    time of a scrape among them."""
    import socket
    import threading

    exporter = PrometheusExporter()
    exporter.add(gpu_samples(T0) + other_samples(T0) + process_samples(T0))
    port = exporter.serve(0)
    before = threading.active_count()
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    try:
        time.sleep(0.5)
        added = threading.active_count() - before
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            resp.read()
        scrape_ms = (time.perf_counter() - t0) * 1e3
    finally:
        for c in conns:
            c.close()
        exporter.close()
    return {"threads_added": added, "scrape_ms": scrape_ms}


def window_names(count: int) -> dict[str, dict[str, float]]:
    """Series and memory after ``count`` distinct window names, capped and not."""
    import tracemalloc

    out = {}
    for key, cap in (("capped", 1000), ("uncapped", 10**9)):
        tracemalloc.start()
        exporter = PrometheusExporter(max_windows=cap)
        for k in range(count):
            t = T0 + k * 1_000_000
            energies = {g: 1.5 for g in range(GPUS)}
            exporter.add([Measurement(HOST, t, f"step-{k}", k, t - 10**9, t, 1.0, energies)])
        body = exporter.render()
        mb = tracemalloc.get_traced_memory()[0] / 1e6
        tracemalloc.stop()
        series = sum(1 for line in body.splitlines() if line.startswith(b"zeus_window"))
        out[key] = {"series": series, "mb": mb}
        exporter.close()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
