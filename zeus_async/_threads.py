"""Worker threads, and what to do once the interpreter refuses to start them.

Monitors and optimizers left open are closed by exit hooks (:mod:`zeus_async._exit`). From
Python 3.12 on, the interpreter is already finalizing when those hooks run and refuses to start
new threads ("can't create new thread at interpreter shutdown"), and executors refuse new work
once shut down. A recording's last frames and fsync, or restoring a power limit, must still
happen then: the blocking call runs on the calling thread instead, which at exit blocks
nothing that matters.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio.to_thread

__all__ = ["or_on_this_thread", "run_sync"]

T = TypeVar("T")


def _threads_refused(exc: RuntimeError) -> bool:
    """Whether ``exc`` says no thread or executor job can be started (interpreter exit)."""
    return "interpreter shutdown" in str(exc)


async def or_on_this_thread(
    attempt: Callable[[], Awaitable[T]], func: Callable[..., T], *args: object
) -> T:
    """``await attempt()`` (which hands ``func`` to a thread), or ``func(*args)`` on this
    thread when threads are refused."""
    try:
        return await attempt()
    except RuntimeError as exc:
        if not _threads_refused(exc):
            raise
        return func(*args)


async def run_sync(func: Callable[..., T], *args: object) -> T:
    """``func(*args)`` in a worker thread, or on this thread when threads are refused."""
    return await or_on_this_thread(lambda: anyio.to_thread.run_sync(func, *args), func, *args)
