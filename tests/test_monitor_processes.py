"""A monitor with process tracking, model metadata and a Prometheus endpoint (real processes)."""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zeus_async import Monitor
from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload
from zeus_async.events import ProcessSample, StreamInfo
from zeus_async.runtime import ProcessTracking
from zeus_async.store import RecordingReader

torch = pytest.importorskip("torch")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_monitor_tracks_this_process_and_serves_prometheus(tmp_path: Path, sampler: str) -> None:
    me = str(os.getpid())
    sim = SimConfig(num_gpus=2, process_pids=(os.getpid(),), workload=ConstantWorkload(util=0.6))
    model = torch.nn.Linear(16, 4)
    path = tmp_path / "run.zarc"
    with Monitor(
        backend="sim",
        cpu_indices=[],
        sim_config=sim,
        sampler=sampler,
        record=path,
        processes=ProcessTracking(period_s=0.2),
        model=model,
        input_size=(8, 16),
        meta={"job": "test"},
        prometheus_port=0,
    ) as mon:
        assert mon.model_complexity is not None
        assert mon.model_complexity.macs == 8 * 16 * 4
        port = mon.prometheus_port
        assert port is not None and port > 0
        deadline = time.monotonic() + 20
        while True:
            values = scrape(port)
            key = ("zeus_process_gpu_power_watts", (("gpu", "1"), ("host", os.uname().nodename),
                                                    ("pid", me)))  # fmt: skip
            if key in values or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert key in values, sorted({name for name, _ in values})
        # The only process on the simulated GPU: all its power is attributed to us.
        (gpu_labels, gpu_power), *_ = [
            (dict(labels), v)
            for (name, labels), v in values.items()
            if name == "zeus_gpu_power_watts" and ("gpu", "1") in labels
        ]
        assert values[key] > 0.5 * gpu_power
        # The stream described the GPU: dcgm-exporter's identifying labels are on it too.
        assert gpu_labels["host"] == gpu_labels["Hostname"] == os.uname().nodename
        assert gpu_labels["UUID"].startswith("GPU-") and gpu_labels["modelName"]
        mon.begin_window("w")
        mon.end_window("w")
        agent = mon._process._proc.pid if mon._process and mon._process._proc else None
    reader = RecordingReader(path)
    assert reader.header.meta["model.macs"] == str(8 * 16 * 4)
    assert reader.header.meta["job"] == "test"
    events = list(reader)
    (info,) = [e for e in events if isinstance(e, StreamInfo)]
    assert info.meta == reader.header.meta
    procs = [e for e in events if isinstance(e, ProcessSample)]
    host_side = {e.pid for e in procs if e.gpu is None}
    assert os.getpid() in host_side
    if sampler == "process":
        # The sampler process is a child of this one, but never tracked (other children of
        # this test process, left by earlier tests in the same session, may be).
        assert agent is not None and agent not in host_side
    on_gpu = [e for e in procs if e.gpu is not None and e.pid == os.getpid()]
    assert {e.gpu for e in on_gpu} == {0, 1}
    assert all(e.gpu_power_share_frac == 1.0 for e in on_gpu)
    assert max(e.attributed_energy_j or 0.0 for e in on_gpu) > 0
