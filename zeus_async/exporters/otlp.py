"""OpenTelemetry metrics export (OTLP over HTTP): the same measurements, pushed.

:class:`OtlpExporter` is a runtime consumer (``rt.start_consumer(exporter.run, batched=True)``)
that keeps the latest value of every GPU and RAPL field and every window name's energy, like
the Prometheus exporter, and hands them to an OpenTelemetry SDK ``MeterProvider`` through
observable instruments, which a ``PeriodicExportingMetricReader`` pushes to an OTLP/HTTP
endpoint every ``interval_s``: nothing is done per event beyond updating a dict.

Names follow OpenTelemetry's hardware semantic conventions where they exist:

* ``hw.power`` (W, gauge) and ``hw.energy`` (J, cumulative counter), per GPU (``hw.type`` =
  ``gpu``) and per RAPL domain (``hw.type`` = ``cpu`` or ``memory``);
* ``hw.gpu.utilization`` (1, gauge: 0..1), ``hw.gpu.memory.usage`` (By), ``hw.temperature``
  (Cel), ``hw.gpu.sm_clock`` (Hz, not a convention yet) per GPU;
* ``zeus.window.energy`` (J, cumulative, per ``zeus.window`` and ``hw.id``) and
  ``zeus.window.count``, for at most ``max_windows`` window names (the least recently finished
  one makes room; ``zeus.exporter.evicted`` counts them);
* ``zeus.workload.energy`` (J, cumulative, per workload and GPU, from the node agent's ledger,
  :mod:`zeus_async.agent.ledger`) with ``zeus.workload`` (the key: ``slurm:4711``,
  ``k8s:<namespace>/<pod>/<container>``, ``uid:1001``), ``zeus.workload.kind``, and where
  known ``slurm.job.id``, ``user.name``, ``slurm.partition``, ``k8s.namespace.name``,
  ``k8s.pod.name``, ``k8s.container.name`` (OpenTelemetry's Kubernetes resource names); a
  workload's points stop once the agent forgets it.

Every GPU point carries ``hw.id`` (its UUID once the stream's description has named it, else
``gpu:N``), ``hw.name`` (the model), ``hw.type``, ``host.name`` and ``zeus.gpu.index``. The
resource carries ``service.name`` (``zeus_async``), ``host.name`` and the run metadata's
``job``, ``rank`` and friends (``zeus_async.ranks``).

Needs ``pip install 'zeus_async[otel]'`` (opentelemetry-sdk and the OTLP/HTTP exporter).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import anyio.abc

from .._exit import ClosedOnExit
from ..errors import ConfigError
from ..events import (
    Event,
    GpuSample,
    Measurement,
    RaplSample,
    StreamInfo,
    WorkloadChange,
    WorkloadEnergy,
    described_gpus,
    window_energies,
)
from ..runtime.hub import EventBatches, feed_batches

__all__ = ["MISSING", "OtlpExporter"]

logger = logging.getLogger(__name__)

MISSING = "OpenTelemetry export needs: pip install 'zeus_async[otel]'"

#: Workload identity fields and their attribute names.
_WORKLOAD_ATTRIBUTES = (
    ("job_id", "slurm.job.id"),
    ("user", "user.name"),
    ("partition", "slurm.partition"),
    ("namespace", "k8s.namespace.name"),
    ("pod", "k8s.pod.name"),
    ("container", "k8s.container.name"),
)
#: GPU fields exported, as (event field, instrument name, unit, scale).
_GPU_GAUGES = (
    ("power_w", "hw.power", "W", 1.0),
    ("utilization_frac", "hw.gpu.utilization", "1", 1.0),
    ("memory_used_bytes", "hw.gpu.memory.usage", "By", 1.0),
    ("temperature_c", "hw.temperature", "Cel", 1.0),
    ("sm_clock_hz", "hw.gpu.sm_clock", "Hz", 1.0),
)
_RAPL_TYPES = {"package": "cpu", "dram": "memory"}
#: Longest an export (with the SDK's retries) may take, in seconds.
_EXPORT_TIMEOUT_S = 2.0


class OtlpExporter(ClosedOnExit):
    """Pushes the latest measurements to an OTLP/HTTP metrics endpoint.

    Args:
        endpoint: The collector's OTLP/HTTP metrics URL (``http://host:4318/v1/metrics``; a
            URL without a path gets ``/v1/metrics``).
        interval_s: Seconds between exports.
        resource: More resource attributes (``job``, ``rank``...; strings).
        max_windows: Most window names exported.
        headers: HTTP headers of every request (an API key...).

    Raises:
        ImportError: The OpenTelemetry SDK or its OTLP/HTTP exporter is not installed.
        ConfigError: A bad interval, endpoint or ``max_windows``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        interval_s: float = 10.0,
        resource: Mapping[str, str] | None = None,
        max_windows: int = 1000,
        headers: Mapping[str, str] | None = None,
        carbon: Any = None,
    ) -> None:
        if not interval_s > 0:
            raise ConfigError(f"interval_s must be positive, got {interval_s!r}")
        if max_windows < 1:
            raise ConfigError(f"max_windows must be at least 1, got {max_windows!r}")
        if not endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"the OTLP endpoint must be an http:// or https:// URL: {endpoint!r}")
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            from opentelemetry.sdk.resources import Resource
        except ImportError as exc:
            raise ImportError(MISSING) from exc
        if endpoint.rstrip("/").count("/") <= 2:  # scheme://host[:port] only
            endpoint = endpoint.rstrip("/") + "/v1/metrics"
        self.endpoint = endpoint
        self.max_windows = max_windows
        self._lock = threading.Lock()
        # (host, gpu) -> field -> value; (host, gpu) -> (UUID, model).
        self._gpus: dict[tuple[str, int], dict[str, float]] = {}
        self._gpu_info: dict[tuple[str, int], tuple[str, str]] = {}
        # (host, package, domain) -> (power, energy).
        self._rapl: dict[tuple[str, int, str], list[float | None]] = {}
        # (host, window) -> device -> [joules total, windows]; least recently finished first.
        self._windows: OrderedDict[tuple[str, str], dict[str, list[float]]] = OrderedDict()
        # Emissions and cost (a carbon configuration), per GPU and per window name: the
        # window's [grams, cost or None, currency].
        self.carbon: Any = None
        if carbon is not None:
            from .carbon_counters import CarbonCounters

            self.carbon = CarbonCounters(carbon)
        self._window_carbon: dict[tuple[str, str], list[Any]] = {}
        # (host, workload key) -> its attributes; -> GPU index -> joules.
        self._workload_info: dict[tuple[str, str], dict[str, str]] = {}
        self._workloads: dict[tuple[str, str], dict[int, float]] = {}
        #: Window names dropped past ``max_windows``.
        self.evicted = 0
        #: Events handled by :meth:`add`.
        self.events = 0
        attributes = {"service.name": "zeus_async", "host.name": socket.gethostname()}
        attributes.update(resource or {})
        # A collector that does not answer costs one export's time at most, never the run's
        # end (the SDK retries with back-off for up to this long), and one line, not a
        # warning per retry.
        self._timeout_s = min(interval_s, _EXPORT_TIMEOUT_S)
        #: Exports that failed so far (the collector did not answer, or refused).
        self.failed_exports = 0
        self._failing = False
        report = self._report

        class Exporter(OTLPMetricExporter):
            def export(self, *args: Any, **kwargs: Any) -> Any:
                result = super().export(*args, **kwargs)
                report(result)
                return result

        exporter = Exporter(endpoint=endpoint, headers=dict(headers or {}), timeout=self._timeout_s)
        logging.getLogger(OTLPMetricExporter.__module__).setLevel(logging.CRITICAL)
        self._reader = PeriodicExportingMetricReader(
            exporter, export_interval_millis=interval_s * 1e3
        )
        self._provider = MeterProvider(
            resource=Resource.create(attributes), metric_readers=[self._reader]
        )
        meter = self._provider.get_meter("zeus_async")
        for field, name, unit, scale in _GPU_GAUGES:
            meter.create_observable_gauge(
                name,
                callbacks=[self._gpu_callback(field, scale)],
                unit=unit,
                description=f"GPU {field} (zeus_async)",
            )
        meter.create_observable_gauge(
            "hw.power", callbacks=[self._rapl_callback(0)], unit="W", description="RAPL power"
        )
        meter.create_observable_counter(
            "hw.energy",
            callbacks=[self._gpu_callback("energy_j", 1.0), self._rapl_callback(1)],
            unit="J",
            description="Energy counter (GPU since the driver loaded, RAPL since sampling began)",
        )
        meter.create_observable_counter(
            "zeus.window.energy",
            callbacks=[self._window_callback(0)],
            unit="J",
            description="Energy of a device summed over the finished windows of a name",
        )
        meter.create_observable_counter(
            "zeus.window.count",
            callbacks=[self._window_callback(1)],
            unit="{window}",
            description="Finished windows of a name",
        )
        if self.carbon is not None:
            meter.create_observable_counter(
                "zeus.gpu.co2e",
                callbacks=[self._carbon_gpu_callback(0)],
                unit="g",
                description="Grams CO2-equivalent of the GPU's energy since the exporter started",
            )
            meter.create_observable_counter(
                "zeus.gpu.energy.cost",
                callbacks=[self._carbon_gpu_callback(1)],
                unit="{currency}",
                description="Cost of the GPU's energy since the exporter started",
            )
            meter.create_observable_counter(
                "zeus.window.co2e",
                callbacks=[self._carbon_window_callback(0)],
                unit="g",
                description="Grams CO2-equivalent summed over the finished windows of a name",
            )
            meter.create_observable_counter(
                "zeus.window.energy.cost",
                callbacks=[self._carbon_window_callback(1)],
                unit="{currency}",
                description="Cost of the energy summed over the finished windows of a name",
            )
        meter.create_observable_counter(
            "zeus.workload.energy",
            callbacks=[self._workload_callback],
            unit="J",
            description="GPU energy drawn while the workload held the GPU",
        )
        meter.create_observable_counter(
            "zeus.exporter.evicted",
            callbacks=[self._evicted_callback],
            unit="{series}",
            description="Window names dropped past max_windows",
        )
        self._closed = False

    # -- feeding ---------------------------------------------------------------------------------

    def add(self, events: Iterable[Event]) -> None:
        """Take a batch of events: update the latest values (other kinds are ignored)."""
        n = 0
        with self._lock:
            for e in events:
                n += 1
                if type(e) is GpuSample:
                    values = self._gpus.setdefault((e.host, e.gpu), {})
                    for field in ("power_w", "energy_j", *(g[0] for g in _GPU_GAUGES)):
                        v = getattr(e, field)
                        if v is not None:
                            values[field] = v
                    if self.carbon is not None:
                        self.carbon.gpu_sample(e.host, e.gpu, e.t_ns, e.energy_j, e.power_w)
                elif type(e) is RaplSample:
                    if e.domain in _RAPL_TYPES:
                        row = self._rapl.setdefault((e.host, e.package, e.domain), [None, None])
                        if e.power_w is not None:
                            row[0] = e.power_w
                        row[1] = e.energy_j
                elif type(e) is Measurement:
                    self._add_measurement(e)
                elif type(e) is StreamInfo:
                    for gpu, d in described_gpus(e):
                        self._gpu_info[(e.host, gpu)] = (d.uuid, d.name)
                elif type(e) is WorkloadEnergy:
                    self._workloads[(e.host, e.key)] = dict(e.gpu_energy_j)
                elif type(e) is WorkloadChange:
                    self._add_workload_change(e)
            self.events += n

    def _add_workload_change(self, e: WorkloadChange) -> None:
        key = (e.host, e.key)
        if e.state == "expired":
            self._workload_info.pop(key, None)
            self._workloads.pop(key, None)
            return
        info = {"zeus.workload": e.key, "zeus.workload.kind": e.kind}
        for field, name in _WORKLOAD_ATTRIBUTES:
            value = getattr(e, field)
            if value:
                info[name] = value
        self._workload_info[key] = info

    def _add_measurement(self, e: Measurement) -> None:
        key = (e.host, e.name)
        devices = self._windows.pop(key, None)
        if devices is None:
            if len(self._windows) >= self.max_windows:
                gone, _ = self._windows.popitem(last=False)
                self._window_carbon.pop(gone, None)
                self.evicted += 1
            devices = {}
        self._windows[key] = devices
        for device, joules in window_energies(e):
            slot = devices.setdefault(device, [0.0, 0.0])
            slot[0] += joules
            slot[1] += 1
        if self.carbon is not None:
            fp = self.carbon.window(e)
            if fp is not None:
                slot = self._window_carbon.setdefault(key, [0.0, None, ""])
                slot[0] += fp.co2e_g
                if fp.cost is not None:
                    slot[1] = (slot[1] or 0.0) + fp.cost
                    slot[2] = slot[2] or fp.currency

    async def run(self, stream: EventBatches | anyio.abc.ObjectReceiveStream[Event]) -> None:
        """Consume ``stream`` until it ends (a runtime consumer, batched or not)."""
        await feed_batches(stream, self.add)

    # -- observing (the SDK's export thread) ------------------------------------------------------

    def _gpu_attributes(self, host: str, gpu: int) -> dict[str, str | int]:
        uuid, model = self._gpu_info.get((host, gpu), ("", ""))
        attributes: dict[str, str | int] = {
            "hw.id": uuid or f"gpu:{gpu}",
            "hw.type": "gpu",
            "host.name": host,
            "zeus.gpu.index": gpu,
        }
        if model:
            attributes["hw.name"] = model
        return attributes

    def _gpu_callback(self, field: str, scale: float) -> Any:
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> Iterator[Observation]:
            with self._lock:
                points = [
                    (self._gpu_attributes(host, gpu), values[field] * scale)
                    for (host, gpu), values in self._gpus.items()
                    if field in values
                ]
            for attributes, value in points:
                yield Observation(value, attributes)

        return observe

    def _rapl_callback(self, index: int) -> Any:
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> Iterator[Observation]:
            with self._lock:
                points = [
                    (host, package, domain, value)
                    for (host, package, domain), row in self._rapl.items()
                    if (value := row[index]) is not None
                ]
            for host, package, domain, value in points:
                attributes = {
                    "hw.id": f"cpu:{package}/{domain}",
                    "hw.type": _RAPL_TYPES[domain],
                    "host.name": host,
                }
                yield Observation(value, attributes)

        return observe

    def _window_callback(self, index: int) -> Any:
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> Iterator[Observation]:
            with self._lock:
                points = [
                    (host, name, device, slot[index])
                    for (host, name), devices in self._windows.items()
                    for device, slot in devices.items()
                ]
            for host, name, device, value in points:
                attributes = {"zeus.window": name, "hw.id": device, "host.name": host}
                yield Observation(value, attributes)

        return observe

    def _carbon_gpu_callback(self, index: int) -> Any:
        """``zeus.gpu.co2e`` (0) or ``zeus.gpu.energy.cost`` (1): the GPU's attributes, the
        source's name (``zeus.carbon.source``) and, on the cost, ``zeus.currency``."""
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> Iterator[Observation]:
            counters = self.carbon
            with self._lock:
                points = [
                    (host, gpu, c.grams if index == 0 else c.cost, c.currency)
                    for (host, gpu), c in counters.gpus.items()
                ]
            for host, gpu, value, currency in points:
                if value is None:
                    continue
                attributes = {
                    **self._gpu_attributes(host, gpu),
                    "zeus.carbon.source": counters.source,
                }
                if index == 1:
                    attributes["zeus.currency"] = currency
                yield Observation(value, attributes)

        return observe

    def _carbon_window_callback(self, index: int) -> Any:
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> Iterator[Observation]:
            with self._lock:
                points = [(key, list(slot)) for key, slot in self._window_carbon.items()]
            for (host, name), (grams, cost, currency) in points:
                value = grams if index == 0 else cost
                if value is None:
                    continue
                attributes = {
                    "zeus.window": name,
                    "host.name": host,
                    "zeus.carbon.source": self.carbon.source,
                }
                if index == 1:
                    attributes["zeus.currency"] = currency
                yield Observation(value, attributes)

        return observe

    def _workload_callback(self, options: Any) -> Iterator[Any]:
        from opentelemetry.metrics import Observation

        with self._lock:
            points = [
                (
                    {
                        **self._workload_info.get((host, key), {"zeus.workload": key}),
                        **self._gpu_attributes(host, gpu),
                    },
                    joules,
                )
                for (host, key), gpus in self._workloads.items()
                for gpu, joules in gpus.items()
            ]
        for attributes, value in points:
            yield Observation(value, attributes)

    def _evicted_callback(self, options: Any) -> Iterator[Any]:
        from opentelemetry.metrics import Observation

        yield Observation(self.evicted, {"zeus.kind": "window"})

    def _report(self, result: Any) -> None:
        """One line when exports start failing, one when they work again (not one a try)."""
        ok = getattr(result, "name", "") == "SUCCESS"
        if not ok:
            self.failed_exports += 1
            if not self._failing:
                self._failing = True
                logger.warning(
                    "OTLP export to %s failed (no answer within %.1f s, or refused); "
                    "trying again every interval",
                    self.endpoint,
                    self._timeout_s,
                )
        elif self._failing:
            self._failing = False
            logger.warning("OTLP export to %s works again", self.endpoint)

    # -- lifecycle ------------------------------------------------------------------------------

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export now (waits for the request); whether it succeeded."""
        flushed = bool(self._provider.force_flush(round(timeout_s * 1e3)))
        return flushed and not self._failing  # the SDK says flushed even when it failed

    def close(self) -> None:
        """Export a last time and stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._provider.shutdown(timeout_millis=self._timeout_s * 1e3)
        except Exception:
            logger.exception("stopping the OTLP exporter failed")
