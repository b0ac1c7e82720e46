"""The system agent's places: its socket (every allowed user's), its state (root's alone).

A system agent (``zeus-async agent --system``, run as root) serves every user of the node that
its policy lets in (:mod:`.policy`). Its socket sits in a directory anyone may enter
(``/run/zeus-async``, mode 0755, root's, writable by root only) and is mode 0660, owned
``root:<group>``, so the kernel already refuses users outside the group; its lease journals,
node lock and simulated node state sit in a directory only root may enter
(``<socket dir>/state``, mode 0700), so no user can forge or remove what the agent restores.

Clients find it by probing its socket (:func:`probe_system_agent`): the path is
``$ZEUS_ASYNC_SYSTEM_AGENT``, else :data:`SYSTEM_SOCKET`.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Literal, NamedTuple

from .._paths import ensure_private_dir
from ..errors import ConfigError

__all__ = [
    "SYSTEM_GROUP",
    "SYSTEM_SOCKET",
    "SYSTEM_SOCKET_ENV_VAR",
    "Probe",
    "group_id",
    "prepare_system_dirs",
    "probe_system_agent",
    "publish_file",
    "require_root",
    "system_socket",
]

logger = logging.getLogger(__name__)

#: The system agent's socket by default.
SYSTEM_SOCKET = Path("/run/zeus-async/agent.sock")
#: The group whose members may use it by default.
SYSTEM_GROUP = "zeus-async"
#: Environment variable naming the system agent's socket (clients and ``--system``).
SYSTEM_SOCKET_ENV_VAR = "ZEUS_ASYNC_SYSTEM_AGENT"


def system_socket() -> Path:
    """``$ZEUS_ASYNC_SYSTEM_AGENT``, else :data:`SYSTEM_SOCKET`."""
    env = os.environ.get(SYSTEM_SOCKET_ENV_VAR)
    return Path(env) if env else SYSTEM_SOCKET


def require_root() -> None:
    """Raises:
    ConfigError: This process is not root (a system agent changes every user's GPUs and
        keeps what to restore where no user can write)."""
    if os.geteuid() != 0:
        raise ConfigError(
            "a system agent (--system) runs as root: it changes every user's GPUs and keeps "
            "what to restore where no user can write (run it from a systemd unit, or sudo)"
        )


def group_id(name: str) -> int:
    """The gid of group ``name`` (a number is taken as a gid).

    Raises:
        ConfigError: No such group.
    """
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(
            f"group {name!r} does not exist (create it: groupadd {name}; or pass --group)"
        ) from None


def prepare_system_dirs(sock: Path, state: Path) -> None:
    """Create the socket's directory (0755) and the state directory (0700), both this
    user's (root's), and check them.

    Raises:
        ConfigError: A directory is a symbolic link, someone else's, or writable by group or
            others (a user could replace the socket with one of their own), or cannot be made.
    """
    directory = sock.parent
    try:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the socket directory {directory}: {exc}") from exc
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket directory {directory} is not a directory (or is a link)")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"socket directory {directory} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.geteuid()}): another user could replace the socket; remove it"
        )
    if st.st_mode & 0o022:
        raise ConfigError(
            f"socket directory {directory} has mode {stat.S_IMODE(st.st_mode):03o}: others "
            f"could replace the socket (chmod 755 {directory})"
        )
    if stat.S_IMODE(st.st_mode) & 0o005 != 0o005:
        os.chmod(directory, stat.S_IMODE(st.st_mode) | 0o055)  # the users must reach the socket
    ensure_private_dir(state)


def publish_file(path: Path, gid: int, mode: int) -> None:
    """Give ``path`` (the socket, the power board) to ``root:<gid>`` with ``mode``."""
    os.chown(path, os.geteuid(), gid)
    os.chmod(path, mode)


class Probe(NamedTuple):
    """What a connection attempt to a system agent's socket found."""

    state: Literal["up", "absent", "denied"]
    detail: str = ""


def probe_system_agent(sock: Path | None = None) -> Probe:
    """Whether a system agent answers on ``sock`` (default :func:`system_socket`): one
    ``connect`` (a stale socket file left by a killed agent is ``absent``; a socket this user
    may not use is ``denied``, with the reason)."""
    path = sock if sock is not None else system_socket()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(os.fspath(path))
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                return Probe("denied", _denied(path))
            return Probe("absent", exc.strerror or str(exc))
    return Probe("up")


def _denied(path: Path) -> str:
    try:
        st = os.stat(path)
        group = grp.getgrgid(st.st_gid).gr_name
    except (OSError, KeyError):
        return f"permission denied on {path}"
    return (
        f"permission denied on {path}: only members of group {group!r} may use the system "
        "agent (ask the node's operator to add you, then log in again)"
    )
