"""Test helper: write a recording frame by frame until killed.

Usage: ``python writer_proc.py PATH EVENTS_PER_FRAME``. Event ``i`` is
``GpuSample(host="w", t_ns=i, gpu=0, power_w=float(i))``. Each frame is written with several
``os.write`` calls (so a kill can tear it) and then the number of complete frames written so
far is printed on its own line.
"""

from __future__ import annotations

import os
import sys

from zeus_async.events import Event, EventEncoder, GpuSample
from zeus_async.store.format import RecordingHeader, encode_frame, encode_header


def main() -> None:
    path, per_frame = sys.argv[1], int(sys.argv[2])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, encode_header(RecordingHeader(host="w", pid=os.getpid())))
    encoder = EventEncoder()
    i = 0
    for frames in range(1, 200_000):
        batch: list[Event] = [
            GpuSample(host="w", t_ns=i + k, gpu=0, power_w=float(i + k)) for k in range(per_frame)
        ]
        i += per_frame
        data = encode_frame(batch, encoder)
        third = len(data) // 3
        for part in (data[:third], data[third : 2 * third], data[2 * third :]):
            os.write(fd, part)
        print(frames, flush=True)
    os.close(fd)


if __name__ == "__main__":
    main()
