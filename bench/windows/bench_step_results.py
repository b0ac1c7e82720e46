"""A window per training step with its energy read at once: zeus_async vs Zeus 0.16, side by side.

Issue 20's benchmark for non-blocking results. Each step (``--step-ms``, default 20 ms, a busy
loop on the caller's thread, as a training step's Python side) is measured by both monitors at
once: Zeus's ``begin_window``/``end_window`` (``approx_instant_energy=True``: its immediate
reading) around our ``push_window``/``pop_window``, with our energies read right after
``pop_window`` returns (the provisional figures). Both monitors see the same simulated GPUs
(the simulator installed as ``pynvml`` here for Zeus, the same configuration in our sampler
process; a square-wave workload), and the truth is the simulator's exact integral over each
monitor's own edges. Our exact figures (``result.exact()``, ~0.1 s later) are shown beside.

Prints one table per GPU count: time the calls take on the caller's thread per step (median,
p90, mean), and the mean absolute error against the truth (J, and % of the window's energy).
Every third step measures the floor instead, in the same conditions: two edge time stamps
queued, and each GPU's latest reading read twice from the same shared-memory board.

Run: ``bench/.venv/bin/python bench/windows/bench_step_results.py [--steps 300] [--gpus 1 4]``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import sys
import time
from typing import Any

from bench_monitor import install_sim, our_monitor, zeus_monitor

from zeus_async.devices.sim_workload import SquareWorkload


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(gpus: int, steps: int, step_s: float) -> dict[str, Any]:
    node = install_sim(gpus, SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1))
    zm, om = zeus_monitor(gpus), our_monitor(gpus)
    cost_ours: list[float] = []
    cost_zeus: list[float] = []
    cost_floor: list[float] = []
    rows = []
    board = om._process._board  # the sampler's power board, mapped here
    keys = [om._process._board_keys[f"gpu:{g}"] for g in range(gpus)]
    edges: collections.deque[int] = collections.deque()
    try:
        time.sleep(0.5)
        for i in range(steps):
            if i % 3 == 2:
                # The floor, in the same conditions (cold caches after a step, the sampler
                # beside us): stamp and queue two edges, read each GPU's latest reading twice.
                f0 = time.perf_counter_ns()
                edges.append(time.time_ns())
                f1 = time.perf_counter_ns()
                _busy(step_s)
                f2 = time.perf_counter_ns()
                edges.append(time.time_ns())
                for key in keys:
                    board.latest(key)
                    board.latest(key)
                cost_floor.append((f1 - f0) + (time.perf_counter_ns() - f2))
                continue
            name = f"s{i}"
            z0a = time.perf_counter_ns(), time.time_ns()
            zm.begin_window(name, sync_execution=False)
            z0b = time.perf_counter_ns(), time.time_ns()
            om.push_window()
            o0 = time.perf_counter_ns()
            _busy(step_s)
            o1 = time.perf_counter_ns()
            res = om.pop_window()
            provisional = list(res.energy)  # read at once
            was_provisional = res.provisional
            o2 = time.perf_counter_ns()
            z1a = time.perf_counter_ns(), time.time_ns()
            zres = zm.end_window(name, sync_execution=False)
            z1b = time.perf_counter_ns(), time.time_ns()
            cost_ours.append((o0 - z0b[0]) + (o2 - o1))
            cost_zeus.append((z0b[0] - z0a[0]) + (z1b[0] - z1a[0]))
            rows.append(
                (
                    res,
                    provisional,
                    was_provisional,
                    [zres.gpu_energy[g] for g in range(gpus)],
                    (z0a[1] + z0b[1]) // 2,
                    (z1a[1] + z1b[1]) // 2,
                )
            )
        err = {"ours": [], "exact": [], "zeus": [], "ours_rel": [], "exact_rel": [], "zeus_rel": []}
        provisional_count = 0
        for res, provisional, was_provisional, zeus_e, z0, z1 in rows:
            provisional_count += was_provisional
            m = res.window.wait(5)
            for g in range(gpus):
                t_o = node.truth_energy_j(g, m.start_ns, m.end_ns)
                t_z = node.truth_energy_j(g, z0, z1)
                for key, value, truth in (
                    ("ours", provisional[g], t_o),
                    ("exact", m.gpu_energy_j[g], t_o),
                    ("zeus", zeus_e[g], t_z),
                ):
                    err[key].append(abs(value - truth))
                    err[f"{key}_rel"].append(abs(value - truth) / truth)
    finally:
        om.close()

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[int(len(xs) * p)] / 1e3

    return {
        "gpus": gpus,
        "steps": steps,
        "provisional": provisional_count,
        "cost": {
            name: (q(xs, 0.5), q(xs, 0.9), statistics.fmean(xs) / 1e3)
            for name, xs in (("ours", cost_ours), ("zeus", cost_zeus), ("floor", cost_floor))
        },
        "mae": {k: statistics.fmean(v) for k, v in err.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--only", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only is None:
        # One process per GPU count: Zeus keeps its GPUs process-wide.
        for gpus in args.gpus:
            argv = ["--steps", str(args.steps), "--step-ms", str(args.step_ms)]
            subprocess.run([sys.executable, __file__, *argv, "--only", str(gpus)], check=True)
        return
    r = run(args.only, args.steps, args.step_ms / 1e3)
    print(
        f"\n{r['gpus']} GPU(s), {r['steps']} steps of {args.step_ms:g} ms "
        f"({r['provisional']} read while provisional)\n"
    )
    print(
        "| reading | caller's thread per step: median µs | p90 µs | mean µs "
        "| MAE J | MAE % of window |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    mae = r["mae"]
    for label, cost, key in (
        ("Zeus 0.16 end_window (immediate)", r["cost"]["zeus"], "zeus"),
        ("zeus_async pop_window, read at once", r["cost"]["ours"], "ours"),
        ("zeus_async exact (~0.1 s later)", None, "exact"),
        ("floor: 2 edge stamps + 2 shared-memory reads a GPU", r["cost"]["floor"], ""),
    ):
        c = "| — | — | —"
        if cost is not None:
            c = f"| {cost[0]:.1f} | {cost[1]:.1f} | {cost[2]:.1f}"
        e = "| — | —" if not key else f"| {mae[key]:.4f} | {mae[key + '_rel'] * 100:.2f}"
        print(f"| {label} {c} {e} |")
    print(
        f"\nerror at once, ours/Zeus: {mae['ours'] / mae['zeus']:.3f}x (target ≤ 0.5x)", flush=True
    )


if __name__ == "__main__":
    main()
