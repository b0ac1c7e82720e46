"""Node-wide settable state of the GPU simulator, shared by every process through a small file.

On a real node the driver owns each GPU's power limit, locked SM clocks and persistence mode:
every process sees the same values, and they outlive the process that set them. The simulator
does the same by keeping them in one JSON file per simulated node, in
``<private dir>/sim/`` (:func:`zeus_async._paths.private_dir`; the ``sim`` directory is created
with mode 0700). The file is named by a short stable hash of the node's
:class:`~zeus_async.devices.sim_config.SimConfig` (:func:`node_key`), so every process simulating
the same configuration (it travels in ``ZEUS_ASYNC_SIM``) shares it.

Per GPU index the file holds a :class:`GpuState`: power limit (W), locked SM clock range (MHz,
or null), persistence mode, and the wall time (ns, the setter's clock) of the last change. A
GPU without an entry has the configuration's defaults; so has every GPU when there is no file.

Writers hold an exclusive ``fcntl.flock`` on a sibling ``.lock`` file for the whole
read-modify-write, and replace the file atomically (temporary file + ``os.replace``), so two
processes changing two GPUs at once lose nothing, and readers need no lock: they see the old file
or the new one, never a mix. Readers notice a new version with one ``os.stat``
(:data:`FileKey`). Nothing is fsynced: after a crash of the machine the state is lost, as the
driver's would be.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Final, NamedTuple

import msgspec

from .._paths import ensure_private_dir, private_dir
from ..errors import ConfigError
from .sim_config import SimConfig

__all__ = [
    "STATE_VERSION",
    "FileKey",
    "GpuSettings",
    "GpuState",
    "NodeState",
    "NodeStateFile",
    "clamp_state",
    "node_key",
    "state_dir",
]

logger = logging.getLogger(__name__)

#: Format version written in every state file; files of another version are ignored.
STATE_VERSION: Final = 1

#: Identity of one version of the state file: ``(inode, mtime ns, size)``; ``None`` = no file.
#: The file is only ever replaced, never rewritten in place, and writers make each version's
#: mtime later than the previous one's (:meth:`NodeStateFile.write`), so no two versions share
#: a key: a freed inode is soon reused (ext4), and file timestamps tick only every few ms.
FileKey = tuple[int, int, int] | None


class GpuState(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One GPU's settable state as stored in the file.

    Attributes:
        power_limit_w: Power limit (W).
        locked_sm_clock_min_mhz: Lower end of the locked SM clock range; ``None``: not locked.
        locked_sm_clock_max_mhz: Upper end of the locked SM clock range; ``None``: not locked.
        persistence_mode: Persistence mode.
        changed_ns: Wall time (ns, on the setting process's clock) of the last change.
    """

    power_limit_w: float
    locked_sm_clock_min_mhz: int | None = None
    locked_sm_clock_max_mhz: int | None = None
    persistence_mode: bool
    changed_ns: int


class NodeState(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole file: format version, node key, and a :class:`GpuState` per GPU index set."""

    version: int = STATE_VERSION
    node: str = ""
    gpus: dict[int, GpuState] = msgspec.field(default_factory=dict)


class GpuSettings(NamedTuple):
    """A GPU's settings after clamping to its configuration (see :func:`clamp_state`)."""

    power_limit_w: float
    locked_sm_clocks_mhz: tuple[int, int] | None
    persistence_mode: bool
    changed_ns: int | None


def node_key(config: SimConfig) -> str:
    """Short stable hash naming the node of ``config`` (16 hex digits).

    ``counter_origin_ns`` is left out: :func:`~zeus_async.testing.sim_pynvml.shim_env` pins it
    in the configuration it hands to child processes, which still simulate the same node.
    """
    normalized = msgspec.structs.replace(config, counter_origin_ns=None)
    return hashlib.sha256(normalized.to_json().encode()).hexdigest()[:16]


def state_dir() -> Path:
    """``<private dir>/sim``, created with mode 0700 and checked like the private directory.

    Raises:
        ConfigError: The private directory or ``sim`` inside it is not safe to use.
    """
    return ensure_private_dir(private_dir() / "sim")


def clamp_state(config: SimConfig, state: GpuState | None) -> GpuSettings:
    """The settings ``state`` stands for under ``config``: the config's defaults when ``None``,
    else the stored values clamped to the config's ranges (a lock with a missing or reversed
    end counts as no lock)."""
    if state is None:
        return GpuSettings(config.power_limit_default_w, None, config.persistence_mode, None)
    limit = min(max(float(state.power_limit_w), config.power_limit_min_w), config.power_limit_max_w)
    lo, hi = state.locked_sm_clock_min_mhz, state.locked_sm_clock_max_mhz
    lock: tuple[int, int] | None = None
    if lo is not None and hi is not None and lo <= hi:
        f_min, f_max = config.min_sm_clock_mhz, config.max_sm_clock_mhz
        lock = (min(max(lo, f_min), f_max), min(max(hi, f_min), f_max))
    return GpuSettings(limit, lock, bool(state.persistence_mode), state.changed_ns)


_decoder = msgspec.json.Decoder(NodeState)
_encoder = msgspec.json.Encoder()


class NodeStateFile:
    """The state file of one simulated node.

    Args:
        config: The node's configuration (names the file, see :func:`node_key`).
        directory: Where the file lives (default: :func:`state_dir`).

    Raises:
        ConfigError: The default directory is not safe to use.
    """

    def __init__(self, config: SimConfig, directory: Path | None = None) -> None:
        self.key = node_key(config)
        self.directory = state_dir() if directory is None else directory
        #: The JSON file (replaced atomically on every change).
        self.path = self.directory / f"node-{self.key}.json"
        #: The file writers hold an exclusive ``flock`` on.
        self.lock_path = self.directory / f"node-{self.key}.lock"
        self._warned: FileKey = None

    def stat_key(self) -> FileKey:
        """The :data:`FileKey` of the file now (one ``os.stat``); ``None`` when there is none."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self) -> tuple[NodeState | None, FileKey]:
        """The stored state and the key of the version read.

        ``(None, None)`` when there is no file; ``(None, key)`` when the file cannot be decoded
        or has another format version (logged once per version of the file; the next write
        replaces it).

        Raises:
            OSError: The file exists but cannot be read.
        """
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return None, None
        key: FileKey = (st.st_ino, st.st_mtime_ns, st.st_size)
        try:
            state = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._warn(key, f"cannot decode simulated node state {self.path}: {exc}; ignoring it")
            return None, key
        if state.version != STATE_VERSION:
            self._warn(
                key,
                f"simulated node state {self.path} has format version {state.version}, not "
                f"{STATE_VERSION}; ignoring it",
            )
            return None, key
        return state, key

    def _warn(self, key: FileKey, message: str) -> None:
        if key != self._warned:
            self._warned = key
            logger.warning("%s", message)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the exclusive writer lock (blocks while another writer, in any process, holds it).

        Raises:
            ConfigError: The lock file cannot be opened.
        """
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"cannot open simulated node state lock {self.lock_path}: {exc}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def write(self, state: NodeState) -> FileKey:
        """Replace the file with ``state`` atomically; call under :meth:`locked`.

        The new version's mtime is made later than the current version's (``os.utime`` when the
        clock has not ticked since), so its :data:`FileKey` differs from every earlier one.

        Returns:
            The key of the version written.

        Raises:
            ConfigError: The file cannot be written.
        """
        data = _encoder.encode(state)
        tmp: str | None = None
        try:
            previous = self.stat_key()
            fd, tmp = tempfile.mkstemp(prefix=f".node-{self.key}.", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                st = os.fstat(f.fileno())
                if previous is not None and st.st_mtime_ns <= previous[1]:
                    st = _later_mtime(f.fileno(), previous[1])
            os.replace(tmp, self.path)
            tmp = None
        except OSError as exc:
            raise ConfigError(f"cannot write simulated node state {self.path}: {exc}") from exc
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reset(self) -> None:
        """Forget every GPU's settings (back to the configuration's defaults).

        Writes a state with no GPU rather than removing the file, so the next version's mtime
        still follows this one's (see :meth:`write`).

        Raises:
            ConfigError: The file cannot be written.
        """
        with self.locked():
            self.write(NodeState(node=self.key))
        logger.debug("simulated node state %s reset", self.path)


def _later_mtime(fd: int, after_ns: int) -> os.stat_result:
    """Set the mtime of ``fd`` past ``after_ns``: 1 ns later, or the next whole second on a
    file system that keeps only seconds."""
    for mtime in (after_ns + 1, (after_ns // 1_000_000_000 + 1) * 1_000_000_000):
        os.utime(fd, ns=(mtime, mtime))
        st = os.fstat(fd)
        if st.st_mtime_ns > after_ns:
            break
    return st
