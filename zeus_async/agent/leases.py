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
from typing import Any, NamedTuple, Protocol

from ..errors import LeaseConflictError
from .journal import (
    Journal,
    LeaseEntry,
    Setting,
    directory_lock,
    journal_dir,
    live_journals,
    orphaned_journals,
    remove_journal,
)

__all__ = ["Leases", "Restored", "describe_holder", "recover_orphans"]

logger = logging.getLogger(__name__)


class _Settable(Protocol):
    """What restoring needs of a GPU (an NVML GPU, or a simulated one)."""

    def set_power_limit_w(self, watts: float) -> None: ...

    def reset_sm_clocks(self) -> None: ...


class Restored(NamedTuple):
    """One entry put back: which, and whether it worked (``error`` empty when it did)."""

    entry: LeaseEntry
    error: str = ""


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
        with directory_lock(self.directory):
            exclude = self._journal.path if self._journal is not None else None
            for doc in live_journals(self.directory, exclude=exclude):
                for other in doc.entries:
                    if other.uuid == uuid and other.setting == setting:
                        raise LeaseConflictError(
                            f"gpu:{gpu}'s {_WHAT[setting]} is held by "
                            f"{describe_holder(other)} through process {doc.pid}; it must "
                            "release it (or exit) before another process changes it"
                        )
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
            if self._journal is None:
                self._journal = Journal(self.directory, self._backend, self._sim_config)
            self._journal.write([*self._entries.values(), entry])
            self._entries[key] = entry
        return True

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
    from ..devices.sim import SimNode
    from ..devices.sim_config import SimConfig, load_sim_config

    config = load_sim_config(sim_config) if sim_config else SimConfig()
    node = SimNode(config)
    return {g.uuid: g for g in node.gpus}


def _nvml_gpus() -> tuple[dict[str, _Settable], Callable[[], None]]:
    from ..devices.nvml import open_nvml_gpus

    gpus = open_nvml_gpus(env={})  # every GPU of the node, whatever CUDA_VISIBLE_DEVICES says

    def close() -> None:
        for gpu in gpus:
            gpu.close()

    return {g.describe().uuid: g for g in gpus}, close


def recover_orphans(directory: Path | None = None) -> list[Restored]:
    """Restore every setting journalled by a process that died without restoring it.

    Runs at every runtime's and agent's start (a directory listing when nothing is orphaned),
    and as ``zeus-async agent --restore``. A journal whose entries could not all be restored
    is kept for the next try; the others are deleted.
    """
    directory = directory or journal_dir()
    restored: list[Restored] = []
    with directory_lock(directory):
        for path, doc in orphaned_journals(directory):
            if doc is None:
                remove_journal(path)
                continue
            if not doc.entries:
                remove_journal(path)
                continue
            failed = _restore_doc(doc, restored)
            if failed:
                logger.error(
                    "%d setting(s) of dead process %d could not be restored; kept in %s",
                    failed,
                    doc.pid,
                    path,
                )
            else:
                remove_journal(path)
    return restored


def _restore_doc(doc: Any, restored: list[Restored]) -> int:
    close: Callable[[], None] = lambda: None  # noqa: E731
    try:
        if doc.backend == "sim":
            gpus = _sim_gpus(doc.sim_config)
        else:
            gpus, close = _nvml_gpus()
    except Exception as exc:
        logger.error("cannot open the GPUs of dead process %d to restore them: %s", doc.pid, exc)
        restored.extend(Restored(e, str(exc)) for e in doc.entries)
        return len(doc.entries)
    failed = 0
    try:
        for entry in doc.entries:
            gpu = gpus.get(entry.uuid)
            if gpu is None:
                restored.append(Restored(entry, "no GPU with this UUID on this node"))
                logger.warning("cannot restore %s: GPU %s not found", entry.setting, entry.uuid)
                continue
            try:
                restore_entry(gpu, entry)
            except Exception as exc:
                failed += 1
                restored.append(Restored(entry, str(exc)))
                logger.error("restoring %s of %s failed: %s", entry.setting, entry.uuid, exc)
            else:
                restored.append(Restored(entry))
                logger.warning(
                    "restored gpu %s's %s left by dead process %d (%s)",
                    entry.uuid,
                    _WHAT[entry.setting],
                    doc.pid,
                    f"to {entry.original_w:g} W" if entry.original_w is not None else "reset",
                )
    finally:
        close()
    return failed
