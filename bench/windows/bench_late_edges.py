"""Short windows whose samples came late: accuracy, ``, late`` marking and ``error_j`` coverage.

A synthetic device (no runtime): a 100 ms energy counter, reads every 10 ms with ±25 % jitter,
a share of them stalled for a random 20 ms to ``--stall-max-ms``; power constant (70 W) or a
70/300 W square wave (85 ms halves) whose readings lag 5 ms. Random 2-5 ms windows between
1 s and 2.5 s are measured with ``DeviceHistory.energy`` and compared with the exact integral.

Prints, for windows marked late and not: count, median / p95 / max relative error, and the
share whose error lies within ``error_j``.

Run: ``.venv/bin/python bench/windows/bench_late_edges.py``.
"""

from __future__ import annotations

import random

from zeus_async.testing.stalled import short_windows


def run(stall_share: float, stall_max_ms: float, square: bool, streams: int = 100) -> None:
    rng = random.Random(2)
    stats: dict[bool, list[tuple[float, bool]]] = {True: [], False: []}
    for _ in range(streams):
        windows = short_windows(
            rng, 30, stall_share=stall_share, stall_max_ms=stall_max_ms, square=square
        )
        for est, truth in windows:
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
