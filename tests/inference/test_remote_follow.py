"""RemoteMeter(follow=...): one process receives the results of requests another sent.

Real processes: a node agent on the simulator, a sender process (the engine core, in vLLM),
and followers in this process or a raw socket that never reads.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from test_remote import CONFIG, _client, _start_agent, _stop, _totals, _wait

from zeus_async.agent import requests as node_requests
from zeus_async.agent.protocol import AgentConfig, Hello, Reply
from zeus_async.agent.requests import NodeRequests, _asked
from zeus_async.agent.server import NODE_SOCKET
from zeus_async.inference.attribution import Attribution
from zeus_async.inference.remote import RemoteMeter
from zeus_async.integrations import vllm as plugin
from zeus_async.testing.procs import sim_env


@pytest.mark.slow
def test_a_follower_gets_every_result_of_the_sender_once(private_dir: Path) -> None:
    agent = _start_agent(private_dir)
    n = 20
    seen: list[tuple[str, str]] = []

    def on_followed(name: str, out: Attribution) -> None:
        seen.extend((name, rid) for rid in out.requests)

    try:
        # Follows "core" and a name no client ever takes.
        with RemoteMeter(name="front", batch_s=0.02, follow=("core", "ghost")) as front:
            front.subscribe_followed(on_followed)
            assert front.wait_connected()
            # Its own requests have the same ids as the sender's: never mixed.
            for i in range(3):
                front.begin(f"r{i}", gpus=(1,))
                front.end(f"r{i}", tokens_in=1, tokens_out=100 + i)
            sender, other = _client("core", n), _client("other", n)
            for p in (sender, other):
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            outs = []
            for p in (sender, other):
                out, err = p.communicate(timeout=60)
                assert p.returncode == 0, err
                outs.append(json.loads(out.strip().splitlines()[-1]))
            _wait(lambda: len(front.results_from("core")) == n, 10, "followed results")
            _wait(lambda: len(front.results()) == 3, 10, "own results")
            time.sleep(0.3)  # anything more (a duplicate, the other's) would come by now
            followed = {r.request_id: r for r in front.results_from("core")}
            own = {r.request_id: r for r in front.results()}
            ghost = front.results_from("ghost")
            totals_front = front.totals
        totals = _totals(private_dir)
    finally:
        _stop(agent)
    ids = {f"r{i}" for i in range(n)}
    # The sender still gets its own, all of them.
    assert set(outs[0]["results"]) == ids and set(outs[1]["results"]) == ids
    # The follower: each of the sender's results once, under the sender's ids, the same
    # figures; nothing of "other", nothing of "ghost".
    assert sorted(seen) == sorted(("core", rid) for rid in ids)
    assert set(followed) == ids and ghost == []
    for rid, (energy, gpus, reason, tokens_out, model) in outs[0]["results"].items():
        r = followed[rid]
        assert math.isclose(r.energy_j, energy, rel_tol=1e-12)
        assert {str(g): e for g, e in r.gpu_energy_j.items()} == gpus
        assert (r.finish_reason, r.tokens_out, r.model) == (reason, tokens_out, model)
    # Its own results are its own (same ids, apart): tokens 100.., GPU 1.
    assert set(own) == {"r0", "r1", "r2"}
    assert [own[f"r{i}"].tokens_out for i in range(3)] == [100, 101, 102]
    assert all(set(r.gpu_energy_j) == {1} for r in own.values())
    assert front.settled("r0") is own["r0"] and front.settled_from("core", "r0") is followed["r0"]
    assert front.settled_from("other", "r0") is None
    assert totals_front.results == 3 and totals_front.followed_results == n
    assert totals.followed == n and totals.returned == 2 * n + 3


@pytest.mark.slow
def test_a_follower_that_never_reads_holds_nothing_up(private_dir: Path) -> None:
    agent = _start_agent(private_dir)
    ctx = zmq.Context()
    deaf = ctx.socket(zmq.DEALER)
    deaf.rcvhwm = 1
    deaf.linger = 0
    try:
        deaf.connect(f"ipc://{private_dir / NODE_SOCKET}")
        deaf.send(
            msgspec.msgpack.encode(Hello(os.getpid(), "deaf", None, gpus=[], follow=["core"]))
        )
        assert deaf.poll(5000)
        assert msgspec.msgpack.decode(deaf.recv(), type=Reply).kind == "ready"
        # From now on it reads nothing. The sender sends many requests, fast.
        n = 3000
        with RemoteMeter(name="core", batch_s=0.02, batch_edges=500) as core:
            assert core.wait_connected()
            t0 = time.time_ns()
            for i in range(n):
                core.begin(f"r{i}", gpus=(0,), at_ns=t0 + i * 1000)
                core.end(f"r{i}", tokens_out=1, at_ns=t0 + i * 1000 + 500)
            _wait(lambda: len(core.results()) == n, 30, "the sender's results")
        totals = _totals(private_dir)
    finally:
        deaf.close(linger=0)
        ctx.term()
        _stop(agent)
    # The sender got all its own; the agent pushed each to the follower once (what the
    # follower's socket does not take, ZeroMQ drops at its high-water mark).
    assert totals.returned == n and totals.followed == n
    assert totals.requests == n and totals.bad_input == {}


class _Who:
    def __init__(self, ident: bytes, name: str, uid: int | None = 1000) -> None:
        self.ident, self.name, self.uid = ident, name, uid
        self.visible: list[int] | None = None

    def to_agent(self, gpus: list[int] | None) -> list[int] | None:
        return gpus


def test_follow_tables_are_bounded_and_forgotten() -> None:
    sent: list[tuple[bytes, Reply]] = []
    clients: dict[bytes, Any] = {}
    no_runtime: Any = None  # follow / left never touch it
    nr = NodeRequests(
        AgentConfig(endpoint="ipc://x"), no_runtime, lambda i, r: sent.append((i, r)), clients
    )
    greedy = _Who(b"g", "greedy")
    nr.follow(greedy, [f"n{i}" for i in range(100)] + ["", "x" * 500])
    assert nr._following[b"g"] == [f"n{i}" for i in range(node_requests._MAX_FOLLOW)]
    many = [_Who(bytes([i]) * 2, f"f{i}") for i in range(node_requests._MAX_FOLLOWERS + 10)]
    for who in many:
        nr.follow(who, ["core"])
    assert len(nr._followers["core"]) == node_requests._MAX_FOLLOWERS
    for who in [greedy, *many]:
        nr.left(who)
    assert nr._followers == {} and nr._following == {}
    assert sent == []


def test_only_the_senders_user_or_root_follows_its_results() -> None:
    # A system agent serves several users: following a name gets another user's results
    # only for root.
    from zeus_async.inference.attribution import RequestEnergy

    sent: list[tuple[bytes, Reply]] = []
    sender = _Who(b"s", "core", uid=1000)
    same, other, root = _Who(b"a", "a", 1000), _Who(b"b", "b", 2000), _Who(b"r", "r", 0)
    clients: dict[bytes, Any] = {c.ident: c for c in (sender, same, other, root)}
    no_runtime: Any = None
    nr = NodeRequests(
        AgentConfig(endpoint="ipc://x"), no_runtime, lambda i, r: sent.append((i, r)), clients
    )
    for who in (same, other, root):
        nr.follow(who, ["core"])
    nr._owner["core/r1"] = (b"s", "r1", "core", 1000)
    out = Attribution(0, 10, "equal")
    out.requests["core/r1"] = RequestEnergy("core/r1", 1.0, {0: 1.0}, None, None, 0, 0, 0.0, "")
    nr._route(out)
    got = {ident: [r.request_id for r in reply.requests] for ident, reply in sent}
    assert got == {b"s": ["r1"], b"a": ["r1"], b"r": ["r1"]}  # not b"b"
    assert nr.followed == 2


def test_the_name_asked_drops_the_agents_uniqueness_suffix() -> None:
    assert _asked("vllm-core0") == "vllm-core0"
    assert _asked("vllm-core0#2") == "vllm-core0"
    assert _asked("a#b") == "a#b" and _asked("#3") == "#3" and _asked("x#") == "x#"


# An engine core as the scheduler hook meters it: vLLM's internal ids, its meter named
# core_meter_name(0); then its own results' ids, as JSON.
CORE = """
import json, sys, time
from zeus_async.inference.remote import RemoteMeter
from zeus_async.integrations.vllm import core_meter_name
m = RemoteMeter(name=core_meter_name(0), batch_s=0.02)
m.wait_connected()
ids = [f"chatcmpl-{i}-{i:08x}" for i in range(5)]
for rid in ids:
    m.begin(rid, gpus=(0,))
    time.sleep(0.01)
    m.end(rid, tokens_in=5, tokens_out=7)
deadline = time.monotonic() + 20
while len(m.results()) < len(ids) and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({r.request_id: r.energy_j for r in m.results()}), flush=True)
m.close()
"""


@pytest.mark.slow
def test_the_vllm_front_end_finds_the_cores_results_by_the_clients_id(
    private_dir: Path,
) -> None:
    agent = _start_agent(private_dir)
    try:
        front = plugin.follow_engine_cores(1)
        assert front is not None and front.wait_connected()
        core = subprocess.run(
            [sys.executable, "-c", CORE],
            capture_output=True,
            text=True,
            timeout=60,
            env=sim_env(CONFIG),
        )
        assert core.returncode == 0, core.stderr
        sent = json.loads(core.stdout.strip().splitlines()[-1])
        assert len(sent) == 5
        _wait(lambda: all(plugin.request_energy(f"chatcmpl-{i}") for i in range(5)), 10, "got")
        for i in range(5):
            r = plugin.request_energy(f"chatcmpl-{i}")
            assert r is not None and r.request_id == f"chatcmpl-{i}-{i:08x}"
            assert r.energy_j == sent[r.request_id] and r.tokens_out == 7
    finally:
        plugin._unfollow()
        _stop(agent)
