"""Event-loop lag of a server whose request meter settles under load.

An asyncio loop plays a busy inference server for ``--seconds`` of real time: about
``--in-flight`` requests in flight at once (each 50-450 ms, begun, marked decode and ended by
one scheduler task on the loop, as handlers would), readings of 4 GPUs every 10 ms fed to the
meter as the runtime would (``meter.consume``), and a probe task that sleeps 1 ms at a time and
records how late it wakes up: the lag any handler on that loop sees.

Two ways to settle, side by side in one run:

* ``thread`` (what ``RequestMeter.consume`` does): bounded slices in a worker thread, the loop
  only hands them over;
* ``loop``: ``meter.settle_all()`` called on the loop every 0.5 s (how settling ran before
  issue 38: the loop waits for every settle);
* ``none``: the same load and readings, nothing settled: the floor (what the load itself and
  the machine cost the loop).

The figure is the probe's lag (p50, p99, p99.9, max) and how many requests were settled.
Python's GIL lets a settling thread hold the loop up for up to ``sys.getswitchinterval()``
at a time (5 ms by default): ``consume`` lowers it to 1 ms while it runs
(``switch_interval_s``), which only the ``thread`` row has; ``--switch-ms`` sets it for the
whole run. The max is the cyclic garbage collector's full passes (tens of ms, in any mode).

Run: ``.venv/bin/python bench/inference/bench_loop_lag.py [--seconds 10] [--in-flight 2000]``
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator

import anyio

from zeus_async.events import Event, GpuSample
from zeus_async.inference import RequestMeter

MS = 1_000_000


async def readings(gpus: int, stop: anyio.Event) -> AsyncIterator[Event]:
    """GPU readings every 10 ms (300 W each, the counter integrating it)."""
    counters = [0.0] * gpus
    last = time.time_ns()
    while not stop.is_set():
        await anyio.sleep(0.01)
        now = time.time_ns()
        for g in range(gpus):
            counters[g] += 300.0 * (now - last) / 1e9
            yield GpuSample("bench", now, g, power_w=300.0, energy_j=counters[g])
        last = now


async def serve(meter: RequestMeter, in_flight: int, gpus: int, stop: anyio.Event) -> int:
    """Begin requests to keep about ``in_flight`` of them in flight; returns how many began."""
    rng = random.Random(1)
    due: list[tuple[int, int, str]] = []  # (t_ns, 1 decode / 2 end, id)
    n = 0
    mean_s = 0.25
    rate = in_flight / mean_s  # requests per second (Little's law)
    next_begin = time.time_ns()
    while not stop.is_set():
        now = time.time_ns()
        while next_begin <= now:
            rid = f"r{n}"
            n += 1
            meter.begin(rid, gpus=(rng.randrange(gpus),))
            length = rng.randrange(50, 450) * MS
            heapq.heappush(due, (now + length // 5, 1, rid))
            heapq.heappush(due, (now + length, 2, rid))
            next_begin += round(rng.expovariate(rate) * 1e9)
        while due and due[0][0] <= now:
            _, kind, rid = heapq.heappop(due)
            if kind == 1:
                meter.phase(rid)
            else:
                meter.end(rid, tokens_in=rng.randrange(50, 800), tokens_out=rng.randrange(1, 64))
        await anyio.sleep(0.001)
    return n


async def probe(lags: list[float], stop: anyio.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await anyio.sleep(0.001)
        lags.append((time.perf_counter() - t0 - 0.001) * 1e3)


async def run(mode: str, seconds: float, in_flight: int, gpus: int = 4) -> dict[str, float]:
    meter = RequestMeter("tokens", gpus=list(range(gpus)), lag_s=0.05, keep=20_000)
    stop = anyio.Event()
    lags: list[float] = []
    began = 0

    async def load() -> None:
        nonlocal began
        began = await serve(meter, in_flight, gpus, stop)

    async def on_loop() -> None:
        next_settle = time.monotonic() + 0.5
        async for event in readings(gpus, stop):
            meter.add(event)
            if time.monotonic() >= next_settle:
                next_settle += 0.5
                meter.settle_all()

    async def no_settle() -> None:
        async for event in readings(gpus, stop):
            meter.add(event)

    async with anyio.create_task_group() as tg:
        if mode == "thread":
            tg.start_soon(meter.consume, readings(gpus, stop))
        elif mode == "loop":
            tg.start_soon(on_loop)
        else:  # the floor: the same load, readings taken, nothing settled
            tg.start_soon(no_settle)
        tg.start_soon(load)
        await anyio.sleep(1.0)  # warm up: in flight reaches its level
        tg.start_soon(probe, lags, stop)
        await anyio.sleep(seconds)
        stop.set()
    lags.sort()
    return {
        "p50": statistics.median(lags),
        "p99": lags[int(0.99 * (len(lags) - 1))],
        "p999": lags[int(0.999 * (len(lags) - 1))],
        "max": lags[-1],
        "samples": len(lags),
        "began": began,
        "settled": meter.totals.requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--in-flight", type=int, default=2000)
    parser.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval")
    parser.add_argument("--modes", default="none,thread,loop")
    args = parser.parse_args()
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    rows = []
    for mode in args.modes.split(","):
        got = anyio.run(run, mode, args.seconds, args.in_flight)
        rows.append((mode, got))
    switch = sys.getswitchinterval() * 1e3
    print(f"event-loop lag, {args.in_flight} requests in flight, {args.seconds:g} s, "
          f"GIL switch interval {switch:g} ms")  # fmt: skip
    print(f"{'settle':<8} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} {'max ms':>8} "
          f"{'requests':>9} {'settled':>8}")  # fmt: skip
    for mode, got in rows:
        print(f"{mode:<8} {got['p50']:>8.2f} {got['p99']:>8.2f} {got['p999']:>9.2f} "
              f"{got['max']:>8.1f} {got['began']:>9.0f} {got['settled']:>8.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
