"""Finding the node agent, and starting one for a job's ranks.

Discovery: the node agent holds ``<private dir>/agent.lock`` and listens on
``<private dir>/agent.sock``; :func:`node_agent_endpoint` probes the lock (one ``flock``).
:func:`ensure_node_agent` starts one when none runs — what the first rank of a torchrun job does
— detached in its own session, sampling every GPU of the node (``CUDA_VISIBLE_DEVICES`` is
removed from its environment; each client's own is applied to its indices), and stopping 5 s
after its last client left. Two ranks starting one at once is fine: the node lock lets one
win, and the other attaches to it.

:func:`system_agent_endpoint` finds a *system* agent (``zeus-async agent --system``, root's,
serving every user of the node its policy lets in) by connecting to its socket
(``$ZEUS_ASYNC_SYSTEM_AGENT``, else ``/run/zeus-async/agent.sock``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import msgspec
import zmq

from .._paths import private_dir
from ..errors import ConfigError
from .protocol import AgentConfig, Bye, Control, Hello, Reply, error_from_reply
from .server import EXIT_AGENT_RUNNING, NODE_SOCKET, node_agent_running
from .system import SYSTEM_SOCKET_ENV_VAR, probe_system_agent, system_socket

__all__ = [
    "agent_request",
    "check_endpoint",
    "ensure_node_agent",
    "node_agent_config",
    "node_agent_endpoint",
    "system_agent_endpoint",
]

logger = logging.getLogger(__name__)

#: How long an agent started for a job lingers after its last client left (seconds).
IDLE_EXIT_S = 5.0


def node_socket() -> str:
    return f"ipc://{private_dir() / NODE_SOCKET}"


def node_agent_endpoint() -> str | None:
    """The node agent's endpoint when one runs, else ``None``."""
    return node_socket() if node_agent_running() else None


def system_agent_endpoint() -> str | None:
    """The system agent's endpoint when one answers on its socket, else ``None``.

    A socket this user may not open (not in the agent's group) is ``None`` too — this user's
    own agent then serves it — unless ``$ZEUS_ASYNC_SYSTEM_AGENT`` names that socket: asked
    for by name, it is an error.

    Raises:
        ConfigError: ``$ZEUS_ASYNC_SYSTEM_AGENT`` names a socket this user may not use.
    """
    sock = system_socket()
    probe = probe_system_agent(sock)
    if probe.state == "up":
        return f"ipc://{sock}"
    if probe.state == "denied":
        if os.environ.get(SYSTEM_SOCKET_ENV_VAR):
            raise ConfigError(
                f"cannot use the system agent ({SYSTEM_SOCKET_ENV_VAR}): {probe.detail}"
            )
        logger.info("not using the system agent: %s", probe.detail)
    return None


def check_endpoint(endpoint: str) -> None:
    """Refuse an agent endpoint this user may not connect to, now and in words (a zmq connect
    would retry in silence until the start timeout).

    Raises:
        ConfigError: An ipc socket that exists and this user may not open.
    """
    if not endpoint.startswith("ipc://"):
        return
    from pathlib import Path

    probe = probe_system_agent(Path(endpoint[len("ipc://") :]))
    if probe.state == "denied":
        raise ConfigError(f"cannot use the agent at {endpoint}: {probe.detail}")


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


def agent_request(
    endpoint: str, control: Control, *, timeout_s: float = 10.0, name: str = "request"
) -> Reply:
    """One control request to an agent, as a short-lived client (``zeus-async job``, a
    Slurm prolog): hello, the request, goodbye; the agent's reply.

    Raises:
        ConfigError: No socket at an ``ipc://`` endpoint.
        TimeoutError: The agent did not answer within ``timeout_s``.
        Exception: The agent's error, typed as it raised it (``ConfigError``,
            ``PolicyDeniedError``, ...).
    """
    check_endpoint(endpoint)
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
        raise ConfigError(f"no agent at {endpoint}: no such socket")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint)
        enc = msgspec.msgpack.Encoder()
        dec = msgspec.msgpack.Decoder(Reply)
        deadline = time.monotonic() + timeout_s

        def receive(kind: str) -> Reply:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(max(1, round(left * 1e3))):
                    raise TimeoutError(
                        f"the agent at {endpoint} did not answer within {timeout_s:g} s"
                    )
                reply = dec.decode(sock.recv())
                if reply.kind == "error" or (reply.kind == "control" and reply.error_type):
                    raise error_from_reply(reply)
                if reply.kind == kind:
                    return reply

        sock.send(enc.encode(Hello(pid=os.getpid(), name=name, gpus=[])))
        receive("ready")
        sock.send(enc.encode(control))
        reply = receive("control")
        sock.send(enc.encode(Bye()))
        return reply
    finally:
        ctx.destroy(linger=0)
