"""Hostile files: what a crafted frame can cost a reader is bounded."""

from __future__ import annotations

import io
import resource
import zlib
from pathlib import Path

import msgspec
import zstandard

from zeus_async.events import EventDecoder, GpuSample
from zeus_async.store import RecordingHeader, RecordingReader
from zeus_async.store.format import (
    MAX_FRAME_BYTES,
    PayloadCodec,
    encode_frame,
    encode_header,
    pack_frame_prefix,
)
from zeus_async.store.reader import _validate

HEADER = RecordingHeader(host="h", start_wall_ns=1, pid=1, compression="zstd")
GIB = 1024**3


def _bomb(t_ns: int) -> bytes:
    """A frame whose valid CRC covers a few kB of zstd that expand to 1 GiB of zeros (the
    frame header declares it)."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, size=GIB, closefd=False) as writer:
        chunk = bytes(1024 * 1024)
        for _ in range(GIB // len(chunk)):
            writer.write(chunk)
    stored = out.getvalue()
    assert len(stored) < 100_000
    return pack_frame_prefix(len(stored), zlib.crc32(stored), t_ns) + stored


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_decompression_bomb_is_rejected_before_it_expands(tmp_path: Path) -> None:
    codec = PayloadCodec("zstd")
    good = [GpuSample("h", 10, 0, 100.0), GpuSample("h", 30, 0, 100.0)]
    path = tmp_path / "bomb.zarc"
    path.write_bytes(
        encode_header(HEADER)
        + encode_frame(good[:1], codec=codec)
        + _bomb(20)
        + encode_frame(good[1:], codec=codec)
    )
    before = _maxrss_mb()
    reader = RecordingReader(path)
    assert list(reader) == good  # the frames around it are read
    assert _maxrss_mb() - before < 200  # not the 1 GiB it declares
    ((_, reason),) = reader.report.corrupt_frames
    assert reason == "undecodable payload"


def test_a_declared_payload_over_the_limit_is_not_read(tmp_path: Path) -> None:
    # The prefix claims more than the limit: rejected from the prefix alone (no CRC pass over
    # it), then the reader resynchronizes on the next frame.
    codec = PayloadCodec("zstd")
    good = [GpuSample("h", 10, 0, 100.0), GpuSample("h", 30, 0, 100.0)]
    liar = pack_frame_prefix(MAX_FRAME_BYTES + 1, 0, 20) + msgspec.msgpack.encode([1])
    path = tmp_path / "liar.zarc"
    path.write_bytes(
        encode_header(HEADER)
        + encode_frame(good[:1], codec=codec)
        + liar
        + encode_frame(good[1:], codec=codec)
    )
    reader = RecordingReader(path)
    assert list(reader) == good
    ((_, reason),) = reader.report.corrupt_frames
    assert reason == "frame runs past the end of the file"
    # In a file large enough to hold it, the limit is what rejects it (unit check, sparse).
    big = bytearray(MAX_FRAME_BYTES + 64)
    big[: len(liar)] = liar
    decoder = EventDecoder()
    assert _validate(big, 0, len(big), decoder, codec) == (
        "declared payload over the frame size limit"
    )


def test_resync_through_a_crafted_region_is_bounded_and_finds_the_frames_after(
    tmp_path: Path,
) -> None:
    # 1 MiB of frame markers, each declaring a payload to the end of the file: checking every
    # one would read ~20 GB. The reader checks what its budget allows, skips the rest
    # unchecked (counted), and still finds the real frames after the region.
    codec = PayloadCodec("zstd")
    before = [GpuSample("h", 10, 0, 100.0)]
    after = [GpuSample("h", 30 + i, 0, 100.0) for i in range(3)]
    tail = b"".join(encode_frame([e], codec=codec) for e in after)
    region = bytearray()
    size = 1024 * 1024
    while len(region) < size:
        remaining = size - len(region) + len(tail) - 20
        region += pack_frame_prefix(remaining, 0xDEADBEEF, 20) + b"\x00\x01\x02\x03"
    path = tmp_path / "crafted.zarc"
    path.write_bytes(
        encode_header(HEADER) + encode_frame(before, codec=codec) + bytes(region) + tail
    )
    reader = RecordingReader(path)
    assert list(reader) == before + after
    assert reader.report.unchecked_candidates > 1000
    ((_, reason),) = reader.report.corrupt_frames
    assert reason == "payload checksum mismatch"


def test_bad_times_and_duplicates_are_dropped_and_counted_never_fatal(tmp_path: Path) -> None:
    from zeus_async.aggregate import LiveTotals
    from zeus_async.aggregate.history import DeviceHistory
    from zeus_async.store import Recorder
    from zeus_async.testing.recording import record_events

    t0 = 1_700_000_000_000_000_000
    ms = 1_000_000
    samples = [GpuSample("h", t0 + k * 10 * ms, 0, 100.0, float(k // 10)) for k in range(50)]
    # A broken publisher's events: negative time, past u64, then a late duplicate.
    bad = [GpuSample("h", -5, 0, 100.0, 0.0), GpuSample("h", 2**64, 0, 1.0, 0.0)]
    late = GpuSample("h", samples[20].t_ns, 0, 100.0, 9.0)
    stream = [*bad, *samples[:30], late, *samples[30:]]
    recorder = record_events(Recorder(tmp_path / "r.zarc", header=HEADER, flush_events=7), stream)
    assert recorder.events_dropped == 2  # the recording went on
    read = list(RecordingReader(tmp_path / "r.zarc"))
    assert read == [*samples[:30], late, *samples[30:]]

    totals = LiveTotals()
    history = DeviceHistory("gpu:0")
    for e in read:
        assert isinstance(e, GpuSample)
        totals.add(e)
        history.add(e.t_ns, e.power_w, e.energy_j)
    gpu = totals.devices["gpu:0"]
    assert gpu.dropped == 1 and history.dropped == 1
    clean = LiveTotals()
    for e in samples:
        clean.add(e)
    assert gpu.energy_j == clean.devices["gpu:0"].energy_j  # the late one changed nothing


def test_frames_are_read_without_a_damaged_header(tmp_path: Path) -> None:
    # One flipped bit in the header (its body, or its length field) used to make the whole
    # file unreadable; the frames carry everything but the run metadata.
    for compression in ("zstd", "none"):
        header = RecordingHeader(host="h", start_wall_ns=1, pid=1, compression=compression)
        codec = PayloadCodec(compression)
        # Frames large enough that a format-3 frame compresses its blocks (a frame of small
        # blocks stores them as they are, and says nothing of the header's codec).
        events = [GpuSample("h", 10 + i, 0, 100.0 + i) for i in range(600)]
        frames = b"".join(
            encode_frame(events[i : i + 200], codec=codec) for i in range(0, 600, 200)
        )
        head = encode_header(header)
        for pos in (len(head) - 6, 9):  # inside the body; inside the body length
            data = bytearray(head + frames)
            data[pos] ^= 0x10
            path = tmp_path / f"flip-{compression}-{pos}.zarc"
            path.write_bytes(bytes(data))
            reader = RecordingReader(path)
            assert list(reader) == events, (compression, pos)
            assert reader.report.header_damage and not reader.report.clean
            assert reader.header.meta["header"].startswith("damaged: ")
            assert reader.header.compression == compression
