"""Window energy error with and without adaptive reads, in real time (sampler in a child process).

Two simulated GPUs at constant power, ``Monitor(sampler="process")``, four 0.4 s windows per
monitor, three monitors each way, alternating; error is against the simulator's ground truth.

Run: ``.venv/bin/python bench/bench_adaptive_accuracy.py``
"""

from __future__ import annotations

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


def main() -> None:
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(3):
        for adaptive in (False, True):
            runs[adaptive] += errors(adaptive)
    print("| reads | windows x GPUs | median abs error | max abs error |")
    print("|---|---:|---:|---:|")
    for adaptive, errs in runs.items():
        errs.sort()
        print(
            f"| {'adaptive' if adaptive else 'every tick'} | {len(errs)} "
            f"| {errs[len(errs) // 2] * 100:.3f} % | {errs[-1] * 100:.3f} % |"
        )


if __name__ == "__main__":
    main()
