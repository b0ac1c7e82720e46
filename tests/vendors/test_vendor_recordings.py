"""Recordings on every vendor's simulator: record, replay, the same window energies; the
devices' vendor, energy method and capabilities survive the round trip; a recording made
before those fields existed still reads, with defaults. The CLI: ``monitor --backend
sim-<vendor>`` and ``inspect`` of what it recorded (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
from vendor_cases import T0, VendorCase

from zeus_async.aggregate.windows import ReplayedWindows
from zeus_async.clock import FakeClock
from zeus_async.devices.sim_workload import SquareWorkload
from zeus_async.events import DeviceInfo, Measurement
from zeus_async.runtime import Runtime
from zeus_async.store import RecordingReader
from zeus_async.testing.replay import ReplayRun

MS = 1_000_000


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def figures(m: Measurement) -> tuple[object, ...]:
    """Everything but the finalization stamp ``t_ns``."""
    return (m.name, m.window_id, m.start_ns, m.end_ns, m.time_s, m.gpu_energy_j, m.methods)


@pytest.mark.anyio
async def test_record_replay_same_windows_and_device_facts(
    vendor: VendorCase, tmp_path: Path, replay: Callable[..., Awaitable[ReplayRun]]
) -> None:
    config = vendor.config(
        num_gpus=min(2, vendor.num_gpus),
        workload=SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1),
        seed=7,
    )
    path = tmp_path / f"{vendor}.zarc"
    clock = FakeClock(wall_start_ns=T0)
    async with Runtime(
        backend=vendor.backend,
        cpus=None,
        sim_config=config,
        clock=clock,
        windows=True,
        record=path,
    ) as rt:
        live_info = [d.describe() for d in rt.devices if d.key.startswith("gpu:")]
        results = []
        for k, length in enumerate((50, 700, 2000)):
            await clock.sleep_until(clock.monotonic_ns() + (100 + 13 * k) * MS)
            async with rt.window(f"w{k}") as w:
                await clock.sleep_until(clock.monotonic_ns() + length * MS)
            assert w.result is not None
            results.append(w.result)
        live = [await r.wait_async() for r in results]

    reader = RecordingReader(path)
    assert reader.header.devices == live_info  # vendor, method, note, capabilities, scope
    for info in reader.header.devices:
        assert info.vendor == vendor.device_vendor
        assert info.capabilities is not None
        assert info.capabilities.power_cap == vendor.power_cap
        assert info.energy_method == ("counter" if vendor.energy_counter else "integrated-power")

    # Offline (inspect, analysis) and replayed into a runtime: the live figures, exactly.
    windows = ReplayedWindows(reader.header.devices)
    for event in RecordingReader(path):
        windows.add(event)
    offline = {m.name: m for m in windows.finish()}
    run = await replay(path, speed=None)
    replayed = {m.name: m for m in run.measurements}
    for m in live:
        assert figures(offline[m.name]) == figures(m)
        assert figures(replayed[m.name]) == figures(m)
        assert all(e > 0 for e in m.gpu_energy_j.values())


def test_an_old_recording_reads_with_default_device_facts(recordings: Path) -> None:
    """``sim_windows.zarc`` was recorded before vendors were named."""
    reader = RecordingReader(recordings / "sim_windows.zarc")
    infos = reader.header.devices
    assert [d.key for d in infos] == ["gpu:0", "gpu:1"]
    for d in infos:
        assert (d.vendor, d.energy_method, d.energy_note, d.capabilities, d.power_scope) == (
            "",
            "",
            "",
            None,
            "",
        )
    assert [d.has_energy_counter for d in infos] == [True, False]  # what it did say
    # A device description of today decodes an old one's array, and the other way round.
    old = msgspec.msgpack.encode(infos[0])
    assert msgspec.msgpack.decode(old, type=DeviceInfo) == infos[0]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ZEUS_ASYNC_SIM"}
    return subprocess.run(
        [sys.executable, "-m", "zeus_async", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_cli_monitor_and_inspect(vendor: VendorCase, tmp_path: Path) -> None:
    path = tmp_path / f"{vendor}.zarc"
    backend = vendor.backend
    proc = _cli(
        "monitor",
        "--backend",
        backend,
        "--duration",
        "1",
        "--cpus",
        "none",
        "-q",
        "--record",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr
    assert f"backend {backend} (SIMULATED GPUs)" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.split("Totals")[1].strip().splitlines()[1:]]
    gpus = [r for r in rows if r[0].startswith("gpu:")]
    assert len(gpus) == vendor.num_gpus, proc.stdout
    config = vendor.config()
    for row in gpus:
        energy, seconds, mean_w = float(row[1]), float(row[2]), float(row[3])
        assert 0.5 < seconds < 5.0 and energy > 0
        # A 1 s run: its two ends are extrapolated from the readings (with the demo's noise).
        assert config.idle_w * 0.9 <= mean_w <= config.max_w * 1.03, row

    shown = _cli("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    reader = RecordingReader(path)
    assert [d.vendor for d in reader.header.devices if d.key.startswith("gpu:")] == [
        vendor.device_vendor
    ] * vendor.num_gpus
    for d in reader.header.devices:
        assert d.key in shown.stdout
    assert config.name.split()[0] in shown.stdout, shown.stdout
