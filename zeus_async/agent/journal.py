"""The lease journal: what a GPU setting was before we changed it, on disk before the change.

Every process that changes hardware settings (a node agent, or a runtime sampling on a thread)
keeps one journal file in ``<private dir>/leases/``: ``<pid>-<id>.journal`` holds an entry per
setting it changed — GPU UUID, which setting, the value in force before the first change — and
``<pid>-<id>.lock`` is locked (``flock``) for as long as the process lives. The entry is
written and fsynced *before* the change is applied, so whatever happens next, the original
value is on disk:

* a lease released, a client gone, the process stopping: the owner restores the entry and
  writes its journal without it;
* the owner killed (SIGKILL, OOM) or the machine crashing mid-job: its lock file is no longer
  locked, so the next process that starts a runtime or an agent (or ``zeus-async agent
  --restore``) finds the journal *orphaned*, restores every entry, and deletes it.

The file (version 2) is append-only: every change of the list appends a *record*, the whole
list (a snapshot, with the owner's pid, backend and simulator configuration), framed as
``magic, length, CRC32, JSON``. An entry's original value is read once, when its lease is
taken, and every later snapshot carries that same value, so the last record that reads back
intact is the state to restore, and each entry is on disk as many times as the list was
written since it was taken. Damage is therefore recovered as far as the records allow: a
damaged record before the last intact one is superseded by it (nothing is lost); damaged bytes
after it (a cut, flipped bytes, garbage) may have held a lease taken later, which cannot be
restored and is reported, naming the GPUs and settings that can still be read in those bytes.
An append that crashes half way leaves every earlier record as it was. The first record is
written to a temporary file, fsynced, renamed and the directory fsynced (a journal never
exists empty); later records are appended and fsynced; past :data:`COMPACT_AT` bytes the file
is rewritten the same way as one record. Version 1 journals (one JSON document, ``.json``) are
still read.

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
import re
import socket
import struct
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

from .._paths import ensure_private_dir, private_dir

__all__ = [
    "COMPACT_AT",
    "Journal",
    "JournalDoc",
    "JournalRead",
    "LeaseEntry",
    "Setting",
    "journal_dir",
    "orphaned_journals",
    "read_journal",
]

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
    """A journal's content: a version 1 file, or one record of a version 2 file."""

    version: int = 1
    pid: int
    host: str
    backend: str
    #: The simulator's configuration (JSON) when ``backend`` is ``sim``: recovery must change
    #: the same simulated node.
    sim_config: str | None = None
    entries: list[LeaseEntry] = []
    #: The record's number in its file (version 2; for messages).
    seq: int = 0


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(JournalDoc)

#: Version 2 file name suffix (version 1: ``.json``).
SUFFIX = ".journal"
_SUFFIXES = (SUFFIX, ".json")
#: Start of every record: not ASCII, so neither JSON nor text reads as one.
_MAGIC = b"\xa7ZJ2"
#: ``magic, payload length, CRC32 of (length field + payload)``, little-endian.
_HEAD = struct.Struct("<4sII")
#: No record is this long; a length field saying so is damage.
_MAX_RECORD = 1 << 20
#: A journal longer than this is rewritten as one record at its next write.
COMPACT_AT = 64 * 1024
#: An entry's first fields as the encoder writes them, to name what damaged bytes held.
_ENTRY_RE = re.compile(
    rb'"uuid":"([A-Za-z0-9._:-]{1,200})","gpu":(\d{1,6}),"setting":"(power_limit|sm_clocks)"'
)


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


def encode_record(doc: JournalDoc) -> bytes:
    """One version 2 record holding ``doc``."""
    payload = _encoder.encode(doc)
    length = struct.pack("<I", len(payload))
    return _HEAD.pack(_MAGIC, len(payload), zlib.crc32(length + payload)) + payload


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_new(path: Path, data: bytes) -> None:
    """Make ``data`` the whole of ``path`` atomically and durably (temporary file, fsync,
    rename, directory fsync): a crash leaves the old file or the new one, never a mix."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _append(path: Path, data: bytes, size: int) -> None:
    """Append ``data`` durably; on failure cut the file back to ``size`` (best effort), so a
    half-written record does not stay as damage."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


class JournalRead(NamedTuple):
    """A journal file as far as it reads back.

    Attributes:
        path: The file.
        doc: The state to restore: the last intact record (version 2) or the document
            (version 1); ``None`` when nothing intact was found.
        pid: The owner's pid: the document's, else the one in the file name (``None``: unknown).
        lost: Damaged byte ranges ``(start, end)`` after the last intact record: they may have
            held leases taken later, which cannot be restored.
        superseded: Damaged byte ranges before the last intact record (it holds every lease
            then held: nothing is lost).
        named: ``(uuid, gpu, setting)`` of entries that can still be read in the ``lost``
            ranges (their original values cannot be trusted; for messages).
        error: Why the file could not be read at all (``OSError``), else empty.
    """

    path: Path
    doc: JournalDoc | None
    pid: int | None
    lost: list[tuple[int, int]] = []
    superseded: list[tuple[int, int]] = []
    named: list[tuple[str, int, Setting]] = []
    error: str = ""

    @property
    def damaged(self) -> bool:
        """Whether any byte of the file failed to read back (or the file could not be read)."""
        return bool(self.lost or self.superseded or self.error)


def _pid_from_name(path: Path) -> int | None:
    head = path.name.split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _named(data: bytes) -> list[tuple[str, int, Setting]]:
    out: list[tuple[str, int, Setting]] = []
    for m in _ENTRY_RE.finditer(data):
        setting: Setting = "power_limit" if m.group(3) == b"power_limit" else "sm_clocks"
        item = (m.group(1).decode("utf-8", "replace"), int(m.group(2)), setting)
        if item not in out:
            out.append(item)
    return out


def _parse_records(data: bytes) -> tuple[list[tuple[int, int, JournalDoc]], list[tuple[int, int]]]:
    """The intact records ``(start, end, doc)`` and the damaged ranges between them.

    A record is intact when its magic, length and CRC agree and its JSON decodes. After a bad
    byte the reader looks for the next magic, so one damaged record costs only itself."""
    records: list[tuple[int, int, JournalDoc]] = []
    bad: list[tuple[int, int]] = []
    bad_start: int | None = None
    pos, n = 0, len(data)
    while pos < n:
        doc: JournalDoc | None = None
        end = pos
        if data.startswith(_MAGIC, pos) and pos + _HEAD.size <= n:
            _, length, crc = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if length <= _MAX_RECORD and end <= n:
                payload = data[pos + _HEAD.size : end]
                if zlib.crc32(data[pos + 4 : pos + 8] + payload) == crc:
                    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                        doc = _decoder.decode(payload)
        if doc is not None:
            if bad_start is not None:
                bad.append((bad_start, pos))
                bad_start = None
            records.append((pos, end, doc))
            pos = end
            continue
        if bad_start is None:
            bad_start = pos
        found = data.find(_MAGIC, pos + 1)
        pos = n if found < 0 else found
    if bad_start is not None:
        bad.append((bad_start, n))
    return records, bad


def read_journal(path: Path) -> JournalRead | None:
    """The journal at ``path`` as far as it reads back; ``None`` when it is missing."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return JournalRead(path, None, _pid_from_name(path), error=str(exc))
    if path.suffix != SUFFIX:  # version 1: one JSON document, intact or not at all
        try:
            doc = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return JournalRead(
                path, None, _pid_from_name(path), lost=[(0, len(data))], named=_named(data)
            )
        return JournalRead(path, doc, doc.pid)
    if not data:  # a journal is never created empty
        return JournalRead(path, None, _pid_from_name(path), lost=[(0, 0)])
    records, bad = _parse_records(data)
    if not records:
        return JournalRead(path, None, _pid_from_name(path), lost=bad, named=_named(data))
    last_end = records[-1][1]
    lost = [r for r in bad if r[0] >= last_end]
    superseded = [r for r in bad if r[0] < last_end]
    doc = records[-1][2]
    held = {(e.uuid, e.setting) for e in doc.entries}
    named = [
        item
        for start, end in lost
        for item in _named(data[start:end])
        if (item[0], item[2]) not in held
    ]
    return JournalRead(path, doc, doc.pid, lost, superseded, named)


class Journal:
    """This process's journal: created on the first lease, locked while the process lives.

    Call :meth:`write` (under :func:`directory_lock`) with the full list of entries after every
    change of the list; :meth:`close` removes the files once nothing is left to restore.
    """

    def __init__(self, directory: Path, backend: str, sim_config: str | None) -> None:
        self.directory = directory
        stem = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = directory / f"{stem}{SUFFIX}"
        self.lock_path = directory / f"{stem}.lock"
        self._doc = JournalDoc(
            version=2,
            pid=os.getpid(),
            host=socket.gethostname(),
            backend=backend,
            sim_config=sim_config,
        )
        self._lock_fd: int | None = None
        self._size = 0  # bytes in the file (0: not created yet)

    def _ensure_locked(self) -> None:
        if self._lock_fd is not None:
            return
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: never contended
        os.set_inheritable(fd, False)
        self._lock_fd = fd

    def write(self, entries: list[LeaseEntry]) -> None:
        """Make ``entries`` the journal's content, durably, before the caller changes anything.

        Appends one record (the whole list); the first record, and the first past
        :data:`COMPACT_AT` bytes, replace the file instead."""
        self._ensure_locked()
        self._doc.entries = list(entries)
        self._doc.seq += 1
        record = encode_record(self._doc)
        if self._size == 0 or self._size + len(record) > COMPACT_AT:
            write_new(self.path, record)
            self._size = len(record)
        else:
            _append(self.path, record, self._size)
            self._size += len(record)

    def close(self) -> None:
        """Delete the journal (every entry restored) and drop the lock. Idempotent."""
        if self._lock_fd is None:
            return
        for path in (self.path, self.lock_path, self.path.with_suffix(".tmp")):
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


def _journal_paths(directory: Path) -> list[Path]:
    return sorted(p for suffix in _SUFFIXES for p in directory.glob(f"*{suffix}"))


def live_journals(directory: Path, *, exclude: Path | None = None) -> list[JournalDoc]:
    """Journals of processes still alive (call under :func:`directory_lock`)."""
    docs = []
    for path in _journal_paths(directory):
        if path == exclude or _is_orphan(path.with_suffix(".lock")):
            continue
        read = read_journal(path)
        if read is not None and read.damaged:
            logger.warning("the lease journal %s of live process %s is damaged", path, read.pid)
        if read is not None and read.doc is not None:
            docs.append(read.doc)
    return docs


def orphaned_journals(directory: Path) -> list[JournalRead]:
    """Journals whose owner is gone, as far as they read back (call under
    :func:`directory_lock`)."""
    reads = []
    for path in _journal_paths(directory):
        if _is_orphan(path.with_suffix(".lock")):
            read = read_journal(path)
            if read is not None:
                reads.append(read)
    return reads


def stray_locks(directory: Path) -> list[Path]:
    """Unheld lock files with no journal: left by a process that died before its first journal
    write reached the disk (nothing was changed then). Call under :func:`directory_lock`."""
    return [
        lock
        for lock in sorted(directory.glob("*.lock"))
        if lock.name != ".lock"
        and not any(lock.with_suffix(s).exists() for s in _SUFFIXES)
        and _is_orphan(lock)
    ]


def remove_journal(path: Path) -> None:
    """Delete an orphaned journal and its lock file."""
    for p in (path, path.with_suffix(".lock"), path.with_suffix(".tmp")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def keep_damaged(path: Path) -> Path:
    """Rename a damaged journal to ``<name>.damaged`` (kept for an operator to read, and no
    longer read as a journal), delete its lock file; the new path."""
    kept = path.with_name(path.name + ".damaged")
    if kept.exists():
        kept = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.damaged")
    os.replace(path, kept)
    _fsync_dir(path.parent)
    for p in (path.with_suffix(".lock"), path.with_suffix(".tmp")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return kept
