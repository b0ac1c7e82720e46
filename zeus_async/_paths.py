"""The per-user private directory: agent socket, lease journals, default bus socket, simulated
node state.

Where it is, first match:

1. ``$ZEUS_ASYNC_DIR`` (tests point it at a fresh directory);
2. ``$XDG_RUNTIME_DIR/zeus-async`` when ``XDG_RUNTIME_DIR`` names a directory;
3. ``<tmp>/zeus-async-<uid>``.

The directory is created with mode 0700. Before it is used it is checked: a real directory (not
a symbolic link), owned by this user, with no access for group or others. Anything else is
refused with a :class:`~zeus_async.errors.ConfigError` naming the fix: in a shared ``/tmp``
another user could otherwise create ``zeus-async-<uid>`` first and serve forged samples on the
sockets inside it, or read ours.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

from .errors import ConfigError

__all__ = ["DIR_ENV_VAR", "ensure_private_dir", "private_dir"]

logger = logging.getLogger(__name__)

#: Environment variable naming the private directory (overrides the default location).
DIR_ENV_VAR = "ZEUS_ASYNC_DIR"


def _default_location() -> Path:
    env = os.environ.get(DIR_ENV_VAR)
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "zeus-async"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"zeus-async-{uid}"


def ensure_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` with mode 0700 if missing, then check it is ours alone.

    Raises:
        ConfigError: ``path`` is not a directory, is a symbolic link, belongs to another user,
            or is accessible to group or others; or it cannot be created.
    """
    p = Path(path)
    try:
        p.mkdir(mode=0o700, parents=False)
    except FileExistsError:
        pass
    except FileNotFoundError:
        try:
            p.mkdir(mode=0o700, parents=True)
        except OSError as exc:
            raise ConfigError(f"cannot create private directory {p}: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot create private directory {p}: {exc}") from exc
    st = os.lstat(p)
    hint = f"remove it, or set {DIR_ENV_VAR} to a directory of your own"
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"private directory {p} is a symbolic link; refusing to use it ({hint})")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"private directory {p} is not a directory ({hint})")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    if st.st_uid != uid:
        raise ConfigError(
            f"private directory {p} belongs to uid {st.st_uid}, not to this user (uid {uid}): "
            f"another user may have created it to intercept the sockets inside; refusing to use "
            f"it ({hint})"
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            f"private directory {p} has mode {stat.S_IMODE(st.st_mode):03o}: group or others "
            f"can reach the sockets inside; refusing to use it (chmod 700 {p}, or {hint})"
        )
    return p


def private_dir() -> Path:
    """The checked per-user private directory (see the module docstring).

    Raises:
        ConfigError: The directory is not safe to use.
    """
    return ensure_private_dir(_default_location())
