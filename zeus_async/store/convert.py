"""Rewriting a recording in another format version: ``zeus-async convert IN OUT``.

The events of every complete frame of the input (every rotated part, in order; damage
skipped and reported as every reader does) are written, in order, to a new recording in
format 3 (columns; or 2). The input is never written: an output that is the input, one of its
parts or a link to one is refused, and an existing output is replaced only when asked
(:func:`~.outputs.claim_output`, the rules of every command that writes).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ..events import Event
from .format import FORMAT_VERSION
from .outputs import claim_output
from .progress import Progress, ProgressTicker
from .reader import RecordingReader, RecoveryReport
from .recorder import write_recording

__all__ = ["ConvertResult", "convert_recording"]

logger = logging.getLogger(__name__)


@dataclass
class ConvertResult:
    """What :func:`convert_recording` did.

    Attributes:
        events: Events written.
        frames: Frames written.
        format_from: The input's format version.
        format_to: The output's.
        report: The input's recovery report (damage skipped).
    """

    events: int
    frames: int
    format_from: int
    format_to: int
    report: RecoveryReport


def convert_recording(
    path_in: str | os.PathLike[str],
    path_out: str | os.PathLike[str],
    *,
    format_version: int = FORMAT_VERSION,
    events_per_frame: int = 4096,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write the events of recording ``path_in`` to a new recording ``path_out``.

    The output keeps the input's header (run metadata; ``meta["part"]`` dropped: the output
    is one file holding every part) and compresses with zstd.

    Raises:
        ConfigError: ``path_out`` is the input or one of its parts (even with ``overwrite``),
            or a format this build does not write.
        FileExistsError: ``path_out`` exists and ``overwrite`` is false.
        CodecError: ``path_in`` is not a recording this build reads.
    """
    claim_output(path_out, inputs=[path_in], overwrite=overwrite, what="recording", recording=True)
    reader = RecordingReader(path_in)
    meta = {k: v for k, v in reader.header.meta.items() if k != "part"}
    header = msgspec.structs.replace(reader.header, meta=meta, compression="zstd")
    ticker = ProgressTicker(reader, progress)
    count = 0

    def events() -> Iterator[Event]:
        nonlocal count
        for batch in reader.batches():
            count += len(batch)
            yield from batch
            ticker.tick()
        ticker.finish()

    frames = write_recording(
        Path(path_out),
        events(),
        header,
        events_per_frame,
        overwrite=overwrite,
        format_version=format_version,
    )
    reader.report.warn(path_in, "converted")
    logger.info(
        "converted %s (format %d) to %s (format %d): %d events",
        path_in,
        reader.format_version,
        path_out,
        format_version,
        count,
    )
    return ConvertResult(count, frames, reader.format_version, format_version, reader.report)
