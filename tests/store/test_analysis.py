"""Recording analysis: series, energy over intervals, totals, windows, export (hand-built
recordings with exact values, and a simulator run checked against its ground truth)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

import zeus_async.store.progress as progress_module
from zeus_async.aggregate.history import DeviceHistory
from zeus_async.clock import FakeClock
from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_config import GpuOverride
from zeus_async.devices.sim_workload import ConstantWorkload, SquareWorkload
from zeus_async.errors import ConfigError
from zeus_async.events import (
    EVENT_TYPES,
    ClockChange,
    DeviceFault,
    DeviceInfo,
    Event,
    GpuSample,
    Heartbeat,
    Measurement,
    PowerLimitChange,
    ProcessSample,
    RaplSample,
    StreamInfo,
    WindowClose,
    WindowOpen,
    event_to_dict,
)
from zeus_async.runtime import Runtime
from zeus_async.store import RecordingHeader, RecordingReader, write_recording
from zeus_async.store.analysis import (
    PROGRESS_EVERY,
    Recording,
    csv_columns,
    export_csv,
    export_jsonl,
)
from zeus_async.testing import sim_pynvml

MS = 1_000_000
T0 = 1_000_000_000  # small enough that every time is exact as a float
H = "node1"
# Energy of each 100 ms counter period of gpu:0 (J); the power reading stays at 200 W.
PERIODS = [20.0, 30.0] * 5
HEADER = RecordingHeader(
    host=H,
    start_wall_ns=T0 - 5 * MS,
    devices=[
        DeviceInfo(key="gpu:0", name="H100", arch="hopper", has_energy_counter=True),
        DeviceInfo(key="gpu:1", name="P100", arch="pascal"),
        DeviceInfo(key="cpu:0", name="Xeon", arch="cpu"),
    ],
)
MEASUREMENT = Measurement(
    H,
    T0 + 1010 * MS,
    "step",
    1,
    T0 + 100 * MS,
    T0 + 600 * MS,
    0.5,
    {0: 125.0, 1: 80.0},
    {0: 45.0},
    {0: 5.0},
    {"gpu:0": "counter+interpolated", "gpu:1": "integrated"},
    [],
)


def hand_events() -> list[Event]:
    """gpu:0 with a counter, pre-Volta gpu:1, RAPL package + dram, two processes, a window."""
    events: list[Event] = [StreamInfo(H, T0 - 5 * MS, "s1", devices=HEADER.devices)]
    counter = 1000.0
    for k in range(101):
        t = T0 + k * 10 * MS
        if k and k % 10 == 0:
            counter += PERIODS[k // 10 - 1]
        temp = 50.0 + k // 10 if k % 10 == 0 else None
        events.append(GpuSample(H, t, 0, power_w=200.0, energy_j=counter, temperature_c=temp))
        if k % 50 == 0:
            half = k // 50
            events.append(GpuSample(H, t, 1, power_w=[100.0, 200.0, 100.0][half]))
            events.append(
                RaplSample(H, t, 0, "package", [0.0, 40.0, 100.0][half], [None, 80.0, 120.0][half])
            )
            if half != 1:
                events.append(RaplSample(H, t, 0, "dram", 5.0 * half, 10.0 if half else None))
            events.append(
                ProcessSample(
                    H, t, 42, cpu_frac=0.25, gpu=0, attributed_power_w=[50.0, 100.0, 50.0][half]
                )
            )
            events.append(ProcessSample(H, t, 43, cpu_frac=0.5))
        if k == 10:
            events.append(WindowOpen(H, T0 + 100 * MS, "step", 1))
        if k == 60:
            events.append(WindowClose(H, T0 + 600 * MS, "step", 1))
    events.append(MEASUREMENT)
    return events


@pytest.fixture
def rec_path(tmp_path: Path) -> Path:
    path = tmp_path / "hand.zarc"
    write_recording(path, hand_events(), HEADER, events_per_frame=16)
    return path


def test_names_duration_and_series(rec_path: Path) -> None:
    rec = Recording(rec_path)
    assert rec.header == HEADER
    assert rec.report.clean and rec.report.events_ok == len(hand_events())
    assert (rec.start_ns, rec.end_ns) == (T0 - 5 * MS, T0 + 1010 * MS)
    assert rec.duration_s == pytest.approx(1.015)
    assert rec.devices() == [
        "gpu:0",
        "gpu:1",
        "cpu:0/dram",
        "cpu:0/package",
        "proc:42/gpu:0",
        "proc:43",
    ]
    assert rec.metrics() == [
        "gpu.power_w",
        "gpu.energy_j",
        "gpu.temperature_c",
        "rapl.energy_j",
        "rapl.power_w",
        "proc.cpu_frac",
        "proc.attributed_power_w",
    ]
    assert rec.metrics("gpu:1") == ["gpu.power_w"]
    assert rec.metrics("cpu:0") == ["rapl.energy_j", "rapl.power_w"]  # cpu:0 = its package
    assert rec.devices("gpu.energy_j") == ["gpu:0"]
    assert rec.devices("proc.cpu_frac") == ["proc:42/gpu:0", "proc:43"]

    temps = rec.series("gpu.temperature_c", "gpu:0")
    assert temps.device == "gpu:0" and temps.metric == "gpu.temperature_c"
    assert temps.t_ns.tolist() == [T0 + k * 100 * MS for k in range(11)]
    assert temps.values.tolist() == [50.0 + k for k in range(11)]  # the None readings are left out
    assert temps.seconds()[:2].tolist() == [0.005, 0.105]
    assert len(temps) == 11
    power = rec.series("rapl.power_w", "cpu:0")
    assert power.device == "cpu:0/package"
    assert power.t_ns.tolist() == [T0 + 500 * MS, T0 + 1000 * MS]
    assert power.values.tolist() == [80.0, 120.0]
    counter = rec.series("gpu.energy_j", "gpu:0")
    assert counter.values[0] == 1000.0 and counter.values[-1] == 1000.0 + sum(PERIODS)
    assert rec.series("proc.attributed_power_w", "proc:42/gpu:0").values.tolist() == [
        50.0,
        100.0,
        50.0,
    ]
    assert rec.windows() == [MEASUREMENT]


def test_energy_over_intervals_is_exact(rec_path: Path) -> None:
    rec = Recording(rec_path)
    # Counter updates are seen at the midpoints 95 ms, 195 ms, ... 995 ms.
    e = rec.energy("gpu:0", T0 + 95 * MS, T0 + 995 * MS)
    assert e.method == "counter+interpolated"
    assert e.energy_j == pytest.approx(sum(PERIODS[1:]), rel=1e-12)
    # Half of period 2 (30 J) and half of period 3 (20 J), split in proportion to time.
    e = rec.energy("gpu:0", T0 + 145 * MS, T0 + 245 * MS)
    assert e.method == "counter+interpolated"
    assert e.energy_j == pytest.approx(25.0, rel=1e-12)
    # Whole span: counter inside, 200 W over the 95 ms before and 5 ms after it.
    e = rec.energy("gpu:0")
    assert e.method == "counter+extrapolated"
    assert e.energy_j == pytest.approx(sum(PERIODS[1:]) + 19.0 + 1.0, rel=1e-12)
    # Pre-Volta: trapezoid over 100 W, 200 W, 100 W at 0, 0.5, 1 s.
    e = rec.energy("gpu:1")
    assert e.method == "integrated" and e.energy_j == pytest.approx(150.0)
    e = rec.energy("gpu:1", T0 + 250 * MS, T0 + 750 * MS)
    assert e.energy_j == pytest.approx(118.75 - 31.25)  # cumulative at 750 ms minus at 250 ms
    # RAPL: every reading is a point of the counter.
    e = rec.energy("cpu:0", T0 + 250 * MS, T0 + 750 * MS)
    assert e.method == "counter+interpolated"
    assert e.energy_j == pytest.approx(20.0 + 30.0)
    assert rec.energy("cpu:0/dram").energy_j == pytest.approx(10.0)
    assert rec.energy("gpu:0", T0, T0).energy_j == 0.0


def test_totals_and_total(rec_path: Path) -> None:
    rec = Recording(rec_path)
    totals = rec.totals()
    assert list(totals.devices) == ["gpu:0", "gpu:1", "cpu:0/dram", "cpu:0/package"]
    g0 = totals.devices["gpu:0"]
    assert (g0.start_ns, g0.end_ns, g0.duration_s) == (T0, T0 + 1000 * MS, 1.0)
    assert g0.energy_j == pytest.approx(250.0) and g0.mean_power_w == pytest.approx(250.0)
    assert g0.method == "counter+extrapolated"
    assert totals.devices["gpu:1"].method == "integrated"
    assert totals.devices["cpu:0/package"].mean_power_w == pytest.approx(100.0)
    assert totals.gpu_energy_j == pytest.approx(400.0)
    assert totals.cpu_energy_j == pytest.approx(100.0)
    assert totals.dram_energy_j == pytest.approx(10.0)
    assert totals.total_energy_j == pytest.approx(510.0)
    assert totals.duration_s == pytest.approx(1.015)
    as_dict = json.loads(json.dumps(totals.to_dict()))
    assert as_dict["devices"]["gpu:1"]["energy_j"] == pytest.approx(150.0)
    assert as_dict["total_energy_j"] == pytest.approx(510.0)

    assert rec.total("gpu.energy_j") == pytest.approx(250.0)  # gpu:1 has no counter
    assert rec.total("gpu.power_w") == pytest.approx(200.0 + 150.0)  # integrated over time
    assert rec.total("gpu.power_w", "gpu:1") == pytest.approx(150.0)
    assert rec.total("rapl.energy_j") == pytest.approx(110.0)  # package + dram
    assert rec.total("rapl.energy_j", "cpu:0/dram") == pytest.approx(10.0)
    assert rec.total("rapl.power_w") == pytest.approx(50.0)  # 80 W .. 120 W over 0.5 s
    assert rec.total("proc.attributed_power_w") == pytest.approx(75.0)


def test_unknown_names_are_config_errors(rec_path: Path) -> None:
    rec = Recording(rec_path)
    with pytest.raises(ConfigError, match=r"unknown metric 'gpu\.nope'.*gpu\.power_w"):
        rec.series("gpu.nope", "gpu:0")
    with pytest.raises(ConfigError, match=r"unknown metric 'gpu\.avg_power_w'"):
        rec.total("gpu.avg_power_w")  # a real field, but never recorded here
    with pytest.raises(ConfigError, match=r"unknown device 'gpu:7'.*available: gpu:0, gpu:1"):
        rec.series("gpu.power_w", "gpu:7")
    with pytest.raises(ConfigError, match=r"unknown device 'gpu:1'.*available: gpu:0$"):
        rec.series("gpu.energy_j", "gpu:1")
    with pytest.raises(ConfigError, match=r"unknown device 'proc:43'.*gpu:0, gpu:1, cpu:0"):
        rec.energy("proc:43")
    with pytest.raises(ConfigError, match="unknown device"):
        rec.metrics("gpu:9")
    with pytest.raises(ConfigError, match=r"energy \(\*energy_j\) or power"):
        rec.total("gpu.temperature_c")
    with pytest.raises(ConfigError, match="ends before it starts"):
        rec.energy("gpu:0", T0 + MS, T0)


def test_energy_outside_the_samples_is_an_error_not_an_extrapolation(rec_path: Path) -> None:
    # Power held constant past the last sample once gave 1 s after the end of a recording, or
    # 1 ms well after it, the energy from the last sample to the interval's end.
    rec = Recording(rec_path)
    end = T0 + 1000 * MS
    for device in ("gpu:0", "gpu:1", "cpu:0"):
        for t0, t1 in [
            (end + 1000 * MS, end + 2000 * MS),  # after the end
            (end + 5000 * MS, end + 5001 * MS),
            (T0 - 2000 * MS, T0 - 1000 * MS),  # before the start
        ]:
            with pytest.raises(ConfigError, match="outside the samples"):
                rec.energy(device, t0, t1)
    assert rec.energy("gpu:0", T0, end).energy_j == rec.energy("gpu:0").energy_j


def test_energy_over_a_span_wider_than_the_samples_is_clamped(rec_path: Path) -> None:
    rec = Recording(rec_path)
    for device in ("gpu:0", "gpu:1", "cpu:0"):
        whole = rec.energy(device)
        wide = rec.energy(device, rec.start_ns - 10**9, rec.end_ns + 10**9)
        assert wide.energy_j == whole.energy_j
        assert wide.method == f"{whole.method}, clamped"
        part = rec.energy(device, T0 + 500 * MS, T0 + 5000 * MS)
        devices = rec.totals().devices
        key = next(k for k in devices if k == device or k.startswith(device + "/"))
        first, last = T0 + 500 * MS, devices[key].end_ns
        assert part.energy_j == rec.energy(device, first, last).energy_j
        assert part.method.endswith(", clamped")


def test_history_energy_after_the_last_counter_point_is_integrated_power() -> None:
    # An interval that starts after the last counter update (a device that stopped, a window
    # finalized on timeout) once summed a negative counter difference and power from the last
    # update on, counting the time before the interval too.
    history = DeviceHistory("gpu:0")
    for k in range(11):  # counter +10 J per 100 ms (100 W), power 100 W, every 50 ms
        history.add(T0 + k * 50 * MS, 100.0, 1000.0 + 10.0 * (k // 2))
    t0 = T0 + 600 * MS
    e = history.energy(t0, t0 + 200 * MS)
    assert e.energy_j == pytest.approx(20.0)


def test_hosts_are_told_apart(tmp_path: Path) -> None:
    path = tmp_path / "two.zarc"
    events: list[Event] = [
        GpuSample(host, T0 + k * MS, 0, power_w=p)
        for k in range(2)
        for host, p in [("b", 2.0), ("a", 1.0)]
    ]
    write_recording(path, events, HEADER)
    rec = Recording(path)
    assert rec.devices() == ["gpu:0@a", "gpu:0@b"]
    assert rec.series("gpu.power_w", "gpu:0@b").values.tolist() == [2.0, 2.0]
    assert rec.totals().gpu_energy_j == pytest.approx(0.001 + 0.002)  # 1 W and 2 W for 1 ms


def test_devices_of_a_stream_that_joined_later_are_listed(tmp_path: Path) -> None:
    # A recording of two streams (record through a proxy): the header was written when only
    # host a's stream was there; host b's stream joined later and is described by its
    # StreamInfo in the file.
    path = tmp_path / "joined.zarc"
    h100 = DeviceInfo(key="gpu:0", name="H100", arch="hopper", has_energy_counter=True)
    a100 = DeviceInfo(key="gpu:1", name="A100", arch="ampere", has_energy_counter=True)
    header = RecordingHeader(host="a", start_wall_ns=T0, devices=[h100])
    events: list[Event] = [
        StreamInfo("a", T0, "s-a", devices=[h100]),
        GpuSample("a", T0 + MS, 0, power_w=1.0),
        StreamInfo("b", T0 + 2 * MS, "s-b", devices=[h100, a100]),
        StreamInfo("b", T0 + 3 * MS, "s-b", devices=[h100, a100]),  # re-sent: one stream
        GpuSample("b", T0 + 4 * MS, 1, power_w=2.0),
    ]
    write_recording(path, events, header)
    rec = Recording(path)
    assert rec.hosts == ["a", "b"]
    assert [info.stream_id for info in rec.streams] == ["s-a", "s-b"]
    info = rec.device_info()
    assert list(info) == ["gpu:0@a", "gpu:0@b", "gpu:1@b"]
    assert info["gpu:1@b"].name == "A100"
    assert rec.devices() == ["gpu:0@a", "gpu:1@b"]  # the ones with samples
    # Without StreamInfo in the file, the header describes the devices.
    write_recording(path, events[1:2], header, overwrite=True)
    assert list(Recording(path).device_info()) == ["gpu:0"]


def test_torn_file_still_analyzes(rec_path: Path) -> None:
    data = rec_path.read_bytes()
    rec_path.write_bytes(data[:-7])
    rec = Recording(rec_path)
    assert rec.report.torn_tail_offset is not None and rec.report.torn_tail_bytes > 0
    assert rec.report.corrupt_frames == []
    kept = list(RecordingReader(rec_path))
    assert rec.report.events_ok == len(kept) < len(hand_events())
    assert rec.end_ns == max(e.t_ns for e in kept)
    # The last frame (every sample at 1000 ms and the measurement) was torn off.
    assert rec.end_ns == T0 + 990 * MS
    assert rec.windows() == []
    assert rec.energy("gpu:1").energy_j == pytest.approx(75.0)  # 100 W .. 200 W over 0.5 s
    assert rec.energy("gpu:0", T0 + 145 * MS, T0 + 245 * MS).energy_j == pytest.approx(25.0)


@pytest.mark.anyio
async def test_damage_is_said_by_every_reader_of_the_file(
    rec_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # export and replay stream a damaged file without failing; each says what it skipped.
    from zeus_async.store.replay import Replayer

    rec_path.write_bytes(rec_path.read_bytes()[:-7])
    out = rec_path.with_suffix(".jsonl")
    with caplog.at_level("WARNING"):
        export_jsonl(rec_path, out)
        export_csv(rec_path, out)
        Recording(rec_path)
        replayer = Replayer(rec_path)

        async def publish(event: Event) -> None:
            pass

        await replayer.run(publish)
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 4, said
    for verb, line in zip(("exported", "exported", "analyzed", "replayed"), said, strict=True):
        assert line.startswith(f"{rec_path} is damaged: torn tail (")
        assert f"; {verb} every complete frame (" in line


def test_empty_recording(tmp_path: Path) -> None:
    path = tmp_path / "empty.zarc"
    write_recording(path, [], HEADER)
    rec = Recording.load(path)
    assert (rec.start_ns, rec.end_ns, rec.duration_s) == (T0 - 5 * MS, T0 - 5 * MS, 0.0)
    assert rec.devices() == [] and rec.metrics() == [] and rec.windows() == []
    assert rec.totals().total_energy_j == 0.0
    with pytest.raises(ConfigError, match="available: none"):
        rec.series("gpu.power_w", "gpu:0")


def test_progress_reports_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert PROGRESS_EVERY == 65_536
    monkeypatch.setattr(progress_module, "PROGRESS_EVERY", 100)
    path = tmp_path / "big.zarc"
    n = 300
    events = (GpuSample(H, i, 0, power_w=1.0) for i in range(n))
    write_recording(path, events, HEADER, events_per_frame=25)
    calls: list[tuple[int, int]] = []
    rec = Recording.load(path, progress=lambda done, total: calls.append((done, total)))
    size = path.stat().st_size
    assert len(rec.series("gpu.power_w", "gpu:0")) == n
    assert 2 <= len(calls) <= 4
    assert all(total == size for _, total in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls[-1] == (size, size) and calls[0][0] < size
    calls.clear()
    out = tmp_path / "big.jsonl"
    assert export_jsonl(path, out, progress=lambda d, t: calls.append((d, t))) == n
    assert calls[-1] == (size, size)


# -- export ------------------------------------------------------------------------------------


def every_kind() -> list[Event]:
    return [
        StreamInfo(H, T0, "s1", pid=7, argv=["x"], devices=HEADER.devices),
        GpuSample(H, T0 + 1, 0, 300.5, 290.0, 1e6, 55.0, 1.98e9, 0.9, 2**40, 700.0),
        GpuSample(H, T0 + 2, 1),
        RaplSample(H, T0 + 3, 0, "dram", 12.5, 0.1),
        ProcessSample(H, T0 + 4, 42, 0.5, 1, 2, 3, 0, 0.7, 4, 120.0),
        WindowOpen(H, T0 + 5, "step", 1),
        WindowClose(H, T0 + 6, "step", 1, cancelled=True),
        MEASUREMENT,
        PowerLimitChange(H, T0 + 8, 0, 500.0, 700.0, "optimizer"),
        ClockChange(H, T0 + 9, 0, 1e9, 1.5e9, "pfo"),
        DeviceFault(H, T0 + 11, "gpu:1", "gpu_lost", "fell, off the bus\n", None),
        Heartbeat(H, T0 + 12, "s1", 10, 2),
    ]


def _parse_cell(cell: str) -> Any:
    if cell == "":
        return None
    try:
        return json.loads(cell)
    except json.JSONDecodeError:
        return cell


def _event_from_row(row: dict[str, str]) -> Event:
    """Rebuild an event from a CSV row (the test's own reading of the documented layout)."""
    cls = next(t for t in EVENT_TYPES if t.__struct_config__.tag == row["kind"])
    values: list[Any] = [row["kind"]]
    for name in cls.__struct_fields__:
        column = {"kind": f"{row['kind']}_kind"}.get(name, name)
        cell = row[column]
        value: Any = (
            cell
            if name in ("host", "message", "name", "stream_id", "workload")
            else _parse_cell(cell)
        )
        if name == "devices":  # DeviceInfo is positional on the wire
            value = [list(d.values()) for d in value]
        values.append(value)
    event: Event = msgspec.convert(values, Event, strict=False)
    return event


def test_csv_round_trip(tmp_path: Path) -> None:
    src, out = tmp_path / "r.zarc", tmp_path / "r.csv"
    events = every_kind()
    write_recording(src, events, HEADER, events_per_frame=5)
    assert export_csv(src, out) == len(events)
    with out.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == csv_columns()
        rows = list(reader)
    assert reader.fieldnames[:6] == ["kind", "host", "t_ns", "device", "gpu", "power_w"]
    assert [_event_from_row(r) for r in rows] == events
    assert [r["device"] for r in rows[:5]] == ["", "gpu:0", "gpu:1", "cpu:0", "gpu:0"]
    assert rows[1]["power_w"] == "300.5" and rows[2]["power_w"] == ""
    assert rows[6]["cancelled"] == "true"
    assert rows[10]["fault_kind"] == "gpu_lost" and rows[10]["device"] == "gpu:1"
    assert json.loads(rows[7]["gpu_energy_j"]) == {"0": 125.0, "1": 80.0}

    # Only some kinds: the header holds their fields only.
    assert export_csv(src, out, kinds=["rapl", "fault"]) == 2
    lines = out.read_text().splitlines()
    assert lines[0] == (
        "kind,host,t_ns,device,package,domain,energy_j,power_w,fault_kind,message,retry_in_s"
    )
    assert lines[1] == f"rapl,{H},{T0 + 3},cpu:0,0,dram,12.5,0.1,,,"


def test_jsonl_is_subscribe_json(tmp_path: Path) -> None:
    src, out = tmp_path / "r.zarc", tmp_path / "r.jsonl"
    events = every_kind()
    write_recording(src, events, HEADER)
    assert export_jsonl(src, out) == len(events)
    lines = out.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        json.loads(json.dumps(event_to_dict(e))) for e in events
    ]
    assert export_jsonl(src, out, kinds="measurement") == 1
    assert json.loads(out.read_text())["gpu_energy_j"] == {"0": 125.0, "1": 80.0}


def test_export_to_stdout_and_bad_kinds(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    src = tmp_path / "r.zarc"
    write_recording(src, every_kind(), HEADER)
    assert export_csv(src, "-", kinds={"heartbeat"}) == 1
    assert export_jsonl(src, "-", kinds=["heartbeat"]) == 1
    text = capsysbinary.readouterr().out.decode()
    header = "kind,host,t_ns,device,stream_id,events_published,frames_published,topic_frames\n"
    row = f"heartbeat,{H},{T0 + 12},,s1,10,2,\n"
    assert text.startswith(header + row)
    assert json.loads(text[len(header + row) :])["frames_published"] == 2
    out = tmp_path / "never.csv"
    for export in (export_csv, export_jsonl):
        with pytest.raises(ConfigError, match=r"unknown event kind\(s\) \['gpus'\]"):
            export(src, out, kinds=["gpus"])
        assert not out.exists()


# -- against the simulator -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_simulated_run_against_ground_truth(tmp_path: Path) -> None:
    path = tmp_path / "sim.zarc"
    clock = FakeClock(wall_start_ns=1_760_000_000_000_000_000)
    config = SimConfig(
        num_gpus=2,
        workload=SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1),
        # The pre-Volta GPU runs at constant power: its integrated energy is exact.
        gpus=(GpuOverride(), GpuOverride(pre_volta=True, workload=ConstantWorkload(util=0.6))),
        seed=5,
    )
    try:
        async with Runtime(
            backend="sim", cpus=None, sim_config=config, clock=clock, windows=True, record=path
        ) as rt:
            # Edges at fixed stream times: the same phases of the square wave in every run.
            for name, start_ms in (("a", 800), ("b", 2600)):
                await clock.sleep_until(start_ms * MS)
                async with rt.window(name) as w:
                    await clock.sleep_until((start_ms + 1000) * MS)
                assert w.result is not None
                await w.result.wait_async()
            await clock.sleep_until(clock.monotonic_ns() + 300 * MS)
            node = sim_pynvml.current_node()
            assert node is not None
    finally:
        sim_pynvml.uninstall()

    rec = Recording(path)
    assert rec.report.clean
    assert rec.devices() == ["gpu:0", "gpu:1"]
    assert "gpu.energy_j" in rec.metrics() and rec.devices("gpu.energy_j") == ["gpu:0"]
    times = [e.t_ns for e in RecordingReader(path)]
    assert (rec.start_ns, rec.end_ns) == (min(times), max(times))
    assert rec.duration_s >= 2.8
    windows = rec.windows()
    assert [m.name for m in windows] == ["a", "b"]
    for m in windows:
        for gpu, method, tol in [(0, "counter+interpolated", 0.01), (1, "integrated", 1e-6)]:
            truth = node.truth_energy_j(gpu, m.start_ns, m.end_ns)
            e = rec.energy(f"gpu:{gpu}", m.start_ns, m.end_ns)
            assert e.method == method == m.methods[f"gpu:{gpu}"]
            assert e.energy_j is not None
            assert abs(e.energy_j - truth) / truth < tol, (gpu, e, truth)
            assert e.energy_j == pytest.approx(m.gpu_energy_j[gpu], rel=tol)
    totals = rec.totals()
    for gpu in (0, 1):
        d = totals.devices[f"gpu:{gpu}"]
        truth = node.truth_energy_j(gpu, d.start_ns, d.end_ns)
        assert d.energy_j is not None
        if gpu == 0:
            # Exact from the first reading (the lead-in period apportioned from the counter) to
            # the last counter update; the time after it (under one counter period) comes from
            # power readings: at most one period of the power swing (70 W .. 700 W).
            assert d.method == "counter+extrapolated"
            assert abs(d.energy_j - truth) <= 0.1 * 630
        else:
            assert d.method == "integrated"
            assert d.energy_j == pytest.approx(truth, rel=1e-6)
    assert totals.gpu_energy_j == pytest.approx(
        sum(d.energy_j or 0.0 for d in totals.devices.values())
    )
    assert totals.cpu_energy_j is None and totals.dram_energy_j is None


def test_process_totals_and_aipowermeter_names(tmp_path: Path) -> None:
    """Running totals of ProcessSample events become per-process and experiment totals."""
    events: list[Event] = []
    for k in range(3):  # samples at 0, 1, 2 s; running totals start at 0
        t = T0 + k * 1000 * MS
        events.append(
            ProcessSample(
                H,
                t,
                7,
                cpu_frac=0.5,
                cpu_power_w=None if k == 0 else 20.0,
                cpu_energy_j=20.0 * k,
                dram_energy_j=1.0 * k,
            )
        )
        events.append(
            ProcessSample(
                H,
                t,
                7,
                gpu=0,
                attributed_power_w=None if k == 0 else 100.0,
                attributed_energy_j=100.0 * k,
            )
        )
        events.append(ProcessSample(H, t, 7, gpu=1, attributed_energy_j=30.0 * k))
        events.append(ProcessSample(H, t, 8, cpu_energy_j=5.0 * k))
    path = tmp_path / "procs.zarc"
    write_recording(path, events, HEADER)
    rec = Recording(path)
    totals = rec.totals()
    p7, p8 = totals.processes["7"], totals.processes["8"]
    assert (p7.cpu_energy_j, p7.dram_energy_j, p7.gpu_energy_j) == (40.0, 2.0, {0: 200.0, 1: 60.0})
    assert p7.total_energy_j == 302.0
    assert (p7.start_ns, p7.end_ns, p7.duration_s) == (T0, T0 + 2000 * MS, 2.0)
    assert (p8.cpu_energy_j, p8.dram_energy_j, p8.gpu_energy_j) == (10.0, None, {})
    assert totals.process_cpu_energy_j == 50.0
    assert totals.process_dram_energy_j == 2.0
    assert totals.process_gpu_energy_j == 260.0
    assert json.loads(json.dumps(totals.to_dict()))["processes"]["7"]["total_energy_j"] == 302.0
    # Power integrated over time agrees with the running totals; AIPowerMeter names work.
    assert rec.total("per_process_cpu_power") == pytest.approx(20.0)  # from 1 s to 2 s
    assert rec.total("proc.cpu_energy_j", "proc:7") == pytest.approx(40.0)
    assert rec.total("nvidia_attributable_power") == pytest.approx(100.0)
    series = rec.series("per_gpu_attributable_power", "gpu:0")  # the tracked pids on GPU 0
    assert (series.metric, series.values.tolist()) == ("per_gpu_attributable_power", [100.0, 100.0])
