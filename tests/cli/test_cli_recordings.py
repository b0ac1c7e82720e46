"""The recording commands as real processes: inspect, export, replay, record, plot."""

from __future__ import annotations

import csv
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cli_helpers import free_port, popen, run_cli

from zeus_async.events import GpuSample, Measurement, StreamInfo, event_to_dict
from zeus_async.store import RecordingReader, recording_parts
from zeus_async.store.analysis import Recording


def test_inspect_summarizes(recordings: Path) -> None:
    proc = run_cli("inspect", str(recordings / "sim_windows.zarc"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "compression zstd" in out and "(complete)" in out
    assert "gpu:0: NVIDIA H100 80GB HBM3 (hopper, energy counter" in out
    assert "gpu:1" in out and "no energy counter" in out
    assert "6 measured window(s)" in out and "train" in out and "step-3" in out
    assert "counter+extrapolated" in out and "integrated" in out


def test_inspect_reports_a_torn_tail(recordings: Path) -> None:
    proc = run_cli("inspect", str(recordings / "sim_windows_torn.zarc"))
    assert proc.returncode == 0, proc.stderr
    assert "DAMAGED" in proc.stdout and "torn tail" in proc.stdout


def test_export_jsonl_and_csv(recordings: Path, tmp_path: Path) -> None:
    src = recordings / "sim_windows.zarc"
    events = list(RecordingReader(src))
    proc = run_cli("export", str(src), "--format", "jsonl")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines == [json.loads(json.dumps(event_to_dict(e))) for e in events]
    out = tmp_path / "gpu.csv"
    proc = run_cli("export", str(src), "--format", "csv", "--kind", "gpu", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    gpu = [e for e in events if isinstance(e, GpuSample)]
    assert f"exported {len(gpu)} events to {out}" in proc.stdout
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == len(gpu)
    assert [float(r["power_w"]) for r in rows] == [e.power_w for e in gpu]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "/nonexistent.zarc"], "No such file"),
        (["export", "{here}", "--format", "xml"], "invalid choice"),
        (["export", "{here}", "--format", "csv", "--kind", "nope"], "unknown event kind"),
        (["replay", "{here}", "--speed", "0"], "positive factor"),
        (["inspect", "{self}"], "not a zeus_async recording"),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str, recordings: Path) -> None:
    args = [
        a.replace("{here}", str(recordings / "sim_windows.zarc")).replace("{self}", __file__)
        for a in args
    ]
    proc = run_cli(*args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_inspect_refuses_an_unknown_format_version_in_one_line(
    recordings: Path, tmp_path: Path
) -> None:
    """Issue 34: format version 2306 (with valid frames after the header) was read as "v2"."""
    data = bytearray((recordings / "sim_windows.zarc").read_bytes())
    data[4:6] = (2306).to_bytes(2, "big")
    path = tmp_path / "v2306.zarc"
    path.write_bytes(bytes(data))
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == (
        "zeus-async inspect: recording format version 2306 is not supported "
        "(this build reads [1, 2, 3])\n"
    )


def test_replay_measures_the_windows_again(recordings: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.zarc"
    proc = run_cli(
        "replay", str(recordings / "sim_windows.zarc"), "--speed", "max", "--record", str(again)
    )
    assert proc.returncode == 0, proc.stderr
    n = sum(1 for _ in RecordingReader(recordings / "sim_windows.zarc"))
    assert f"replayed {n} events" in proc.stdout
    table = proc.stdout.split("measured again from the replay:\n")[1].splitlines()
    assert table[0].split() == ["window", "time", "s", "GPU", "energy", "J", "=", "recorded"]
    assert [row.split()[-1] for row in table[2:]] == ["yes"] * 6
    original = list(RecordingReader(recordings / "sim_windows.zarc"))
    assert [e for e in RecordingReader(again) if e in original] == original
    # The replay adds its measurements, not a description of itself stamped today: the new
    # recording spans what the old one did and describes the same stream.
    old, new = Recording(recordings / "sim_windows.zarc"), Recording(again)
    assert (new.start_ns, new.end_ns) == (old.start_ns, old.end_ns)
    assert new.streams == old.streams


@contextmanager
def _publishing_replay(src: Path, endpoint: str, speed: str) -> Iterator[subprocess.Popen[str]]:
    """``replay SRC --publish ENDPOINT``, waiting for a subscriber; killed if still running."""
    replay = popen(
        "replay", str(src), "--speed", speed, "--publish", endpoint, "--wait-subscriber", "20"
    )
    try:
        yield replay
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.communicate()


@pytest.mark.slow
def test_replay_publishes_to_a_subscriber_process(recordings: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    src = recordings / "sim_windows.zarc"
    with _publishing_replay(src, endpoint, "4") as replay:
        want = [event_to_dict(e) for e in RecordingReader(src) if isinstance(e, GpuSample)]
        sub = run_cli("subscribe", endpoint, "--json", "--topic", "gpu/", "--count", str(len(want)))
        assert sub.returncode == 0, sub.stderr
        got = [json.loads(line) for line in sub.stdout.splitlines()]
        # Each line names the frame that carried it: one stream, numbers rising per topic.
        frames = [e.pop("frame") for e in got]
        assert len({f["stream_id"] for f in frames}) == 1
        for f, e in zip(frames, got, strict=True):
            assert f["topic"] == f"gpu/{e['host']}/{e['gpu']}"
        for topic in {f["topic"] for f in frames}:
            seqs = [(f["seq"], f["topic_seq"]) for f in frames if f["topic"] == topic]
            assert seqs == sorted(seqs)
        want = json.loads(json.dumps(want))
        # Same events and timestamps; per GPU (one bus topic each) in the same order.
        for gpu in (0, 1):
            assert [e for e in got if e["gpu"] == gpu] == [e for e in want if e["gpu"] == gpu]
        assert len(got) == len(want)
        _, err = replay.communicate(timeout=60)
        assert replay.returncode == 0, err


@pytest.mark.slow
def test_record_a_remote_stream(tmp_path: Path) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    mon = popen("monitor", "--backend", "sim", "--gpus", "0,1", "--publish", endpoint)
    out_file = tmp_path / "remote.zarc"
    try:
        assert mon.stdout is not None
        assert "Ctrl-C to stop" in mon.stdout.readline()  # streaming, with its stream info sent
        before_ns = time.time_ns()
        rec = run_cli(
            "record", endpoint, "-o", str(out_file), "--duration", "3.5", "--rotate-mb", "0.005"
        )
        assert rec.returncode == 0, rec.stderr
        assert "0 frame(s) lost" in rec.stdout
    finally:
        mon.terminate()
        mon.communicate(timeout=30)
    parts = recording_parts(out_file)
    assert len(parts) >= 2  # rotated at 5 kB
    reader = RecordingReader(out_file)  # every part, given the first
    assert reader.parts == parts
    events = list(reader)
    assert reader.report.parts == [str(p) for p in parts] and reader.report.clean
    # The same events as the parts read one by one (a later part read alone is just itself).
    tail = [e for p in parts[1:] for e in RecordingReader(p)]
    assert events[len(events) - len(tail) :] == tail
    # The file spans the recording, not the publisher's life before it (the stream info the
    # handshake got is kept, stamped with the start of the recording).
    assert reader.header.start_wall_ns >= before_ns
    infos = [e for e in events if isinstance(e, StreamInfo)]
    assert infos and all(e.t_ns >= reader.header.start_wall_ns for e in infos)
    assert [d.key for d in reader.header.devices] == ["gpu:0", "gpu:1"]
    assert reader.header.meta["recorded_from"] == endpoint
    assert RecordingReader(parts[1]).header.meta["part"] == "1"
    samples = [e for e in events if isinstance(e, GpuSample)]
    assert {s.gpu for s in samples} == {0, 1} and len(samples) > 100
    for gpu in (0, 1):
        ts = [s.t_ns for s in samples if s.gpu == gpu]
        assert ts == sorted(ts)


def test_plot_writes_a_png(recordings: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "power.png"
    proc = run_cli("plot", str(recordings / "sim_windows.zarc"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measurements_in_the_committed_file_are_complete(recordings: Path) -> None:
    ms = [e for e in RecordingReader(recordings / "sim_windows.zarc") if isinstance(e, Measurement)]
    assert all(set(m.gpu_energy_j) == {0, 1} for m in ms)


@contextmanager
def _publishing_monitor() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A ``monitor`` publishing one simulated GPU, started; killed at the end if still
    running. Yields it and its endpoint."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    mon = popen("monitor", "--backend", "sim", "--gpus", "0", "--publish", endpoint)
    try:
        assert mon.stdout is not None
        assert "Ctrl-C to stop" in mon.stdout.readline()
        yield mon, endpoint
    finally:
        if mon.poll() is None:
            mon.kill()
        mon.communicate(timeout=30)


def test_record_and_subscribe_end_with_the_stream(tmp_path: Path) -> None:
    with _publishing_monitor() as (mon, endpoint):
        rec = popen("record", endpoint, "-o", str(tmp_path / "r.zarc"), "--until-end")
        sub = popen("subscribe", endpoint, "--until-end")
        time.sleep(2.0)
        mon.terminate()  # the stream ends: both stop by themselves
        rec_out, rec_err = rec.communicate(timeout=30)
        sub_out, sub_err = sub.communicate(timeout=30)
    assert rec.returncode == 0 and sub.returncode == 0, (rec_err, sub_err)
    assert "0 frame(s) lost on the bus" in rec_out
    # Ended with its FINAL: nothing to say about tails (no line unless something was lost).
    assert "tail unknown" not in rec_err + sub_err and "still running" not in rec_err + sub_err
    assert sum(line.startswith("gpu ") for line in sub_out.splitlines()) > 50
    assert RecordingReader(tmp_path / "r.zarc").header.meta["hosts"]
    # One description per stream in the file (the publisher re-sends it per subscription).
    infos = [e for e in RecordingReader(tmp_path / "r.zarc") if isinstance(e, StreamInfo)]
    assert len(infos) == 1


def test_a_stream_killed_without_its_end_has_an_unknown_tail(tmp_path: Path) -> None:
    # SIGKILL: no FINAL. Neither subscribe nor record may call the stream complete ("0 lost"),
    # nor wait for its end forever.
    with _publishing_monitor() as (mon, endpoint):
        # --until-end: a stream that goes silent without its end ends the wait too.
        sub = popen("subscribe", endpoint, "--until-end")
        rec = popen("record", endpoint, "-o", str(tmp_path / "r.zarc"), "--until-end")
        assert sub.stdout is not None and rec.stdout is not None
        assert sub.stdout.readline().startswith("stream")  # both take part in the stream
        assert rec.stdout.readline().startswith("zeus-async record:")
        time.sleep(1.0)
        mon.kill()
        sub_out, sub_err = sub.communicate(timeout=30)
        _, rec_err = rec.communicate(timeout=30)
    assert sub.returncode == 0 and rec.returncode == 0, (sub_err, rec_err)
    assert sum(line.startswith("gpu ") for line in sub_out.splitlines()) > 10
    for err in (sub_err, rec_err):
        assert "went silent with no end of stream: tail unknown" in err, err


def test_replay_publishes_its_own_stream(recordings: Path) -> None:
    # The recording holds the recorded stream's StreamInfo and heartbeats; the replay is a
    # stream of its own and describes itself only.
    src = recordings / "sim_windows.zarc"
    recorded = {e.stream_id for e in RecordingReader(src) if isinstance(e, StreamInfo)}
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with _publishing_replay(src, endpoint, "max") as replay:
        sub = run_cli("subscribe", endpoint, "--json", "--until-end")
        assert sub.returncode == 0, sub.stderr
        events = [json.loads(line) for line in sub.stdout.splitlines()]
        own = {e["stream_id"] for e in events if e["kind"] in ("stream", "heartbeat")}
        assert len(own) == 1 and not own & recorded, (own, recorded)
        assert {e["frame"]["stream_id"] for e in events} == own
        assert "tail unknown" not in sub.stderr
        _, err = replay.communicate(timeout=60)
        assert replay.returncode == 0, err


def test_inspect_lists_the_devices_of_every_stream(tmp_path: Path) -> None:
    from zeus_async.events import DeviceInfo
    from zeus_async.store import RecordingHeader, write_recording

    path = tmp_path / "joined.zarc"
    h100 = DeviceInfo(key="gpu:0", name="H100", arch="hopper", has_energy_counter=True)
    a100 = DeviceInfo(key="gpu:1", name="A100", arch="ampere", has_energy_counter=True)
    t0 = 1_000_000_000
    write_recording(
        path,
        [
            StreamInfo("a", t0, "s-a", devices=[h100]),
            GpuSample("a", t0 + 1, 0, power_w=1.0),
            StreamInfo("b", t0 + 2, "s-b", devices=[a100]),  # joined after the header
            GpuSample("b", t0 + 3, 1, power_w=2.0),
        ],
        RecordingHeader(host="a", start_wall_ns=t0, devices=[h100]),
    )
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "hosts       a, b (2 stream(s))" in proc.stdout
    assert "(the first stream's)" in proc.stdout
    assert "device      gpu:0@a: H100 (hopper" in proc.stdout
    assert "device      gpu:1@b: A100 (ampere" in proc.stdout


def test_output_into_a_closed_pipe_stops_quietly(recordings: Path) -> None:
    # `zeus-async export ... | head -c 10`: no error message, the status of a SIGPIPE death.
    cli = popen("export", str(recordings / "sim_windows.zarc"), "--format", "jsonl", "-o", "-")
    assert cli.stdout is not None
    assert cli.stdout.read(10).startswith('{"kind":')
    cli.stdout.close()  # the reader goes away with most of the output unread
    _, err = cli.communicate(timeout=30)
    assert cli.returncode == 141, err
    assert err == ""
