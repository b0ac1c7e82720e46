"""Window energy error with and without adaptive reads, in real time (sampler in a child process).

Two simulated GPUs at constant power, ``Monitor(sampler="process")``, four 0.4 s windows per
monitor, ``--runs`` monitors each way, alternating; error is against the simulator's ground
truth. ``--load N`` keeps N busy-looping processes running meanwhile, so that the sampler is
descheduled now and then (late wake-ups, reads that see a refresh only after skipped ticks):
the tail of the error distribution is what this is for.

Run: ``.venv/bin/python bench/sampling/bench_adaptive_accuracy.py [--runs 3] [--load 0]``
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

from zeus_async import Monitor
from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.devices.sim_workload import ConstantWorkload

CONFIG = SimConfig(num_gpus=2, workload=ConstantWorkload(util=0.5), seed=1)


def errors(adaptive: bool) -> list[float]:
    node = SimNode(CONFIG)
    out: list[float] = []
    with Monitor(
        backend="sim", cpu_indices=[], sim_config=CONFIG, sampler="process", adaptive_reads=adaptive
    ) as mon:
        time.sleep(0.8)  # learning
        for _ in range(4):
            mon.begin_window("w")
            time.sleep(0.4)
            m = mon.end_window("w").wait(timeout=3)
            for gpu in (0, 1):
                truth = node.truth_energy_j(gpu, m.start_ns, m.end_ns)
                out.append(abs(m.gpu_energy_j[gpu] / truth - 1))
    return out


def _spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="monitors each way (default 3)")
    parser.add_argument("--load", type=int, default=0, help="busy processes meanwhile")
    args = parser.parse_args()
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for hog in hogs:
        hog.start()
    runs: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(args.runs):
            for adaptive in (False, True):
                runs[adaptive] += errors(adaptive)
    finally:
        for hog in hogs:
            hog.terminate()
    print(f"{args.runs} run(s) each way, {args.load} busy process(es)")
    print("| reads | windows x GPUs | median abs error | p95 abs error | max abs error |")
    print("|---|---:|---:|---:|---:|")
    for adaptive, errs in runs.items():
        errs.sort()
        print(
            f"| {'adaptive' if adaptive else 'every tick'} | {len(errs)} "
            f"| {errs[len(errs) // 2] * 100:.3f} % | {errs[int(len(errs) * 0.95)] * 100:.3f} % "
            f"| {errs[-1] * 100:.3f} % |"
        )


if __name__ == "__main__":
    main()
