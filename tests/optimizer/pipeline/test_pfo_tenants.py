"""A PFO server that tenants can share, run as a real `zeus-async pfo-server` process: a job
is opened only by its token; `info` shows nobody else's jobs; floods of jobs and of unread
replies are bounded; jobs whose ranks never come are evicted; CURVE on TCP. Through all of
it, the honest tenant's job runs to its final schedule."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import zmq

from zeus_async.bus.curve import generate_certificates, load_client_keys
from zeus_async.optimizer.pipeline import JobInfo, PfoClient, PfoServerError, RankInfo
from zeus_async.optimizer.pipeline import protocol as p

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cli"))
from cli_helpers import free_port
from pfo_helpers import result_for

ADMIN = "admin-token-for-this-test"
FREQS = [1980, 1500, 1000]


def _rank(rank: int) -> RankInfo:
    return RankInfo(rank=rank, dp_rank=0, pp_rank=rank, tp_rank=0, available_frequencies=FREQS)


def _job(meta: str | None = None) -> JobInfo:
    return JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2, job_metadata=meta)


def _server(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([[["forward", 1500], ["backward", 1000]]] * 2))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "ZEUS_PFO_ADMIN_TOKEN": ADMIN}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "zeus_async", "pfo-server", "--bind", endpoint, "--no-dump",
            "--scheduler-args", json.dumps({"solution_path": str(plan)}), *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert endpoint in line, line + (proc.stderr.read() if proc.stderr else "")
    return proc, endpoint


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err  # stopped cleanly by SIGTERM


def _code(call: object, *args: object) -> str:
    with pytest.raises(PfoServerError) as err:
        call(*args)  # type: ignore[operator]
    return err.value.code


def test_jobs_are_opened_only_by_their_token(tmp_path: Path) -> None:
    server, ep = _server(tmp_path)
    try:
        rank0, rank1 = PfoClient(ep, timeout_s=10), PfoClient(ep, timeout_s=10)
        job = rank0.register_job(_job("victim"))
        token = rank0.tokens[job]
        assert len(token) >= 40
        rank1.join(job, token)
        rank0.register_rank(job, _rank(0))

        thief = PfoClient(ep, timeout_s=10)
        listing = thief.info()
        assert listing.jobs == [] and listing.jobs_total == 1  # no job ids without a token
        # Refused exactly as a job that does not exist is: probing reveals no job ids.
        unknown = "1999-01-01-00-00-00+dp1+pp2+tp1+PointSolution+victim"
        with pytest.raises(PfoServerError) as nothing:
            thief.info(unknown)
        with pytest.raises(PfoServerError) as refused:
            thief.info(job)
        assert refused.value.code == nothing.value.code == "unknown_job"
        assert refused.value.message == nothing.value.message.replace(unknown, job)
        assert _code(thief.register_rank, job, _rank(1)) == "unknown_job"  # take over rank 1
        assert _code(thief.get_schedule, job, 0) == "unknown_job"
        thief.join(job, "a-guess")
        assert _code(thief.get_schedule, job, 0) == "unknown_job"
        stolen = result_for(p.FrequencySchedule(rank=0, frequencies=[]))
        assert _code(thief.report, job, stolen) == "unknown_job"
        # None of it touched the job: the tenant's ranks go on to the final schedule.
        rank1.register_rank(job, _rank(1))
        for r in range(2):  # forged goodbyes from every rank end nothing (and get no answer)
            forger = PfoClient(ep, timeout_s=10)
            forger.join(job, "a-guess")
            forger.leave(job, r)
        time.sleep(0.3)
        ranks = (rank0, rank1)
        first = [c.get_schedule(job, r) for r, c in enumerate(ranks)]
        for c, reply in zip(ranks, first, strict=True):
            c.report(job, result_for(reply.schedule))
        final = [c.get_schedule(job, r) for r, c in enumerate(ranks)]
        assert [f.final for f in final] == [True, True]
        assert rank0.info(job).jobs[0].ranks_registered == 2
        admin = PfoClient(ep, timeout_s=10, admin_token=ADMIN)
        assert [j.job_id for j in admin.info().jobs] == [job]
        # The job ends when both its ranks have left (as their optimizers close).
        rank0.leave(job, 0)
        assert _wait_for(lambda: admin.info().jobs_total == 1) and admin.info().jobs != []
        rank1.leave(job, 1)
        assert _wait_for(lambda: admin.info().jobs_total == 0)
    finally:
        _stop(server)


def _wait_for(condition: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_jobs_that_end_free_their_client_and_memory_is_bounded(tmp_path: Path) -> None:
    # 2 jobs per client; 0.3 MiB of ranks and results per client.
    server, ep = _server(tmp_path, "--max-jobs-per-client", "2", "--max-client-mib", "0.3")
    try:
        admin = PfoClient(ep, timeout_s=10, admin_token=ADMIN)
        for round_ in range(3):  # jobs that end make room: 6 jobs in turn, 2 at most at once
            clients = [PfoClient(ep, timeout_s=10) for _ in range(2)]
            jobs = [c.register_job(_job(f"run{round_}-{i}")) for i, c in enumerate(clients)]
            if round_ == 0:
                err = _code(PfoClient(ep, timeout_s=10).register_job, _job())
                assert err == "busy"
            for c, job in zip(clients, jobs, strict=True):
                other = PfoClient(ep, timeout_s=10)  # rank 1, given the id and token by rank 0
                other.join(job, c.tokens[job])
                c.register_rank(job, _rank(0))
                other.register_rank(job, _rank(1))
                c.leave(job, 0)
                other.leave(job, 1)
            assert _wait_for(lambda: admin.info().jobs_total == 0), admin.info()

        # A rank listing more clocks than any GPU has is refused as it decodes.
        tenant = PfoClient(ep, timeout_s=10)
        job = tenant.register_job(JobInfo(pp_degree=64, dp_degree=1, tp_degree=1, world_size=64))
        many = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1])
        many.available_frequencies = list(range(2000, 0, -1))  # past MAX_CLOCKS (1024)
        assert _code(tenant.register_rank, job, many) == "bad_request"
        # Ranks of 1,024 clocks (~56 kB charged each, their state included): 0.3 MiB holds 5.
        big = list(range(2024, 1000, -1))
        registered = 0
        with pytest.raises(PfoServerError) as err:
            for r in range(64):
                tenant.register_rank(
                    job,
                    RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=big),
                )
                registered += 1
        assert err.value.code == "busy" and "max_client_mib" in err.value.message
        assert registered == 5
    finally:
        _stop(server)


def test_floods_are_bounded_and_never_used_jobs_evicted(tmp_path: Path) -> None:
    server, ep = _server(
        tmp_path, "--max-jobs-per-client", "5", "--max-jobs", "8", "--registration-timeout", "2"
    )
    try:
        tenant = PfoClient(ep, timeout_s=10)
        job = tenant.register_job(_job("honest"))
        tenant.register_rank(job, _rank(0))
        tenant.register_rank(job, _rank(1))

        flooder = PfoClient(ep, timeout_s=10)
        made = []
        with pytest.raises(PfoServerError) as err:
            for _ in range(100):
                made.append(flooder.register_job(_job()))
        # 5 per client, and this machine's clients all share one address (127.0.0.1).
        assert err.value.code == "busy" and "5 jobs are registered from this client" in str(
            err.value
        )
        assert len(made) == 4  # the tenant's job counts for this address too
        admin = PfoClient(ep, timeout_s=10, admin_token=ADMIN)
        assert admin.info().jobs_total == 5

        # A client that sends and never reads: the server's memory stays bounded.
        rss_before = psutil.Process(server.pid).memory_info().rss
        flood = subprocess.run(
            [sys.executable, "-c", _FLOOD, ep, "200000"], capture_output=True, text=True,
            timeout=120, check=True,
        )  # fmt: skip
        assert int(flood.stdout) == 200_000  # the server kept reading
        time.sleep(1.0)
        grown = psutil.Process(server.pid).memory_info().rss - rss_before
        assert grown < 40 * 2**20, f"the server grew by {grown / 2**20:.1f} MiB"

        # The jobs whose ranks never came are gone after the registration timeout (2 s).
        deadline = time.monotonic() + 10
        while admin.info().jobs_total > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [j.job_id for j in admin.info().jobs] == [job]
        assert flooder.register_job(_job()) not in made  # room again
        assert tenant.get_schedule(job, 0).round == 0  # the tenant's job carries on
    finally:
        _stop(server)


_FLOOD = """
import sys, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.RCVHWM, 10)
sock.setsockopt(zmq.SNDTIMEO, 10000)
sock.connect(sys.argv[1])
import msgspec
payload = msgspec.msgpack.encode({"type": "info", "job_id": ""})
sent = 0
for i in range(int(sys.argv[2])):
    try:
        sock.send_multipart([b"", i.to_bytes(8, "little"), payload])
        sent += 1
    except zmq.Again:
        break
print(sent)
"""


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (Linux's ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _at_once(endpoint: str, n: int, payload: bytes) -> Counter[str]:
    """``n`` clients send ``payload`` at once; how they were answered."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        socks = [ctx.socket(zmq.DEALER) for _ in range(n)]
        poller = zmq.Poller()
        for sock in socks:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            poller.register(sock, zmq.POLLIN)
        for sock in socks:
            sock.send_multipart([b"", bytes(8), payload], copy=False)
        answers: Counter[str] = Counter()
        while sum(answers.values()) < n:
            ready = poller.poll(60_000)
            assert ready, f"{n - sum(answers.values())} requests were not answered"
            for sock, _ in ready:
                reply = p.reply_decoder.decode(sock.recv_multipart()[-1])
                answers[reply.code if isinstance(reply, p.ErrorReply) else "answered"] += 1
                poller.unregister(sock)
        return answers
    finally:
        ctx.destroy(linger=0)


def _report(mib: float, job_id: str = "none", token: str = "none") -> bytes:
    """A profiling report of ``mib`` MiB (msgpack spends 9 bytes on a float)."""
    floats = [0.5] * int(mib * 2**20 / 2 / 9)
    result = {"rank": 0, "iter_time": floats, "iter_energy": floats}
    return msgspec.msgpack.encode(
        {"type": "report", "job_id": job_id, "token": token, "result": result}
    )


def test_requests_sent_at_once_are_bounded_in_bytes(tmp_path: Path) -> None:
    # 40 clients send a 15 MiB report each at once (600 MiB). Before, the server held all of
    # them (in libzmq's queues) while it decoded them one by one: 693 MiB at its peak. Now it
    # takes each from libzmq as it arrives, holds at most max_queue_mib (64) of them, and
    # answers the rest `busy` at once. What remains is what libzmq holds of the messages still
    # arriving (it receives a whole message before the server sees it): 210-360 MiB here.
    server, ep = _server(tmp_path)
    try:
        rss = psutil.Process(server.pid).memory_info().rss
        forged = _at_once(ep, 40, _report(15))  # about no job: refused once skimmed
        grown = _peak_rss(server.pid) - rss
        assert set(forged) <= {"busy", "unknown_job"}, forged
        assert grown < 480 * 2**20, f"the server grew by {grown / 2**20:.0f} MiB at its peak"

        # A tenant's own reports are decoded in full (~0.1 s each): they queue up, and those
        # past 64 MiB are answered busy.
        tenant = PfoClient(ep, timeout_s=10)
        job = tenant.register_job(_job())
        mine = _at_once(ep, 40, _report(15, job, tenant.tokens[job]))
        assert set(mine) == {"busy", "bad_rank"} and mine["busy"] >= 20, mine  # rank 0: none
        tenant.register_rank(job, _rank(0))  # the server serves on
    finally:
        _stop(server)


def test_curve_on_the_pfo_server(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_certificates(keys, "server")
    generate_certificates(keys / "clients", "rank")
    server, ep = _server(
        tmp_path,
        "--curve-secret", str(keys / "server.key_secret"),
        "--curve-allow", str(keys / "clients"),
    )  # fmt: skip
    try:
        curve = load_client_keys(
            keys / "clients" / "rank.key_secret", server_public_file=keys / "server.key"
        )
        good = PfoClient(ep, timeout_s=10, curve=curve)
        assert good.register_job(_job())
        plain = PfoClient(ep, timeout_s=1)
        with pytest.raises(TimeoutError):
            plain.register_job(_job())
    finally:
        _stop(server)
