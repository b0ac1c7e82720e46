"""Worker threads, and what to do once the interpreter refuses to start them.

Monitors and optimizers left open are closed by exit hooks (:mod:`zeus_async._exit`). From
Python 3.12 on, the interpreter is already finalizing when those hooks run and refuses to start
new threads ("can't create new thread at interpreter shutdown"), and executors refuse new work
once shut down. A recording's last frames and fsync, or restoring a power limit, must still
happen then: the blocking call runs on the calling thread instead, which at exit blocks
nothing that matters.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

import anyio.to_thread

__all__ = ["DaemonExecutor", "or_on_this_thread", "run_sync"]

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


class DaemonExecutor(Executor):
    """One daemon thread running submitted calls in order (an executor for a file's I/O).

    A write that hangs in the kernel (a stalled file system, a pipe nobody reads) blocks only
    this thread, and neither the event loop's shutdown (which joins its default executor) nor
    the interpreter's exit waits for it. The thread starts on the first call.
    """

    #: Calls submitted to any DaemonExecutor and not finished yet (a fake clock must not jump
    #: while real-time work is in flight; see ``clock._worker_threads_busy``).
    in_flight = 0
    _count_lock = threading.Lock()

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._shutdown = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            with DaemonExecutor._count_lock:
                DaemonExecutor.in_flight += 1
            self._jobs.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            finally:
                with DaemonExecutor._count_lock:
                    DaemonExecutor.in_flight -= 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            thread = self._thread
        self._jobs.put(None)
        if wait and thread is not None:
            thread.join()
