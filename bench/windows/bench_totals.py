"""Running totals (``monitor``/``replay``) on the one estimator: cost per event, memory held
as the stream grows, and agreement with a history that keeps every sample.

    python bench/windows/bench_totals.py [--gpus 4] [--lengths 10000,100000,1000000]

Feeds synthetic H100-like samples (every 10 ms, counter updating every 100 ms, power changing
at random) to :class:`~zeus_async.aggregate.LiveTotals` (bounded histories) and to unbounded
:class:`~zeus_async.aggregate.history.DeviceHistory` objects (what ``Recording``/``inspect``
use), and prints a Markdown table: µs per event, memory held after the stream (tracemalloc),
and whether the two totals are equal to the last bit.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
import tracemalloc
from collections.abc import Callable
from typing import TypeVar

from zeus_async.aggregate import LiveTotals
from zeus_async.aggregate.history import DeviceHistory, add_sample
from zeus_async.events import GpuSample

T = TypeVar("T")


def _stream(n: int, gpus: int, seed: int = 1) -> list[GpuSample]:
    rng = random.Random(seed)
    counters = [1e6] * gpus
    powers = [300.0] * gpus
    out = []
    for k in range(n):
        g = k % gpus
        tick = k // gpus
        if tick % 10 == 3:
            counters[g] += powers[g] * 0.1
        if rng.random() < 0.02:
            powers[g] = rng.uniform(70.0, 700.0)
        t = 1_000_000_000 + tick * 10_000_000 + rng.randrange(0, 300_000)
        out.append(GpuSample("h", t, g, power_w=powers[g], energy_j=counters[g]))
    return out


def _held(fn: Callable[[], T]) -> tuple[float, T]:
    """Memory (MB) still held by what ``fn`` returns, and that."""
    tracemalloc.start()
    result = fn()
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return current / 1e6, result


def _running(events: list[GpuSample]) -> LiveTotals:
    totals = LiveTotals()
    for e in events:
        totals.add(e)
    return totals


def _keep_all(events: list[GpuSample], gpus: int) -> dict[int, DeviceHistory]:
    histories = {g: DeviceHistory(f"gpu:{g}") for g in range(gpus)}
    for e in events:
        add_sample(histories[e.gpu], e)
    return histories


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--lengths", default="10000,100000,1000000")
    args = parser.parse_args()
    print("| events | running totals µs/event | held MB (running) | held MB (keep all) | equal |")
    print("|---:|---:|---:|---:|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        events = _stream(n, args.gpus)
        totals = LiveTotals()
        t0 = time.perf_counter()
        for e in events:
            totals.add(e)
        per_event = (time.perf_counter() - t0) / n * 1e6

        held_running, _ = _held(functools.partial(_running, events))
        held_all, hs = _held(functools.partial(_keep_all, events, args.gpus))
        equal = all(
            totals.devices[f"gpu:{g}"].energy_j == hs[g].span_energy().energy_j
            for g in range(args.gpus)
        )
        print(f"| {n:,} | {per_event:.2f} | {held_running:.2f} | {held_all:.1f} | {equal} |")


if __name__ == "__main__":
    main()
