"""Reading recordings: iteration with filters, crash recovery and random access by time.

Recovery rules (also in ``docs/recording-format.md``):

* Frames are read in file order. A frame is *valid* when its sync marker is ``b"ZAFR"``, its
  payload lies inside the file, the CRC32 of the payload matches, the payload decodes to a
  non-empty list of events, and the first event's ``t_ns`` equals the prefix's ``first_t_ns``.
* A frame that is not valid is *corrupt* when a valid frame follows it: it is reported in
  :attr:`RecoveryReport.corrupt_frames` with its offset and reason, and reading resumes at the
  next ``b"ZAFR"`` marker whose frame is valid (resynchronization).
* A last frame that runs past the end of the file (or a last prefix shorter than 20 bytes) with
  no valid frame after it is the *torn tail* of a writer killed mid-write: it is reported in
  :attr:`RecoveryReport.torn_tail_offset` / ``torn_tail_bytes``; every frame before it is read.

Only :class:`~zeus_async.errors.CodecError` (and its subclasses
:class:`~zeus_async.errors.SchemaVersionError`, :class:`~.format.NotARecordingError`) and
:class:`OSError` are raised for bad or unreadable files; damage past the header is reported,
not raised.

The files are read through a read-only ``mmap``; :meth:`RecordingReader.aiter` runs the reading
in worker threads (``anyio.to_thread``), a chunk of frames at a time, so the event loop never
blocks on disk.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import mmap
import os
import zlib
from collections.abc import AsyncIterator, Callable, Collection, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import anyio

from ..errors import CodecError, ConfigError, SchemaVersionError, ZeusAsyncError
from ..events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    ClockChange,
    DeviceFault,
    Event,
    EventDecoder,
    GpuSample,
    PowerLimitChange,
    ProcessSample,
    RaplSample,
    event_kind,
    event_topic,
)
from .columnar import ColumnarFrame, decode_payload, directory_rows
from .format import (
    FORMAT_VERSION,
    FRAME_MAGIC,
    FRAME_PREFIX_SIZE,
    HEADER_PREFIX_SIZE,
    MAX_FRAME_BYTES,
    FramePrefix,
    HeaderPrefix,
    NotARecordingError,
    PayloadCodec,
    RecordingHeader,
    decode_header,
    recording_parts,
    rotated_path,
    unpack_frame_prefix,
    unpack_header_prefix,
)

__all__ = [
    "Frame",
    "FrameCodec",
    "PartOf",
    "RecordingReader",
    "RecoveryReport",
    "event_device",
    "frame_events",
    "part_of",
]

logger = logging.getLogger(__name__)

_TRUNCATED = "truncated frame prefix"
_PAST_END = "frame runs past the end of the file"
_KNOWN_KINDS = frozenset(str(t.__struct_config__.tag) for t in EVENT_TYPES)


@dataclass
class RecoveryReport:
    """What a pass over a recording found.

    Attributes:
        frames_ok: Valid frames read.
        events_ok: Events in those frames (before any filter).
        torn_tail_bytes: Bytes of the torn tail (0 when the file ends on a frame boundary).
        torn_tail_offset: File offset where the torn tail starts, or ``None``.
        corrupt_frames: ``(offset, reason)`` of each damaged frame skipped by resynchronizing.
            In a rotated recording, the offset is within its part and the reason starts with
            the part's file name (``run.1.zarc: ...``) for every part after the first.
        torn_tail_part: The file whose tail is torn (the recording's last part, unless a
            part in the middle is damaged too), or ``None``.
        parts: The files the pass read, in order (one unless the recording was rotated).
        header_damage: Why the recording's header could not be read, when its frames were
            read without it (``None``: the header is intact).
        unchecked_candidates: Frame markers inside damaged ranges that were skipped without
            checking, because checking them would have exceeded the resynchronization budget
            (only crafted files get there; see ``docs/recording-format.md``).
    """

    frames_ok: int = 0
    events_ok: int = 0
    torn_tail_bytes: int = 0
    torn_tail_offset: int | None = None
    corrupt_frames: list[tuple[int, str]] = field(default_factory=list)
    torn_tail_part: str | None = None
    parts: list[str] = field(default_factory=list)
    unchecked_candidates: int = 0
    header_damage: str | None = None

    @property
    def clean(self) -> bool:
        """True when nothing was torn or corrupt."""
        return self.torn_tail_offset is None and not self.corrupt_frames and not self.header_damage

    def summary(self) -> str:
        """What was damaged, in one line (``""`` when :attr:`clean`)."""
        said = []
        if self.header_damage:
            said.append(f"header unreadable ({self.header_damage})")
        if self.corrupt_frames:
            said.append(f"{len(self.corrupt_frames)} corrupt range(s) skipped")
        if self.torn_tail_offset is not None:
            torn = self.torn_tail_part
            part = f" of {Path(torn).name}" if torn and len(self.parts) > 1 else ""
            said.append(
                f"torn tail{part} ({self.torn_tail_bytes} bytes at offset {self.torn_tail_offset})"
            )
        return "; ".join(said)

    def warn(self, path: object, done: str) -> None:
        """Log a warning when the pass found damage: ``path is damaged: ...; done``."""
        if not self.clean:
            logger.warning(
                "%s is damaged: %s; %s every complete frame (%d frame(s), %d event(s))",
                path,
                self.summary(),
                done,
                self.frames_ok,
                self.events_ok,
            )


def event_device(event: Event) -> str | None:
    """The device key an event is about (``"gpu:0"``, ``"cpu:1"``), or ``None``.

    GPU samples and GPU control events map to ``gpu:<index>``, RAPL samples to
    ``cpu:<package>``, process samples to their GPU when they have one, faults to their device;
    window, measurement and stream events concern no single device.
    """
    if isinstance(event, (GpuSample, PowerLimitChange, ClockChange)):
        return f"gpu:{event.gpu}"
    if isinstance(event, RaplSample):
        return f"cpu:{event.package}"
    if isinstance(event, ProcessSample):
        return None if event.gpu is None else f"gpu:{event.gpu}"
    if isinstance(event, DeviceFault):
        return event.device
    return None


def _predicate(
    kinds: Collection[str] | None,
    topics_prefix: str | None,
    devices: Collection[str] | None,
) -> Callable[[Event], bool] | None:
    if kinds is None and topics_prefix is None and devices is None:
        return None
    kind_set = None if kinds is None else frozenset(kinds)
    if kind_set is not None and not kind_set <= _KNOWN_KINDS:
        raise ConfigError(
            f"unknown event kind(s) {sorted(kind_set - _KNOWN_KINDS)}; "
            f"known: {sorted(_KNOWN_KINDS)}"
        )
    device_set = None if devices is None else frozenset(devices)

    def keep(event: Event) -> bool:
        if kind_set is not None and event_kind(event) not in kind_set:
            return False
        if topics_prefix is not None and not event_topic(event).startswith(topics_prefix):
            return False
        return device_set is None or event_device(event) in device_set

    return keep


_Buffer = mmap.mmap | bytes
#: A decoded frame: its events (formats 1 and 2) or its columns (format 3).
Frame = list[Event] | ColumnarFrame
_Valid = tuple[FramePrefix, Frame]


class FrameCodec:
    """Decodes the stored payloads of one file: msgpack (formats 1, 2; expanded per the
    header's codec) or columns (format 3)."""

    __slots__ = ("columnar", "payload")

    def __init__(self, compression: str, format_version: int) -> None:
        self.payload = PayloadCodec(compression)
        self.columnar = format_version >= 3

    def decode(self, stored: bytes, decoder: EventDecoder) -> Frame:
        """The frame a payload holds (raises :class:`CodecError` on anything invalid)."""
        if self.columnar:
            return decode_payload(
                stored, self.payload.decompressor(), decoder, limit=MAX_FRAME_BYTES
            )
        expanded = self.payload.expand(stored)
        try:
            return decoder.decode_batch(expanded)
        except ValueError as exc:  # invalid UTF-8 in a string (msgspec raises it as is)
            raise CodecError(f"undecodable events: {exc}") from None


def frame_events(frame: Frame, kinds: Collection[str] | None = None) -> list[Event]:
    """The events of a decoded frame (those of ``kinds`` only, for a columnar frame)."""
    return frame if isinstance(frame, list) else frame.events(kinds)


def _first_t(frame: Frame) -> int:
    return frame[0].t_ns if isinstance(frame, list) else frame.first_t_ns


def _validate(
    buf: _Buffer, pos: int, end: int, decoder: EventDecoder, codec: FrameCodec | PayloadCodec
) -> _Valid | str:
    """The frame at ``pos`` and its events, or why it is not a valid frame."""
    if isinstance(codec, PayloadCodec):  # a file of this build's format
        codec = FrameCodec(codec.compression, FORMAT_VERSION)
    if end - pos < FRAME_PREFIX_SIZE:
        return _TRUNCATED
    prefix = unpack_frame_prefix(buf, pos)
    if prefix is None:
        return "bad sync marker"
    stop = pos + FRAME_PREFIX_SIZE + prefix.payload_len
    if stop > end:
        return _PAST_END
    if prefix.payload_len > MAX_FRAME_BYTES:  # rejected before reading or checking it
        return "declared payload over the frame size limit"
    payload = buf[pos + FRAME_PREFIX_SIZE : stop]
    if zlib.crc32(payload) != prefix.crc:
        return "payload checksum mismatch"
    try:
        events = codec.decode(payload, decoder)
    except CodecError:
        return "undecodable payload"
    if not len(events):
        return "empty frame"
    if _first_t(events) != prefix.first_t_ns:
        return "first_t_ns does not match the first event"
    return prefix, events


class _ResyncCost:
    """Bounds what resynchronizing costs over one pass, so a crafted file reads in linear time.

    Checking a candidate frame reads its declared payload (CRC, then decoding); a file packed
    with candidates that each declare a payload to its end would cost the square of its size.
    Failed checks may read at most twice the bytes the pass has advanced, plus one largest
    frame (:data:`MAX_FRAME_BYTES`). A candidate the allowance cannot cover is still checked
    when no other marker lies inside the bytes its check reads (those checks read disjoint
    ranges: one pass over the file at most), so a real frame after damage is checked unless
    its own payload happens to hold the 4 marker bytes; any other candidate the allowance
    cannot cover is skipped unchecked and counted (:attr:`RecoveryReport.unchecked_candidates`).
    """

    __slots__ = ("spent", "start")

    def __init__(self, start: int) -> None:
        self.start = start
        self.spent = 0

    def allows(self, at: int, cost: int) -> bool:
        return self.spent + cost <= 2 * (at - self.start) + MAX_FRAME_BYTES


def _resync(
    buf: _Buffer,
    pos: int,
    end: int,
    decoder: EventDecoder,
    codec: FrameCodec,
    cost: _ResyncCost,
    report: RecoveryReport | None = None,
) -> int | None:
    """Offset of the first valid frame at or after ``pos``, or ``None``."""
    i = buf.find(FRAME_MAGIC, pos, end)
    while i != -1:
        declared = _declared_len(buf, i, end)
        if cost.allows(i, declared):
            if not isinstance(_validate(buf, i, end, decoder, codec), str):
                return i
            cost.spent += declared
        elif buf.find(FRAME_MAGIC, i + 1, i + FRAME_PREFIX_SIZE + declared) == -1:
            # Over the allowance, but no other marker lies inside the bytes this check reads:
            # such checks read disjoint ranges (the next candidate starts past this one's
            # payload), so they cost one pass over the file at most, and the real frame right
            # behind a crafted region (whose payload holds no marker) is still checked.
            if not isinstance(_validate(buf, i, end, decoder, codec), str):
                return i
        elif report is not None:
            report.unchecked_candidates += 1
        i = buf.find(FRAME_MAGIC, i + 1, end)
    return None


def _declared_len(buf: _Buffer, pos: int, end: int) -> int:
    """The payload bytes a check of the candidate at ``pos`` would read (0: none)."""
    if end - pos < FRAME_PREFIX_SIZE:
        return 0
    prefix = unpack_frame_prefix(buf, pos)
    if prefix is None or prefix.payload_len > MAX_FRAME_BYTES:
        return 0
    return min(prefix.payload_len, end - pos - FRAME_PREFIX_SIZE)


def _frames(
    buf: _Buffer,
    start: int,
    end: int,
    report: RecoveryReport,
    codec: FrameCodec,
    *,
    stop_t_ns: int | None = None,
) -> Iterator[tuple[int, int, Frame]]:
    """Yield ``(offset, first_t_ns, events)`` of every valid frame from ``start``, recovering."""
    decoder = EventDecoder()
    cost = _ResyncCost(start)
    pos = start
    while pos < end:
        result = _validate(buf, pos, end, decoder, codec)
        if not isinstance(result, str):
            prefix, events = result
            if stop_t_ns is not None and prefix.first_t_ns >= stop_t_ns:
                return
            report.frames_ok += 1
            report.events_ok += len(events)
            yield pos, prefix.first_t_ns, events
            pos += FRAME_PREFIX_SIZE + prefix.payload_len
            continue
        found = _resync(buf, pos + 1, end, decoder, codec, cost, report)
        if found is None and result in (_TRUNCATED, _PAST_END):
            report.torn_tail_offset = pos
            report.torn_tail_bytes = end - pos
            logger.info("recording has a torn tail of %d bytes at offset %d", end - pos, pos)
            return
        report.corrupt_frames.append((pos, result))
        logger.warning("corrupt frame at offset %d: %s", pos, result)
        if found is None:
            return
        pos = found


def _torn_at(report: RecoveryReport) -> int | None:
    return report.torn_tail_offset


class _Part(NamedTuple):
    path: Path
    base: int  # offset of its first byte in the recording (the parts laid end to end)
    size: int


class PartOf(NamedTuple):
    """Where a later part of a rotated recording, read alone, belongs.

    A part is a complete recording of its own (its own header, its frames intact), so read
    alone it is "complete"; this says of what it is a part, so that nobody takes its figures
    for the whole run's.

    Attributes:
        part: The part's index (``meta["part"]`` of its header; ``run.3.zarc`` is part 3, the
            fourth file).
        parts: Parts of the recording found beside it (``recording_parts(first)``), or ``None``
            when its first file or a part before it is missing.
        first: The recording's first file, the one to read for the whole recording (``None``
            when the part's file name does not derive from one: it was renamed).
    """

    part: int
    parts: int | None
    first: Path | None

    def __str__(self) -> str:
        n = self.part + 1
        if self.first is None:
            return f"part {n} of a rotated recording (renamed: its other parts are not found)"
        name = self.first.name
        if self.parts is not None:
            return f"part {n} of {self.parts} of {name} (read {name} for the whole recording)"
        if not self.first.exists():
            return f"part {n} of {name}, which is missing"
        have = len(recording_parts(self.first))
        return (
            f"part {n} of {name}, whose part {have + 1} "
            f"({rotated_path(self.first, have).name}) is missing"
        )


def part_of(path: Path, header: RecordingHeader) -> PartOf | None:
    """Which part of which rotated recording ``path`` is, when its header says it is a later
    part (``meta["part"]``, written by the recorder from the second file on); ``None`` for a
    first part or a recording that was never rotated."""
    text = header.meta.get("part", "")
    if not (text.isascii() and text.isdigit()) or int(text) == 0:
        return None
    index = int(text)
    first = None
    # run.3.zarc is part 3 of run.zarc; a name without a suffix: run.3 of run
    for name in (path.stem.removesuffix(f".{index}") + path.suffix, path.stem):
        candidate = path.with_name(name)
        if name and candidate != path and rotated_path(candidate, index) == path:
            first = candidate
            break
    count = None
    if first is not None and first.exists():
        parts = recording_parts(first)
        count = len(parts) if len(parts) > index else None
    return PartOf(index, count, first)


class RecordingReader:
    """Reads a recording written by :class:`~zeus_async.store.Recorder`.

    A rotated recording is read whole from its first file: ``run.zarc``, then ``run.1.zarc``,
    ``run.2.zarc``, ... (:func:`~zeus_async.store.recording_parts`), as one stream of events;
    damage is reported per part (:class:`RecoveryReport`). Offsets (:meth:`frame_index`) count
    through the parts laid end to end.

    Args:
        path: The recording file (its first part).

    Attributes:
        path: The recording file.
        parts: Its files, in order (``[path]`` unless it was rotated).
        size_bytes: Their total size.
        header: The run metadata (the first part's).
        format_version: File layout version of the file.
        schema_version: Event schema version of the file.
        data_offset: Offset of the first frame.
        part_of: Given a later part of a rotated recording (``run.3.zarc``), which part of
            which recording it is (:class:`PartOf`; ``str()`` says it in words); ``None``
            otherwise.
        report: :class:`RecoveryReport` of the latest pass (iteration, :meth:`aiter`,
            :meth:`seek_time` or :meth:`events_between`); updated as the pass proceeds.

    Raises:
        NotARecordingError: The file does not start with ``b"ZARC"``.
        SchemaVersionError: Unsupported format or schema version (whatever follows the
            header: the frames of an unknown format are not read as those of a known one).
        CodecError: Truncated or corrupt header with no valid frame after it.
        OSError: The file cannot be read.

    Iterating (``for event in reader``) yields every event of every valid frame, in file order.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._header_damage: str | None = None
        self.format_version = FORMAT_VERSION
        self.schema_version = SCHEMA_VERSION
        try:
            with self.path.open("rb") as f:
                head = f.read(HEADER_PREFIX_SIZE)
                prefix: HeaderPrefix = unpack_header_prefix(head)
                self.format_version = prefix.format_version
                self.schema_version = prefix.schema_version
                head += f.read(prefix.body_len + 4)
            _, header, self.data_offset = decode_header(head)
        except (NotARecordingError, SchemaVersionError):
            # Not a recording, or one of a format or schema this build does not know: its
            # frames cannot be trusted to mean what this build would read them as (a format
            # version of 2306 was read as "format v2", the frames decoded as such).
            raise
        except CodecError as exc:
            # A damaged header (a flipped bit fails its CRC or its length): the frames carry
            # everything but the run metadata, so read them without it when there are any.
            recovered = self._without_header(str(exc))
            if recovered is None:
                raise
            header, self.data_offset = recovered
        self.header: RecordingHeader = header
        self.part_of: PartOf | None = part_of(self.path, header)
        self._codec = FrameCodec(header.compression, self.format_version)
        self.report = RecoveryReport()
        self._index: list[tuple[int, int]] | None = None
        self._index_t: list[int] = []
        self.parts: list[Path] = recording_parts(self.path)
        self._parts: list[_Part] = []
        base = 0
        for part in self.parts:
            size = part.stat().st_size
            self._parts.append(_Part(part, base, size))
            base += size
        self.size_bytes = base
        # Data offset and codec of each part after the first (read from its header on use).
        self._part_heads: dict[int, tuple[int, FrameCodec] | str] = {}

    def _without_header(self, why: str) -> tuple[RecordingHeader, int] | None:
        """A stand-in header and the first valid frame's offset, found by scanning with each
        codec; ``None`` when no valid frame is found (nothing to recover)."""
        decoder = EventDecoder()
        with self._mapped(self.path) as (buf, end):
            versions = [self.format_version] if self.format_version != FORMAT_VERSION else [3, 2]
            for version, compression in itertools.product(versions, ("zstd", "none")):
                codec = FrameCodec(compression, version)
                start = HEADER_PREFIX_SIZE
                found = _resync(buf, start, end, decoder, codec, _ResyncCost(start))
                if found is None:
                    continue
                result = _validate(buf, found, end, decoder, codec)
                assert not isinstance(result, str)
                _, frame = result
                events = frame_events(frame)
                self.format_version = version
                if isinstance(frame, ColumnarFrame):  # each block says its codec
                    compression = "zstd" if frame.compressed else "none"
                self._header_damage = f"{why}; frames read without it"
                logger.warning("recording %s: header damaged (%s)", self.path, self._header_damage)
                header = RecordingHeader(
                    start_wall_ns=events[0].t_ns,
                    compression=compression,
                    meta={"header": f"damaged: {why}"},
                )
                return header, found
        return None

    def _part_head(self, k: int) -> tuple[int, FrameCodec] | str:
        """Data offset and codec of part ``k``, or why its header cannot be read."""
        if k == 0:
            return self.data_offset, self._codec
        head = self._part_heads.get(k)
        if head is None:
            try:
                with self._parts[k].path.open("rb") as f:
                    raw = f.read(HEADER_PREFIX_SIZE)
                    prefix = unpack_header_prefix(raw)
                    raw += f.read(prefix.body_len + 4)
                _, header, offset = decode_header(raw)
                head = (offset, FrameCodec(header.compression, prefix.format_version))
            except (ZeusAsyncError, OSError) as exc:
                head = f"unreadable header ({exc})"
            self._part_heads[k] = head
        return head

    @staticmethod
    @contextmanager
    def _mapped(path: Path) -> Iterator[tuple[_Buffer, int]]:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                yield b"", 0
                return
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                yield mm, size
            finally:
                mm.close()

    def _frames_from(
        self, start: int, report: RecoveryReport, *, stop_t_ns: int | None = None
    ) -> Generator[tuple[int, int, Frame], None, None]:
        """Frames from offset ``start`` (counted through the parts) to the end of the last
        part; offsets yielded the same way."""
        many = len(self._parts) > 1
        for k, part in enumerate(self._parts):
            if start >= part.base + part.size and k < len(self._parts) - 1:
                continue
            head = self._part_head(k)
            report.parts.append(str(part.path))
            if isinstance(head, str):
                report.corrupt_frames.append((0, f"{part.path.name}: {head}"))
                logger.warning("part %s of %s skipped: %s", part.path, self.path, head)
                continue
            data_offset, codec = head
            local = max(start - part.base, data_offset)
            damage = len(report.corrupt_frames)
            torn = report.torn_tail_offset
            report.torn_tail_offset = None
            with self._mapped(part.path) as (buf, end):
                for pos, t_ns, events in _frames(
                    buf, local, end, report, codec, stop_t_ns=stop_t_ns
                ):
                    yield part.base + pos, t_ns, events
            if _torn_at(report) is not None:  # this part's tail is torn
                report.torn_tail_part = str(part.path)
            else:
                report.torn_tail_offset = torn
            if many and k:
                report.corrupt_frames[damage:] = [
                    (off, f"{part.path.name}: {why}") for off, why in report.corrupt_frames[damage:]
                ]

    def _new_report(self) -> RecoveryReport:
        self.report = RecoveryReport(header_damage=self._header_damage)
        return self.report

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def events(
        self,
        kinds: Collection[str] | None = None,
        topics_prefix: str | None = None,
        devices: Collection[str] | None = None,
    ) -> Iterator[Event]:
        """Every event of every valid frame, in file order, optionally filtered.

        Args:
            kinds: Keep only these event tags (``"gpu"``, ``"rapl"``, ``"measurement"``, ...).
            topics_prefix: Keep only events whose bus topic starts with this
                (see :func:`~zeus_async.events.event_topic`), e.g. ``"gpu/node1/"``.
            devices: Keep only events about these devices (``"gpu:0"``, ``"cpu:1"``; see
                :func:`event_device`).

        Raises:
            ConfigError: An unknown kind.
        """
        for batch in self.batches(kinds, topics_prefix, devices):
            yield from batch

    def batches(
        self,
        kinds: Collection[str] | None = None,
        topics_prefix: str | None = None,
        devices: Collection[str] | None = None,
    ) -> Iterator[list[Event]]:
        """The events of :meth:`events`, a list per valid frame (empty lists are skipped).

        The bulk form of the reader: the same decoded events without a generator step per
        event, for consumers that handle lists (replay, analysis, export, benchmarks).
        """
        keep = _predicate(kinds, topics_prefix, devices)
        report = self._new_report()
        for _, _, frame in self._frames_from(self.data_offset, report):
            events = frame_events(frame, kinds)
            if keep is not None:
                events = [e for e in events if keep(e)]
                if not events:
                    continue
            yield events

    def frames(self, kinds: Collection[str] | None = None) -> Iterator[Frame]:
        """Every valid frame as decoded: a list of events (formats 1, 2) or a
        :class:`~.columnar.ColumnarFrame` (format 3), whose columns a columnar reader takes
        without building events. ``kinds`` filters the events of formats 1 and 2 (frames left
        empty are skipped); a columnar frame is yielded whole.

        Raises:
            ConfigError: An unknown kind.
        """
        keep = _predicate(kinds, None, None)
        report = self._new_report()
        for _, _, frame in self._frames_from(self.data_offset, report):
            if keep is not None and isinstance(frame, list):
                frame = [e for e in frame if keep(e)]
                if not frame:
                    continue
            yield frame

    async def aiter(
        self,
        kinds: Collection[str] | None = None,
        topics_prefix: str | None = None,
        devices: Collection[str] | None = None,
        *,
        frames_per_chunk: int = 64,
    ) -> AsyncIterator[Event]:
        """Async version of :meth:`events`: frames are read and decoded in a worker thread.

        Args:
            kinds: See :meth:`events`.
            topics_prefix: See :meth:`events`.
            devices: See :meth:`events`.
            frames_per_chunk: Frames read per trip to the worker thread.
        """
        keep = _predicate(kinds, topics_prefix, devices)
        report = self._new_report()
        frames = self._frames_from(self.data_offset, report)

        def take() -> list[tuple[int, int, list[Event]]]:
            chunk = itertools.islice(frames, frames_per_chunk)
            return [(p, t, frame_events(f, kinds)) for p, t, f in chunk]

        try:
            while True:
                chunk = await anyio.to_thread.run_sync(take)
                if not chunk:
                    return
                for _, _, events in chunk:
                    for event in events:
                        if keep is None or keep(event):
                            yield event
        finally:
            frames.close()

    # -- random access by time ---------------------------------------------------------------

    def frame_index(self) -> list[tuple[int, int]]:
        """``(offset, first_t_ns)`` of every frame, built once by reading frame prefixes only.

        Offsets count through the parts laid end to end. Payloads are skipped; where a prefix
        does not lead to another frame (damage), the scan resynchronizes like a full read does.
        """
        if self._index is None:
            index: list[tuple[int, int]] = []
            decoder = EventDecoder()
            for k, part in enumerate(self._parts):
                head = self._part_head(k)
                if isinstance(head, str):
                    continue
                data_offset, codec = head
                with self._mapped(part.path) as (buf, end):
                    pos = data_offset
                    cost = _ResyncCost(pos)
                    while pos + FRAME_PREFIX_SIZE <= end:
                        prefix = unpack_frame_prefix(buf, pos)
                        nxt = pos + FRAME_PREFIX_SIZE + prefix.payload_len if prefix else end + 1
                        if prefix is None or nxt > end:
                            found = _resync(buf, pos + 1, end, decoder, codec, cost)
                            if found is None:
                                break
                            pos = found
                            continue
                        index.append((part.base + pos, prefix.first_t_ns))
                        pos = nxt
            self._index = index
            self._index_t = [t for _, t in index]
        return self._index

    def column_rows(self) -> dict[str, int]:
        """Rows per column kind (``"gpu"``, ``"rapl"``, ``"proc"``) that the frames of a
        format-3 recording declare, read from the frame prefixes and the directories at the
        start of the payloads (nothing expanded, no CRC checked); empty for formats 1 and 2.

        A capacity hint for a columnar load (one array per field, filled frame by frame): exact
        for an undamaged recording; damage can make it too large or too small, so the load
        trims or grows to what it actually decodes. The walk stops at the first prefix that
        does not lead to another frame (no resynchronization).
        """
        rows: dict[str, int] = {}
        for k, part in enumerate(self._parts):
            head = self._part_head(k)
            if isinstance(head, str) or not head[1].columnar:
                continue
            with self._mapped(part.path) as (buf, end):
                view = memoryview(buf)
                try:
                    pos = head[0]
                    while pos + FRAME_PREFIX_SIZE <= end:
                        prefix = unpack_frame_prefix(buf, pos)
                        start = pos + FRAME_PREFIX_SIZE
                        if prefix is None or start + prefix.payload_len > end:
                            break
                        got = directory_rows(view[start : start + prefix.payload_len])
                        for kind, n in (got or {}).items():
                            rows[kind] = rows.get(kind, 0) + n
                        pos = start + prefix.payload_len
                finally:
                    view.release()
        return rows

    def _start_for(self, t_ns: int) -> int:
        index = self.frame_index()
        if not index:
            return self.data_offset
        i = bisect.bisect_left(self._index_t, t_ns) - 1
        return index[max(i, 0)][0]

    def seek_time(self, t_ns: int) -> Iterator[Event]:
        """Events with ``t_ns >= t_ns`` from the frame that contains time ``t_ns`` onwards.

        Starts at the last frame whose ``first_t_ns`` is before ``t_ns`` (found by bisecting
        :meth:`frame_index`), so it is exact for recordings in nondecreasing time order (what
        one recorder writes, up to events published late such as measurements).
        """
        report = self._new_report()
        for _, _, frame in self._frames_from(self._start_for(t_ns), report):
            for event in frame_events(frame):
                if event.t_ns >= t_ns:
                    yield event

    def events_between(self, t0_ns: int, t1_ns: int) -> Iterator[Event]:
        """Events with ``t0_ns <= t_ns < t1_ns``, read from the frames that can hold them.

        Same ordering assumption as :meth:`seek_time`; frames starting at or after ``t1_ns`` are
        not decoded.
        """
        report = self._new_report()
        start = self._start_for(t0_ns)
        for _, _, frame in self._frames_from(start, report, stop_t_ns=t1_ns):
            for event in frame_events(frame):
                if t0_ns <= event.t_ns < t1_ns:
                    yield event
