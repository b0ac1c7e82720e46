"""PFO server at scale: 1,024 ranks register and fetch their schedules.

A ``zeus-async pfo-server`` process (default settings, so it also dumps ``ranks.json``; scheduler
``PointSolution3D`` with an 8-stage plan: pipeline 8 x data parallel 128) and ``--procs`` client
processes, each owning ``ranks / procs`` ZeroMQ DEALER sockets (one per rank, connected and
warmed up before timing). A run is timed from rank 0's ``register_job`` until every rank holds
its schedule: the id goes to every client process, each sends all its ``register_rank``
requests, waits for the replies, then sends all its ``get_schedule`` requests (answered once
the whole job has registered) and waits for those. Each schedule is checked to be its rank's.

Run: ``.venv/bin/python bench/pfo/bench_pfo_server.py [--ranks 1024] [--procs 4] [--runs 5]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

from zeus_async.optimizer.pipeline import JobInfo, PfoClient, RankInfo
from zeus_async.optimizer.pipeline import protocol as p

PP = 8
FREQS = list(range(1980, 1004, -15))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _roundtrip(socks: list[zmq.Socket[Any]], requests: list[bytes]) -> list[p.Reply]:
    poller = zmq.Poller()
    for i, (sock, req) in enumerate(zip(socks, requests, strict=True)):
        sock.send_multipart([b"", struct.pack("<Q", i), req])
        poller.register(sock, zmq.POLLIN)
    replies: dict[int, p.Reply] = {}
    index = {s: i for i, s in enumerate(socks)}
    while len(replies) < len(socks):
        for sock, _ in poller.poll(30_000) or []:
            parts = sock.recv_multipart()
            replies[index[sock]] = p.reply_decoder.decode(parts[2])
            poller.unregister(sock)
        if not poller.sockets and len(replies) < len(socks):
            raise RuntimeError("lost replies")
    return [replies[i] for i in range(len(socks))]


def client_proc(endpoint: str, ranks: list[int], conn: Connection) -> None:
    ctx = zmq.Context()
    socks = []
    for _ in ranks:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        socks.append(s)
    _roundtrip(socks, [p.encoder.encode(p.Info(job_id="")) for _ in ranks])  # warm up
    conn.send("ready")
    while True:
        got_job = conn.recv()
        if got_job is None:
            break
        job_id, token = got_job
        infos = [
            RankInfo(
                rank=r, dp_rank=r // PP, pp_rank=r % PP, tp_rank=0, available_frequencies=FREQS
            )
            for r in ranks
        ]
        regs = _roundtrip(
            socks,
            [
                p.encoder.encode(p.RegisterRank(job_id=job_id, rank=info, token=token))
                for info in infos
            ],
        )
        assert all(isinstance(r, p.Ok) for r in regs), regs[:3]
        got = _roundtrip(
            socks,
            [p.encoder.encode(p.GetSchedule(job_id=job_id, rank=r, token=token)) for r in ranks],
        )
        for r, reply in zip(ranks, got, strict=True):
            assert isinstance(reply, p.ScheduleReply) and reply.schedule.rank == r, reply
        conn.send(time.perf_counter())
    for s in socks:
        s.close()
    ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.ranks % PP:
        raise SystemExit(f"--ranks must be a multiple of {PP}")
    tmp = Path(tempfile.mkdtemp(prefix="pfo-bench-"))
    plan = tmp / "plan.json"
    plan.write_text(
        json.dumps([[["forward", 1980 - 15 * s], ["backward", 1500]] for s in range(PP)])
    )
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(
        os.environ,
        ZEUS_PFO_SCHEDULER="PointSolution3D",
        ZEUS_PFO_SCHEDULER_ARGS=json.dumps({"solution_path": str(plan)}),
        ZEUS_PFO_DUMP_DIR=str(tmp / "dump"),
        ZEUS_PFO_LOG_LEVEL="WARNING",
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "zeus_async", "pfo-server", "--bind", endpoint],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    server.stdout.readline()  # bound
    ctx = mp.get_context("spawn")
    chunks = [list(range(i, args.ranks, args.procs)) for i in range(args.procs)]
    pipes, procs = [], []
    for chunk in chunks:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=client_proc, args=(endpoint, chunk, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    for conn in pipes:
        assert conn.recv() == "ready"
    rank0 = PfoClient(endpoint)
    rank0.info()
    job = JobInfo(pp_degree=PP, dp_degree=args.ranks // PP, tp_degree=1, world_size=args.ranks)
    times = []
    try:
        for _ in range(args.runs):
            t0 = time.perf_counter()
            job_id = rank0.register_job(job)
            for conn in pipes:
                conn.send((job_id, rank0.tokens[job_id]))
            done = max(conn.recv() for conn in pipes)
            times.append(done - t0)
    finally:
        for conn in pipes:
            conn.send(None)
        for proc in procs:
            proc.join(30)
        rank0.close()
        server.terminate()
        server.wait(30)
    requests = 1 + 2 * args.ranks
    median = statistics.median(times)
    print(
        f"PFO server: {args.ranks} ranks register + fetch ({args.procs} client processes, "
        f"{args.runs} runs, loopback TCP, dump on)"
    )
    print(f"{'ranks':>6} {'median s':>9} {'min s':>7} {'max s':>7} {'req/s':>8} {'target':>8}")
    print(
        f"{args.ranks:>6} {median:>9.3f} {min(times):>7.3f} {max(times):>7.3f} "
        f"{requests / median:>8.0f} {'< 1 s':>8}"
    )
    ok = max(times) < 1.0
    print("target met" if ok else "TARGET MISSED")
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "times_s": times}))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
