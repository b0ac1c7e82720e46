from __future__ import annotations

import itertools
import os
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import msgspec
import pytest
from anyio.abc import ObjectReceiveStream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeus_async.clock import FakeClock
from zeus_async.errors import CodecError, ConfigError, SchemaVersionError
from zeus_async.events import (
    SCHEMA_VERSION,
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
)
from zeus_async.runtime import Runtime
from zeus_async.runtime.hub import EventBatches
from zeus_async.store import (
    NotARecordingError,
    Recorder,
    RecordingHeader,
    RecordingReader,
    write_recording,
)
from zeus_async.store.analysis import Recording
from zeus_async.store.format import (
    FORMAT_VERSION,
    FRAME_PREFIX_SIZE,
    PayloadCodec,
    encode_frame,
    encode_header,
    unpack_frame_prefix,
)

DEVICES = [
    DeviceInfo(
        key="gpu:0",
        name="H100",
        uuid="GPU-1",
        arch="hopper",
        has_energy_counter=True,
        power_limit_min_w=200.0,
        power_limit_max_w=700.0,
        power_limit_default_w=700.0,
        supported_sm_clocks_hz=[1.98e9, 1.5e9],
    ),
    DeviceInfo(key="cpu:0", name="Xeon", arch="cpu"),
]
HEADER = RecordingHeader(
    host="node1",
    start_wall_ns=1_700_000_000_000_000_000,
    pid=1234,
    argv=["train.py", "--lr", "0.1"],
    devices=DEVICES,
    meta={"job": "j1", "git": "abc"},
)


def one_of_each(t0: int = 1_000) -> list[Event]:
    h = "node1"
    return [
        StreamInfo(h, t0, "s1", pid=7, argv=["x"], devices=DEVICES),
        GpuSample(h, t0 + 1, 0, 300.0, 290.0, 1e6, 55.0, 1.98e9, 0.9, 2**40, 700.0),
        GpuSample(h, t0 + 2, 1),
        RaplSample(h, t0 + 3, 0, "dram", 12.5, 30.0),
        ProcessSample(h, t0 + 4, 42, 0.5, 1, 2, 3, 0, 0.7, 4, 120.0),
        WindowOpen(h, t0 + 5, "step", 1),
        WindowClose(h, t0 + 6, "step", 1, cancelled=True),
        Measurement(
            h,
            t0 + 7,
            "step",
            1,
            t0 + 5,
            t0 + 6,
            1e-9,
            {0: 1.5, 1: 2.5},
            {0: 3.0},
            None,
            {"gpu:0": "counter"},
            ["gpu:1"],
        ),
        PowerLimitChange(h, t0 + 8, 0, 500.0, 700.0, "optimizer"),
        ClockChange(h, t0 + 9, 0, 1e9, 1.5e9, "pfo"),
        ClockChange(h, t0 + 10, 0),
        DeviceFault(h, t0 + 11, "gpu:1", "gpu_lost", "fell off the bus", None),
        Heartbeat(h, t0 + 12, "s1", 10, 2),
    ]


def test_every_event_kind_round_trips(tmp_path: Path) -> None:
    events = one_of_each()
    path = tmp_path / "r.zarc"
    assert write_recording(path, events, HEADER, events_per_frame=5) == 3
    reader = RecordingReader(path)
    assert reader.header == HEADER
    assert reader.schema_version == SCHEMA_VERSION
    assert reader.format_version == FORMAT_VERSION
    assert list(reader) == events
    assert reader.report.frames_ok == 3
    assert reader.report.events_ok == len(events)
    assert reader.report.clean


def test_filters(tmp_path: Path) -> None:
    events = one_of_each()
    path = tmp_path / "r.zarc"
    write_recording(path, events, HEADER, events_per_frame=4)
    reader = RecordingReader(path)
    assert [e for e in reader.events(kinds=["gpu"])] == events[1:3]
    assert list(reader.events(devices=["gpu:0"])) == [
        events[1],
        events[4],
        events[8],
        events[9],
        events[10],
    ]
    assert list(reader.events(devices=["cpu:0"])) == [events[3]]
    assert list(reader.events(devices=["gpu:1"], kinds=["fault"])) == [events[11]]
    assert list(reader.events(topics_prefix="window/node1/step")) == events[5:8]
    assert reader.report.events_ok == len(events)  # counts before filtering
    with pytest.raises(ConfigError):
        list(reader.events(kinds=["gpus"]))


def test_empty_recording(tmp_path: Path) -> None:
    path = tmp_path / "r.zarc"
    assert write_recording(path, [], HEADER) == 0
    reader = RecordingReader(path)
    assert list(reader) == []
    assert reader.report.clean
    assert list(reader.events_between(0, 10**20)) == []


@pytest.mark.anyio
async def test_aiter(tmp_path: Path) -> None:
    events = one_of_each() * 20
    path = tmp_path / "r.zarc"
    write_recording(path, events, HEADER, events_per_frame=3)
    reader = RecordingReader(path)
    got = [e async for e in reader.aiter(frames_per_chunk=4)]
    assert got == events
    assert reader.report.frames_ok == (len(events) + 2) // 3
    got_gpu = [e async for e in reader.aiter(kinds={"gpu"})]
    assert got_gpu == [e for e in events if isinstance(e, GpuSample)]


# -- recorder ----------------------------------------------------------------------------------


async def feed(events: list[Event]) -> ObjectReceiveStream[Event]:
    send, receive = anyio.create_memory_object_stream[Event](len(events) + 1)
    async with send:
        for e in events:
            await send.send(e)
    return receive


@pytest.mark.anyio
async def test_recorder_batches_by_count(tmp_path: Path) -> None:
    events = one_of_each() * 3
    path = tmp_path / "r.zarc"
    rec = Recorder(path, header=HEADER, flush_events=4, flush_interval_s=3600)
    await rec.run(await feed(events))
    assert rec.events_written == len(events)
    assert rec.frames_written == -(-len(events) // 4)
    assert rec.bytes_written == path.stat().st_size
    reader = RecordingReader(path)
    assert reader.header == HEADER
    assert list(reader) == events
    assert reader.report.frames_ok == rec.frames_written


@pytest.mark.anyio
async def test_recorder_explicit_flush_and_default_header(tmp_path: Path) -> None:
    path = tmp_path / "r.zarc"
    rec = Recorder(path, flush_events=1000, flush_interval_s=3600, fsync_on_close=False)
    send, receive = anyio.create_memory_object_stream[Event](100)
    events = one_of_each()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rec.run, receive)
        async with send:
            for e in events[:5]:
                await send.send(e)
            # Let the recorder take the events, then force a frame out.
            while rec.pending_events < 5:
                await anyio.lowlevel.checkpoint()
            await rec.flush()
            assert rec.pending_events == 0
            assert rec.frames_written == 1
            assert rec.events_written == 5
            # The frame is on disk while the recorder still runs.
            assert list(RecordingReader(path)) == events[:5]
            for e in events[5:]:
                await send.send(e)
    assert rec.events_written == len(events)
    assert rec.frames_written == 2
    reader = RecordingReader(path)
    assert reader.header.pid == os.getpid()
    assert list(reader) == events


@pytest.mark.anyio
async def test_recorder_finishes_when_threads_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit hooks close a monitor left open; from Python 3.12 on, the interpreter refuses new
    threads by then. The recording's last frames, fsync and close must still happen (they ran
    through worker threads, and the end of the recording was lost on 3.12)."""
    import asyncio

    def refused(*args: object, **kwargs: object) -> object:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    path = tmp_path / "r.zarc"
    rec = Recorder(path, header=HEADER, flush_events=4, flush_interval_s=3600)
    send, receive = anyio.create_memory_object_stream[Event](100)
    events = one_of_each()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rec.run, receive)
        async with send:
            for e in events[:4]:  # one frame, written while threads still start
                await send.send(e)
            while rec.frames_written < 1:
                await anyio.sleep(0.01)
            monkeypatch.setattr(anyio.to_thread, "run_sync", refused)
            try:  # under asyncio, aiofiles hands its calls to the loop's executor
                loop = asyncio.get_running_loop()
            except RuntimeError:  # trio
                pass
            else:
                monkeypatch.setattr(loop, "run_in_executor", refused)
            for e in events[4:]:
                await send.send(e)
    reader = RecordingReader(path)
    assert list(reader) == events
    assert reader.report.clean


@pytest.mark.anyio
async def test_recorder_flushes_on_interval(tmp_path: Path) -> None:
    clock = FakeClock(autojump=False)
    path = tmp_path / "r.zarc"
    rec = Recorder(path, header=HEADER, flush_events=1000, flush_interval_s=1.0, clock=clock)
    send, receive = anyio.create_memory_object_stream[Event](100)
    events = one_of_each()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rec.run, receive)
        async with send:
            await send.send(events[0])
            await send.send(events[1])
            while clock.sleepers == 0 or rec.pending_events < 2:
                await anyio.lowlevel.checkpoint()
            await clock.advance(0.5)
            assert rec.frames_written == 0
            await clock.advance(0.5)
            while rec.frames_written == 0:
                await anyio.lowlevel.checkpoint()
            assert rec.events_written == 2
            assert list(RecordingReader(path)) == events[:2]
    assert list(RecordingReader(path)) == events[:2]
    assert rec.frames_written == 1


@pytest.mark.anyio
async def test_recorder_as_runtime_consumer(tmp_path: Path) -> None:
    from zeus_async.testing.fakes import ScriptedGpu

    clock = FakeClock()
    path = tmp_path / "r.zarc"
    rec = Recorder(path, header=HEADER, flush_events=16)
    seen: list[Event] = []

    async def collect(stream: ObjectReceiveStream[Event]) -> None:
        async for event in stream:
            seen.append(event)

    async with Runtime(
        [ScriptedGpu(0, clock)], clock=clock, host="h", consumers=[rec.run, collect]
    ):
        await clock.sleep_until(clock.monotonic_ns() + 10**9)
    recorded = list(RecordingReader(path))
    samples = [e for e in recorded if isinstance(e, GpuSample)]
    assert len(samples) >= 90
    assert recorded == seen
    assert isinstance(recorded[0], StreamInfo)
    assert [s.t_ns for s in samples] == sorted(s.t_ns for s in samples)
    assert rec.events_written == len(seen)


# -- crash safety ------------------------------------------------------------------------------

WRITER = Path(__file__).with_name("writer_proc.py")


def _kill_once(
    path: Path, per_frame: int, min_frames: int, rng: random.Random, mode: str = "raw"
) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(path), str(per_frame), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        reported = 0
        while reported < min_frames:
            line = proc.stdout.readline()
            assert line, "writer exited early"
            reported = int(line)
        # Read a random number of further reports so the kill lands at a random point.
        for _ in range(rng.randrange(0, 50)):
            reported = int(proc.stdout.readline())
        proc.kill()
    finally:
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    _check_killed(path, per_frame, mode, reported)


def _check_killed(path: Path, per_frame: int, mode: str, reported: int) -> None:
    """The file of a writer killed after it reported ``reported`` complete frames: every
    complete frame reads back intact, in order; a torn tail is the file's last bytes."""
    reader = RecordingReader(path)
    events = list(reader)
    report = reader.report
    assert report.corrupt_frames == []
    assert report.frames_ok >= reported
    assert report.torn_tail_bytes >= 0
    if mode == "raw":
        assert len(events) == report.frames_ok * per_frame
    assert events == [
        GpuSample(host="w", t_ns=i, gpu=0, power_w=float(i)) for i in range(len(events))
    ]
    if report.torn_tail_offset is not None:
        assert report.torn_tail_offset + report.torn_tail_bytes == path.stat().st_size


@pytest.mark.slow
def test_kill_minus_9_keeps_every_complete_frame(tmp_path: Path) -> None:
    rng = random.Random(1234)
    for i in range(10):
        _kill_once(tmp_path / f"k{i}.zarc", per_frame=rng.choice([1, 7, 64]), min_frames=5, rng=rng)


@pytest.mark.slow
def test_kill_minus_9_of_the_recorder_keeps_every_complete_frame(tmp_path: Path) -> None:
    """The product's writer (hub -> batched Recorder, aiofiles, zstd) killed at random points."""
    rng = random.Random(99)
    for i in range(8):
        path = tmp_path / f"r{i}.zarc"
        _kill_once(path, per_frame=rng.choice([16, 100, 1000]), min_frames=3, rng=rng, mode="rec")
        assert RecordingReader(path).header.compression == "zstd"


# -- damaged files -----------------------------------------------------------------------------


def _sample_file(compression: str = "none") -> tuple[bytes, list[Event], list[int]]:
    """Bytes of a small recording, its events, and the end offset of each frame."""
    events = one_of_each() + one_of_each(5_000)
    header = msgspec.structs.replace(HEADER, compression=compression)
    codec = PayloadCodec(compression)
    data = encode_header(header)
    ends = []
    for i in range(0, len(events), 4):
        data += encode_frame(events[i : i + 4], codec=codec)
        ends.append(len(data))
    return data, events, ends


SAMPLE, SAMPLE_EVENTS, SAMPLE_ENDS = _sample_file()
HEADER_SIZE = len(encode_header(HEADER))
ZSAMPLE, _, ZSAMPLE_ENDS = _sample_file("zstd")
ZHEADER_SIZE = len(encode_header(msgspec.structs.replace(HEADER, compression="zstd")))


@contextmanager
def _opened(data: bytes) -> Iterator[RecordingReader]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.zarc"
        path.write_bytes(data)
        yield RecordingReader(path)


def _is_subsequence(sub: list[Event], full: list[Event]) -> bool:
    it = iter(full)
    return all(any(x == y for y in it) for x in sub)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=0, max_value=len(SAMPLE)))
def test_truncation_keeps_complete_frames(cut: int) -> None:
    if cut < HEADER_SIZE:
        with pytest.raises(CodecError), _opened(SAMPLE[:cut]):
            pass
        return
    with _opened(SAMPLE[:cut]) as reader:
        events = list(reader)
        complete = sum(1 for end in SAMPLE_ENDS if end <= cut)
        assert events == SAMPLE_EVENTS[: min(complete * 4, len(SAMPLE_EVENTS))]
        assert reader.report.corrupt_frames == []
        if cut in SAMPLE_ENDS or cut == HEADER_SIZE:
            assert reader.report.torn_tail_offset is None
        else:
            assert reader.report.torn_tail_offset is not None
            assert reader.report.torn_tail_bytes > 0


@settings(max_examples=500, deadline=None)
@given(
    st.integers(min_value=0, max_value=len(SAMPLE) - 1),
    st.integers(min_value=1, max_value=255),
    st.integers(min_value=0, max_value=len(SAMPLE)),
)
def test_flipped_byte_yields_only_original_events(pos: int, xor: int, cut: int) -> None:
    data = bytearray(SAMPLE)
    data[pos] ^= xor
    try:
        with _opened(bytes(data[: max(cut, pos + 1)])) as reader:
            events = list(reader)
            between = list(reader.events_between(0, 10**18))
    except CodecError:
        assert pos < HEADER_SIZE or cut < HEADER_SIZE
        return
    assert _is_subsequence(events, SAMPLE_EVENTS)
    # At most the damaged frame and the cut-off frames are lost: CRC32 catches every
    # single-byte error, and reading resynchronizes after it.
    lost_to_cut = sum(1 for end in SAMPLE_ENDS if end > max(cut, pos + 1))
    assert len(events) >= len(SAMPLE_EVENTS) - 4 - 4 * lost_to_cut
    assert _is_subsequence(between, SAMPLE_EVENTS)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=0, max_value=len(ZSAMPLE) - 1),
    st.integers(min_value=1, max_value=255),
    st.integers(min_value=0, max_value=len(ZSAMPLE)),
)
def test_flipped_byte_in_a_compressed_file(pos: int, xor: int, cut: int) -> None:
    data = bytearray(ZSAMPLE)
    data[pos] ^= xor
    try:
        with _opened(bytes(data[: max(cut, pos + 1)])) as reader:
            events = list(reader)
    except CodecError:
        assert pos < ZHEADER_SIZE or cut < ZHEADER_SIZE
        return
    assert _is_subsequence(events, SAMPLE_EVENTS)
    lost_to_cut = sum(1 for end in ZSAMPLE_ENDS if end > max(cut, pos + 1))
    assert len(events) >= len(SAMPLE_EVENTS) - 4 - 4 * lost_to_cut


def test_single_flip_in_middle_frame_is_reported_and_skipped() -> None:
    offset = SAMPLE_ENDS[0]  # start of frame 1
    for pos, reason in [
        (offset, "bad sync marker"),
        (offset + FRAME_PREFIX_SIZE + 3, "payload checksum mismatch"),
        (offset + 19, "first_t_ns does not match the first event"),
    ]:
        data = bytearray(SAMPLE)
        data[pos] ^= 0x01
        with _opened(bytes(data)) as reader:
            events = list(reader)
            assert events == SAMPLE_EVENTS[:4] + SAMPLE_EVENTS[8:]
            assert reader.report.corrupt_frames == [(offset, reason)]
            assert reader.report.torn_tail_offset is None
    # A length pointing past the end of the file, with valid frames after it: corrupt.
    data = bytearray(SAMPLE)
    data[offset + 4] = 0x7F
    with _opened(bytes(data)) as reader:
        events = list(reader)
        assert events == SAMPLE_EVENTS[:4] + SAMPLE_EVENTS[8:]
        assert reader.report.corrupt_frames == [(offset, "frame runs past the end of the file")]


def test_bad_magic_and_versions(tmp_path: Path) -> None:
    path = tmp_path / "r.zarc"
    for data in [b"", b"ZA", b"NOPE" + SAMPLE[4:], b"\x00" * 100]:
        path.write_bytes(data)
        with pytest.raises(NotARecordingError):
            RecordingReader(path)
    path.write_bytes(encode_header(HEADER, schema_version=SCHEMA_VERSION + 1))
    with pytest.raises(SchemaVersionError, match="schema version"):
        RecordingReader(path)
    path.write_bytes(encode_header(HEADER, format_version=FORMAT_VERSION + 1))
    with pytest.raises(SchemaVersionError, match="format version"):
        RecordingReader(path)
    path.write_bytes(SAMPLE[:10])
    with pytest.raises(CodecError, match="truncated"):
        RecordingReader(path)
    bad_crc = bytearray(encode_header(HEADER))
    bad_crc[20] ^= 0xFF
    path.write_bytes(bytes(bad_crc))
    with pytest.raises(CodecError, match="checksum"):
        RecordingReader(path)
    with pytest.raises(OSError):
        RecordingReader(tmp_path / "missing.zarc")


@pytest.mark.parametrize(
    ("fmt", "schema"), [(2306, SCHEMA_VERSION), (FORMAT_VERSION, SCHEMA_VERSION + 1)]
)
def test_an_unknown_version_is_refused_even_with_frames_after_it(
    tmp_path: Path, fmt: int, schema: int
) -> None:
    """Issue 34: a file whose format version field was 2306 read as "format v2" (the unknown
    version was taken for a damaged header and the frames read as version-2 frames)."""
    path = tmp_path / "r.zarc"
    frames = encode_frame(one_of_each()[1:4], codec=PayloadCodec("zstd"))
    path.write_bytes(
        encode_header(msgspec.structs.replace(HEADER, compression="zstd"),
                      format_version=fmt, schema_version=schema) + frames
    )  # fmt: skip
    what = "format" if fmt != FORMAT_VERSION else "schema"
    version = fmt if what == "format" else schema
    with pytest.raises(SchemaVersionError, match=f"^recording {what} version {version} is not "):
        RecordingReader(path)
    with pytest.raises(SchemaVersionError):
        Recording(path)


# -- random access -----------------------------------------------------------------------------


def test_seek_time_and_events_between(tmp_path: Path) -> None:
    events: list[Event] = [GpuSample("h", t, 0, float(t)) for t in range(0, 1000, 10)]
    # Duplicate times across a frame boundary.
    events[40:40] = [GpuSample("h", 395, 1)] * 6
    path = tmp_path / "r.zarc"
    write_recording(path, events, HEADER, events_per_frame=7)
    reader = RecordingReader(path)
    index = reader.frame_index()
    assert [t for _, t in index] == [events[i].t_ns for i in range(0, len(events), 7)]
    assert all(unpack_frame_prefix(path.read_bytes(), off) is not None for off, _ in index)

    def expect(t0: int, t1: int) -> list[Event]:
        return [e for e in events if t0 <= e.t_ns < t1]

    for t0, t1 in [(0, 1), (395, 396), (390, 400), (5, 995), (-5, 10**6), (999, 10**6), (500, 500)]:
        assert list(reader.events_between(t0, t1)) == expect(t0, t1), (t0, t1)
    assert list(reader.seek_time(395)) == [e for e in events if e.t_ns >= 395]
    assert list(reader.seek_time(2000)) == []
    assert list(reader.seek_time(-1)) == events
    # Frames after t1 are not even decoded.
    list(reader.events_between(0, 15))
    assert reader.report.frames_ok == 1


@pytest.mark.anyio
async def test_a_flush_in_progress_completes_when_the_stream_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timer's flush, blocked in a write when the stream ends (and the timer is
    cancelled), still writes its events: nothing taken from the buffer is lost."""
    import zeus_async.store.recorder as recorder_module

    gate = anyio.Event()
    writes: list[int] = []
    real_open = recorder_module._open_sink

    async def slow_open(path: Path) -> object:
        sink = await real_open(path)
        real_write = sink.write

        async def write(data: bytes) -> None:
            writes.append(len(data))
            if len(writes) > 1:  # the header goes through; frames wait for the gate
                await gate.wait()
            await real_write(data)

        sink.write = write  # type: ignore[method-assign]
        return sink

    monkeypatch.setattr(recorder_module, "_open_sink", slow_open)
    clock = FakeClock(autojump=False)
    path = tmp_path / "r.zarc"
    rec = Recorder(path, header=HEADER, flush_events=1000, flush_interval_s=1.0, clock=clock)
    batches = EventBatches(100)
    events = one_of_each()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rec.run, batches)
        await batches.send(events[0])
        await batches.send(events[1])
        while clock.sleepers == 0 or rec.pending_events < 2:
            await anyio.lowlevel.checkpoint()
        await clock.advance(1.0)  # the timer starts a flush, which blocks in write()
        while len(writes) < 2:
            await anyio.lowlevel.checkpoint()
        batches.close()  # end of stream: the run loop cancels the timer mid-flush
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        gate.set()
    assert list(RecordingReader(path)) == events[:2]
    assert rec.events_written == 2


HEX_BYTE = re.compile(r"[0-9a-f]{2}")


def test_the_documented_version_1_example_still_reads(tmp_path: Path) -> None:
    """docs/recording-format.md's hex example (a format-1 file) decodes with this build."""
    doc = (Path(__file__).parents[2] / "docs" / "recording-format.md").read_text()
    blocks = doc.split("```")[1:5:2]  # the header block, then the frame block
    data = b""
    for block in blocks:
        for line in block.strip().splitlines():
            tokens = list(itertools.takewhile(HEX_BYTE.fullmatch, line.split()))
            data += bytes.fromhex("".join(tokens))
    path = tmp_path / "doc.zarc"
    path.write_bytes(data)
    reader = RecordingReader(path)
    assert reader.format_version == 1 and reader.header.compression == "none"
    assert reader.header.meta == {"k": "v"} and reader.header.argv == ["a"]
    assert list(reader) == [GpuSample(host="h", t_ns=5, gpu=0, power_w=100.0)]
    assert reader.report.clean


@pytest.mark.anyio
async def test_a_large_flush_is_sealed_in_parallel_groups_and_stays_in_order(
    tmp_path: Path,
) -> None:
    """Many frames in one flush: groups are compressed by several worker threads at once
    (each with its own Zstandard context) and written in order."""
    from zeus_async.testing.fakes import realistic_gpu_samples

    events = realistic_gpu_samples(20_000, t0_ns=10**18, step_ns=1000)
    batches = EventBatches(len(events))
    for e in events:
        batches.send_nowait(e)
    batches.close()
    path = tmp_path / "big.zarc"
    header = msgspec.structs.replace(HEADER, compression="zstd")
    rec = Recorder(path, header=header, flush_events=37)
    await rec.run(batches)
    reader = RecordingReader(path)
    assert list(reader) == events
    assert reader.report.frames_ok == rec.frames_written == -(-len(events) // 37)


def test_payload_codec_from_many_threads() -> None:
    import concurrent.futures

    codec = PayloadCodec("zstd")
    payloads = [bytes([i]) * (10_000 + i) for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        packed = list(pool.map(codec.compress, payloads))
        back = list(pool.map(codec.expand, packed))
    assert back == payloads
