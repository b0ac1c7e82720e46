"""The power board: each device's latest readings in shared memory, for provisional figures.

A window's exact energy needs the energy counter's first update after the window's end (about
0.1 s later on recent NVIDIA GPUs), so it cannot be known when the window closes. What can be
known at once is what the power readings say. The process that samples (a private or node
agent, or the runtime's thread) writes every power reading of every device onto a
:class:`PowerBoard`: per device, a ring of ``(t_ns, cumulative J, W)`` points (the running
trapezoid integral of the readings, or the counter itself for RAPL) in a memory map, plus a
coarse ring of one point a second for long windows. The process that closes a window reads the
board (:class:`BoardReader`) — no message, no wait, a few microseconds — and computes the
window's provisional energy from it: interpolated between readings, extrapolated at the last
reading's power past it. :class:`~zeus_async.aggregate.windows.WindowResult` returns that figure
until the exact, counter-based one arrives.

Each ring entry carries its sequence number before and after its data; the writer stores the
first, then the data, then the second, so a reader that finds both equal to the number it
expects read a complete entry (a torn read is retried). The header is written once, before any
reader can know the file.

A board shared through a file (the agent's, ``<private dir>/board-<pid>-<random>``) has its
whole size allocated when it is created (``posix_fallocate``): a sparse file would fail only
when a page is first written, and on a full file system that failure is a SIGBUS that kills
the sampler. Allocated up front, a full or read-only directory is an ``OSError`` at creation,
and the agent goes on without a board (its clients then get the exact figures only). The
file never grows after that. (On a copy-on-write file system, btrfs, every rewrite needs a new
block whatever was allocated: there a full disk blocks the writer; docs/agent.md says to keep
the private directory on a tmpfs.) Its writer holds an ``flock`` on it while it lives and removes it
when it closes; a board left by a process that died (killed, crashed) is removed by the next
board created in the same directory (:func:`sweep_stale_boards`).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import mmap
import os
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from ..events import Measurement
from .history import LATE_FACTOR, EnergyEstimate, window_measurement

__all__ = [
    "BoardReader",
    "ClosedWindow",
    "PowerBoard",
    "provisional_measurement",
    "sweep_stale_boards",
]

logger = logging.getLogger(__name__)

_MAGIC = b"ZABOARD1"
_HEADER = struct.Struct("<8sqqqq")  # magic, slots, fine ring, coarse ring, coarse step (ns)
_KEY = struct.Struct("<24s")
_HEAD = struct.Struct("<qqq")  # entries written (fine ring, coarse ring), typical interval (ns)
_SEQ = struct.Struct("<q")
_DATA = struct.Struct("<qdd")  # t_ns, cumulative J, W
_ENTRY = struct.Struct("<qqddq")  # seq, t_ns, cumulative J, W, seq
#: Ring lengths: 256 readings (2.56 s at 10 ms), and one point a second for 2.3 hours.
_FINE, _COARSE, _COARSE_STEP_NS = 256, 8192, 1_000_000_000
#: Entries a reader leaves alone at the old end of a ring: the writer may be overwriting them.
_MARGIN = 4

_Point = tuple[int, float, float]
_Bracket = tuple[int, float, float, int, float, float]


def _layout(slots: int, fine: int, coarse: int) -> tuple[int, int, int]:
    """(offset of the first slot block, block size, total size) of a board."""
    first = _HEADER.size + slots * _KEY.size
    block = _HEAD.size + (fine + coarse) * _ENTRY.size
    return first, block, first + slots * block


class PowerBoard:
    """The writer's side (one process: the sampler's).

    Args:
        keys: The devices it holds (``gpu:0``, ``cpu:0/package``, ...), at most 24 bytes each.
        path: A file to map, so that other processes can read it (created, owner only,
            allocated whole and locked; removed by :meth:`close`); ``None`` for an anonymous
            map read in this process. Stale boards in its directory are swept first.

    Raises:
        OSError: The file cannot be created or allocated (a full or read-only directory).
    """

    def __init__(self, keys: Sequence[str], path: str | os.PathLike[str] | None = None) -> None:
        self.keys = list(keys)
        self.path = None if path is None else Path(path)
        self._fine, self._coarse = _FINE, _COARSE
        first, block, size = _layout(len(self.keys), self._fine, self._coarse)
        # The file's descriptor, locked (flock) while this board lives: the sweeper's sign.
        self._fd: int | None = None
        if self.path is None:
            self._map = mmap.mmap(-1, size)
        else:
            sweep_stale_boards(self.path.parent)
            self._fd, self._map = _allocate(self.path, size)
        _HEADER.pack_into(self._map, 0, _MAGIC, len(self.keys), _FINE, _COARSE, _COARSE_STEP_NS)
        self._slot: dict[str, int] = {}
        for i, key in enumerate(self.keys):
            _KEY.pack_into(self._map, _HEADER.size + i * _KEY.size, key.encode())
            self._slot[key] = first + i * block
        # Per slot: (entries written fine, coarse, last t_ns, last W, cumulative J, last
        # coarse t_ns).
        self._state: dict[int, list[float]] = {
            base: [0, 0, -1, 0.0, 0.0, -(2**62)] for base in self._slot.values()
        }
        # The last intervals between readings, per slot (their median is published).
        self._gaps: dict[int, collections.deque[int]] = {
            base: collections.deque(maxlen=9) for base in self._slot.values()
        }

    def add(
        self, key: str, t_ns: int, power_w: float | None, cumulative_j: float | None = None
    ) -> None:
        """One reading at ``t_ns``: the power, and the device's own cumulative energy where it
        has an exact one (RAPL; the power is then derived from it). Without a cumulative
        figure, the trapezoid integral of the power readings is kept here."""
        base = self._slot.get(key)
        if base is None:
            return
        st = self._state[base]
        last_t = int(st[2])
        if t_ns <= last_t:
            return
        if cumulative_j is None:
            if power_w is None:
                return
            cumulative_j = (
                st[4] + (st[3] + power_w) / 2 * (t_ns - last_t) / 1e9 if last_t >= 0 else 0.0
            )
        elif power_w is None:
            power_w = (cumulative_j - st[4]) / (t_ns - last_t) * 1e9 if last_t >= 0 else 0.0
        st[2], st[3], st[4] = t_ns, power_w, cumulative_j
        buf = self._map
        n = int(st[0])
        self._put(
            base + _HEAD.size + (n % self._fine) * _ENTRY.size, n, t_ns, cumulative_j, power_w
        )
        st[0] = n + 1
        _SEQ.pack_into(buf, base, n + 1)
        if last_t >= 0:
            gaps = self._gaps[base]
            gaps.append(t_ns - last_t)
            if n % 8 == 0 or n < 16:
                ordered = sorted(gaps)
                _SEQ.pack_into(buf, base + 2 * _SEQ.size, ordered[len(ordered) // 2])
        if t_ns - int(st[5]) >= _COARSE_STEP_NS:
            m = int(st[1])
            offset = base + _HEAD.size + (self._fine + m % self._coarse) * _ENTRY.size
            self._put(offset, m, t_ns, cumulative_j, power_w)
            st[1], st[5] = m + 1, t_ns
            _SEQ.pack_into(buf, base + _SEQ.size, m + 1)

    def _put(self, offset: int, n: int, t_ns: int, cumulative_j: float, power_w: float) -> None:
        buf = self._map
        _SEQ.pack_into(buf, offset, n)
        _DATA.pack_into(buf, offset + _SEQ.size, t_ns, cumulative_j, power_w)
        _SEQ.pack_into(buf, offset + _SEQ.size + _DATA.size, n)

    def reader(self) -> BoardReader:
        """A reader of this board in this process (the same memory)."""
        return BoardReader(self._map)

    def close(self) -> None:
        """Remove the file and let go of its lock (readers that mapped it keep their view).
        Idempotent."""
        if self.path is not None and self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = None


def _allocate(path: Path, size: int) -> tuple[int, mmap.mmap]:
    """``path`` created (owner only), locked, allocated to ``size`` bytes and mapped: its
    descriptor (the lock lives as long as it stays open) and the map.

    Raises:
        OSError: The file cannot be created or allocated (``ENOSPC``, ``EROFS``, ...); nothing
            is left behind.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        # Locked before anything else: a sweeper that sees the file in the meantime finds
        # its owner alive (the pid in its name) or its lock held. (Held: another live board.)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        # Every block now, so writing through the map never faults for want of space (tmpfs,
        # ext4, xfs rewrite allocated blocks in place; a copy-on-write file system does not).
        os.posix_fallocate(fd, 0, size)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
        raise


#: Name of a board file the agent creates: ``board-<pid of its writer>-<random hex>``.
_BOARD_NAME = re.compile(r"board-(\d+)-[0-9a-f]+")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not: it holds no files, and its pid is
    not reused until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # gone meanwhile; or no /proc: what kill said
    except OSError:
        return True
    fields = stat.rpartition(b")")[2].split()
    return not fields or fields[0] not in (b"Z", b"X")


def sweep_stale_boards(directory: Path) -> list[Path]:
    """Remove the board files in ``directory`` left by processes that died without closing
    them (SIGKILL, a crash): those whose writer (the pid in the name) is not alive and whose
    lock nobody holds. Returns the files removed. Never raises: a directory that cannot be
    read or written is left as it is."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _BOARD_NAME.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
        except OSError as exc:  # locked (its writer lives, in another pid namespace), EROFS
            logger.debug("board %s left in place: %s", path, exc)
        else:
            removed.append(path)
            logger.info("removed the power board %s of dead process %s", path, match.group(1))
        finally:
            os.close(fd)
    return removed


class BoardReader:
    """The reading side: any process that can open the board's file, or the writer's own.

    Raises:
        ValueError: ``source`` is not a power board.
    """

    def __init__(self, source: mmap.mmap | str | os.PathLike[str]) -> None:
        if isinstance(source, mmap.mmap):
            self._map = source
        else:
            with open(source, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        magic, slots, fine, coarse, _ = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC:
            raise ValueError(f"{source!r} is not a zeus_async power board")
        first, block, _ = _layout(slots, fine, coarse)
        self._fine, self._coarse = fine, coarse
        self.slots: dict[str, int] = {}
        for i in range(slots):
            (raw,) = _KEY.unpack_from(self._map, _HEADER.size + i * _KEY.size)
            self.slots[raw.rstrip(b"\0").decode()] = first + i * block

    # -- points -----------------------------------------------------------------------------

    def latest(self, key: str) -> _Point | None:
        """The latest reading of ``key``: ``(t_ns, cumulative J, W)``, or ``None``."""
        base = self.slots.get(key)
        if base is None:
            return None
        for _ in range(4):
            count, _, _ = _HEAD.unpack_from(self._map, base)
            if count == 0:
                return None
            offset = base + _HEAD.size + ((count - 1) % self._fine) * _ENTRY.size
            a, t, cum, watts, b = _ENTRY.unpack_from(self._map, offset)
            if a == b == count - 1:
                return t, cum, watts
        return None

    def _bracket(
        self, base: int, count: int, t_ns: int, coarse: bool, newest_ns: int = 0, step: int = 0
    ) -> _Bracket | None:
        """The readings of one ring around ``t_ns``, which is before its newest reading:
        ``None`` when the ring starts after ``t_ns`` (or was overwritten meanwhile). With the
        newest reading's time and the typical interval, the first probe is where regular
        readings would put ``t_ns`` (two probes, usually); then it bisects."""
        buf, unpack, size = self._map, _ENTRY.unpack_from, _ENTRY.size
        length = self._coarse if coarse else self._fine
        start = base + _HEAD.size + (self._fine * size if coarse else 0)
        lo, hi = max(0, count - length + _MARGIN), count - 1
        if hi - lo < 1:
            return None
        first: tuple[int, int, float, float, int] | None = None
        last: tuple[int, int, float, float, int] | None = None
        if step > 0 and newest_ns > t_ns:
            guess = min(max(hi - 1 - (newest_ns - t_ns) // step, lo), hi - 1)
            entry = unpack(buf, start + (guess % length) * size)
            if entry[0] != guess or entry[4] != guess:
                return None
            if entry[1] <= t_ns:
                lo, first = guess, entry
                after = unpack(buf, start + ((guess + 1) % length) * size)
                if after[0] != guess + 1 or after[4] != guess + 1:
                    return None
                if after[1] > t_ns:
                    return entry[1], entry[2], entry[3], after[1], after[2], after[3]
                lo, first = guess + 1, after
            else:
                hi, last = guess, entry
        if first is None:
            first = unpack(buf, start + (lo % length) * size)
            if first[0] != lo or first[4] != lo or first[1] > t_ns:
                return None
        if last is None:
            last = unpack(buf, start + (hi % length) * size)
            if last[0] != hi or last[4] != hi:
                return None
        # Bisect on entry numbers: first has t <= t_ns, last has t > t_ns.
        while hi - lo > 1:
            mid = (lo + hi) // 2
            entry = unpack(buf, start + (mid % length) * size)
            if entry[0] != mid or entry[4] != mid:
                return None
            if entry[1] <= t_ns:
                lo, first = mid, entry
            else:
                hi, last = mid, entry
        return first[1], first[2], first[3], last[1], last[2], last[3]

    def cumulative(self, key: str, t_ns: int) -> tuple[float, float, bool, bool] | None:
        """The device's cumulative energy at ``t_ns`` as the readings put it: ``(J, error J,
        extrapolated, late)``, or ``None`` without readings. ``error`` is what the readings
        leave open (see :class:`~zeus_async.aggregate.history.EnergyEstimate`)."""
        base = self.slots.get(key)
        if base is None:
            return None
        buf = self._map
        for _ in range(4):
            count, coarse_count, typical = _HEAD.unpack_from(buf, base)
            if count == 0:
                return None
            offset = base + _HEAD.size + ((count - 1) % self._fine) * _ENTRY.size
            a, t_n, cum_n, p_n, b = _ENTRY.unpack_from(buf, offset)
            if not a == b == count - 1:
                continue  # being written: read again
            if t_ns >= t_n:
                beyond = t_ns - t_n
                late = typical > 0 and beyond > LATE_FACTOR * typical
                return cum_n + p_n * beyond / 1e9, p_n * beyond / 1e9, True, late
            pair = self._bracket(base, count, t_ns, False, t_n, typical)
            coarse = pair is None
            if pair is None:
                pair = self._bracket(base, coarse_count, t_ns, True)
            if pair is None:
                # Older than both rings: back from the oldest point at its power.
                lo = max(0, coarse_count - self._coarse + _MARGIN)
                start = base + _HEAD.size + self._fine * _ENTRY.size
                a, t_o, c_o, p_o, b = _ENTRY.unpack_from(
                    buf, start + (lo % self._coarse) * _ENTRY.size
                )
                if coarse_count == 0 or not a == b == lo or t_o <= t_ns:
                    continue
                span = (t_o - t_ns) / 1e9
                return c_o - p_o * span, p_o * span, True, True
            t_a, c_a, p_a, t_b, c_b, p_b = pair
            if not t_a <= t_ns <= t_b or t_b <= t_a:
                continue
            # The increment between the two points is exact (the integral, or the counter);
            # it is shared as the power readings' trapezoid shares it.
            f = (t_ns - t_a) / (t_b - t_a)
            p_t = p_a + (p_b - p_a) * f
            whole = (p_a + p_b) * (t_b - t_a)
            share = (p_a + p_t) * (t_ns - t_a) / whole if whole > 0 and not coarse else f
            error = abs(p_b - p_a) * min(t_ns - t_a, t_b - t_ns) / 1e9
            late = not coarse and p_a != p_b and t_b - t_a > LATE_FACTOR * typical > 0
            return c_a + (c_b - c_a) * share, error, False, late
        return None


class _Torn(Exception):
    """An entry changed while it was read."""


class ClosedWindow(Protocol):
    """What the board needs of a window to estimate it: its name and span. A
    :class:`~zeus_async.aggregate.windows.WindowResult` is one; naming only these keeps the
    board below the window tracker that reads it (no import back up)."""

    @property
    def name(self) -> str: ...

    @property
    def window_id(self) -> int: ...

    @property
    def start_ns(self) -> int: ...

    @property
    def end_ns(self) -> int: ...


def provisional_measurement(
    reader: BoardReader,
    window: ClosedWindow,
    keys: Mapping[str, str],
    *,
    host: str,
    now_ns: int,
) -> Measurement | None:
    """A closed window's provisional figures from the board: ``keys`` maps the caller's device
    keys (``gpu:0``, ``cpu:0/package``) to the board's. ``None`` when the board has no reading
    of any of them."""
    figures: dict[str, EnergyEstimate] = {}
    for mine, theirs in keys.items():
        a = reader.cumulative(theirs, window.start_ns)
        b = reader.cumulative(theirs, window.end_ns)
        if a is None or b is None:
            continue
        method = "integrated+extrapolated" if a[2] or b[2] else "integrated"
        if a[3] or b[3]:
            method += ", late"
        figures[mine] = EnergyEstimate(max(b[0] - a[0], 0.0), method, a[1] + b[1])
    if not figures:
        return None
    return window_measurement(
        host=host,
        t_ns=now_ns,
        name=window.name,
        window_id=window.window_id,
        start_ns=window.start_ns,
        end_ns=window.end_ns,
        figures=figures,
    )
