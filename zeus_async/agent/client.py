"""Finding the node agent, and starting one for a job's ranks.

Discovery: the node agent holds ``<private dir>/agent.lock`` and listens on
``<private dir>/agent.sock``; :func:`node_agent_endpoint` probes the lock (one ``flock``).
:func:`ensure_node_agent` starts one when none runs — what the first rank of a torchrun job does
— detached in its own session, sampling every GPU of the node (``CUDA_VISIBLE_DEVICES`` is
removed from its environment; each client's own is applied to its indices), and stopping 5 s
after its last client left. Two ranks starting one at once is fine: the node lock lets one
win, and the other attaches to it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import msgspec

from .._paths import private_dir
from .protocol import AgentConfig
from .server import EXIT_AGENT_RUNNING, NODE_SOCKET, node_agent_running

__all__ = ["ensure_node_agent", "node_agent_config", "node_agent_endpoint"]

logger = logging.getLogger(__name__)

#: How long an agent started for a job lingers after its last client left (seconds).
IDLE_EXIT_S = 5.0


def node_socket() -> str:
    return f"ipc://{private_dir() / NODE_SOCKET}"


def node_agent_endpoint() -> str | None:
    """The node agent's endpoint when one runs, else ``None``."""
    return node_socket() if node_agent_running() else None


def node_agent_config(**options: object) -> AgentConfig:
    """A node agent's configuration on the default socket (``options``: more fields)."""
    return msgspec.structs.replace(
        AgentConfig(
            endpoint=node_socket(),
            fields={"power_w": None, "energy_j": None},
            node=True,
        ),
        **options,
    )


def ensure_node_agent(timeout_s: float = 60.0) -> str:
    """The node agent's endpoint, starting one (exiting when idle) if none runs.

    Raises:
        RuntimeError: The agent did not start (its error output is in the message).
    """
    endpoint = node_agent_endpoint()
    if endpoint is not None:
        return endpoint
    cfg = node_agent_config(exit_when_idle_s=IDLE_EXIT_S)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    log_path = private_dir() / "agent.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "zeus_async.agent.server", msgspec.json.encode(cfg)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env=env,
        )
    logger.info("started a node agent (pid %d) on %s", proc.pid, cfg.endpoint)
    deadline = time.monotonic() + timeout_s
    sock = private_dir() / NODE_SOCKET
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None and code != EXIT_AGENT_RUNNING:
            tail = log_path.read_bytes()[-2000:].decode(errors="replace").strip()
            raise RuntimeError(f"the node agent exited with code {code}: {tail}")
        if node_agent_running() and sock.exists():
            return cfg.endpoint
        time.sleep(0.05)
    raise RuntimeError(f"the node agent did not start within {timeout_s:g} s (log: {log_path})")
