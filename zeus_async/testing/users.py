"""Processes of other users, for tests of what a node shared by several users must keep apart
(the system agent, Slurm jobs): run as a user, and a Python that user can run with this
checkout importable."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

__all__ = ["as_user", "identity", "python_for"]

logger = logging.getLogger(__name__)

#: The directory holding the ``zeus_async`` package.
_SOURCE_ROOT = Path(__file__).resolve().parents[2]


def identity(user: str) -> tuple[int, int, list[int]]:
    """``(uid, gid, groups)`` of ``user``."""
    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid, os.getgrouplist(user, pw.pw_gid)


def as_user(user: str) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child ``user`` (groups, gid, then uid)."""
    uid, gid, groups = identity(user)

    def demote() -> None:
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)

    return demote


def python_for(user: str) -> tuple[str, str] | None:
    """An interpreter ``user`` can run with this checkout and its packages importable, and the
    ``PYTHONPATH`` it needs (this one may live under root's home); ``None`` when there is none."""
    packages = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    path = os.pathsep.join([str(_SOURCE_ROOT), *sorted(packages)])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, shutil.which(version), f"/usr/bin/{version}"]
    for python in dict.fromkeys(c for c in candidates if c):
        try:
            probe = subprocess.run(
                [python, "-c", "import zeus_async, zmq, msgspec, anyio"],
                env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
                preexec_fn=as_user(user),
                capture_output=True,
                cwd="/",
            )
        except OSError:  # not executable by this user (under root's home)
            continue
        if probe.returncode == 0:
            return python, path
    return None
