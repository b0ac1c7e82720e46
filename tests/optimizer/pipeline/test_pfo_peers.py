"""Who a PFO client is, and what a flood of one costs the others (real server object, real
sockets, fake clock): rotating loopback addresses are one client, ipc clients are their uid,
CURVE clients their key; registrations left incomplete give their places up to an honest job
after ``registration_grace``; the request queue is bounded in bytes, the heaviest client's
requests dropped first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq
from pfo_helpers import FakeClock, running_server

from zeus_async.bus.curve import (
    CurveClientKeys,
    apply_client_keys,
    generate_certificates,
    load_client_keys,
)
from zeus_async.optimizer.pipeline import JobInfo, PfoClient, PfoServer, PfoServerError, RankInfo
from zeus_async.optimizer.pipeline import protocol as p
from zeus_async.optimizer.pipeline.settings import PfoSettings

GRACE = 5.0  # registration_grace's default
#: A job whose ranks never come (the flood's).
NEVER = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
ONE = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
RANK0 = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1500])


def _plan(tmp_path: Path) -> dict[str, Any]:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([[["forward", 1500]]]))
    return {"scheduler": "PointSolution", "scheduler_args": {"solution_path": str(plan)}}


def _answer(reply: p.Reply) -> str:
    return reply.code if isinstance(reply, p.ErrorReply) else str(reply.__struct_config__.tag)


def _register_from(ctx: zmq.Context[Any], endpoint: str, source: str) -> str:
    """``register_job`` sent from loopback address ``source``; the answer (``job``, or the
    error code)."""
    port = endpoint.rsplit(":", 1)[1]
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{source}:0;127.0.0.1:{port}")  # bound to that source address
    try:
        sock.send_multipart([b"", b"\0" * 8, p.encoder.encode(p.RegisterJob(job=NEVER))])
        assert sock.poll(10_000), "no reply"
        return _answer(p.reply_decoder.decode(sock.recv_multipart()[-1]))
    finally:
        sock.close()


def _jobs_by_client(server: Any) -> Counter[str]:
    return server.call(lambda: Counter(j.owner for j in server.jobs.values()))  # type: ignore[no-any-return]


def test_rotating_loopback_addresses_are_one_client_and_an_honest_job_gets_in(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    with running_server(tmp_path, clock, **_plan(tmp_path)) as (server, ep):
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            # 1,000 registrations, each from another loopback address (and /24, and /16):
            # one client, held to max_jobs_per_client (64). Before, each address was a client
            # of its own, and the flood filled max_jobs (1,000) for registration_timeout.
            flood = Counter(
                _register_from(ctx, ep, f"127.{1 + i % 250}.{i // 250}.7") for i in range(1000)
            )
            assert flood == {"job": 64, "busy": 936}
            assert _jobs_by_client(server) == {"loopback": 64}

            honest = PfoClient(ep, timeout_s=10)
            with pytest.raises(PfoServerError) as err:
                honest.register_job(ONE)  # the flood's registrations are all fresh
            assert err.value.code == "busy"
            assert "64 jobs are registered from this client (loopback)" in err.value.message
            assert "registration_grace" in err.value.message

            clock.now += GRACE  # the flood's registrations have been incomplete for 5 s
            job = honest.register_job(ONE)  # takes the place of the oldest one
            honest.register_rank(job, RANK0)  # complete: no registration displaces it
            assert server.registrations_displaced == 1
            assert honest.get_schedule(job, 0).round == 0  # the job runs

            # The flood goes on: its stale registrations make room for it, its fresh ones
            # do not, and the honest job keeps its place.
            more = Counter(_register_from(ctx, ep, f"127.9.{i}.1") for i in range(100))
            assert more == {"job": 63, "busy": 37}
            assert server.registrations_displaced == 64
            assert honest.info(job).jobs[0].ranks_registered == 1
        finally:
            ctx.destroy(linger=0)


@contextmanager
def _curve(tmp_path: Path, *names: str) -> Iterator[tuple[dict[str, Any], list[CurveClientKeys]]]:
    keys = tmp_path / "keys"
    generate_certificates(keys, "server")
    for name in names:
        generate_certificates(keys / "clients", name)
    settings = {
        "curve_secret": str(keys / "server.key_secret"),
        "curve_allow": str(keys / "clients"),
    }
    yield (
        settings,
        [
            load_client_keys(
                keys / "clients" / f"{n}.key_secret", server_public_file=keys / "server.key"
            )
            for n in names
        ],
    )


def test_curve_keys_are_clients_and_the_heaviest_gives_up_its_stale_registrations(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    with _curve(tmp_path, "flood", "light", "honest") as (curve, keys):
        settings = {**_plan(tmp_path), **curve, "max_jobs": 6}
        with running_server(tmp_path, clock, **settings) as (server, ep):
            flood, light, honest = (PfoClient(ep, timeout_s=10, curve=k) for k in keys)
            names = {k.public.decode(): n for k, n in zip(keys, "FLH", strict=True)}

            def held() -> dict[str, int]:  # jobs per client, a client named "key <z85>"
                return {
                    names[c.removeprefix("key ")]: n for c, n in _jobs_by_client(server).items()
                }

            light_job = light.register_job(NEVER)  # one slow job: incomplete too
            flooded = [flood.register_job(NEVER) for _ in range(5)]
            assert held() == {"L": 1, "F": 5}  # one client per key, all from 127.0.0.1
            with pytest.raises(PfoServerError) as err:
                honest.register_job(ONE)
            assert err.value.code == "busy" and "maximum of 6 jobs" in err.value.message

            clock.now += GRACE
            # The flood holds the most incomplete registrations: its oldest makes room (not
            # the light client's older one).
            job = honest.register_job(ONE)
            honest.register_rank(job, RANK0)
            assert held() == {"L": 1, "F": 4, "H": 1}
            with pytest.raises(PfoServerError) as gone:
                flood.register_rank(flooded[0], RANK0)
            assert gone.value.code == "unknown_job"
            # The light client holds fewer than the flood: it takes the flood's places too.
            light.register_job(NEVER)
            assert held() == {"L": 2, "F": 3, "H": 1}
            # The flood holds the most: it can only replace its own stale registrations, never
            # the light client's (older, but its client holds fewer).
            for _ in range(3):
                flood.register_job(NEVER)
                assert held() == {"L": 2, "F": 3, "H": 1}
            with pytest.raises(PfoServerError) as err:
                flood.register_job(NEVER)  # every one of its own is fresh now
            assert err.value.code == "busy"
            assert light.info(light_job).jobs[0].state == "registering"
            assert server.registrations_displaced == 5


_IPC_REGISTER = """
import os, sys, msgspec, zmq
if len(sys.argv) > 2:  # become another user (the interpreter is already loaded)
    os.setgroups([])
    os.setgid(int(sys.argv[2]))
    os.setuid(int(sys.argv[2]))
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
job = {"pp_degree": 1, "dp_degree": 1, "tp_degree": 1, "world_size": 1}
sock.send_multipart([b"", bytes(8), msgspec.msgpack.encode({"type": "register_job", "job": job})])
assert sock.poll(10_000)
reply = msgspec.msgpack.decode(sock.recv_multipart()[-1])
print(reply.get("code") or reply["type"], reply.get("message", ""))
"""


def _register_over_ipc(endpoint: str, uid: int | None = None) -> tuple[str, str]:
    """``register_job`` from a process of its own (as ``uid``): the answer and message."""
    argv = [sys.executable, "-c", _IPC_REGISTER, endpoint, *([str(uid)] if uid is not None else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    answer, _, message = done.stdout.strip().partition(" ")
    return answer, message


@contextmanager
def _ipc_server(tmp_path: Path, **settings: Any) -> Iterator[tuple[Any, str]]:
    folder = Path(tempfile.mkdtemp(prefix="pfo-ipc-"))  # short: ipc paths are ~107 bytes
    folder.chmod(0o755)
    try:
        with running_server(
            tmp_path, endpoint=f"ipc://{folder}/pfo", **_plan(tmp_path), **settings
        ) as (server, ep):
            (folder / "pfo").chmod(0o777)  # another user may connect
            yield server, ep
    finally:
        (folder / "pfo").unlink(missing_ok=True)
        folder.rmdir()


def test_ipc_processes_of_one_user_are_one_client(tmp_path: Path) -> None:
    with _ipc_server(tmp_path, max_jobs_per_client=2) as (server, ep):
        # Three processes of this user: one client (before, each pid was a client).
        answers = [_register_over_ipc(ep) for _ in range(3)]
        assert [a for a, _ in answers] == ["job", "job", "busy"]
        assert f"2 jobs are registered from this client (uid {os.getuid()})" in answers[2][1]
        assert _jobs_by_client(server) == {f"uid {os.getuid()}": 2}


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_ipc_another_user_is_another_client(tmp_path: Path) -> None:
    with _ipc_server(tmp_path, max_jobs_per_client=1) as (server, ep):
        assert _register_over_ipc(ep)[0] == "job"
        assert _register_over_ipc(ep)[0] == "busy"
        assert _register_over_ipc(ep, uid=65534)[0] == "job"  # nobody: a client of its own
        assert _jobs_by_client(server) == {"uid 0": 1, "uid 65534": 1}


def _request(mib: float, **fields: Any) -> bytes:
    """A request of ``mib`` MiB: an ``info`` whose token is that long (it opens nothing)."""
    return msgspec.msgpack.encode(
        {"type": "info", "job_id": "", **fields, "token": "x" * int(mib * 2**20)}
    )


def test_the_request_queue_is_bounded_in_bytes_and_the_heaviest_client_yields(
    tmp_path: Path,
) -> None:
    # The server's loop does not run: the test takes the requests off the socket itself, as the
    # loop does before handling each (_drain), then handles them in the loop's order.
    with _curve(tmp_path, "heavy", "light") as (curve, keys):
        settings = PfoSettings(dump_dir=str(tmp_path), **_plan(tmp_path), **curve)
        server = PfoServer(settings, "tcp://127.0.0.1:*", clock=FakeClock(), evict_period_s=3600)
        ep = server.bind()
        sock = server._sock
        assert sock is not None
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            heavy, light = (ctx.socket(zmq.DEALER) for _ in range(2))
            for s, k in ((heavy, keys[0]), (light, keys[1])):
                apply_client_keys(s, k)
                s.connect(ep)
            h, lt = (f"key {k.public.decode()}" for k in keys)

            def take(n: int) -> None:  # until n more requests are queued or refused
                total = server.requests_refused + server._queued_count + n
                while server.requests_refused + server._queued_count < total:
                    assert sock.poll(10_000), "the requests did not arrive"
                    server._drain(sock)

            def answer(s: zmq.Socket[Any]) -> tuple[bytes, str]:
                assert s.poll(10_000), "no answer"
                frames = s.recv_multipart()
                return frames[1], _answer(p.reply_decoder.decode(frames[-1]))

            for i in range(5):  # 5 x 15 MiB: 4 fit in 64 MiB (max_queue_mib), the 5th does not
                heavy.send_multipart([b"", bytes([i]) * 8, _request(15)])
            take(5)
            assert (server._queued_count, server.requests_refused) == (4, 1)
            assert answer(heavy) == (bytes([4]) * 8, "busy")  # refused, not held

            # A light client's 10 MiB does not fit either: the heavy client's newest goes.
            light.send_multipart([b"", b"L" * 8, _request(10)])
            take(1)
            assert (server._queued_count, server.requests_refused) == (4, 2)
            assert answer(heavy) == (bytes([3]) * 8, "busy")
            assert server.queued_bytes_peak <= 64 * 2**20

            # Clients take turns; each one's requests in order.
            queued = [server._next_request() for _ in range(4)]
            assert [q.client for q in queued] == [h, lt, h, h]
            assert server._queued_bytes == 0
            for q in queued:
                anyio.run(server._handle, q)
            assert [answer(heavy) for _ in range(3)] == [(bytes([i]) * 8, "info") for i in range(3)]
            assert answer(light) == (b"L" * 8, "info")
        finally:
            ctx.destroy(linger=0)
            sock.close(linger=0)
            if server._auth is not None:
                server._auth.stop()
