"""Recovery edge cases: a real frame right behind a dense crafted region of frame markers, and
invalid UTF-8 inside a payload whose CRC is valid (formats 2 and 3)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from zeus_async.events import Event, GpuSample
from zeus_async.store import RecordingHeader, RecordingReader
from zeus_async.store.format import (
    FRAME_MAGIC,
    FRAME_PREFIX_SIZE,
    MAX_FRAME_BYTES,
    PayloadCodec,
    encode_frame,
    encode_header,
    pack_frame_prefix,
    unpack_frame_prefix,
)


def _header(compression: str) -> RecordingHeader:
    return RecordingHeader(host="h", start_wall_ns=1, pid=1, compression=compression)


@pytest.mark.parametrize("version", [2, 3])
def test_a_real_frame_right_behind_a_dense_crafted_region_is_checked(
    tmp_path: Path, version: int
) -> None:
    # 1 MiB of frame markers, each declaring a payload that runs to the end of the file, then
    # a real frame of a few MiB, then another. The failed checks of the region use up the
    # allowance (64 MiB + twice the bytes advanced); the big frame's check reads bytes that
    # hold no other marker, so it is checked all the same (it was skipped before).
    codec = PayloadCodec("none")
    before = [GpuSample("h", 10, 0, 100.0)]
    big = [GpuSample("h", 1_000 + i, i % 8, 100.0 + i, energy_j=float(i)) for i in range(110_000)]
    after = [GpuSample("h", 500_000, 0, 7.0)]
    big_frame = encode_frame(big, codec=codec, format_version=version)
    assert FRAME_MAGIC not in big_frame[1:]  # the premise: no marker inside its check
    tail = big_frame + encode_frame(after, codec=codec, format_version=version)
    region = bytearray()
    size = 1024 * 1024
    while len(region) < size:
        remaining = size - len(region) + len(tail) - FRAME_PREFIX_SIZE
        region += pack_frame_prefix(remaining, 0xDEADBEEF, 20) + b"\x00\x01\x02\x03"
    # Once the failed checks have used up the allowance, what is left of it stays below the
    # cost of the next candidate (the rest of the region plus the tail): below the big
    # frame's payload at the end of the region, whatever the byte counts.
    big_len = unpack_frame_prefix(big_frame)
    assert big_len is not None and 1024 * 1024 < big_len.payload_len < MAX_FRAME_BYTES
    path = tmp_path / "crafted.zarc"
    path.write_bytes(
        encode_header(_header("none"), format_version=version)
        + encode_frame(before, codec=codec, format_version=version)
        + bytes(region)
        + tail
    )
    reader = RecordingReader(path)
    events: list[Event] = list(reader)
    assert len(events) == 1 + len(big) + 1
    assert events[0] == before[0] and events[-1] == after[0]
    assert events[1:-1] == big
    assert reader.report.unchecked_candidates > 40_000  # the region: skipped, not checked
    ((offset, reason),) = reader.report.corrupt_frames
    assert reason == "payload checksum mismatch"
    assert offset == path.stat().st_size - len(region) - len(tail)  # the region's start
    assert reader.report.frames_ok == 3


def _with_bad_utf8(frame: bytes, good: bytes, bad: bytes) -> bytes:
    """``frame`` with ``good`` replaced by ``bad`` (same length) and its CRC made valid again."""
    prefix = unpack_frame_prefix(frame)
    assert prefix is not None
    payload = frame[FRAME_PREFIX_SIZE:]
    assert payload.count(good) >= 1 and len(good) == len(bad)
    payload = payload.replace(good, bad)
    return pack_frame_prefix(len(payload), zlib.crc32(payload), prefix.first_t_ns) + payload


@pytest.mark.parametrize("version", [2, 3])
def test_invalid_utf8_under_a_valid_crc_is_a_corrupt_frame_not_an_exception(
    tmp_path: Path, version: int
) -> None:
    codec = PayloadCodec("none")  # the string's bytes are in the payload as they are
    first = [GpuSample("node-01", 10 + i, i, 100.0) for i in range(3)]
    second = [GpuSample("node-01", 20 + i, i, 100.0) for i in range(3)]
    third = [GpuSample("node-01", 30 + i, i, 100.0) for i in range(3)]
    frames = [encode_frame(b, codec=codec, format_version=version) for b in (first, second, third)]
    frames[1] = _with_bad_utf8(frames[1], b"node-01", b"node\xff01")
    path = tmp_path / "utf8.zarc"
    path.write_bytes(encode_header(_header("none"), format_version=version) + b"".join(frames))
    reader = RecordingReader(path)
    assert list(reader) == first + third
    ((offset, reason),) = reader.report.corrupt_frames
    assert reason == "undecodable payload"
    assert offset == len(encode_header(_header("none"), format_version=version)) + len(frames[0])
    # Every other reader of the file takes the same frames.
    assert sum(len(b) for b in RecordingReader(path).batches()) == 6
