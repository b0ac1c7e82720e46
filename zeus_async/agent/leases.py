"""Leases on GPU settings: one holder per setting per GPU, journalled, restored on release.

A runtime changes a power limit or locks clocks only through :class:`Leases`. The first change
of a setting on a GPU by a holder takes a lease: the value in force is read, journalled and
fsynced (:mod:`.journal`), and only then is the change applied. Later changes by the same holder
reuse the lease. A different holder — another client of the same agent, or another process
with a journal of its own — gets a :class:`~zeus_async.errors.LeaseConflictError` naming who
holds it. Releasing a lease (explicitly, the holder gone, the runtime stopping) restores the
journalled value. :func:`recover_orphans` restores what a killed process left behind.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple, Protocol

import msgspec

from .._liveness import pid_alive
from ..devices import is_simulated
from ..errors import JournalError, LeaseConflictError
from .journal import (
    SUFFIX,
    Journal,
    JournalDoc,
    JournalRead,
    LeaseEntry,
    Setting,
    directory_lock,
    encode_record,
    journal_dir,
    keep_damaged,
    live_journals,
    orphaned_journals,
    remove_journal,
    stray_locks,
    write_new,
)

__all__ = [
    "Leases",
    "Lost",
    "Recovery",
    "Restored",
    "describe_holder",
    "recover_after",
    "recover_orphans",
]

logger = logging.getLogger(__name__)


class _Settable(Protocol):
    """What restoring needs of a GPU (an NVML GPU, or a simulated one)."""

    def set_power_limit_w(self, watts: float) -> None: ...

    def reset_sm_clocks(self) -> None: ...


class Restored(NamedTuple):
    """One entry put back: which, and whether it worked (``error`` empty when it did)."""

    entry: LeaseEntry
    error: str = ""
    #: The dead process whose journal held the entry.
    owner_pid: int = 0

    def describe(self) -> str:
        """``gpu:0 (GPU-…) power limit, left by process 4242: restored to 300 W``."""
        e = self.entry
        if self.error:
            outcome = f"NOT restored: {self.error}"
        elif e.setting == "power_limit" and e.original_w is not None:
            outcome = f"restored to {e.original_w:g} W"
        else:
            outcome = "restored" if e.setting == "power_limit" else "reset"
        return (
            f"gpu:{e.gpu} ({e.uuid}) {_WHAT[e.setting]}, left by process {self.owner_pid}: "
            f"{outcome}"
        )


class Lost(NamedTuple):
    """Something a dead process may have changed that cannot be restored: the bytes of its
    journal that held the original value are damaged.

    Attributes:
        journal: The damaged journal as kept for an operator (``<name>.damaged``).
        owner_pid: The dead process (``None``: unknown).
        uuid: The GPU, when the damaged bytes still name it (``None``: unreadable).
        gpu: Its index as the owner saw it.
        setting: Which setting.
        detail: Which bytes are damaged (or why the file could not be read).
    """

    journal: Path
    owner_pid: int | None
    uuid: str | None = None
    gpu: int | None = None
    setting: Setting | None = None
    detail: str = ""

    def describe(self) -> str:
        owner = "an unknown process" if self.owner_pid is None else f"process {self.owner_pid}"
        if self.uuid is None or self.setting is None:
            return (
                f"the lease journal of {owner} is unreadable ({self.detail}): whatever it "
                f"held there is unknown; kept as {self.journal}"
            )
        return (
            f"gpu:{self.gpu} ({self.uuid}) {_WHAT[self.setting]}, changed by {owner}: its "
            f"original value is in damaged bytes ({self.detail}) of {self.journal}"
        )


class Recovery(NamedTuple):
    """What :func:`recover_orphans` did.

    Attributes:
        restored: Every entry an intact journal record held, restored or not (``error``).
        lost: What damaged journals may have held and cannot be restored.
        kept: Damaged journals, renamed ``<name>.damaged`` for an operator.
    """

    restored: list[Restored]
    lost: list[Lost]
    kept: list[Path]

    @property
    def failed(self) -> list[Restored]:
        """Entries whose restore failed."""
        return [r for r in self.restored if r.error]

    @property
    def complete(self) -> bool:
        """Whether every setting dead processes left changed is back."""
        return not self.lost and not self.failed


#: How long taking a lease waits for one whose holder has exited to be restored and released
#: by the process that holds it (its agent notices within a fraction of a second).
DEAD_HOLDER_WAIT_S = 10.0

_WHAT = {"power_limit": "power limit", "sm_clocks": "locked SM clocks"}


def describe_holder(entry: LeaseEntry) -> str:
    """``client 'rank1' (pid 4242, GlobalPowerLimitOptimizer: profiling)``."""
    who = f"client {entry.holder!r}" if entry.holder else "a process"
    extra = f"pid {entry.pid}" + (f", {entry.source}" if entry.source else "")
    return f"{who} ({extra})"


def restore_entry(gpu: _Settable, entry: LeaseEntry) -> None:
    """Put ``entry``'s setting back on ``gpu`` (blocking NVML calls)."""
    if entry.setting == "power_limit":
        if entry.original_w is not None:
            gpu.set_power_limit_w(entry.original_w)
    else:
        gpu.reset_sm_clocks()


class Leases:
    """The leases one process holds, with their journal.

    Blocking: every method may read NVML or fsync a file; the runtime calls them on a worker
    thread. Not thread-safe on its own (the runtime serializes hardware changes).

    Args:
        backend: The GPU backend (``nvml`` or ``sim``), written into the journal.
        sim_config: The simulator configuration as JSON (``sim`` backend).
        directory: The journal directory (default ``<private dir>/leases``).
    """

    def __init__(
        self, backend: str, sim_config: str | None = None, directory: Path | None = None
    ) -> None:
        self._directory = directory
        self._backend = backend
        self._sim_config = sim_config
        self._journal: Journal | None = None
        self._entries: dict[tuple[str, Setting], LeaseEntry] = {}

    @property
    def directory(self) -> Path:
        if self._directory is None:
            self._directory = journal_dir()
        return self._directory

    @property
    def entries(self) -> list[LeaseEntry]:
        """Leases held now."""
        return list(self._entries.values())

    def holders(self) -> set[str]:
        return {e.holder for e in self._entries.values()}

    def take(
        self,
        *,
        uuid: str,
        gpu: int,
        setting: Setting,
        holder: str,
        read_original: Callable[[], float | None],
        pid: int | None = None,
        source: str = "",
    ) -> bool:
        """Make sure ``holder`` holds ``setting`` on GPU ``uuid``; journal it if new.

        Returns ``True`` when the lease is new (the journal was written and fsynced).

        Raises:
            LeaseConflictError: Another holder (here or in another process) holds it.
        """
        key = (uuid, setting)
        held = self._entries.get(key)
        if held is not None:
            if held.holder != holder:
                raise LeaseConflictError(
                    f"gpu:{gpu}'s {_WHAT[setting]} is held by {describe_holder(held)}; it "
                    "must release it (or exit) before another client changes it"
                )
            return False
        # What a process killed since this one started left changed is put back first, so the
        # value journalled below is the one before anybody's change.
        recover_orphans(self.directory)
        deadline = time.monotonic() + DEAD_HOLDER_WAIT_S
        while True:
            with directory_lock(self.directory):
                blocker = self._blocker(uuid, setting)
                if blocker is None:
                    entry = LeaseEntry(
                        uuid=uuid,
                        gpu=gpu,
                        setting=setting,
                        original_w=read_original(),
                        holder=holder,
                        pid=os.getpid() if pid is None else pid,
                        source=source,
                        t_ns=time.time_ns(),
                    )
                    self._journal_write([*self._entries.values(), entry], gpu, setting)
                    self._entries[key] = entry
                    return True
                other, owner = blocker
                where = f"{describe_holder(other)} through process {owner}"
                if pid_alive(other.pid, existed_at_ns=other.t_ns):
                    raise LeaseConflictError(
                        f"gpu:{gpu}'s {_WHAT[setting]} is held by {where}; it must release it "
                        "(or exit) before another process changes it"
                    )
            # Its holder has exited (a restarted job meets its killed predecessor): the
            # process that holds the lease for it restores and releases it within moments.
            if time.monotonic() >= deadline:
                raise LeaseConflictError(
                    f"gpu:{gpu}'s {_WHAT[setting]} is still held by {where}, although that "
                    f"client exited more than {DEAD_HOLDER_WAIT_S:g} s ago; process {owner} "
                    "should have restored it (is it stuck? `zeus-async agent --restore` "
                    "restores once it is gone)"
                )
            time.sleep(0.02)

    def _journal_write(self, entries: list[LeaseEntry], gpu: int, setting: Setting) -> None:
        """Journal ``entries`` before the change of ``setting`` on ``gpu`` is applied.

        Raises:
            JournalError: The journal could not be written (the change must not happen).
        """
        fresh = self._journal is None
        if self._journal is None:
            self._journal = Journal(self.directory, self._backend, self._sim_config)
        try:
            self._journal.write(entries)
        except OSError as exc:
            if fresh:  # nothing of ours in it yet: leave no empty journal behind
                self._journal.close()
                self._journal = None
            raise JournalError(
                f"gpu:{gpu}'s {_WHAT[setting]} left unchanged: the value to restore could not "
                f"be journalled first ({exc.filename or self.directory}: "
                f"{exc.strerror or exc}); free space there, or set ZEUS_ASYNC_DIR to a "
                "writable directory on a tmpfs"
            ) from exc

    def _blocker(self, uuid: str, setting: Setting) -> tuple[LeaseEntry, int] | None:
        """Another live process's lease on this setting, and that process (call under the
        directory lock)."""
        exclude = self._journal.path if self._journal is not None else None
        for doc in live_journals(self.directory, exclude=exclude):
            for other in doc.entries:
                if other.uuid == uuid and other.setting == setting:
                    return other, doc.pid
        return None

    def held_by(
        self,
        holder: str | None = None,
        uuids: Iterable[str] | None = None,
        settings: Iterable[Setting] | None = None,
    ) -> list[LeaseEntry]:
        """Leases matching the filters (``None`` = any)."""
        wanted_uuids = None if uuids is None else set(uuids)
        wanted_settings = None if settings is None else set(settings)
        return [
            e
            for e in self._entries.values()
            if (holder is None or e.holder == holder)
            and (wanted_uuids is None or e.uuid in wanted_uuids)
            and (wanted_settings is None or e.setting in wanted_settings)
        ]

    def forget(self, entries: Iterable[LeaseEntry]) -> None:
        """Drop ``entries`` (restored, or the setting reset by its holder) from the journal."""
        removed = False
        for entry in entries:
            if self._entries.pop((entry.uuid, entry.setting), None) is not None:
                removed = True
        if not removed or self._journal is None:
            return
        with directory_lock(self.directory):
            if self._entries:
                self._journal.write(list(self._entries.values()))
            else:
                self._journal.close()
                self._journal = None

    def close(self) -> None:
        """Drop the journal's lock without deleting it: what is left there will be restored by
        the next process to start (call after a failed restore)."""
        if self._journal is not None and self._entries:
            logger.error(
                "%d hardware setting(s) could not be restored; they stay in %s for the next "
                "agent start (or `zeus-async agent --restore`)",
                len(self._entries),
                self._journal.path,
            )
        self._journal = None


def _sim_gpus(sim_config: str | None) -> dict[str, _Settable]:
    """The simulated node's GPUs by UUID, whichever vendor's API served them (one node-wide
    state beneath every simulated API)."""
    from ..devices.sim import SimNode
    from ..devices.sim_config import SimConfig, load_sim_config

    config = load_sim_config(sim_config) if sim_config else SimConfig()
    node = SimNode(config)
    gpus: dict[str, _Settable] = {g.uuid: g for g in node.gpus}
    # sim_amdsmi shows the same GPU's UUID without NVIDIA's "GPU-" prefix, as amdsmi does.
    gpus.update({g.uuid.removeprefix("GPU-"): g for g in node.gpus})
    return gpus


def _nvml_gpus() -> tuple[dict[str, _Settable], Callable[[], None]]:
    from ..devices.nvml import open_nvml_gpus

    gpus = open_nvml_gpus(env={})  # every GPU of the node, whatever CUDA_VISIBLE_DEVICES says

    def close() -> None:
        for gpu in gpus:
            gpu.close()

    return {g.describe().uuid: g for g in gpus}, close


def _amd_gpus() -> tuple[dict[str, _Settable], Callable[[], None]]:
    from ..devices.amd import open_amd_gpus

    gpus = open_amd_gpus(env={})  # every GPU of the node, whatever *_VISIBLE_DEVICES say

    def close() -> None:
        for gpu in gpus:
            gpu.close()

    return {g.describe().uuid: g for g in gpus}, close  # type: ignore[misc]


def _real_gpus(backend: str) -> tuple[dict[str, _Settable], Callable[[], None]]:
    """The GPUs of a real backend (``nvml``, ``amd``, or a mixed ``nvml+amd``) by UUID."""
    gpus: dict[str, _Settable] = {}
    closers: list[Callable[[], None]] = []

    def close() -> None:
        for c in closers:
            c()

    try:
        for part in backend.split("+") or ["nvml"]:
            found, closer = _amd_gpus() if part == "amd" else _nvml_gpus()
            closers.append(closer)
            gpus.update(found)
    except BaseException:
        close()
        raise
    return gpus, close


class _Note(msgspec.Struct, kw_only=True):
    """What became of a dead process's journal (``<stem>.recovered``, kept :data:`NOTE_TTL_S`):
    so that a client of a dead agent that finds its journal already gone can say who restored
    it and how it went, instead of guessing."""

    owner_pid: int
    by_pid: int
    t_ns: int
    restored: int
    failed: int
    lost: int


#: How long a ``.recovered`` note is kept (s).
NOTE_TTL_S = 600.0

_note_decoder = msgspec.json.Decoder(_Note)


def _notes(directory: Path) -> list[tuple[Path, _Note | None]]:
    out: list[tuple[Path, _Note | None]] = []
    for path in sorted(directory.glob("*.recovered")):
        try:
            out.append((path, _note_decoder.decode(path.read_bytes())))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            out.append((path, None))
    return out


def _prune_notes(directory: Path) -> None:
    oldest = time.time_ns() - int(NOTE_TTL_S * 1e9)
    for path, note in _notes(directory):
        if note is None or note.t_ns < oldest:
            path.unlink(missing_ok=True)


def _write_note(read: JournalRead, restored: list[Restored], lost: list[Lost]) -> None:
    if read.pid is None:
        return
    failed = sum(1 for r in restored if r.error)
    note = _Note(
        owner_pid=read.pid,
        by_pid=os.getpid(),
        t_ns=time.time_ns(),
        restored=len(restored) - failed,
        failed=failed,
        lost=len(lost),
    )
    try:
        write_new(read.path.with_name(read.path.name + ".recovered"), msgspec.json.encode(note))
    except OSError as exc:  # a note only serves messages
        logger.warning("cannot write a recovery note next to %s: %s", read.path, exc)


def _lost(read: JournalRead, kept: Path) -> list[Lost]:
    """What ``read``'s damaged bytes may have held (nothing when only superseded records were
    damaged)."""
    if not read.lost and not read.error:
        return []
    detail = read.error or ", ".join(
        f"bytes {a}-{b} unreadable" if b > a else "the file is empty" for a, b in read.lost
    )
    if not read.named:
        return [Lost(kept, read.pid, detail=detail)]
    return [Lost(kept, read.pid, u, g, s, detail) for u, g, s in read.named]


def recover_orphans(directory: Path | None = None) -> Recovery:
    """Restore every setting journalled by a process that died without restoring it.

    Runs at every runtime's and agent's start (a directory listing when nothing is orphaned),
    and as ``zeus-async agent --restore``. A journal whose entries could not all be restored
    is kept for the next try; the others are deleted. A damaged journal is restored as far as
    its intact records go (:func:`~.journal.read_journal`); what they cannot tell is logged as
    an error and returned in :attr:`Recovery.lost`, and the file is renamed ``.damaged`` (not
    deleted: an operator may want to read it; not kept: it would be read again forever).
    """
    directory = directory or journal_dir()
    restored: list[Restored] = []
    lost: list[Lost] = []
    kept: list[Path] = []
    with directory_lock(directory):
        for lock in stray_locks(directory):
            remove_journal(lock.with_suffix(SUFFIX))
        _prune_notes(directory)
        for read in orphaned_journals(directory):
            doc = read.doc
            mine: list[Restored] = []
            retry = _restore_doc(doc, mine, read.pid or 0) if doc and doc.entries else []
            restored.extend(mine)
            gone: list[Lost] = []
            if read.damaged:
                path = read.path
                try:
                    path = keep_damaged(read.path)
                except OSError as exc:
                    logger.error("cannot rename the damaged journal %s: %s", read.path, exc)
                kept.append(path)
                gone = _lost(read, path)
                lost.extend(gone)
                _log_damage(read, path, gone, sum(1 for r in mine if not r.error))
                if retry and doc is not None and path != read.path:  # what failed, cleanly
                    again = JournalDoc(
                        version=2,
                        pid=doc.pid,
                        host=doc.host,
                        backend=doc.backend,
                        sim_config=doc.sim_config,
                        entries=retry,
                        seq=1,
                    )
                    write_new(read.path.with_suffix(SUFFIX), encode_record(again))
            if retry:
                logger.error(
                    "%d setting(s) of dead process %s could not be restored; kept in %s for "
                    "the next try",
                    len(retry),
                    read.pid,
                    read.path.with_suffix(SUFFIX) if read.damaged else read.path,
                )
            elif not read.damaged:
                remove_journal(read.path)
            if mine or read.damaged:
                _write_note(read, mine, gone)
    return Recovery(restored, lost, kept)


def _log_damage(read: JournalRead, kept: Path, gone: list[Lost], restored: int) -> None:
    owner = "an unknown process" if read.pid is None else f"dead process {read.pid}"
    if not gone:
        logger.warning(
            "the lease journal %s of %s was damaged (%s) before its last intact record, which "
            "holds every lease it had: its %d setting(s) were restored from it; kept as %s",
            read.path,
            owner,
            ", ".join(f"bytes {a}-{b}" for a, b in read.superseded),
            restored,
            kept,
        )
        return
    logger.error(
        "the lease journal %s of %s is damaged: %d setting(s) restored from its intact "
        "records; NOT restored: %s; kept as %s",
        read.path,
        owner,
        restored,
        "; ".join(lost.describe() for lost in gone),
        kept,
    )


def recover_after(owner_pid: int, directory: Path | None = None) -> str:
    """Restore what dead processes left changed now, and say in one clause what became of the
    settings ``owner_pid`` held (a client of a dead agent calls this; several clients race,
    and the first to take the directory lock restores).

    Never claims a restore that did not happen: ``the 3 setting(s) it held were restored from
    its journal``, ``1 of the 2 setting(s) it held were restored ...; NOT restored: ...``,
    ``process 4242 restored the 3 setting(s) it held ...``, ``it held no hardware settings``.
    """
    directory = directory or journal_dir()
    recovery = recover_orphans(directory)
    mine = [r for r in recovery.restored if r.owner_pid == owner_pid]
    gone = [lost for lost in recovery.lost if lost.owner_pid == owner_pid]
    if mine or gone:
        bad = [r.describe() for r in mine if r.error] + [lost.describe() for lost in gone]
        done = sum(1 for r in mine if not r.error)
        if not bad:
            return f"the {done} setting(s) it held were restored from its journal"
        return (
            f"{done} setting(s) it held were restored from its journal; NOT restored: "
            + "; ".join(bad)
        )
    notes = [n for _, n in _notes(directory) if n is not None and n.owner_pid == owner_pid]
    if notes:
        note = max(notes, key=lambda n: n.t_ns)
        text = f"process {note.by_pid} restored the {note.restored} setting(s) it held"
        if note.failed or note.lost:
            text += (
                f", but {note.failed + note.lost} could not be restored or recovered (see "
                f"process {note.by_pid}'s log, or run `zeus-async agent --restore`)"
            )
        return text
    return "it held no hardware settings (it left no journal)"


def _restore_doc(doc: JournalDoc, restored: list[Restored], owner: int) -> list[LeaseEntry]:
    """Restore ``doc``'s entries into ``restored``; the entries to try again later."""
    close: Callable[[], None] = lambda: None  # noqa: E731
    try:
        if is_simulated(doc.backend):
            gpus = _sim_gpus(doc.sim_config)
        else:
            gpus, close = _real_gpus(doc.backend)
    except Exception as exc:
        logger.error("cannot open the GPUs of dead process %d to restore them: %s", owner, exc)
        restored.extend(Restored(e, str(exc), owner) for e in doc.entries)
        return list(doc.entries)
    retry: list[LeaseEntry] = []
    try:
        for entry in doc.entries:
            gpu = gpus.get(entry.uuid)
            if gpu is None:
                restored.append(Restored(entry, "no GPU with this UUID on this node", owner))
                logger.warning("cannot restore %s: GPU %s not found", entry.setting, entry.uuid)
                continue
            try:
                restore_entry(gpu, entry)
            except Exception as exc:
                retry.append(entry)
                restored.append(Restored(entry, str(exc), owner))
                logger.error("restoring %s of %s failed: %s", entry.setting, entry.uuid, exc)
            else:
                restored.append(Restored(entry, "", owner))
                logger.warning(
                    "restored gpu %s's %s left by dead process %d (%s)",
                    entry.uuid,
                    _WHAT[entry.setting],
                    owner,
                    f"to {entry.original_w:g} W" if entry.original_w is not None else "reset",
                )
    finally:
        close()
    return retry
