"""Format 3 (samples as columns): round trips from format 2, identical analysis from either,
the kept format-2 corpus, ``convert``, and hostile format-3 frames."""

from __future__ import annotations

import json
import resource
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeus_async.errors import ConfigError
from zeus_async.events import EVENT_TYPES, Event, EventEncoder, GpuSample, ProcessSample
from zeus_async.store import RecordingHeader, RecordingReader, write_recording
from zeus_async.store.analysis import Recording
from zeus_async.store.columnar import (
    _DIR_LEN,
    Block,
    ColumnGroup,
    Directory,
    _dir_decoder,
    _dir_encoder,
    encode_columns,
)
from zeus_async.store.columns import load_columns
from zeus_async.store.convert import convert_recording
from zeus_async.store.format import (
    MAX_FRAME_BYTES,
    PayloadCodec,
    encode_frame,
    encode_header,
    pack_frame_prefix,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "bus"))
from bus_helpers import EVENT_STRATEGIES

DATA = Path(__file__).parents[1] / "data"
HEADER = RecordingHeader(host="h", start_wall_ns=1, pid=1, compression="zstd")


def _times_ok(e: Any) -> Any:
    return msgspec.structs.replace(e, t_ns=abs(e.t_ns) % 2**63)


any_event = st.one_of(*EVENT_STRATEGIES.values()).map(_times_ok)


def _write_both(tmp: Path, events: list[Event], per_frame: int) -> tuple[Path, Path]:
    v2, v3 = tmp / "v2.zarc", tmp / "v3.zarc"
    write_recording(v2, events, HEADER, per_frame, overwrite=True, format_version=2)
    write_recording(v3, events, HEADER, per_frame, overwrite=True, format_version=3)
    return v2, v3


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(any_event, min_size=1, max_size=40), st.integers(min_value=1, max_value=50))
def test_every_event_kind_round_trips_from_v2_to_v3(
    tmp_path: Path, events: list[Event], per_frame: int
) -> None:
    v2, v3 = _write_both(tmp_path, events, per_frame)
    assert list(RecordingReader(v2)) == events
    converted = tmp_path / "conv.zarc"
    result = convert_recording(v2, converted, events_per_frame=per_frame, overwrite=True)
    assert result.events == len(events) and result.format_from == 2 and result.format_to == 3
    for path in (v3, converted):
        reader = RecordingReader(path)
        assert reader.format_version == 3
        assert list(reader) == events
        assert reader.report.clean and reader.report.events_ok == len(events)


def test_every_kind_is_exercised() -> None:
    assert set(EVENT_STRATEGIES) == set(EVENT_TYPES)


_opt_float = st.none() | st.floats(allow_nan=False, width=64)
_opt_int = st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1)


@st.composite
def gpu_frames(draw: Any) -> list[GpuSample]:
    """GPU samples whose fields are, per frame, all present, all absent or mixed (bitmaps)."""
    n = draw(st.integers(min_value=1, max_value=80))
    hosts = draw(st.lists(st.text(max_size=6), min_size=1, max_size=3))
    return [
        GpuSample(
            draw(st.sampled_from(hosts)),
            1000 + i * draw(st.integers(min_value=0, max_value=2**20)),
            draw(st.integers(min_value=-(2**63), max_value=2**63 - 1)),
            draw(_opt_float),
            draw(_opt_float),
            draw(_opt_float),
            None,
            draw(_opt_float),
            draw(_opt_float),
            draw(_opt_int),
            300.0,
        )
        for i in range(n)
    ]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(gpu_frames())
def test_sample_columns_with_gaps_round_trip(tmp_path: Path, events: list[GpuSample]) -> None:
    v2, v3 = _write_both(tmp_path, events, 64)
    assert list(RecordingReader(v3)) == events
    a = load_columns(RecordingReader(v2)).tables["gpu"]
    b = load_columns(RecordingReader(v3)).tables["gpu"]
    assert a.devices == b.devices and np.array_equal(a.device, b.device)
    for name, column in a.columns.items():
        assert column.dtype == b.columns[name].dtype, name
        assert np.array_equal(column, b.columns[name], equal_nan=True), name


def realistic(n_ticks: int, gpus: int = 8) -> list[Event]:
    sys.path.insert(0, str(Path(__file__).parents[2] / "bench" / "store"))
    from bench_columnar import events

    return list(events(n_ticks * gpus))


def test_uniform_samples_take_the_msgpack_path_and_odd_ones_the_object_path() -> None:
    enc = EventEncoder()
    events = [e for e in realistic(64) if isinstance(e, GpuSample)]
    frame = encode_columns(events, enc)
    assert [kind for kind, _, _ in frame.groups] == ["gpu"]
    mixed = [*events[:10], GpuSample("other-host", 5, 3)]  # different layout: objects
    frame = encode_columns(mixed, enc)
    assert [kind for kind, _, _ in frame.groups] == ["gpu"]
    bogus = [GpuSample("h", 1, 0, power_w="x")]  # type: ignore[arg-type]
    frame = encode_columns(bogus, enc)
    assert [kind for kind, _, _ in frame.groups] == [""]  # kept as a record


def test_load_columns_of_v2_and_v3_are_identical(tmp_path: Path) -> None:
    events = [*realistic(600), ProcessSample("node-01", 2**62, 7, 0.5, gpu=1, workload="w")]
    v2, v3 = _write_both(tmp_path, events, 4096)
    a, b = load_columns(RecordingReader(v2)), load_columns(RecordingReader(v3))
    assert a.counts == b.counts and a.hosts == b.hosts and a.others == b.others
    assert a.tables.keys() == b.tables.keys() == {"gpu", "rapl", "proc"}
    for kind, ta in a.tables.items():
        tb = b.tables[kind]
        assert ta.devices == tb.devices and ta.categories == tb.categories
        assert np.array_equal(ta.device, tb.device)
        for name, column in ta.columns.items():
            assert column.dtype == tb.columns[name].dtype, (kind, name)
            assert np.array_equal(column, tb.columns[name], equal_nan=True), (kind, name)
    assert v3.stat().st_size * 3 < v2.stat().st_size


def test_totals_and_window_energies_are_identical_from_v2_and_v3(tmp_path: Path) -> None:
    v2 = DATA / "sim_windows.zarc"
    v3 = tmp_path / "sim_windows.v3.zarc"
    convert_recording(v2, v3)
    a, b = Recording(v2), Recording(v3)
    assert RecordingReader(v3).format_version == 3
    assert a.totals() == b.totals()
    assert a.windows() == b.windows() and len(a.windows()) == 6
    for m in a.windows():
        for device in a.device_info():
            x, y = a.energy(device, m.start_ns, m.end_ns), b.energy(device, m.start_ns, m.end_ns)
            assert repr(x) == repr(y) and x.energy_j == y.energy_j
    for metric in ("gpu.power_w", "gpu.energy_j"):
        assert a.total(metric, "gpu:0") == b.total(metric, "gpu:0")


def test_the_kept_v2_corpus_reads_and_converts(tmp_path: Path) -> None:
    sys.path.insert(0, str(DATA))
    from make_v2_corpus import T0, every_kind
    from make_v2_corpus import samples as make_samples

    kinds = every_kind(T0) + every_kind(T0 + 100)
    samples = make_samples()
    expected = json.loads((DATA / "v2" / "expected.json").read_text())
    for name, want in expected.items():
        path = DATA / "v2" / f"{name}.zarc"
        reader = RecordingReader(path)
        events = list(reader)
        assert reader.format_version == 2
        assert len(events) == want["events"] and reader.report.frames_ok == want["frames"]
        assert reader.report.torn_tail_bytes == want["torn_tail_bytes"]
        # the events the corpus was written from (its generator is deterministic)
        source = kinds if name.startswith("every_kind") else samples
        assert events == source[: len(events)], name
        out = tmp_path / f"{name}.v3.zarc"
        result = convert_recording(path, out)
        assert result.report.clean == (want["torn_tail_bytes"] == 0)
        assert list(RecordingReader(out)) == events
        if name.startswith("samples"):
            assert Recording(path).totals() == Recording(out).totals()


def test_convert_never_writes_its_input_and_refuses_an_existing_output(tmp_path: Path) -> None:
    src = tmp_path / "run.zarc"
    src.write_bytes((DATA / "v2" / "samples.zarc").read_bytes())
    with pytest.raises(ConfigError, match="it is the input"):
        convert_recording(src, src, overwrite=True)
    out = tmp_path / "out.zarc"
    out.write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        convert_recording(src, out)
    assert out.read_bytes() == b"keep"
    convert_recording(src, out, overwrite=True)
    assert RecordingReader(out).format_version == 3
    assert list(RecordingReader(out)) == list(RecordingReader(src))


# -- hostile format-3 frames -------------------------------------------------------------------


def _frame_with(payload: bytes, t_ns: int) -> bytes:
    return pack_frame_prefix(len(payload), zlib.crc32(payload), t_ns) + payload


def _parts(events: list[Event]) -> tuple[Directory, bytes]:
    payload = encode_frame(events, codec=PayloadCodec("zstd"))[20:]
    (n,) = _DIR_LEN.unpack_from(payload, 0)
    return _dir_decoder.decode(payload[4 : 4 + n]), payload[4 + n :]


def _pack(directory: Directory, blocks: bytes) -> bytes:
    raw = _dir_encoder.encode(directory)
    return _DIR_LEN.pack(len(raw)) + raw + blocks


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_block_declaring_gigabytes_is_refused_before_expanding(tmp_path: Path) -> None:
    good = [e for e in realistic(64) if isinstance(e, GpuSample)]
    directory, blocks = _parts(good)
    column = directory.groups[0].columns[3]  # power_w
    assert column.values is not None and column.values.codec == 1
    column.values = Block(1, column.values.stored, 2**31)
    bad = _frame_with(_pack(directory, blocks), good[0].t_ns)
    path = tmp_path / "bomb.zarc"
    path.write_bytes(encode_header(HEADER) + bad + encode_frame(good, codec=PayloadCodec("zstd")))
    before = _maxrss_mb()
    reader = RecordingReader(path)
    assert list(reader) == good
    assert reader.report.corrupt_frames == [(len(encode_header(HEADER)), "undecodable payload")]
    assert _maxrss_mb() - before < 64


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_lying_directory_is_a_corrupt_frame_never_an_exception(data: st.DataObject) -> None:
    """Any field of a CRC-valid frame's directory changed: the frame reads as what it says
    (the same events) or is reported corrupt; the frames after it are read."""
    good = realistic(8)[:20]
    directory, blocks = _parts(good)
    raw = _dir_encoder.encode(directory)
    mutated = bytearray(raw)
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        pos = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
        mutated[pos] = data.draw(st.integers(min_value=0, max_value=255))
    payload = _DIR_LEN.pack(len(mutated)) + bytes(mutated) + blocks
    after = encode_frame(good, codec=PayloadCodec("zstd"))
    file = encode_header(HEADER) + _frame_with(payload, good[0].t_ns) + after
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lie.zarc"
        path.write_bytes(file)
        reader = RecordingReader(path)
        got = list(reader)
    assert got[-len(good) :] == good
    assert reader.report.frames_ok in (1, 2)
    assert reader.report.frames_ok == 2 or len(reader.report.corrupt_frames) == 1


def test_reading_v3_crafted_candidates_is_linear(tmp_path: Path) -> None:
    """A region packed with frame markers that each declare a payload to the end of the file:
    reading time grows linearly with its size (the resynchronization budget)."""
    good = realistic(8)[:40]
    frame = encode_frame(good, codec=PayloadCodec("zstd"))
    # A real frame after the region is checked when the budget has room: small frames, as in
    # test_hostile (a large frame right after a region this dense can be skipped unchecked,
    # in format 2 as in format 3).
    tail = b"".join(encode_frame([e], codec=PayloadCodec("zstd")) for e in good[:3])
    seconds = []
    for size in (256 * 1024, 1024 * 1024):
        region = bytearray()
        while len(region) < size:
            remaining = min(size - len(region) + len(tail) - 20, MAX_FRAME_BYTES)
            region += pack_frame_prefix(remaining, 0xDEADBEEF, 20) + b"\x00\x01\x02\x03"
        path = tmp_path / f"c{size}.zarc"
        path.write_bytes(encode_header(HEADER) + frame + bytes(region) + tail)
        t = time.perf_counter()
        reader = RecordingReader(path)
        got = list(reader)
        seconds.append(time.perf_counter() - t)
        assert got[:40] == good and got[-1] == good[2]  # frames after the region are read
    assert seconds[1] < 4 * seconds[0] * 3 + 0.5  # 4x the bytes: far below the 16x of a square


def test_columnar_frames_keep_their_groups() -> None:
    events = realistic(16)
    frame = encode_columns(events, EventEncoder())
    assert [kind for kind, _, _ in frame.groups] == ["gpu", "rapl"]
    payload = frame.seal(None)
    import zstandard

    from zeus_async.events import EventDecoder
    from zeus_async.store.columnar import decode_payload

    decoded = decode_payload(payload, zstandard.ZstdDecompressor(), EventDecoder(), limit=2**20)
    assert decoded.events() == events
    assert isinstance(decoded.groups[0], ColumnGroup) and decoded.groups[0].rows == 128
    assert decoded.events(["rapl"]) == [e for e in events if not isinstance(e, GpuSample)]
