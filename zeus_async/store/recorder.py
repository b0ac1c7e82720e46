"""Recording events to disk: an in-process consumer of the hub writing framed msgpack.

A :class:`Recorder` is a runtime consumer (``Runtime(consumers=[recorder.run])``): it writes
the header when it starts, buffers events, and appends a frame when ``flush_events`` events are
buffered or ``flush_interval_s`` has passed since the first buffered event, whichever comes
first. Each frame is pushed to the OS as soon as it is written, so a process killed mid-write
loses at most the events buffered since the last frame; when the stream ends the last frame is
written and the file is fsync'ed.

Files are written with **aiofiles** under asyncio. aiofiles needs an asyncio event loop, so
under trio the recorder falls back to :func:`anyio.open_file` (the same worker-thread design).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any, Protocol

import aiofiles
import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import ObjectReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream

from .._threads import DaemonExecutor, or_on_this_thread, run_sync
from ..clock import Clock, RealClock
from ..errors import ConfigError
from ..events import Event, EventEncoder
from ..runtime.hub import EventBatches
from .columnar import PreparedFrame, encode_columns
from .format import (
    FORMAT_VERSION,
    WRITABLE_FORMAT_VERSIONS,
    PayloadCodec,
    RecordingHeader,
    default_header,
    encode_frame,
    encode_header,
    recording_parts,
    rotated_path,
    seal_frame,
)
from .outputs import claim_output

__all__ = ["Recorder", "recording_parts", "rotated_path", "write_recording"]

logger = logging.getLogger(__name__)

#: Frames sealed (compressed, checksummed) per trip to a worker thread.
_SEAL_GROUP = 4


class _Sink(Protocol):
    async def write(self, data: bytes) -> None: ...

    async def flush(self) -> None: ...

    async def fsync(self) -> None: ...

    async def aclose(self) -> None: ...


class _FileSink:
    """A file written through worker threads: aiofiles under asyncio, :func:`anyio.open_file`
    under trio (where aiofiles cannot run). Once the interpreter refuses new threads (exit hooks,
    Python 3.12+), each operation runs on the calling thread instead, so nothing is lost.

    Args:
        f: The asynchronous file.
        raw: The binary file underneath it.
        close: Name of ``f``'s closing coroutine (``close`` for aiofiles, ``aclose`` for anyio).
    """

    def __init__(
        self, f: Any, raw: Any, close: str, executor: DaemonExecutor | None = None
    ) -> None:
        self._f = f
        self._raw = raw
        self._close = close
        self._executor = executor

    async def _do(self, name: str, raw_name: str, *args: Any) -> None:
        await or_on_this_thread(
            lambda: getattr(self._f, name)(*args), getattr(self._raw, raw_name), *args
        )

    async def write(self, data: bytes) -> None:
        await self._do("write", "write", data)

    async def flush(self) -> None:
        await self._do("flush", "flush")

    async def fsync(self) -> None:
        if self._executor is None:
            await run_sync(os.fsync, self._raw.fileno())
            return
        fd = self._raw.fileno()
        await or_on_this_thread(
            lambda: asyncio.get_running_loop().run_in_executor(self._executor, os.fsync, fd),
            os.fsync,
            fd,
        )

    async def aclose(self) -> None:
        try:
            await self._do(self._close, "close")
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False)


def _under_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _open_sink(path: Path) -> _Sink:
    if _under_asyncio():
        # Its own daemon thread, in order: a hung write blocks neither the loop's shutdown nor
        # the interpreter's exit (the default executor is joined at both).
        executor = DaemonExecutor(f"zeus-async-write {path.name}")
        f: Any = await aiofiles.open(path, "wb", executor=executor)
        return _FileSink(f, f._file, "close", executor)  # aiofiles keeps the file in _file
    g = await anyio.open_file(path, "wb")
    return _FileSink(g, g.wrapped, "aclose")


async def _drain(stream: ObjectReceiveStream[Event]) -> AsyncIterator[list[Event]]:
    """Adapt a plain event stream to batches: wait for one event, then take what is buffered."""
    while True:
        try:
            first = await stream.receive()
        except anyio.EndOfStream:
            return
        batch = [first]
        if not isinstance(stream, MemoryObjectReceiveStream):
            yield batch
            continue
        try:
            while len(batch) < 65536:
                batch.append(stream.receive_nowait())
        except anyio.WouldBlock:
            pass
        except anyio.EndOfStream:
            yield batch
            return
        yield batch


def _check_version(format_version: int) -> None:
    if format_version not in WRITABLE_FORMAT_VERSIONS:
        raise ConfigError(
            f"cannot write recording format version {format_version!r} "
            f"(this build writes {sorted(WRITABLE_FORMAT_VERSIONS)})"
        )


#: Event times a frame can carry: ``0 <= t_ns < 2**64``.
_T_LIMIT = 2**64


class Recorder:
    """Writes every event of a stream to a recording file.

    Args:
        path: File to create. An existing file (or rotated part of one) is refused with
            :class:`FileExistsError` unless ``overwrite`` is true.
        header: Run metadata; default: this process (:func:`~.format.default_header`).
        flush_events: Write a frame once this many events are buffered.
        flush_interval_s: Write a frame once this long has passed since the first buffered
            event (measured on ``clock``).
        fsync_on_close: fsync the file when the stream ends (and each rotated part).
        rotate_bytes: Start a new part once a file reaches this size: ``run.zarc``, then
            ``run.1.zarc``, ``run.2.zarc``, ... Each part is a complete recording with its own
            header (``meta["part"]`` numbers it); :func:`recording_parts` lists them.
            ``None`` (default): one file.
        clock: Clock of the flush timer (default: the real clock).
        write_timeout_s: Give up on a write (and the recording) that has not finished after
            this many seconds: a hung file system or a target nobody reads. The recording then
            ends at its last complete frame and :meth:`run` raises :class:`TimeoutError`; the
            hung write's thread is abandoned. ``None`` (default): wait as long as it takes.
        overwrite: Replace an existing recording at ``path``, dropping its old rotated parts
            (which would otherwise read as the continuation of the new one).
        format_version: File layout to write: 3 (default; samples as columns) or 2 (msgpack
            frames, for readers of older builds).

    Attributes:
        events_written: Events written in frames so far.
        events_dropped: Events not written because their time was negative or past u64 (a
            frame cannot carry it; such events come only from a broken publisher).
        frames_written: Frames written so far.
        bytes_written: Bytes written so far, headers included, over all parts.
        paths: The files written so far (more than one after rotation).

    Raises:
        ConfigError: ``flush_events < 1``, ``flush_interval_s <= 0``, ``rotate_bytes`` too
            small to hold a header, or a format version this build does not write.
        FileExistsError: ``path`` exists and ``overwrite`` is false.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        header: RecordingHeader | None = None,
        flush_events: int = 4096,
        flush_interval_s: float = 1.0,
        fsync_on_close: bool = True,
        rotate_bytes: int | None = None,
        clock: Clock | None = None,
        write_timeout_s: float | None = None,
        overwrite: bool = False,
        format_version: int = FORMAT_VERSION,
    ) -> None:
        _check_version(format_version)
        if flush_events < 1:
            raise ConfigError(f"flush_events must be at least 1, got {flush_events!r}")
        if not flush_interval_s > 0:
            raise ConfigError(f"flush_interval_s must be positive, got {flush_interval_s!r}")
        if rotate_bytes is not None and rotate_bytes < 4096:
            raise ConfigError(f"rotate_bytes must be at least 4096, got {rotate_bytes!r}")
        self.path = claim_output(
            path,
            overwrite=overwrite,
            what="recording",
            recording=True,
            force_hint="overwrite=True",
        )
        self.header = header
        self.format_version = format_version
        self.flush_events = flush_events
        self.flush_interval_s = flush_interval_s
        self.fsync_on_close = fsync_on_close
        self.rotate_bytes = rotate_bytes
        self.clock: Clock = clock or RealClock()
        self.write_timeout_s = write_timeout_s
        self._hung: str | None = None  # why the recording was given up (a write hung)
        self.events_written = 0
        self.events_dropped = 0
        self.frames_written = 0
        self.bytes_written = 0
        self.paths: list[Path] = []
        self._buf: list[Event] = []
        self._encoder = EventEncoder()
        self._codec = PayloadCodec("none")
        self._sink: _Sink | None = None
        self._file_bytes = 0
        self._part_frames = 0
        self._lock: anyio.Lock | None = None
        self._armed: anyio.Event | None = None
        self._first_buffered_ns = 0

    async def run(self, stream: ObjectReceiveStream[Event] | EventBatches) -> None:
        """Record ``stream`` until it ends (a :class:`~zeus_async.runtime.Runtime` consumer).

        ``stream`` is a plain event stream or, cheaper per event, an
        :class:`~zeus_async.runtime.hub.EventBatches` (``start_consumer(..., batched=True)``).
        The header is written first; the last frame is written and the file fsync'ed when the
        stream ends, and also (shielded) if the task is cancelled.
        """
        if self._lock is not None:
            raise RuntimeError("a Recorder records one stream at a time")
        self._lock = anyio.Lock()
        self._armed = anyio.Event()
        batches = stream if isinstance(stream, EventBatches) else _drain(stream)
        try:
            await self._open_part()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._timer)
                async for batch in batches:
                    if not self._buf:
                        self._first_buffered_ns = self.clock.monotonic_ns()
                        self._armed.set()
                    self._buf.extend(batch)
                    if len(self._buf) >= self.flush_events:
                        await self.flush()
                    elif self._lock.locked():
                        # The timer is writing: take nothing more until it is done, so a slow
                        # or hung target backs events up in the stream (bounded, watched)
                        # rather than in our buffer.
                        async with self._lock:
                            pass
                tg.cancel_scope.cancel()
        finally:
            # Closing after a hung write would wait for it too: the file is left as it is.
            if self._hung is None:
                with anyio.CancelScope(shield=True):
                    try:
                        await self.flush()
                    finally:
                        if self._hung is None:
                            await self._close_part()
                logger.debug(
                    "recorded %d events in %d frames (%d bytes) to %s",
                    self.events_written,
                    self.frames_written,
                    self.bytes_written,
                    ", ".join(map(str, self.paths)),
                )

    async def _open_part(self) -> None:
        header = self.header if self.header is not None else default_header()
        self.header = header
        self._codec = PayloadCodec(header.compression)
        part = len(self.paths)
        if part:
            header = msgspec.structs.replace(header, meta={**header.meta, "part": str(part)})
        path = rotated_path(self.path, part)
        self._sink = await _open_sink(path)
        self.paths.append(path)
        self._file_bytes = 0
        self._part_frames = 0
        await self._write(encode_header(header, format_version=self.format_version))
        await self._sink.flush()

    async def _close_part(self) -> None:
        sink, self._sink = self._sink, None
        if sink is None:
            return
        try:
            if self.fsync_on_close:
                await sink.fsync()
        finally:
            await sink.aclose()

    @property
    def pending_events(self) -> int:
        """Events buffered but not yet written (lost if the process dies now)."""
        return len(self._buf)

    async def _timer(self) -> None:
        assert self._armed is not None
        interval_ns = round(self.flush_interval_s * 1e9)
        while True:
            await self._armed.wait()
            await self.clock.sleep_until(self._first_buffered_ns + interval_ns)
            if self._buf and self.clock.monotonic_ns() - self._first_buffered_ns >= interval_ns:
                await self.flush()

    async def _write(self, data: bytes) -> None:
        assert self._sink is not None
        await self._sink.write(data)
        self.bytes_written += len(data)
        self._file_bytes += len(data)

    async def flush(self) -> None:
        """Write the buffered events as frames and push them to the OS (no-op when empty).

        Buffered events are cut into frames of at most ``flush_events``. Does nothing when the
        recorder is not running.
        """
        if self._sink is None or self._lock is None:
            return
        if self._hung is not None:
            raise TimeoutError(self._hung)
        # Shielded: once events leave the buffer they must reach the file, even if the task
        # that started the flush (the timer, cancelled at the end of the stream) is cancelled;
        # but not longer than write_timeout_s (a write that hangs never will).
        with anyio.CancelScope(shield=True) as scope:
            if self.write_timeout_s is not None:
                scope.deadline = anyio.current_time() + self.write_timeout_s
            await self._flush_locked(self._lock)
        if scope.cancelled_caught:
            self._hung = (
                f"writing {self.paths[-1]} made no progress for {self.write_timeout_s:g} s "
                "(a hung file system, or a pipe nobody reads?); the recording was given up "
                f"and ends at its last complete frame ({self.events_written} events)"
            )
            raise TimeoutError(self._hung)

    async def _flush_locked(self, lock: anyio.Lock) -> None:
        async with lock:
            if not self._buf:
                return
            events, self._buf = self._buf, []
            assert self._armed is not None
            self._armed = anyio.Event()
            step = self.flush_events
            # A frame carries its first event's time as a u64: check those (one per frame);
            # only when one is out of range, filter the batch.
            if any(not 0 <= events[i].t_ns < _T_LIMIT for i in range(0, len(events), step)):
                events = self._drop_bad_times(events)
                if not events:
                    return
            for frames in await self._seal(events):
                await self._write_frames(frames)
            assert self._sink is not None
            await self._sink.flush()
            # Counted once the frames reached the OS, so a reader sees what the counters say.
            self.events_written += len(events)
            self.frames_written += -(-len(events) // step)

    def _drop_bad_times(self, events: list[Event]) -> list[Event]:
        """``events`` without those whose time no frame can carry (negative, or past u64):
        a broken or hostile publisher's, which would otherwise end the recording."""
        kept = [e for e in events if 0 <= e.t_ns < _T_LIMIT]
        dropped = len(events) - len(kept)
        if not self.events_dropped:
            logger.warning(
                "recording %s: dropped %d event(s) with a time outside 0 .. 2**64 ns "
                "(counted in Recorder.events_dropped)",
                self.path,
                dropped,
            )
        self.events_dropped += dropped
        return kept

    async def _seal(self, events: list[Event]) -> list[list[bytes]]:
        """Encode ``events`` into frames, groups of :data:`_SEAL_GROUP` frames at a time.

        msgpack runs on the event loop (it holds the GIL anyway); compression and CRC32 of
        each group run in a worker thread, where they release the GIL — so sealing group k
        overlaps with encoding group k + 1.
        """
        step = self.flush_events
        codec = self._codec
        groups: list[list[bytes]] = []
        span = step * _SEAL_GROUP
        columnar = self.format_version >= 3
        async with anyio.create_task_group() as tg:
            for g in range(0, len(events), span):
                part = events[g : g + span]
                slot: list[bytes] = []
                groups.append(slot)
                if columnar:
                    prepared = [
                        encode_columns(part[i : i + step], self._encoder)
                        for i in range(0, len(part), step)
                    ]
                    tg.start_soon(self._seal_columns, prepared, codec, slot)
                    await anyio.lowlevel.checkpoint()
                    continue
                payloads = [
                    (self._encoder.encode(part[i : i + step]), part[i].t_ns)
                    for i in range(0, len(part), step)
                ]

                async def seal(payloads: list[tuple[bytes, int]], slot: list[bytes]) -> None:
                    slot.extend(
                        await run_sync(lambda: [seal_frame(p, t, codec) for p, t in payloads])
                    )

                tg.start_soon(seal, payloads, slot)
                await anyio.lowlevel.checkpoint()  # let it hand the group to its thread
        return groups

    @staticmethod
    async def _seal_columns(
        prepared: list[PreparedFrame], codec: PayloadCodec, slot: list[bytes]
    ) -> None:
        def seal() -> list[bytes]:
            cctx = codec.block_compressor()
            return [seal_frame(p.seal(cctx), p.first_t_ns) for p in prepared]

        slot.extend(await run_sync(seal))

    async def _write_frames(self, frames: list[bytes]) -> None:
        """Write sealed frames in one go, starting a new part first where rotation says so."""
        pending: list[bytes] = []
        for frame in frames:
            if (
                self.rotate_bytes is not None
                and self._file_bytes + sum(map(len, pending)) + len(frame) > self.rotate_bytes
                and (self._part_frames or pending)
            ):
                if pending:
                    await self._write(b"".join(pending))
                pending = []
                await self._close_part()
                await self._open_part()
            pending.append(frame)
            self._part_frames += 1
        if pending:
            await self._write(pending[0] if len(pending) == 1 else b"".join(pending))


def write_recording(
    path: str | os.PathLike[str],
    events: Iterable[Event],
    header: RecordingHeader | None = None,
    events_per_frame: int = 4096,
    *,
    overwrite: bool = False,
    format_version: int = FORMAT_VERSION,
) -> int:
    """Write ``events`` to a new recording synchronously (tests, benchmarks, converters).

    Args:
        path: File to create. An existing file (or rotated part of one) is refused with
            :class:`FileExistsError` unless ``overwrite`` is true.
        events: Events, in the order to record them.
        header: Run metadata; default: this process.
        events_per_frame: Events per frame (the last frame may hold fewer).
        overwrite: Replace an existing recording (and drop its old rotated parts).
        format_version: File layout: 3 (default; samples as columns) or 2 (msgpack frames).

    Returns:
        The number of frames written.

    Raises:
        ConfigError: ``events_per_frame < 1`` or a format version this build does not write.
        FileExistsError: ``path`` exists and ``overwrite`` is false.
    """
    _check_version(format_version)
    if events_per_frame < 1:
        raise ConfigError(f"events_per_frame must be at least 1, got {events_per_frame!r}")
    encoder = EventEncoder()
    header = header if header is not None else default_header()
    codec = PayloadCodec(header.compression)
    path = claim_output(
        path, overwrite=overwrite, what="recording", recording=True, force_hint="overwrite=True"
    )
    frames = 0
    batch: list[Event] = []
    with path.open("wb") as f:
        f.write(encode_header(header, format_version=format_version))
        for event in events:
            batch.append(event)
            if len(batch) >= events_per_frame:
                f.write(encode_frame(batch, encoder, codec, format_version=format_version))
                frames += 1
                batch = []
        if batch:
            f.write(encode_frame(batch, encoder, codec, format_version=format_version))
            frames += 1
    return frames
