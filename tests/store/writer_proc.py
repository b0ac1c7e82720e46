"""Test helper: write a recording until killed.

Usage: ``python writer_proc.py PATH EVENTS_PER_FRAME [raw|recorder]``. Event ``i`` is
``GpuSample(host="w", t_ns=i, gpu=0, power_w=float(i))``. The number of complete frames
written so far is printed on its own line after each frame.

* ``raw`` (default): each frame is written with several ``os.write`` calls, so a kill can
  tear it.
* ``recorder``: the product's path — events published through a hub to the batched
  :class:`~zeus_async.store.Recorder` (aiofiles, zstd frames of ``EVENTS_PER_FRAME`` events).

:func:`write` is the same writer in a process forked from a ``multiprocessing`` forkserver
that has imported this module (no interpreter start per process), reporting each count on a
pipe instead of stdout.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

import anyio

from zeus_async.events import Event, EventEncoder, GpuSample
from zeus_async.runtime.hub import Hub
from zeus_async.store import Recorder
from zeus_async.store.format import RecordingHeader, encode_frame, encode_header


def sample(i: int) -> GpuSample:
    return GpuSample(host="w", t_ns=i, gpu=0, power_w=float(i))


def _print(frames: int) -> None:
    print(frames, flush=True)


def raw(path: str, per_frame: int, report: Callable[[int], None] = _print) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, encode_header(RecordingHeader(host="w", pid=os.getpid())))
    encoder = EventEncoder()
    i = 0
    for frames in range(1, 200_000):
        batch: list[Event] = [sample(i + k) for k in range(per_frame)]
        i += per_frame
        data = encode_frame(batch, encoder)
        third = len(data) // 3
        for part in (data[:third], data[third : 2 * third], data[2 * third :]):
            os.write(fd, part)
        report(frames)
    os.close(fd)


async def recorder(path: str, per_frame: int, report: Callable[[int], None] = _print) -> None:
    hub = Hub()
    header = RecordingHeader(host="w", pid=os.getpid(), compression="zstd")
    rec = Recorder(path, header=header, flush_events=per_frame, flush_interval_s=0.05)
    batches = hub.subscribe_batches(4 * per_frame)
    async with anyio.create_task_group() as tg:
        tg.start_soon(rec.run, batches)
        reported = 0
        for i in range(10**9):
            await hub.publish(sample(i))
            if rec.frames_written != reported:
                reported = rec.frames_written
                report(reported)
            if i % 16 == 0:
                await anyio.sleep(0)


def write(path: str, per_frame: int, mode: str, reports: Connection) -> None:
    """The writer of ``mode`` (``raw`` or ``rec``), each count sent on ``reports``."""
    if mode == "raw":
        raw(path, per_frame, reports.send)
    else:
        anyio.run(recorder, path, per_frame, reports.send)


def main() -> None:
    path, per_frame = sys.argv[1], int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "raw"
    if mode == "raw":
        raw(path, per_frame)
    else:
        anyio.run(recorder, path, per_frame)


if __name__ == "__main__":
    main()
