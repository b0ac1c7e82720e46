"""Benchmark of the zeus_async event bus: throughput and latency, publisher and subscriber in
separate processes.

Rows:

* ``zeus_async frames()``: :class:`~zeus_async.bus.Publisher` (``publish_many``, 1000-event
  frames of realistic :class:`~zeus_async.events.GpuSample` events) in one process,
  :class:`~zeus_async.bus.Subscriber` decoding every frame into structs (``sub.frames()``) in
  another. The publisher publishes as fast as it can; the figure is the sustained rate of
  events *decoded* by the subscriber (frames it could not keep up with are dropped by ZeroMQ
  and reported as lost).
* ``paced``: the same with the publisher held to ``--rate`` events/s (1,000,000 by default):
  does the subscriber sustain that rate without loss, when the publisher does not also take
  the CPU a saturating publisher would?
* ``zeus_async async for event``: the same, iterating event by event.
* ``raw pyzmq``: the same pre-encoded frames sent PUB -> SUB with plain pyzmq, no decoding: the
  ceiling set by ZeroMQ and the transport.
* latency: one GpuSample per millisecond (1,000 events/s) stamped with ``time.time_ns()`` at
  creation; the subscriber measures ``time.time_ns() - event.t_ns`` on arrival (same host).

Run ``python bench/bus/bench_bus.py [--duration S] [--latency-events N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

BATCH = 1000
GPUS = 8


def _events(n: int, host: str = "node-01") -> list[Any]:
    from zeus_async.testing.fakes import realistic_gpu_samples

    return realistic_gpu_samples(n, gpus=GPUS, host=host)


# ---------------------------------------------------------------- publisher processes


def _pub_zeus(endpoint: str, ctl: Connection, mode: str, rate: float = 0.0) -> None:
    import anyio

    from zeus_async.bus import Publisher

    async def main() -> None:
        pub = Publisher(
            endpoint, host="node-01", max_batch_events=BATCH, sndhwm=1000, heartbeat_s=0.2
        )
        async with anyio.create_task_group() as tg:
            await tg.start(pub.run)
            ctl.send("bound")
            await anyio.to_thread.run_sync(ctl.recv)  # "go"
            stop = False

            async def wait_stop() -> None:
                nonlocal stop
                await anyio.to_thread.run_sync(ctl.recv)
                stop = True

            tg.start_soon(wait_stop)
            t0 = time.perf_counter()
            if mode == "throughput":
                pool = _events(GPUS * BATCH * 2)
                chunks = [pool[i : i + BATCH] for i in range(0, len(pool), BATCH)]
                i = 0
                while not stop:
                    pub.publish_many(chunks[i % len(chunks)])
                    i += 1
                    ahead = i * BATCH / rate - (time.perf_counter() - t0) if rate else 0.0
                    if ahead > 0:
                        await anyio.sleep(ahead)  # paced: keep to the target rate
                    else:
                        await anyio.lowlevel.checkpoint()
            else:  # latency: one event per ms, t_ns stamped at creation
                from zeus_async.events import GpuSample

                period = 0.001
                nxt = time.monotonic()
                k = 0
                while not stop:
                    pub.publish(
                        GpuSample(host="node-01", t_ns=time.time_ns(), gpu=k % GPUS, power_w=300.0)
                    )
                    k += 1
                    nxt += period
                    delay = nxt - time.monotonic()
                    await anyio.sleep(delay if delay > 0 else 0)
            elapsed = time.perf_counter() - t0
            tg.cancel_scope.cancel()
        ctl.send(
            {
                "events_sent": pub.stats.events_sent,
                "frames_sent": pub.stats.frames_sent,
                "elapsed_s": elapsed,
            }
        )

    anyio.run(main)


def _pub_raw(endpoint: str, ctl: Connection) -> None:
    import uuid

    import zmq

    from zeus_async.bus import FrameEncoder
    from zeus_async.events import event_topic

    pool = _events(GPUS * BATCH)
    by_topic: dict[str, list[Any]] = {}
    for ev in pool:
        by_topic.setdefault(event_topic(ev), []).append(ev)
    enc = FrameEncoder(uuid.uuid4())
    frames = [enc.encode(t, evs) for t, evs in by_topic.items()]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.bind(endpoint)
    ctl.send("bound")
    ctl.recv()  # "go"
    sent = 0
    t0 = time.perf_counter()
    seq_at = struct.Struct("!Q")
    while not ctl.poll():
        for _ in range(64):
            topic, header, payload = frames[sent % len(frames)]
            # Same pre-encoded frames; only the stream sequence number is re-stamped, so the
            # subscriber can count what ZeroMQ dropped.
            stamped = bytearray(header)
            seq_at.pack_into(stamped, 24, sent)
            sock.send_multipart([topic, stamped, payload], copy=False)
            sent += 1
    elapsed = time.perf_counter() - t0
    ctl.recv()
    sock.close(linger=0)
    ctx.term()
    ctl.send({"events_sent": sent * BATCH, "frames_sent": sent, "elapsed_s": elapsed})


# ---------------------------------------------------------------- subscriber processes


def _sub_zeus(endpoint: str, ctl: Connection, mode: str, duration: float, n_lat: int) -> None:
    import anyio

    from zeus_async.bus import Subscriber

    async def main() -> dict[str, Any]:
        async with Subscriber(endpoint, rcvhwm=1000) as sub:
            await sub.wait_ready(timeout=30)
            ctl.send("ready")
            if mode == "latency":
                lat: list[int] = []
                async for ev in sub:
                    if ev.host == "node-01" and hasattr(ev, "gpu"):
                        lat.append(time.time_ns() - ev.t_ns)
                        if len(lat) >= n_lat:
                            break
                return {"latency_ns": lat, "lost": sub.stats.frames_lost}
            events = 0
            t_end = 0.0
            t0 = 0.0
            base_lost = 0
            if mode == "frames":
                async for frame in sub.frames():
                    if not frame.topic.startswith("gpu/"):
                        continue
                    if not t0:
                        t0 = time.perf_counter()
                        t_end = t0 + duration
                        base_lost = sub.stats.frames_lost
                        continue
                    events += len(frame.events)
                    if time.perf_counter() >= t_end:
                        break
            else:
                async for _ev in sub:
                    events += 1
                    if events % 1000 == 0:
                        now = time.perf_counter()
                        if not t0:  # start the clock at the first full thousand
                            t0, t_end, events = now, now + duration, 0
                            base_lost = sub.stats.frames_lost
                        elif now >= t_end:
                            break
            elapsed = time.perf_counter() - t0
            return {
                "events": events,
                "elapsed_s": elapsed,
                "rate": events / elapsed,
                "frames_lost": sub.stats.frames_lost - base_lost,
                "decode_errors": sub.stats.decode_errors,
            }

    ctl.send(anyio.run(main))


def _sub_raw(endpoint: str, ctl: Connection, duration: float) -> None:
    import zmq

    from zeus_async.bus import unpack_header

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    ctl.send("ready")
    parts = sock.recv_multipart(copy=False)
    next_seq = unpack_header(parts[1].buffer).seq + 1
    t0 = time.perf_counter()
    t_end = t0 + duration
    events = 0
    frames = 0
    lost = 0
    while True:
        parts = sock.recv_multipart(copy=False)
        header = unpack_header(parts[1].buffer)
        events += header.event_count
        lost += header.seq - next_seq
        next_seq = header.seq + 1
        frames += 1
        if frames % 64 == 0 and time.perf_counter() >= t_end:
            break
    elapsed = time.perf_counter() - t0
    sock.close(linger=0)
    ctx.term()
    ctl.send(
        {"events": events, "elapsed_s": elapsed, "rate": events / elapsed, "frames_lost": lost}
    )


def _decode_only(duration: float) -> float:
    """FrameDecoder.decode of the same frames in this process: the per-core decoding ceiling."""
    import uuid

    from zeus_async.bus import FrameDecoder, FrameEncoder
    from zeus_async.events import event_topic

    by_topic: dict[str, list[Any]] = {}
    for ev in _events(GPUS * BATCH):
        by_topic.setdefault(event_topic(ev), []).append(ev)
    enc = FrameEncoder(uuid.uuid4())
    frames = [enc.encode(t, evs) for t, evs in by_topic.items()]
    dec = FrameDecoder()
    events = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < min(duration, 2.0):
        for frame in frames:
            events += len(dec.decode(frame).events)
    return events / (time.perf_counter() - t0)


# ---------------------------------------------------------------- orchestration


def _run_pair(
    pub_target: Any, pub_args: tuple[Any, ...], sub_target: Any, sub_args: tuple[Any, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    pub_ctl, pub_remote = ctx.Pipe()
    sub_ctl, sub_remote = ctx.Pipe()
    pub = ctx.Process(target=pub_target, args=(*pub_args, pub_remote), daemon=True)
    pub.start()
    if pub_ctl.recv() != "bound":
        raise RuntimeError("publisher failed")
    sub = ctx.Process(target=sub_target, args=(sub_args[0], sub_remote, *sub_args[1:]))
    sub.start()
    if pub_target is _pub_raw:
        sub_ctl.recv()  # "ready" (plain SUB: no handshake, give it time to connect)
        time.sleep(0.3)
    else:
        if sub_ctl.recv() != "ready":
            raise RuntimeError("subscriber failed")
    pub_ctl.send("go")
    sub_result = sub_ctl.recv()
    pub_ctl.send("stop")
    pub_result = pub_ctl.recv()
    sub.join(10)
    pub.join(10)
    return pub_result, sub_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per throughput row")
    parser.add_argument("--latency-events", type=int, default=5000)
    parser.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    parser.add_argument(
        "--rate", type=float, default=1_000_000, help="events/s of the paced throughput row"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="zeus-bench-")
    counter = iter(range(100))

    def endpoint() -> str:
        if args.transport == "ipc":
            return f"ipc://{tmp}/bus{next(counter)}.sock"
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"tcp://127.0.0.1:{port}"

    results: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "transport": args.transport,
        "batch_events": BATCH,
    }
    rows: list[tuple[str, dict[str, Any], dict[str, Any]]] = []

    for name, pub_t, pub_a, sub_t, sub_a in (
        (
            "zeus_async Publisher -> Subscriber.frames() (decoded)",
            _pub_zeus_throughput,
            (),
            _sub_zeus_frames,
            (args.duration, 0),
        ),
        (
            "zeus_async Publisher -> async for event (decoded)",
            _pub_zeus_throughput,
            (),
            _sub_zeus_events,
            (args.duration, 0),
        ),
        (
            f"zeus_async, publisher paced at {args.rate:,.0f} events/s -> frames() (decoded)",
            _pub_zeus_paced,
            (args.rate,),
            _sub_zeus_frames,
            (args.duration, 0),
        ),
        (
            "raw pyzmq PUB -> SUB, same frames (not decoded)",
            _pub_raw,
            (),
            _sub_raw,
            (args.duration,),
        ),
    ):
        ep = endpoint()
        pub_r, sub_r = _run_pair(pub_t, (ep, *pub_a), sub_t, (ep, *sub_a))
        rows.append((name, pub_r, sub_r))
        print(f"... {name}: {sub_r['rate']:,.0f} events/s", file=sys.stderr)

    results["decode_only_events_per_s"] = _decode_only(args.duration)

    ep = endpoint()
    _, lat_r = _run_pair(
        _pub_zeus_latency, (ep,), _sub_zeus_latency, (ep, 0.0, args.latency_events)
    )
    lat = sorted(lat_r["latency_ns"])
    p50 = statistics.median(lat) / 1e6
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] / 1e6
    lmax = lat[-1] / 1e6

    results["throughput"] = [
        {
            "row": name,
            "events_per_s": sub_r["rate"],
            "published_events_per_s": pub_r["events_sent"] / pub_r["elapsed_s"],
            "frames_lost": sub_r["frames_lost"],
        }
        for name, pub_r, sub_r in rows
    ]
    results["latency_ms"] = {
        "events": len(lat),
        "rate_events_per_s": 1000,
        "p50": p50,
        "p99": p99,
        "max": lmax,
        "frames_lost": lat_r["lost"],
    }

    print(f"\n### zeus_async bus benchmark ({args.transport}, {BATCH} events/frame)\n")
    print(f"Python {results['python']}, {results['platform']}, {results['cpus']} CPUs\n")
    print("| path | events/s received | events/s published | frames lost |")
    print("|---|---:|---:|---:|")
    for r in results["throughput"]:
        print(
            f"| {r['row']} | {r['events_per_s']:,.0f} | {r['published_events_per_s']:,.0f} "
            f"| {r['frames_lost']} |"
        )
    print(
        f"| FrameDecoder.decode only, in one process (no transport) "
        f"| {results['decode_only_events_per_s']:,.0f} | | |"
    )
    jitter = _sleep_jitter_ms(2.0)
    results["sleep_jitter_ms"] = jitter
    print("\n| latency at 1,000 events/s | events | p50 | p99 | max |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| sample -> subscriber (zeus_async) | {len(lat)} | {p50:.3f} ms | {p99:.3f} ms "
        f"| {lmax:.3f} ms |"
    )
    print(
        f"| context: oversleep of time.sleep(1 ms) on this machine, same run | {int(jitter['n'])} "
        f"| {jitter['p50']:.3f} ms | {jitter['p99']:.3f} ms | {jitter['max']:.3f} ms |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _sleep_jitter_ms(seconds: float) -> dict[str, float]:
    """How late ``time.sleep(1 ms)`` wakes on this machine: the scheduler's own noise floor."""
    over: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        time.sleep(0.001)
        over.append((time.monotonic() - t - 0.001) * 1e3)
    over.sort()
    return {
        "n": float(len(over)),
        "p50": over[len(over) // 2],
        "p99": over[int(len(over) * 0.99)],
        "max": over[-1],
    }


# Module-level targets (spawned processes need importable functions).


def _pub_zeus_throughput(endpoint: str, ctl: Connection) -> None:
    _pub_zeus(endpoint, ctl, "throughput")


def _pub_zeus_paced(endpoint: str, rate: float, ctl: Connection) -> None:
    _pub_zeus(endpoint, ctl, "throughput", rate)


def _pub_zeus_latency(endpoint: str, ctl: Connection) -> None:
    _pub_zeus(endpoint, ctl, "latency")


def _sub_zeus_frames(endpoint: str, ctl: Connection, duration: float, n_lat: int) -> None:
    _sub_zeus(endpoint, ctl, "frames", duration, n_lat)


def _sub_zeus_events(endpoint: str, ctl: Connection, duration: float, n_lat: int) -> None:
    _sub_zeus(endpoint, ctl, "events", duration, n_lat)


def _sub_zeus_latency(endpoint: str, ctl: Connection, duration: float, n_lat: int) -> None:
    _sub_zeus(endpoint, ctl, "latency", duration, n_lat)


if __name__ == "__main__":
    sys.exit(main())
