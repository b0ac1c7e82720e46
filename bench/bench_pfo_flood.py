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
  most a rank may), until ``max_client_mib`` (default 256) refuses it with ``busy``.

Run: ``.venv/bin/python bench/bench_pfo_flood.py [--jobs 10000] [--requests 500000]``
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
from pathlib import Path

import msgspec
import psutil
import zmq

from zeus_async.optimizer.pipeline import JobInfo, PfoClient, PfoServerError, RankInfo

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=500_000)
    args = parser.parse_args()
    rows = []

    proc, ep = _server()
    try:
        before = _rss_mib(proc)
        held, busy, took = _flood_jobs(ep, args.jobs)
        rows.append(("jobs, default limits", before, _rss_mib(proc), f"{held} held, {busy} busy"))
    finally:
        proc.terminate()
        proc.wait(30)

    proc, ep = _server(
        "--max-jobs", "20000", "--max-jobs-per-client", "20000", "--registration-timeout", "20"
    )
    try:
        before = _rss_mib(proc)
        held, busy, took = _flood_jobs(ep, args.jobs)
        after = _rss_mib(proc)
        rows.append(("jobs, limits raised", before, after, f"{held} held in {took:.1f} s"))
        deadline = time.monotonic() + 60
        while _jobs_total(ep) and time.monotonic() < deadline:
            time.sleep(1.0)
        rows.append(
            ("  after the registration timeout", before, _rss_mib(proc), f"{_jobs_total(ep)} held")
        )
    finally:
        proc.terminate()
        proc.wait(30)

    proc, ep = _server()
    try:
        before = _rss_mib(proc)
        took = _never_read(ep, args.requests)
        rows.append(
            ("unread replies", before, _rss_mib(proc), f"{args.requests} requests in {took:.1f} s")
        )
    finally:
        proc.terminate()
        proc.wait(30)

    proc, ep = _server()
    try:
        before = _rss_mib(proc)
        registered, why, took = _big_ranks(ep)
        rows.append(
            (
                "big ranks, one tenant",
                before,
                _rss_mib(proc),
                f"{registered} ranks of 1,024 clocks in {took:.1f} s, {why}",
            )
        )
    finally:
        proc.terminate()
        proc.wait(30)

    print(f"{'case':<34}{'RSS before MiB':>16}{'RSS after MiB':>15}{'growth MiB':>12}  note")
    for name, before, after, note in rows:
        print(f"{name:<34}{before:>16.1f}{after:>15.1f}{after - before:>12.1f}  {note}")


if __name__ == "__main__":
    main()
