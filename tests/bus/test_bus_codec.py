from __future__ import annotations

import struct
import uuid
from typing import Any

import msgspec
import pytest
from bus_helpers import EVENT_STRATEGIES, any_event, gpu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeus_async.bus import (
    FLAG_FINAL,
    HEADER_SIZE,
    FrameDecoder,
    FrameEncoder,
    FrameHeader,
    pack_header,
    unpack_header,
)
from zeus_async.bus.codec import MAGIC, event_tags, parse_stream_id
from zeus_async.errors import CodecError, ConfigError, SchemaVersionError
from zeus_async.events import EVENT_TYPES, SCHEMA_VERSION, EventEncoder, event_topic

SID = "12345678-1234-4234-8234-123456789abc"


def test_header_is_52_bytes_big_endian_at_documented_offsets() -> None:
    enc = FrameEncoder(SID)
    enc.encode("a", [gpu(0)])  # seq 0, topic a: 0
    topic, header, _payload = enc.encode("a", [gpu(1), gpu(2)], flags=FLAG_FINAL, wall_ns=7)
    assert HEADER_SIZE == 52 == len(header)
    assert topic == b"a"
    assert header[0:2] == b"ZA" == MAGIC
    assert header[2] == 1  # header version
    assert header[3] == FLAG_FINAL
    assert struct.unpack(">H", header[4:6])[0] == SCHEMA_VERSION
    assert header[6:8] == b"\0\0"
    assert header[8:24] == uuid.UUID(SID).bytes
    assert struct.unpack(">Q", header[24:32])[0] == 1  # stream seq
    assert struct.unpack(">Q", header[32:40])[0] == 1  # topic seq
    assert struct.unpack(">Q", header[40:48])[0] == 7  # wall ns
    assert struct.unpack(">I", header[48:52])[0] == 2  # event count


def test_sequence_numbers_per_stream_and_per_topic() -> None:
    enc = FrameEncoder(SID)
    dec = FrameDecoder()
    topics = ["gpu/n/0", "gpu/n/1", "gpu/n/0", "stream/n", "gpu/n/0", "gpu/n/1"]
    headers = [dec.decode(enc.encode(t, [gpu(i)])).header for i, t in enumerate(topics)]
    assert [h.seq for h in headers] == [0, 1, 2, 3, 4, 5]
    assert [h.topic_seq for h in headers] == [0, 0, 1, 0, 2, 1]
    assert enc.skip("gpu/n/1", 3) == (6, 2)  # a dropped frame still consumes its numbers
    h = dec.decode(enc.encode("gpu/n/1", [gpu(9)])).header
    assert (h.seq, h.topic_seq) == (7, 3)
    assert enc.seq == 8
    assert enc.events == 6 + 3 + 1


def test_payload_is_exactly_what_event_encoder_produces() -> None:
    events = [gpu(i) for i in range(5)]
    _, _, payload = FrameEncoder(SID).encode("gpu/n1/0", events)
    assert payload == EventEncoder().encode(events)  # type: ignore[arg-type]
    raw = msgspec.msgpack.decode(payload)
    assert raw[0][:5] == ["gpu", "n1", 0, 0, 0.0]  # tag, host, t_ns, gpu, power_w


def test_pack_unpack_header_round_trip() -> None:
    h = FrameHeader(SID, 2**64 - 1, 5, 2**63, 2**32 - 1, SCHEMA_VERSION, FLAG_FINAL)
    assert unpack_header(pack_header(h)) == h
    assert unpack_header(pack_header(h)).final
    with pytest.raises(CodecError):
        pack_header(h._replace(seq=2**64))
    with pytest.raises(CodecError):
        pack_header(h._replace(stream_id="nope"))


def test_longer_header_is_accepted_for_forward_compatibility() -> None:
    parts = FrameEncoder(SID).encode("t", [gpu(1)])
    frame = FrameDecoder().decode([parts[0], parts[1] + b"future fields", parts[2]])
    assert frame.events == [gpu(1)]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(event=any_event)
def test_round_trip_of_every_event_kind(event: Any) -> None:
    topic = event_topic(event)
    enc = FrameEncoder(uuid.uuid4())
    frame = FrameDecoder().decode(enc.encode(topic, [event]))
    assert frame.topic == topic
    assert frame.events == [event]
    assert frame.header.event_count == 1
    assert frame.header.stream_id == enc.stream_id


@pytest.mark.parametrize("kind", EVENT_TYPES, ids=lambda t: t.__name__)
def test_round_trip_of_batches_per_kind(kind: type[Any]) -> None:
    @settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
    @given(events=st.lists(EVENT_STRATEGIES[kind], max_size=20))
    def check(events: list[Any]) -> None:
        frame = FrameDecoder().decode(FrameEncoder(SID).encode("x", events))
        assert frame.events == events
        assert frame.header.event_count == len(events)

    check()


def _valid_frame() -> list[bytes]:
    return FrameEncoder(SID).encode("gpu/n1/0", [gpu(i) for i in range(3)])


@settings(max_examples=500)
@given(parts=st.lists(st.binary(max_size=120), max_size=5))
def test_garbage_raises_only_codec_error(parts: list[bytes]) -> None:
    try:
        FrameDecoder().decode(parts)
    except CodecError:
        pass


@settings(max_examples=500)
@given(part=st.integers(0, 2), data=st.data())
def test_bit_flips_raise_only_codec_error(part: int, data: st.DataObject) -> None:
    parts = _valid_frame()
    buf = bytearray(parts[part])
    if not buf:
        return
    flips = data.draw(st.lists(st.integers(0, len(buf) * 8 - 1), min_size=1, max_size=4))
    for bit in flips:
        buf[bit // 8] ^= 1 << (bit % 8)
    parts[part] = bytes(buf)
    try:
        frame = FrameDecoder().decode(parts)
    except CodecError:
        return
    assert len(frame.events) <= frame.header.event_count


@settings(max_examples=300)
@given(part=st.integers(0, 2), cut=st.integers(0, 400), garbage=st.binary(max_size=16))
def test_truncated_or_extended_payloads_raise_only_codec_error(
    part: int, cut: int, garbage: bytes
) -> None:
    parts = _valid_frame()
    parts[part] = parts[part][:cut] + garbage
    try:
        FrameDecoder().decode(parts)
    except CodecError:
        pass


def test_truncated_payload_is_a_codec_error() -> None:
    topic, header, payload = _valid_frame()
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            FrameDecoder().decode([topic, header, payload[:cut]])


def test_specific_malformations() -> None:
    topic, header, payload = _valid_frame()
    dec = FrameDecoder()
    with pytest.raises(CodecError, match="3 parts"):
        dec.decode([topic, header])
    with pytest.raises(CodecError, match="UTF-8"):
        dec.decode([b"\xff\xfe", header, payload])
    with pytest.raises(CodecError, match="too short"):
        dec.decode([topic, header[:51], payload])
    with pytest.raises(CodecError, match="magic"):
        dec.decode([topic, b"XX" + header[2:], payload])
    count_wrong = header[:48] + struct.pack(">I", 4)
    with pytest.raises(CodecError, match="says 4 events"):
        dec.decode([topic, count_wrong, payload])
    with pytest.raises(CodecError):
        dec.decode([topic, header, msgspec.msgpack.encode([["gpu", "h", "not-an-int", 0]])])


def test_unknown_versions_raise_schema_version_error() -> None:
    topic, header, payload = _valid_frame()
    newer_header = header[:2] + b"\x02" + header[3:]
    with pytest.raises(SchemaVersionError, match="header version 2"):
        FrameDecoder().decode([topic, newer_header, payload])
    newer_schema = header[:4] + struct.pack(">H", SCHEMA_VERSION + 1) + header[6:]
    with pytest.raises(SchemaVersionError, match="schema version"):
        FrameDecoder().decode([topic, newer_schema, payload])
    assert issubclass(SchemaVersionError, CodecError)


def test_unknown_event_tags_are_skipped_and_counted() -> None:
    enc = FrameEncoder(SID)
    _, header, _ = enc.encode("gpu/n1/0", [gpu(0), gpu(1), gpu(2)])
    known = msgspec.msgpack.decode(msgspec.msgpack.encode([gpu(0), gpu(2)]))
    payload = msgspec.msgpack.encode([known[0], ["from_the_future", 1, {"x": [1, 2]}], known[1]])
    dec = FrameDecoder()
    frame = dec.decode([b"gpu/n1/0", header, payload])
    assert frame.events == [gpu(0), gpu(2)]
    assert dec.unknown_events == 1


def test_newer_publisher_appending_fields_still_decodes() -> None:
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode([gpu(3)]))
    raw[0].append("a field appended by a later schema")
    _, header, _ = FrameEncoder(SID).encode("t", [gpu(3)])
    frame = FrameDecoder().decode([b"t", header, msgspec.msgpack.encode(raw)])
    assert frame.events == [gpu(3)]


def test_encoding_a_bad_event_is_a_codec_error() -> None:
    enc = FrameEncoder(SID)
    with pytest.raises(CodecError):
        enc.encode("t", [gpu(0), object()])  # type: ignore[list-item]
    assert enc.seq == 0  # nothing consumed: the caller decides (the publisher skips)


def test_stream_id_parsing() -> None:
    u = uuid.uuid4()
    assert parse_stream_id(str(u)) == u
    assert parse_stream_id(u.bytes) == u
    assert parse_stream_id(u) == u
    with pytest.raises(ConfigError):
        parse_stream_id("not-a-uuid")
    with pytest.raises(ConfigError):
        FrameEncoder(b"short")


def test_event_tags_cover_the_union() -> None:
    tags = event_tags()
    assert list(tags.values()) == list(EVENT_TYPES)
    assert tags["gpu"].__name__ == "GpuSample"
