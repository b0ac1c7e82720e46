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
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import aiofiles
import anyio
from anyio.abc import ObjectReceiveStream

from ..clock import Clock, RealClock
from ..errors import ConfigError
from ..events import Event, EventEncoder
from .format import RecordingHeader, default_header, encode_frame, encode_header

__all__ = ["Recorder", "write_recording"]

logger = logging.getLogger(__name__)


class _Sink(Protocol):
    async def write(self, data: bytes) -> None: ...

    async def flush(self) -> None: ...

    async def fsync(self) -> None: ...

    async def aclose(self) -> None: ...


class _AiofilesSink:
    """A file written through aiofiles (asyncio)."""

    def __init__(self, f: Any) -> None:
        self._f = f

    async def write(self, data: bytes) -> None:
        await self._f.write(data)

    async def flush(self) -> None:
        await self._f.flush()

    async def fsync(self) -> None:
        await anyio.to_thread.run_sync(os.fsync, self._f.fileno())

    async def aclose(self) -> None:
        await self._f.close()


class _AnyioSink:
    """A file written through :func:`anyio.open_file` (trio, where aiofiles cannot run)."""

    def __init__(self, f: anyio.AsyncFile[bytes]) -> None:
        self._f = f

    async def write(self, data: bytes) -> None:
        await self._f.write(data)

    async def flush(self) -> None:
        await self._f.flush()

    async def fsync(self) -> None:
        await anyio.to_thread.run_sync(os.fsync, self._f.wrapped.fileno())

    async def aclose(self) -> None:
        await self._f.aclose()


def _under_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _open_sink(path: Path) -> _Sink:
    if _under_asyncio():
        return _AiofilesSink(await aiofiles.open(path, "wb"))
    return _AnyioSink(await anyio.open_file(path, "wb"))


class Recorder:
    """Writes every event of a stream to a recording file.

    Args:
        path: File to create (truncated if it exists).
        header: Run metadata; default: this process (:func:`~.format.default_header`).
        flush_events: Write a frame once this many events are buffered.
        flush_interval_s: Write a frame once this long has passed since the first buffered
            event (measured on ``clock``).
        fsync_on_close: fsync the file when the stream ends.
        clock: Clock of the flush timer (default: the real clock).

    Attributes:
        events_written: Events written in frames so far.
        frames_written: Frames written so far.
        bytes_written: Bytes written so far, header included.

    Raises:
        ConfigError: ``flush_events < 1`` or ``flush_interval_s <= 0``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        header: RecordingHeader | None = None,
        flush_events: int = 4096,
        flush_interval_s: float = 1.0,
        fsync_on_close: bool = True,
        clock: Clock | None = None,
    ) -> None:
        if flush_events < 1:
            raise ConfigError(f"flush_events must be at least 1, got {flush_events!r}")
        if not flush_interval_s > 0:
            raise ConfigError(f"flush_interval_s must be positive, got {flush_interval_s!r}")
        self.path = Path(path)
        self.header = header
        self.flush_events = flush_events
        self.flush_interval_s = flush_interval_s
        self.fsync_on_close = fsync_on_close
        self.clock: Clock = clock or RealClock()
        self.events_written = 0
        self.frames_written = 0
        self.bytes_written = 0
        self._buf: list[Event] = []
        self._encoder = EventEncoder()
        self._sink: _Sink | None = None
        self._lock: anyio.Lock | None = None
        self._armed: anyio.Event | None = None
        self._first_buffered_ns = 0

    async def run(self, stream: ObjectReceiveStream[Event]) -> None:
        """Record ``stream`` until it ends (a :class:`~zeus_async.runtime.Runtime` consumer).

        The header is written first; the last frame is written and the file fsync'ed when the
        stream ends, and also (shielded) if the task is cancelled.
        """
        if self._sink is not None:
            raise RuntimeError("a Recorder records one stream at a time")
        header = self.header if self.header is not None else default_header()
        self._lock = anyio.Lock()
        self._armed = anyio.Event()
        sink = await _open_sink(self.path)
        self._sink = sink
        try:
            await self._write(encode_header(header))
            await sink.flush()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._timer)
                async for event in stream:
                    self._buf.append(event)
                    if len(self._buf) == 1:
                        self._first_buffered_ns = self.clock.monotonic_ns()
                        self._armed.set()
                    if len(self._buf) >= self.flush_events:
                        await self.flush()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.flush()
                    if self.fsync_on_close:
                        await sink.fsync()
                finally:
                    self._sink = None
                    await sink.aclose()
                    logger.debug(
                        "recorded %d events in %d frames (%d bytes) to %s",
                        self.events_written,
                        self.frames_written,
                        self.bytes_written,
                        self.path,
                    )

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

    async def flush(self) -> None:
        """Write the buffered events as one frame and push it to the OS (no-op when empty).

        Does nothing when the recorder is not running.
        """
        if self._sink is None or self._lock is None:
            return
        async with self._lock:
            if not self._buf:
                return
            events, self._buf = self._buf, []
            assert self._armed is not None
            self._armed = anyio.Event()
            frame = encode_frame(events, self._encoder)
            await self._write(frame)
            await self._sink.flush()
            self.events_written += len(events)
            self.frames_written += 1


def write_recording(
    path: str | os.PathLike[str],
    events: Iterable[Event],
    header: RecordingHeader | None = None,
    events_per_frame: int = 4096,
) -> int:
    """Write ``events`` to a new recording synchronously (tests, benchmarks, converters).

    Args:
        path: File to create (truncated if it exists).
        events: Events, in the order to record them.
        header: Run metadata; default: this process.
        events_per_frame: Events per frame (the last frame may hold fewer).

    Returns:
        The number of frames written.

    Raises:
        ConfigError: ``events_per_frame < 1``.
    """
    if events_per_frame < 1:
        raise ConfigError(f"events_per_frame must be at least 1, got {events_per_frame!r}")
    encoder = EventEncoder()
    frames = 0
    batch: list[Event] = []
    with Path(path).open("wb") as f:
        f.write(encode_header(header if header is not None else default_header()))
        for event in events:
            batch.append(event)
            if len(batch) >= events_per_frame:
                f.write(encode_frame(batch, encoder))
                frames += 1
                batch = []
        if batch:
            f.write(encode_frame(batch, encoder))
            frames += 1
    return frames
