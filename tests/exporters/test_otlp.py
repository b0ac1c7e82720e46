"""OpenTelemetry export: a real OTLP/HTTP receiver (in this test) decodes what we push with
the official ``opentelemetry-proto`` package."""

from __future__ import annotations

import gzip
import http.server
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from zeus_async.errors import ConfigError
from zeus_async.events import DeviceInfo, GpuSample, Measurement, RaplSample, StreamInfo

pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.metrics.v1.metrics_service_pb2",
    reason="needs the otel extra (pip install 'zeus_async[otel]')",
)

H = "node1"
T0 = 1_763_000_000_000_000_000


class Receiver:
    """An OTLP/HTTP metrics endpoint: keeps every request, decoded."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        received = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                assert self.path == "/v1/metrics"
                assert self.headers["Content-Type"] == "application/x-protobuf"
                request = pb2.ExportMetricsServiceRequest()
                request.ParseFromString(body)
                received.append(request)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(pb2.ExportMetricsServiceResponse().SerializeToString())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def points(self) -> Iterator[tuple[dict[str, Any], str, Any, dict[str, Any]]]:
        """(resource attributes, metric name, metric, point attributes) of every point."""
        for request in self.requests:
            for rm in request.resource_metrics:
                resource = {a.key: _value(a.value) for a in rm.resource.attributes}
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        for point in getattr(metric, kind).data_points:
                            attributes = {a.key: _value(a.value) for a in point.attributes}
                            yield resource, metric.name, (kind, metric, point), attributes


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value"))


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def test_points_resource_and_conventions(receiver: Receiver) -> None:
    from zeus_async.exporters.otlp import OtlpExporter

    exporter = OtlpExporter(receiver.url, interval_s=60, resource={"job": "test", "rank": "0"})
    devices = [DeviceInfo("gpu:0", "NVIDIA H100 80GB HBM3", uuid="GPU-abc")]
    exporter.add(
        [
            StreamInfo(H, T0, "s", devices=devices),
            GpuSample(H, T0, 0, power_w=312.5, energy_j=1500.25, utilization_frac=0.75),
            GpuSample(H, T0, 1, power_w=70.0),
            RaplSample(H, T0, 0, "package", energy_j=99.5, power_w=40.0),
            Measurement(H, T0, "step", 1, T0 - 10**9, T0, 1.0, {0: 3.0}),
            Measurement(H, T0, "step", 2, T0 - 10**9, T0, 1.0, {0: 4.0}),
        ]
    )
    assert exporter.flush()
    exporter.close()
    points = list(receiver.points())
    assert points
    resource = points[0][0]
    assert resource["service.name"] == "zeus_async" and resource["job"] == "test"
    assert resource["rank"] == "0" and resource["host.name"]
    by = {
        (name, attrs.get("hw.id")): (kind, metric, p)
        for _, name, (kind, metric, p), attrs in points
    }
    # A described GPU is named by its UUID and model; another by its index.
    kind, metric, p = by[("hw.power", "GPU-abc")]
    assert kind == "gauge" and metric.unit == "W" and p.as_double == 312.5
    assert by[("hw.power", "gpu:1")][2].as_double == 70.0
    assert by[("hw.power", "cpu:0/package")][2].as_double == 40.0
    kind, metric, p = by[("hw.energy", "GPU-abc")]
    assert kind == "sum" and metric.sum.is_monotonic and metric.unit == "J"
    assert metric.sum.aggregation_temporality == 2  # cumulative
    assert p.as_double == 1500.25
    assert by[("hw.gpu.utilization", "GPU-abc")][2].as_double == 0.75
    assert by[("zeus.window.energy", "gpu:0")][2].as_double == 7.0
    assert by[("zeus.window.count", "gpu:0")][2].as_double == 2.0
    gpu0 = next(a for _, n, _, a in points if n == "hw.power" and a["hw.id"] == "GPU-abc")
    assert gpu0 == {
        "hw.id": "GPU-abc",
        "hw.type": "gpu",
        "hw.name": "NVIDIA H100 80GB HBM3",
        "host.name": H,
        "zeus.gpu.index": 0,
    }


def test_workload_energy_points_carry_the_workloads_attributes(receiver: Receiver) -> None:
    from zeus_async.events import WorkloadChange, WorkloadEnergy
    from zeus_async.exporters.otlp import OtlpExporter

    exporter = OtlpExporter(receiver.url, interval_s=60)
    devices = [DeviceInfo("gpu:0", "NVIDIA H100 80GB HBM3", uuid="GPU-abc")]
    pod = "k8s:ml/train-0/main"
    exporter.add(
        [
            StreamInfo(H, T0, "s", devices=devices),
            WorkloadChange(H, T0, "slurm:4711", "started", "slurm", [0], "4711", "alice", 1001),
            WorkloadChange(
                H,
                T0,
                pod,
                "started",
                "kubernetes",
                [1],
                namespace="ml",
                pod="train-0",
                container="main",
            ),
            WorkloadChange(H, T0, "slurm:9", "started", "slurm", [0], "9"),
            WorkloadEnergy(H, T0, "slurm:4711", {0: 1234.5}),
            WorkloadEnergy(H, T0, pod, {1: 99.0}),
            WorkloadEnergy(H, T0, "slurm:9", {0: 1.0}),
            WorkloadChange(H, T0, "slurm:9", "expired", "slurm"),
        ]
    )
    assert exporter.flush()
    exporter.close()
    points = {
        a["zeus.workload"]: (a, p.as_double)
        for _, n, (_, _, p), a in receiver.points()
        if n == "zeus.workload.energy"
    }
    assert set(points) == {"slurm:4711", pod}
    attrs, value = points["slurm:4711"]
    assert value == 1234.5
    assert attrs == {
        "zeus.workload": "slurm:4711",
        "zeus.workload.kind": "slurm",
        "slurm.job.id": "4711",
        "user.name": "alice",
        "hw.id": "GPU-abc",
        "hw.type": "gpu",
        "hw.name": "NVIDIA H100 80GB HBM3",
        "host.name": H,
        "zeus.gpu.index": 0,
    }
    attrs, value = points[pod]
    assert value == 99.0 and attrs["k8s.pod.name"] == "train-0"
    assert attrs["k8s.namespace.name"] == "ml" and attrs["k8s.container.name"] == "main"


def test_window_names_are_capped(receiver: Receiver) -> None:
    from zeus_async.exporters.otlp import OtlpExporter

    exporter = OtlpExporter(receiver.url, interval_s=60, max_windows=10)
    exporter.add(
        [Measurement(H, T0 + k, f"w{k}", k, T0, T0 + k, 1.0, {0: 1.0}) for k in range(1000)]
    )
    assert exporter.flush()
    exporter.close()
    names = {a["zeus.window"] for _, n, _, a in receiver.points() if n == "zeus.window.energy"}
    assert names == {f"w{k}" for k in range(990, 1000)}
    evicted = [p for _, n, (_, _, p), _ in receiver.points() if n == "zeus.exporter.evicted"]
    assert evicted[-1].as_int == 990 or evicted[-1].as_double == 990


@pytest.mark.parametrize(
    ("endpoint", "kwargs", "match"),
    [
        ("localhost:4318", {}, "http:// or https:// URL"),
        ("http://x", {"interval_s": 0}, "interval_s must be positive"),
        ("http://x", {"max_windows": 0}, "max_windows must be at least 1"),
    ],
)
def test_bad_options(endpoint: str, kwargs: dict[str, Any], match: str) -> None:
    from zeus_async.exporters.otlp import OtlpExporter

    with pytest.raises(ConfigError, match=match):
        OtlpExporter(endpoint, **kwargs)


def test_a_live_runtime_pushes_on_its_interval(receiver: Receiver) -> None:
    import anyio

    from zeus_async.devices.sim import SimConfig
    from zeus_async.runtime import Runtime
    from zeus_async.testing import sim_pynvml

    async def main() -> None:
        async with Runtime(
            backend="sim",
            cpus=None,
            sim_config=SimConfig(num_gpus=2),
            otlp=receiver.url,
            otlp_interval_s=0.2,
            meta={"job": "live"},
        ):
            deadline = time.monotonic() + 10
            while not any(n == "hw.power" for _, n, _, _ in receiver.points()):
                assert time.monotonic() < deadline, "no export arrived"
                await anyio.sleep(0.1)

    try:
        anyio.run(main)
    finally:
        sim_pynvml.uninstall()
    power = [(r, a) for r, n, _, a in receiver.points() if n == "hw.power"]
    assert {a["zeus.gpu.index"] for _, a in power} == {0, 1}
    assert all(a["hw.id"].startswith("GPU-") for _, a in power)  # the runtime described them
    assert power[0][0]["job"] == "live"


def test_monitor_cli_and_class_push_with_rank_attributes(receiver: Receiver) -> None:
    import subprocess
    import sys

    from zeus_async import Monitor
    from zeus_async.devices.sim import SimConfig
    from zeus_async.testing.procs import sim_env

    proc = subprocess.run(
        [sys.executable, "-m", "zeus_async", "monitor", "--backend", "sim", "--cpus", "none",
         "--quiet", "--duration", "1.5", "--otlp", receiver.url, "--otlp-interval", "0.3"],
        env=sim_env(SimConfig()), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    gpus = {a["zeus.gpu.index"] for _, n, _, a in receiver.points() if n == "hw.power"}
    assert gpus == {0, 1, 2, 3}
    receiver.requests.clear()
    # Monitor(otlp=...) on a rank: the agent pushes, with the rank in the resource.
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with Monitor(
            backend="sim", cpu_indices=[], sim_config=SimConfig(), otlp=receiver.url,
            otlp_interval_s=0.2, agent=False,
        ) as mon:  # fmt: skip
            deadline = time.monotonic() + 10
            while not any(n == "hw.power" for _, n, _, _ in receiver.points()):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert mon.gpu_indices == [1]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        from zeus_async.testing import sim_pynvml

        sim_pynvml.uninstall()
    resource = next(r for r, n, _, _ in receiver.points() if n == "hw.power")
    assert resource["rank"] == "1" and resource["world_size"] == "2"


def test_an_unreachable_collector_is_one_line_and_never_holds_up_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import socket

    from zeus_async.exporters.otlp import OtlpExporter

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    exporter = OtlpExporter(url, interval_s=0.5)
    exporter.add([GpuSample(H, T0, 0, power_w=100.0)])
    with caplog.at_level("WARNING"):
        assert not exporter.flush()
        assert not exporter.flush()
        started = time.monotonic()
        exporter.close()
    assert time.monotonic() - started < 3.0
    assert exporter.failed_exports >= 2
    ours = [r for r in caplog.records if "OTLP export" in r.getMessage()]
    assert len(ours) == 1 and url in ours[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
