"""Small, failure-tolerant readers of ``/proc/<pid>/...`` under an injectable root.

The workload sources (:mod:`.slurm`, :mod:`.workloads`) ask about processes that may exit at
any moment, or belong to another user: every reader returns ``None`` instead of raising when
the file is gone (the process exited), unreadable (``environ`` of another user's process) or
malformed, so a caller never has to tell those apart. The root is a parameter so tests can
build fake ``/proc`` trees.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "parse_environ",
    "read_cgroup",
    "read_comm",
    "read_environ",
    "read_start_ticks",
    "read_uid",
]

logger = logging.getLogger(__name__)


def _read_bytes(proc_root: Path, pid: int, name: str, *, whole: bool = True) -> bytes | None:
    # os.open/os.read, not open(): half the cost, and refresh() reads one file per process.
    # ``whole=False``: one read of 4 KiB, for a file known to be shorter (``stat``: ~300 bytes).
    try:
        fd = os.open(f"{proc_root}/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # gone (ENOENT, ESRCH), another user's (EACCES, EPERM), anything else
        return None
    try:
        if not whole:
            return os.read(fd, 4096)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:  # the process exited while read (ESRCH)
        return None
    finally:
        os.close(fd)


def read_cgroup(proc_root: Path, pid: int) -> list[str] | None:
    """The cgroup path of each hierarchy ``pid`` belongs to (the third field of each line of
    ``/proc/<pid>/cgroup``: ``5:devices:/slurm/uid_1001/job_4711/step_0`` gives
    ``/slurm/uid_1001/job_4711/step_0``), or ``None`` when unreadable."""
    data = _read_bytes(proc_root, pid, "cgroup")
    if data is None:
        return None
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append(parts[2])
    return out


def read_environ(proc_root: Path, pid: int) -> bytes | None:
    """``pid``'s initial environment as the kernel shows it (``NAME=value`` entries, each
    ended by a NUL), or ``None`` when unreadable (another user's process without privileges,
    or gone).

    Empty for a process that has no environment (``env -i``), a zombie, and, for a moment, a
    process in the middle of ``execve``: its new command name is set, and the parent's
    ``subprocess.Popen`` has returned, before the kernel has laid out its new environment.
    """
    return _read_bytes(proc_root, pid, "environ")


def parse_environ(data: bytes, prefixes: Iterable[str]) -> dict[str, str]:
    """The variables of ``data`` (from :func:`read_environ`) whose names start with one of
    ``prefixes`` (only those: an environment can be large, and only a few names matter)."""
    wanted = tuple(p.encode() for p in prefixes)
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        if item.startswith(wanted):
            name, sep, value = item.partition(b"=")
            if sep:
                out[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


def read_start_ticks(proc_root: Path, pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``):
    with the pid, it names one process for good, whereas a pid alone is reused."""
    data = _read_bytes(proc_root, pid, "stat", whole=False)
    if data is None:
        return None
    # The command (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def read_uid(proc_root: Path, pid: int) -> int | None:
    """The real uid of ``pid`` (the first value of the ``Uid:`` line of its ``status``)."""
    data = _read_bytes(proc_root, pid, "status")
    if data is None:
        return None
    for line in data.splitlines():
        if line.startswith(b"Uid:"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def read_comm(proc_root: Path, pid: int) -> str | None:
    """The command name of ``pid`` (``/proc/<pid>/comm``: at most 15 characters)."""
    data = _read_bytes(proc_root, pid, "comm")
    if data is None:
        return None
    return data.decode("utf-8", "replace").rstrip("\n") or None
