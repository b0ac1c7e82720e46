"""Floors for reading a window's energy at once (issue 20, item 4), before building it.

    python bench/windows/bench_result_floor.py [--n 200]

Prints a Markdown table of per-call latencies (median and p90, µs) on this machine:

* **now**: ``Monitor`` (sampler in its own process, simulated GPUs) ``end_window`` and reading
  ``gpu_energy`` at once: it blocks until the counter-based figure is final;
* **round trip**: one request and its reply between two processes over ZeroMQ (``ipc://``,
  DEALER/ROUTER, as the agent's channel): the floor of asking the sampler for an estimate;
* **shared memory**: reading 4 GPUs' ``(t_ns, cumulative J, W)`` from a memory map under a
  sequence lock, as a sampler could publish them at every sample: the floor of computing the
  estimate in the caller, with no message at all;
* **NVML read**: one ``nvmlDeviceGetTotalEnergyConsumption`` per GPU (Zeus's immediate
  reading; simulated NVML here, so only the Python-side cost).
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import statistics
import struct
import time
from collections.abc import Callable

_REC = struct.Struct("<qdd")  # t_ns, cumulative J, power W
_GPUS = 4


def _quantiles(samples_ns: list[int]) -> tuple[float, float]:
    ordered = sorted(samples_ns)
    return statistics.median(ordered) / 1e3, ordered[int(len(ordered) * 0.9)] / 1e3


def _timed(fn: Callable[[], object], n: int) -> list[int]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


def bench_now(n: int) -> list[int]:
    from zeus_async import Monitor

    out = []
    with Monitor(backend="sim", cpu_indices=[], sync_execution_with=None) as mon:
        for k in range(n):
            mon.begin_window(f"w{k}")
            time.sleep(0.02)
            t0 = time.perf_counter_ns()
            result = mon.end_window(f"w{k}")
            _ = result.gpu_energy
            out.append(time.perf_counter_ns() - t0)
    return out


def _echo(endpoint: str, ready: multiprocessing.synchronize.Event) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        parts = sock.recv_multipart()
        if parts[-1] == b"stop":
            break
        sock.send_multipart(parts)
    sock.close(0)
    ctx.term()


def bench_round_trip(n: int, endpoint: str) -> list[int]:
    import zmq

    ready = multiprocessing.get_context("spawn").Event()
    proc = multiprocessing.get_context("spawn").Process(target=_echo, args=(endpoint, ready))
    proc.start()
    ready.wait(30)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    payload = b"x" * 64

    def once() -> None:
        sock.send(payload)
        sock.recv()

    for _ in range(50):  # connect and warm up
        once()
    out = _timed(once, n)
    sock.send(b"stop")
    proc.join(10)
    sock.close(0)
    ctx.term()
    return out


def bench_shared_memory(n: int) -> list[int]:
    buf = mmap.mmap(-1, 8 + _GPUS * _REC.size)
    struct.pack_into("<q", buf, 0, 2)  # an even sequence number: a complete write
    for g in range(_GPUS):
        _REC.pack_into(buf, 8 + g * _REC.size, time.time_ns(), 1000.0 * g, 300.0)

    def read() -> list[tuple[int, float, float]]:
        while True:
            (seq,) = struct.unpack_from("<q", buf, 0)
            got = [_REC.unpack_from(buf, 8 + g * _REC.size) for g in range(_GPUS)]
            if seq % 2 == 0 and struct.unpack_from("<q", buf, 0)[0] == seq:
                return got

    return _timed(read, n)


def bench_nvml(n: int) -> list[int]:
    from zeus_async.devices.sim import SimConfig
    from zeus_async.testing import sim_pynvml

    with sim_pynvml.patched_pynvml(config=SimConfig(num_gpus=_GPUS)) as pynvml:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(_GPUS)]

        def read() -> None:
            for h in handles:
                pynvml.nvmlDeviceGetTotalEnergyConsumption(h)

        return _timed(read, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            ("now: end_window + read gpu_energy", bench_now(min(args.n, 60))),
            (
                "round trip to another process (ZeroMQ ipc)",
                bench_round_trip(args.n, f"ipc://{tmp}/e"),
            ),
            ("shared memory read, 4 GPUs (seqlock)", bench_shared_memory(args.n * 10)),
            ("NVML energy read, 4 GPUs (simulated)", bench_nvml(args.n)),
        ]
    print("| what | median µs | p90 µs | calls |")
    print("|---|---:|---:|---:|")
    for name, samples in rows:
        p50, p90 = _quantiles(samples)
        print(f"| {name} | {p50:,.1f} | {p90:,.1f} | {len(samples)} |")


if __name__ == "__main__":
    main()
