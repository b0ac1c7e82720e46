"""Export of a recording's events, streamed: JSON lines and one CSV table.

:func:`export_jsonl` writes what ``zeus-async subscribe --json`` prints, :func:`export_csv`
one row per event under :func:`csv_columns`; both stream the file in constant memory and
never write over the recording they read.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import os
import sys
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Final

from ...events import EVENT_TYPES, Event, event_kind, event_to_dict, event_to_json
from ..progress import Progress, ProgressTicker
from ..reader import RecordingReader, event_device

logger = logging.getLogger(__name__)


_PathLike = str | os.PathLike[str]


def _events(reader: RecordingReader, kinds: str | Collection[str] | None) -> Iterator[Event]:
    """The reader's events of ``kinds``; an unknown kind raises here, before any output."""
    wanted = [kinds] if isinstance(kinds, str) else kinds
    events = reader.events(kinds=wanted)
    first = next(events, None)  # the reader validates the kinds on the first step
    return events if first is None else itertools.chain((first,), events)


@contextmanager
def _open_out(path_out: _PathLike, path_in: _PathLike) -> Iterator[IO[bytes]]:
    if os.fspath(path_out) == "-":
        stream = sys.stdout.buffer
        try:
            yield stream
        finally:
            stream.flush()
    else:
        from ..outputs import claim_output

        # Never the recording being read (or one of its parts): truncating it while it is read.
        claim_output(path_out, inputs=[path_in], overwrite=True, what="export")
        with Path(path_out).open("wb") as f:
            yield f


def export_jsonl(
    path_in: _PathLike,
    path_out: _PathLike,
    *,
    kinds: str | Collection[str] | None = None,
    progress: Progress | None = None,
) -> int:
    """Write the events of a recording as JSON lines, as ``zeus-async subscribe --json`` does.

    Streams the file (constant memory). Each line is
    ``event_to_json(event)`` (compact JSON of :func:`event_to_dict`).

    Args:
        path_in: The recording.
        path_out: Output file (truncated; never the recording or one of its parts: that is
            a ``ConfigError``), or ``"-"`` for standard output.
        kinds: Export only these event tags (``"gpu"``, ``"measurement"``, ...).
        progress: ``progress(done_bytes, total_bytes)`` over the input file.

    Returns:
        The number of events written.

    Raises:
        ConfigError: An unknown kind.
    """
    reader = RecordingReader(path_in)
    events = _events(reader, kinds)
    ticker = ProgressTicker(reader, progress)
    written = 0
    with _open_out(path_out, path_in) as out:
        for event in events:
            out.write(event_to_json(event) + b"\n")
            written += 1
            ticker.tick()
    ticker.finish()
    reader.report.warn(path_in, "exported")
    logger.info("exported %d events of %s to %s (JSON lines)", written, path_in, path_out)
    return written


#: Columns every CSV row fills: the event tag, host, time and :func:`event_device`.
CSV_FIXED: Final = ("kind", "host", "t_ns", "device")


def csv_columns(kinds: Iterable[str] | None = None) -> list[str]:
    """The CSV header for events of ``kinds`` (all by default).

    After :data:`CSV_FIXED`, the fields of each kind in schema order (:data:`~zeus_async.events.
    EVENT_TYPES` order, then field order), each name once: fields of the same name share a
    column. A field named ``kind`` becomes ``<tag>_kind`` (``fault_kind``); the ``device``
    field of faults is the ``device`` column.
    """
    wanted = None if kinds is None else set(kinds)
    columns = list(CSV_FIXED)
    for cls in EVENT_TYPES:
        tag = str(cls.__struct_config__.tag)
        if wanted is not None and tag not in wanted:
            continue
        for name in cls.__struct_fields__:
            column = _csv_column(tag, name)
            if column is not None and column not in columns:
                columns.append(column)
    return columns


def _csv_column(tag: str, name: str) -> str | None:
    if name in ("host", "t_ns", "device"):
        return None  # fixed columns (a fault's device is its event_device)
    return f"{tag}_{name}" if name == "kind" else name


_SCALARS: Final = (bool, int, float, str, type(None))


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def export_csv(
    path_in: _PathLike,
    path_out: _PathLike,
    *,
    kinds: str | Collection[str] | None = None,
    progress: Progress | None = None,
) -> int:
    """Write the events of a recording as one CSV table (streamed, constant memory).

    The header is :func:`csv_columns` of the exported kinds. A cell is empty for ``None``, an
    empty string, or a field the row's kind does not have; booleans are ``true``/``false``,
    floats are written so they read back exactly, and dicts and lists (measurement energies,
    stream devices) are JSON.

    Args:
        path_in: The recording.
        path_out: Output file (truncated; never the recording or one of its parts: that is
            a ``ConfigError``), or ``"-"`` for standard output.
        kinds: Export only these event tags (``"gpu"``, ``"rapl"``, ...).
        progress: ``progress(done_bytes, total_bytes)`` over the input file.

    Returns:
        The number of events (rows) written.

    Raises:
        ConfigError: An unknown kind.
    """
    reader = RecordingReader(path_in)
    wanted = [kinds] if isinstance(kinds, str) else kinds
    events = _events(reader, wanted)
    columns = csv_columns(wanted)
    index = {c: i for i, c in enumerate(columns)}
    layout: dict[type[Any], list[tuple[int, str]]] = {}
    for cls in EVENT_TYPES:
        tag = str(cls.__struct_config__.tag)
        layout[cls] = [
            (index[c], name)
            for name in cls.__struct_fields__
            if (c := _csv_column(tag, name)) is not None and c in index
        ]
    ticker = ProgressTicker(reader, progress)
    written = 0
    with _open_out(path_out, path_in) as out:
        text = io.TextIOWrapper(out, encoding="utf-8", newline="")
        try:
            writer = csv.writer(text, lineterminator="\n")
            writer.writerow(columns)
            for event in events:
                row = [""] * len(columns)
                row[0] = event_kind(event)
                row[1] = event.host
                row[2] = str(event.t_ns)
                row[3] = event_device(event) or ""
                builtins: dict[str, Any] | None = None
                for i, name in layout[type(event)]:
                    value = getattr(event, name)
                    if not isinstance(value, _SCALARS):
                        # Nested structs as named fields, the same form as the JSON export.
                        builtins = builtins or event_to_dict(event)
                        value = builtins[name]
                    row[i] = _csv_cell(value)
                writer.writerow(row)
                written += 1
                ticker.tick()
        finally:
            text.flush()
            text.detach()
    ticker.finish()
    reader.report.warn(path_in, "exported")
    logger.info("exported %d events of %s to %s (CSV)", written, path_in, path_out)
    return written
