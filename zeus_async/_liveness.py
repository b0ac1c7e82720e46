"""Whether a process still runs, in a way a zombie or a reused pid cannot fool.

``psutil.pid_exists`` and ``psutil.Process(pid).create_time()`` are both true for a *zombie*: a
process that has exited but whose parent has not reaped it yet. A launcher that reads its
child's output to the end before it reaps it (``subprocess.run(..., capture_output=True)``,
many CI runners) leaves a SIGKILLed training process a zombie for as long as anything holds
the other end of its pipes, so an agent that waited for its owner's pid to vanish waited
forever, with the GPUs still capped.

:class:`ProcessWatch` follows one process:

* on Linux ≥ 5.3 through a *pidfd* (``os.pidfd_open``), which becomes readable the moment the
  process exits, zombie or not, and can never name a later process that reuses the pid;
* elsewhere (or when pidfds are unavailable) through ``/proc/<pid>/stat``: gone, state ``Z``
  (zombie) or ``X`` (dead), or a start time other than the one first seen (the pid was
  reused) all count as dead; and without ``/proc``, through psutil with its zombie status.

:func:`pid_alive` answers the same question once, for a pid that must have existed at a given
wall time (a lease's holder): a process that started after it is a reuse of the pid.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select

import psutil

__all__ = ["ProcessWatch", "pid_alive"]

logger = logging.getLogger(__name__)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time in clock ticks)`` from ``/proc/<pid>/stat``; ``None`` when the
    process is gone. Raises ``OSError`` when there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        if not os.path.isdir("/proc/self"):
            raise OSError("no /proc") from None
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ')'.
    rest = data[data.rindex(b")") + 2 :].split()
    return rest[0].decode(), int(rest[19])


def _psutil_alive(pid: int, create_time: float | None) -> bool:
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return False
        return create_time is None or proc.create_time() == create_time
    except psutil.Error:
        return False


class ProcessWatch:
    """Follows one process (see the module docstring); :meth:`alive` is cheap (one ``poll``
    of a pidfd, or one small ``/proc`` read).

    Args:
        pid: The process. If it is already gone (or a zombie) when the watch starts, the watch
            says dead at once.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._start: int | None = None
        self._create_time: float | None = None
        self._dead = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._dead = True
            return
        except (AttributeError, OSError):
            pass  # no pidfds (not Linux ≥ 5.3, or not permitted): /proc or psutil below
        if self._fd is not None:
            return
        try:
            stat = _proc_stat(pid)
        except OSError:
            try:
                self._create_time = psutil.Process(pid).create_time()
            except psutil.Error:
                self._dead = True
            return
        if stat is None or stat[0] in ("Z", "X"):
            self._dead = True
        else:
            self._start = stat[1]

    @property
    def fileno(self) -> int | None:
        """The pidfd (readable once the process exited), to poll with other descriptors;
        ``None`` when the watch reads ``/proc`` instead."""
        return self._fd

    def alive(self) -> bool:
        """Whether the process has not exited (a zombie has)."""
        if self._dead:
            return False
        if self._fd is not None:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            if poller.poll(0):
                self._dead = True
        elif self._start is not None:
            stat = _proc_stat(self.pid)
            if stat is None or stat[0] in ("Z", "X") or stat[1] != self._start:
                self._dead = True
        elif not _psutil_alive(self.pid, self._create_time):
            self._dead = True
        return not self._dead

    def close(self) -> None:
        """Release the pidfd. Idempotent."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
            self._dead = True

    def __del__(self) -> None:
        self.close()


def pid_alive(pid: int, *, existed_at_ns: int | None = None) -> bool:
    """Whether ``pid`` names a running process (not a zombie) — the same one that existed at
    wall time ``existed_at_ns`` when given (a process started later reuses the pid)."""
    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return False
        # A process started after ``existed_at_ns`` reuses the pid. create_time derives from
        # the boot time and clock ticks, so it can be off by a tick: one second of slack. A pid
        # reused within that second counts as alive, which costs the caller a bounded wait,
        # never a wrong restore.
        return existed_at_ns is None or proc.create_time() <= existed_at_ns / 1e9 + 1.0
    except psutil.Error:
        return False
