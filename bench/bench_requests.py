"""Energy per inference request: the meter's cost on the serving thread, attribution keeping up
with 10,000 requests/s, and accuracy against a simulated ground truth.

1. **Cost per request** on the serving thread: ``begin`` + ``phase`` + ``end``, median over
   batches of 10,000 requests (target <= 5 us).
2. **Sustained load**: 10,000 requests/s (each 5-50 ms, so ~300 in flight) on 4 GPUs with
   readings every 10 ms, for ``--seconds`` of simulated time; the attribution's CPU time per
   second of traffic (it keeps up when below 1 s) and the meter's memory each second (it keeps
   the last 20,000 settled results here, 2 s of traffic).
3. **Accuracy**: a GPU draws idle power plus each request's own power while it runs (random,
   50-400 W, so heavier requests draw more); tokens are reported with noise around each
   request's own work. Per-request error against the request's own energy plus its
   equal share of the idle power while in flight, for the token and the equal policies.

Run: ``.venv/bin/python bench/bench_requests.py [--seconds 10]``
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import time
import tracemalloc

from zeus_async.events import GpuSample
from zeus_async.inference import RequestMeter, RequestSpan, attribute

MS = 1_000_000
S = 1_000_000_000


def cost_per_request(batches: int = 20, n: int = 10_000) -> float:
    meter = RequestMeter(gpus=[0])
    ids = [f"r{i}" for i in range(n)]
    times = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for rid in ids:
            meter.begin(rid)
            meter.phase(rid)
            meter.end(rid, tokens_in=100, tokens_out=20)
        times.append((time.perf_counter_ns() - t0) / n)
        meter._edges.clear()
    return statistics.median(times) / 1e3


class FakeClock:
    def __init__(self, t: int) -> None:
        self.now = t

    def __call__(self) -> int:
        return self.now


def sustained(seconds: float, rate: int = 10_000, gpus: int = 4) -> tuple[float, list[float]]:
    rng = random.Random(1)
    t0 = 1_700_000_000 * S
    clock = FakeClock(t0)
    meter = RequestMeter("tokens", gpus=list(range(gpus)), clock=clock, lag_s=0.05, keep=20_000)
    counters = [0.0] * gpus
    pending: list[tuple[int, int, str, int]] = []  # (t, kind, id, gpu)
    spent = 0.0
    memory = []
    tracemalloc.start()
    next_request = t0
    next_reading = t0
    next_settle = t0 + S // 10
    n = 0
    end = t0 + int(seconds * S)
    import heapq

    while clock.now < end:
        t = min(next_request, next_reading, pending[0][0] if pending else end)
        clock.now = t
        if pending and pending[0][0] == t:
            _, kind, rid, _ = heapq.heappop(pending)
            if kind == 1:
                meter.phase(rid)
            else:
                meter.end(rid, tokens_in=rng.randrange(50, 800), tokens_out=rng.randrange(1, 64))
        elif t == next_request:
            rid = f"r{n}"
            n += 1
            gpu = rng.randrange(gpus)
            meter.begin(rid, gpus=(gpu,))
            length = rng.randrange(5, 50) * MS
            heapq.heappush(pending, (t + length // 5, 1, rid, gpu))
            heapq.heappush(pending, (t + length, 2, rid, gpu))
            next_request = t + S // rate
        else:
            for g in range(gpus):
                counters[g] += 0.01 * 300.0
                meter.add(GpuSample("h", t, g, power_w=300.0, energy_j=counters[g]))
            next_reading = t + 10 * MS
        if t >= next_settle:
            c0 = time.process_time()
            meter.settle()
            spent += time.process_time() - c0
            next_settle += S // 10
            if (next_settle - t0) % S == 0:
                gc.collect()
                memory.append(tracemalloc.get_traced_memory()[0] / 2**20)
    tracemalloc.stop()
    return spent / seconds, memory


def accuracy(requests: int = 2000, seed: int = 2) -> tuple[float, float, float]:
    rng = random.Random(seed)
    idle_w = 70.0
    reqs = []
    t = 0
    for i in range(requests):
        t += rng.randrange(1, 20) * MS
        length = rng.randrange(20, 400) * MS
        own_w = rng.uniform(50.0, 400.0)
        reqs.append((f"r{i}", t, t + length, own_w))
    horizon = max(r[2] for r in reqs) + 100 * MS
    edges = sorted({0, horizon, *(r[1] for r in reqs), *(r[2] for r in reqs)})
    power_at = {}
    for a, b in itertools.pairwise(edges):
        mid = (a + b) // 2
        own = [r for r in reqs if r[1] <= mid < r[2]]
        power_at[a] = idle_w + sum(r[3] for r in own)
    cum = {edges[0]: 0.0}
    for a, b in itertools.pairwise(edges):
        cum[b] = cum[a] + power_at[a] * (b - a) / S

    def energy(gpu: int, a: int, b: int) -> float:
        return cum[b] - cum[a]  # every edge is a request edge: the segments are these

    # The truth: own energy, plus the idle power while in flight split equally.
    truth = {r[0]: r[3] * (r[2] - r[1]) / S for r in reqs}
    for a, b in itertools.pairwise(edges):
        mid = (a + b) // 2
        own = [r for r in reqs if r[1] <= mid < r[2]]
        for r in own:
            truth[r[0]] += idle_w * (b - a) / S / len(own)
    # Tokens: the request's own work with +-20 % noise (what a server can report).
    spans = [
        RequestSpan(rid, (0,), a, b, tokens_in=round(w * (b - a) / S * rng.uniform(0.8, 1.2) * 10))
        for rid, a, b, w in reqs
    ]
    errors = {}
    for policy in ("tokens", "equal"):
        out = attribute(spans, energy, start_ns=0, end_ns=horizon, policy=policy)  # type: ignore[arg-type]
        rel = [abs(out.requests[rid].energy_j - truth[rid]) / truth[rid] for rid in truth]
        errors[policy] = statistics.mean(rel) * 100
    mean_j = statistics.mean(truth.values())
    return errors["tokens"], errors["equal"], mean_j


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    us = cost_per_request()
    print(f"{'meter cost per request (begin + phase + end)':<52}{us:>9.2f} us   target <= 5 us")
    per_s, memory = sustained(args.seconds)
    print(
        f"{'attribution CPU per second of 10,000 req/s':<52}{per_s * 1e3:>9.1f} ms   "
        f"keeps up: {'yes' if per_s < 1.0 else 'NO'}"
    )
    print(
        f"{'meter memory at each simulated second (MiB)':<52}"
        + " ".join(f"{m:.1f}" for m in memory)
    )
    tok, eq, mean_j = accuracy()
    print(f"{'mean per-request error, tokens policy':<52}{tok:>9.2f} %")
    print(
        f"{'mean per-request error, equal policy':<52}{eq:>9.2f} %   (mean request {mean_j:.1f} J)"
    )


if __name__ == "__main__":
    main()
