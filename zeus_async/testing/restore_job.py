"""A job that changes hardware settings, for restore tests and benchmarks.

``python -m zeus_async.testing.restore_job [--record PATH] [--thread] [--print-windows]
[--backend nvml|sim-amd|amd]``: opens a :class:`~zeus_async.Monitor` on the node simulated by
``ZEUS_ASYNC_SIM`` (or, with ``--backend nvml``, on the GPUs NVML shows: a real GPU, as
``bench/hardware/bench_real_restore.py`` runs it), caps every GPU's power
limit to its minimum and locks GPU 0's SM clock (the two settings the optimizers change; not
the clock where the device's capabilities say clocks cannot be locked, as on AMD: ``--backend
sim-amd``, the simulator beneath amdsmi), prints ``capped <agent pid>`` and then measures one
window after another until it is stopped.
The test or benchmark stops it one way or another and reads the node's state from outside.
"""

from __future__ import annotations

import argparse
import logging
import time

from ..monitor import Monitor

logger = logging.getLogger(__name__)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", default=None)
    parser.add_argument("--backend", default="sim", choices=("sim", "sim-amd", "nvml", "amd"))
    parser.add_argument("--thread", action="store_true", help="sampler='thread'")
    parser.add_argument(
        "--print-windows", action="store_true", help="wait for each window, print its energy"
    )
    args = parser.parse_args()
    monitor = Monitor(
        backend=args.backend,
        cpu_indices=[],
        record=args.record,
        sampler="thread" if args.thread else "process",
        agent=False,
    )
    lowest = min(d.power_limit_min_w or 0.0 for d in monitor.gpu_devices)
    monitor.set_power_limit(lowest, source="restore_job").result(timeout=30)
    caps = monitor.gpu_devices[0].capabilities if monitor.gpu_devices else None
    if caps is None or caps.clocks:  # AMD GPUs: power caps only
        monitor.set_sm_clocks(990, [0], source="restore_job").result(timeout=30)
    agent = monitor._process._proc.pid if monitor._process and monitor._process._proc else 0
    print(f"capped {agent}", flush=True)  # noqa: T201
    while True:
        with monitor.window("step") as w:
            time.sleep(0.05)
        if args.print_windows and w.result is not None:
            print(f"window {w.result.total_energy:.3f} J", flush=True)  # noqa: T201


if __name__ == "__main__":
    main()
