"""Running cleanup at interpreter exit early enough that worker threads still run."""

from __future__ import annotations

import atexit
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, TypeVar

__all__ = ["ClosedOnExit", "SignalRestorer", "call_at_exit"]

_C = TypeVar("_C", bound="ClosedOnExit")

logger = logging.getLogger(__name__)


def call_at_exit(func: Callable[[], None]) -> None:
    """Run ``func`` when the interpreter exits, before ``concurrent.futures`` shuts down.

    The executors stop in ``threading``'s exit hooks, which run *before* ``atexit``
    callbacks: a monitor closed from ``atexit`` could no longer flush its recording (aiofiles
    writes through the default executor), and an optimizer restoring power limits through a
    monitor must do so before that monitor closes. CPython's ``threading._register_atexit``
    runs callbacks before that shutdown, the last registered first (so an optimizer built on a
    monitor is closed before it); ``atexit`` is the fallback elsewhere. ``func`` must be
    idempotent: it also runs when the object was closed already.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(func)
        return
    try:
        register(func)
    except RuntimeError:  # already shutting down
        atexit.register(func)


class SignalRestorer:
    """Run ``restore`` on SIGINT and SIGTERM, then let the signal do what it did before.

    Handlers are only installed from the main thread (Python delivers signals there). With the
    default disposition the process exits through ``SystemExit(128 + signum)``, so ``finally``
    blocks and exit hooks still run (a re-raised ``SIG_DFL`` would kill it before monitors
    flush their recordings).
    """

    def __init__(self, restore: Callable[[], None], what: str) -> None:
        self._restore = restore
        self._what = what
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self.on_signal)

    def uninstall(self) -> None:
        """Put the previous handlers back (from the main thread; elsewhere, nothing to do:
        handlers were only installed from there, and ``signal.signal`` only works there)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self.on_signal:
                signal.signal(sig, previous)
        self._previous.clear()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        logger.info("signal %d: %s", signum, self._what)
        self._restore()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            raise SystemExit(128 + signum)


class ClosedOnExit:
    """``with obj: ...`` returns ``obj`` and calls ``obj.close()`` when the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
