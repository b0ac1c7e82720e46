"""Sampler CPU cost: zeus_async's runtime vs Zeus 0.16 ``PowerMonitor`` on the same simulated GPUs.

Both run in fresh subprocesses whose ``pynvml`` is zeus_async's simulator (through the shim
on PYTHONPATH; zeus_async uses its ``nvml`` backend, the code that runs on real GPUs), with
the same GPU count, cadence, per-call NVML latency and duration. CPU seconds are user+system
time of the measuring process *and all its children* (Zeus polls from spawned processes),
split into

* startup: from before constructing the monitor until it is sampling (imports excluded);
* steady: the sampling interval itself (the cost that grows with run length);
* total: startup + steady + stop.

Our runtime runs reading every tick, and with ``adaptive_reads=True`` (reads that can only
repeat the last power value skipped; "changes not bracketed" counts the changes that rule saw
late); the latter also with measurement windows on (``windows=True``, as ``Monitor`` runs it:
the window tracker accounts every sample), with no window open.

``--real`` runs the same rows on real GPUs (``--gpus`` of them) through the installed
``pynvml`` instead of the simulator.

``--profile h100-580`` gives the simulator the NVML call costs measured on a real H100 (driver
580.159.04: ``H100_DRIVER_580_COSTS``, an energy-counter read 3.84 ms of CPU) in place of
``--latency``. ``--ours-only`` runs only our runtime, every tick and with adaptive reads, on
``--gpus`` GPUs x ``--fields`` (``monitor``: ``power_w`` and ``energy_j``, what ``Monitor``
samples by default), and prints its CPU per GPU.

Run: ``bench/.venv/bin/python bench/sampling/bench_sampler.py`` (see bench/README.md for the venv).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent


def _cpu_tree() -> float:
    """CPU seconds of this process plus its live children."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def _cpu_all_including_reaped() -> float:
    r_self = resource.getrusage(resource.RUSAGE_SELF)
    r_child = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r_self.ru_utime + r_self.ru_stime + r_child.ru_utime + r_child.ru_stime


def worker(kind: str, gpus: int, period: float, duration: float, fields: str) -> dict[str, Any]:
    adaptive = kind in ("adaptive", "adaptive-windows")
    extra: dict[str, Any] = {}
    if kind == "floor":
        # The least any 100 Hz sampler can pay: the same NVML calls from a bare loop, nothing
        # done with the values.
        import threading

        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(gpus)]
        field = [(pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_GPU)]
        stop = threading.Event()
        reads = [0]

        def loop() -> None:
            deadline = time.monotonic()
            while not stop.is_set():
                for h in handles:
                    pynvml.nvmlDeviceGetFieldValues(h, field)
                reads[0] += len(handles)
                deadline += period
                delay = deadline - time.monotonic()
                if delay > 0:
                    time.sleep(delay)

        c0, w0 = _cpu_all_including_reaped(), time.perf_counter()
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        c1_tree = _cpu_tree()
        time.sleep(duration)
        c2_tree = _cpu_tree()
        samples = reads[0]
        stop.set()
        thread.join()
        c3 = _cpu_all_including_reaped()
        startup = c1_tree
    elif kind == "zeus":
        import logging

        logging.disable(logging.WARNING)  # Zeus warns about <50 ms periods on every start
        from zeus.monitor.power import PowerDomain, PowerMonitor

        c0, w0 = _cpu_all_including_reaped(), time.perf_counter()
        mon = PowerMonitor(
            gpu_indices=list(range(gpus)),
            update_period=period,
            power_domains=[PowerDomain.DEVICE_INSTANT],
        )
        c1_tree = _cpu_tree()
        time.sleep(duration)
        c2_tree = _cpu_tree()
        timeline = mon.get_power_timeline(PowerDomain.DEVICE_INSTANT)
        samples = sum(len(v) for v in (timeline or {}).values())
        mon.stop()
        for p in list(mon.processes.values()):
            p.join(timeout=5)
        c3 = _cpu_all_including_reaped()
        startup = c1_tree
    else:
        from zeus_async.devices.base import GPU_FIELDS
        from zeus_async.runtime import EmbeddedRuntime

        field_map: dict[str, float | None] | None
        if fields == "power":
            field_map = {"power_w": None}
        elif fields == "monitor":  # Monitor's default: what windows need
            field_map = {"power_w": None, "energy_j": None}
        else:
            field_map = dict.fromkeys(GPU_FIELDS)
        c0, w0 = _cpu_all_including_reaped(), time.perf_counter()
        rt = EmbeddedRuntime(
            backend="nvml",
            gpus=list(range(gpus)),
            cpus=None,
            period_s=period,
            fields=field_map,
            adaptive_reads=adaptive,
            windows=kind == "adaptive-windows",
        )
        rt.start()
        assert rt.runtime is not None
        c1_tree = _cpu_tree()
        time.sleep(duration)
        c2_tree = _cpu_tree()
        samples = sum(s.stats.reads for s in rt.runtime.samplers)
        extra["missed_ticks"] = sum(s.stats.missed_ticks for s in rt.runtime.samplers)
        extra["offloaded"] = sum(s.stats.offloaded for s in rt.runtime.samplers)
        extra["skipped_ticks"] = sum(s.stats.skipped_ticks for s in rt.runtime.samplers)
        extra["unbracketed"] = sum(s.unbracketed_changes for s in rt.runtime.samplers)
        rt.stop()
        c3 = _cpu_all_including_reaped()
        startup = c1_tree
    # `startup` is the tree's CPU at "ready"; subtract what this process had spent before
    # constructing the monitor (interpreter start, imports) so it counts the monitor alone.
    startup -= c0
    steady = c2_tree - c1_tree
    return {
        "kind": kind,
        "gpus": gpus,
        "period_s": period,
        "duration_s": duration,
        "fields": fields,
        "startup_cpu_s": startup,
        "steady_cpu_s": steady,
        "total_cpu_s": c3 - c0,
        "samples": samples,
        "wall_s": time.perf_counter() - w0,
        **extra,
    }


def run_worker(
    python: str,
    kind: str,
    gpus: int,
    period: float,
    duration: float,
    fields: str,
    latency: float,
    real: bool = False,
    profile: str = "none",
) -> dict[str, Any]:
    cmd = [python, __file__, "--worker", kind, "--gpus", str(gpus), "--period", str(period)]
    cmd += ["--duration", str(duration), "--fields", fields]
    env = dict(os.environ) if real else {**os.environ, **_sim_env(gpus, latency, profile)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{out.stderr[-4000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _sim_env(gpus: int, latency: float, profile: str = "none") -> dict[str, str]:
    from zeus_async.devices.sim_config import H100_DRIVER_580_COSTS, sim_preset
    from zeus_async.devices.sim_workload import RandomWorkload
    from zeus_async.testing.sim_pynvml import shim_env

    costs: dict[str, float] = {"call_latency_s": latency}
    if profile == "h100-580":
        costs = dict(H100_DRIVER_580_COSTS)
    # Varying power (and a little noise) so Zeus's de-duplication of equal readings does not
    # make its job artificially cheap.
    config = sim_preset(
        "nvidia",
        num_gpus=gpus,
        seed=1,
        power_noise_w=3.0,
        workload=RandomWorkload(seg_min_s=0.05, seg_max_s=0.5),
        **costs,
    )
    return shim_env(config)


def _ours_only(py: str, args: argparse.Namespace) -> None:
    """Our runtime alone, every tick and adaptive reads, on ``--gpus`` x ``--fields``."""
    source = "real GPUs" if args.real else f"simulator, costs {args.profile}"
    if not args.real and args.profile == "none":
        source += f" (every call {args.latency * 1e6:g} us)"
    print(
        f"\nzeus_async Runtime CPU, {args.gpus} GPU(s) x {args.fields}, {args.duration:g} s at "
        f"{1 / args.period:g} Hz, {source} (mean of {args.repeat})\n"
    )
    print("| reads | steady CPU s | per GPU, % of a core | reads kept | missed ticks |")
    print("|---|---:|---:|---:|---:|")
    for kind, label in (("ours", "every tick"), ("adaptive", "adaptive reads")):
        runs = [
            run_worker(
                py,
                kind,
                args.gpus,
                args.period,
                args.duration,
                args.fields,
                args.latency,
                args.real,
                args.profile,
            )
            for _ in range(args.repeat)
        ]
        steady = sum(r["steady_cpu_s"] for r in runs) / len(runs)
        kept = sum(r["samples"] for r in runs) / len(runs)
        missed = sum(r.get("missed_ticks", 0) for r in runs) / len(runs)
        share = steady / args.duration / args.gpus * 100
        print(f"| {label} | {steady:.3f} | {share:.1f} % | {kept:.0f} | {missed:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--worker", choices=("zeus", "ours", "adaptive", "adaptive-windows", "floor")
    )
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--period", type=float, default=0.01)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--fields", choices=("power", "monitor", "all"), default="power")
    parser.add_argument("--latency", type=float, default=10e-6, help="simulated NVML call cost")
    parser.add_argument(
        "--profile",
        choices=("none", "h100-580"),
        default="none",
        help="simulated NVML call costs: --latency for every call (none), or those measured "
        "on a real H100, driver 580 (h100-580: an energy read 3.84 ms)",
    )
    parser.add_argument(
        "--ours-only",
        action="store_true",
        help="only our runtime (every tick, adaptive reads) on --gpus x --fields",
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--real",
        action="store_true",
        help="the real GPUs through the installed pynvml, not the simulator (--gpus: how many)",
    )
    args = parser.parse_args()
    if args.worker:
        res = worker(args.worker, args.gpus, args.period, args.duration, args.fields)
        print(json.dumps(res))
        return
    py = sys.executable
    if args.ours_only:
        _ours_only(py, args)
        return
    # The simulator: 4 GPUs x power against Zeus, 8 GPUs x all fields for our cost alone. Real
    # GPUs: as many as there are (--gpus), both ways.
    small, big = (args.gpus, args.gpus) if args.real else (4, 8)
    rows: list[dict[str, Any]] = []

    def row(kind: str, gpus: int, fields: str) -> dict[str, Any]:
        return run_worker(py, kind, gpus, 0.01, args.duration, fields, args.latency, args.real)

    for _ in range(args.repeat):
        for kind in ("zeus", "ours", "adaptive", "adaptive-windows", "floor"):
            rows.append(row(kind, small, "power"))
    rows.append(row("ours", big, "all"))
    rows.append(row("adaptive", big, "all"))

    def mean(kind: str, gpus: int, fields: str) -> dict[str, Any]:
        cand = [r for r in rows if (r["kind"], r["gpus"], r["fields"]) == (kind, gpus, fields)]
        out = dict(cand[0])
        for key in ("startup_cpu_s", "steady_cpu_s", "total_cpu_s", "samples"):
            out[key] = sum(r[key] for r in cand) / len(cand)
        out["missed_ticks"] = sum(r.get("missed_ticks", 0) for r in cand)
        out["unbracketed"] = sum(r.get("unbracketed", 0) for r in cand)
        return out

    z, o = mean("zeus", small, "power"), mean("ours", small, "power")
    o8 = mean("ours", big, "all")
    a, a8 = mean("adaptive", small, "power"), mean("adaptive", big, "all")
    aw = mean("adaptive-windows", small, "power")
    fl = mean("floor", small, "power")
    source = "real GPUs" if args.real else f"simulated NVML call {args.latency * 1e6:g} us"
    print(f"\nSampler CPU cost, {args.duration:g} s at 100 Hz, {source} (mean of {args.repeat})\n")
    print(
        "| sampler | GPUs x fields | values kept | startup CPU s | steady CPU s | total CPU s "
        "| changes not bracketed |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, r in (
        ("Zeus 0.16 PowerMonitor (keeps changed values only)", z),
        ("zeus_async Runtime, every tick", o),
        ("zeus_async Runtime, adaptive reads", a),
        ("zeus_async Runtime, adaptive reads, windows on", aw),
        ("floor: bare thread loop, same NVML calls, no output", fl),
        ("zeus_async Runtime, every tick", o8),
        ("zeus_async Runtime, adaptive reads", a8),
    ):
        unbracketed = str(r["unbracketed"]) if r["kind"].startswith("adaptive") else ""
        print(
            f"| {name} | {r['gpus']} x {r['fields']} | {r['samples']:.0f} "
            f"| {r['startup_cpu_s']:.3f} | {r['steady_cpu_s']:.3f} | {r['total_cpu_s']:.3f} "
            f"| {unbracketed} |"
        )
    for label, r in (
        ("every tick", o),
        ("adaptive reads", a),
        ("adaptive reads, windows on", aw),
    ):
        print(
            f"\nratio ours ({label})/Zeus, {small} GPUs x power: "
            f"steady {r['steady_cpu_s'] / z['steady_cpu_s']:.3f}x, "
            f"total {r['total_cpu_s'] / z['total_cpu_s']:.3f}x (target <= 0.25x)"
        )
    print(
        f"floor/Zeus steady {fl['steady_cpu_s'] / z['steady_cpu_s']:.3f}x; missed ticks: "
        f"{o['missed_ticks']}, {a['missed_ticks']} ({small} GPUs), {o8['missed_ticks']}, "
        f"{a8['missed_ticks']} ({big} GPUs x all)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
