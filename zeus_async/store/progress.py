"""Progress of long passes over a recording (load, export, replay) and its terminal display.

Long operations take an optional ``progress(done_bytes, total_bytes)`` callback: bytes of the
input file read so far, called about every :data:`PROGRESS_EVERY` events and once more at the
end with ``done == total``. :func:`terminal_progress` renders it on a terminal.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Final, TextIO

from .reader import RecordingReader

__all__ = ["PROGRESS_EVERY", "Progress", "ProgressTicker", "terminal_progress"]

logger = logging.getLogger(__name__)

#: ``progress(done_bytes, total_bytes)``; see the module docstring.
Progress = Callable[[int, int], None]

#: Events between two progress calls.
PROGRESS_EVERY: Final = 65_536


class ProgressTicker:
    """Calls ``progress(done_bytes, total_bytes)`` about every :data:`PROGRESS_EVERY` events
    of a pass over ``reader`` (it reads the pass's :attr:`RecordingReader.report`)."""

    def __init__(self, reader: RecordingReader, progress: Progress | None) -> None:
        self._reader = reader
        self._progress = progress
        self._next = PROGRESS_EVERY
        self._done = 0
        self._offsets: list[int] = []
        self._total = 0
        if progress is not None:
            self._total = reader.size_bytes
            self._offsets = [offset for offset, _ in reader.frame_index()]

    def tick(self) -> None:
        if self._progress is None:
            return
        report = self._reader.report
        if report.events_ok < self._next:
            return
        self._next = report.events_ok + PROGRESS_EVERY
        # Frames 0..frames_ok-1 are read: the next one starts where the reading stands.
        k = report.frames_ok
        done = self._offsets[k] if k < len(self._offsets) else self._total
        self._done = max(self._done, min(done, self._total))
        self._progress(self._done, self._total)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress(self._total, self._total)


def terminal_progress(
    label: str, stream: TextIO | None = None, *, min_interval_s: float = 0.1
) -> Progress | None:
    """A progress callback drawing ``label  42% 12.3/29.1 MB  3.1 s`` on one terminal line.

    Returns ``None`` (no display) when ``stream`` (default: stderr) is not a terminal, so
    redirected output stays clean. The line is finished with a newline at 100 %.
    """
    out = sys.stderr if stream is None else stream
    if not out.isatty():
        return None
    t0 = time.monotonic()
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        finished = total > 0 and done >= total
        if not finished and now - last[0] < min_interval_s:
            return
        last[0] = now
        pct = 100.0 * done / total if total else 100.0
        out.write(
            f"\r{label}  {pct:5.1f}%  {done / 1e6:.1f}/{total / 1e6:.1f} MB  {now - t0:.1f} s"
        )
        if finished:
            out.write("\n")
        out.flush()

    return show
