"""AIPowerMeter's recorded fields, by their own names and in their own units.

AIPowerMeter (``deep_learning_power_measure``) records, per experiment, CPU and GPU use and
power under names such as ``per_process_cpu_uses`` or ``nvidia_draw_absolute``. Each of those
names is accepted wherever :class:`~zeus_async.store.Recording` takes a metric
(:meth:`~zeus_async.store.Recording.series`, :meth:`~zeus_async.store.Recording.total`) and
maps to the recorded field that measures the same thing (:data:`FIELDS`):

* **units as AIPowerMeter gives them**: where its definition says *percent* the values are
  percent (``per_process_cpu_uses``: our ``proc.cpu_share_frac`` x 100), powers in W, memory in
  bytes;
* **per device** names (``per_gpu_power_draw``, ``per_process_cpu_power``, ...) are series of one
  device, as our metrics are (``series("per_gpu_power_draw", "gpu:0")``); the per-GPU names
  about the tracked processes (``per_gpu_attributable_power``,
  ``per_gpu_absolute_percent_usage``, ``per_gpu_estimated_attributable_utilization``) are one
  series per GPU, the processes on it summed, as AIPowerMeter keys them by GPU
  (``series("per_gpu_attributable_power", "gpu:0")``);
* **experiment** names are one series over every device they cover (``device`` ``"all"``): the
  sum, at every instant any of those devices was sampled, of each device's value linearly
  interpolated there between two of its own samples. An all-device series has points **only
  where every device it sums has a reading**: from the latest first sample to the earliest last
  sample of those devices (:func:`combine`). Before a GPU's first sample or after its last, its
  power is unknown, not zero, and a sum without it would show the GPUs dropping out at the
  edges of the recording (four GPUs read 1382.6, 998.7, 456.1, 385.4 W over the last four
  points). Processes are different: one that has not started, or has exited, draws nothing, so
  a process counts 0 outside its own samples, and only the span of each host's process tracking
  (its first to its last process sample) bounds the series. ``nvidia_draw_absolute`` is the
  all-GPU power; ``nvidia_attributable_power`` the power attributed to the tracked processes on
  every GPU; ``rel_intel_power`` the experiment's share of the CPU power (its processes'
  ``cpu_power_w``);
* ``intel_power`` is derived as AIPowerMeter defines it, **psys + uncore + total_cpu**, where
  ``total_cpu_power`` is the RAPL ``core`` domain (the ``package`` domain on CPUs that report
  no ``core``); domains a CPU does not report are left out, as AIPowerMeter leaves them out.
  The relation holds sample for sample (``tests/store/test_aipowermeter.py``).

``total(name)`` of a power name is the energy in joules over the recording (a RAPL domain's
from its energy counter; other powers integrated over time), summed over the devices the name
covers, each over its own samples: the energy of every device is known over its whole span, so
``total("nvidia_draw_absolute")`` is ``total("gpu.power_w")``, a little more than the integral
of the series, which covers only the span common to every GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "FIELDS",
    "GROUPS",
    "AipmField",
    "combine",
    "is_aipowermeter",
    "source_of",
    "why_absent",
]

#: How a name covers devices: one device at a time, every device summed, or per GPU the
#: processes on it summed.
Scope = Literal["device", "all", "per-gpu"]


@dataclass(frozen=True)
class AipmField:
    """One AIPowerMeter field.

    Attributes:
        name: AIPowerMeter's name.
        metric: Our recorded metric it reads.
        group: ``CPU``, ``GPU`` or ``Experiments`` (the groups ``print(recording)`` lists).
        scope: ``"device"`` (a series per device), ``"all"`` (summed over devices) or
            ``"per-gpu"`` (a series per GPU ``gpu:N``: its processes summed).
        scale: Factor to AIPowerMeter's unit (100 for a fraction given as percent).
        unit: The unit of the values.
        devices: Which devices of ``metric`` it covers: ``"proc-host"`` (processes, host side),
            ``"proc-gpu"`` (processes on a GPU), ``"gpu"``, or RAPL domains (``"rapl:core"``).
        description: What it measures.
    """

    name: str
    metric: str
    group: str
    scope: Scope
    scale: float
    unit: str
    devices: tuple[str, ...]
    description: str


def _f(
    name: str,
    metric: str,
    group: str,
    scope: Scope,
    unit: str,
    devices: tuple[str, ...],
    description: str,
    scale: float = 1.0,
) -> AipmField:
    return AipmField(name, metric, group, scope, scale, unit, devices, description)


_PH, _PG = ("proc-host",), ("proc-gpu",)
#: RAPL domains making up ``intel_power`` (AIPowerMeter: psys + uncore + total_cpu).
INTEL_DOMAINS: Final = ("rapl:psys", "rapl:uncore", "rapl:core|package")

#: Every recorded field of AIPowerMeter, by its name.
FIELDS: Final[dict[str, AipmField]] = {
    f.name: f
    for f in (
        # -- CPU use, per process
        _f("per_process_mem_use_abs", "proc.memory_pss_bytes", "CPU", "device", "B", _PH,
           "RAM (PSS) of each process"),
        _f("per_process_mem_use_percent", "proc.memory_frac", "CPU", "device", "%", _PH,
           "RAM (PSS) of each process, percent of physical memory (AIPowerMeter divides by "
           "the memory in use)", 100.0),
        _f("per_process_mem_use_uss", "proc.memory_uss_bytes", "CPU", "device", "B", _PH,
           "RAM (USS) of each process"),
        _f("per_process_cpu_uses", "proc.cpu_share_frac", "CPU", "device", "%", _PH,
           "CPU use of each process, percent of the CPU time used on the machine", 100.0),
        _f("cpu_uses", "proc.cpu_frac", "CPU", "device", "%", _PH,
           "CPU clock used by each process, percent of the machine", 100.0),
        _f("mem_use_abs", "proc.memory_rss_bytes", "CPU", "device", "B", _PH,
           "RAM (RSS) of each process"),
        _f("mem_use_percent", "proc.memory_frac", "CPU", "device", "%", _PH,
           "RAM (PSS) of each process, percent of physical memory (AIPowerMeter divides by "
           "the memory in use)", 100.0),
        _f("per_process_cpu_power", "proc.cpu_power_w", "CPU", "device", "W", _PH,
           "CPU power attributed to each process"),
        _f("per_process_dram_power", "proc.dram_power_w", "CPU", "device", "W", _PH,
           "DRAM power attributed to each process"),
        # -- CPU power (RAPL)
        _f("intel_power", "rapl.power_w", "CPU", "all", "W", INTEL_DOMAINS,
           "RAPL total: psys + uncore + total_cpu"),
        _f("psys_power", "rapl.power_w", "CPU", "all", "W", ("rapl:psys",),
           "RAPL psys domain (system on chip)"),
        _f("uncore_power", "rapl.power_w", "CPU", "all", "W", ("rapl:uncore",),
           "RAPL uncore domain"),
        _f("total_cpu_power", "rapl.power_w", "CPU", "all", "W", ("rapl:core|package",),
           "RAPL core domain (package where no core domain is reported)"),
        _f("rel_intel_power", "proc.cpu_power_w", "Experiments", "all", "W", _PH,
           "CPU power of the experiment's processes"),
        # -- GPU use, per process on a GPU
        _f("per_gpu_attributable_mem_use", "proc.gpu_memory_bytes", "GPU", "device", "B", _PG,
           "GPU memory of each process on each GPU"),
        _f("per_gpu_per_pid_utilization_absolute", "proc.gpu_sm_frac", "GPU", "device", "%",
           _PG, "SM use of each process on each GPU, percent", 100.0),
        _f("per_gpu_absolute_percent_usage", "proc.gpu_sm_frac", "GPU", "per-gpu", "%", _PG,
           "SM use of the tracked processes on each GPU, percent", 100.0),
        _f("per_gpu_estimated_attributable_utilization", "proc.gpu_power_share_frac", "GPU",
           "per-gpu", "1", _PG, "share of each GPU's use by the tracked processes (0-1)"),
        # -- GPU power
        _f("per_gpu_power_draw", "gpu.power_w", "GPU", "device", "W", ("gpu",),
           "power of each GPU"),
        _f("per_gpu_attributable_power", "proc.attributed_power_w", "GPU", "per-gpu", "W", _PG,
           "GPU power attributed to the tracked processes on each GPU"),
        _f("nvidia_draw_absolute", "gpu.power_w", "Experiments", "all", "W", ("gpu",),
           "power of all GPUs"),
        _f("nvidia_attributable_power", "proc.attributed_power_w", "Experiments", "all", "W",
           _PG, "GPU power attributed to the experiment's processes, all GPUs"),
        _f("nvidia_mem_use", "proc.gpu_memory_bytes", "Experiments", "all", "B", _PG,
           "GPU memory of the experiment's processes, all GPUs"),
        _f("nvidia_sm_use", "proc.gpu_sm_frac", "Experiments", "all", "%", _PG,
           "SM use of the experiment's processes, summed over GPUs, percent", 100.0),
    )
}  # fmt: skip

#: The groups ``print(recording)`` lists the names under, in order.
GROUPS: Final = ("CPU", "GPU", "Experiments")


def is_aipowermeter(name: str) -> bool:
    """Whether ``name`` is one of AIPowerMeter's field names."""
    return name in FIELDS


def covers(field: AipmField, device: str, domains: Callable[[str], Sequence[str]]) -> bool:
    """Whether ``device`` (a key, ``@host`` allowed) is one ``field`` reads.

    ``domains(device)`` gives the RAPL domains its package reports (for ``core|package``).
    """
    base = device.split("@", 1)[0]
    for want in field.devices:
        if want == "gpu" and base.startswith("gpu:"):
            return True
        if want == "proc-host" and base.startswith("proc:") and "/gpu:" not in base:
            return True
        if want == "proc-gpu" and base.startswith("proc:") and "/gpu:" in base:
            return True
        if want.startswith("rapl:") and base.startswith("cpu:"):
            domain = base.rpartition("/")[2]
            names = want.removeprefix("rapl:").split("|")
            if domain == names[0]:
                return True
            # a fallback domain counts only when the package reports none of the first
            if len(names) > 1 and domain == names[1] and names[0] not in domains(device):
                return True
    return False


#: Process metrics computed from RAPL readings: a process's shares of the package and DRAM
#: power (``None`` in every sample where RAPL is not readable).
_FROM_RAPL: Final = (
    "proc.cpu_power_w",
    "proc.cpu_energy_j",
    "proc.dram_power_w",
    "proc.dram_energy_j",
)
_NO_RAPL: Final = (
    "it holds no RAPL readings: CPU energy was not readable on the machine that recorded it "
    "(no RAPL, as in most virtual machines, or no permission to read it)"
)
_SHARES: Final = "a process's CPU and DRAM power are its shares of the RAPL power, and "


def why_absent(metric: str, present: Sequence[str]) -> str:
    """Why a recording whose metrics are ``present`` holds no value of ``metric``, as text to
    append to the error (``""`` when there is nothing more to say).

    The cause a user can act on: process metrics need process tracking, but a tracked process
    has no CPU or DRAM power where RAPL was not readable (its samples are there, those fields
    ``None``), and no GPU metrics unless it ran on a GPU. Saying "record with process tracking"
    to someone who did would send them the wrong way.
    """
    rapl = any(m.startswith("rapl.") for m in present)
    if metric.startswith("rapl."):
        return "" if rapl else f" ({_NO_RAPL})"
    if not metric.startswith("proc."):
        return ""
    from_rapl = metric in _FROM_RAPL and not rapl
    if not any(m.startswith("proc.") for m in present):
        where = f", where RAPL is readable: {_SHARES}{_NO_RAPL}" if from_rapl else ""
        return f" (record with process tracking{where})"
    if from_rapl:
        return f" ({_SHARES}{_NO_RAPL})"
    if metric.startswith(("proc.gpu_", "proc.attributed_")):
        return " (no tracked process ran on a GPU while it was recorded)"
    return ""


def source_of(field: AipmField, device: str) -> str:
    """What must have a reading at every point of an all-device series of ``field``: the
    device itself (a GPU, a RAPL domain), or for a process its host's process tracking (a
    process outside its own samples draws nothing; its host's sampler has to be running for
    that 0 to be known)."""
    if field.devices[0].startswith("proc-"):
        return "proc@" + device.partition("@")[2]
    return device


def combine(
    parts: Sequence[tuple[str, npt.NDArray[np.int64], npt.NDArray[np.float64]]],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Sum of several series ``(source, t_ns, values)`` where every source has a reading.

    The points are the times any series has a value, within the span common to every source
    (from the latest first sample to the earliest last sample, a source's span running from
    the first to the last sample of its series). At each point a series is linearly
    interpolated between its own samples, and counts 0 outside its own first..last sample
    (a process not running); a source is a device or a host's process tracking
    (:func:`source_of`). Empty when the sources have no instant in common.
    """
    parts = [(src, t, v) for src, t, v in parts if len(t)]
    if not parts:
        return np.empty(0, dtype=np.int64), np.empty(0)
    spans: dict[str, tuple[int, int]] = {}
    for src, t, _ in parts:
        first, last = int(t.min()), int(t.max())
        seen = spans.get(src)
        spans[src] = (first, last) if seen is None else (min(seen[0], first), max(seen[1], last))
    lo = max(first for first, _ in spans.values())
    hi = min(last for _, last in spans.values())
    times = np.unique(np.concatenate([t for _, t, _ in parts]))
    times = times[(times >= lo) & (times <= hi)]
    if not len(times):
        return np.empty(0, dtype=np.int64), np.empty(0)
    base = times[0]
    total = np.zeros(len(times))
    for _, t, v in parts:
        order = np.argsort(t, kind="stable")
        t, v = t[order], v[order]
        a, b = np.searchsorted(times, t[0], "left"), np.searchsorted(times, t[-1], "right")
        # relative times: exact in a float64 (absolute ns since the epoch are not)
        at = (times[a:b] - base).astype(np.float64)
        total[a:b] += np.interp(at, (t - base).astype(np.float64), v)
    return times, total
