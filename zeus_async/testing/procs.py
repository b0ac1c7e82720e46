"""Real processes on a simulated node, for tests and benchmarks of the agent and restores.

* :func:`sim_env` — the environment of a child process simulating a node;
* :func:`start_node_agent` — ``zeus-async agent --backend sim``, started and ready;
* :func:`start_restore_job` — :mod:`zeus_async.testing.restore_job` in its own process
  group, started and holding its settings;
* :func:`run_ranks` — the ranks of a ``torch.distributed`` job (``env://`` rendezvous), run to
  completion.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from ..devices.sim_config import SimConfig

__all__ = [
    "run_cli",
    "run_ranks",
    "sim_env",
    "start_node_agent",
    "start_node_agent_ready",
    "start_restore_job",
]

#: The directory holding the ``zeus_async`` package (put on children's ``PYTHONPATH``).
_SOURCE_ROOT = str(Path(__file__).resolve().parents[2])

_Stderr = int | IO[Any] | None


def sim_env(config: SimConfig, **extra: str) -> dict[str, str]:
    """This process's environment for a child that simulates ``config``'s node: unbuffered
    output, ``ZEUS_ASYNC_SIM`` set, this ``zeus_async`` importable, plus ``extra``."""
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        ZEUS_ASYNC_SIM=config.to_json(),
        PYTHONPATH=_SOURCE_ROOT if not path else f"{_SOURCE_ROOT}{os.pathsep}{path}",
        **extra,
    )


def _started(
    argv: list[str], env: dict[str, str], stderr: _Stderr, ready: str, what: str, **popen: Any
) -> tuple[subprocess.Popen[str], str]:
    """``argv`` started, once its first line of output begins with ``ready``; and that line.

    Raises:
        RuntimeError: It exited or printed something else first (with its stderr).
    """
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, **popen
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(ready):
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"{what} did not start: {line!r} {err or ''}")
    return proc, line


def run_cli(
    env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``zeus-async ARGS`` to its end in ``env``; its status and output (text)."""
    return subprocess.run(
        [sys.executable, "-m", "zeus_async", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_node_agent(
    env: dict[str, str], *args: str, stderr: _Stderr = subprocess.PIPE
) -> subprocess.Popen[str]:
    """``zeus-async agent --backend sim ARGS``, returned once it printed ``agent ready``.

    Raises:
        RuntimeError: It exited or printed something else first (with its stderr).
    """
    return start_node_agent_ready(env, *args, stderr=stderr)[0]


def start_node_agent_ready(
    env: dict[str, str], *args: str, stderr: _Stderr = subprocess.PIPE
) -> tuple[subprocess.Popen[str], str]:
    """:func:`start_node_agent`, with its ready line (``agent ready: ENDPOINT (metrics on port
    N)``)."""
    argv = [sys.executable, "-m", "zeus_async", "agent", "--backend", "sim", *args]
    return _started(argv, env, stderr, "agent ready", "the node agent")


def start_restore_job(
    *args: str, env: dict[str, str], stderr: _Stderr = subprocess.PIPE
) -> tuple[subprocess.Popen[str], int]:
    """The restore job (``ARGS`` as its options) in its own process group, as a job under a
    shell or Slurm; returned with its agent's pid once it has changed the settings.

    Raises:
        RuntimeError: It exited or printed something else first (with its stderr).
    """
    argv = [sys.executable, "-m", "zeus_async.testing.restore_job", *args]
    proc, line = _started(argv, env, stderr, "capped", "the restore job", start_new_session=True)
    return proc, int(line.split()[1])


def run_ranks(
    argv: list[str], env: dict[str, str], *, world_size: int = 2, timeout: float = 60
) -> list[str]:
    """Run ``argv`` as each rank of a one-node job, with the variables torchrun sets
    (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``); the ranks' outputs, rank 0 first.

    Raises:
        RuntimeError: A rank failed (with its stderr); every rank is killed then.
    """
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    size = str(world_size)
    job = dict(
        env,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        WORLD_SIZE=size,
        LOCAL_WORLD_SIZE=size,
        GROUP_RANK="0",
    )
    procs = [
        subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(job, RANK=str(rank), LOCAL_RANK=str(rank)),
        )
        for rank in range(world_size)
    ]
    outputs = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"rank {rank} exited with {proc.returncode}: {err}")
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def pid_gone(pid: int, timeout_s: float = 15.0) -> bool:
    """Whether process ``pid`` is gone within ``timeout_s`` (polled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def sim_node_restored(config: Any) -> bool:
    """Whether every GPU of the simulated node ``config`` has its default settings."""
    from .sim_state import read_sim_node_state

    return all(g.is_default(config) for g in read_sim_node_state(config))


def wait_sim_node_restored(config: Any, timeout_s: float = 15.0) -> None:
    """Wait until :func:`sim_node_restored`.

    Raises:
        AssertionError: Not within ``timeout_s`` (with the node's state).
    """
    from .sim_state import read_sim_node_state

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sim_node_restored(config):
            return
        time.sleep(0.05)
    raise AssertionError(f"not restored: {read_sim_node_state(config)}")


def finish(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` if it still runs, and collect it."""
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=20)
