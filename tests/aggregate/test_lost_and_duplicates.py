"""A lost device contributes no energy after it was lost; a duplicated or late sample never
changes a total (issue 34, item 3)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from test_windows import MS, run_windows, square_config

from zeus_async.aggregate.history import DeviceHistory
from zeus_async.devices.sim_config import GpuOverride
from zeus_async.events import DeviceInfo, Event, GpuSample, ProcessSample, RaplSample, StreamInfo
from zeus_async.store import RecordingHeader, write_recording
from zeus_async.store.analysis import Recording


def test_a_window_after_a_gpu_was_lost_gets_nothing_from_it() -> None:
    # gpu:1 is lost 0.9 s after the clock starts. The first window (0.5 s .. 1.5 s) spans the
    # loss, the second (1.7 s .. 2.7 s) lies wholly after it.
    start = 1_760_000_000_000_000_000 + 3 * MS
    config = square_config(epoch_ns=start, gpus=(GpuOverride(), GpuOverride(lost_at_s=0.9)))
    results, _, _ = anyio.run(run_windows, config, [(0, 1000), (200, 1000)])
    spans, after = results[0].wait(0), results[1].wait(0)
    assert spans.lost == after.lost == ["gpu:1"]
    # Before: 133 J for gpu:1 in the window after the loss (its last power held on).
    assert after.gpu_energy_j[1] == 0.0 and after.methods["gpu:1"] == "lost"
    assert after.gpu_energy_j[0] > 0 and after.methods["gpu:0"] == "counter+interpolated"
    # Up to the loss only (before: 133 J, the last reading held to the window's end).
    assert spans.methods["gpu:1"].endswith(", lost")
    assert 0 < spans.gpu_energy_j[1] < 20.0


def test_energy_of_a_lost_device_stops_at_the_loss() -> None:
    h = DeviceHistory("gpu:0")
    for k in range(101):  # 100 W for 1 s, no counter
        h.add(k * 10 * MS, 100.0, None)
    h.mark_lost(1_000 * MS)
    assert h.energy(500 * MS, 2_000 * MS).energy_j == pytest.approx(50.0)
    assert h.energy(500 * MS, 2_000 * MS).method == "integrated, lost"
    lost = h.energy(1_000 * MS, 3_000 * MS)
    assert (lost.energy_j, lost.method) == (0.0, "lost")
    assert h.energy(100 * MS, 600 * MS).method == "integrated"  # before the loss: unchanged


T0 = 1_000_000_000
HOST = "n"
DEVICES = [
    DeviceInfo(key="gpu:0", name="P100", arch="pascal"),
    DeviceInfo(key="gpu:1", name="H100", arch="hopper", has_energy_counter=True),
    DeviceInfo(key="cpu:0", name="Xeon", arch="cpu"),
]


def _events() -> list[Event]:
    """0.2 s at 100 W everywhere: 20 J per device and for the process on gpu:0."""
    events: list[Event] = [StreamInfo(HOST, T0 - 5 * MS, "s1", devices=DEVICES)]
    for k in range(21):
        t = T0 + k * 10 * MS
        events.append(GpuSample(HOST, t, 0, power_w=100.0))
        events.append(GpuSample(HOST, t, 1, power_w=100.0, energy_j=1000.0 + k))
        events.append(RaplSample(HOST, t, 0, "package", 1.0 * k, 100.0))
        events.append(
            ProcessSample(HOST, t, 42, gpu=0, attributed_power_w=100.0, attributed_energy_j=1.0 * k)
        )
        events.append(ProcessSample(HOST, t, 42, cpu_energy_j=1.0 * k))
    return events


def _totals(tmp_path: Path, events: list[Event]) -> dict[str, float | None]:
    path = tmp_path / f"r{len(list(tmp_path.iterdir()))}.zarc"
    write_recording(path, events, RecordingHeader(host=HOST, start_wall_ns=T0, devices=DEVICES))
    rec = Recording(path)
    totals = rec.totals()
    process = totals.processes["42"]
    return {
        **{key: d.energy_j for key, d in totals.devices.items()},
        "all GPUs": totals.gpu_energy_j,
        "process GPU": process.gpu_energy_j[0],
        "process CPU": process.cpu_energy_j,
        "process time": process.duration_s,
        "gpu.power_w": rec.total("gpu.power_w"),
        "rapl.energy_j": rec.total("rapl.energy_j"),
    }


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_late_duplicate_never_changes_a_total(tmp_path: Path, which: str) -> None:
    events = _events()
    clean = _totals(tmp_path, events)
    assert clean == {
        "gpu:0": pytest.approx(20.0),
        "gpu:1": pytest.approx(20.0),
        "cpu:0/package": pytest.approx(20.0),
        "all GPUs": pytest.approx(40.0),
        "process GPU": 20.0,
        "process CPU": 20.0,
        "process time": pytest.approx(0.2),
        "gpu.power_w": pytest.approx(40.0),
        "rapl.energy_j": pytest.approx(20.0),
    }
    # The samples of one instant (every device's and the process's) sent again at the end,
    # as a publisher retrying, or a stream delivering late, would. Before: the process's GPU
    # and CPU energy, its time and the integrated power ended at the duplicate (0 J for the
    # first instant's, 10 J for the middle one's); the last instant's is the control.
    index = {"first": 1, "middle": 1 + 5 * 10, "last": len(events) - 5}[which]
    duplicated = events + events[index : index + 5]
    assert _totals(tmp_path, duplicated) == clean
