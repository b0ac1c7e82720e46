"""The XSUB -> XPUB proxy: how fast it forwards, and what a subscription flood behind it does.

    python bench/bus/bench_proxy.py [--seconds 4] [--rounds 3] [--events 1,1000]
                                [--rates 20000,2000] [--flood 100000] [--flood-seconds 6]
                                [--only throughput|flood]

Two proxies side by side, each in its own process: ``libzmq`` is libzmq's
``zmq_proxy_steerable`` between an XSUB and an ``XPUB_VERBOSE`` socket (what ``run_proxy`` ran
before it limited subscriptions), ``run_proxy`` is this tree's.

* Throughput: a raw PUB process sends pre-encoded frames of ``--events`` GpuSamples each (the
  stream sequence number re-stamped per frame) as fast as it can; a raw SUB process behind the
  proxy counts the frames reaching it over ``--seconds`` (and the sequence gaps: frames ZeroMQ
  dropped at a high-water mark). ``--rounds`` alternate the two proxies; the table gives the
  median. A paced run (``--rates``: frames/s per frame size, which both sustain) gives the
  proxy's CPU time per frame forwarded (the proxy process's user + system time over the run,
  divided by the frames the SUB received), a figure that the other processes on the machine
  disturb less.
* Flood: a ``Publisher`` (one GpuSample every 10 ms; default caps) behind the proxy, a
  ``Subscriber`` of ``gpu/`` in front of it timing each frame's arrival, and a raw XSUB client
  sending ``--flood`` subscribe messages for distinct topics (``flood/0000000`` ...) to the
  proxy and keeping its connection (ZeroMQ reconnects it, and resends them all, when cut).
  Reported over ``--flood-seconds`` after the flood starts: the subscriber's largest gap
  between frames and its frames received and lost, how often the publisher cut the proxy's
  connection, the subscribe messages the publisher received, and what the proxy cut.

Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROXIES = ("libzmq", "run_proxy")
HWM = 10_000


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _out(obj: Any) -> None:
    print(json.dumps(obj) if not isinstance(obj, str) else obj, flush=True)


# ---------------------------------------------------------------- roles (one process each)


def _source(events: int, seconds: float, rate: float) -> None:
    """Raw PUB: prints its endpoint, waits for a line on stdin, sends for ``seconds``."""
    import zmq

    from zeus_async.bus import FrameEncoder
    from zeus_async.testing.fakes import realistic_gpu_samples

    enc = FrameEncoder(str(uuid.uuid4()))
    topic, header, payload = enc.encode("gpu/node-01/0", realistic_gpu_samples(events, gpus=1))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.bind("tcp://127.0.0.1:*")
    _out(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    sys.stdin.readline()
    seq_at = struct.Struct("!Q")
    stamped = bytearray(header)
    sent = 0
    t0 = time.perf_counter()
    t_end = t0 + seconds
    while time.perf_counter() < t_end:
        for _ in range(64):
            seq_at.pack_into(stamped, 24, sent)
            sock.send_multipart([topic, bytes(stamped), payload], copy=events < 100)
            sent += 1
        if rate:
            ahead = sent / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
    _out({"sent": sent})
    sock.close(linger=0)
    ctx.term()


def _proxy(kind: str, upstream: str) -> None:
    """Prints its downstream endpoint; forwards until stdin closes; prints CPU time (and the
    counters of ``run_proxy``)."""
    import anyio
    import zmq

    if kind == "libzmq":
        ctx = zmq.Context()
        frontend = ctx.socket(zmq.XSUB)
        backend = ctx.socket(zmq.XPUB)
        control = ctx.socket(zmq.PAIR)
        peer = ctx.socket(zmq.PAIR)
        frontend.setsockopt(zmq.RCVHWM, HWM)
        backend.setsockopt(zmq.SNDHWM, HWM)
        backend.setsockopt(zmq.XPUB_VERBOSE, 1)
        backend.bind("tcp://127.0.0.1:*")
        frontend.connect(upstream)
        control.bind("inproc://control")
        peer.connect("inproc://control")
        thread = threading.Thread(target=zmq.proxy_steerable, args=(frontend, backend, None, peer))
        cpu0 = _cpu_s()
        thread.start()
        _out(backend.getsockopt(zmq.LAST_ENDPOINT).decode())
        sys.stdin.read()
        control.send(b"TERMINATE")
        thread.join()
        _out({"cpu_s": _cpu_s() - cpu0})
        ctx.destroy(linger=0)
        return

    from zeus_async._threads import run_sync
    from zeus_async.bus.proxy import ProxyStats, run_proxy

    stats = ProxyStats()

    async def main() -> float:
        async with anyio.create_task_group() as tg:
            cpu0 = _cpu_s()
            out = await tg.start(
                lambda task_status: run_proxy(
                    [upstream], "tcp://127.0.0.1:*", task_status=task_status, stats=stats
                )
            )
            _out(out)
            await run_sync(sys.stdin.read)
            tg.cancel_scope.cancel()
        return _cpu_s() - cpu0

    cpu = anyio.run(main)
    _out({"cpu_s": cpu, **vars(stats)})


def _sink(endpoint: str, seconds: float) -> None:
    """Raw SUB: counts every frame until none came for 1 s; the rate over ``seconds`` from
    the first."""
    import zmq

    from zeus_async.bus import unpack_header

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 1000)
    sock.connect(endpoint)
    _out("ready")
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    parts = sock.recv_multipart(copy=False)
    sock.setsockopt(zmq.RCVTIMEO, 1000)
    t0 = time.perf_counter()
    next_seq = unpack_header(parts[1].buffer).seq + 1
    frames, lost, window_frames, window_lost = 1, 0, 0, 0
    t_end = t0 + seconds
    while True:
        try:
            parts = sock.recv_multipart(copy=False)
        except zmq.Again:
            break
        seq = unpack_header(parts[1].buffer).seq
        lost += seq - next_seq
        next_seq = seq + 1
        frames += 1
        if not window_frames and time.perf_counter() >= t_end:
            window_frames, window_lost = frames, lost
    _out({"frames": frames, "window_frames": window_frames or frames, "window_lost": window_lost})
    sock.close(linger=0)
    ctx.term()


def _publisher(seconds: float) -> None:
    """A ``Publisher`` with default caps, one GpuSample every 10 ms until stdin closes."""
    import anyio

    from zeus_async._threads import run_sync
    from zeus_async.bus import Publisher
    from zeus_async.events import GpuSample

    pub = Publisher("tcp://127.0.0.1:*", host="bench")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(pub.run)
            _out(pub.endpoint)

            async def publish() -> None:
                for i in itertools.count():
                    pub.publish(GpuSample(host="bench", t_ns=i, gpu=0, power_w=300.0))
                    await anyio.sleep(0.01)

            tg.start_soon(publish)
            await run_sync(sys.stdin.read)
            tg.cancel_scope.cancel()

    anyio.run(main)
    _out(vars(pub.stats))


def _subscriber(endpoint: str, seconds: float) -> None:
    """A ``Subscriber`` of ``gpu/``: ready, then (after a line on stdin) the largest gap."""
    import anyio

    from zeus_async._threads import run_sync
    from zeus_async.bus import Subscriber

    async def main() -> dict[str, Any]:
        async with Subscriber(endpoint, topics=["gpu/"]) as sub:
            await sub.wait_ready(timeout=30)
            _out("ready")
            await run_sync(sys.stdin.readline)
            lost0 = sub.stats.frames_lost
            arrivals = [time.monotonic()]
            with anyio.move_on_after(seconds):
                async for _ in sub.frames():
                    arrivals.append(time.monotonic())
            arrivals.append(time.monotonic())
            gaps = [b - a for a, b in itertools.pairwise(arrivals)]
            return {
                "gap_s": max(gaps),
                "frames": len(arrivals) - 2,
                "lost": sub.stats.frames_lost - lost0,
            }

    _out(anyio.run(main))


# ---------------------------------------------------------------- orchestration


class _Role:
    def __init__(self, *args: str, script: str = __file__) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, script, "--role", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=os.environ,
        )

    def line(self) -> str:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().strip()
        if not got:
            raise RuntimeError(f"{self.proc.args[3:]} ended without answering")
        return got

    def result(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.line())
        return data

    def say(self, text: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()


def _throughput(kind: str, events: int, seconds: float, rate: float) -> dict[str, Any]:
    src = _Role("source", str(events), str(seconds + 2), str(rate))
    proxy = _Role("proxy", kind, src.line())
    sink = _Role("sink", proxy.line(), str(seconds))
    assert sink.line() == "ready"
    time.sleep(0.5)  # the SUB's subscription reaches the source through the proxy
    src.say()
    sent = src.result()["sent"]
    got = sink.result()
    proxy.close()
    cpu = proxy.result()["cpu_s"]
    for role in (src, proxy, sink):
        role.proc.wait()
    return {
        "fps": got["window_frames"] / seconds,
        "lost": got["window_lost"],
        "frames": got["frames"],
        "sent": sent,
        "cpu_us": cpu / max(got["frames"], 1) * 1e6,
    }


def _flood_run(kind: str, n: int, seconds: float) -> dict[str, Any]:
    pub = _Role("publisher", str(seconds))
    proxy = _Role("proxy", kind, pub.line())
    out = proxy.line()
    sub = _Role("subscriber", out, str(seconds))
    assert sub.line() == "ready"
    time.sleep(0.5)
    sub.say()
    # bench_sub_flood's flooder: one XSUB, n distinct topics, held until its stdin closes.
    flood = _Role(
        "flood", out, str(n), script=str(ROOT / "bench" / "hostile" / "bench_sub_flood.py")
    )
    got = sub.result()
    flood.close()
    proxy.close()
    proxy_stats = proxy.result()
    pub.close()
    pub_stats = pub.result()
    for role in (pub, proxy, sub, flood):
        role.proc.wait()
    return {**got, "pub": pub_stats, "proxy": proxy_stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", default="1,1000", help="events per frame, comma-separated")
    parser.add_argument("--rates", default="20000,2000", help="frames/s of the paced runs")
    parser.add_argument("--flood", type=int, default=100_000)
    parser.add_argument("--flood-seconds", type=float, default=6.0)
    parser.add_argument("--only", choices=["throughput", "flood"], default=None)
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    roles: dict[str, Any] = {
        "source": lambda: _source(int(rest[0]), float(rest[1]), float(rest[2])),
        "proxy": lambda: _proxy(rest[0], rest[1]),
        "sink": lambda: _sink(rest[0], float(rest[1])),
        "publisher": lambda: _publisher(float(rest[0])),
        "subscriber": lambda: _subscriber(rest[0], float(rest[1])),
    }
    if args.role:
        return roles[args.role]()  # type: ignore[no-any-return]

    print(f"{os.cpu_count()} CPUs, tcp on 127.0.0.1, high-water marks {HWM:,}\n")
    if args.only in (None, "throughput"):
        print(f"Saturating source, median of {args.rounds} rounds of {args.seconds:g} s:\n")
        print("| proxy | events/frame | frames/s at the SUB | lost at HWM "
              "| paced: frames/s | proxy CPU per frame |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|")
        sizes = [int(x) for x in args.events.split(",")]
        for events, rate in zip(sizes, [float(x) for x in args.rates.split(",")], strict=True):
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in PROXIES}
            paced: dict[str, list[float]] = {k: [] for k in PROXIES}
            for _ in range(args.rounds):
                for kind in PROXIES:
                    runs[kind].append(_throughput(kind, events, args.seconds, 0))
                    paced[kind].append(_throughput(kind, events, args.seconds, rate)["cpu_us"])
            for kind in PROXIES:
                fps = statistics.median(r["fps"] for r in runs[kind])
                lost = statistics.median(r["lost"] for r in runs[kind])
                cpu = statistics.median(paced[kind])
                print(
                    f"| {kind} | {events:,} | {fps:,.0f} | {lost:,.0f} | {rate:,.0f} "
                    f"| {cpu:.2f} µs |"
                )
        print()
    if args.only in (None, "flood"):
        print(
            f"{args.flood:,} subscriptions flooded through the proxy, {args.flood_seconds:g} s:\n"
        )
        print("| proxy | largest gap at the subscriber | frames received / lost "
              "| publisher cut the proxy | subscribes at the publisher "
              "| flooder cut at the proxy | subscribes refused at the proxy |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|")
        for kind in PROXIES:
            r = _flood_run(kind, args.flood, args.flood_seconds)
            pub, prx = r["pub"], r["proxy"]
            print(
                f"| {kind} | {r['gap_s'] * 1e3:,.0f} ms | {r['frames']:,} / {r['lost']:,} "
                f"| {pub['connections_dropped']:,} | {pub['subscriptions']:,} "
                f"| {prx.get('connections_dropped', '-')} "
                f"| {prx.get('subscriptions_refused', '-')} |"
            )


if __name__ == "__main__":
    main()
