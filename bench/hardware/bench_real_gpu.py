"""On a real NVIDIA GPU: what the simulator and the sampler assume, measured in one run.

Written for the sessions that are lent a GPU machine, so that one command (well inside its
10-minute limit) records what only real hardware can tell. It runs on the simulator too
(``--sim``: the simulator installed as ``pynvml``, its own workload instead of a load), which
is how it is checked on machines without a GPU. It prints a markdown report, also written to
``--out``.

1. **Machine**: GPU name, driver and NVML versions, and what the NVML backend makes of the
   GPU (architecture, energy counter, power-limit range, supported clocks).
2. **NVML call cost**: CPU and wall µs per call of each read the sampler makes, and of one
   ``device.read`` of the default fields. The simulator burns 10 µs per call by default
   (``SimConfig.call_latency_s``); this is the figure to set it from.
3. **Under load**: a child process runs bf16 matrix products in a square wave (busy 0.7 s, idle
   0.5 s; torch on CUDA), while three runtimes sample the GPU at 10 ms at once: two read every
   tick, one with adaptive reads. From an every-tick series:

   * the refresh period of the energy counter and of instant and average power (the simulator
     and adaptive reads assume 100 ms);
   * how many instant-power changes come with a counter update (the sensor model of
     ``aggregate/history.py`` assumes they do);
   * energy from the counter against integrated instant power and integrated average power,
     over the whole run and in 1 s windows.

   From each series, the energies of 300 random windows (20 ms to 2 s, computed as
   measurement windows compute them), against the first every-tick series, with the reads
   each made and the changes adaptive reads saw only late ("not bracketed"). The second
   every-tick runtime is the control: it samples on a grid of its own, so its difference is
   what sampling at other instants alone changes. On the simulator, also against the truth.
4. **Power limit** (skipped with ``--no-power-limit``): under the same load, 3 s at the limit
   in force, 3 s at the minimum, 3 s back at the limit in force; average power in each. The
   limit in force before is always restored. A refusal (no permission) is reported, not fatal.

For the sampler's CPU against Zeus on the real GPU, run ``bench_sampler.py --real`` (needs
``zeus`` installed there).

**AMD** (``--backend amd``; ``nvml`` is the default): the same parts through the devices API
(``open_devices(backend="amd")``, ``device.read``, the runtimes, ``set_power_limit`` as the
power cap, set and restored), with what the backend makes of the GPU (energy method and why,
capabilities, power scope) under Machine and the cost of each raw ``amdsmi`` call the backend
makes in place of the NVML ones. The load is the same torch script (ROCm builds of torch name
the GPU ``cuda`` too). On AMD the rows of a power field the GPU lacks (``avg_power_w`` on
MI300 and later, ``power_w`` before) are left out; ``energy_j`` is absent where the counter
failed its start check (Machine says so), and then the "energy counter" row is integrated
power.

Run: ``python bench/hardware/bench_real_gpu.py --out $OUT/real_gpu.md`` on the GPU machine
(see bench/README.md for the wheels to carry; ``--backend amd`` on an AMD one, whose image
must have ``amdsmi`` and a ROCm torch), or
``.venv/bin/python bench/hardware/bench_real_gpu.py --sim`` (``--sim --backend amd``: the
same check over ``zeus_async.testing.sim_amdsmi`` as ``amdsmi``, an MI300X preset).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: The child process that loads the GPU: busy ``on`` s, idle ``off`` s, until ``until``
#: (``time.monotonic()`` seconds, shared by the processes of one machine).
LOAD_SCRIPT = r"""
import sys, time
import torch
on, off, until = (float(a) for a in sys.argv[1:4])
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
torch.cuda.synchronize()
print("ready", flush=True)
while time.monotonic() < until:
    end = min(time.monotonic() + on, until)
    while time.monotonic() < end:
        for _ in range(4):
            a @ b
        torch.cuda.synchronize()
    time.sleep(max(0.0, min(off, until - time.monotonic())))
"""

FIELDS: dict[str, float | None] = {"power_w": None, "avg_power_w": None, "energy_j": None}


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Report:
    """Markdown lines, printed as they come (progress on a long run) and kept for ``--out``."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, text: str = "") -> None:
        self.lines.append(text)
        print(text, flush=True)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        self.add("| " + " | ".join(header) + " |")
        self.add("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        for row in rows:
            self.add("| " + " | ".join(str(c) for c in row) + " |")
        self.add()


# -- 1. machine ----------------------------------------------------------------------------


def machine(report: Report, gpu: int) -> Any:
    import pynvml

    from zeus_async.devices import open_devices

    pynvml.nvmlInit()

    def text(value: object) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    opened = open_devices(backend="nvml", gpus=[gpu], cpus=None)
    device = opened.gpus[0]
    info = device.describe()
    clocks = info.supported_sm_clocks_hz
    report.add("## Machine\n")
    report.table(
        ["what", "value"],
        [
            ["GPU", info.name],
            ["driver", text(pynvml.nvmlSystemGetDriverVersion())],
            ["NVML", text(pynvml.nvmlSystemGetNVMLVersion())],
            ["GPUs visible", pynvml.nvmlDeviceGetCount()],
            ["architecture (backend)", info.arch],
            ["energy counter", info.has_energy_counter],
            [
                "power limit min / default / max W",
                f"{info.power_limit_min_w} / {info.power_limit_default_w} / "
                f"{info.power_limit_max_w}",
            ],
            [
                "supported SM clocks",
                f"{len(clocks)} ({min(clocks) / 1e6:.0f}-{max(clocks) / 1e6:.0f} MHz)"
                if clocks
                else "none listed",
            ],
            ["fields the backend reads", ", ".join(device.fields)],
        ],
    )
    return device


# -- 2. NVML call cost ---------------------------------------------------------------------


def call_costs(report: Report, device: Any, gpu: int, calls: int) -> None:
    import pynvml

    from zeus_async.devices.base import GPU_FIELDS

    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    instant = [(pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_GPU)]
    nv = pynvml
    every_field = tuple(f for f in GPU_FIELDS if f in device.fields)
    candidates: list[tuple[str, Callable[[], object]]] = [
        (
            "nvmlDeviceGetFieldValues(POWER_INSTANT)",
            lambda: nv.nvmlDeviceGetFieldValues(handle, instant),
        ),
        ("nvmlDeviceGetPowerUsage", lambda: nv.nvmlDeviceGetPowerUsage(handle)),
        (
            "nvmlDeviceGetTotalEnergyConsumption",
            lambda: nv.nvmlDeviceGetTotalEnergyConsumption(handle),
        ),
        (
            "nvmlDeviceGetTemperature",
            lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU),
        ),
        ("nvmlDeviceGetClockInfo(SM)", lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)),
        ("nvmlDeviceGetUtilizationRates", lambda: nv.nvmlDeviceGetUtilizationRates(handle)),
        ("nvmlDeviceGetMemoryInfo", lambda: nv.nvmlDeviceGetMemoryInfo(handle)),
        ("nvmlDeviceGetPowerManagementLimit", lambda: nv.nvmlDeviceGetPowerManagementLimit(handle)),
        ("zeus_async device.read(power_w)", lambda: device.read(("power_w",), "h", 0)),
        (
            "zeus_async device.read(power, avg power, energy)",
            lambda: device.read(tuple(FIELDS), "h", 0),
        ),
        ("zeus_async device.read(all fields)", lambda: device.read(every_field, "h", 0)),
    ]
    energy_fields = [
        ("TOTAL_ENERGY_CONSUMPTION", nv.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION),
        ("ENERGY", getattr(nv, "NVML_FI_DEV_ENERGY", 191)),
    ]
    for label, fid in energy_fields:
        candidates.insert(
            3,
            (
                f"nvmlDeviceGetFieldValues({label})",
                lambda fid=fid: nv.nvmlDeviceGetFieldValues(handle, [fid]),  # type: ignore[misc]
            ),
        )
    rows: list[list[object]] = []
    for name, call in candidates:
        try:
            call()
        except Exception as exc:  # a call the driver refuses is a finding
            rows.append([name, f"fails: {type(exc).__name__}: {exc}", ""])
            continue
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(calls):
            call()
        cpu = (time.thread_time_ns() - c0) / calls / 1e3
        wall = (time.perf_counter_ns() - w0) / calls / 1e3
        rows.append([name, f"{cpu:.1f}", f"{wall:.1f}"])
    report.add(f"## NVML call cost ({calls} calls back to back, after one warm-up call)\n")
    report.table(["call", "CPU µs", "wall µs"], rows)
    # The energy counter, one call at a time every 10 ms (as a sampler reads it): the spread.
    spread: list[float] = []
    for _ in range(min(calls, 100)):
        c0 = time.thread_time_ns()
        nv.nvmlDeviceGetTotalEnergyConsumption(handle)
        spread.append((time.thread_time_ns() - c0) / 1e3)
        time.sleep(0.01)
    report.add(
        f"nvmlDeviceGetTotalEnergyConsumption one call every 10 ms, CPU µs: median "
        f"{_pct(spread, 0.5):.1f}, p10 {_pct(spread, 0.1):.1f}, p90 {_pct(spread, 0.9):.1f}, "
        f"max {max(spread):.1f} ({len(spread)} calls)\n"
    )


# -- 1-2 on AMD: machine and amdsmi call cost --------------------------------------------------


def _import_amdsmi() -> Any:
    import amdsmi

    return amdsmi


def machine_amd(report: Report, gpu: int) -> Any:
    """The AMD GPU as amdsmi and the ``amd`` backend see it; returns the opened device."""
    from zeus_async.devices import open_devices

    smi = _import_amdsmi()
    smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
    opened = open_devices(backend="amd", gpus=[gpu], cpus=None)
    device = opened.gpus[0]
    info = device.describe()
    handle = smi.amdsmi_get_processor_handles()[info.index]
    lib = smi.amdsmi_get_lib_version()
    caps = info.capabilities
    rows: list[list[object]] = [
        ["GPU", info.name],
        ["amdsmi library", ", ".join(f"{k} {v}" for k, v in lib.items())],
        ["GPUs visible (amd-smi)", len(smi.amdsmi_get_processor_handles())],
        ["HIP index / amd-smi index", f"{gpu} / {info.index}"],
        [
            "energy method",
            info.energy_method + (f" ({info.energy_note})" if info.energy_note else ""),
        ],
        [
            "capabilities",
            ", ".join(
                f"{name}={getattr(caps, name)}"
                for name in ("energy_counter", "power_cap", "clocks", "per_process")
            )
            if caps is not None
            else "not stated",
        ],
        ["power scope", info.power_scope],
        [
            "power cap min / default / max W",
            f"{info.power_limit_min_w} / {info.power_limit_default_w} / {info.power_limit_max_w}",
        ],
        ["fields the backend reads", ", ".join(device.fields)],
    ]
    try:  # the kernel driver, where this amdsmi answers it
        driver = smi.amdsmi_get_gpu_driver_info(handle)
        rows.insert(2, ["driver", f"{driver.get('driver_name')} {driver.get('driver_version')}"])
    except Exception as exc:  # not in every amdsmi version, nor in the simulator
        rows.insert(2, ["driver", f"not answered ({type(exc).__name__})"])
    report.add("## Machine\n")
    report.table(["what", "value"], rows)
    return device


def call_costs_amd(report: Report, device: Any, calls: int) -> None:
    """CPU and wall µs of each raw amdsmi call the ``amd`` backend makes, and of
    ``device.read``."""
    from zeus_async.devices.base import GPU_FIELDS

    smi = _import_amdsmi()
    handle = smi.amdsmi_get_processor_handles()[device.describe().index]
    every_field = tuple(f for f in GPU_FIELDS if f in device.fields)
    neutral = tuple(f for f in FIELDS if f in device.fields)
    candidates: list[tuple[str, Callable[[], object]]] = [
        ("amdsmi_get_power_info", lambda: smi.amdsmi_get_power_info(handle)),
        ("amdsmi_get_energy_count", lambda: smi.amdsmi_get_energy_count(handle)),
        (
            "amdsmi_get_temp_metric(HOTSPOT, CURRENT)",
            lambda: smi.amdsmi_get_temp_metric(
                handle,
                smi.AmdSmiTemperatureType.HOTSPOT,
                smi.AmdSmiTemperatureMetric.CURRENT,
            ),
        ),
        (
            "amdsmi_get_clock_info(GFX)",
            lambda: smi.amdsmi_get_clock_info(handle, smi.AmdSmiClkType.GFX),
        ),
        ("amdsmi_get_gpu_activity", lambda: smi.amdsmi_get_gpu_activity(handle)),
        ("amdsmi_get_gpu_vram_usage", lambda: smi.amdsmi_get_gpu_vram_usage(handle)),
        ("amdsmi_get_power_cap_info", lambda: smi.amdsmi_get_power_cap_info(handle)),
        (f"zeus_async device.read({neutral[0]})", lambda: device.read(neutral[:1], "h", 0)),
        (
            f"zeus_async device.read({', '.join(neutral)})",
            lambda: device.read(neutral, "h", 0),
        ),
        ("zeus_async device.read(all fields)", lambda: device.read(every_field, "h", 0)),
    ]
    rows: list[list[object]] = []
    for name, call in candidates:
        try:
            call()
        except Exception as exc:  # a call the driver refuses is a finding
            rows.append([name, f"fails: {type(exc).__name__}: {exc}", ""])
            continue
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(calls):
            call()
        cpu = (time.thread_time_ns() - c0) / calls / 1e3
        wall = (time.perf_counter_ns() - w0) / calls / 1e3
        rows.append([name, f"{cpu:.1f}", f"{wall:.1f}"])
    report.add(f"## amdsmi call cost ({calls} calls back to back, after one warm-up call)\n")
    report.table(["call", "CPU µs", "wall µs"], rows)
    spread: list[float] = []
    for _ in range(min(calls, 100)):
        c0 = time.thread_time_ns()
        smi.amdsmi_get_energy_count(handle)
        spread.append((time.thread_time_ns() - c0) / 1e3)
        time.sleep(0.01)
    report.add(
        f"amdsmi_get_energy_count one call every 10 ms, CPU µs: median "
        f"{_pct(spread, 0.5):.1f}, p10 {_pct(spread, 0.1):.1f}, p90 {_pct(spread, 0.9):.1f}, "
        f"max {max(spread):.1f} ({len(spread)} calls)\n"
    )


# -- 3. under load ----------------------------------------------------------------------------


def _collector(out: list[Any]) -> Callable[[Any], Any]:
    from zeus_async.events import GpuSample

    async def consume(stream: Any) -> None:
        async for event in stream:
            if isinstance(event, GpuSample):
                out.append(event)

    return consume


def _history(samples: Sequence[Any], power: str | None, counter: bool) -> Any:
    from zeus_async.aggregate.history import DeviceHistory

    history = DeviceHistory("gpu")
    for s in samples:
        p = getattr(s, power) if power else None
        e = s.energy_j if counter else None
        if p is not None or e is not None:
            history.add(s.t_ns, p, e)
    return history


def _changes(samples: Sequence[Any], field: str) -> list[int]:
    times: list[int] = []
    last: object = None
    for s in samples:
        value = getattr(s, field)
        if value is None:
            continue
        if last is not None and value != last:
            times.append(s.t_ns)
        last = value
    return times


def under_load(
    report: Report, gpu: int, seconds: float, sim: bool, seed: int, backend: str = "nvml"
) -> None:
    from zeus_async.runtime import EmbeddedRuntime

    every: list[Any] = []
    control: list[Any] = []
    sparse: list[Any] = []
    common = {"backend": backend, "gpus": [gpu], "cpus": None, "period_s": 0.01, "fields": FIELDS}
    runtimes = [
        EmbeddedRuntime(**common, consumers=[_collector(every)]),
        EmbeddedRuntime(**common, consumers=[_collector(control)]),
        EmbeddedRuntime(**common, consumers=[_collector(sparse)], adaptive_reads=True),
    ]
    what = "the simulator's own workload" if sim else "a square wave of bf16 matrix products"
    report.add(f"## Under load: {seconds:g} s of {what}, three runtimes at once, 10 ms\n")
    for rt in runtimes:
        rt.start()
    try:
        time.sleep(seconds)
    finally:
        for rt in reversed(runtimes):
            rt.stop()
    samplers = []
    for rt in runtimes:
        assert rt.runtime is not None
        samplers.append(rt.runtime.samplers[0])

    # Refresh periods.
    rows: list[list[object]] = []
    read = samplers[0].device.fields
    for field in FIELDS:
        if backend != "nvml" and field not in read:
            continue  # a power field this GPU lacks (MI300: no average; MI200: no instant)
        times = _changes(every, field)
        gaps = [(b - a) / 1e6 for a, b in itertools.pairwise(times)]
        if len(times) < 3:
            rows.append([field, len(times), "", "", "", ""])
            continue
        mean = (times[-1] - times[0]) / (len(times) - 1) / 1e6
        rows.append(
            [
                field,
                len(times),
                f"{mean:.1f}",
                f"{statistics.median(gaps):.0f}",
                f"{_pct(gaps, 0.05):.0f}",
                f"{_pct(gaps, 0.95):.0f}",
            ]
        )
    report.add("Refresh of each field, from an every-tick series (gaps are to ±10 ms):\n")
    report.table(["field", "changes", "mean period ms", "median gap ms", "p5", "p95"], rows)

    counter = _history(every, "power_w", True)
    by_power = _history(every, "power_w", False)
    by_avg = _history(every, "avg_power_w", False)
    report.add(
        f"Instant-power changes that came with a counter update: "
        f"{counter.power_changes_with_counter} of {counter.power_changes} "
        "(the sensor model is used when ≥ 90 %).\n"
    )

    series = (every, control, sparse)
    lo = max(x[0].t_ns for x in series) + 500_000_000
    hi = min(x[-1].t_ns for x in series) - 500_000_000
    if hi - lo < 2_000_000_000:
        report.add("Too little overlap between the series to compare windows.\n")
        return

    def energy(history: Any, t0: int, t1: int) -> float:
        value = history.energy(t0, t1).energy_j
        return math.nan if value is None else float(value)

    whole = [energy(h, lo, hi) for h in (counter, by_power, by_avg)]
    seconds_in = int((hi - lo) // 1_000_000_000)
    ratios_p: list[float] = []
    ratios_a: list[float] = []
    for k in range(seconds_in):
        t0 = lo + k * 1_000_000_000
        e = energy(counter, t0, t0 + 1_000_000_000)
        ratios_p.append(energy(by_power, t0, t0 + 1_000_000_000) / e - 1)
        ratios_a.append(energy(by_avg, t0, t0 + 1_000_000_000) / e - 1)
    report.add("Energy from the counter against integrated power (the same every-tick series):\n")
    rows = [["energy counter", f"{whole[0]:.1f}", "", "", "", ""]]
    for name, total, ratios in (
        ("instant power (trapezoid)", whole[1], ratios_p),
        ("average power (trapezoid)", whole[2], ratios_a),
    ):
        if backend != "nvml" and math.isnan(total):
            continue  # that power field is not read on this GPU
        rows.append(
            [
                name,
                f"{total:.1f}",
                f"{total / whole[0] - 1:+.2%}",
                f"{statistics.median(ratios):+.2%}",
                f"{_pct(ratios, 0.05):+.2%}",
                f"{_pct(ratios, 0.95):+.2%}",
            ]
        )
    span = f"whole {(hi - lo) / 1e9:.1f} s, J"
    report.table(["source", span, "vs counter", "1 s windows: median", "p5", "p95"], rows)

    # Windows as measurement windows compute them, from each series. The two every-tick
    # runtimes sample on grids of their own, so their difference is what sampling at other
    # instants alone changes: the yardstick for adaptive reads.
    truth = _sim_truth(gpu, backend, samplers[0].device) if sim else None
    histories = [counter, _history(control, "power_w", True), _history(sparse, "power_w", True)]
    rng = random.Random(seed)
    windows = []
    for _ in range(300):
        length = round(math.exp(rng.uniform(math.log(0.02), math.log(2.0))) * 1e9)
        t0 = rng.randrange(lo, hi - length)
        windows.append((t0, t0 + length))
    reference = [energy(counter, t0, t1) for t0, t1 in windows]
    exact = [truth(t0, t1) for t0, t1 in windows] if truth is not None else None
    rows = []
    names = ("every tick", "every tick, second runtime (control)", "adaptive reads")
    for name, history, sampler in zip(names, histories, samplers, strict=True):
        row: list[object] = [name, sampler.stats.reads, sampler.stats.missed_ticks]
        ours = [energy(history, t0, t1) for t0, t1 in windows]
        row += ["", "", ""] if history is counter else _spread(ours, reference)
        if exact is not None:
            row += _spread(ours, exact)
        rows.append(row)
    header = ["series", "reads", "missed ticks", "vs every tick: median", "p99", "max"]
    if exact is not None:
        header += ["vs truth: median", "p99", "max"]
    trackers = list(samplers[2].trackers.values())
    report.add(
        "300 windows of 20 ms to 2 s (log-uniform), energy from each series as windows compute "
        "it, as absolute relative differences. Adaptive reads: "
        f"{samplers[2].unbracketed_changes} changes not bracketed; learnt period/guard per "
        f"field: {', '.join(f'{t.period}/{t.guard}' for t in trackers)}.\n"
    )
    report.table(header, rows)


def _spread(values: Sequence[float], against: Sequence[float]) -> list[str]:
    """Median, p99 and max of the absolute relative differences."""
    d = [abs(v / x - 1) for v, x in zip(values, against, strict=True)]
    return [f"{statistics.median(d):.3%}", f"{_pct(d, 0.99):.3%}", f"{max(d):.3%}"]


def _sim_truth(gpu: int, backend: str, device: Any) -> Callable[[int, int], float] | None:
    if backend == "amd":
        from zeus_async.testing.sim_amdsmi import current_node

        index = device.describe().index  # the simulated GPU: amd-smi's index, not HIP's
    else:
        from zeus_async.testing.sim_pynvml import current_node

        index = gpu
    node = current_node()
    if node is None:
        return None
    return lambda t0, t1: node.truth_energy_j(index, t0, t1)


# -- 4. power limit ------------------------------------------------------------------------


def power_limit(
    report: Report, device: Any, gpu: int, phase_s: float, backend: str = "nvml"
) -> None:
    from zeus_async.errors import ZeusAsyncError
    from zeus_async.runtime import EmbeddedRuntime

    report.add(f"## Power limit ({phase_s:g} s per phase, under the same load)\n")
    try:
        before = device.get_power_limit_w()
        lowest, _ = device.power_limit_range_w()
    except ZeusAsyncError as exc:
        report.add(f"Cannot read the power limit: {exc}\n")
        return
    samples: list[Any] = []
    rt = EmbeddedRuntime(
        backend=backend,
        gpus=[gpu],
        cpus=None,
        period_s=0.01,
        fields={"power_w": None, "energy_j": None, "power_limit_w": 0.1},
        consumers=[_collector(samples)],
    )
    rt.start()
    assert rt.runtime is not None
    runtime = rt.runtime
    spans: list[tuple[str, float, int, int]] = []
    try:
        for label, watts in (("in force", before), ("minimum", lowest), ("restored", before)):
            try:
                rt.call(runtime.set_power_limit, watts, [gpu])
            except ZeusAsyncError as exc:
                report.add(f"Setting {watts:g} W was refused: {exc}\n")
                return
            t0 = time.time_ns() + 500_000_000  # the limit takes effect within ~0.5 s
            time.sleep(phase_s)
            spans.append((label, watts, t0, time.time_ns()))
    finally:
        try:
            device.set_power_limit_w(before)
        finally:
            rt.stop()
    history = _history(samples, "power_w", True)
    rows: list[list[object]] = []
    for label, watts, t0, t1 in spans:
        e = history.energy(t0, t1).energy_j
        seen = [s.power_limit_w for s in samples if t0 <= s.t_ns <= t1 and s.power_limit_w]
        rows.append(
            [
                label,
                f"{watts:g}",
                f"{seen[-1]:g}" if seen else "",
                "" if e is None else f"{e / ((t1 - t0) / 1e9):.1f}",
            ]
        )
    report.table(["phase", "limit set W", "limit read back W", "mean power W"], rows)
    report.add(
        f"Limit in force afterwards: {device.get_power_limit_w():g} W (before: {before:g} W)\n"
    )


# -- main ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> Report:
    report = Report()
    report.add(f"# zeus_async on {'the simulator' if args.sim else 'a real GPU'}\n")
    report.add(f"`{' '.join(sys.argv)}`, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    if args.backend == "amd":
        device = machine_amd(report, args.gpu)
        call_costs_amd(report, device, args.calls)
    else:
        device = machine(report, args.gpu)
        call_costs(report, device, args.gpu, args.calls)
    if args.costs_only:
        return report
    load: subprocess.Popen[str] | None = None
    limit_s = 0.0 if args.no_power_limit else 3 * args.phase
    if not args.sim:
        until = time.monotonic() + args.seconds + limit_s + 30
        load = subprocess.Popen(
            [sys.executable, "-c", LOAD_SCRIPT, "0.7", "0.5", str(until)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert load.stdout is not None
        if load.stdout.readline().strip() != "ready":
            build = "ROCm" if args.backend == "amd" else "CUDA"
            raise SystemExit(f"the load process did not start (is torch with {build} installed?)")
    try:
        under_load(report, args.gpu, args.seconds, args.sim, args.seed, args.backend)
        if not args.no_power_limit:
            power_limit(report, device, args.gpu, args.phase, args.backend)
    finally:
        if load is not None:
            load.terminate()
            load.wait(timeout=30)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sim", action="store_true", help="run on the simulator (no GPU needed)")
    parser.add_argument(
        "--backend",
        choices=("nvml", "amd"),
        default="nvml",
        help="the GPU's API: nvml (NVIDIA, default) or amd (amdsmi)",
    )
    parser.add_argument("--gpu", type=int, default=0, help="GPU index (after CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the load run")
    parser.add_argument("--phase", type=float, default=3.0, help="seconds per power-limit phase")
    parser.add_argument("--calls", type=int, default=500, help="calls per NVML cost figure")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-power-limit", action="store_true", help="leave the power limit alone")
    parser.add_argument(
        "--costs-only", action="store_true", help="the machine and the NVML call costs, no load"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sim and not args.child:
        # Re-run with the simulator installed beneath `pynvml` (as bench_sampler.py does), or
        # beneath `amdsmi` (an MI300X) for --backend amd.
        from zeus_async.devices.sim import SimConfig
        from zeus_async.devices.sim_config import sim_preset
        from zeus_async.devices.sim_workload import RandomWorkload
        from zeus_async.testing import sim_amdsmi, sim_pynvml

        workload = RandomWorkload(seg_min_s=0.05, seg_max_s=0.5)
        if args.backend == "amd":
            amd = sim_preset(
                "amd", num_gpus=1, seed=args.seed, power_noise_w=3.0, workload=workload
            )
            env = {**os.environ, **sim_amdsmi.shim_env(amd)}
        else:
            config = SimConfig(num_gpus=1, seed=args.seed, power_noise_w=3.0, workload=workload)
            env = {**os.environ, **sim_pynvml.shim_env(config)}
        code = subprocess.call([sys.executable, *sys.argv, "--child"], env=env)
        raise SystemExit(code)
    report = run(args)
    if args.out is not None:
        args.out.write_text("\n".join(report.lines) + "\n")


if __name__ == "__main__":
    main()
