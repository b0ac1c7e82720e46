"""Prometheus exporter: the latest value of every measurement, served for scraping.

:class:`PrometheusExporter` is a runtime consumer (``rt.start_consumer(exporter.run,
batched=True)``) that keeps, in plain dicts, the latest value of every field of every device and
tracked process, and exposes it as a prometheus_client *custom collector*: metric families are
built from those dicts when Prometheus scrapes, never per event (updating ``Gauge`` objects at
100 Hz x many GPUs would cost more than sampling).

Metrics (prefix ``zeus_``, Prometheus base units, ``_total`` on counters; every series carries
``host``):

* GPUs (labels ``host``, ``gpu``): ``zeus_gpu_power_watts``, ``zeus_gpu_average_power_watts``,
  ``zeus_gpu_energy_joules_total``, ``zeus_gpu_temperature_celsius``,
  ``zeus_gpu_sm_clock_hertz``, ``zeus_gpu_utilization_ratio``, ``zeus_gpu_memory_used_bytes``,
  ``zeus_gpu_power_limit_watts``.
* RAPL (labels ``host``, ``package``, ``domain``): ``zeus_rapl_power_watts``,
  ``zeus_rapl_energy_joules_total``.
* Tracked processes on the host (labels ``host``, ``pid``): ``zeus_process_cpu_ratio``,
  ``zeus_process_cpu_share_ratio``, ``zeus_process_memory_bytes`` (plus ``kind`` = ``rss``,
  ``pss`` or ``uss``), ``zeus_process_memory_ratio``, ``zeus_process_cpu_power_watts``,
  ``zeus_process_cpu_energy_joules_total``, ``zeus_process_dram_power_watts``,
  ``zeus_process_dram_energy_joules_total``.
* Tracked processes on a GPU (labels ``host``, ``pid``, ``gpu``): ``zeus_process_gpu_sm_ratio``,
  ``zeus_process_gpu_memory_bytes``, ``zeus_process_gpu_sm_share_ratio``,
  ``zeus_process_gpu_memory_share_ratio``, ``zeus_process_gpu_power_share_ratio``,
  ``zeus_process_gpu_power_watts``, ``zeus_process_gpu_energy_joules_total``.
* Measurement windows (labels ``host``, ``window``; ``device`` = ``gpu:0``, ``cpu:0``,
  ``dram:0`` on energies): ``zeus_window_last_energy_joules`` (latest window),
  ``zeus_window_duration_seconds`` (latest window), ``zeus_window_energy_joules_total`` (all
  windows of that name), ``zeus_windows_total`` (windows finished).

GPU series also carry dcgm-exporter's identifying labels, ``UUID``, ``modelName`` and
``Hostname``, once a :class:`~zeus_async.events.StreamInfo` has described the GPU (the runtime
publishes one at start; the bus sends it to each new subscriber); a simulated GPU's series carry
``simulated="true"`` besides (its stream's ``meta`` says so), so a dashboard can never show
simulated figures as a real GPU's. With ``names="dcgm"`` the GPU
series take dcgm-exporter's names, units and labels instead (``DCGM_FI_DEV_POWER_USAGE`` W,
``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` mJ, ``DCGM_FI_DEV_GPU_TEMP`` C, ``DCGM_FI_DEV_SM_CLOCK``
MHz, ``DCGM_FI_DEV_GPU_UTIL`` %, ``DCGM_FI_DEV_FB_USED`` MiB, ``DCGM_FI_DEV_POWER_MGMT_LIMIT``
W; plus ``device="nvidiaN"``), so dashboards built for it work unchanged.

Window names are label values, so they are bounded: at most ``max_windows`` names (the least
recently finished one makes room), and a name whose last window is older than
``window_ttl_s`` of its host's stream time is dropped at the next scrape;
``zeus_exporter_evicted_series_total{kind="window"|"process"}`` counts what was dropped.

A field a device never reported is not exported, and a sample whose field is ``None`` leaves
the last known value in place. Process series whose last sample is older than ``stale_after_s``
(in event time, against the newest event of the same host) are dropped at the next scrape.

Scrapes are fast: with the exporter's own registry, :meth:`PrometheusExporter.render` and the
HTTP server write the text format straight from a snapshot of the dicts, with the label part of
every series rendered once when the series appears; the output is byte for byte what
``prometheus_client.generate_latest`` writes for the same collector, about 9x faster
(``bench/bench_exporter.py``: 3,454 series, 8 GPUs x 50 pids, render in ~3 ms).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from typing import Any, Final, NamedTuple, cast
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import anyio.abc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from .._exit import ClosedOnExit
from ..devices.base import GPU_FIELDS
from ..errors import ConfigError
from ..events import (
    Event,
    GpuSample,
    Measurement,
    ProcessSample,
    RaplSample,
    StreamInfo,
    described_gpus,
    window_energies,
)
from ..runtime.hub import EventBatches, feed_batches
from .names import DEFAULT_PORT, NAME_SETS

__all__ = ["DEFAULT_PORT", "NAME_SETS", "PrometheusExporter"]


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

_gpu_values = attrgetter(*_GPU_FIELDS)
_proc_values = attrgetter(*_PROC_FIELDS)
_proc_gpu_values = attrgetter(*_PROC_GPU_FIELDS)


# -- state --------------------------------------------------------------------------------------


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


class PrometheusExporter(ClosedOnExit):
    """Keeps the latest value of every metric from events and serves them to Prometheus.

    A prometheus_client custom collector (:meth:`collect`, :meth:`describe`) registered in its
    own :class:`~prometheus_client.CollectorRegistry` (only this collector), or in
    ``registry`` when given. Events are fed with :meth:`add` (a batch) or :meth:`run` (a runtime
    consumer); scrapes read a snapshot, so events (on the event loop) and scrapes (on the HTTP
    server's threads) only meet on a lock taken once per batch and once per scrape.

    Args:
        stale_after_s: Drop a process series (a pid, or a (pid, GPU) pair) whose last sample is
            older than this, in event time, than the newest event of its host. Seconds.
        registry: Register in this registry instead of a private one. The fast text path
            (:meth:`render`, :meth:`serve`) then leaves formatting to prometheus_client, since
            the registry may hold other collectors.
        names: ``native`` or ``dcgm`` (see the module docstring).
        max_windows: Most window names kept.
        window_ttl_s: Seconds of stream time after which an idle window name is dropped.

    Raises:
        ConfigError: ``stale_after_s`` or ``window_ttl_s`` is not positive, ``max_windows`` is
            below 1, or ``names`` is not a known name set.

    Example::

        exporter = PrometheusExporter()
        port = exporter.serve(DEFAULT_PORT)
        async with Runtime() as rt:
            rt.start_consumer(exporter.run, batched=True)
            ...
        exporter.close()
    """

    def __init__(
        self,
        *,
        stale_after_s: float = 30.0,
        registry: CollectorRegistry | None = None,
        names: str = "native",
        max_windows: int = 1000,
        window_ttl_s: float = 3600.0,
    ) -> None:
        if not stale_after_s > 0:
            raise ConfigError(f"stale_after_s must be positive, got {stale_after_s!r}")
        if names not in NAME_SETS:
            raise ConfigError(f"names must be one of {', '.join(NAME_SETS)}, not {names!r}")
        if max_windows < 1:
            raise ConfigError(f"max_windows must be at least 1, got {max_windows!r}")
        if not window_ttl_s > 0:
            raise ConfigError(f"window_ttl_s must be positive, got {window_ttl_s!r}")
        self.stale_after_s = stale_after_s
        self._stale_ns = round(stale_after_s * 1e9)
        self.names = names
        self.max_windows = max_windows
        self._window_ttl_ns = round(window_ttl_s * 1e9)
        # (host, GPU index) -> (UUID, model name), from StreamInfo events.
        self._gpu_info: dict[tuple[str, int], tuple[str, str, bool]] = {}
        # Evicted series by kind (window, process): one row each.
        self._evictions: dict[str, _Row] = {}
        self._lock = threading.Lock()
        self._gpus: dict[tuple[str, int], _Row] = {}
        self._rapl: dict[tuple[str, int, str], _Row] = {}
        self._procs: dict[tuple[str, int], _Row] = {}
        self._proc_gpus: dict[tuple[str, int, int], _Row] = {}
        self._windows: dict[tuple[str, str], _Row] = {}
        self._window_devices: dict[tuple[str, str, str], _Row] = {}
        self._tables: tuple[tuple[dict[Any, _Row], tuple[_Family, ...]], ...] = (
            (self._gpus, _DCGM_FAMILIES if names == "dcgm" else _GPU_FAMILIES),
            (self._rapl, _RAPL_FAMILIES),
            (self._procs, _PROC_FAMILIES),
            (self._proc_gpus, _PROC_GPU_FAMILIES),
            (self._window_devices, _WINDOW_DEVICE_FAMILIES),
            (self._windows, _WINDOW_FAMILIES),
            (self._evictions, _EXPORTER_FAMILIES),
        )
        self._own_registry = registry is None
        self.registry: CollectorRegistry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        #: Events handled by :meth:`add` (of every kind, exported or not).
        self.events = 0
        #: Process series dropped as stale so far.
        self.evicted = 0
        #: Window names dropped so far (past ``max_windows``, or idle past ``window_ttl_s``).
        self.evicted_windows = 0

    # -- feeding ---------------------------------------------------------------------------------

    def add(self, events: Iterable[Event]) -> None:
        """Take a batch of events: update the latest values (other event kinds are ignored)."""
        n = 0
        with self._lock:
            gpus = self._gpus
            for e in events:
                n += 1
                if type(e) is GpuSample:
                    row = gpus.get((e.host, e.gpu))
                    if row is None:
                        row = self._new_gpu(e)
                    row.t_ns = e.t_ns
                    vals = row.values
                    for i, v in enumerate(_gpu_values(e)):
                        if v is not None:
                            vals[i] = v
                elif type(e) is ProcessSample:
                    self._add_process(e)
                elif type(e) is RaplSample:
                    self._add_rapl(e)
                elif type(e) is Measurement:
                    self._add_measurement(e)
                elif type(e) is StreamInfo:
                    self._add_stream(e)
            self.events += n

    async def run(self, stream: EventBatches | anyio.abc.ObjectReceiveStream[Event]) -> None:
        """Consume ``stream`` until it ends (a :class:`~zeus_async.runtime.Runtime` consumer).

        ``stream`` is an :class:`~zeus_async.runtime.hub.EventBatches`
        (``rt.start_consumer(exporter.run, batched=True)``, one lock round per batch) or a plain
        event stream (``rt.start_consumer(exporter.run)``).
        """
        await feed_batches(stream, self.add)

    def _gpu_labels(self, host: str, gpu: int) -> dict[str, str]:
        """A GPU's labels: ``host`` and ``gpu``, and once a stream has described it
        dcgm-exporter's ``UUID``, ``modelName`` and ``Hostname`` (plus ``device`` with the
        DCGM names), so that queries can join the two exporters' series."""
        labels = {"host": host, "gpu": str(gpu)}
        info = self._gpu_info.get((host, gpu))
        if info is not None:
            labels.update(UUID=info[0], modelName=info[1], Hostname=host)
            if info[2]:
                labels["simulated"] = "true"
        if self.names == "dcgm":
            labels["device"] = f"nvidia{gpu}"
            labels.setdefault("Hostname", host)
        return labels

    def _new_gpu(self, e: GpuSample) -> _Row:
        labels = _labels(self._gpu_labels(e.host, e.gpu))
        row = self._gpus[(e.host, e.gpu)] = _Row(labels, len(_GPU_FIELDS), e.t_ns)
        return row

    def _add_stream(self, e: StreamInfo) -> None:
        for gpu, device in described_gpus(e):
            key = (e.host, gpu)
            info = (device.uuid, device.name, e.meta.get("simulated") == "true")
            if self._gpu_info.get(key) == info:
                continue
            self._gpu_info[key] = info
            row = self._gpus.get(key)
            if row is not None:  # described after its first sample: relabel it
                row.labels, row.texts = _labels(self._gpu_labels(*key))

    def _add_rapl(self, e: RaplSample) -> None:
        key = (e.host, e.package, e.domain)
        row = self._rapl.get(key)
        if row is None:
            labels = _labels({"host": e.host, "package": str(e.package), "domain": e.domain})
            row = self._rapl[key] = _Row(labels, len(_RAPL_FIELDS), e.t_ns)
        row.t_ns = e.t_ns
        if e.power_w is not None:
            row.values[0] = e.power_w
        row.values[1] = e.energy_j

    def _add_process(self, e: ProcessSample) -> None:
        if e.gpu is None:
            key: Any = (e.host, e.pid)
            table: dict[Any, _Row] = self._procs
            getter = _proc_values
        else:
            key = (e.host, e.pid, e.gpu)
            table = self._proc_gpus
            getter = _proc_gpu_values
        row = table.get(key)
        if row is None:
            base = {"host": e.host, "pid": str(e.pid)}
            if e.gpu is None:
                labels = _labels(base, *({**base, "kind": k} for k in _MEMORY_KINDS))
                row = _Row(labels, len(_PROC_FIELDS), e.t_ns)
            else:
                row = _Row(_labels({**base, "gpu": str(e.gpu)}), len(_PROC_GPU_FIELDS), e.t_ns)
            table[key] = row
        row.t_ns = e.t_ns
        vals = row.values
        for i, v in enumerate(getter(e)):
            if v is not None:
                vals[i] = v

    def _add_measurement(self, e: Measurement) -> None:
        key = (e.host, e.name)
        row = self._windows.pop(key, None)
        if row is None:
            if len(self._windows) >= self.max_windows:
                # The least recently finished name makes room (the dict is in that order).
                self._drop_window(next(iter(self._windows)))
            row = _Row(_labels({"host": e.host, "window": e.name}), 2, e.t_ns)
        self._windows[key] = row  # last: the most recently finished
        row.t_ns = e.t_ns
        row.values[0] = e.time_s
        row.values[1] = (row.values[1] or 0) + 1
        for device, joules in window_energies(e):
            dkey = (e.host, e.name, device)
            drow = self._window_devices.get(dkey)
            if drow is None:
                labels = _labels({"host": e.host, "window": e.name, "device": device})
                drow = self._window_devices[dkey] = _Row(labels, 2, e.t_ns)
            drow.t_ns = e.t_ns
            drow.values[0] = joules
            drow.values[1] = (drow.values[1] or 0.0) + joules

    def _drop_window(self, key: tuple[str, str]) -> None:
        """Forget a window name and its per-device series (counted as evicted)."""
        del self._windows[key]
        for dkey in [k for k in self._window_devices if k[:2] == key]:
            del self._window_devices[dkey]
        self.evicted_windows += 1
        self._count_eviction("window", 1)

    def _count_eviction(self, kind: str, n: int) -> None:
        row = self._evictions.get(kind)
        if row is None:
            row = self._evictions[kind] = _Row(_labels({"kind": kind}), 1, 0)
            row.values[0] = 0
        row.values[0] = (row.values[0] or 0) + n

    # -- scraping --------------------------------------------------------------------------------

    def _evict_stale(self) -> None:
        """Drop process rows older than ``stale_after_s`` than their host's newest event."""
        newest: dict[str, int] = {}
        for table, _ in self._tables[:-1]:  # the last table (evictions) has no host
            for row in table.values():
                host = row.labels[0]["host"]
                latest = newest.get(host)
                if latest is None or row.t_ns > latest:
                    newest[host] = row.t_ns
        stale_ns = self._stale_ns
        tables: tuple[dict[Any, _Row], ...] = (self._procs, self._proc_gpus)
        for procs in tables:
            stale = [k for k, row in procs.items() if newest[k[0]] - row.t_ns > stale_ns]
            for k in stale:
                del procs[k]
            if stale:
                self.evicted += len(stale)
                self._count_eviction("process", len(stale))
                logger.debug("dropped %d stale process series", len(stale))
        ttl = self._window_ttl_ns
        for key in [k for k, row in self._windows.items() if newest[k[0]] - row.t_ns > ttl]:
            self._drop_window(key)

    def _snapshot(self) -> _Snapshot:
        """Evict stale processes and copy every row's values: the only work under the lock."""
        with self._lock:
            if self._procs or self._proc_gpus or self._windows:
                self._evict_stale()
            return [
                (families, [(row, row.values.copy()) for row in table.values()])
                for table, families in self._tables
            ]

    def describe(self) -> list[Metric]:
        """Every family this collector may yield, without samples.

        A registry calls this instead of :meth:`collect` when the collector is registered: it
        learns the names (to detect clashes with other collectors and to answer ``name[]``
        filtered scrapes) without a scrape.
        """
        return [
            Metric(fam.family, fam.help, fam.kind, fam.unit)
            for _, families in self._tables
            for fam in families
        ]

    def collect(self) -> Iterator[Metric]:
        """The metric families for prometheus_client (families with no sample are left out)."""
        new = tuple.__new__
        for families, rows in self._snapshot():
            for fam in families:
                name = fam.name
                scale = fam.scale
                samples = [
                    new(Sample, (name, row.labels[variant], value * scale, None, None, None))
                    for row, values in rows
                    for index, variant in fam.parts
                    if (value := values[index]) is not None
                ]
                if samples:
                    metric = Metric(fam.family, fam.help, fam.kind, fam.unit)
                    metric.samples = samples
                    yield metric

    def render(self) -> bytes:
        """The text exposition format (version 0.0.4) of this exporter's registry.

        With the private registry it is written directly from a snapshot, identical to (and
        several times faster than) ``prometheus_client.generate_latest(exporter.registry)``;
        with a registry given to the constructor it *is* ``generate_latest(registry)``.
        """
        if not self._own_registry:
            return generate_latest(self.registry)
        fmt = _go_float
        out: list[str] = []
        for families, rows in self._snapshot():
            for fam in families:
                pre, scale = fam.name + "{", fam.scale
                lines = [
                    f"{pre}{row.texts[variant]}}} {fmt(value * scale)}\n"
                    for row, values in rows
                    for index, variant in fam.parts
                    if (value := values[index]) is not None
                ]
                if lines:
                    out.append(fam.header)
                    out.append("".join(lines))
        return "".join(out).encode()

    # -- serving ---------------------------------------------------------------------------------

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP from a daemon thread; returns the port bound.

        Every path answers a GET with the metrics (as prometheus_client's server does). With
        the private registry the body is :meth:`render` in the text format 0.0.4, uncompressed
        whatever the request's ``Accept`` headers ask (Prometheus takes it); requests with a
        ``name[]`` filter, and every request when a registry was given, are answered by
        prometheus_client's own WSGI app (content negotiation, OpenMetrics, gzip).

        Hostile or broken clients cannot delay a scrape (``bench/bench_scrape_hostile.py``):
        one thread reads requests and writes answers without blocking, and 4 workers only
        see complete requests. A request must be complete within 10 s of the connect, in all
        (a client trickling bytes is cut then), and at most 16 KiB (else 431); an answer must
        be written within 10 s; at most 512 connections are open, 32 per peer address, and
        one more closes the oldest still waiting for its request.

        Args:
            port: TCP port; ``0`` picks a free one (see the return value).
            addr: Address to bind (``"0.0.0.0"`` or ``"::"`` for every interface).

        Raises:
            ConfigError: The port is in use or out of range, or the address cannot be bound.
            RuntimeError: Already serving.
        """
        if self._server is not None:
            raise RuntimeError(f"already serving on port {self.port}")
        if not 0 <= port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {port!r}")
        try:
            family, host = _best_family(addr, port)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {addr!r}: {exc}") from None

        class Server(_Server):
            address_family = family

        app = self._wsgi_app()
        try:
            server = make_server(host, port, app, Server, handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {addr}:{port}: "
                + (
                    "port already in use"
                    if exc.errno == errno.EADDRINUSE
                    else (exc.strerror or str(exc))
                )
            ) from None
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"zeus-prometheus-{server.server_port}",
            daemon=True,
        )
        thread.start()
        self._server, self._thread = server, thread
        bound = int(server.server_port)
        logger.info("serving Prometheus metrics on http://%s:%d/metrics", addr, bound)
        return bound

    @property
    def port(self) -> int | None:
        """The port being served, or ``None`` when not serving."""
        return None if self._server is None else int(self._server.server_port)

    def _wsgi_app(self) -> Callable[[dict[str, Any], Callable[..., Any]], list[bytes]]:
        fallback = make_wsgi_app(self.registry)
        fast = self._own_registry
        headers = [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)]

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            if (
                not fast
                or environ["REQUEST_METHOD"] != "GET"
                or environ.get("PATH_INFO") == "/favicon.ico"
                or "name[]" in parse_qs(environ.get("QUERY_STRING", ""))
            ):
                body: list[bytes] = fallback(environ, start_response)
                return body
            data = self.render()
            start_response("200 OK", [*headers, ("Content-Length", str(len(data)))])
            return [data]

        return app

    def close(self) -> None:
        """Stop the HTTP server, if any (idempotent); the collected values are kept."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)


#: Threads answering requests, at most (a scrape takes a few ms: Prometheus needs one).
_WORKERS = 4
#: Seconds a connection has, from its accept, to send a complete request (headers), in all:
#: a client that trickles bytes is closed then, however often it sends.
_IDLE_TIMEOUT_S = 10.0
#: Seconds a response may take to be written out, in all (a client that does not read).
_WRITE_TIMEOUT_S = 10.0
#: Open connections, at most, in all and per peer address; a connection beyond closes the
#: oldest one still waiting for its request (or is closed itself when none is).
_MAX_CONNECTIONS = 512
_MAX_PER_PEER = 32
#: Longest request (request line and headers) read; a longer one is answered 431 and closed.
_MAX_REQUEST_BYTES = 16384

_READING, _WORKING, _WRITING = range(3)
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)


class _Conn:
    """One client connection of :class:`_Server`, and where its request stands."""

    __slots__ = ("address", "buf", "deadline", "out", "peer", "sock", "state")

    def __init__(self, sock: socket.socket, address: Any, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.peer = str(address[0]) if isinstance(address, tuple) else str(address)
        self.deadline = deadline
        self.state = _READING
        self.buf = bytearray()  # the request, as read so far
        self.out = memoryview(b"")  # the response, what is left to write


class _Server(WSGIServer):
    """A WSGI server that slow, idle or numerous clients cannot hold up.

    One thread owns every socket: it accepts connections, reads each request without
    blocking until its headers are complete, and writes each response without blocking; the
    pool of :data:`_WORKERS` threads only turns complete requests into responses (in
    memory), so no client can tie a worker up. Bounds, each closing the connection:

    * a request must be complete within ``idle_timeout_s`` of the accept, in all (a client
      trickling a byte every few seconds, "slowloris", is cut then), and a response written
      within ``write_timeout_s``;
    * a request longer than ``max_request_bytes`` is answered 431;
    * at most ``max_connections`` connections in all and ``max_per_peer`` per peer address:
      one more closes the oldest of them still waiting for its request (or is closed itself).

    So 2,000 idle clients or 64 trickling ones cost sockets and no thread, and a scrape is
    answered at once (prometheus_client's server keeps a thread per connection; ours before
    gave a connection to a worker at its first byte, and 8 trickling clients held all 4).
    """

    idle_timeout_s = _IDLE_TIMEOUT_S
    write_timeout_s = _WRITE_TIMEOUT_S
    max_connections = _MAX_CONNECTIONS
    max_per_peer = _MAX_PER_PEER
    max_request_bytes = _MAX_REQUEST_BYTES
    request_queue_size = _MAX_CONNECTIONS  # the listen backlog (socketserver's default is 5)

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.setblocking(False)  # accept until none is pending
        self._pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="zeus-prometheus-req")
        self._selector: selectors.BaseSelector = selectors.DefaultSelector()
        self._conns: dict[socket.socket, _Conn] = {}  # in the order accepted
        self._per_peer: dict[str, int] = {}
        # Responses made by the workers, for the selector thread to write; a byte on the
        # socket pair wakes it.
        self._done: deque[_Conn] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        #: Connections closed without a complete request: past the deadline, or to make room
        #: (figures for tests).
        self.idle_closed = 0
        #: Of those, closed to make room (or refused) under the connection caps.
        self.evicted = 0
        #: Requests longer than ``max_request_bytes``.
        self.oversized = 0

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        selector = self._selector
        selector.register(self.socket, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, events in selector.select(poll_interval):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._take_responses()
                    else:
                        conn = cast(_Conn, key.data)
                        if conn.sock not in self._conns:
                            continue  # closed earlier in this round
                        if events & selectors.EVENT_READ and conn.state == _READING:
                            self._read(conn)
                        elif events & selectors.EVENT_WRITE and conn.state == _WRITING:
                            self._write(conn)
                self._expire(time.monotonic())
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            selector.close()
            self._stopped.set()

    # -- connections (selector thread) -----------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self.get_request()
            except OSError:  # none pending (BlockingIOError), or a failed accept
                return
            sock.setblocking(False)
            self._admit(sock, address)

    def _admit(self, sock: socket.socket, address: Any) -> None:
        conn = _Conn(sock, address, time.monotonic() + self.idle_timeout_s)
        room = self._per_peer.get(conn.peer, 0) < self.max_per_peer or self._evict(conn.peer)
        room = room and (len(self._conns) < self.max_connections or self._evict(None))
        if not room:  # every connection is being answered: refuse this one
            self.evicted += 1
            self.idle_closed += 1
            self.shutdown_request(sock)
            return
        self._conns[sock] = conn
        self._per_peer[conn.peer] = self._per_peer.get(conn.peer, 0) + 1
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _evict(self, peer: str | None) -> bool:
        """Close the oldest connection still waiting for its request (of ``peer``, if given)."""
        for conn in self._conns.values():
            if conn.state == _READING and (peer is None or conn.peer == peer):
                self.evicted += 1
                self.idle_closed += 1
                self._close(conn)
                return True
        return False

    def _read(self, conn: _Conn) -> None:
        buf = conn.buf
        try:
            data = conn.sock.recv(self.max_request_bytes + 1 - len(buf))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client left (or failed)
            self._close(conn)
            return
        seen = max(0, len(buf) - 3)
        buf += data
        if buf.find(b"\r\n\r\n", seen) < 0 and buf.find(b"\n\n", seen) < 0:
            if len(buf) > self.max_request_bytes:
                self.oversized += 1
                with contextlib.suppress(OSError):
                    conn.sock.send(_TOO_LARGE)
                self._close(conn)
            return
        conn.state = _WORKING  # complete: a worker makes the response
        self._selector.unregister(conn.sock)
        self._pool.submit(self._respond, conn)

    def _take_responses(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        now = time.monotonic()
        while self._done:
            conn = self._done.popleft()
            if conn.sock not in self._conns:
                continue
            if not conn.out:
                self._close(conn)
                continue
            conn.state = _WRITING
            conn.deadline = now + self.write_timeout_s
            self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)
            self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline < now]:
            if conn.state == _READING:
                self.idle_closed += 1
                self._close(conn)
            elif conn.state == _WRITING:
                self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        left = self._per_peer[conn.peer] - 1
        if left:
            self._per_peer[conn.peer] = left
        else:
            del self._per_peer[conn.peer]
        if conn.state != _WORKING:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        self.shutdown_request(conn.sock)

    # -- responses (worker threads) --------------------------------------------------------------

    def _respond(self, conn: _Conn) -> None:
        """Run the WSGI app on a complete request; the selector thread writes the answer."""
        try:
            handler: _QuietHandler = cast(Any, self.RequestHandlerClass)(conn, conn.address, self)
            conn.out = memoryview(handler.response)
        except Exception:
            logger.debug("a metrics request failed", exc_info=True)
        self._done.append(conn)
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            self._wake_w.send(b"\0")

    def shutdown(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._stopped.wait(5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def server_close(self) -> None:
        super().server_close()
        if hasattr(self, "_wake_r"):  # activated (a failed bind closes before that)
            self._wake_r.close()
            self._wake_w.close()


class _QuietHandler(WSGIRequestHandler):
    """Answers a request read by :class:`_Server` (``request`` is its ``_Conn``) into memory,
    and does not log requests."""

    response = b""

    def setup(self) -> None:
        conn = cast(_Conn, self.request)
        self.connection = conn.sock
        self.rfile = io.BytesIO(bytes(conn.buf))
        self.wfile = io.BytesIO()

    def finish(self) -> None:
        self.response = cast(io.BytesIO, self.wfile).getvalue()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _best_family(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family to bind ``addr`` with (IPv6 for ``::``), and the address to bind."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return family, str(sockaddr[0])
