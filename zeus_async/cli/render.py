"""What the CLI draws: tables that fit the terminal, the live view and progress bars.

Everything is drawn with rich. Tables have a priority per column: when the terminal is narrower
than the whole table, the least important columns are dropped (never wrapped), and when it is
shorter than the rows, the last rows are folded into one "… N more" row. Output that is not a
terminal (a pipe, a file, a test's buffer) gets every column, as wide as it needs, in plain text
with no escape sequences.
"""

from __future__ import annotations

import io
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

__all__ = [
    "Column",
    "LiveView",
    "counting_status",
    "fit_table",
    "plain_text",
    "terminal_progress",
    "write_table",
]

logger = logging.getLogger(__name__)

#: ``Column.keep`` of a column that is never dropped.
ALWAYS = 9

#: Characters between two columns (a space of padding each side of a one-space rule).
_GAP = 3


@dataclass(frozen=True)
class Column:
    """A table column.

    Attributes:
        header: The column's title.
        left: Left-aligned (names); numbers are right-aligned.
        keep: Importance when the terminal is too narrow: the lowest is dropped first (the
            rightmost of equals first); :data:`ALWAYS` is never dropped.
    """

    header: str
    left: bool = False
    keep: int = ALWAYS


def _widths(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[int]:
    return [max([len(c.header), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]


def fitted_columns(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int
) -> list[int]:
    """Indices of the columns that fit in ``width`` characters, dropping the least important
    first (every :data:`ALWAYS` column stays, even if they alone do not fit)."""
    widths = _widths(columns, rows)
    kept = list(range(len(columns)))

    def needed() -> int:
        return sum(widths[i] for i in kept) + _GAP * (len(kept) - 1)

    while needed() > width:
        droppable = [i for i in kept if columns[i].keep < ALWAYS]
        if not droppable:
            break
        kept.remove(min(droppable, key=lambda i: (columns[i].keep, -i)))
    return kept


def fit_table(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    max_rows: int | None = None,
    footer: Sequence[Sequence[str]] = (),
    more: str = "more",
) -> Table:
    """A table of ``rows`` (cells as text) that fits ``width`` columns of characters (all of
    them when ``None``) and ``max_rows`` data rows including the ``footer`` rows (all when
    ``None``); rows past that become one ``… N more`` row."""
    everything = [*rows, *footer]
    kept = (
        list(range(len(columns))) if width is None else fitted_columns(columns, everything, width)
    )
    shown = list(rows)
    hidden = 0
    if max_rows is not None:
        room = max(max_rows - len(footer), 1)
        if len(shown) > room:
            hidden = len(shown) - (room - 1)
            shown = shown[: room - 1]
    if hidden:
        shown.append([f"… {hidden} {more}", *("" for _ in columns[1:])])
    shown.extend(footer)
    # Widths are known (every cell is text): given to rich, they spare it measuring each cell,
    # and cells are Text, never parsed as markup (a name such as "[rank0]" stays as it is).
    widths = _widths(columns, shown)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
    for i in kept:
        c = columns[i]
        table.add_column(
            c.header,
            justify="left" if c.left else "right",
            no_wrap=True,
            overflow="ellipsis",
            width=widths[i],
        )
    for row in shown:
        table.add_row(*(Text(row[i]) for i in kept))
    return table


def plain_text(renderable: RenderableType, width: int | None = None) -> str:
    """``renderable`` as plain text (no escape sequences, trailing spaces removed), laid out in
    ``width`` characters, or as wide as it needs when ``None`` (so nothing wraps)."""
    if width is None:
        width = Console(file=io.StringIO(), width=10_000).measure(renderable).maximum
    buffer = io.StringIO()
    Console(file=buffer, width=max(width, 1), color_system=None, soft_wrap=False).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"


def write_table(
    out: TextIO,
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    footer: Sequence[Sequence[str]] = (),
) -> None:
    """Print a whole table to ``out``: as wide as it needs (a pipe, a file), or fitted to the
    terminal's width when ``out`` is one."""
    width = terminal_width(out)
    out.write(plain_text(fit_table(columns, rows, width=width, footer=footer), width))


def terminal_width(out: TextIO) -> int | None:
    """The width of the terminal ``out`` writes to, or ``None`` when it is not one."""
    try:
        if not out.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return Console(file=out).size.width


class LiveView:
    """A view redrawn on a terminal's alternate screen (rich's ``Live``), like ``top``: each
    refresh draws the whole screen, so a resized window never leaves pieces of earlier frames;
    at the end the terminal's own screen comes back as it was.

    ``update(draw)`` calls ``draw(width, height)`` with the terminal's size at that moment and
    shows what it returns, cropped to the screen. Log records written meanwhile are kept and
    written out when the view ends (they would be drawn over on the alternate screen).
    """

    def __init__(self, out: TextIO) -> None:
        self.console = Console(file=out)
        self._live = Live(
            console=self.console,
            auto_refresh=False,
            screen=True,
            vertical_overflow="crop",
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._handlers: list[tuple[logging.StreamHandler[Any], Any]] = []
        self._held = io.StringIO()

    def __enter__(self) -> LiveView:
        self._live.start()
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (
                sys.stderr,
                sys.stdout,
            ):
                self._handlers.append((handler, handler.setStream(self._held)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.stop()
        for handler, stream in self._handlers:
            handler.setStream(stream)
            held = self._held.getvalue()
            if held and stream is not None:
                stream.write(held)
                stream.flush()
                self._held = io.StringIO()
        self._handlers.clear()

    def update(self, draw: Callable[[int, int], RenderableType]) -> None:
        size = self.console.size
        self._live.update(draw(size.width, size.height), refresh=True)


def group(*parts: RenderableType | None) -> Group:
    """The parts that are not ``None``, one under the other."""
    return Group(*(p for p in parts if p is not None))


# -- progress -----------------------------------------------------------------------------------


def _stderr_terminal(stream: TextIO | None) -> TextIO | None:
    out = sys.stderr if stream is None else stream
    try:
        return out if out.isatty() else None
    except (AttributeError, ValueError):
        return None


def terminal_progress(
    label: str,
    stream: TextIO | None = None,
    *,
    min_interval_s: float = 0.1,
    in_bytes: bool = True,
) -> Callable[[int, int], None] | None:
    """A ``progress(done_bytes, total_bytes)`` callback (:mod:`zeus_async.store.progress`)
    drawing a rich progress bar: percent, bytes (unless not ``in_bytes``), elapsed and
    remaining time.

    Returns ``None`` (no display) when ``stream`` (default: stderr) is not a terminal, so
    redirected output stays clean. The bar is left complete at 100 %.
    """
    out = _stderr_terminal(stream)
    if out is None:
        return None
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        *([DownloadColumn()] if in_bytes else []),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(file=out),
        auto_refresh=False,
        transient=False,
    )
    task = bar.add_task(label, total=None)
    state = {"started": False, "last": 0.0}

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        finished = total > 0 and done >= total
        if state["started"] and not finished and now - state["last"] < min_interval_s:
            return
        if not state["started"]:
            bar.start()
            _LIVE_BARS.add(bar)
            state["started"] = True
        state["last"] = now
        bar.update(task, completed=done, total=total or None)
        bar.refresh()
        if finished:
            bar.stop()
            _LIVE_BARS.discard(bar)

    return show


#: Progress bars drawing now (started, not finished).
_LIVE_BARS: set[Progress] = set()


def stop_progress_bars() -> None:
    """End the bars still drawing (work stopped short: an error, Ctrl-C), so what is written
    next starts on a line of its own rather than under a bar that redraws at exit."""
    for bar in list(_LIVE_BARS):
        bar.stop()
    _LIVE_BARS.clear()


@contextmanager
def counting_status(
    label: str, stream: TextIO | None = None, *, min_interval_s: float = 0.25
) -> Iterator[Callable[[str], None]]:
    """A one-line status for open-ended work (a recording that runs until stopped): yields
    ``show(text)``, drawn with a spinner and the elapsed time at most every
    ``min_interval_s``; nothing is drawn when ``stream`` (default: stderr) is not a terminal."""
    out = _stderr_terminal(stream)
    if out is None:
        yield lambda text: None
        return
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=Console(file=out),
        auto_refresh=False,
        transient=False,
    )
    task = bar.add_task(label, total=None, status="")
    last = [0.0]

    def show(text: str) -> None:
        now = time.monotonic()
        if now - last[0] < min_interval_s:
            return
        last[0] = now
        bar.update(task, status=text)
        bar.refresh()

    bar.start()
    try:
        yield show
    finally:
        bar.stop()
