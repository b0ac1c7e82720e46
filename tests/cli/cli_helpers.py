"""Running the CLI as real processes in tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

PY = sys.executable


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ZEUS_ASYNC_SIM"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m zeus_async ARGS`` to completion (stdout/stderr captured as text)."""
    return subprocess.run(
        [PY, "-m", "zeus_async", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        check=False,
    )


def popen(*args: str, start_new_session: bool = False) -> subprocess.Popen[str]:
    """``python -m zeus_async ARGS`` in the background, pipes for stdout and stderr (in a
    process group of its own with ``start_new_session``)."""
    return subprocess.Popen(
        [PY, "-m", "zeus_async", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=start_new_session,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
