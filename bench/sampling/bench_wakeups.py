"""What one wake-up and one simulated NVML read cost on this machine (CPU µs).

The sampler's steady CPU is wake-ups * (cost of a wake-up + reads * cost of a read). This
script measures each part on its own, so the sampler figures of ``bench_sampler.py`` can be
taken apart:

* a 10 ms periodic wake-up by ``time.sleep`` (a bare polling thread, like Zeus's), by
  ``epoll`` (what an event loop blocks in), by an asyncio task sleeping (our samplers), by an
  asyncio ``call_at`` callback, and by a uvloop task if uvloop is installed;
* the same asyncio wake-up with 4 and 8 tasks due at once (one task per device);
* one ``nvmlDeviceGetFieldValues`` call on the simulator beneath ``pynvml`` (10 µs of burnt
  "driver" time by default), warm (back to back) and cold (one per 50 ms wake-up, four GPUs);
* whole read schedules of 4 simulated GPUs, nothing done with the values, CPU per second:
  Zeus's (a ``time.sleep`` loop reading every GPU every 10 ms) against the bracketing schedule
  of adaptive reads (each refresh read on the tick before it and the tick it shows, i.e. 2 of
  every 10 ticks; the simulator refreshes all GPUs at the same instants, the case most
  favourable to us) made by a bare loop, by one asyncio task per GPU (the runtime's design,
  with none of its work), and by one asyncio task for all GPUs; and, for scale, one read per
  refresh with no bracket. These are the least a sampler of each kind can cost, so their ratio
  to Zeus's bounds what ours can reach.

Run: ``bench/.venv/bin/python bench/sampling/bench_wakeups.py`` (see bench/README.md for the venv).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import resource
import selectors
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

PERIOD_S = 0.01


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _per_wake(fn: Callable[[int], None], n: int) -> float:
    c = _cpu()
    fn(n)
    return (_cpu() - c) / n * 1e6


def _sleep_loop(n: int) -> None:
    deadline = time.monotonic()
    for _ in range(n):
        deadline += PERIOD_S
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _epoll_loop(n: int) -> None:
    with selectors.EpollSelector() as sel:
        for _ in range(n):
            sel.select(PERIOD_S)


async def _tasks(n: int, tasks: int) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one() -> None:
        for k in range(1, n + 1):
            await asyncio.sleep(max(0.0, start + k * PERIOD_S - loop.time()))

    await asyncio.gather(*(one() for _ in range(tasks)))


async def _callbacks(n: int) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    done: asyncio.Future[None] = loop.create_future()
    count = [0]

    def tick() -> None:
        count[0] += 1
        if count[0] >= n:
            done.set_result(None)
        else:
            loop.call_at(start + (count[0] + 1) * PERIOD_S, tick)

    loop.call_at(start + PERIOD_S, tick)
    await done


def wakeups(n: int) -> list[tuple[str, float]]:
    rows = [
        ("time.sleep (bare thread loop)", _per_wake(_sleep_loop, n)),
        ("epoll_wait", _per_wake(_epoll_loop, n)),
        ("asyncio task, 1 due", _per_wake(lambda k: asyncio.run(_tasks(k, 1)), n)),
        ("asyncio task, 4 due at once", _per_wake(lambda k: asyncio.run(_tasks(k, 4)), n)),
        ("asyncio task, 8 due at once", _per_wake(lambda k: asyncio.run(_tasks(k, 8)), n)),
        ("asyncio call_at callback", _per_wake(lambda k: asyncio.run(_callbacks(k)), n)),
    ]
    try:
        uvloop = importlib.import_module("uvloop")  # optional, untyped where missing
    except ImportError:
        pass
    else:
        rows.append(("uvloop task, 1 due", _per_wake(lambda k: uvloop.run(_tasks(k, 1)), n)))
    return rows


def reads_worker(n: int, n_s: float) -> dict[str, float]:
    """Runs with the simulator installed as ``pynvml`` (see :func:`main`)."""
    import pynvml

    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
    field = [(pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_GPU)]
    c = _cpu()
    for _ in range(n):
        pynvml.nvmlDeviceGetFieldValues(handles[0], field)
    warm = (_cpu() - c) / n * 1e6
    wakes = max(1, n // 40)
    deadline = time.monotonic()
    c = _cpu()
    for _ in range(wakes):
        deadline += 0.05
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for h in handles:
            pynvml.nvmlDeviceGetFieldValues(h, field)
    cold_wake = (_cpu() - c) / wakes * 1e6
    return {
        "warm_read_us": warm,
        "wake_with_4_cold_reads_us": cold_wake,
        **schedules(handles, field, n_s),
    }


#: Ticks of every 10 (100 ms refresh at 10 ms) that the bracketing schedule reads, and the
#: one a schedule reading once per refresh (no bracket) reads.
_BRACKET = (0, 9)
_ONCE = (0,)


def schedules(handles: list[Any], field: Any, seconds: float) -> dict[str, float]:
    """CPU ms per second of whole read schedules (see the module docstring)."""
    import pynvml

    read = pynvml.nvmlDeviceGetFieldValues
    ticks = round(seconds / PERIOD_S)

    def thread_loop(bracket: bool) -> None:
        start = time.monotonic()
        for k in range(1, ticks + 1):
            if bracket and k % 10 not in _BRACKET:
                continue
            delay = start + k * PERIOD_S - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            for h in handles:
                read(h, field)

    async def tasks(per_gpu: bool, read_ticks: tuple[int, ...] = _BRACKET) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(group: list[Any]) -> None:
            for k in range(1, ticks + 1):
                if k % 10 not in read_ticks:
                    continue
                await asyncio.sleep(max(0.0, start + k * PERIOD_S - loop.time()))
                for h in group:
                    read(h, field)

        groups = [[h] for h in handles] if per_gpu else [handles]
        await asyncio.gather(*(one(g) for g in groups))

    def per_second(fn: Callable[[], None]) -> float:
        c = _cpu()
        fn()
        return (_cpu() - c) / seconds * 1e3

    return {
        "zeus_like_ms_s": per_second(lambda: thread_loop(False)),
        "bracket_thread_ms_s": per_second(lambda: thread_loop(True)),
        "bracket_tasks_per_gpu_ms_s": per_second(lambda: asyncio.run(tasks(True))),
        "bracket_one_task_ms_s": per_second(lambda: asyncio.run(tasks(False))),
        "once_tasks_per_gpu_ms_s": per_second(lambda: asyncio.run(tasks(True, _ONCE))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wakes", type=int, default=400, help="wake-ups per measurement")
    parser.add_argument("--reads", type=int, default=20_000, help="warm reads")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each schedule")
    parser.add_argument("--latency", type=float, default=10e-6, help="simulated NVML call cost")
    parser.add_argument("--reads-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reads_worker:
        print(json.dumps(reads_worker(args.reads, args.seconds)))
        return

    from zeus_async.devices.sim import SimConfig
    from zeus_async.devices.sim_workload import RandomWorkload
    from zeus_async.testing.sim_pynvml import shim_env

    rows = wakeups(args.wakes)
    config = SimConfig(
        num_gpus=4,
        call_latency_s=args.latency,
        seed=1,
        power_noise_w=3.0,
        workload=RandomWorkload(seg_min_s=0.05, seg_max_s=0.5),
    )
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--reads-worker",
            "--reads",
            str(args.reads),
            "--seconds",
            str(args.seconds),
        ],
        env={**os.environ, **shim_env(config)},
        capture_output=True,
        text=True,
        check=True,
    )
    reads: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nCPU per 10 ms wake-up ({args.wakes} wake-ups each)\n")
    print("| wake-up | CPU µs |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.0f} |")
    print(f"\nSimulated NVML read ({args.latency * 1e6:g} µs burnt per call)\n")
    print("| read | CPU µs |\n|---|---:|")
    print(f"| one call, warm (back to back) | {reads['warm_read_us']:.1f} |")
    print(
        "| one 50 ms wake-up of a time.sleep loop reading 4 GPUs | "
        f"{reads['wake_with_4_cold_reads_us']:.0f} |"
    )
    zeus = reads["zeus_like_ms_s"]
    print(f"\nRead schedules, 4 simulated GPUs, {args.seconds:g} s each\n")
    print("| schedule | wake-ups/s | reads/s | CPU ms/s | vs Zeus's |\n|---|---:|---:|---:|---:|")
    for key, name, wakes, reads_s in (
        ("zeus_like_ms_s", "Zeus's: time.sleep loop, every GPU every tick", 100, 400),
        ("bracket_thread_ms_s", "bracketing, time.sleep loop", 20, 80),
        ("bracket_tasks_per_gpu_ms_s", "bracketing, asyncio task per GPU", 20, 80),
        ("bracket_one_task_ms_s", "bracketing, one asyncio task for all GPUs", 20, 80),
        ("once_tasks_per_gpu_ms_s", "once per refresh (no bracket), asyncio task per GPU", 10, 40),
    ):
        ms = reads[key]
        print(f"| {name} | {wakes} | {reads_s} | {ms:.2f} | {ms / zeus:.2f}x |")


if __name__ == "__main__":
    main()
