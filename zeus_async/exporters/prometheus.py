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
* Tracked processes on the host (labels ``host``, ``pid``, and ``workload`` where the sample
  names one, below): ``zeus_process_cpu_ratio``,
  ``zeus_process_cpu_share_ratio``, ``zeus_process_memory_bytes`` (plus ``kind`` = ``rss``,
  ``pss`` or ``uss``), ``zeus_process_memory_ratio``, ``zeus_process_cpu_power_watts``,
  ``zeus_process_cpu_energy_joules_total``, ``zeus_process_dram_power_watts``,
  ``zeus_process_dram_energy_joules_total``.
* Tracked processes on a GPU (labels ``host``, ``pid``, ``gpu``, and ``workload`` where the
  sample names one): ``zeus_process_gpu_sm_ratio``,
  ``zeus_process_gpu_memory_bytes``, ``zeus_process_gpu_sm_share_ratio``,
  ``zeus_process_gpu_memory_share_ratio``, ``zeus_process_gpu_power_share_ratio``,
  ``zeus_process_gpu_power_watts``, ``zeus_process_gpu_energy_joules_total``.
  A node agent's process samples name the workload each pid works for
  (``ProcessSample.workload``: ``slurm:4711``, ``k8s:<namespace>/<pod>/<container>``,
  ``uid:1001``), so ``sum by (workload) (zeus_process_cpu_power_watts)`` adds up per job; a
  sample without one (a runtime of its own) leaves the label out. A pid's series carry its
  latest workload: one whose workload changes (read mid-``exec`` as its user's, then its
  job's) is relabelled, a new series from then on.
* Workloads, from the node agent's ledger (labels ``host``, ``gpu``, ``UUID``, ``workload``
  (the key: ``slurm:4711``, ``k8s:<namespace>/<pod>/<container>``, ``uid:1001``), ``kind``,
  ``job_id``, ``user``, ``partition``, ``namespace``, ``pod``, ``container``):
  ``zeus_workload_gpu_energy_joules_total``, a counter that never goes down, across agent
  restarts too (:mod:`zeus_async.agent.ledger`), so ``sum by (job_id) (increase(...))`` holds
  over missed scrapes. A workload's series go when the agent forgets it (``expired``), or
  ``window_ttl_s`` after its last update.
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
W; plus ``device="nvidiaN"``), so dashboards built for it work unchanged. With ``names="amd"``
they take the AMD Device Metrics Exporter's (``gpu_package_power`` W, ``gpu_energy_consumed``
µJ, ``gpu_junction_temperature`` C, ``gpu_clock`` MHz, ``gpu_gfx_activity`` %,
``gpu_used_vram`` MB; plus ``gpu_id``, ``card_model`` and ``hostname``), for its dashboards.

With a carbon configuration (``PrometheusExporter(carbon=...)``; a runtime passes its own,
``Runtime(carbon=...)``), emissions and cost beside the energy
(:mod:`.carbon_counters`): ``zeus_gpu_co2e_grams_total`` and ``zeus_gpu_energy_cost_total``
(the GPU's labels plus ``source``, the configured intensity source's name, and ``currency``
on the cost), each joule charged at the intensity and price in force when it was drawn, since
the exporter started; and per window name ``zeus_window_co2e_grams_total`` and
``zeus_window_energy_cost_total`` (``host``, ``window``, ``source``, ``currency``), every
device's energy of each finished window. A cost series appears once a price is known.

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
(``bench/observability/bench_exporter.py``: 3,454 series, 8 GPUs x 50 pids, render in ~3 ms).

The metric families, the rows of series and the text format are in :mod:`.prometheus_families`;
the HTTP server behind :meth:`PrometheusExporter.serve`, bounded against hostile clients, in
:mod:`.prometheus_server`.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIServer, make_server

import anyio.abc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from .._exit import ClosedOnExit
from ..errors import ConfigError
from ..events import (
    Event,
    GpuSample,
    Measurement,
    ProcessSample,
    RaplSample,
    StreamInfo,
    WorkloadChange,
    WorkloadEnergy,
    described_gpus,
    window_energies,
)
from ..runtime.hub import EventBatches, feed_batches
from .names import DEFAULT_PORT, NAME_SETS
from .prometheus_families import (
    _AMD_FAMILIES,
    _CARBON_GPU_FAMILIES,
    _CARBON_WINDOW_FAMILIES,
    _DCGM_FAMILIES,
    _EXPORTER_FAMILIES,
    _GPU_FAMILIES,
    _GPU_FIELDS,
    _MEMORY_KINDS,
    _PROC_FAMILIES,
    _PROC_FIELDS,
    _PROC_GPU_FAMILIES,
    _PROC_GPU_FIELDS,
    _RAPL_FAMILIES,
    _RAPL_FIELDS,
    _WINDOW_DEVICE_FAMILIES,
    _WINDOW_FAMILIES,
    _WORKLOAD_FAMILIES,
    _Family,
    _go_float,
    _gpu_values,
    _labels,
    _proc_gpu_values,
    _proc_values,
    _Row,
    _Snapshot,
)
from .prometheus_server import _MAX_REQUEST_BYTES as _MAX_REQUEST_BYTES

if TYPE_CHECKING:
    from .carbon_counters import CarbonCounters
from .prometheus_server import _best_family, _QuietHandler
from .prometheus_server import _Server as _Server

__all__ = ["DEFAULT_PORT", "NAME_SETS", "PrometheusExporter"]

#: The GPU families of each name set.
_GPU_NAME_SETS: Final = {"native": _GPU_FAMILIES, "dcgm": _DCGM_FAMILIES, "amd": _AMD_FAMILIES}


logger = logging.getLogger(__name__)


def _process_labels(e: ProcessSample) -> tuple[tuple[dict[str, str], ...], tuple[str, ...]]:
    """A process row's labels: ``host``, ``pid``, ``workload`` when the sample names one
    (without it, the label set of samples that never do stays as it was), then ``kind`` per
    memory part on the host or ``gpu`` on a GPU."""
    base = {"host": e.host, "pid": str(e.pid)}
    if e.workload:
        base["workload"] = e.workload
    if e.gpu is None:
        return _labels(base, *({**base, "kind": k} for k in _MEMORY_KINDS))
    return _labels({**base, "gpu": str(e.gpu)})


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
        names: ``native``, ``dcgm`` or ``amd`` (see the module docstring).
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
        carbon: Any = None,
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
        # (host, workload key, GPU index) -> its energy counter; (host, key) -> its labels.
        self._workloads: dict[tuple[str, str, int], _Row] = {}
        self._workload_info: dict[tuple[str, str], dict[str, str]] = {}
        # Emissions and cost (a carbon configuration): per GPU and per window name.
        self.carbon: CarbonCounters | None = None
        if carbon is not None:
            from .carbon_counters import CarbonCounters

            self.carbon = CarbonCounters(carbon)
        self._gpu_carbon: dict[tuple[str, int], _Row] = {}
        self._window_carbon: dict[tuple[str, str], _Row] = {}
        self._tables: tuple[tuple[dict[Any, _Row], tuple[_Family, ...]], ...] = (
            (self._gpus, _GPU_NAME_SETS[names]),
            (self._rapl, _RAPL_FAMILIES),
            (self._procs, _PROC_FAMILIES),
            (self._proc_gpus, _PROC_GPU_FAMILIES),
            (self._window_devices, _WINDOW_DEVICE_FAMILIES),
            (self._windows, _WINDOW_FAMILIES),
            (self._workloads, _WORKLOAD_FAMILIES),
            *(
                (
                    (self._gpu_carbon, _CARBON_GPU_FAMILIES),
                    (self._window_carbon, _CARBON_WINDOW_FAMILIES),
                )
                if carbon is not None
                else ()
            ),
            # Last: _evict_stale reads every table before it by host.
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
                    if self.carbon is not None:
                        self._add_gpu_carbon(e)
                elif type(e) is ProcessSample:
                    self._add_process(e)
                elif type(e) is RaplSample:
                    self._add_rapl(e)
                elif type(e) is Measurement:
                    self._add_measurement(e)
                elif type(e) is StreamInfo:
                    self._add_stream(e)
                elif type(e) is WorkloadEnergy:
                    self._add_workload_energy(e)
                elif type(e) is WorkloadChange:
                    self._add_workload_change(e)
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
        elif self.names == "amd":  # the device metrics exporter's identifying labels
            labels["gpu_id"] = str(gpu)
            labels["hostname"] = host
            if info is not None:
                labels["card_model"] = info[1]
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
            crow = self._gpu_carbon.get(key)
            if crow is not None:
                crow.labels, crow.texts = self._carbon_labels(
                    self._gpu_labels(*key), crow.labels[1]["currency"]
                )

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
            size = len(_PROC_FIELDS) if e.gpu is None else len(_PROC_GPU_FIELDS)
            row = table[key] = _Row(_process_labels(e), size, e.t_ns)
        elif e.workload and row.labels[0].get("workload") != e.workload:
            row.labels, row.texts = _process_labels(e)  # its workload is known now, or moved
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
        if self.carbon is not None:
            self._add_window_carbon(e)

    def _carbon_labels(
        self, labels: dict[str, str], currency: str
    ) -> tuple[tuple[dict[str, str], ...], tuple[str, ...]]:
        assert self.carbon is not None
        own = {**labels, "source": self.carbon.source}
        return _labels(own, {**own, "currency": currency})

    def _add_gpu_carbon(self, e: GpuSample) -> None:
        counters = self.carbon
        assert counters is not None
        key = (e.host, e.gpu)
        counters.gpu_sample(e.host, e.gpu, e.t_ns, e.energy_j, e.power_w)
        charge = counters.gpus[key]
        row = self._gpu_carbon.get(key)
        if row is None or row.labels[1]["currency"] != charge.currency:
            labels = self._carbon_labels(self._gpu_labels(*key), charge.currency)
            if row is None:
                row = self._gpu_carbon[key] = _Row(labels, 2, e.t_ns)
            row.labels, row.texts = labels
        row.t_ns = e.t_ns
        row.values[0] = charge.grams
        row.values[1] = charge.cost

    def _add_window_carbon(self, e: Measurement) -> None:
        assert self.carbon is not None
        fp = self.carbon.window(e)
        if fp is None:
            return
        key = (e.host, e.name)
        row = self._window_carbon.get(key)
        currency = fp.currency if fp.cost is not None else ""
        if row is None or (currency and row.labels[1]["currency"] != currency):
            labels = self._carbon_labels({"host": e.host, "window": e.name}, currency)
            if row is None:
                row = self._window_carbon[key] = _Row(labels, 2, e.t_ns)
            row.labels, row.texts = labels
        row.t_ns = e.t_ns
        row.values[0] = (row.values[0] or 0.0) + fp.co2e_g
        if fp.cost is not None:
            row.values[1] = (row.values[1] or 0.0) + fp.cost

    def _workload_labels(self, host: str, key: str, gpu: int) -> dict[str, str]:
        labels = {"host": host, "gpu": str(gpu)}
        info = self._gpu_info.get((host, gpu))
        if info is not None:
            labels["UUID"] = info[0]
        labels["workload"] = key
        labels.update(self._workload_info.get((host, key), {}))
        return labels

    def _add_workload_change(self, e: WorkloadChange) -> None:
        wkey = (e.host, e.key)
        if e.state == "expired":
            self._workload_info.pop(wkey, None)
            for k in [k for k in self._workloads if k[:2] == wkey]:
                del self._workloads[k]
            return
        info = {"kind": e.kind}
        for name in ("job_id", "user", "partition", "namespace", "pod", "container"):
            value = getattr(e, name)
            if value:
                info[name] = value
        if self._workload_info.get(wkey) == info:
            return
        self._workload_info[wkey] = info
        for k, row in self._workloads.items():
            if k[:2] == wkey:  # described after its first figures: relabel
                row.labels, row.texts = _labels(self._workload_labels(*k))

    def _add_workload_energy(self, e: WorkloadEnergy) -> None:
        for gpu, joules in e.gpu_energy_j.items():
            k = (e.host, e.key, gpu)
            row = self._workloads.get(k)
            if row is None:
                row = self._workloads[k] = _Row(_labels(self._workload_labels(*k)), 1, e.t_ns)
            row.t_ns = e.t_ns
            row.values[0] = joules

    def _drop_window(self, key: tuple[str, str]) -> None:
        """Forget a window name and its per-device series (counted as evicted)."""
        del self._windows[key]
        self._window_carbon.pop(key, None)
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
        for wkey in [k for k, row in self._workloads.items() if newest[k[0]] - row.t_ns > ttl]:
            del self._workloads[wkey]

    def _snapshot(self) -> _Snapshot:
        """Evict stale processes and copy every row's values: the only work under the lock."""
        with self._lock:
            if self._procs or self._proc_gpus or self._windows or self._workloads:
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

        Hostile or broken clients cannot delay a scrape (``bench/hostile/bench_scrape_hostile.py``):
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
