"""Workload identity: what the resolver costs, and how many labels it keeps.

    .venv/bin/python bench/agent/bench_workloads.py

A node of 8 GPUs running 20 Slurm jobs of 10 processes each (200 tracked processes), in a
fake /proc tree (each process with a cgroup v2 Slurm path and a 3 KB environment holding
``SLURM_*`` variables), and the same 200 processes as real children in the real /proc (plain
``sleep``s: their cgroup names no job, so each is its user's). Measured, each the median of
``--repeat`` runs:

* ``for_pid`` the first time (reads /proc: stat, cgroup, environ, comm, status), per process;
* ``for_pid`` cached, and ``for_gpu``, per call;
* ``refresh()`` with 200 cached processes (each checked still the same process), without and
  with a Kubernetes source (a real gRPC server on a unix socket listing 20 pods on 8 GPUs).

Then the label set (``len(workloads())``) over 1,000 job starts and ends (a job starts every
second and runs 10 s; fake clock, refresh every second): with ``expire_s=60`` and with expiry
off, side by side.

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

from zeus_async.agent.kubernetes import KubernetesSource
from zeus_async.agent.slurm import SlurmSource
from zeus_async.agent.workloads import WorkloadResolver
from zeus_async.clock import FakeClock
from zeus_async.testing.fake_proc import FakeProc

GPUS = 8
JOBS = 20
PER_JOB = 10
UUIDS = [f"GPU-{i:08x}-1111-2222-3333-444444444444" for i in range(GPUS)]
S = 1_000_000_000


def _median_us(fn: Callable[[], object], repeat: int, inner: int = 1) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter_ns() - t0) / inner / 1e3)
    return statistics.median(times)


def _fake_node(root: Path) -> list[int]:
    proc = FakeProc(root)
    filler = {f"VAR_{i:03d}": "x" * 20 for i in range(100)}  # ~3 KB, as a real job's
    pids = []
    for j in range(JOBS):
        for k in range(PER_JOB):
            pid = 1000 + j * PER_JOB + k
            proc.add(
                pid,
                uid=2000 + j % 5,
                cgroup=FakeProc.slurm_v2(5000 + j, str(k % 2)),
                environ={
                    **filler,
                    "SLURM_JOB_ID": str(5000 + j),
                    "SLURM_JOB_USER": f"user{j % 5}",
                    "SLURM_JOB_PARTITION": "gpu",
                    "SLURM_STEP_GPUS": str(j % GPUS),
                },
            )
            pids.append(pid)
    return pids


def _kubelet(path: Path) -> Any:
    """A gRPC server listing 20 pods on 8 GPUs (the source's own messages encode it)."""
    import grpc

    from zeus_async.agent.kubernetes import podresources_messages

    m = podresources_messages()
    reply = m["ListPodResourcesResponse"]()
    for j in range(JOBS):
        pod = reply.pod_resources.add(name=f"job-{j}", namespace="team")
        c = pod.containers.add(name="main", cpu_ids=[j])
        c.devices.add(resource_name="nvidia.com/gpu", device_ids=[UUIDS[j % GPUS]])
    data = reply.SerializeToString()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: data)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("v1.PodResourcesLister", {"List": handler}),)
    )
    server.add_insecure_port(f"unix:{path}")
    server.start()
    return server


def _costs(repeat: int) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    tmp = Path(tempfile.mkdtemp(prefix="zwl-", dir="/tmp"))
    children: list[subprocess.Popen[bytes]] = []
    server = None
    try:
        pids = _fake_node(tmp / "proc")

        def cold() -> None:
            r = WorkloadResolver(slurm=SlurmSource(tmp / "proc"), gpu_uuids=UUIDS)
            for pid in pids:
                r.for_pid(pid)

        rows.append(
            (
                "`for_pid`, first time (fake /proc)",
                f"{_median_us(cold, repeat) / len(pids):.1f} µs a process",
            )
        )
        r = WorkloadResolver(slurm=SlurmSource(tmp / "proc"), gpu_uuids=UUIDS)
        for pid in pids:
            r.for_pid(pid)
        assert len(r.workloads()) == JOBS
        rows.append(
            (
                "`for_pid`, cached",
                f"{_median_us(lambda: [r.for_pid(p) for p in pids], repeat) / len(pids):.2f} µs",
            )
        )
        rows.append(
            (
                "`for_gpu`",
                f"{_median_us(lambda: [r.for_gpu(g) for g in range(GPUS)], repeat) / GPUS:.2f} µs",
            )
        )
        rows.append(
            (
                f"`refresh()`, {len(pids)} processes, {JOBS} jobs (fake /proc)",
                f"{_median_us(r.refresh, repeat) / 1e3:.3f} ms",
            )
        )

        sock = tmp / "kubelet.sock"
        server = _kubelet(sock)
        k8s = KubernetesSource(sock)
        rk = WorkloadResolver(slurm=SlurmSource(tmp / "proc"), kubernetes=k8s, gpu_uuids=UUIDS)
        for pid in pids:
            rk.for_pid(pid)
        rk.refresh()
        assert len(rk.workloads()) == 2 * JOBS
        rows.append(
            (
                f"`refresh()`, same + kubelet `List` of {JOBS} pods (real gRPC, unix socket)",
                f"{_median_us(rk.refresh, repeat) / 1e3:.3f} ms",
            )
        )
        rows.append(("kubelet `List` alone", f"{_median_us(k8s.list, repeat) / 1e3:.3f} ms"))
        k8s.close()

        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_JOB_GPUS": "0"}
        children = [subprocess.Popen(["sleep", "1000"], env=env) for _ in range(JOBS * PER_JOB)]
        real = [c.pid for c in children]

        def cold_real() -> None:
            rr = WorkloadResolver(slurm=SlurmSource())
            for pid in real:
                rr.for_pid(pid)

        rows.append(
            (
                "`for_pid`, first time (real /proc)",
                f"{_median_us(cold_real, repeat) / len(real):.1f} µs a process",
            )
        )
        rr = WorkloadResolver(slurm=SlurmSource())
        for pid in real:
            rr.for_pid(pid)
        rows.append(
            (
                f"`refresh()`, {len(real)} processes (real /proc)",
                f"{_median_us(rr.refresh, repeat) / 1e3:.3f} ms",
            )
        )
    finally:
        for c in children:
            c.kill()
            c.wait()
        if server is not None:
            server.stop(None).wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _label_set(expire_s: float, jobs: int = 1000, run_s: int = 10) -> tuple[int, int, int]:
    """(largest, at the last start, 80 s after the last end) label-set size."""
    clock = FakeClock()
    slurm = SlurmSource()
    r = WorkloadResolver(slurm=slurm, gpu_uuids=UUIDS, expire_s=expire_s, clock=clock)
    largest = at_last = 0
    for t in range(jobs + run_s + 80):
        clock.set_ns(t * S)
        if t < jobs:
            slurm.register(t + 1, gpus=[t % GPUS])
        if run_s <= t < jobs + run_s:
            slurm.unregister(t - run_s + 1)
        r.refresh()
        size = len(r.workloads())
        largest = max(largest, size)
        if t == jobs - 1:
            at_last = size
    return largest, at_last, len(r.workloads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=50, help="runs per cost (median)")
    args = parser.parse_args()
    print(f"| cost ({GPUS} GPUs, {JOBS} jobs x {PER_JOB} processes) | median |")
    print("|---|---|")
    for name, value in _costs(args.repeat):
        print(f"| {name} | {value} |")
    print()
    print(
        "| 1,000 jobs (1 start/s, 10 s each) | largest label set | at the last start "
        "| 80 s after the last end |"
    )
    print("|---|---|---|---|")
    for label, expire in (("`expire_s=60`", 60.0), ("no expiry", 1e9)):
        largest, at_last, after = _label_set(expire)
        print(f"| {label} | {largest} | {at_last} | {after} |")


if __name__ == "__main__":
    main()
