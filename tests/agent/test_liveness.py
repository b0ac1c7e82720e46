"""Liveness and identity that cannot be fooled (issue 33): zombies, restarts, two monitors in one
process, forged hellos, and nothing left behind in the private directory.

Real processes throughout; the simulated node's state is read from outside, as a driver shows it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from zeus_async import Monitor
from zeus_async._liveness import ProcessWatch, pid_alive
from zeus_async.agent.protocol import Control, Hello, Reply
from zeus_async.devices.sim_config import SimConfig
from zeus_async.errors import LeaseConflictError
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import sim_env, start_node_agent, start_restore_job

CONFIG = SimConfig(num_gpus=2, seed=5)

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    return sim_env(CONFIG, **extra)


def _limits() -> list[float]:
    return [g.power_limit_w for g in read_sim_node_state(CONFIG)]


def _restored() -> bool:
    return all(g.is_default(CONFIG) for g in read_sim_node_state(CONFIG))


def _wait(predicate: object, timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout_s``."""
    assert callable(predicate)
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, read_sim_node_state(CONFIG)
        time.sleep(0.01)
    return time.monotonic() - t0


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rindex(b")") + 2 :].split()[0] == b"Z"


@pytest.fixture(autouse=True)
def _sim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEUS_ASYNC_SIM", CONFIG.to_json())


# -- zombies ------------------------------------------------------------------------------------


def test_process_watch_calls_a_zombie_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = ProcessWatch(child.pid)
        assert watch.alive() and pid_alive(child.pid)
        child.kill()
        _wait(lambda: _zombie(child.pid), 10)  # exited, not reaped
        assert not watch.alive()
        assert not pid_alive(child.pid)
        assert not ProcessWatch(child.pid).alive()  # a watch started on a zombie
        watch.close()
    finally:
        child.wait()
    assert not pid_alive(child.pid)
    # A lease taken 10 s before this process started cannot be this process's: a reused pid.
    started_ns = int(psutil.Process().create_time() * 1e9)
    assert not pid_alive(os.getpid(), existed_at_ns=started_ns - 10**10)
    assert pid_alive(os.getpid(), existed_at_ns=started_ns + 10**9)


def test_a_zombie_owner_is_restored_and_its_parent_not_blocked() -> None:
    # A launcher that captures the job's output and reads it to the end before it reaps
    # (subprocess.run(capture_output=True)): the job is a zombie until then.
    proc, agent_pid = start_restore_job(env=_env())
    try:
        assert _limits() == [200.0, 200.0]
        proc.kill()
        _wait(lambda: _zombie(proc.pid), 10)
        took = _wait(_restored, 10)
        assert took < 5, took
        # Nothing holds the job's pipes: reading them to the end returns.
        proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        _wait(lambda: not pid_alive(agent_pid), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=20)


def test_a_node_agent_restores_a_zombie_clients_lease() -> None:
    agent = start_node_agent(_env())
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT.format(watts=300)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "capped"
        assert _limits() == [300.0, 300.0]
        client.kill()
        _wait(lambda: _zombie(client.pid), 10)
        assert _wait(_restored, 10) < 5
        client.communicate(timeout=10)
    finally:
        if client.poll() is None:
            client.kill()
            client.communicate(timeout=20)
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=20)


CLIENT = """
import time
from zeus_async import Monitor
m = Monitor()
assert m._process is not None and m._process.attached
m.set_power_limit({watts}).result(timeout=30)
print("capped", flush=True)
time.sleep(60)
"""


# -- restarts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "unreaped"])
def test_a_job_restarted_right_after_sigkill_gets_its_lease(reaped: bool) -> None:
    first, _ = start_restore_job(env=_env())
    second: subprocess.Popen[str] | None = None
    try:
        first.kill()
        if reaped:
            first.wait(timeout=20)
        # At once, as torchrun's elastic restart or a retry loop does: the dead job's agent may
        # still hold its leases; the new job waits for them instead of a LeaseConflictError.
        second, _ = start_restore_job(env=_env())
        assert _limits() == [200.0, 200.0]
        os.killpg(second.pid, signal.SIGINT)
        second.communicate(timeout=20)
        _wait(_restored, 10)
    finally:
        for proc in (first, second):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate(timeout=20)


def test_a_client_restarted_on_a_node_agent_gets_the_lease() -> None:
    agent = start_node_agent(_env())
    procs: list[subprocess.Popen[str]] = []
    try:
        for watts in (300, 250):
            client = subprocess.Popen(
                [sys.executable, "-c", CLIENT.format(watts=watts)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(),
            )
            procs.append(client)
            assert client.stdout is not None
            line = client.stdout.readline().strip()
            assert line == "capped", client.communicate(timeout=20)
            assert _limits() == [float(watts)] * 2
            client.kill()  # and the next one starts at once, before the agent's watch ran
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=20)
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=20)
    assert _restored()


# -- identity -----------------------------------------------------------------------------------


@pytest.fixture
def node_agent() -> Iterator[subprocess.Popen[str]]:
    proc = start_node_agent(_env())
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)


def test_two_monitors_in_one_process_are_two_holders(
    node_agent: subprocess.Popen[str],
) -> None:
    a = Monitor()
    b = Monitor()
    try:
        assert a._process is not None and a._process.attached
        a.set_power_limit(350, [0]).result(timeout=30)
        with pytest.raises(LeaseConflictError, match=r"held by client 'pid\d+ \(pid \d+, client"):
            b.set_power_limit(400, [0]).result(timeout=30)
        b.set_power_limit(400, [1]).result(timeout=30)
        b.close()  # puts back its own GPU only
        assert _limits() == [350.0, 700.0]
    finally:
        b.close()
        a.close()
    assert _limits() == [700.0, 700.0]


def test_two_private_monitors_in_one_process_conflict() -> None:
    with Monitor(agent=False) as a, Monitor(agent=False) as b:
        a.set_power_limit(350, [0]).result(timeout=30)
        with pytest.raises(LeaseConflictError, match="held by"):
            b.set_power_limit(400, [0]).result(timeout=30)
        b.close()
        assert _limits() == [350.0, 700.0]
    assert _limits() == [700.0, 700.0]


def _raw_client(endpoint: str) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    return ctx, sock


def _reply(sock: zmq.Socket[bytes]) -> Reply:
    assert sock.poll(20_000), "no reply"
    return msgspec.msgpack.decode(sock.recv(), type=Reply)


def test_a_forged_hello_is_refused(node_agent: subprocess.Popen[str]) -> None:
    from zeus_async.agent.client import node_agent_endpoint

    endpoint = node_agent_endpoint()
    assert endpoint is not None
    with Monitor() as victim:
        victim.set_power_limit(300, [0]).result(timeout=30)
        ctx, sock = _raw_client(endpoint)
        try:
            # Another process's pid: refused, whatever the name.
            sock.send(msgspec.msgpack.encode(Hello(os.getppid(), "pid1")))
            reply = _reply(sock)
            assert reply.kind == "error" and "a client speaks only for itself" in reply.message
            # Without a hello, requests are ignored: nothing released.
            release = Control(1, "release", 0.0, None, setting="power_limit")
            sock.send(msgspec.msgpack.encode(release))
            assert not sock.poll(500)
            # Its own hello, then a release: only its own (none) is released.
            sock.send(msgspec.msgpack.encode(Hello(os.getpid(), "")))
            assert _reply(sock).kind == "ready"
            sock.send(msgspec.msgpack.encode(Control(2, "release", 0.0, None)))
            assert _reply(sock).kind == "control"
            assert _limits() == [300.0, 700.0]
        finally:
            sock.close(linger=0)
            ctx.term()
    assert _limits() == [700.0, 700.0]


def test_a_private_agent_serves_its_owner_only(private_dir: Path) -> None:
    with Monitor(agent=False) as mon:
        assert mon._process is not None
        endpoint = mon._process.agent_endpoint
        helper = subprocess.run(
            [sys.executable, "-c", FORGER, endpoint, str(os.getpid())],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
            check=False,
        )
        assert helper.returncode == 0, helper.stderr
        forged, honest = helper.stdout.splitlines()
        assert "a client speaks only for itself" in forged
        assert f"this private agent serves process {os.getpid()}" in honest
        mon.set_power_limit(300, [1]).result(timeout=30)  # still serving its owner
        assert _limits() == [700.0, 300.0]
    assert _restored()


FORGER = """
import os, sys, msgspec, zmq
from zeus_async.agent.protocol import Hello, Reply, Bye
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send(msgspec.msgpack.encode(Bye()))  # not a client: ignored, the agent goes on
for pid in (int(sys.argv[2]), os.getpid()):  # the owner's pid (forged), then its own
    sock.send(msgspec.msgpack.encode(Hello(pid)))
    assert sock.poll(20000)
    print(msgspec.msgpack.decode(sock.recv(), type=Reply).message)
sock.close(linger=0)
"""


# -- nothing left behind ------------------------------------------------------------------------


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("a-"))


def test_closed_monitors_leave_no_socket(private_dir: Path) -> None:
    for _ in range(3):
        Monitor(agent=False, cpu_indices=[]).close()
    assert _leftovers(private_dir) == []


def test_a_killed_owners_files_are_swept_at_the_next_start(private_dir: Path) -> None:
    proc, agent_pid = start_restore_job(env=_env(ZEUS_ASYNC_DIR=str(private_dir)))
    try:
        assert len(_leftovers(private_dir)) == 1  # its agent's socket
        proc.kill()
        proc.wait(timeout=20)
        _wait(lambda: not pid_alive(agent_pid), 10)
        assert len(_leftovers(private_dir)) == 1
        Monitor(agent=False, cpu_indices=[]).close()
        assert _leftovers(private_dir) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=20)
