"""PFO server under hostile load: memory with 10,000 flooded jobs and with a client that never
reads its replies.

Each case starts its own ``zeus-async pfo-server`` process and reads its resident memory (RSS)
before and after:

* ``jobs, default limits``: one client registers 10,000 jobs; the per-client limit (64) refuses
  the rest with ``busy``;
* ``jobs, limits raised``: the same with ``--max-jobs 20000 --max-jobs-per-client 20000``, so all
  10,000 are held (the memory a job costs), then ``--registration-timeout`` evicts them (their
  ranks never come) and the count falls back to 0;
* ``unread replies``: a client sends ``--requests`` ``info`` requests and never reads; the
  server's reply queue to it is bounded (``REPLY_QUEUE``), so its memory stays flat;
* ``big ranks``: one tenant registers a job of 16,384 ranks, each listing 1,024 clocks (the
  most a rank may), until ``max_client_mib`` (default 256) refuses it with ``busy``;
* ``rotating addresses``: ``--rotating`` (1,000) jobs registered, each from its own loopback
  source address (``tcp://127.A.B.7:0;127.0.0.1:PORT``), their ranks never sent; then an honest
  client registers a job, retrying on ``busy``, and the time it waited is reported (a job whose
  ranks never come used to hold its place for ``registration_timeout``, 600 s);
* ``big requests``: ``--big`` (40) clients send a 15 MiB profiling report each at once, about
  no job, then (``a job token``) about a job of theirs, so that each is decoded in full; the
  server's peak RSS (``VmHWM``, the ``peak`` column of every row) and how the requests were
  answered (``busy``: past ``max_queue_mib``, 64).

Run: ``.venv/bin/python bench/hostile/bench_pfo_flood.py [--jobs 10000] [--requests 500000]
[--rotating 1000] [--big 40] [--only rotating,big]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import psutil
import zmq

from zeus_async.optimizer.pipeline import JobInfo, PfoClient, PfoServerError, RankInfo
from zeus_async.optimizer.pipeline import protocol as p

ADMIN = "bench-admin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server(*extra: str) -> tuple[subprocess.Popen[str], str]:
    tmp = Path(tempfile.mkdtemp(prefix="pfo-flood-"))
    plan = tmp / "plan.json"
    plan.write_text(json.dumps([[["forward", 1500]]]))
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "zeus_async", "pfo-server", "--bind", endpoint, "--no-dump",
            "--log-level", "WARNING",
            "--scheduler-args", json.dumps({"solution_path": str(plan)}), *extra,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "ZEUS_PFO_ADMIN_TOKEN": ADMIN},
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.readline()
    return proc, endpoint


def _rss_mib(proc: subprocess.Popen[str]) -> float:
    return float(psutil.Process(proc.pid).memory_info().rss) / 2**20


def _flood_jobs(endpoint: str, n: int) -> tuple[int, int, float]:
    client = PfoClient(endpoint, timeout_s=30)
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
    held = busy = 0
    t0 = time.perf_counter()
    for _ in range(n):
        try:
            client.register_job(job)
            held += 1
        except PfoServerError as exc:
            assert exc.code == "busy", exc
            busy += 1
    client.close()
    return held, busy, time.perf_counter() - t0


def _jobs_total(endpoint: str) -> int:
    admin = PfoClient(endpoint, timeout_s=30, admin_token=ADMIN)
    try:
        return admin.info().jobs_total
    finally:
        admin.close()


def _never_read(endpoint: str, n: int) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.connect(endpoint)
    payload = msgspec.msgpack.encode({"type": "info", "job_id": ""})
    t0 = time.perf_counter()
    for i in range(n):
        sock.send_multipart([b"", i.to_bytes(8, "little"), payload])
    elapsed = time.perf_counter() - t0
    time.sleep(1.0)  # let the server work through what is queued
    sock.close()
    ctx.term()
    return elapsed


def _big_ranks(endpoint: str) -> tuple[int, str, float]:
    client = PfoClient(endpoint, timeout_s=30)
    n = 16_384
    job = client.register_job(JobInfo(pp_degree=n, dp_degree=1, tp_degree=1, world_size=n))
    clocks = list(range(2024, 1000, -1))
    registered, why = 0, "all registered"
    t0 = time.perf_counter()
    for r in range(n):
        info = RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=clocks)
        try:
            client.register_rank(job, info)
        except PfoServerError as exc:
            why = f"then {exc.code} ({'max_client_mib' in exc.message and 'max_client_mib'})"
            break
        registered += 1
    took = time.perf_counter() - t0
    client.close()
    return registered, why, took


def _peak_mib(proc: subprocess.Popen[str]) -> float:
    """The process's peak RSS so far (Linux ``VmHWM``; its current RSS elsewhere)."""
    try:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return _rss_mib(proc)


def _register_from(ctx: zmq.Context[Any], endpoint: str, source: str) -> str:
    """One ``register_job`` from loopback address ``source``; the reply's type or error code."""
    port = endpoint.rsplit(":", 1)[1]
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{source}:0;127.0.0.1:{port}")
    try:
        job = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
        sock.send_multipart([b"", b"\0" * 8, p.encoder.encode(p.RegisterJob(job=job))])
        if not sock.poll(10_000):
            return "no reply"
        reply = p.reply_decoder.decode(sock.recv_multipart()[-1])
        return reply.code if isinstance(reply, p.ErrorReply) else str(reply.__struct_config__.tag)
    finally:
        sock.close()


def _rotating_flood(endpoint: str, n: int, wait_s: float) -> tuple[Counter[str], float, str]:
    """``n`` registrations from rotating loopback addresses, then an honest job's: how the
    flood was answered, and how long the honest job waited to register (retrying on busy)."""
    ctx: zmq.Context[Any] = zmq.Context()
    answers: Counter[str] = Counter()
    for i in range(n):  # 127.1.0.7, 127.2.0.7, ...: another /24 (and /16) each time
        answers[_register_from(ctx, endpoint, f"127.{1 + i % 250}.{i // 250}.7")] += 1
    ctx.term()
    honest = PfoClient(endpoint, timeout_s=30)
    t0 = time.perf_counter()
    note = f"still busy after {wait_s:g} s"
    while time.perf_counter() - t0 < wait_s:
        try:
            job = honest.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
        except PfoServerError as exc:
            assert exc.code == "busy", exc
            time.sleep(0.1)
            continue
        honest.register_rank(
            job, RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1500])
        )
        note = "registered"
        break
    waited = time.perf_counter() - t0
    honest.close()
    return answers, waited, note


def _big_requests(
    endpoint: str, n: int, mib: float, *, tenant: bool = False
) -> tuple[Counter[str], float]:
    """``n`` clients send a ``mib`` MiB request each at once (a profiling report, costly to
    decode): about no job, or (``tenant``) about a job of theirs, with its token, so that the
    server decodes each in full (then refuses it: its rank has not registered). How they were
    answered, and in how long."""
    job_id = token = "none"
    if tenant:
        owner = PfoClient(endpoint, timeout_s=30)
        job_id = owner.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
        token = owner.tokens[job_id]
        owner.close()
    floats = int(mib * 2**20 / 2 / 9)  # msgpack spends 9 bytes on a float
    result = {"rank": 0, "iter_time": [0.5] * floats, "iter_energy": [0.5] * floats}
    payload = msgspec.msgpack.encode(
        {"type": "report", "job_id": job_id, "token": token, "result": result}
    )
    ctx: zmq.Context[Any] = zmq.Context()
    socks = []
    for _ in range(n):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    time.sleep(0.5)  # connected, so that the sends below go out together
    t0 = time.perf_counter()
    for sock in socks:
        sock.send_multipart([b"", b"\0" * 8, payload], copy=False)
    answers: Counter[str] = Counter()
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    waiting = set(socks)
    deadline = time.monotonic() + 120
    while waiting and time.monotonic() < deadline:
        for sock, _ in poller.poll(1000):
            reply = p.reply_decoder.decode(sock.recv_multipart()[-1])
            answers[
                reply.code if isinstance(reply, p.ErrorReply) else str(reply.__struct_config__.tag)
            ] += 1
            poller.unregister(sock)
            waiting.discard(sock)
    took = time.perf_counter() - t0
    answers["no reply"] += len(waiting)
    for sock in socks:
        sock.close()
    ctx.term()
    return answers, took


def _counts(answers: Counter[str]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(answers.items()) if v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=500_000)
    parser.add_argument("--rotating", type=int, default=1_000)
    parser.add_argument("--honest-wait", type=float, default=60.0, metavar="S")
    parser.add_argument("--big", type=int, default=40)
    parser.add_argument("--big-mib", type=float, default=15.0)
    parser.add_argument(
        "--only", default="", help="comma-separated cases: jobs,unread,ranks,rotating,big"
    )
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    rows: list[tuple[str, float, float, float, str]] = []

    def run(case: str) -> bool:
        return not only or case in only

    @contextmanager
    def case(*server_args: str) -> Iterator[tuple[subprocess.Popen[str], str, float]]:
        """A fresh server for one case: its process, endpoint and RSS before; the rows the
        case adds get the server's peak RSS."""
        proc, ep = _server(*server_args)
        first = len(rows)
        try:
            yield proc, ep, _rss_mib(proc)
        finally:
            peak = _peak_mib(proc)
            proc.terminate()
            proc.wait(30)
            rows[first:] = [(*r[:3], peak, r[4]) for r in rows[first:]]

    if run("jobs"):
        with case() as (proc, ep, before):
            held, busy, took = _flood_jobs(ep, args.jobs)
            rows.append(
                ("jobs, default limits", before, _rss_mib(proc), 0.0, f"{held} held, {busy} busy")
            )
        limits = ("--max-jobs", "20000", "--max-jobs-per-client", "20000")
        with case(*limits, "--registration-timeout", "20") as (proc, ep, before):
            held, busy, took = _flood_jobs(ep, args.jobs)
            rows.append(
                ("jobs, limits raised", before, _rss_mib(proc), 0.0, f"{held} held in {took:.1f} s")
            )
            deadline = time.monotonic() + 60
            while _jobs_total(ep) and time.monotonic() < deadline:
                time.sleep(1.0)
            rows.append(
                ("  after the registration timeout", before, _rss_mib(proc), 0.0,
                 f"{_jobs_total(ep)} held")
            )  # fmt: skip

    if run("unread"):
        with case() as (proc, ep, before):
            took = _never_read(ep, args.requests)
            rows.append(
                ("unread replies", before, _rss_mib(proc), 0.0,
                 f"{args.requests} requests in {took:.1f} s")
            )  # fmt: skip

    if run("ranks"):
        with case() as (proc, ep, before):
            registered, why, took = _big_ranks(ep)
            rows.append(
                ("big ranks, one tenant", before, _rss_mib(proc), 0.0,
                 f"{registered} ranks of 1,024 clocks in {took:.1f} s, {why}")
            )  # fmt: skip

    if run("rotating"):
        with case() as (proc, ep, before):
            answers, waited, note = _rotating_flood(ep, args.rotating, args.honest_wait)
            rows.append(
                (f"{args.rotating} jobs, rotating addresses", before, _rss_mib(proc), 0.0,
                 f"flood: {_counts(answers)}; honest job {note} after {waited:.1f} s")
            )  # fmt: skip

    if run("big"):
        for tenant in (False, True):
            with case() as (proc, ep, before):
                answers, took = _big_requests(ep, args.big, args.big_mib, tenant=tenant)
                rows.append(
                    (f"{args.big} x {args.big_mib:g} MiB requests"
                     f"{', a job token' if tenant else ''}", before, _rss_mib(proc), 0.0,
                     f"{_counts(answers)} in {took:.1f} s")
                )  # fmt: skip

    print(
        f"{'case':<34}{'RSS before MiB':>16}{'RSS after MiB':>15}{'growth MiB':>12}"
        f"{'peak MiB':>10}  note"
    )
    for name, before, after, peak, note in rows:
        print(
            f"{name:<34}{before:>16.1f}{after:>15.1f}{after - before:>12.1f}{peak:>10.1f}  {note}"
        )


if __name__ == "__main__":
    main()
