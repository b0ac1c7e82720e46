"""Running cleanup at interpreter exit early enough that worker threads still run."""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

__all__ = ["call_at_exit"]

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
