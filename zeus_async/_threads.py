"""Worker threads, and what to do once the interpreter refuses to start them.

Monitors and optimizers left open are closed by exit hooks (:mod:`zeus_async._exit`). From
Python 3.12 on, the interpreter is already finalizing when those hooks run and refuses to start
new threads ("can't create new thread at interpreter shutdown"), and executors refuse new work
once shut down. A recording's last frames and fsync, or restoring a power limit, must still
happen then: the blocking call runs on the calling thread instead, which at exit blocks
nothing that matters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread

__all__ = ["run_sync", "threads_refused"]

T = TypeVar("T")


def threads_refused(exc: BaseException) -> bool:
    """Whether ``exc`` says no thread or executor job can be started (interpreter exit)."""
    return isinstance(exc, RuntimeError) and "interpreter shutdown" in str(exc)


async def run_sync(func: Callable[..., T], *args: object) -> T:
    """``func(*args)`` in a worker thread, or on this thread when threads are refused."""
    try:
        return await anyio.to_thread.run_sync(func, *args)
    except RuntimeError as exc:
        if not threads_refused(exc):
            raise
        return func(*args)
