"""PrometheusExporter: exact values and labels, state rules, HTTP serving, a real Prometheus."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from zeus_async.clock import FakeClock
from zeus_async.devices.sim import SimConfig
from zeus_async.errors import ConfigError
from zeus_async.events import (
    DeviceFault,
    DeviceInfo,
    Event,
    GpuSample,
    Heartbeat,
    Measurement,
    ProcessSample,
    RaplSample,
    StreamInfo,
    WindowClose,
    WindowOpen,
)
from zeus_async.exporters import PrometheusExporter
from zeus_async.runtime import Runtime
from zeus_async.testing import sim_pynvml

H = "node1"
T0 = 1_763_000_000_000_000_000
S = 1_000_000_000

Labels = tuple[tuple[str, str], ...]


def scrape(exporter: PrometheusExporter) -> dict[str, dict[Labels, float]]:
    """Sample name -> {sorted label pairs: value}, parsed from ``render()``."""
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(exporter.render().decode()):
        for s in family.samples:
            key = tuple(sorted(s.labels.items()))
            assert key not in out.setdefault(s.name, {}), f"duplicate series {s.name}{key}"
            out[s.name][key] = s.value
    return out


def types(exporter: PrometheusExporter) -> dict[str, str]:
    """Sample name -> its ``# TYPE``."""
    out = {}
    for line in exporter.render().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            out[name] = kind
    return out


def lab(**labels: str | int) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def full_gpu(t_ns: int, gpu: int, host: str = H) -> GpuSample:
    return GpuSample(
        host,
        t_ns,
        gpu,
        power_w=312.5 + gpu,
        avg_power_w=305.25,
        energy_j=1_500_000.5,
        temperature_c=61.0,
        sm_clock_hz=1.98e9,
        utilization_frac=0.75,
        memory_used_bytes=72_000_000_000,
        power_limit_w=700.0,
    )


def host_proc(t_ns: int, pid: int, host: str = H, **fields: float | int | None) -> ProcessSample:
    values: dict[str, float | int | None] = {
        "cpu_frac": 0.125,
        "memory_rss_bytes": 2_000_000_000,
        "memory_pss_bytes": 1_900_000_000,
        "memory_uss_bytes": 1_800_000_000,
        "memory_frac": 0.0625,
        "cpu_share_frac": 0.25,
        "cpu_power_w": 3.5,
        "cpu_energy_j": 1234.5,
        "dram_power_w": 0.75,
        "dram_energy_j": 321.25,
    }
    values.update(fields)
    return ProcessSample(host, t_ns, pid, **values)  # type: ignore[arg-type]


def gpu_proc(t_ns: int, pid: int, gpu: int, host: str = H) -> ProcessSample:
    return ProcessSample(
        host,
        t_ns,
        pid,
        gpu=gpu,
        gpu_sm_frac=0.5,
        gpu_memory_bytes=1_400_000_000,
        attributed_power_w=156.25,
        gpu_sm_share_frac=0.625,
        gpu_memory_share_frac=0.375,
        gpu_power_share_frac=0.5,
        attributed_energy_j=4321.5,
    )


def measurement(
    t_ns: int,
    name: str,
    window_id: int,
    time_s: float,
    gpu: dict[int, float],
    cpu: dict[int, float] | None = None,
    dram: dict[int, float] | None = None,
    lost: list[str] | None = None,
) -> Measurement:
    return Measurement(
        H,
        t_ns,
        name,
        window_id,
        t_ns - round(time_s * S),
        t_ns,
        time_s,
        gpu_energy_j=gpu,
        cpu_energy_j=cpu,
        dram_energy_j=dram,
        lost=lost or [],
    )


# -- values and labels ----------------------------------------------------------------------------


def test_gpu_sample_exports_every_field_with_host_and_gpu_labels() -> None:
    exporter = PrometheusExporter()
    exporter.add([full_gpu(T0, 0), full_gpu(T0, 1)])
    got = scrape(exporter)
    g0, g1 = lab(host=H, gpu=0), lab(host=H, gpu=1)
    assert got["zeus_gpu_power_watts"] == {g0: 312.5, g1: 313.5}
    assert got["zeus_gpu_average_power_watts"] == {g0: 305.25, g1: 305.25}
    assert got["zeus_gpu_energy_joules_total"] == {g0: 1_500_000.5, g1: 1_500_000.5}
    assert got["zeus_gpu_temperature_celsius"][g0] == 61.0
    assert got["zeus_gpu_sm_clock_hertz"][g0] == 1.98e9
    assert got["zeus_gpu_utilization_ratio"][g0] == 0.75
    assert got["zeus_gpu_memory_used_bytes"][g0] == 72_000_000_000
    assert got["zeus_gpu_power_limit_watts"][g1] == 700.0
    assert len(got) == 8


def test_none_keeps_the_last_value_and_unseen_fields_are_not_exported() -> None:
    exporter = PrometheusExporter()
    exporter.add([GpuSample(H, T0, 0, power_w=100.0, temperature_c=50.0)])
    exporter.add(
        [
            GpuSample(H, T0 + 10_000_000, 0, power_w=None, temperature_c=55.0),
            GpuSample(H, T0 + 10_000_000, 3, energy_j=42.0),
        ]
    )
    got = scrape(exporter)
    assert got == {
        "zeus_gpu_power_watts": {lab(host=H, gpu=0): 100.0},
        "zeus_gpu_temperature_celsius": {lab(host=H, gpu=0): 55.0},
        "zeus_gpu_energy_joules_total": {lab(host=H, gpu=3): 42.0},
    }
    # No HELP/TYPE lines for families without a sample.
    assert "zeus_gpu_sm_clock_hertz" not in exporter.render().decode()
    # The latest value wins.
    exporter.add([GpuSample(H, T0 + 20_000_000, 0, power_w=250.0)])
    assert scrape(exporter)["zeus_gpu_power_watts"] == {lab(host=H, gpu=0): 250.0}


def test_rapl_power_and_energy_counter() -> None:
    exporter = PrometheusExporter()
    exporter.add(
        [
            RaplSample(H, T0, 0, "package", energy_j=10.0),  # first sample: no power yet
            RaplSample(H, T0, 1, "dram", energy_j=2.5, power_w=4.0),
        ]
    )
    got = scrape(exporter)
    assert got["zeus_rapl_energy_joules_total"] == {
        lab(host=H, package=0, domain="package"): 10.0,
        lab(host=H, package=1, domain="dram"): 2.5,
    }
    assert got["zeus_rapl_power_watts"] == {lab(host=H, package=1, domain="dram"): 4.0}
    exporter.add([RaplSample(H, T0 + S, 0, "package", energy_j=130.0, power_w=120.0)])
    got = scrape(exporter)
    assert got["zeus_rapl_power_watts"][lab(host=H, package=0, domain="package")] == 120.0
    assert got["zeus_rapl_energy_joules_total"][lab(host=H, package=0, domain="package")] == 130.0


def test_host_side_process_metrics() -> None:
    exporter = PrometheusExporter()
    exporter.add([host_proc(T0, 4242), host_proc(T0, 7, memory_pss_bytes=None, cpu_power_w=None)])
    got = scrape(exporter)
    p = lab(host=H, pid=4242)
    assert got["zeus_process_cpu_ratio"][p] == 0.125
    assert got["zeus_process_cpu_share_ratio"][p] == 0.25
    assert got["zeus_process_memory_ratio"][p] == 0.0625
    assert got["zeus_process_cpu_power_watts"] == {p: 3.5}  # pid 7 has none
    assert got["zeus_process_cpu_energy_joules_total"][p] == 1234.5
    assert got["zeus_process_dram_power_watts"][p] == 0.75
    assert got["zeus_process_dram_energy_joules_total"][p] == 321.25
    assert got["zeus_process_memory_bytes"] == {
        lab(host=H, pid=4242, kind="rss"): 2_000_000_000,
        lab(host=H, pid=4242, kind="pss"): 1_900_000_000,
        lab(host=H, pid=4242, kind="uss"): 1_800_000_000,
        lab(host=H, pid=7, kind="rss"): 2_000_000_000,
        lab(host=H, pid=7, kind="uss"): 1_800_000_000,
    }
    # Host-side samples produce no per-GPU process series, and vice versa.
    assert not [name for name in got if name.startswith("zeus_process_gpu_")]


def test_per_gpu_process_metrics() -> None:
    exporter = PrometheusExporter()
    exporter.add([gpu_proc(T0, 4242, 0), gpu_proc(T0, 4242, 1)])
    got = scrape(exporter)
    pg0, pg1 = lab(host=H, pid=4242, gpu=0), lab(host=H, pid=4242, gpu=1)
    assert got["zeus_process_gpu_sm_ratio"] == {pg0: 0.5, pg1: 0.5}
    assert got["zeus_process_gpu_memory_bytes"][pg0] == 1_400_000_000
    assert got["zeus_process_gpu_sm_share_ratio"][pg0] == 0.625
    assert got["zeus_process_gpu_memory_share_ratio"][pg0] == 0.375
    assert got["zeus_process_gpu_power_share_ratio"][pg1] == 0.5
    assert got["zeus_process_gpu_power_watts"][pg1] == 156.25
    assert got["zeus_process_gpu_energy_joules_total"][pg1] == 4321.5
    assert not [name for name in got if name.startswith("zeus_process_c")]
    # A first sample (no rates yet) does not erase what is known.
    exporter.add([ProcessSample(H, T0 + S, 4242, gpu=0, attributed_energy_j=0.0)])
    got = scrape(exporter)
    assert got["zeus_process_gpu_power_watts"][pg0] == 156.25
    assert got["zeus_process_gpu_energy_joules_total"][pg0] == 0.0


def test_window_latest_values_and_totals() -> None:
    exporter = PrometheusExporter()
    exporter.add(
        [
            WindowOpen(H, T0, "step", 1),
            WindowClose(H, T0 + S, "step", 1),
            measurement(T0 + S, "step", 1, 1.5, {0: 10.0, 1: 20.0}, {0: 5.0}, {0: 1.0}),
            measurement(T0 + 2 * S, "step", 2, 2.5, {0: 12.0, 1: 22.0}, {0: 6.0}),
            measurement(T0 + 2 * S, "eval", 1, 0.25, {0: 3.0}, lost=["gpu:1"]),
        ]
    )
    got = scrape(exporter)
    step = {"host": H, "window": "step"}
    assert got["zeus_window_last_energy_joules"] == {
        lab(**step, device="gpu:0"): 12.0,
        lab(**step, device="gpu:1"): 22.0,
        lab(**step, device="cpu:0"): 6.0,
        lab(**step, device="dram:0"): 1.0,  # the latest window that measured DRAM
        lab(host=H, window="eval", device="gpu:0"): 3.0,
    }
    assert got["zeus_window_energy_joules_total"] == {
        lab(**step, device="gpu:0"): 22.0,
        lab(**step, device="gpu:1"): 42.0,
        lab(**step, device="cpu:0"): 11.0,
        lab(**step, device="dram:0"): 1.0,
        lab(host=H, window="eval", device="gpu:0"): 3.0,
    }
    assert got["zeus_window_duration_seconds"] == {
        lab(**step): 2.5,
        lab(host=H, window="eval"): 0.25,
    }
    assert got["zeus_windows_total"] == {lab(**step): 2.0, lab(host=H, window="eval"): 1.0}


def test_other_events_are_ignored() -> None:
    exporter = PrometheusExporter()
    exporter.add(
        [
            StreamInfo(H, T0, "abc"),
            Heartbeat(H, T0, "abc"),
            WindowOpen(H, T0, "w", 1),
            DeviceFault(H, T0, "gpu:0", "gpu_lost", "fell off the bus"),
        ]
    )
    assert exporter.render() == b""
    assert exporter.events == 4


# -- naming ---------------------------------------------------------------------------------------


def rich_exporter(host: str = H) -> PrometheusExporter:
    exporter = PrometheusExporter()
    exporter.add(
        [
            full_gpu(T0, 0, host),
            RaplSample(host, T0, 0, "package", energy_j=10.0, power_w=100.0),
            host_proc(T0, 1, host),
            gpu_proc(T0, 1, 0, host),
            Measurement(host, T0, 'w"\\1', 1, T0 - S, T0, 1.0, {0: 3.0}, {0: 1.0}, {0: 0.5}),
        ]
    )
    return exporter


def test_counters_are_named_total_and_every_family_has_help_with_its_unit() -> None:
    exporter = rich_exporter()
    kinds = types(exporter)
    assert len(kinds) == 29  # every family of the exporter
    for name, kind in kinds.items():
        assert name.startswith("zeus_")
        assert kind == ("counter" if name.endswith("_total") else "gauge"), name
    assert {f.type for f in text_string_to_metric_families(exporter.render().decode())} == {
        "counter",
        "gauge",
    }
    units = {
        "_watts": "watts",
        "_joules": "joules",
        "_celsius": "celsius",
        "_hertz": "hertz",
        "_bytes": "bytes",
        "_ratio": "ratio",
        "_seconds": "seconds",
    }
    helps = {}
    for line in exporter.render().decode().splitlines():
        if line.startswith("# HELP "):
            _, _, name, text = line.split(" ", 3)
            helps[name] = text
    assert helps.keys() == kinds.keys()
    for name, text in helps.items():
        base = name.removesuffix("_total")
        unit = next((u for suffix, u in units.items() if base.endswith(suffix)), None)
        if name == "zeus_windows_total":
            assert "windows" in text
        else:
            assert unit is not None and unit in text, (name, text)


def test_render_is_byte_for_byte_what_prometheus_client_writes() -> None:
    # Odd label values (quotes, backslashes, newlines) and values Go writes in exponent form.
    exporter = rich_exporter(host='we"ird\\host\nname')
    exporter.add([GpuSample(H, T0, 5, power_w=float("inf"), energy_j=1e16, sm_clock_hz=1.5e9)])
    text = exporter.render()
    assert text == generate_latest(exporter.registry)
    assert b'host="we\\"ird\\\\host\\nname"' in text and b" 1.5e+09\n" in text
    parsed = {f.name for f in text_string_to_metric_families(text.decode())}
    assert "zeus_gpu_power_watts" in parsed


def test_collector_protocol_and_a_caller_registry() -> None:
    class NoCollect(PrometheusExporter):
        def collect(self) -> Iterator[Metric]:
            raise AssertionError("registration must not call collect()")

    NoCollect()  # registers itself: describe() is enough
    described = PrometheusExporter().describe()
    assert len(described) == 31 and not any(m.samples for m in described)
    registry = CollectorRegistry()
    other = Gauge("other_metric", "Something else.", registry=registry)
    other.set(3)
    exporter = PrometheusExporter(registry=registry)
    assert exporter.registry is registry
    exporter.add([full_gpu(T0, 0)])
    text = exporter.render()
    assert text == generate_latest(registry)
    assert b"other_metric 3.0" in text and b'zeus_gpu_power_watts{gpu="0",host="node1"}' in text
    # describe() names the families, so a clash with another collector is caught at once.
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrometheusExporter(registry=registry)


def test_stale_after_s_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="stale_after_s"):
        PrometheusExporter(stale_after_s=0)


# -- process eviction -----------------------------------------------------------------------------


def test_stale_processes_are_dropped_at_the_next_scrape() -> None:
    exporter = PrometheusExporter(stale_after_s=30)
    other = "node2"
    exporter.add(
        [
            host_proc(T0, 1),
            gpu_proc(T0, 1, 0),
            host_proc(T0, 2),
            gpu_proc(T0, 2, 0),
            gpu_proc(T0, 2, 1),
            host_proc(T0 - 100 * S, 9, host=other),  # another host, another clock
        ]
    )
    exporter.add([host_proc(T0 + 20 * S, 2), gpu_proc(T0 + 20 * S, 2, 1), full_gpu(T0 + 20 * S, 0)])
    pids = scrape(exporter)["zeus_process_cpu_ratio"]
    assert set(pids) == {lab(host=H, pid=1), lab(host=H, pid=2), lab(host=other, pid=9)}

    # 30 s after pid 1's last sample: still fresh (dropped only once *older* than 30 s).
    exporter.add([full_gpu(T0 + 30 * S, 0)])
    assert lab(host=H, pid=1) in scrape(exporter)["zeus_process_cpu_ratio"]
    exporter.add([full_gpu(T0 + 31 * S, 0)])
    got = scrape(exporter)
    assert set(got["zeus_process_cpu_ratio"]) == {lab(host=H, pid=2), lab(host=other, pid=9)}
    assert set(got["zeus_process_memory_bytes"]) == {
        lab(host=h, pid=p, kind=k) for h, p in ((H, 2), (other, 9)) for k in ("rss", "pss", "uss")
    }
    # (pid, gpu) pairs age on their own: pid 2 left GPU 0 at T0 but stayed on GPU 1.
    assert set(got["zeus_process_gpu_power_watts"]) == {lab(host=H, pid=2, gpu=1)}
    assert exporter.evicted == 3  # pid 1, (1, gpu 0), (2, gpu 0)

    # Everything of pid 2 goes too once it is stale; a returning pid is exported again.
    exporter.add([full_gpu(T0 + 60 * S, 0), host_proc(T0 + 60 * S, 1)])
    got = scrape(exporter)
    assert set(got["zeus_process_cpu_ratio"]) == {lab(host=H, pid=1), lab(host=other, pid=9)}
    assert "zeus_process_gpu_power_watts" not in got


# -- serving --------------------------------------------------------------------------------------


def get(url: str) -> tuple[bytes, str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read(), resp.headers["Content-Type"]


def serving_port(exporter: PrometheusExporter) -> int | None:
    return exporter.port


def test_serve_on_port_zero_and_scrape_over_http() -> None:
    with rich_exporter() as exporter:
        port = exporter.serve(0)
        assert port > 0 and exporter.port == port
        body, ctype = get(f"http://127.0.0.1:{port}/metrics")
        assert body == exporter.render()
        assert ctype == "text/plain; version=0.0.4; charset=utf-8"
        # A name[] filter is answered by prometheus_client's own app.
        query = urllib.parse.urlencode({"name[]": "zeus_gpu_power_watts"})
        body, _ = get(f"http://127.0.0.1:{port}/metrics?{query}")
        assert [f.name for f in text_string_to_metric_families(body.decode())] == [
            "zeus_gpu_power_watts"
        ]
        with pytest.raises(RuntimeError, match="already serving"):
            exporter.serve(0)
    assert serving_port(exporter) is None
    with pytest.raises(urllib.error.URLError):
        get(f"http://127.0.0.1:{port}/metrics")
    exporter.close()  # idempotent


def test_port_in_use_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exporter = PrometheusExporter()
        with pytest.raises(ConfigError, match=rf"127\.0\.0\.1:{port}.*in use"):
            exporter.serve(port)
        assert exporter.port is None
    with pytest.raises(ConfigError, match="port must be"):
        exporter.serve(70000)


def test_idle_connections_hold_no_thread_and_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000 clients that connect and send nothing: no thread each (before: 2,001 threads),
    a scrape still answers at once, and they are closed after the idle timeout."""
    from zeus_async.exporters import prometheus

    monkeypatch.setattr(prometheus._Server, "idle_timeout_s", 1.0)
    exporter = rich_exporter()
    port = exporter.serve(0)
    threads_before = threading.active_count()
    idle = []
    try:
        for _ in range(2000):
            idle.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(0.3)
        assert threading.active_count() <= threads_before + 4  # the bounded pool, at most
        started = time.monotonic()
        body, _ = get(f"http://127.0.0.1:{port}/metrics")
        assert b"zeus_gpu_power_watts" in body
        assert time.monotonic() - started < 2.0
        # Past the idle timeout the server has closed them: reads see the end of the stream.
        time.sleep(1.6)
        closed = 0
        for conn in idle:
            conn.settimeout(0.5)
            try:
                closed += conn.recv(1) == b""
            except (ConnectionError, TimeoutError):
                closed += 1
        assert closed == 2000
        assert exporter._server is not None and exporter._server.idle_closed >= 2000  # type: ignore[attr-defined]
        # A client that starts a request and stalls holds one worker until the same timeout.
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert b"zeus_gpu_power_watts" in get(f"http://127.0.0.1:{port}/metrics")[0]
        stalled.close()
    finally:
        for conn in idle:
            conn.close()
        exporter.close()


def test_scrapes_from_another_thread_while_events_arrive() -> None:
    exporter = PrometheusExporter()
    stop = threading.Event()
    errors: list[BaseException] = []

    def scraper() -> None:
        try:
            while not stop.is_set():
                text_string_to_metric_families(exporter.render().decode())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=scraper)
    thread.start()
    try:
        for k in range(300):
            t = T0 + k * 10_000_000
            batch: list[Event] = [full_gpu(t, g) for g in range(4)]
            batch += [host_proc(t, 100 + k % 40), gpu_proc(t, 100 + k % 40, k % 4)]
            exporter.add(batch)
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert len(scrape(exporter)["zeus_process_cpu_ratio"]) == 40


# -- as a runtime consumer ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_runtime_consumer_on_the_simulator() -> None:
    clock = FakeClock(wall_start_ns=T0)
    batched, plain = PrometheusExporter(), PrometheusExporter()
    try:
        async with Runtime(
            backend="sim",
            cpus=None,
            sim_config=SimConfig(num_gpus=3, seed=7),
            clock=clock,
            host="simhost",
            windows=True,
        ) as rt:
            rt.start_consumer(batched.run, batched=True)
            rt.start_consumer(plain.run)
            await clock.sleep_until(clock.monotonic_ns() + 300_000_000)
            live = scrape(batched)["zeus_gpu_power_watts"]
            assert set(live) == {lab(host="simhost", gpu=g) for g in range(3)}
            async with rt.window("step") as w:
                await clock.sleep_until(clock.monotonic_ns() + 200_000_000)
            assert w.result is not None
            result = await w.result.wait_async()
            await clock.sleep_until(clock.monotonic_ns() + 50_000_000)
    finally:
        sim_pynvml.uninstall()
    for exporter in (batched, plain):
        got = scrape(exporter)
        assert set(got["zeus_gpu_power_watts"]) == {lab(host="simhost", gpu=g) for g in range(3)}
        assert all(v > 0 for v in got["zeus_gpu_power_watts"].values())
        assert got["zeus_window_last_energy_joules"] == {
            lab(host="simhost", window="step", device=f"gpu:{g}"): result.gpu_energy_j[g]
            for g in range(3)
        }
        assert got["zeus_windows_total"] == {lab(host="simhost", window="step"): 1.0}
    assert batched.render() == plain.render()
    assert batched.events == plain.events > 0


# -- dcgm-exporter names, identifying labels, bounded window series ------------------------------


def stream_info(host: str = H, gpus: int = 2) -> StreamInfo:
    devices = [
        DeviceInfo(f"gpu:{g}", "NVIDIA H100 80GB HBM3", uuid=f"GPU-{g:08d}-abcd")
        for g in range(gpus)
    ]
    return StreamInfo(host, T0, "s1", devices=devices)


def test_dcgm_names_units_and_labels() -> None:
    exporter = PrometheusExporter(names="dcgm")
    exporter.add([stream_info(), full_gpu(T0, 0), full_gpu(T0, 1)])
    got = scrape(exporter)
    g0 = lab(
        host=H,
        gpu=0,
        Hostname=H,
        UUID="GPU-00000000-abcd",
        device="nvidia0",
        modelName="NVIDIA H100 80GB HBM3",
    )
    assert got["DCGM_FI_DEV_POWER_USAGE"][g0] == 312.5
    # mJ, in a counter written as dcgm-exporter writes it (prometheus_client's parser adds
    # _total when it reads one back; Prometheus keeps the name as written).
    assert got["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total"][g0] == 1_500_000.5 * 1e3
    assert got["DCGM_FI_DEV_GPU_TEMP"][g0] == 61.0
    assert got["DCGM_FI_DEV_SM_CLOCK"][g0] == pytest.approx(1980.0)  # MHz
    assert got["DCGM_FI_DEV_GPU_UTIL"][g0] == 75.0  # %
    assert got["DCGM_FI_DEV_FB_USED"][g0] == pytest.approx(72_000_000_000 / 2**20)  # MiB
    assert got["DCGM_FI_DEV_POWER_MGMT_LIMIT"][g0] == 700.0
    assert not any(name.startswith("zeus_gpu_") for name in got)
    text = exporter.render().decode()
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter" in text
    assert 'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{Hostname="node1",UUID="GPU-00000000-abcd"' in text


def test_amd_device_metrics_exporter_names_units_and_labels() -> None:
    exporter = PrometheusExporter(names="amd")
    exporter.add([stream_info(), full_gpu(T0, 0), full_gpu(T0, 1)])
    got = scrape(exporter)
    g0 = lab(
        host=H,
        gpu=0,
        Hostname=H,
        UUID="GPU-00000000-abcd",
        modelName="NVIDIA H100 80GB HBM3",
        gpu_id=0,
        hostname=H,
        card_model="NVIDIA H100 80GB HBM3",
    )
    assert got["gpu_package_power"][g0] == 312.5
    assert got["gpu_energy_consumed"][g0] == pytest.approx(1_500_000.5 * 1e6)  # µJ
    assert got["gpu_junction_temperature"][g0] == 61.0
    assert got["gpu_clock"][g0] == pytest.approx(1980.0)  # MHz
    assert got["gpu_gfx_activity"][g0] == 75.0  # %
    assert got["gpu_used_vram"][g0] == pytest.approx(72_000.0)  # MB
    assert got["zeus_gpu_power_limit_watts"][g0] == 700.0  # no AMD name: ours
    assert not any(name.startswith("DCGM_") for name in got)
    assert "zeus_gpu_power_watts" not in got


def test_native_gpu_series_get_uuid_labels_once_described() -> None:
    exporter = PrometheusExporter()
    exporter.add([full_gpu(T0, 0)])  # before the stream's description
    assert scrape(exporter)["zeus_gpu_power_watts"] == {lab(host=H, gpu=0): 312.5}
    exporter.add([stream_info(gpus=1)])
    described = lab(
        host=H, gpu=0, Hostname=H, UUID="GPU-00000000-abcd", modelName="NVIDIA H100 80GB HBM3"
    )
    assert scrape(exporter)["zeus_gpu_power_watts"] == {described: 312.5}


def test_window_names_are_capped_and_expire() -> None:
    exporter = PrometheusExporter(max_windows=100, window_ttl_s=60)
    for k in range(10_000):
        t = T0 + k * 1_000_000
        exporter.add([Measurement(H, t, f"step-{k}", k, t - S, t, 1.0, {0: 1.0, 1: 2.0})])
    got = scrape(exporter)
    # The 100 most recently finished names, with their per-device series, and nothing else.
    names = {dict(labels)["window"] for labels in got["zeus_windows_total"]}
    assert names == {f"step-{k}" for k in range(9_900, 10_000)}
    assert len(got["zeus_window_last_energy_joules"]) == 200
    assert got["zeus_exporter_evicted_series_total"] == {lab(kind="window"): 9_900.0}
    assert exporter.evicted_windows == 9_900
    # A name finished again moves to the back of the line.
    t = T0 + 10_000 * 1_000_000
    exporter.add([Measurement(H, t, "step-9900", 1, t - S, t, 1.0, {0: 1.0})])
    exporter.add([Measurement(H, t, "new", 2, t - S, t, 1.0, {0: 1.0})])
    names = {dict(labels)["window"] for labels in scrape(exporter)["zeus_windows_total"]}
    assert "step-9900" in names and "step-9901" not in names and "new" in names
    # Names idle for over window_ttl_s of the host's event time go at the next scrape.
    later = t + 61 * S
    exporter.add([Measurement(H, later, "fresh", 3, later - S, later, 1.0, {0: 1.0})])
    names = {dict(labels)["window"] for labels in scrape(exporter)["zeus_windows_total"]}
    assert names == {"fresh"}
    assert len(scrape(exporter)["zeus_window_last_energy_joules"]) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"names": "datadog"}, "names must be one of native, dcgm"),
        ({"max_windows": 0}, "max_windows must be at least 1"),
        ({"window_ttl_s": 0}, "window_ttl_s must be positive"),
    ],
)
def test_bad_exporter_options_are_config_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PrometheusExporter(**kwargs)  # type: ignore[arg-type]


# -- against a real Prometheus server -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prometheus_bin() -> str:
    """The Prometheus server binary; skip (or fail, when it is required) without one."""
    path = shutil.which("prometheus")
    if path is None:
        reason = "the Prometheus server is not installed (apt-get install prometheus)"
        if os.environ.get("ZEUS_ASYNC_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(reason + " and ZEUS_ASYNC_REQUIRE_PROMETHEUS=1 is set")
        pytest.skip(reason)
    return path


def wait_for(what: str, deadline: float, poll: Callable[[], object], log: Path) -> None:
    while True:
        try:
            if poll():
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"timed out waiting for {what}; prometheus log:\n{tail}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_real_prometheus_scrapes_the_exporter(tmp_path: Path) -> None:
    binary = prometheus_bin()
    exporter = rich_exporter()
    exporter.add(
        [
            RaplSample(H, T0, 1, "dram", energy_j=98_765.5, power_w=12.5),
            ProcessSample(H, T0, 4242, gpu=0, attributed_power_w=187.5),
        ]
    )
    dcgm = PrometheusExporter(names="dcgm")  # the same GPUs under dcgm-exporter's names
    dcgm.add([stream_info(), full_gpu(T0, 0), full_gpu(T0, 1)])
    with exporter, dcgm:
        port, dcgm_port = exporter.serve(0), dcgm.serve(0)
        web = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: zeus\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{port}']\n"
            "  - job_name: dcgm\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{dcgm_port}']\n"
        )
        log = tmp_path / "prometheus.log"
        base = f"http://127.0.0.1:{web}"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{web}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 30
            wait_for("/-/ready", deadline, lambda: get(f"{base}/-/ready")[0], log)

            def query(q: str) -> list[dict[str, object]]:
                url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": q})
                data = json.loads(get(url)[0])
                assert data["status"] == "success", data
                result: list[dict[str, object]] = data["data"]["result"]
                return result

            queries = {
                'zeus_gpu_power_watts{gpu="0"}': 312.5,
                'zeus_rapl_energy_joules_total{package="1",domain="dram"}': 98_765.5,
                'zeus_process_gpu_power_watts{pid="4242",gpu="0"}': 187.5,
                'zeus_window_last_energy_joules{device="gpu:0"}': 3.0,
            }
            deadline = time.monotonic() + 20
            wait_for("the first scrape", deadline, lambda: all(query(q) for q in queries), log)
            for q, expected in queries.items():
                (series,) = query(q)
                metric, value = series["metric"], series["value"]
                assert isinstance(metric, dict) and isinstance(value, list)
                assert float(value[1]) == expected, (q, series)
                assert metric["host"] == H and metric["job"] == "zeus"
            assert query('zeus_process_gpu_power_watts{pid="4242"}')[0]["metric"] == {
                "__name__": "zeus_process_gpu_power_watts",
                "host": H,
                "pid": "4242",
                "gpu": "0",
                "instance": f"127.0.0.1:{port}",
                "job": "zeus",
            }
            # Queries as NVIDIA's dcgm-exporter dashboard (Grafana 12239) writes them.
            dashboard = {
                'avg(DCGM_FI_DEV_GPU_TEMP{instance=~".+", gpu=~"0|1"})': 61.0,
                'sum(DCGM_FI_DEV_POWER_USAGE{instance=~".+", gpu=~"0|1"})': 312.5 + 313.5,
                'DCGM_FI_DEV_SM_CLOCK{gpu="0"} * 1000000': 1.98e9,
                'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="1"} / 1000': 1_500_000.5,
                'DCGM_FI_DEV_GPU_UTIL{gpu="0"}': 75.0,
            }
            wait_for("the dcgm scrape", deadline, lambda: all(query(q) for q in dashboard), log)
            for q, expected in dashboard.items():
                (series,) = query(q)
                assert float(series["value"][1]) == pytest.approx(expected), (q, series)  # type: ignore[index]
            (power,) = query('DCGM_FI_DEV_POWER_USAGE{gpu="0"}')
            assert power["metric"] == {
                "__name__": "DCGM_FI_DEV_POWER_USAGE",
                "gpu": "0",
                "UUID": "GPU-00000000-abcd",
                "device": "nvidia0",
                "modelName": "NVIDIA H100 80GB HBM3",
                "Hostname": H,
                "host": H,
                "instance": f"127.0.0.1:{dcgm_port}",
                "job": "dcgm",
            }
            assert all(u["value"][1] == "1" for u in query("up"))  # type: ignore[index]
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
