"""A rotated recording is one recording: every reader and command reads all its parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run_cli

from zeus_async.events import DeviceInfo, Event, GpuSample, StreamInfo
from zeus_async.store import Recorder, RecordingHeader, RecordingReader, recording_parts
from zeus_async.store.analysis import Recording
from zeus_async.testing.recording import record_events

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
DEVICES = [DeviceInfo(key="gpu:0", name="H100", arch="hopper", has_energy_counter=True)]
HEADER = RecordingHeader(
    host="node1", start_wall_ns=T0, pid=1, argv=["train.py"], devices=DEVICES, compression="none"
)


def _events(n: int) -> list[Event]:
    out: list[Event] = [StreamInfo("node1", T0, "s1", pid=1, argv=["x"], devices=DEVICES)]
    for i in range(n):  # 300 W steady, counter in step
        out.append(GpuSample("node1", T0 + i * 10 * MS, 0, power_w=300.0, energy_j=3.0 * i))
    return out


def _write(path: Path, events: list[Event]) -> Recorder:
    recorder = Recorder(path, header=HEADER, rotate_bytes=4096, flush_events=50)
    return record_events(recorder, events)


@pytest.fixture
def rotated(tmp_path: Path) -> tuple[Path, list[Event]]:
    events = _events(2000)  # 20 s
    path = tmp_path / "run.zarc"
    recorder = _write(path, events)
    assert len(recorder.paths) >= 3
    return path, events


def test_reader_and_recording_read_every_part(rotated: tuple[Path, list[Event]]) -> None:
    path, events = rotated
    reader = RecordingReader(path)
    assert reader.parts == recording_parts(path) and len(reader.parts) >= 3
    assert list(reader) == events
    assert reader.report.clean and reader.report.parts == [str(p) for p in reader.parts]
    assert reader.size_bytes == sum(p.stat().st_size for p in reader.parts)
    # Random access across parts.
    t = T0 + 1234 * 10 * MS
    assert list(reader.events_between(t, t + 50 * MS)) == [
        e for e in events if t <= e.t_ns < t + 50 * MS
    ]
    assert list(reader.seek_time(t)) == [e for e in events if e.t_ns >= t]
    offsets = [off for off, _ in reader.frame_index()]
    assert offsets == sorted(offsets) and offsets[-1] > reader.parts[0].stat().st_size
    rec = Recording(path)
    assert rec.duration_s == pytest.approx(19.99)
    assert rec.totals().devices["gpu:0"].energy_j == pytest.approx(3.0 * 1999)


def test_damage_is_reported_per_part(rotated: tuple[Path, list[Event]]) -> None:
    path, _ = rotated
    second = recording_parts(path)[1]
    data = bytearray(second.read_bytes())
    data[-100] ^= 0xFF  # inside the last frame of part 1
    second.write_bytes(bytes(data))
    reader = RecordingReader(path)
    list(reader)
    ((_, reason),) = reader.report.corrupt_frames
    assert reason.startswith("run.1.zarc: ")
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "DAMAGED" in proc.stdout and "run.1.zarc: " in proc.stdout


def test_commands_read_every_part(rotated: tuple[Path, list[Event]], tmp_path: Path) -> None:
    path, events = rotated
    n = len(events)
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    assert f"events {n} (complete)" in proc.stdout
    assert "duration    19.990 s" in proc.stdout
    assert "parts       " in proc.stdout
    out = tmp_path / "all.jsonl"
    proc = run_cli("export", str(path), "--format", "jsonl", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == n and json.loads(lines[-1])["t_ns"] == events[-1].t_ns
    proc = run_cli("replay", str(path), "--speed", "max")
    assert proc.returncode == 0, proc.stderr
    assert f"replayed {n} events" in proc.stdout


def test_a_part_read_alone_says_which_part_of_which_recording_it_is(
    rotated: tuple[Path, list[Event]], tmp_path: Path
) -> None:
    """Issue 34: `inspect run.3.zarc` said "complete" with no hint that it was part 4 of 7."""
    path, _ = rotated
    parts = recording_parts(path)
    n = len(parts)
    third = parts[2]
    assert third.name == "run.2.zarc"
    whole = f"part 3 of {n} of run.zarc (read run.zarc for the whole recording)"
    proc = run_cli("inspect", str(third))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1] == f"part        3 of {n} of run.zarc (read run.zarc for the whole recording)"
    assert any(line.endswith("(this part complete)") for line in lines), proc.stdout
    assert f"This file is {whole}" in str(Recording(third)).splitlines()
    # the first file, and a recording never rotated, are not parts of anything
    assert RecordingReader(path).part_of is None and Recording(path).part_of is None
    proc = run_cli("inspect", str(path))
    assert "part   " not in proc.stdout and "(complete)" in proc.stdout
    # a part before it missing, the first file missing, a part renamed
    parts[1].rename(tmp_path / "aside.zarc")
    assert (
        str(RecordingReader(third).part_of)
        == "part 3 of run.zarc, whose part 2 (run.1.zarc) is missing"
    )
    path.rename(tmp_path / "first.zarc")
    assert str(RecordingReader(third).part_of) == "part 3 of run.zarc, which is missing"
    third.rename(tmp_path / "renamed.zarc")
    assert str(RecordingReader(tmp_path / "renamed.zarc").part_of) == (
        "part 3 of a rotated recording (renamed: its other parts are not found)"
    )
