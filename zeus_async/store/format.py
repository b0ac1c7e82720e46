"""The recording file format: a header with run metadata, then append-only frames.

The byte-level contract lives in ``docs/recording-format.md``; this module is its reference
implementation. Everything is in network byte order (big-endian). In short::

    file   := header frame*
    header := "ZARC" u16 format_version  u16 schema_version  u32 body_len
              body (msgpack RecordingHeader, body_len bytes)
              u32 crc32(every header byte before this field)
    frame  := "ZAFR" u32 payload_len  u32 crc32(payload)  u64 first_t_ns
              payload (msgpack array of events, payload_len bytes; zstd-compressed when
                       the header says compression="zstd")

A frame is self-delimiting and self-checking, so a reader can recover every complete frame of a
file whose writer was killed mid-write (the torn tail) and resynchronize past a damaged frame by
scanning for the next ``b"ZAFR"`` marker whose frame validates.

Decoding never raises anything but :class:`~zeus_async.errors.CodecError` (or its subclasses
:class:`~zeus_async.errors.SchemaVersionError` and :class:`NotARecordingError`) on bad bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NamedTuple

import msgspec
import zstandard

from ..errors import CodecError, SchemaVersionError
from ..events import SCHEMA_VERSION, DeviceInfo, Event, EventEncoder

__all__ = [
    "COMPRESSIONS",
    "FILE_MAGIC",
    "FORMAT_VERSION",
    "FRAME_MAGIC",
    "FRAME_PREFIX_SIZE",
    "HEADER_PREFIX_SIZE",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BODY",
    "MAX_PAYLOAD",
    "SUPPORTED_FORMAT_VERSIONS",
    "SUPPORTED_SCHEMA_VERSIONS",
    "WRITABLE_FORMAT_VERSIONS",
    "ZSTD_LEVEL",
    "Buffer",
    "FramePrefix",
    "HeaderPrefix",
    "NotARecordingError",
    "PayloadCodec",
    "RecordingHeader",
    "decode_header",
    "default_header",
    "encode_frame",
    "encode_header",
    "pack_frame_prefix",
    "pack_header_prefix",
    "recording_parts",
    "rotated_path",
    "seal_frame",
    "unpack_frame_prefix",
    "unpack_header_prefix",
]

logger = logging.getLogger(__name__)

#: First four bytes of every recording.
FILE_MAGIC: Final = b"ZARC"
#: Sync marker opening every frame.
FRAME_MAGIC: Final = b"ZAFR"
#: Version of the file layout described above. Version 2 added frame compression (a version-1
#: reader would take compressed payloads for damage, so the version changed); version 3 stores
#: the samples of a frame as typed columns (:mod:`.columnar`).
FORMAT_VERSION: Final = 3
#: File layout versions this build reads.
SUPPORTED_FORMAT_VERSIONS: Final = frozenset({1, 2, 3})
#: File layout versions this build writes.
WRITABLE_FORMAT_VERSIONS: Final = frozenset({2, 3})
#: Frame payload codecs: ``"none"`` (plain msgpack) and ``"zstd"`` (Zstandard, default).
COMPRESSIONS: Final = ("none", "zstd")
#: Zstandard level of the writers (level 1: ~5 M events/s, about 7x smaller than msgpack).
ZSTD_LEVEL: Final = 1
#: Event schema versions this build reads.
SUPPORTED_SCHEMA_VERSIONS: Final = frozenset({SCHEMA_VERSION})
#: Largest header body a reader accepts (a larger length field means a damaged file).
MAX_HEADER_BODY: Final = 16 * 1024 * 1024
#: Largest frame payload (the u32 length field).
MAX_PAYLOAD: Final = 2**32 - 1
#: Largest msgpack payload a frame may hold, compressed or not (64 MiB; a recorder's frame of
#: 4,096 events is well under 1 MiB). Readers reject a frame that declares more before
#: checking or expanding it, so a crafted file cannot make them allocate more.
MAX_FRAME_BYTES: Final = 64 * 1024 * 1024

#: Bytes-like inputs the decoders accept (a read-only ``mmap`` of a file included).
Buffer = bytes | bytearray | memoryview | mmap.mmap

_HEADER_PREFIX = struct.Struct("!4sHHI")
_CRC = struct.Struct("!I")
_FRAME_PREFIX = struct.Struct("!4sIIQ")
_U64_MAX: Final = 2**64 - 1

#: Size of the fixed part of the header, before the msgpack body.
HEADER_PREFIX_SIZE: Final = _HEADER_PREFIX.size  # 12
#: Size of the fixed prefix of every frame.
FRAME_PREFIX_SIZE: Final = _FRAME_PREFIX.size  # 20


class NotARecordingError(CodecError):
    """The file does not start with the recording magic ``b"ZARC"``."""


class RecordingHeader(msgspec.Struct, kw_only=True):
    """Run metadata stored once at the start of a recording.

    Encoded as a msgpack *map* (field names as keys) so later versions can add fields that
    older readers ignore.

    Attributes:
        host: Host id of the recording process.
        start_wall_ns: Wall-clock time the recording started (ns since the Unix epoch).
        pid: Process id of the writer.
        argv: Command line of the writer.
        devices: The devices the recorded runtime sampled.
        meta: Free-form string metadata (job name, git revision, ...).
        compression: Codec of every frame payload in the file: ``"none"`` or ``"zstd"``
            (a missing key, as in format version 1, means ``"none"``).
    """

    host: str = ""
    start_wall_ns: int = 0
    pid: int = 0
    argv: list[str] = msgspec.field(default_factory=list)
    devices: list[DeviceInfo] = msgspec.field(default_factory=list)
    meta: dict[str, str] = msgspec.field(default_factory=dict)
    compression: str = "none"


def default_header(
    *,
    devices: Sequence[DeviceInfo] = (),
    meta: dict[str, str] | None = None,
    compression: str = "zstd",
) -> RecordingHeader:
    """A header describing the current process (host name, now, pid, ``sys.argv``)."""
    return RecordingHeader(
        host=socket.gethostname(),
        start_wall_ns=time.time_ns(),
        pid=os.getpid(),
        argv=list(sys.argv),
        devices=list(devices),
        meta=dict(meta or {}),
        compression=compression,
    )


class PayloadCodec:
    """Compresses frame payloads on write and expands them on read, per the header's codec.

    Thread-safe: Zstandard contexts must not be shared by threads running at the same time,
    so each thread gets its own.

    Raises:
        CodecError: An unknown codec name.
    """

    def __init__(self, compression: str) -> None:
        if compression not in COMPRESSIONS:
            raise CodecError(
                f"unknown recording compression {compression!r} (known: {list(COMPRESSIONS)})"
            )
        self.compression = compression
        self._zstd = compression == "zstd"
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        c: zstandard.ZstdCompressor | None = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d: zstandard.ZstdDecompressor | None = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def compress(self, payload: bytes) -> bytes:
        return self._compressor().compress(payload) if self._zstd else payload

    def block_compressor(self) -> zstandard.ZstdCompressor | None:
        """This thread's compressor for format-3 blocks (``None``: stored uncompressed)."""
        return self._compressor() if self._zstd else None

    def decompressor(self) -> zstandard.ZstdDecompressor:
        """This thread's decompressor (format-3 blocks carry their own codec)."""
        return self._decompressor()

    def expand(self, stored: bytes) -> bytes:
        """The msgpack payload of stored frame bytes.

        Raises:
            CodecError: Bytes that do not decompress (damage the CRC did not catch).
        """
        if not self._zstd:
            return stored
        try:
            declared = zstandard.frame_content_size(stored)
        except zstandard.ZstdError as exc:
            raise CodecError(f"frame does not decompress: {exc}") from None
        if declared > MAX_FRAME_BYTES:  # -1 (not declared): bounded by max_output_size below
            raise CodecError(
                f"frame declares {declared} bytes expanded, over the {MAX_FRAME_BYTES} limit"
            )
        try:
            return self._decompressor().decompress(stored, max_output_size=MAX_FRAME_BYTES)
        except zstandard.ZstdError as exc:
            raise CodecError(f"frame does not decompress: {exc}") from None


class HeaderPrefix(NamedTuple):
    """The fixed first :data:`HEADER_PREFIX_SIZE` bytes of a recording."""

    format_version: int
    schema_version: int
    body_len: int


class FramePrefix(NamedTuple):
    """The fixed :data:`FRAME_PREFIX_SIZE` bytes opening a frame."""

    payload_len: int
    crc: int
    first_t_ns: int


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(RecordingHeader)


def pack_header_prefix(
    body_len: int, *, format_version: int = FORMAT_VERSION, schema_version: int = SCHEMA_VERSION
) -> bytes:
    """Pack the fixed header prefix (magic, versions, body length)."""
    return _HEADER_PREFIX.pack(FILE_MAGIC, format_version, schema_version, body_len)


def unpack_header_prefix(data: bytes | bytearray | memoryview) -> HeaderPrefix:
    """Unpack and check the fixed header prefix.

    Raises:
        NotARecordingError: Bad magic (or fewer than 4 bytes).
        SchemaVersionError: Unsupported format or schema version.
        CodecError: Truncated prefix or implausible body length.
    """
    if len(data) < len(FILE_MAGIC) or bytes(data[: len(FILE_MAGIC)]) != FILE_MAGIC:
        raise NotARecordingError("not a zeus_async recording (bad magic)")
    if len(data) < HEADER_PREFIX_SIZE:
        raise CodecError("truncated recording header")
    _, fmt, schema, body_len = _HEADER_PREFIX.unpack_from(data, 0)
    if fmt not in SUPPORTED_FORMAT_VERSIONS:
        raise SchemaVersionError(
            f"recording format version {fmt} is not supported "
            f"(this build reads {sorted(SUPPORTED_FORMAT_VERSIONS)})"
        )
    if schema not in SUPPORTED_SCHEMA_VERSIONS:
        raise SchemaVersionError(
            f"recording schema version {schema} is not supported "
            f"(this build reads {sorted(SUPPORTED_SCHEMA_VERSIONS)})"
        )
    if body_len > MAX_HEADER_BODY:
        raise CodecError(f"implausible recording header length {body_len}")
    return HeaderPrefix(fmt, schema, body_len)


def encode_header(
    header: RecordingHeader,
    *,
    format_version: int = FORMAT_VERSION,
    schema_version: int = SCHEMA_VERSION,
) -> bytes:
    """The complete header bytes: prefix, msgpack body and CRC32."""
    body = _header_encoder.encode(header)
    if len(body) > MAX_HEADER_BODY:
        raise CodecError(f"recording header too large ({len(body)} bytes)")
    head = (
        pack_header_prefix(len(body), format_version=format_version, schema_version=schema_version)
        + body
    )
    return head + _CRC.pack(zlib.crc32(head))


def decode_header(
    data: bytes | bytearray | memoryview,
) -> tuple[HeaderPrefix, RecordingHeader, int]:
    """Decode the header at the start of ``data``.

    Returns:
        The prefix, the header and the total header size in bytes (offset of the first frame).

    Raises:
        NotARecordingError: Bad magic.
        SchemaVersionError: Unsupported format or schema version.
        CodecError: Truncated or corrupt header.
    """
    prefix = unpack_header_prefix(data)
    end = HEADER_PREFIX_SIZE + prefix.body_len
    if len(data) < end + _CRC.size:
        raise CodecError("truncated recording header")
    (crc,) = _CRC.unpack_from(data, end)
    if zlib.crc32(data[:end]) != crc:
        raise CodecError("recording header checksum mismatch")
    try:
        header = _header_decoder.decode(data[HEADER_PREFIX_SIZE:end])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CodecError(f"invalid recording header: {exc}") from None
    if header.compression not in COMPRESSIONS:
        raise CodecError(f"unknown recording compression {header.compression!r}")
    return prefix, header, end + _CRC.size


def pack_frame_prefix(payload_len: int, crc: int, first_t_ns: int) -> bytes:
    """Pack a frame prefix (sync marker, payload length, payload CRC32, first event time)."""
    return _FRAME_PREFIX.pack(FRAME_MAGIC, payload_len, crc, first_t_ns)


def unpack_frame_prefix(data: Buffer, offset: int = 0) -> FramePrefix | None:
    """Unpack the frame prefix at ``offset``; ``None`` when the sync marker is not there.

    Raises:
        CodecError: Fewer than :data:`FRAME_PREFIX_SIZE` bytes at ``offset``.
    """
    if len(data) - offset < FRAME_PREFIX_SIZE:
        raise CodecError("truncated frame prefix")
    magic, length, crc, t_ns = _FRAME_PREFIX.unpack_from(data, offset)
    if magic != FRAME_MAGIC:
        return None
    return FramePrefix(length, crc, t_ns)


def encode_frame(
    events: Sequence[Event],
    encoder: EventEncoder | None = None,
    codec: PayloadCodec | None = None,
    *,
    format_version: int = FORMAT_VERSION,
) -> bytes:
    """Encode a non-empty batch of events as one complete frame (prefix + payload).

    ``codec`` compresses the payload (the file's :attr:`RecordingHeader.compression`); without
    one the payload is plain msgpack (format 2) or uncompressed columns (format 3).

    Raises:
        CodecError: No events, a first ``t_ns`` outside u64, or a payload over 4 GiB.
    """
    if not events:
        raise CodecError("a frame needs at least one event")
    encoder = encoder or EventEncoder()
    if format_version == 3:
        from .columnar import encode_columns

        prepared = encode_columns(events, encoder)
        cctx = codec.block_compressor() if codec is not None else None
        return seal_frame(prepared.seal(cctx), prepared.first_t_ns)
    payload = encoder.encode(list(events))
    return seal_frame(payload, events[0].t_ns, codec)


def seal_frame(payload: bytes, first_t_ns: int, codec: PayloadCodec | None = None) -> bytes:
    """The frame around an encoded msgpack batch: compress it (``codec``), prefix and CRC.

    The second half of :func:`encode_frame`, separate so a writer can run it off the event
    loop (Zstandard and CRC32 release the GIL).

    Raises:
        CodecError: A ``first_t_ns`` outside u64, or a payload over :data:`MAX_FRAME_BYTES`.
    """
    if len(payload) > MAX_FRAME_BYTES:
        raise CodecError(
            f"frame payload too large ({len(payload)} bytes, limit {MAX_FRAME_BYTES}): "
            "write fewer events per frame"
        )
    if codec is not None:
        payload = codec.compress(payload)
    if len(payload) > MAX_PAYLOAD:
        raise CodecError(f"frame payload too large ({len(payload)} bytes)")
    if not 0 <= first_t_ns <= _U64_MAX:
        raise CodecError(f"event t_ns {first_t_ns} does not fit a u64")
    return pack_frame_prefix(len(payload), zlib.crc32(payload), first_t_ns) + payload


def rotated_path(path: Path, part: int) -> Path:
    """File name of part ``part`` of a rotated recording: ``run.zarc``, ``run.1.zarc``, ..."""
    if part == 0:
        return path
    return path.with_name(f"{path.stem}.{part}{path.suffix}")


def recording_parts(path: str | os.PathLike[str]) -> list[Path]:
    """The files of a (possibly rotated) recording, in order: ``path`` then its existing parts."""
    first = Path(path)
    parts = [first]
    while (nxt := rotated_path(first, len(parts))).exists():
        parts.append(nxt)
    return parts
