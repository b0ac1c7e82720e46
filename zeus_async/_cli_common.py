"""Pieces shared by the CLI's command modules (:mod:`zeus_async.cli`, ``_cli_store``)."""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from .errors import ConfigError

if TYPE_CHECKING:
    from .bus import Subscriber

__all__ = ["stop_on_signals", "until_stopped", "wait_for_publisher"]

logger = logging.getLogger(__name__)


async def stop_on_signals(scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` on the first SIGINT or SIGTERM (Ctrl-C ends a command cleanly)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


@asynccontextmanager
async def until_stopped(duration: float | None = None) -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group for a command's body: cancelled after ``duration`` seconds (when given) or
    on the first SIGINT/SIGTERM, and ended (with the tasks the body started) when the body
    returns."""
    with anyio.CancelScope() as scope:
        if duration is not None:
            scope.deadline = anyio.current_time() + duration
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, scope)
            yield tg
            tg.cancel_scope.cancel()


async def wait_for_publisher(sub: Subscriber, endpoints: Sequence[str], timeout: float) -> None:
    """Wait for one stream's handshake; a clear error when nobody answers in time."""
    try:
        await sub.wait_ready(streams=1, timeout=timeout)
    except TimeoutError:
        raise ConfigError(
            f"no publisher answered at {', '.join(endpoints)} within {timeout:g} s"
        ) from None


def fmt_cell(value: float | int | None, scale: float = 1.0, digits: int = 1) -> str:
    """A table cell: ``value / scale`` with ``digits`` decimals, ``-`` when unknown."""
    if value is None:
        return "-"
    return f"{value / scale:.{digits}f}"
