"""Every GPU vendor on its simulator, side by side: window error and sampler CPU (issue 37).

Per vendor, each on the simulator beneath its real API (the backend's real code runs over it):

* ``NVIDIA H100``: ``--backend sim`` (``sim_pynvml`` beneath ``pynvml``), ``sim_preset("nvidia")``;
* ``AMD MI300X``: ``--backend sim-amd`` (``sim_amdsmi`` beneath ``amdsmi``), ``sim_preset("amd")``;
* ``Jetson AGX Orin``: ``--backend sim-jetson`` (a virtual INA3221 sysfs),
  ``sim_preset("jetson")``, GPU rail;
* ``Apple M3 Max``: ``--backend sim-apple`` (``sim_ioreport`` in place of
  ``zeus_apple_silicon``), ``sim_preset("apple")``;
* ``GH200, module scope``: ``--backend sim`` with ``grace_preset()`` and
  ``power_scope="module"`` (GPU + Grace CPU + memory), against
  ``SimNode.truth_module_energy_j``.

Three figures per vendor:

1. **2 s windows**: the mean absolute error, in % of the true energy, of our exact figure over
   ``--windows`` windows x the node's GPUs (2 GPUs where the preset has several, else 1), on a
   square wave (0.37 s, 10 %/100 %) and on random levels held 0.05-1 s (the workloads of
   ``bench/windows/bench_short_windows.py``), after a 5 s warm-up, windows at random phases.
   The truth is the simulator's exact integral (``SimNode.truth_energy_j``, or
   ``truth_module_energy_j`` for the module scope) on the node the backend serves. Targets
   (issue 37): <= 1 % where the device has an energy counter, <= 3 % on integrated power.
2. **50 ms windows**: ours (exact, and provisional: read the moment the window closes) beside
   Zeus 0.16's ``ZeusMonitor(approx_instant_energy=True)`` on the same simulated device, opened
   and closed at the same fake-clock instants (Zeus's ``time()`` patched to the fake clock, as
   in ``bench_short_windows.py``). How Zeus is pointed at each simulator, in-process:

   - NVIDIA and GH200: ``sim_pynvml`` installed as ``pynvml``. On the GH200 Zeus sees C2C
     enabled (``nvmlDeviceGetC2cModeInfoV``) and reads its *power* in the MODULE scope, but
     its window energy is still ``nvmlDeviceGetTotalEnergyConsumption``, the GPU's counter:
     its error against the module's truth is the CPU and memory it leaves out.
   - AMD: ``sim_amdsmi`` as ``amdsmi`` in ``sys.modules`` before Zeus is imported, Zeus's
     ``nvml_is_available`` patched to ``False`` so that ``get_gpus`` picks ``AMDGPUs``, and
     the 0.5 s ``time.sleep`` of its counter check advanced on the fake clock.
   - Apple: ``sim_ioreport`` as ``zeus_apple_silicon`` before Zeus is imported, and
     ``sys.platform``/``platform.processor()`` answered ``darwin``/``arm`` *inside Zeus's
     ``zeus.device.soc.apple`` module only*; Zeus's figure is its ``soc_energy``
     ``gpu_mj + gpu_sram_mj`` (what our GPU device and the truth count).
   - Jetson: not compared. Zeus's Jetson path reads fixed ``/sys/bus/i2c/drivers/...`` paths
     with ``pathlib`` after checking ``platform.processor() == "aarch64"`` and a Tegra file;
     pointing it at the virtual sysfs would mean patching ``Path`` inside Zeus, not running
     Zeus: "not supported on the simulator".

3. **Sampler CPU per device**: our ``Runtime`` (``EmbeddedRuntime``, real clock) sampling 1 GPU
   of each simulator at 100 Hz (``power_w`` and ``energy_j``, what ``Monitor`` samples; the
   fields a device lacks are skipped) for ``--cpu-duration`` s, every tick and with adaptive
   reads, in a fresh process each: CPU seconds (user + system of the process and its children,
   as ``bench/sampling/bench_sampler.py`` counts them) per device-second of the steady
   interval. Every simulated call is free (no ``call_latency_s``), so the figure is our
   sampler's own cost plus the simulator's Python, not a driver's: the vendors' real call
   costs are unknown here except NVIDIA's (``bench/sampling/bench_sampler.py --profile``).

Each case runs in its own process (Zeus keeps its GPUs and SoC process-wide). Prints one
markdown table.

Run (from the repository root; ``bench/.venv`` has Zeus 0.16 and zeus_async installed editable
from this checkout, see bench/README.md)::

    bench/.venv/bin/python bench/devices/bench_vendors.py
    bench/.venv/bin/python bench/devices/bench_vendors.py --windows 20 --cpu-duration 5

``--vendors nvidia amd`` runs a subset; ``--skip-cpu`` leaves the sampler rows out.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import resource
import statistics
import subprocess
import sys
import time
import types
from typing import Any

import anyio

logger = logging.getLogger(__name__)

MS = 1_000_000
#: Window lengths measured (ms).
LENGTHS_MS = (2000, 50)
WORKLOADS = ("square 0.37 s", "random 0.05-1 s")
#: Vendor key -> (label, backend, power scope, what Zeus 0.16 can read on it).
VENDORS: dict[str, tuple[str, str, str, str | None]] = {
    "nvidia": ("NVIDIA H100 (sim)", "sim", "gpu", "nvml"),
    "amd": ("AMD MI300X (sim-amd)", "sim-amd", "gpu", "amd"),
    "jetson": ("Jetson AGX Orin (sim-jetson)", "sim-jetson", "gpu", None),
    "apple": ("Apple M3 Max (sim-apple)", "sim-apple", "gpu", "apple"),
    "grace": ("GH200, module scope (sim)", "sim", "module", "nvml"),
}


def _workload(name: str) -> Any:
    from zeus_async.devices.sim_workload import RandomWorkload, SquareWorkload

    if name == "square 0.37 s":
        return SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1)
    return RandomWorkload(seg_min_s=0.05, seg_max_s=1.0)


def _config(vendor: str, workload: str | None, gpus: int) -> Any:
    """The simulated node of ``vendor``: its preset, ``gpus`` GPUs where it has several."""
    from zeus_async.devices.sim_config import grace_preset, sim_preset
    from zeus_async.devices.sim_workload import RandomWorkload

    load = _workload(workload) if workload else RandomWorkload(seg_min_s=0.05, seg_max_s=0.5)
    if vendor == "grace":
        return grace_preset(seed=11, workload=load)
    if vendor in ("jetson", "apple"):
        return _preset(vendor, seed=11, workload=load)
    return sim_preset(vendor, num_gpus=gpus, seed=11, workload=load)


def _preset(vendor: str, **fields: Any) -> Any:
    from zeus_async.devices.sim_config import sim_preset

    return sim_preset(vendor, **fields)


def _served_node(vendor: str) -> Any:
    """The node the backend serves (its truth is the truth of what was sampled)."""
    if vendor == "amd":
        from zeus_async.testing import sim_amdsmi

        return sim_amdsmi.current_node()
    if vendor == "apple":
        from zeus_async.testing import sim_ioreport

        return sim_ioreport.current_node()
    if vendor == "jetson":
        from zeus_async.testing import sim_jetson

        fs = sim_jetson.current_fs()
        return None if fs is None else fs.node
    from zeus_async.testing import sim_pynvml

    return sim_pynvml.current_node()


def _zeus_monitor(kind: str, clock: Any, gpus: int) -> Any:
    """Zeus 0.16's ``ZeusMonitor`` over the simulator the runtime samples (see the module
    docstring for how each vendor's path is reached); its ``time()`` is the fake clock's."""
    logging.getLogger("zeus").setLevel(logging.ERROR)
    if kind == "nvml":
        from zeus_async.testing import sim_pynvml

        sim_pynvml.install_as_pynvml()
    elif kind == "amd":
        from zeus_async.testing import sim_amdsmi

        sys.modules["amdsmi"] = sim_amdsmi
    elif kind == "apple":
        from zeus_async.testing import sim_ioreport

        sys.modules["zeus_apple_silicon"] = sim_ioreport
    import zeus.device.gpu as zeus_gpu
    import zeus.monitor.energy as zeus_energy

    zeus_energy.time = lambda: clock.wall_ns() / 1e9  # type: ignore[attr-defined]
    if kind == "amd":
        import zeus.device.gpu.amd as zeus_amd

        zeus_gpu.nvml_is_available = lambda: False  # type: ignore[attr-defined]
        # Its counter check sleeps 0.5 s: on the fake clock.
        zeus_amd.time = types.SimpleNamespace(sleep=clock.advance_sync)  # type: ignore[attr-defined]
    if kind == "apple":
        import zeus.device.soc.apple as zeus_apple

        zeus_gpu.nvml_is_available = lambda: False  # type: ignore[attr-defined]
        zeus_gpu.amdsmi_is_available = lambda: False  # type: ignore[attr-defined]
        zeus_apple.sys = types.SimpleNamespace(platform="darwin")  # type: ignore[attr-defined]
        zeus_apple.platform = types.SimpleNamespace(processor=lambda: "arm")  # type: ignore[attr-defined]
        zeus_apple.apple_silicon_is_available.cache_clear()
        monitor = zeus_energy.ZeusMonitor(
            gpu_indices=[], cpu_indices=[], approx_instant_energy=True
        )
        if not monitor.soc_is_present:
            raise RuntimeError("Zeus did not take the simulated Apple SoC")
        return monitor
    monitor = zeus_energy.ZeusMonitor(
        gpu_indices=list(range(gpus)), cpu_indices=[], approx_instant_energy=True
    )
    name = type(monitor.gpus).__name__
    expected = {"nvml": "NVIDIAGPUs", "amd": "AMDGPUs"}[kind]
    if name != expected:
        raise RuntimeError(f"Zeus took {name}, not {expected}")
    return monitor


def _zeus_energy(kind: str, measurement: Any, gpu: int) -> float:
    if kind == "apple":
        soc = measurement.soc_energy
        return float((soc.gpu_mj or 0) + (soc.gpu_sram_mj or 0)) / 1e3
    return float(measurement.gpu_energy[gpu])


async def _accuracy(
    vendor: str, workload: str, windows: int, gpus: int, warmup_s: float
) -> dict[str, Any]:
    """Windows of each length on ``vendor``'s simulator: ours and Zeus's error (one process)."""
    from zeus_async.clock import FakeClock
    from zeus_async.runtime import Runtime

    _, backend, scope, zeus_kind = VENDORS[vendor]
    config = _config(vendor, workload, gpus)
    n_gpus = config.num_gpus
    clock = FakeClock(wall_start_ns=1_760_000_000_000_000_000 + 3 * MS)
    rng = random.Random(3)
    rows: list[tuple[int, Any, dict[int, float], dict[int, float] | None, int]] = []
    async with Runtime(
        backend=backend,
        cpus=None,
        sim_config=config,
        clock=clock,
        windows=True,
        power_scope=scope,
    ) as rt:
        tracker = rt.tracker
        assert tracker is not None
        node = _served_node(vendor)
        assert node is not None, f"no node served for {vendor}"
        zm = _zeus_monitor(zeus_kind, clock, n_gpus) if zeus_kind else None
        await clock.sleep_until(clock.monotonic_ns() + round(warmup_s * 1e9))
        for length in LENGTHS_MS:
            for i in range(windows):
                await clock.sleep_until(clock.monotonic_ns() + rng.randrange(0, 100 * MS))
                name = f"w{length}-{i}"
                if zm is not None:
                    zm.begin_window(name, sync_execution=False)
                tracker.open(name)
                t0 = clock.wall_ns()
                await clock.sleep_until(clock.monotonic_ns() + length * MS)
                result = tracker.close(name)
                provisional = dict(result.gpu_energy)  # read at once, as pop_window returns it
                zeus: dict[int, float] | None = None
                if zm is not None:
                    zres = zm.end_window(name, sync_execution=False)
                    zeus = {g: _zeus_energy(zeus_kind or "", zres, g) for g in range(n_gpus)}
                rows.append((length, result, provisional, zeus, t0))
        for _, result, *_ in rows:
            await result.wait_async()
        truth_of = node.truth_module_energy_j if scope == "module" else node.truth_energy_j
        errors: dict[str, dict[str, list[float]]] = {}
        by_method: dict[str, list[float]] = {}  # 2 s windows' error, by each GPU's method
        methods: set[str] = set()
        for length, result, provisional, zeus, t0 in rows:
            m = result.wait(0)
            assert m.start_ns == t0
            for g in range(n_gpus):
                truth = truth_of(g, m.start_ns, m.end_ns)
                e = errors.setdefault(str(length), {"exact": [], "provisional": [], "zeus": []})
                e["exact"].append(abs(m.gpu_energy_j[g] - truth) / truth)
                e["provisional"].append(abs(provisional[g] - truth) / truth)
                if zeus is not None:
                    e["zeus"].append(abs(zeus[g] - truth) / truth)
                methods.add(m.methods[f"gpu:{g}"])
                if length == LENGTHS_MS[0]:
                    method = m.methods[f"gpu:{g}"].split("+")[0]
                    by_method.setdefault(method, []).append(e["exact"][-1])
        info = [d.describe() for d in rt.devices]
    return {
        "gpus": n_gpus,
        "methods": sorted(methods),
        "energy_methods": [i.energy_method for i in info],
        "notes": sorted({i.energy_note for i in info if i.energy_note}),
        "by_method": {k: statistics.fmean(v) for k, v in by_method.items()},
        "mape": {
            k: {s: statistics.fmean(v) if v else None for s, v in e.items()}
            for k, e in errors.items()
        },
        "max": {k: max(e["exact"]) for k, e in errors.items()},
    }


def _cpu_tree() -> float:
    """CPU seconds (user + system) of this process and its live children."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def _sampler_cpu(vendor: str, adaptive: bool, duration: float) -> dict[str, Any]:
    """Our runtime sampling 1 GPU of ``vendor``'s simulator at 100 Hz, real time."""
    from zeus_async.runtime import EmbeddedRuntime

    _, backend, scope, _ = VENDORS[vendor]
    config = _config(vendor, None, 1)
    rt = EmbeddedRuntime(
        backend=backend,
        gpus=[0],
        cpus=None,
        period_s=0.01,
        fields={"power_w": None, "energy_j": None},
        adaptive_reads=adaptive,
        sim_config=config,
        power_scope=scope,
    )
    rt.start()
    try:
        assert rt.runtime is not None
        time.sleep(1.0)  # past the start (adaptive reads learn the refresh periods)
        reads0 = sum(s.stats.reads for s in rt.runtime.samplers)
        c0, w0 = _cpu_tree(), time.perf_counter()
        time.sleep(duration)
        c1, w1 = _cpu_tree(), time.perf_counter()
        reads = sum(s.stats.reads for s in rt.runtime.samplers) - reads0
        missed = sum(s.stats.missed_ticks for s in rt.runtime.samplers)
    finally:
        rt.stop()
    return {
        "cpu_s_per_device_s": (c1 - c0) / (w1 - w0),
        "reads_per_s": reads / (w1 - w0),
        "missed_ticks": missed,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _run_child(argv: list[str]) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, __file__, *argv], check=False, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise SystemExit(f"case {argv} failed:\n{run.stderr[-4000:]}")
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=20, help="windows per length and case")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs where the preset has several")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--cpu-duration", type=float, default=5.0, help="sampler CPU run (s)")
    parser.add_argument("--vendors", nargs="+", default=list(VENDORS), choices=list(VENDORS))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--only-accuracy", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--only-cpu", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only_accuracy is not None:
        vendor, workload = args.only_accuracy
        out = anyio.run(_accuracy, vendor, workload, args.windows, args.gpus, args.warmup_s)
        sys.stdout.write(json.dumps(out) + "\n")
        return
    if args.only_cpu is not None:
        vendor, mode = args.only_cpu
        out = _sampler_cpu(vendor, mode == "adaptive", args.cpu_duration)
        sys.stdout.write(json.dumps(out) + "\n")
        return

    common = ["--windows", str(args.windows), "--gpus", str(args.gpus)]
    common += ["--warmup-s", str(args.warmup_s), "--cpu-duration", str(args.cpu_duration)]
    lines = [
        f"{args.windows} windows per length x the node's GPUs per case (fake clock, "
        f"{args.warmup_s:g} s warm-up); error = mean |error| / true energy (max in brackets); "
        f"sampler CPU: 1 GPU, 100 Hz, {args.cpu_duration:g} s real time, free simulated calls",
        "",
        "| vendor (backend) | energy method | workload | GPUs | 2 s: ours exact (max) "
        "| 2 s: Zeus 0.16 | 50 ms: ours exact | 50 ms: ours provisional | 50 ms: Zeus 0.16 "
        "| sampler CPU s / device-s, every tick | adaptive reads |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for line in lines:
        sys.stdout.write(line + "\n")
    for vendor in args.vendors:
        label, _, _, zeus_kind = VENDORS[vendor]
        cpu: dict[str, str] = {"ours": "", "adaptive": ""}
        if not args.skip_cpu:
            for mode in ("ours", "adaptive"):
                r = _run_child([*common, "--only-cpu", vendor, mode])
                cpu[mode] = f"{r['cpu_s_per_device_s']:.4f} ({r['reads_per_s']:.0f} reads/s)"
        for k, workload in enumerate(args.workloads):
            out = _run_child([*common, "--only-accuracy", vendor, workload])
            two, fifty = out["mape"]["2000"], out["mape"]["50"]
            no_zeus = "not supported on the simulator"
            zeus2 = _pct(two["zeus"]) if zeus_kind else no_zeus
            zeus50 = _pct(fifty["zeus"]) if zeus_kind else no_zeus
            counts = {m: out["energy_methods"].count(m) for m in out["energy_methods"]}
            method = ", ".join(f"{n} x {m}" for m, n in counts.items())
            if len(out["by_method"]) > 1:  # say what each method's GPUs scored
                each = "; ".join(f"{m} {_pct(v)}" for m, v in sorted(out["by_method"].items()))
                method += f" (2 s: {each})"
            for note in out["notes"]:
                logger.warning("%s, %s: %s", label, workload, note)
            sys.stdout.write(
                f"| {label} | {method} | {workload} | {out['gpus']} "
                f"| {_pct(two['exact'])} ({_pct(out['max']['2000'])}) | {zeus2} "
                f"| {_pct(fifty['exact'])} | {_pct(fifty['provisional'])} | {zeus50} "
                f"| {cpu['ours'] if k == 0 else ''} | {cpu['adaptive'] if k == 0 else ''} |\n"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
