"""The system agent: one agent per node serving many users, with real users and processes.

Run as root (skipped otherwise): each test creates a group and users of its own (unique names,
removed afterwards), starts ``zeus-async agent --system`` on a simulated 4-GPU node with a
policy file, and drives clients running as those users (``system_client.py``, started with
their uid and gids). The node's settings are read from outside, as a driver would show them
(the simulated node's state file in the agent's state directory).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zeus_async.devices.sim_config import SimConfig
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import sim_env, start_node_agent
from zeus_async.testing.users import as_user, identity, python_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0,
        reason="creates users and runs a system agent: needs root",
    ),
    pytest.mark.skipif(
        shutil.which("useradd") is None or shutil.which("groupadd") is None,
        reason="needs useradd and groupadd to create the test's users",
    ),
]

CONFIG = SimConfig(num_gpus=4, seed=11)
DEFAULT_W = CONFIG.power_limit_default_w  # 700 W
SOURCE_ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("system_client.py")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


class Accounts:
    """A group and users created for one test (removed by :meth:`remove`)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.group = f"zsg{tag}"
        self.users: list[str] = []
        _run("groupadd", self.group)
        self.gid = grp.getgrnam(self.group).gr_gid

    def add(self, role: str, *, member: bool) -> str:
        name = f"zs{role}{uuid.uuid4().hex[:8]}"
        groups = ["-G", self.group] if member else []
        _run("useradd", "-M", "-N", "-s", "/usr/sbin/nologin", *groups, name)
        self.users.append(name)
        return name

    def remove(self) -> None:
        for name in self.users:
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", self.group], capture_output=True)


_identity = identity
_as_user = as_user


def _python_for(user: str) -> tuple[str, str]:
    found = python_for(user)
    if found is None:
        pytest.skip(f"no Python with this checkout's packages that user {user} can run")
    return found


class Client:
    """``system_client.py`` running as a user; :meth:`do` sends one command, returns the reply."""

    def __init__(self, user: str, python: tuple[str, str], env: dict[str, str]) -> None:
        self.user = user
        self.proc = subprocess.Popen(
            [python[0], str(CLIENT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env, PYTHONPATH=python[1]),
            preexec_fn=_as_user(user),
            cwd="/",
        )

    def do(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"client of {self.user} exited: {err}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ok(self, op: str, **args: Any) -> dict[str, Any]:
        reply = self.do(op, **args)
        assert reply["ok"], reply
        return reply

    def refused(self, op: str, error: str, **args: Any) -> str:
        reply = self.do(op, **args)
        assert not reply["ok"], reply
        assert reply["type"] == error, reply
        message: str = reply["message"]
        return message

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=20)


class Node:
    """A system agent on a simulated node, its directories and its clients."""

    def __init__(self, accounts: Accounts, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.accounts = accounts
        # Somewhere every test user can reach (pytest's tmp_path is root's alone).
        self.base = Path(tempfile.mkdtemp(prefix="zsys-", dir="/tmp"))
        os.chmod(self.base, 0o755)
        self.socket = self.base / "run" / "agent.sock"
        self.state = self.base / "run" / "state"
        self.policy = self.base / "policy.toml"
        self.policy.write_text(policy)
        self.clients: list[Client] = []
        self.agent: subprocess.Popen[str] | None = None
        self.log = self.base / "agent.log"
        self.monkeypatch = monkeypatch

    def start(self) -> None:
        with open(self.log, "w") as log:
            self.agent = start_node_agent(
                sim_env(CONFIG),
                "--system",
                "--socket",
                str(self.socket),
                "--group",
                self.accounts.group,
                "--policy",
                str(self.policy),
                stderr=log,
            )
        # The simulated node's state lives in the agent's state directory: read it there.
        self.monkeypatch.setenv("ZEUS_ASYNC_DIR", str(self.state))

    def client(self, user: str, **env: str) -> Client:
        home = self.base / f"home-{user}"
        home.mkdir(mode=0o700)
        uid, gid, _ = _identity(user)
        os.chown(home, uid, gid)
        base_env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(home),
            "ZEUS_ASYNC_DIR": str(home),
            "ZEUS_ASYNC_SYSTEM_AGENT": str(self.socket),
            "PYTHONUNBUFFERED": "1",
        }
        client = Client(user, _python_for(user), dict(base_env, **env))
        self.clients.append(client)
        return client

    def limits(self) -> list[float]:
        return [g.power_limit_w for g in read_sim_node_state(CONFIG)]

    def clocks(self) -> list[tuple[int, int] | None]:
        return [g.locked_sm_clocks_mhz for g in read_sim_node_state(CONFIG)]

    def wait_limits(self, expected: list[float], timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.limits() == expected:
                return
            time.sleep(0.05)
        assert self.limits() == expected

    def stop(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                client.stop()
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait(timeout=20)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def accounts() -> Iterator[Accounts]:
    acc = Accounts()
    try:
        yield acc
    finally:
        acc.remove()


def _policy(users: list[str], read: str = "") -> str:
    names = ", ".join(f'"{u}"' for u in users)
    return f"""{read}
[[control.rule]]
users = [{names}]
gpus = [0, 1]
min_power_w = 250
max_power_w = 500
min_sm_mhz = 600
max_sm_mhz = 1500
"""


@pytest.fixture
def node(accounts: Accounts, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    n = Node(accounts, "", monkeypatch)
    try:
        yield n
    finally:
        n.stop()


def test_two_users_share_one_system_agent_under_its_policy(accounts: Accounts, node: Node) -> None:
    alice = accounts.add("a", member=True)
    bob = accounts.add("b", member=True)
    carol = accounts.add("c", member=False)
    node.policy.write_text(_policy([alice, bob]))
    node.start()

    # The places: socket 0660 root:<group> in a 0755 directory; state root's alone.
    st = os.stat(node.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, accounts.gid)
    assert stat.S_IMODE(os.stat(node.socket.parent).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(node.state).st_mode) == 0o700

    a = node.client(alice)
    b = node.client(bob, SLURM_JOB_GPUS="3")
    # Both read: every GPU, and windows measured. Alice's ranges are her rule's on GPUs 0-1.
    opened = a.ok("open")
    assert opened["gpus"] == [0, 1, 2, 3]
    assert opened["ranges"] == [[250.0, 500.0], [250.0, 500.0], [200.0, 700.0], [200.0, 700.0]]
    assert b.ok("open")["gpus"] == [0, 1, 2, 3]
    assert a.ok("window")["energy_j"] > 0
    assert b.ok("window")["energy_j"] > 0

    # Alice: GPU 0 within her rule; not GPU 2 (no rule, no allocation known); not 600 W.
    a.ok("power", watts=300, gpus=[0])
    a.ok("clocks", mhz=990, gpus=[0])
    message = a.refused("power", "PolicyDeniedError", watts=300, gpus=[2])
    assert f"gpu:2 power limit: no rule of {node.policy} lets user {alice} change it" in message
    assert "GPUs allocated to the job of process" in message and "are unknown" in message
    message = a.refused("power", "PolicyDeniedError", watts=600, gpus=[0])
    assert message == (
        f"gpu:0 power limit 600 W: outside what {node.policy} lets user {alice} set there: "
        "[250, 500] W (control.rule[1])"
    )
    a.refused("clocks", "PolicyDeniedError", mhz=1800, gpus=[0])
    assert node.limits() == [300.0, DEFAULT_W, DEFAULT_W, DEFAULT_W]
    assert node.clocks() == [(990, 990), None, None, None]

    # Bob may change GPU 0 by the rule, but Alice holds it: a conflict naming her, for a new
    # limit and for a clock reset alike; his release does not touch her lease.
    message = b.refused("power", "LeaseConflictError", watts=400, gpus=[0])
    assert f"user {alice}" in message and "gpu:0's power limit is held by" in message
    message = b.refused("clocks", "LeaseConflictError", mhz=None, gpus=[0])
    assert f"user {alice}" in message and "locked SM clocks are held by" in message
    b.ok("release", gpus=[0])
    assert node.limits() == [300.0, DEFAULT_W, DEFAULT_W, DEFAULT_W]
    assert node.clocks() == [(990, 990), None, None, None]
    # No rule for GPU 3: Bob's job was allocated it (SLURM_JOB_GPUS), not GPU 2.
    b.ok("power", watts=450, gpus=[3])
    message = b.refused("power", "PolicyDeniedError", watts=450, gpus=[2])
    assert "not allocated to the job of process" in message and "(its GPUs: [3])" in message

    # A user outside the group cannot connect, and is told why.
    c = node.client(carol)
    message = c.refused("open", "ConfigError")
    assert f"only members of group '{accounts.group}' may use the system agent" in message

    # Alice's power-limit optimizer works through the agent, within her rule's range.
    a.ok("open", gpus=[1], slot="opt")
    optimized = a.ok("optimize", slot="opt")
    assert optimized["limits"] == [500, 375, 250]
    assert optimized["optimal"] in (500, 375, 250)
    a.ok("close", slot="opt")
    node.wait_limits([300.0, DEFAULT_W, DEFAULT_W, 450.0])

    # Alice's client killed: her settings come back, Bob's stay.
    a.proc.kill()
    a.proc.wait(timeout=10)
    node.wait_limits([DEFAULT_W, DEFAULT_W, DEFAULT_W, 450.0])
    assert node.clocks() == [None, None, None, None]

    # SIGTERM to the agent: everything restored before it exits.
    assert node.agent is not None
    node.agent.send_signal(signal.SIGTERM)
    assert node.agent.wait(timeout=30) == 128 + signal.SIGTERM
    assert node.limits() == [DEFAULT_W] * 4


def test_a_connection_with_anothers_routing_id_cannot_act_for_it(
    accounts: Accounts, node: Node
) -> None:
    alice = accounts.add("a", member=True)
    bob = accounts.add("b", member=True)
    node.policy.write_text(_policy([alice, bob]))
    node.start()
    b = node.client(bob)
    a = node.client(alice)
    routing_id = "5a" + uuid.uuid4().hex
    assert b.ok("raw_open", id=routing_id, name="bob")["reply"] == "ready"
    assert b.ok("raw_power", watts=400, gpus=[1]) == {
        "ok": True,
        "reply": "control",
        "error": "",
        "message": "",
    }
    # Alice connects under Bob's routing id and asks for his lease back, then says goodbye
    # for him: the agent never hears of it (no handover), and nothing of Bob's changes.
    # (Bounded waits for what must not come: the agent answers a hello within milliseconds.)
    assert a.ok("raw_open", id=routing_id, name="alice", wait_ms=1000)["reply"] is None
    assert a.ok("raw_send", release=True, bye=True)["reply"] is None
    assert node.limits() == [DEFAULT_W, 400.0, DEFAULT_W, DEFAULT_W]
    assert b.ok("raw_power", watts=350, gpus=[1])["reply"] == "control"
    assert node.limits() == [DEFAULT_W, 350.0, DEFAULT_W, DEFAULT_W]

    # Nor can Alice restore what the system agent holds: --system --restore is root's.
    python, path = _python_for(alice)
    run = subprocess.run(
        [
            python,
            "-m",
            "zeus_async",
            "agent",
            "--system",
            "--restore",
            "--socket",
            str(node.socket),
        ],
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "ZEUS_ASYNC_DIR": str(node.base)},
        preexec_fn=_as_user(alice),
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert run.returncode == 1
    assert "a system agent (--system) runs as root" in run.stderr
    assert node.limits() == [DEFAULT_W, 350.0, DEFAULT_W, DEFAULT_W]


def test_the_agent_admits_only_the_readers_its_policy_names(accounts: Accounts, node: Node) -> None:
    alice = accounts.add("a", member=True)
    bob = accounts.add("b", member=True)
    node.policy.write_text(_policy([alice, bob], read=f'[read]\nusers = ["{alice}"]\n'))
    node.start()
    # Readers other than the group: the socket is everyone's, and the agent checks each
    # connection's user (SO_PEERCRED), not the kernel.
    assert stat.S_IMODE(os.stat(node.socket).st_mode) == 0o666
    assert node.client(alice).ok("open")["gpus"] == [0, 1, 2, 3]
    message = node.client(bob).refused("open", "PolicyDeniedError")
    assert message == (
        f"refused user {bob}: this system agent serves user {alice} ([read] of {node.policy})"
    )


def test_a_killed_system_agent_is_restored_by_restore_as_root(
    accounts: Accounts, node: Node
) -> None:
    alice = accounts.add("a", member=True)
    node.policy.write_text(_policy([alice]))
    node.start()
    a = node.client(alice)
    a.ok("open")
    a.ok("power", watts=260, gpus=[0, 1])
    assert node.limits() == [260.0, 260.0, DEFAULT_W, DEFAULT_W]
    assert node.agent is not None
    node.agent.kill()  # nothing restores: the journal (root's) is left
    node.agent.wait(timeout=10)
    # The client cannot restore a system agent's journal, and says who will.
    message = a.refused("window", "RuntimeError")
    assert "it is the node's system agent: the settings it held are restored when it" in message
    assert node.limits() == [260.0, 260.0, DEFAULT_W, DEFAULT_W]
    run = subprocess.run(
        [sys.executable, "-m", "zeus_async", "agent", "--system", "--restore"],
        env=dict(sim_env(CONFIG), ZEUS_ASYNC_SYSTEM_AGENT=str(node.socket)),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "2 setting(s) found to restore, 2 restored"
    assert node.limits() == [DEFAULT_W] * 4


def test_system_options_are_checked_before_serving(accounts: Accounts, tmp_path: Path) -> None:
    bad = tmp_path / "policy.toml"
    bad.write_text("[read]\nal = true\n")
    sock = tmp_path / "run" / "agent.sock"
    cases = [
        (["--system", "--group", accounts.group, "--policy", str(bad)], f"policy file {bad}: "),
        (["--system", "--group", "zs-no-such-group"], "group 'zs-no-such-group' does not exist"),
        (["--policy", str(bad)], "--policy needs --system"),
    ]
    for args, message in cases:
        run = subprocess.run(
            [sys.executable, "-m", "zeus_async", "agent", "--backend", "sim", *args],
            env=dict(sim_env(CONFIG), ZEUS_ASYNC_SYSTEM_AGENT=str(sock)),
            capture_output=True,
            text=True,
        )
        assert run.returncode == 1
        assert run.stderr.startswith(f"zeus-async agent: {message}"), run.stderr
        assert run.stderr.count("\n") == 1
    assert not sock.parent.exists()  # nothing made
