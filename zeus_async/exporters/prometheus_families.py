"""The Prometheus exporter's metric families, the rows of series they read, and the text format.

Each family (:class:`_Family`) says which value of a table's rows (:class:`_Row`: one label
set, its label texts rendered once, the latest value of each field) it exports, under which
name, type, unit and scale (native names, or dcgm-exporter's with ``names="dcgm"``).
:class:`~zeus_async.exporters.prometheus.PrometheusExporter` keeps the tables and writes the
text format from them with :func:`_go_float`, byte for byte what ``prometheus_client`` writes.
"""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import Final, NamedTuple

from ..devices.base import GPU_FIELDS

logger = logging.getLogger(__name__)

_INF: Final = float("inf")

# -- metric families ------------------------------------------------------------------------------


class _Family(NamedTuple):
    """One metric family: where its values come from in a table's rows.

    ``parts`` lists ``(value index, label variant)`` pairs: each row contributes one sample per
    part whose value is known (``zeus_process_memory_bytes`` has three parts, one per ``kind``).
    """

    name: str  # name of the samples (``..._total`` for counters)
    family: str  # name of the family (counters without ``_total``, as prometheus_client has it)
    kind: str  # "gauge" or "counter"
    unit: str  # OpenMetrics unit ("" when none)
    help: str
    parts: tuple[tuple[int, int], ...]
    header: str  # the "# HELP" and "# TYPE" lines of the text format
    scale: float = 1.0  # exported value = stored value x scale (DCGM's units)


def _family(
    name: str, kind: str, unit: str, help: str, *parts: tuple[int, int], scale: float = 1.0
) -> _Family:
    family = name.removesuffix("_total") if kind == "counter" else name
    doc = help.replace("\\", r"\\").replace("\n", r"\n")
    header = f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"
    return _Family(name, family, kind, unit, help, parts, header, scale)


def _gauge(name: str, unit: str, help: str, index: int) -> _Family:
    return _family(name, "gauge", unit, help, (index, 0))


def _counter(name: str, unit: str, help: str, index: int) -> _Family:
    return _family(name, "counter", unit, help, (index, 0))


_GPU_FIELDS: Final = GPU_FIELDS  # the family order below follows it
_GPU_FAMILIES: Final = (
    _gauge("zeus_gpu_power_watts", "watts", "GPU power draw (NVML instant power), in watts.", 0),
    _gauge(
        "zeus_gpu_average_power_watts",
        "watts",
        "GPU power averaged by the driver (about 1 s), in watts.",
        1,
    ),
    _counter(
        "zeus_gpu_energy_joules_total",
        "joules",
        "GPU energy counter (since the driver loaded), in joules.",
        2,
    ),
    _gauge("zeus_gpu_temperature_celsius", "celsius", "GPU core temperature, in celsius.", 3),
    _gauge("zeus_gpu_sm_clock_hertz", "hertz", "GPU SM clock, in hertz.", 4),
    _gauge(
        "zeus_gpu_utilization_ratio",
        "ratio",
        "GPU utilization: fraction of time a kernel ran, ratio 0..1.",
        5,
    ),
    _gauge("zeus_gpu_memory_used_bytes", "bytes", "GPU memory in use, in bytes.", 6),
    _gauge("zeus_gpu_power_limit_watts", "watts", "GPU power limit in force, in watts.", 7),
)

#: The same GPU fields under dcgm-exporter's names, units and types (``names="dcgm"``), so
#: dashboards made for it (Grafana 12239) work unchanged. Its energy counter has no ``_total``.
_DCGM_FAMILIES: Final = (
    _family("DCGM_FI_DEV_POWER_USAGE", "gauge", "", "Power draw (in W).", (0, 0)),
    _family(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "",
        "Total energy consumption since boot (in mJ).",
        (2, 0),
        scale=1e3,
    ),
    _family("DCGM_FI_DEV_GPU_TEMP", "gauge", "", "GPU temperature (in C).", (3, 0)),
    _family(
        "DCGM_FI_DEV_SM_CLOCK", "gauge", "", "SM clock frequency (in MHz).", (4, 0), scale=1e-6
    ),
    _family("DCGM_FI_DEV_GPU_UTIL", "gauge", "", "GPU utilization (in %).", (5, 0), scale=100.0),
    _family(
        "DCGM_FI_DEV_FB_USED",
        "gauge",
        "",
        "Framebuffer memory used (in MiB).",
        (6, 0),
        scale=1 / 2**20,
    ),
    _family("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "", "Power management limit (in W).", (7, 0)),
)

#: The same GPU fields under AMD Device Metrics Exporter's names and units (``names="amd"``;
#: ROCm/device-metrics-exporter's metrics list: ``gpu_package_power`` W,
#: ``gpu_average_package_power`` W, ``gpu_energy_consumed`` µJ, ``gpu_junction_temperature`` C,
#: ``gpu_clock`` MHz, ``gpu_gfx_activity`` %, ``gpu_used_vram`` MB), so dashboards built for
#: it work on our series, whichever vendor's GPU they come from. The power limit has no name
#: there and keeps ours.
_AMD_FAMILIES: Final = (
    _family("gpu_package_power", "gauge", "", "Current socket power in Watts.", (0, 0)),
    _family("gpu_average_package_power", "gauge", "", "Average socket power in Watts.", (1, 0)),
    _family(
        "gpu_energy_consumed",
        "gauge",
        "",
        "Energy consumed by GPU in Micro Jules (uJ).",
        (2, 0),
        scale=1e6,
    ),
    _family(
        "gpu_junction_temperature",
        "gauge",
        "",
        "Hotspot (aka junction) temperature value in Celsius.",
        (3, 0),
    ),
    _family("gpu_clock", "gauge", "", "Clock measure of the GPU in Mhz.", (4, 0), scale=1e-6),
    _family(
        "gpu_gfx_activity",
        "gauge",
        "",
        "Graphics engine usage percentage (0 - 100).",
        (5, 0),
        scale=100.0,
    ),
    _family("gpu_used_vram", "gauge", "", "Total VRAM memory used in MB.", (6, 0), scale=1e-6),
    _gauge("zeus_gpu_power_limit_watts", "watts", "GPU power limit in force, in watts.", 7),
)

_EXPORTER_FAMILIES: Final = (
    _family(
        "zeus_exporter_evicted_series_total",
        "counter",
        "",
        "Series dropped by the exporter: window names past the cap or idle past the TTL "
        "(kind=window), processes gone stale (kind=process).",
        (0, 0),
    ),
)

_WORKLOAD_FAMILIES: Final = (
    _counter(
        "zeus_workload_gpu_energy_joules_total",
        "joules",
        "GPU energy drawn while the workload (Slurm job, pod container, user) held the GPU, "
        "in joules; never goes down, across agent restarts too.",
        0,
    ),
)

_RAPL_FIELDS: Final = ("power_w", "energy_j")
_RAPL_FAMILIES: Final = (
    _gauge(
        "zeus_rapl_power_watts",
        "watts",
        "RAPL domain power: mean since the previous sample, in watts.",
        0,
    ),
    _counter(
        "zeus_rapl_energy_joules_total",
        "joules",
        "RAPL domain energy since the sampler started, in joules.",
        1,
    ),
)

_PROC_FIELDS: Final = (
    "cpu_frac",
    "cpu_share_frac",
    "memory_rss_bytes",
    "memory_pss_bytes",
    "memory_uss_bytes",
    "memory_frac",
    "cpu_power_w",
    "cpu_energy_j",
    "dram_power_w",
    "dram_energy_j",
)
#: Label variants of host-side process rows: 0 = (host, pid), then one per memory ``kind``.
_MEMORY_KINDS: Final = ("rss", "pss", "uss")
_PROC_FAMILIES: Final = (
    _gauge(
        "zeus_process_cpu_ratio",
        "ratio",
        "Process CPU time over wall time x logical CPUs (share of the machine), ratio 0..1.",
        0,
    ),
    _gauge(
        "zeus_process_cpu_share_ratio",
        "ratio",
        "Process CPU time over the CPU time used by the whole machine, ratio 0..1.",
        1,
    ),
    _family(
        "zeus_process_memory_bytes",
        "gauge",
        "bytes",
        "Process memory by kind (rss: resident, pss: proportional, uss: unique set size), "
        "in bytes.",
        (2, 1),
        (3, 2),
        (4, 3),
    ),
    _gauge(
        "zeus_process_memory_ratio",
        "ratio",
        "Process PSS (RSS when PSS is unknown) over physical memory, ratio 0..1.",
        5,
    ),
    _gauge(
        "zeus_process_cpu_power_watts",
        "watts",
        "RAPL package power attributed to the process by CPU share, in watts.",
        6,
    ),
    _counter(
        "zeus_process_cpu_energy_joules_total",
        "joules",
        "RAPL package energy attributed to the process since it was first sampled, in joules.",
        7,
    ),
    _gauge(
        "zeus_process_dram_power_watts",
        "watts",
        "RAPL DRAM power attributed to the process by memory share, in watts.",
        8,
    ),
    _counter(
        "zeus_process_dram_energy_joules_total",
        "joules",
        "RAPL DRAM energy attributed to the process since it was first sampled, in joules.",
        9,
    ),
)

_PROC_GPU_FIELDS: Final = (
    "gpu_sm_frac",
    "gpu_memory_bytes",
    "gpu_sm_share_frac",
    "gpu_memory_share_frac",
    "gpu_power_share_frac",
    "attributed_power_w",
    "attributed_energy_j",
)
_PROC_GPU_FAMILIES: Final = (
    _gauge(
        "zeus_process_gpu_sm_ratio",
        "ratio",
        "SM utilization of the process on the GPU (NVML process samples), ratio 0..1.",
        0,
    ),
    _gauge(
        "zeus_process_gpu_memory_bytes", "bytes", "GPU memory held by the process, in bytes.", 1
    ),
    _gauge(
        "zeus_process_gpu_sm_share_ratio",
        "ratio",
        "Process SM utilization over that of all tracked processes on the GPU, ratio 0..1.",
        2,
    ),
    _gauge(
        "zeus_process_gpu_memory_share_ratio",
        "ratio",
        "Process GPU memory over that of all tracked processes on the GPU, ratio 0..1.",
        3,
    ),
    _gauge(
        "zeus_process_gpu_power_share_ratio",
        "ratio",
        "Share of the GPU power attributed to the process, ratio 0..1.",
        4,
    ),
    _gauge(
        "zeus_process_gpu_power_watts",
        "watts",
        "GPU power attributed to the process, in watts.",
        5,
    ),
    _counter(
        "zeus_process_gpu_energy_joules_total",
        "joules",
        "GPU energy attributed to the process since it was first sampled there, in joules.",
        6,
    ),
)

_WINDOW_FAMILIES: Final = (
    _gauge(
        "zeus_window_duration_seconds",
        "seconds",
        "Duration of the latest finished window of this name, in seconds.",
        0,
    ),
    _counter("zeus_windows_total", "", "Finished measurement windows of this name.", 1),
)
_WINDOW_DEVICE_FAMILIES: Final = (
    _gauge(
        "zeus_window_last_energy_joules",
        "joules",
        "Energy of a device in the latest finished window of this name, in joules.",
        0,
    ),
    _counter(
        "zeus_window_energy_joules_total",
        "joules",
        "Energy of a device summed over every finished window of this name, in joules.",
        1,
    ),
)

# Emissions and cost beside the energy (a runtime with ``carbon``): label variant 0 has the
# GPU's (or window's) labels and ``source``, variant 1 adds ``currency``.
_CARBON_GPU_FAMILIES: Final = (
    _counter(
        "zeus_gpu_co2e_grams_total",
        "grams",
        "Grams CO2-equivalent of the GPU's energy since the exporter started, at the intensity "
        "in force when each joule was drawn (PUE and overhead applied), in grams.",
        0,
    ),
    _family(
        "zeus_gpu_energy_cost_total",
        "counter",
        "",
        "Cost of the GPU's energy since the exporter started, at the price in force when each "
        "joule was drawn (PUE and overhead applied), in the currency labelled.",
        (1, 1),
    ),
)
_CARBON_WINDOW_FAMILIES: Final = (
    _counter(
        "zeus_window_co2e_grams_total",
        "grams",
        "Grams CO2-equivalent of every device's energy summed over the finished windows of "
        "this name (PUE and overhead applied), in grams.",
        0,
    ),
    _family(
        "zeus_window_energy_cost_total",
        "counter",
        "",
        "Cost of every device's energy summed over the finished windows of this name (PUE and "
        "overhead applied), in the currency labelled.",
        (1, 1),
    ),
)

_gpu_values = attrgetter(*_GPU_FIELDS)
_proc_values = attrgetter(*_PROC_FIELDS)
_proc_gpu_values = attrgetter(*_PROC_GPU_FIELDS)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(*variants: dict[str, str]) -> tuple[tuple[dict[str, str], ...], tuple[str, ...]]:
    """Label dicts and their text form (``a="1",b="2"``: sorted, escaped, as generate_latest)."""
    texts = tuple(
        ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) for labels in variants
    )
    return variants, texts


class _Row:
    """One series group: the latest values of a label set's fields, and its label texts.

    Attributes:
        labels: Label dicts, one per variant (shared by the samples of every scrape).
        texts: The same labels in text form (``host="h",pid="1"``), one per variant.
        values: Latest value of each field (``None`` while never seen).
        t_ns: Event time of the latest update.
    """

    __slots__ = ("labels", "t_ns", "texts", "values")

    def __init__(
        self,
        labels: tuple[tuple[dict[str, str], ...], tuple[str, ...]],
        size: int,
        t_ns: int,
    ) -> None:
        self.labels, self.texts = labels
        self.values: list[float | None] = [None] * size
        self.t_ns = t_ns


_Snapshot = list[tuple[tuple[_Family, ...], list[tuple[_Row, list[float | None]]]]]


def _go_float(value: float) -> str:
    """A float as the Prometheus text format writes it (``prometheus_client.utils``' rules)."""
    d = float(value)
    if -_INF < d < 1e6:  # the common case: Python's repr is Go's
        return repr(d)
    if d != d:
        return "NaN"
    if d == _INF:
        return "+Inf"
    if d == -_INF:
        return "-Inf"
    s = repr(d)
    dot = s.find(".")
    if dot > 6:  # Go switches to exponents sooner than Python: 1234567.0 is 1.234567e+06
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s
