"""The lease journal: what a GPU setting was before we changed it, on disk before the change.

Every process that changes hardware settings (a node agent, or a runtime sampling on a thread)
keeps one journal file in ``<private dir>/leases/``: ``<pid>-<id>.json`` holds an entry per
setting it changed — GPU UUID, which setting, the value in force before the first change — and
``<pid>-<id>.lock`` is locked (``flock``) for as long as the process lives. The entry is
written and fsynced (file and directory) *before* the change is applied, so whatever happens
next, the original value is on disk:

* a lease released, a client gone, the process stopping: the owner restores the entry and
  rewrites its journal without it;
* the owner killed (SIGKILL, OOM) or the machine crashing mid-job: its lock file is no longer
  locked, so the next process that starts a runtime or an agent (or ``zeus-async agent
  --restore``) finds the journal *orphaned*, restores every entry, and deletes it.

A reboot clears the private directory when it is a tmpfs (``$XDG_RUNTIME_DIR``), and the driver
forgets its settings then too, so nothing is left to restore. Locked clocks cannot be read back
through NVML; their entry restores by resetting them (the driver's default).

All of this runs under one directory lock (``leases/.lock``), so a recovering process and a
process taking a new lease never interleave.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec

from .._paths import ensure_private_dir, private_dir

__all__ = ["Journal", "JournalDoc", "LeaseEntry", "Setting", "journal_dir", "orphaned_journals"]

logger = logging.getLogger(__name__)

Setting = Literal["power_limit", "sm_clocks"]


class LeaseEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One setting changed on one GPU, and what to put back.

    Attributes:
        uuid: The GPU's UUID (indices change with ``CUDA_VISIBLE_DEVICES``; UUIDs do not).
        gpu: Its index as the owner saw it (for messages).
        setting: ``power_limit`` or ``sm_clocks``.
        original_w: The power limit in force before the first change (``power_limit``).
        holder: Who holds the lease (a client id; empty for the owning process itself).
        pid: The holder's process id.
        source: What the holder said it was doing (``GlobalPowerLimitOptimizer: profiling``).
        t_ns: Wall time of the first change.
    """

    uuid: str
    gpu: int
    setting: Setting
    original_w: float | None = None
    holder: str = ""
    pid: int = 0
    source: str = ""
    t_ns: int = 0


class JournalDoc(msgspec.Struct, kw_only=True):
    """A journal file's content."""

    version: int = 1
    pid: int
    host: str
    backend: str
    #: The simulator's configuration (JSON) when ``backend`` is ``sim``: recovery must change
    #: the same simulated node.
    sim_config: str | None = None
    entries: list[LeaseEntry] = []


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(JournalDoc)


def journal_dir(base: Path | None = None) -> Path:
    """``<private dir>/leases``, created 0700 and checked."""
    return ensure_private_dir((base or private_dir()) / "leases")


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """Hold the lock that serializes lease changes and recovery on this node (blocking)."""
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_doc(path: Path, doc: JournalDoc) -> None:
    """Replace ``path`` with ``doc`` atomically and durably (temp file, fsync, rename, fsync)."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, _encoder.encode(doc))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_doc(path: Path) -> JournalDoc | None:
    """The journal at ``path``; ``None`` when it is missing or unreadable (logged)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("cannot read lease journal %s: %s", path, exc)
        return None
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        logger.warning("lease journal %s is damaged (%s); ignoring it", path, exc)
        return None


class Journal:
    """This process's journal: created on the first lease, locked while the process lives.

    Call :meth:`write` (under :func:`directory_lock`) with the full list of entries after every
    change of the list; :meth:`close` removes the files once nothing is left to restore.
    """

    def __init__(self, directory: Path, backend: str, sim_config: str | None) -> None:
        self.directory = directory
        stem = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = directory / f"{stem}.json"
        self.lock_path = directory / f"{stem}.lock"
        self._doc = JournalDoc(
            pid=os.getpid(), host=socket.gethostname(), backend=backend, sim_config=sim_config
        )
        self._lock_fd: int | None = None

    def _ensure_locked(self) -> None:
        if self._lock_fd is not None:
            return
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: never contended
        os.set_inheritable(fd, False)
        self._lock_fd = fd

    def write(self, entries: list[LeaseEntry]) -> None:
        """Make ``entries`` the journal's content, durably, before the caller changes anything."""
        self._ensure_locked()
        self._doc.entries = list(entries)
        write_doc(self.path, self._doc)

    def close(self) -> None:
        """Delete the journal (every entry restored) and drop the lock. Idempotent."""
        if self._lock_fd is None:
            return
        for path in (self.path, self.lock_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        os.close(self._lock_fd)
        self._lock_fd = None


def lock_held(lock_path: Path) -> bool:
    """Whether a live process holds ``lock_path`` (``flock``): try to lock it, and let go."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _is_orphan(lock_path: Path) -> bool:
    """Whether the owner of a journal died (nobody holds its lock file)."""
    return not lock_held(lock_path)


def live_journals(directory: Path, *, exclude: Path | None = None) -> list[JournalDoc]:
    """Journals of processes still alive (call under :func:`directory_lock`)."""
    docs = []
    for path in sorted(directory.glob("*.json")):
        if path == exclude or _is_orphan(path.with_suffix(".lock")):
            continue
        doc = read_doc(path)
        if doc is not None:
            docs.append(doc)
    return docs


def orphaned_journals(directory: Path) -> list[tuple[Path, JournalDoc | None]]:
    """Journals whose owner is gone (call under :func:`directory_lock`)."""
    return [
        (path, read_doc(path))
        for path in sorted(directory.glob("*.json"))
        if _is_orphan(path.with_suffix(".lock"))
    ]


def remove_journal(path: Path) -> None:
    """Delete an orphaned journal and its lock file."""
    for p in (path, path.with_suffix(".lock"), path.with_suffix(".tmp")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
