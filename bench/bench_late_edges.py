"""Short windows whose samples came late: accuracy, ``, late`` marking and ``error_j`` coverage.

A synthetic device (no runtime): a 100 ms energy counter, reads every 10 ms with ±25 % jitter,
a share of them stalled for a random 20 ms to ``--stall-max-ms``; power constant (70 W) or a
70/300 W square wave (85 ms halves) whose readings lag 5 ms. Random 2-5 ms windows between
1 s and 2.5 s are measured with ``DeviceHistory.energy`` and compared with the exact integral.

Prints, for windows marked late and not: count, median / p95 / max relative error, and the
share whose error lies within ``error_j``.

Run: ``.venv/bin/python bench/bench_late_edges.py``.
"""

from __future__ import annotations

import random

from zeus_async.aggregate.history import DeviceHistory

MS = 1_000_000


def run(stall_share: float, stall_max_ms: float, square: bool, streams: int = 100) -> None:
    rng = random.Random(2)
    stats: dict[bool, list[tuple[float, bool]]] = {True: [], False: []}
    for _ in range(streams):
        phase = rng.uniform(0, 100 * MS)

        def power(t: float) -> float:
            return 70.0 if not square or (t // (85 * MS)) % 2 == 0 else 300.0

        def energy(t: float) -> float:
            if not square:
                return 70.0 * t / 1e9
            n = int(t // (85 * MS))
            full = sum(70.0 if k % 2 == 0 else 300.0 for k in range(n)) * 0.085
            return full + power(t) * (t - n * 85 * MS) / 1e9

        h = DeviceHistory("gpu:0")
        t = 0
        while t < 3_000 * MS:
            stalled = rng.random() < stall_share
            gap = rng.uniform(20, stall_max_ms) * MS if stalled else 10 * MS
            t += int(gap * rng.uniform(0.8, 1.3))
            k = int((t - phase) // (100 * MS))
            update = phase + k * 100 * MS
            h.add(t, power(t - 5 * MS), 1000.0 + (energy(update) if k >= 0 else 0.0))
        for _ in range(30):
            t0 = int(rng.uniform(1_000, 2_500) * MS)
            t1 = t0 + int(rng.uniform(2, 5) * MS)
            est = h.energy(t0, t1)
            truth = energy(t1) - energy(t0)
            assert est.energy_j is not None
            err = abs(est.energy_j - truth)
            stats[est.method.endswith(", late")].append((err / truth, err <= est.error_j + 1e-9))
    load = "square 70/300 W" if square else "constant 70 W"
    for late in (True, False):
        rows = stats[late]
        if not rows:
            continue
        errors = sorted(e for e, _ in rows)
        covered = sum(c for _, c in rows) / len(rows)
        print(
            f"| {stall_share:.0%} stalled ≤ {stall_max_ms:g} ms | {load} | "
            f"{'late' if late else 'not late'} | {len(rows)} | {errors[len(errors) // 2]:.2%} | "
            f"{errors[int(len(errors) * 0.95)]:.2%} | {errors[-1]:.2%} | {covered:.0%} |"
        )


def main() -> None:
    print("| reads | power | windows | n | median error | p95 | max | within error_j |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for share, most in ((0.0, 1.0), (0.05, 60.0), (0.15, 150.0)):
        for square in (False, True):
            run(share, most, square)


if __name__ == "__main__":
    main()
