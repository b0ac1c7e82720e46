"""CPU overhead of per-process metrics: 50 real processes sampled at 1 Hz.

Starts 50 idle Python processes (real pids, real ``/proc`` entries and smaps), then measures the
CPU time of the process sampler's tick (psutil readings + attribution) with its thread CPU
clock, in four cases:

* ``50 pids``: an explicit list of 50 pids (``--pid``), no GPU, read three ways: through
  psutil with PSS/USS every tick; through ``/proc`` directly (the default source on Linux) with
  PSS/USS every tick; and the default, PSS/USS every 5 s (RSS and CPU time every tick);
* ``tree of 50``: this process and its 50 children (descendants listed again every 5 s, the
  default; the listing scans every process of the machine, so its cost is amortized);
* ``tree of 50 + 8 GPUs``: the same plus 8 simulated GPUs asked for their processes (NVML
  calls over the simulator, ``gpu_all``);
* ``runtime, 50 pids``: the sampler inside a live ``Runtime`` at 1 Hz for ``--duration`` s on the
  real clock: CPU of its ticks / elapsed time.

Target (issue 7): <= 1 % of one core at 1 Hz, i.e. <= 10 ms of CPU per tick.

Run: ``.venv/bin/python bench/observability/bench_processes.py [--pids 50] [--ticks 30]
[--duration 10]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import anyio

from zeus_async.clock import FakeClock
from zeus_async.devices import open_devices
from zeus_async.devices.base import GpuProcessReader
from zeus_async.devices.processes import PsutilSource, default_source
from zeus_async.devices.sim import SimConfig
from zeus_async.runtime import ProcessTracking, Runtime
from zeus_async.runtime.hub import Hub
from zeus_async.runtime.processes import EnergyMeter, ProcessSampler

TARGET_PCT = 1.0


def spawn(n: int) -> list[subprocess.Popen[bytes]]:
    code = "import sys, time\nsys.stdin.read()"  # idle until stdin closes
    return [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE) for _ in range(n)]


def ticks_cost(sampler: ProcessSampler, clock: FakeClock, ticks: int) -> tuple[float, float, int]:
    """(mean, median) CPU ms per tick over ``ticks`` ticks 1 s apart, and events per tick."""
    sampler.tick(time.time_ns(), {})  # warm-up: opens the psutil handles
    clock.advance_sync(1.0)
    costs: list[float] = []
    events = 0
    for _ in range(ticks):
        before = sampler.stats.cpu_ns
        events = len(sampler.tick(time.time_ns(), {}))
        costs.append((sampler.stats.cpu_ns - before) / 1e6)
        clock.advance_sync(1.0)
    return statistics.mean(costs), statistics.median(costs), events


def make(
    tracking: ProcessTracking, gpus: list[GpuProcessReader], source: PsutilSource | None = None
) -> tuple[ProcessSampler, FakeClock]:
    clock = FakeClock(wall_start_ns=time.time_ns())
    source = source or default_source()
    sampler = ProcessSampler(tracking, source, gpus, Hub(), clock, "bench", EnergyMeter())
    return sampler, clock


async def runtime_case(pids: tuple[int, ...], duration: float) -> tuple[float, int]:
    async with Runtime(devices=[], cpus=None, processes=ProcessTracking(pids=pids)) as rt:
        t0 = time.perf_counter()
        await anyio.sleep(duration)
        elapsed = time.perf_counter() - t0
        assert rt.process_sampler is not None
        stats = rt.process_sampler.stats
        return stats.cpu_ns / 1e9 / elapsed * 100, stats.ticks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pids", type=int, default=50)
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--duration", type=float, default=10.0)
    args = parser.parse_args()

    children = spawn(args.pids)
    try:
        time.sleep(1.0)  # let them start
        pids = tuple(c.pid for c in children)
        rows: list[tuple[str, float, float, int]] = []
        n = args.pids
        sampler, clock = make(ProcessTracking(pids=pids), [], PsutilSource())
        rows.append((f"{n} pids, psutil, PSS 1 s", *ticks_cost(sampler, clock, args.ticks)))
        sampler, clock = make(ProcessTracking(pids=pids, smaps_s=1.0), [])
        rows.append((f"{n} pids, /proc, PSS 1 s", *ticks_cost(sampler, clock, args.ticks)))
        sampler, clock = make(ProcessTracking(pids=pids), [])
        rows.append((f"{n} pids, /proc, PSS 5 s", *ticks_cost(sampler, clock, args.ticks)))
        sampler, clock = make(ProcessTracking(), [])
        rows.append((f"tree of {args.pids}", *ticks_cost(sampler, clock, args.ticks)))
        sim = SimConfig(num_gpus=8, process_pids=pids[:8])
        gpus = [
            g
            for g in open_devices("sim", cpus=None, sim_config=sim).gpus
            if isinstance(g, GpuProcessReader)
        ]
        sampler, clock = make(ProcessTracking(gpu_all=True), gpus)
        rows.append((f"tree of {args.pids} + 8 GPUs", *ticks_cost(sampler, clock, args.ticks)))

        print(f"{'case':<30}{'events/tick':>12}{'mean ms':>10}{'median ms':>11}"
              f"{'% core @1Hz':>13}{'target':>8}  pass")  # fmt: skip
        for name, mean, median, events in rows:
            pct = mean / 10  # ms per second -> percent of one core
            ok = "yes" if pct <= TARGET_PCT else "NO"
            print(f"{name:<30}{events:>12}{mean:>10.2f}{median:>11.2f}{pct:>13.2f}"
                  f"{TARGET_PCT:>7.0f}%  {ok}")  # fmt: skip
        pct, ticks = anyio.run(runtime_case, pids, args.duration)
        ok = "yes" if pct <= TARGET_PCT else "NO"
        print(
            f"{'runtime, ' + str(args.pids) + ' pids':<26}{'':>12}{'':>10}{'':>11}"
            f"{pct:>13.2f}{TARGET_PCT:>7.0f}%  {ok}   ({ticks} ticks in {args.duration:g} s)"
        )
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()


if __name__ == "__main__":
    main()
