"""A subscription flood against a sampling, publishing runtime: sampling and stream keep going.

    python bench/hostile/bench_sub_flood.py [--floods 0,300000] [--seconds 8] [--period 0.01]
                                    [--publisher-source FILE]

Per flood size, one fresh process runs ``Runtime(backend="sim", publish=...)`` (2 simulated
GPUs at ``--period``) and starts two real clients: a normal subscriber (``Subscriber``,
``gpu/`` topics, in its own process) that times the arrival of every frame, and a flooder (a
raw ZeroMQ XSUB, in its own process) that sends ``N`` subscribe messages for distinct topics
(``flood/0000000`` ...) and keeps its connection open (ZeroMQ reconnects it, and resends its
subscriptions, if the publisher drops it). Reported over the ``--seconds`` after the flood
starts: the largest gap between consecutive samples of GPU 0 (sample timestamps, in the
runtime's process), the largest gap between frames at the normal subscriber, and the
runtime's RSS growth (end minus just before the flood, and the peak).

``--publisher-source`` loads ``Publisher`` from another copy of ``zeus_async/bus/publisher.py``
(e.g. ``git show HEAD:zeus_async/bus/publisher.py > /tmp/old.py``) to measure the code before a
change in the same run. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _publisher_class(source: str | None) -> Any:
    if source is None:
        from zeus_async.bus import Publisher

        return Publisher
    name = "zeus_async.bus._bench_publisher"  # relative imports resolve in zeus_async.bus
    spec = importlib.util.spec_from_file_location(name, source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.Publisher


def _flood(endpoint: str, n: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.XSUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    time.sleep(0.2)
    for i in range(n):
        sock.send(b"\x01flood/%07d" % i)
    print("sent", flush=True)
    sys.stdin.read()  # hold the connection until the runtime is done


def _subscriber(endpoint: str, seconds: float) -> None:
    import anyio

    from zeus_async.bus import Subscriber

    async def main() -> None:
        arrivals: list[float] = []
        async with Subscriber(endpoint, topics=["gpu/"]) as sub:
            await sub.wait_ready(timeout=30)
            print("ready", flush=True)
            start = time.monotonic()
            with anyio.move_on_after(seconds):
                async for _ in sub.frames():
                    arrivals.append(time.monotonic())
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        first = arrivals[0] - start if arrivals else seconds
        print(json.dumps({"frames": len(arrivals), "gap_s": max([first, *gaps])}), flush=True)

    anyio.run(main)


def _runtime(n: int, seconds: float, period: float, source: str | None) -> None:
    import anyio

    from zeus_async._threads import run_sync
    from zeus_async.events import GpuSample
    from zeus_async.runtime import Runtime

    publisher = _publisher_class(source)("tcp://127.0.0.1:*", host="bench")
    stamps: list[int] = []
    py = sys.executable

    async def consumer(stream: Any) -> None:
        async for e in stream:
            if type(e) is GpuSample and e.gpu == 0:
                stamps.append(e.t_ns)

    async def main() -> dict[str, float]:
        async with Runtime(
            backend="sim",
            gpus=[0, 1],
            cpus=None,
            period_s=period,
            publish=publisher,
            host="bench",
            consumers=[consumer],
        ):
            ep = publisher.endpoint
            sub = subprocess.Popen(
                [py, __file__, "--role", "sub", ep, str(seconds)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert sub.stdout is not None
            assert (await run_sync(sub.stdout.readline)).strip() == "ready"
            await anyio.sleep(0.5)
            rss0 = _rss_mib()
            t0 = time.time_ns()
            flood = subprocess.Popen(
                [py, __file__, "--role", "flood", ep, str(n)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
            )
            await anyio.sleep(seconds)
            rss1, peak = _rss_mib(), _hwm_mib()
            got = json.loads(await run_sync(sub.stdout.readline))
            assert flood.stdin is not None
            flood.stdin.close()
            await run_sync(flood.wait)
            await run_sync(sub.wait)
        window = [t for t in stamps if t >= t0]
        gaps = [b - a for a, b in itertools.pairwise(window)]
        return {
            "sampling_gap_ms": max(gaps) / 1e6,
            "samples": len(window),
            "stream_gap_ms": got["gap_s"] * 1e3,
            "frames": got["frames"],
            "rss_growth_mib": rss1 - rss0,
            "peak_growth_mib": peak - rss0,
            "subscriptions": publisher.stats.subscriptions,
            "dropped": getattr(publisher.stats, "connections_dropped", 0),
        }

    print(json.dumps(anyio.run(main)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--floods", default="0,300000")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--period", type=float, default=0.01)
    parser.add_argument("--publisher-source", default=None)
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.role == "flood":
        return _flood(rest[0], int(rest[1]))
    if args.role == "sub":
        return _subscriber(rest[0], float(rest[1]))
    if args.role == "runtime":
        return _runtime(int(rest[0]), args.seconds, args.period, args.publisher_source)
    label = args.publisher_source or "this tree"
    print(f"publisher: {label}; {args.seconds:g} s per run, period {args.period * 1e3:g} ms\n")
    print(
        "| flooded subscriptions | largest sampling gap | largest stream gap "
        "| samples | frames at subscriber | RSS growth (end / peak) "
        "| subscribe messages read | connections dropped |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in args.floods.split(",")]:
        cmd = [sys.executable, __file__, "--role", "runtime", str(n)]
        cmd += ["--seconds", str(args.seconds), "--period", str(args.period)]
        if args.publisher_source:
            cmd += ["--publisher-source", args.publisher_source]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            raise SystemExit(out.returncode)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {n:,} | {r['sampling_gap_ms']:.1f} ms | {r['stream_gap_ms']:.1f} ms "
            f"| {r['samples']:,} | {r['frames']:,} "
            f"| {r['rss_growth_mib']:+.1f} / {r['peak_growth_mib']:+.1f} MiB "
            f"| {r['subscriptions']:,} | {r['dropped']:,} |"
        )


if __name__ == "__main__":
    main()
