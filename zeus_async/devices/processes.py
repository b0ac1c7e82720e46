"""Host-side process readings (CPU time, memory) through psutil, behind a small protocol.

The process sampler (:mod:`zeus_async.runtime.processes`) asks a :class:`ProcessSource` for
machine-wide counters and for each tracked pid's counters; it differences them itself. Tests
substitute a scripted source (:class:`~zeus_async.testing.fakes.FakeProcessSource`), so the
arithmetic is checked against hand-computed values without ``/proc``.

:class:`PsutilSource` reads:

* per pid: user + system CPU seconds (``/proc/<pid>/stat``), RSS, and PSS/USS from
  ``/proc/<pid>/smaps_rollup`` (``memory_full_info``). When smaps is not readable (another
  user's process without privileges) PSS and USS are ``None`` and a log line says so once per
  pid; RSS is still read.
* machine-wide: busy CPU seconds over all CPUs (``/proc/stat``: everything but idle and
  iowait, as psutil's ``cpu_percent`` counts it), the number of logical CPUs, physical memory
  and memory in use (total minus available).
* descendants of a pid (``children(recursive=True)``), which scans every process of the
  machine; the sampler therefore refreshes the set only every few seconds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import psutil

__all__ = [
    "HostStat",
    "ProcessSource",
    "ProcessStat",
    "ProcfsSource",
    "PsutilSource",
    "default_source",
]

logger = logging.getLogger(__name__)


class ProcessStat(NamedTuple):
    """Counters of one process at one moment.

    Attributes:
        cpu_s: User + system CPU seconds since the process started (its children excluded).
        rss_bytes: Resident set size.
        pss_bytes: Proportional set size, or ``None`` when unreadable.
        uss_bytes: Unique set size, or ``None`` when unreadable.
    """

    cpu_s: float
    rss_bytes: int | None
    pss_bytes: int | None
    uss_bytes: int | None


class HostStat(NamedTuple):
    """Machine-wide counters at one moment.

    Attributes:
        cpu_busy_s: CPU seconds spent not idle, summed over every logical CPU, since boot.
        cpu_count: Logical CPUs.
        memory_total_bytes: Physical memory.
        memory_used_bytes: Memory in use (total minus available).
    """

    cpu_busy_s: float
    cpu_count: int
    memory_total_bytes: int
    memory_used_bytes: int


class ProcessSource(Protocol):
    """Where the process sampler gets host-side readings. Calls may block (they read /proc)."""

    def host(self) -> HostStat:
        """Machine-wide counters now."""
        ...

    def process(self, pid: int, smaps: bool = True) -> ProcessStat | None:
        """Counters of ``pid`` now, or ``None`` when it no longer exists.

        With ``smaps=False`` PSS and USS may be the values of the last ``smaps=True`` call
        (reading them makes the kernel walk the process's page tables, ~0.1 ms).
        """
        ...

    def descendants(self, pid: int) -> list[int]:
        """Pids of every live descendant of ``pid`` (``[]`` when it is gone)."""
        ...

    def forget(self, pids: Iterable[int]) -> None:
        """Drop any state kept for ``pids`` (they are no longer tracked)."""
        ...


class PsutilSource:
    """:class:`ProcessSource` over psutil (Linux gives PSS/USS; elsewhere they are ``None``)."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._no_smaps: set[int] = set()
        self._cpu_count = psutil.cpu_count() or 1

    def host(self) -> HostStat:
        times = psutil.cpu_times()
        idle = times.idle + getattr(times, "iowait", 0.0)
        total = sum(times)
        # ``guest`` time is already counted in ``user`` on Linux; psutil's sum includes both.
        total -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
        memory = psutil.virtual_memory()
        return HostStat(
            cpu_busy_s=max(total - idle, 0.0),
            cpu_count=self._cpu_count,
            memory_total_bytes=int(memory.total),
            memory_used_bytes=int(memory.total - memory.available),
        )

    def _proc(self, pid: int) -> psutil.Process | None:
        proc = self._procs.get(pid)
        if proc is None:
            try:
                proc = psutil.Process(pid)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                return None
            except psutil.AccessDenied:
                logger.warning("process %d: access denied; it is not sampled", pid)
                return None
            self._procs[pid] = proc
        return proc

    def process(self, pid: int, smaps: bool = True) -> ProcessStat | None:
        proc = self._proc(pid)
        if proc is None:
            return None
        try:
            with proc.oneshot():
                # A recycled pid is another process: psutil checks its creation time.
                if not proc.is_running():
                    self.forget((pid,))
                    return None
                times = proc.cpu_times()
                pss = uss = None
                if pid not in self._no_smaps:
                    try:
                        full = proc.memory_full_info()
                    except psutil.AccessDenied:
                        self._no_smaps.add(pid)
                        logger.info(
                            "process %d: /proc/%d/smaps_rollup is not readable; PSS and USS "
                            "are not sampled (RSS is)",
                            pid,
                            pid,
                        )
                    else:
                        pss = getattr(full, "pss", None)
                        uss = getattr(full, "uss", None)
                        return ProcessStat(times.user + times.system, int(full.rss), pss, uss)
                rss = int(proc.memory_info().rss)
                return ProcessStat(times.user + times.system, rss, pss, uss)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            self.forget((pid,))
            return None
        except psutil.AccessDenied:
            logger.warning("process %d: access denied; it is no longer sampled", pid)
            self.forget((pid,))
            return None

    def descendants(self, pid: int) -> list[int]:
        proc = self._proc(pid)
        if proc is None:
            return []
        try:
            return [child.pid for child in proc.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            return []

    def forget(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self._procs.pop(pid, None)
            self._no_smaps.discard(pid)


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _ProcFds:
    __slots__ = ("pss", "stat", "statm", "uss")

    def __init__(self, stat: int, statm: int) -> None:
        self.stat = stat
        self.statm = statm
        self.pss: int | None = None
        self.uss: int | None = None


class ProcfsSource(PsutilSource):
    """Linux fast path: reads ``/proc/<pid>/{stat,statm,smaps_rollup}`` directly.

    Same figures as :class:`PsutilSource` at a fraction of the cost: ``stat`` and ``statm``
    stay open and are re-read with ``pread`` (a descriptor keeps pointing at the process it was
    opened for, so a recycled pid reads as gone, never as another process), and
    ``smaps_rollup`` (the expensive one) is read only when asked (``smaps=True``). Machine-wide
    figures and descendants come from psutil.
    """

    def __init__(self, proc_root: str = "/proc") -> None:
        super().__init__()
        self._root = proc_root
        self._fds: dict[int, _ProcFds] = {}

    def _open(self, pid: int) -> _ProcFds | None:
        fds = self._fds.get(pid)
        if fds is not None:
            return fds
        base = f"{self._root}/{pid}"
        try:
            stat = os.open(f"{base}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            statm = os.open(f"{base}/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(stat)
            return None
        fds = self._fds[pid] = _ProcFds(stat, statm)
        return fds

    def process(self, pid: int, smaps: bool = True) -> ProcessStat | None:
        fds = self._open(pid)
        if fds is None:
            return None
        try:
            stat = os.pread(fds.stat, 4096, 0)
            statm = os.pread(fds.statm, 512, 0)
        except OSError:  # ESRCH: the process this descriptor belongs to has exited
            self.forget((pid,))
            return None
        fields = stat[stat.rfind(b")") + 2 :].split()
        if not fields or fields[0] in (b"Z", b"X"):  # a zombie has released its resources
            self.forget((pid,))
            return None
        cpu_s = (int(fields[11]) + int(fields[12])) / _CLK_TCK
        rss = int(statm.split()[1]) * _PAGE
        if smaps and pid not in self._no_smaps:
            self._read_smaps(pid, fds)
        return ProcessStat(cpu_s, rss, fds.pss, fds.uss)

    def _read_smaps(self, pid: int, fds: _ProcFds) -> None:
        try:
            with open(f"{self._root}/{pid}/smaps_rollup", "rb") as fh:
                data = fh.read()
        except PermissionError:
            self._no_smaps.add(pid)
            logger.info(
                "process %d: smaps_rollup is not readable; PSS and USS are not sampled (RSS is)",
                pid,
            )
            return
        except OSError:
            return
        pss = uss = 0
        found = False
        for line in data.splitlines():
            if line.startswith(b"Pss:"):
                pss = int(line.split()[1]) * 1024
                found = True
            elif line.startswith(b"Private_"):
                uss += int(line.split()[1]) * 1024
        if found:
            fds.pss, fds.uss = pss, uss

    def forget(self, pids: Iterable[int]) -> None:
        pids = list(pids)
        for pid in pids:
            fds = self._fds.pop(pid, None)
            if fds is not None:
                os.close(fds.stat)
                os.close(fds.statm)
        super().forget(pids)

    def close(self) -> None:
        """Close every descriptor kept open."""
        self.forget(list(self._fds))


def default_source() -> PsutilSource:
    """:class:`ProcfsSource` where ``/proc/self/smaps_rollup`` exists, else psutil."""
    if os.path.exists("/proc/self/smaps_rollup"):
        return ProcfsSource()
    return PsutilSource()
