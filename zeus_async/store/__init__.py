"""Recordings: crash-safe framed msgpack files of events (see ``docs/recording-format.md``).

* :class:`Recorder` — a runtime consumer writing a recording with aiofiles;
* :func:`write_recording` — the synchronous writer for tests and tools;
* :class:`RecordingReader` — iteration with filters, recovery of torn/corrupt files, and random
  access by time.
"""

from __future__ import annotations

import logging

from .format import NotARecordingError, RecordingHeader, default_header
from .plot import power_figure
from .reader import RecordingReader, RecoveryReport, event_device
from .recorder import Recorder, recording_parts, rotated_path, write_recording

__all__ = [
    "NotARecordingError",
    "Recorder",
    "RecordingHeader",
    "RecordingReader",
    "RecoveryReport",
    "default_header",
    "event_device",
    "power_figure",
    "recording_parts",
    "rotated_path",
    "write_recording",
]

logger = logging.getLogger(__name__)
