"""Progress of long passes over a recording (load, export, replay) and its terminal display.

Long operations take an optional ``progress(done_bytes, total_bytes)`` callback: bytes of the
input file read so far, called about every :data:`PROGRESS_EVERY` events and once more at the
end with ``done == total``. The CLI draws it as a progress bar
(:func:`zeus_async.cli.render.terminal_progress`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

from .reader import RecordingReader

__all__ = ["PROGRESS_EVERY", "Progress", "ProgressTicker"]

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
