"""Simulated figures say so wherever they go: recording header, inspect, plot titles,
Prometheus series, StreamInfo (issue 34: `curl :9466/metrics | grep -ci sim` gave 0)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import anyio
import pytest

from zeus_async.runtime import Runtime
from zeus_async.store import RecordingReader


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.anyio
async def test_a_simulated_runtime_says_so_in_its_recording_and_stream(tmp_path: Path) -> None:
    path = tmp_path / "run.zarc"
    async with Runtime(backend="sim", cpus=None, record=path, meta={"job": "j1"}) as rt:
        assert rt.stream_info().meta == {"job": "j1", "simulated": "true"}
        await anyio.sleep(0.05)
    assert RecordingReader(path).header.meta == {"job": "j1", "simulated": "true"}


def test_inspect_says_a_recording_is_simulated(tmp_path: Path) -> None:
    path = tmp_path / "run.zarc"
    py = [sys.executable, "-m", "zeus_async"]
    made = subprocess.run(
        [*py, "monitor", "--backend", "sim", "--duration", "0.5", "--quiet", "--record", path],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    shown = subprocess.run(
        [*py, "inspect", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0, shown.stderr
    assert (
        "SIMULATED   every GPU figure here comes from the simulator, not from hardware"
        in shown.stdout.splitlines()
    )
    from zeus_async.store.plot import _default_title

    assert _default_title(RecordingReader(path)).startswith("GPU power (SIMULATED GPUs) — ")


def test_prometheus_labels_simulated_gpus() -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeus_async", "exporter", "--backend", "sim", "--port", str(port),
         "--cpus", "none", "--duration", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert "backend sim" in proc.stdout.readline()
        deadline = time.monotonic() + 20
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            power = [line for line in text.splitlines() if line.startswith("zeus_gpu_power_watts")]
            if power or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert power and all('simulated="true"' in line for line in power), power
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
