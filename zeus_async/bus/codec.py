"""Framing of events on the bus: ``[topic, header, payload]`` ZeroMQ multipart messages.

The byte-level contract lives in ``docs/wire-format.md``; this module is its reference
implementation. In short:

* **topic** — UTF-8, prefix-filterable (:func:`zeus_async.events.event_topic`); every event of a
  frame has this topic.
* **header** — :data:`HEADER_SIZE` bytes, network byte order (big-endian)::

      offset  size  type   field
      0       2     bytes  magic b"ZA"
      2       1     u8     header version (1)
      3       1     u8     flags (bit 0: FINAL, last frame of the stream)
      4       2     u16    schema version of the payload's events
      6       2     u16    reserved, 0
      8       16    bytes  stream id (UUID, RFC 4122 byte order)
      24      8     u64    stream sequence number (consecutive over all topics of the stream)
      32      8     u64    topic sequence number (consecutive per (stream, topic))
      40      8     u64    publisher wall clock at encoding, ns since the Unix epoch
      48      4     u32    number of events in the payload

* **payload** — a msgpack array of events, each event a msgpack array ``[tag, field, ...]``
  (byte-for-byte what :meth:`zeus_async.events.EventEncoder.encode` produces for a list).

Two sequence numbers make every drop visible to every subscriber: the stream sequence lets a
subscriber that receives *all* topics detect each lost frame, tail included (heartbeats follow
data); the topic sequence lets a topic-filtered subscriber, which legitimately never sees the
other topics, count exactly the frames it lost on the topics it does receive.

Decoding never raises anything but :class:`~zeus_async.errors.CodecError` (or its subclass
:class:`~zeus_async.errors.SchemaVersionError`) on bad input.
"""

from __future__ import annotations

import logging
import struct
import time
import uuid
from collections.abc import Sequence
from typing import Final, NamedTuple

import msgspec

from ..errors import CodecError, ConfigError, SchemaVersionError
from ..events import EVENT_TYPES, SCHEMA_VERSION, Event

__all__ = [
    "FLAG_FINAL",
    "HEADER_SIZE",
    "HEADER_VERSION",
    "MAGIC",
    "SUPPORTED_SCHEMA_VERSIONS",
    "Frame",
    "FrameDecoder",
    "FrameEncoder",
    "FrameHeader",
    "event_tags",
    "pack_header",
    "parse_stream_id",
    "unpack_header",
]

logger = logging.getLogger(__name__)

#: First two bytes of every header.
MAGIC: Final = b"ZA"
#: Version of the header layout described above.
HEADER_VERSION: Final = 1
#: Header flag: this is the last frame the publisher sends on this stream.
FLAG_FINAL: Final = 0x01
#: Schema versions this build decodes.
SUPPORTED_SCHEMA_VERSIONS: Final = frozenset({SCHEMA_VERSION})

_HEADER = struct.Struct("!2sBBHH16sQQQI")
#: Size of a version-1 header in bytes.
HEADER_SIZE: Final = _HEADER.size  # 52
_U64_MAX: Final = 2**64 - 1
_U32_MAX: Final = 2**32 - 1

_TAGS: Final[frozenset[str]] = frozenset(str(t.__struct_config__.tag) for t in EVENT_TYPES)


def event_tags() -> dict[str, type[Event]]:
    """Map every event tag to its struct type, in the order of :data:`zeus_async.events.Event`."""
    return {str(t.__struct_config__.tag): t for t in EVENT_TYPES}


def parse_stream_id(value: str | bytes | uuid.UUID) -> uuid.UUID:
    """Parse a stream id given as UUID text, 16 raw bytes, or :class:`uuid.UUID`.

    Raises:
        ConfigError: ``value`` is not a UUID.
    """
    if isinstance(value, uuid.UUID):
        return value
    try:
        if isinstance(value, bytes):
            return uuid.UUID(bytes=value)
        return uuid.UUID(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"stream id must be a UUID, got {value!r}") from exc


class FrameHeader(NamedTuple):
    """The decoded header of one frame (see the module docstring for the byte layout)."""

    stream_id: str
    """Publisher stream id, canonical UUID text (``xxxxxxxx-xxxx-...``)."""
    seq: int
    """Stream sequence number: consecutive over all frames of the stream, from 0."""
    topic_seq: int
    """Topic sequence number: consecutive over the frames of this topic in this stream, from 0."""
    wall_ns: int
    """Publisher wall clock when the frame was encoded (ns since the Unix epoch)."""
    event_count: int
    """Number of events in the payload."""
    schema_version: int = SCHEMA_VERSION
    """Schema version of the payload's events."""
    flags: int = 0
    """Bit field; :data:`FLAG_FINAL` marks the last frame of a stream."""

    @property
    def final(self) -> bool:
        """Whether this is the last frame of its stream (the publisher is shutting down)."""
        return bool(self.flags & FLAG_FINAL)


class Frame(NamedTuple):
    """One decoded frame: its topic, header and events."""

    topic: str
    header: FrameHeader
    events: list[Event]


def pack_header(header: FrameHeader) -> bytes:
    """Encode a header to its :data:`HEADER_SIZE` bytes.

    Raises:
        CodecError: A field does not fit its wire type.
    """
    try:
        return _HEADER.pack(
            MAGIC,
            HEADER_VERSION,
            header.flags,
            header.schema_version,
            0,
            uuid.UUID(header.stream_id).bytes,
            header.seq,
            header.topic_seq,
            header.wall_ns,
            header.event_count,
        )
    except (struct.error, ValueError, TypeError) as exc:
        raise CodecError(f"cannot pack frame header {header!r}: {exc}") from None


_stream_id_cache: dict[bytes, str] = {}


def _stream_id_text(raw: bytes) -> str:
    text = _stream_id_cache.get(raw)
    if text is None:
        if len(_stream_id_cache) >= 4096:
            _stream_id_cache.clear()
        text = _stream_id_cache[raw] = str(uuid.UUID(bytes=raw))
    return text


def unpack_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Decode a header frame.

    A header longer than :data:`HEADER_SIZE` is accepted and its extra bytes ignored (future
    header fields are only appended).

    Raises:
        SchemaVersionError: Unknown header version or unsupported schema version.
        CodecError: Not a zeus_async header (wrong magic, too short).
    """
    if len(data) < HEADER_SIZE:
        raise CodecError(f"frame header too short: {len(data)} < {HEADER_SIZE} bytes")
    magic, version, flags, schema, _reserved, sid, seq, topic_seq, wall_ns, count = (
        _HEADER.unpack_from(data)
    )
    if magic != MAGIC:
        raise CodecError(f"bad frame magic {bytes(magic)!r}")
    if version != HEADER_VERSION:
        raise SchemaVersionError(
            f"unsupported frame header version {version} (this build reads {HEADER_VERSION})"
        )
    if schema not in SUPPORTED_SCHEMA_VERSIONS:
        raise SchemaVersionError(
            f"unsupported event schema version {schema} "
            f"(this build reads {sorted(SUPPORTED_SCHEMA_VERSIONS)})"
        )
    return FrameHeader(_stream_id_text(sid), seq, topic_seq, wall_ns, count, schema, flags)


class FrameEncoder:
    """Encodes batches of events into frames of one stream, assigning sequence numbers.

    One encoder per publisher instance: it owns the stream's two sequence counters. Every call to
    :meth:`encode` or :meth:`skip` consumes one stream sequence number and one topic sequence
    number, so a frame that is never sent (:meth:`skip`) shows up as a gap at the subscribers.

    Args:
        stream_id: The stream's UUID (text, 16 bytes or :class:`uuid.UUID`).

    Raises:
        ConfigError: ``stream_id`` is not a UUID.
    """

    __slots__ = ("_enc", "_sid", "_stream_id", "_topic_bytes", "_topic_seqs", "events", "seq")

    def __init__(self, stream_id: str | bytes | uuid.UUID) -> None:
        sid = parse_stream_id(stream_id)
        self._sid = sid.bytes
        self._stream_id = str(sid)
        self._enc = msgspec.msgpack.Encoder()
        self._topic_seqs: dict[str, int] = {}
        self._topic_bytes: dict[str, bytes] = {}
        #: Next stream sequence number (= frames sequenced so far).
        self.seq = 0
        #: Events in all frames sequenced so far (sent or skipped).
        self.events = 0

    @property
    def stream_id(self) -> str:
        """Canonical UUID text of the stream."""
        return self._stream_id

    def next_topic_seq(self, topic: str) -> int:
        """The topic sequence number the next frame of ``topic`` will carry."""
        return self._topic_seqs.get(topic, 0)

    def topic_counts(self) -> dict[str, int]:
        """Frames sequenced so far on each topic (the next topic seq of each)."""
        return dict(self._topic_seqs)

    def _advance(self, topic: str, count: int) -> tuple[int, int]:
        seq = self.seq
        tseq = self._topic_seqs.get(topic, 0)
        self._topic_seqs[topic] = tseq + 1
        self.seq = seq + 1
        self.events += count
        return seq, tseq

    def encode(
        self,
        topic: str,
        events: Sequence[Event],
        *,
        flags: int = 0,
        wall_ns: int | None = None,
    ) -> list[bytes]:
        """Encode ``events`` (all of topic ``topic``) into ``[topic, header, payload]``.

        Args:
            topic: The frame's topic.
            events: The events; at most 2**32 - 1.
            flags: Header flags (:data:`FLAG_FINAL`).
            wall_ns: Header wall clock; defaults to ``time.time_ns()``.

        Raises:
            CodecError: An event cannot be encoded, or too many events.
        """
        count = len(events)
        if count > _U32_MAX:
            raise CodecError(f"too many events for one frame: {count}")
        try:
            payload = self._enc.encode(events)
        except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as exc:
            raise CodecError(f"cannot encode events: {exc}") from None
        tb = self._topic_bytes.get(topic)
        if tb is None:
            tb = self._topic_bytes[topic] = topic.encode()
        seq, tseq = self._advance(topic, count)
        header = _HEADER.pack(
            MAGIC,
            HEADER_VERSION,
            flags,
            SCHEMA_VERSION,
            0,
            self._sid,
            seq,
            tseq,
            time.time_ns() if wall_ns is None else wall_ns,
            count,
        )
        return [tb, header, payload]

    def skip(self, topic: str, count: int) -> tuple[int, int]:
        """Consume the sequence numbers of a frame that will not be sent (a local drop).

        Returns:
            The (stream, topic) sequence numbers the dropped frame would have carried.
        """
        return self._advance(topic, count)


class FrameDecoder:
    """Decodes ``[topic, header, payload]`` frames into :class:`Frame`.

    Events whose tag this build does not know (a newer publisher) are skipped and counted in
    :attr:`unknown_events`, so a newer publisher can add event kinds without breaking older
    subscribers. Any other malformation raises :class:`~zeus_async.errors.CodecError`.
    """

    __slots__ = ("_batch", "_one", "_raw", "unknown_events")

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(list[Event])
        self._raw = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._one = msgspec.msgpack.Decoder(Event)
        #: Events skipped because their tag is unknown to this build.
        self.unknown_events = 0

    def decode(self, parts: Sequence[bytes | bytearray | memoryview]) -> Frame:
        """Decode one multipart message.

        Raises:
            SchemaVersionError: Unknown header or schema version.
            CodecError: Anything else malformed (part count, topic, header, payload, count).
        """
        if len(parts) != 3:
            raise CodecError(f"a frame has 3 parts (topic, header, payload), got {len(parts)}")
        topic_raw, header_raw, payload = parts
        try:
            topic = bytes(topic_raw).decode()
        except UnicodeDecodeError:
            raise CodecError("frame topic is not valid UTF-8") from None
        header = unpack_header(header_raw)
        events = self.decode_payload(payload, header.event_count)
        return Frame(topic, header, events)

    def decode_payload(self, payload: bytes | bytearray | memoryview, count: int) -> list[Event]:
        """Decode a payload that the header says holds ``count`` events.

        Raises:
            CodecError: Malformed payload, or not ``count`` events.
        """
        try:
            events = self._batch.decode(payload)
        except msgspec.ValidationError:
            events = self._decode_lenient(payload, count)
            return events
        except (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError) as exc:
            raise CodecError(f"invalid frame payload: {exc}") from None
        if len(events) != count:
            raise CodecError(f"frame header says {count} events, payload holds {len(events)}")
        return events

    def _decode_lenient(self, payload: bytes | bytearray | memoryview, count: int) -> list[Event]:
        """Slow path: decode event by event, skipping unknown tags, failing on anything else."""
        try:
            raws = self._raw.decode(payload)
        except (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError) as exc:
            raise CodecError(f"invalid frame payload: {exc}") from None
        if len(raws) != count:
            raise CodecError(f"frame header says {count} events, payload holds {len(raws)}")
        events: list[Event] = []
        for raw in raws:
            try:
                events.append(self._one.decode(raw))
            except msgspec.ValidationError as exc:
                if _unknown_tag(raw):
                    self.unknown_events += 1
                    continue
                raise CodecError(f"invalid event in frame payload: {exc}") from None
            except (
                msgspec.MsgspecError,
                ValueError,
                TypeError,
                OverflowError,
                RecursionError,
            ) as exc:
                raise CodecError(f"invalid event in frame payload: {exc}") from None
        return events


class _Tagged(msgspec.Struct, array_like=True):
    """The leading tag of an event array (trailing fields are ignored when decoding)."""

    tag: str


_tag_decoder = msgspec.msgpack.Decoder(_Tagged)


def _unknown_tag(raw: msgspec.Raw) -> bool:
    """Whether ``raw`` is an array whose first element is a string tag this build lacks."""
    try:
        head = _tag_decoder.decode(raw)
    except (msgspec.MsgspecError, ValueError, TypeError, OverflowError, RecursionError):
        return False
    return head.tag not in _TAGS
