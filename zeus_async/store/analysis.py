"""Analysis of recordings: per-device series, energy over any interval, totals and export.

This is the offline counterpart of the live aggregation (the role of AIPowerMeter's
``ExpResults``): :class:`Recording` reads a recording once and keeps, per device, one column of
``(t_ns, value)`` pairs per metric, plus a :class:`~zeus_async.aggregate.history.DeviceHistory`
per energy-measurable device — the same estimator the measurement windows use, fed the same
way — so energy over any interval is what a window over that interval would have reported.

Naming
------

*Devices* are the keys the live aggregation uses:

* ``gpu:<index>`` — a GPU (:class:`~zeus_async.events.GpuSample`);
* ``cpu:<package>/<domain>`` — one RAPL domain of one CPU package
  (:class:`~zeus_async.events.RaplSample`; domains ``package``, ``core``, ``uncore``, ``dram``,
  ``psys``). Wherever a device name is accepted, ``cpu:<package>`` alone means
  ``cpu:<package>/package``;
* ``proc:<pid>`` — a process (:class:`~zeus_async.events.ProcessSample` without a GPU), and
  ``proc:<pid>/gpu:<index>`` — a process on one GPU.

When the events of a recording come from more than one host, every key gets the host appended
(``gpu:0@node1``); a single-host recording uses the bare keys.

*Metrics* are ``"<kind>.<field>"``: the event tag and a numeric field of that event, e.g.
``gpu.power_w``, ``gpu.energy_j``, ``gpu.temperature_c``, ``rapl.energy_j``, ``rapl.power_w``,
``proc.cpu_frac``, ``proc.attributed_power_w``. Every ``int``/``float`` field of
``GpuSample``, ``RaplSample`` and ``ProcessSample`` is a metric, except the identifying ones
(``gpu``, ``package``, ``pid``); :meth:`Recording.metrics` lists those with at least one value
in the file. A new numeric field in the schema becomes a metric with no change here.

Processes
---------

Recordings of a runtime with process tracking hold :class:`~zeus_async.events.ProcessSample`
events: ``proc.*`` metrics like any other (``total("proc.cpu_power_w")`` integrates a tracked
process's CPU power; ``total("proc.attributed_power_w")`` the GPU power attributed to every
tracked process). :meth:`Recording.totals` adds, per process, the attributed CPU, DRAM and
per-GPU energy from the samples' running totals, and their sums for the experiment.
AIPowerMeter's metric names are accepted too (:data:`AIPOWERMETER_METRICS`:
``total("per_process_cpu_power")``, ``series("nvidia_attributable_power", ...)``).

Progress
--------

Loading and the exporters take ``progress(done_bytes, total_bytes)``: bytes of the file read so
far and the file size. It is called about every 64k events (:data:`PROGRESS_EVERY`), and once
more with ``done_bytes == total_bytes`` when the pass ends.
"""

from __future__ import annotations

import collections
import csv
import io
import itertools
import json
import logging
import operator
import os
import sys
import typing
from array import array
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from ..aggregate.history import DeviceHistory, EnergyEstimate, add_sample
from ..aggregate.live import device_order
from ..errors import ConfigError
from ..events import (
    EVENT_TYPES,
    DeviceInfo,
    Event,
    GpuSample,
    Measurement,
    ProcessSample,
    RaplSample,
    RequestIdle,
    RequestMeasurement,
    StreamInfo,
    event_kind,
    event_to_dict,
    event_to_json,
)
from .format import RecordingHeader
from .progress import PROGRESS_EVERY, Progress, ProgressTicker
from .reader import RecordingReader, RecoveryReport, event_device

__all__ = [
    "AIPOWERMETER_METRICS",
    "CSV_FIXED",
    "PROGRESS_EVERY",
    "DeviceTotal",
    "ProcessTotal",
    "Progress",
    "Recording",
    "Series",
    "Totals",
    "csv_columns",
    "export_csv",
    "export_jsonl",
]

logger = logging.getLogger(__name__)

_PathLike = str | os.PathLike[str]

# Fields that identify what a sample is about; they are part of the device key, not metrics.
_ID_FIELDS: Final = frozenset({"host", "t_ns", "gpu", "package", "domain", "pid"})


def _numeric_fields(cls: type[Any]) -> tuple[str, ...]:
    """The int/float (optionally ``None``) fields of an event struct, in schema order."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for name in cls.__struct_fields__:
        if name in _ID_FIELDS:
            continue
        hint = hints[name]
        args = set(typing.get_args(hint) or (hint,)) - {type(None)}
        if args and args <= {int, float}:
            out.append(name)
    return tuple(out)


# Event type -> (kind, ((field, metric), ...)) for the event kinds that form series.
_SPECS: Final[dict[type[Any], tuple[str, tuple[tuple[str, str], ...]]]] = {
    cls: (tag, tuple((f, f"{tag}.{f}") for f in _numeric_fields(cls)))
    for cls in (GpuSample, RaplSample, ProcessSample)
    for tag in [str(cls.__struct_config__.tag)]
}


#: AIPowerMeter's metric names, accepted wherever a metric is (``total("per_process_cpu_power")``).
AIPOWERMETER_METRICS: Final = {
    "per_process_cpu_power": "proc.cpu_power_w",
    "per_process_dram_power": "proc.dram_power_w",
    "per_process_cpu_uses": "proc.cpu_share_frac",
    "per_process_mem_use_abs": "proc.memory_pss_bytes",
    "per_process_mem_use_uss": "proc.memory_uss_bytes",
    "per_process_mem_use_percent": "proc.memory_frac",
    "nvidia_attributable_power": "proc.attributed_power_w",
    "per_gpu_attributable_power": "proc.attributed_power_w",
    "per_gpu_per_pid_utilization_absolute": "proc.gpu_sm_frac",
    "per_gpu_attributable_mem_use": "proc.gpu_memory_bytes",
    "per_gpu_estimated_attributable_utilization": "proc.gpu_power_share_frac",
    "per_gpu_power_draw": "gpu.power_w",
    "nvidia_draw_absolute": "gpu.power_w",
}


_T_NS: Final = operator.attrgetter("t_ns")
_GETTERS: Final = {
    name: operator.attrgetter(name) for _, fields in _SPECS.values() for name, _ in fields
}


def _series_key(event: GpuSample | RaplSample | ProcessSample) -> str:
    if isinstance(event, GpuSample):
        return f"gpu:{event.gpu}"
    if isinstance(event, RaplSample):
        return f"cpu:{event.package}/{event.domain}"
    base = f"proc:{event.pid}"
    return base if event.gpu is None else f"{base}/gpu:{event.gpu}"


class _Column:
    """One metric of one device: parallel arrays of time and value (compact in memory)."""

    __slots__ = ("t", "v")

    def __init__(self) -> None:
        self.t: array[int] = array("q")
        self.v: array[float] = array("d")


@dataclass(frozen=True)
class Series:
    """Values of one metric of one device, in file order (time order for one recorder).

    Attributes:
        metric: ``"<kind>.<field>"``.
        device: Device key.
        t_ns: Time of each value (wall-clock ns).
        values: The values (samples where the field was ``None`` are left out).
        start_ns: Start of the recording, the origin of :meth:`seconds`.
    """

    metric: str
    device: str
    t_ns: list[int]
    values: list[float]
    start_ns: int

    def seconds(self) -> list[float]:
        """Time of each value in seconds since the start of the recording."""
        start = self.start_ns
        return [(t - start) / 1e9 for t in self.t_ns]

    def __len__(self) -> int:
        return len(self.t_ns)


@dataclass(frozen=True)
class DeviceTotal:
    """Energy of one device over its whole span in the recording.

    Attributes:
        device: Device key.
        energy_j: Joules, or ``None`` when the device's data cannot give it.
        method: How it was obtained (the :class:`DeviceHistory` method: ``counter+interpolated``,
            ``counter+extrapolated``, ``integrated``, ``unavailable``).
        start_ns: First sample of the device.
        end_ns: Last sample of the device.
        duration_s: ``end_ns - start_ns`` in seconds.
        mean_power_w: ``energy_j / duration_s``, or ``None`` (no energy or zero duration).
    """

    device: str
    energy_j: float | None
    method: str
    start_ns: int
    end_ns: int
    duration_s: float
    mean_power_w: float | None


@dataclass(frozen=True)
class ProcessTotal:
    """Attributed energy of one tracked process over the recording (from its
    :class:`~zeus_async.events.ProcessSample` running totals).

    Attributes:
        pid: Process id (with ``@host`` appended in multi-host recordings, as device keys are).
        cpu_energy_j: Share of the RAPL package energy, or ``None`` without RAPL.
        dram_energy_j: Share of the RAPL DRAM energy, or ``None`` without a DRAM domain.
        gpu_energy_j: GPU index to the energy attributed on that GPU.
        start_ns: First sample of the process.
        end_ns: Last sample of the process.
        duration_s: ``end_ns - start_ns`` in seconds.
    """

    pid: str
    cpu_energy_j: float | None
    dram_energy_j: float | None
    gpu_energy_j: dict[int, float]
    start_ns: int
    end_ns: int
    duration_s: float

    @property
    def total_energy_j(self) -> float:
        """CPU + DRAM + every GPU."""
        return (
            (self.cpu_energy_j or 0.0)
            + (self.dram_energy_j or 0.0)
            + sum(self.gpu_energy_j.values())
        )


@dataclass(frozen=True)
class Totals:
    """Per-device and experiment totals of a recording (see :meth:`Recording.totals`).

    Attributes:
        devices: Device key to its :class:`DeviceTotal`, for every GPU and RAPL domain.
        gpu_energy_j: Sum over GPUs.
        cpu_energy_j: Sum over the RAPL ``package`` domains, or ``None`` without any.
        dram_energy_j: Sum over the RAPL ``dram`` domains, or ``None`` without any.
        total_energy_j: GPU + CPU + DRAM (the ``core``/``uncore`` domains lie inside
            ``package`` and ``psys`` contains it, so they are not added).
        duration_s: Duration of the recording.
        processes: Per tracked process, its attributed energy (empty without process
            tracking).
        process_cpu_energy_j, process_dram_energy_j, process_gpu_energy_j: The experiment's
            share: sums over the tracked processes (``None`` when nothing was attributed).
    """

    devices: dict[str, DeviceTotal]
    gpu_energy_j: float
    cpu_energy_j: float | None
    dram_energy_j: float | None
    total_energy_j: float
    duration_s: float
    processes: dict[str, ProcessTotal] = field(default_factory=dict)
    process_cpu_energy_j: float | None = None
    process_dram_energy_j: float | None = None
    process_gpu_energy_j: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of everything here."""
        return {
            "devices": {k: dict(vars(v)) for k, v in self.devices.items()},
            "gpu_energy_j": self.gpu_energy_j,
            "cpu_energy_j": self.cpu_energy_j,
            "dram_energy_j": self.dram_energy_j,
            "total_energy_j": self.total_energy_j,
            "duration_s": self.duration_s,
            "processes": {
                k: {**vars(v), "total_energy_j": v.total_energy_j}
                for k, v in self.processes.items()
            },
            "process_cpu_energy_j": self.process_cpu_energy_j,
            "process_dram_energy_j": self.process_dram_energy_j,
            "process_gpu_energy_j": self.process_gpu_energy_j,
        }


def _tag(event_type: type) -> str:
    """The kind name of an event type (its msgspec tag)."""
    return str(getattr(event_type, "__struct_config__").tag)  # noqa: B009 (mypy: not on type)


@dataclass
class _Loaded:
    columns: dict[str, dict[str, _Column]] = field(default_factory=dict)
    histories: dict[str, DeviceHistory] = field(default_factory=dict)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    windows: list[Measurement] = field(default_factory=list)
    requests: list[RequestMeasurement] = field(default_factory=list)
    request_idle: list[RequestIdle] = field(default_factory=list)
    streams: dict[str, StreamInfo] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    several_hosts: bool = False
    start_ns: int | None = None
    end_ns: int | None = None
    types: collections.Counter[type] = field(default_factory=collections.Counter)


def _load(reader: RecordingReader, progress: Progress | None) -> _Loaded:
    """One pass over the file: columns, histories and spans per ``(host, key)``."""
    columns: dict[tuple[str, str], dict[str, _Column]] = {}
    histories: dict[tuple[str, str], DeviceHistory] = {}
    spans: dict[tuple[str, str], list[int]] = {}
    out = _Loaded()
    t_min: int | None = None
    t_max: int | None = None
    ticker = ProgressTicker(reader, progress)
    types = out.types
    for batch in reader.batches():
        types.update(map(type, batch))
        # Group the frame's samples per device, then extend each column in one go (C-level
        # map/extend instead of a Python step per value).
        stamps = list(map(_T_NS, batch))
        lo, hi = min(stamps), max(stamps)
        t_min = lo if t_min is None else min(t_min, lo)
        t_max = hi if t_max is None else max(t_max, hi)
        groups: dict[tuple[str, str], list[Any]] = {}
        for event in batch:
            if type(event) in _SPECS:
                sample = typing.cast("GpuSample | RaplSample | ProcessSample", event)
                ident = (sample.host, _series_key(sample))
                group = groups.get(ident)
                if group is None:
                    groups[ident] = [event]
                else:
                    group.append(event)
            elif isinstance(event, Measurement):
                out.windows.append(event)
            elif isinstance(event, RequestMeasurement):
                out.requests.append(event)
            elif isinstance(event, RequestIdle):
                out.request_idle.append(event)
            elif isinstance(event, StreamInfo):
                # Every stream's own description (a stream that joined a recording after its
                # header was written is only here); the first one of each stream is kept.
                out.streams.setdefault(event.stream_id, event)
        for ident, group in groups.items():
            spec = _SPECS[type(group[0])]
            ts = list(map(_T_NS, group))
            span = spans.get(ident)
            if span is None:
                spans[ident] = [min(ts), max(ts)]
            else:
                span[0] = min(span[0], *ts)
                span[1] = max(span[1], *ts)
            metrics = columns.setdefault(ident, {})
            for name, metric in spec[1]:
                values = list(map(_GETTERS[name], group))
                if None in values:
                    kept = [(t, v) for t, v in zip(ts, values, strict=True) if v is not None]
                    if not kept:
                        continue
                    col_t: Iterable[int] = (t for t, _ in kept)
                    col_v: Iterable[float] = (v for _, v in kept)
                else:
                    col_t, col_v = ts, values
                column = metrics.get(metric)
                if column is None:
                    column = metrics[metric] = _Column()
                column.t.extend(col_t)
                column.v.extend(col_v)
            if not isinstance(group[0], ProcessSample):
                history = histories.get(ident)
                if history is None:
                    fine = isinstance(group[0], RaplSample)
                    history = histories[ident] = DeviceHistory(ident[1], fine_counter=fine)
                for event in group:
                    add_sample(history, event)
        ticker.tick()
    ticker.finish()
    out.hosts = list(
        dict.fromkeys([info.host for info in out.streams.values()] + [h for h, _ in columns])
    )
    several_hosts = out.several_hosts = len(out.hosts) > 1

    def label(ident: tuple[str, str]) -> str:
        return f"{ident[1]}@{ident[0]}" if several_hosts else ident[1]

    for ident in sorted(columns, key=lambda i: device_order(label(i))):
        key = label(ident)
        out.columns[key] = columns[ident]
        out.spans[key] = (spans[ident][0], spans[ident][1])
        history = histories.get(ident)
        if history is not None and history.first_t_ns is not None:
            # A device's span is that of the samples its estimator took (not a duplicate or
            # an out-of-order one, nor one with neither power nor energy): the span of its
            # monitor/replay total.
            assert history.last_t_ns is not None
            out.histories[key] = history
            out.spans[key] = (history.first_t_ns, history.last_t_ns)
    out.start_ns, out.end_ns = t_min, t_max
    return out


def _energy_field(metric: str) -> bool:
    return metric.rpartition(".")[2].endswith("energy_j")


def _power_field(metric: str) -> bool:
    return metric.rpartition(".")[2].endswith("power_w")


class Recording:
    """A recording loaded for analysis (one pass over the file, see the module docstring).

    Args:
        path: The recording file.
        progress: Optional ``progress(done_bytes, total_bytes)`` callback for the load pass.

    Attributes:
        path: The recording file.
        header: Run metadata (:class:`~zeus_async.store.RecordingHeader`).
        report: What the load pass found (torn tail, corrupt frames); damage is reported,
            every complete frame is analyzed.
        start_ns: Time of the earliest event (``header.start_wall_ns`` for an empty file).
        end_ns: Time of the latest event (``start_ns`` for an empty file).

    Raises:
        NotARecordingError, SchemaVersionError, CodecError: Not a readable recording.
        OSError: The file cannot be read.
    """

    def __init__(self, path: _PathLike, *, progress: Progress | None = None) -> None:
        reader = RecordingReader(path)
        self.path = reader.path
        self.header: RecordingHeader = reader.header
        loaded = _load(reader, progress)
        self.report: RecoveryReport = reader.report
        self._columns = loaded.columns
        self._histories = loaded.histories
        self._spans = loaded.spans
        self._windows = loaded.windows
        self._requests = loaded.requests
        self._request_idle = loaded.request_idle
        counts = {_tag(t): n for t, n in loaded.types.items()}
        self._kinds = dict(sorted(counts.items()))
        self._streams = loaded.streams
        self._hosts = loaded.hosts
        self._several_hosts = loaded.several_hosts
        self.start_ns: int = (
            loaded.start_ns if loaded.start_ns is not None else self.header.start_wall_ns
        )
        self.end_ns: int = loaded.end_ns if loaded.end_ns is not None else self.start_ns
        self.report.warn(self.path, "analyzed")
        logger.info(
            "loaded %s: %d events, %d devices, %.3f s%s",
            self.path,
            self.report.events_ok,
            len(self._columns),
            self.duration_s,
            "" if self.report.clean else " (damaged file, recovered)",
        )

    @property
    def hosts(self) -> list[str]:
        """Every host the recording holds streams or samples of, in order of appearance (the
        header's ``host`` is the recorder's or the first stream's)."""
        return list(self._hosts) or ([self.header.host] if self.header.host else [])

    @property
    def streams(self) -> list[StreamInfo]:
        """The description of every stream recorded (its first StreamInfo), in file order:
        one per publisher; a stream that joined after the header was written is only here."""
        return list(self._streams.values())

    def device_info(self) -> dict[str, DeviceInfo]:
        """What the recording says about each device, by the names :meth:`devices` uses
        (``gpu:0``, or ``gpu:0@node1`` when several hosts).

        From each recorded stream's StreamInfo, so devices of streams that joined after the
        header was written are included; from the header when no stream describes itself in
        the file (a recording written by :func:`~zeus_async.store.write_recording`).
        """
        pairs: list[tuple[str, DeviceInfo]] = [
            (info.host, d) for info in self._streams.values() for d in info.devices
        ]
        if not pairs:
            pairs = [(self.header.host, d) for d in self.header.devices]
        return {
            (f"{d.key}@{host}" if self._several_hosts else d.key): d
            for host, d in sorted(pairs, key=lambda p: device_order(f"{p[1].key}@{p[0]}"))
        }

    @classmethod
    def load(cls, path: _PathLike, progress: Progress | None = None) -> Recording:
        """Same as ``Recording(path, progress=progress)``."""
        return cls(path, progress=progress)

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last event."""
        return (self.end_ns - self.start_ns) / 1e9

    # -- names ---------------------------------------------------------------------------------

    def devices(self, metric: str | None = None) -> list[str]:
        """Device keys with data (GPUs, then RAPL domains, then processes), optionally only
        those with values of ``metric``."""
        if metric is None:
            return list(self._columns)
        metric = self._check_metric(metric)
        return [d for d, cols in self._columns.items() if metric in cols]

    def requests(self) -> list[RequestMeasurement]:
        """The inference requests the recording holds (``request`` events, in order)."""
        return list(self._requests)

    def request_totals(self) -> dict[int, tuple[float, float, float]]:
        """Per GPU, over the request meter's settled intervals in the recording:
        ``(measured J, requests J, idle J)``; requests + idle = measured."""
        out: dict[int, list[float]] = {}
        for idle in self._request_idle:
            for gpu, energy in idle.gpu_energy_j.items():
                row = out.setdefault(gpu, [0.0, 0.0, 0.0])
                row[0] += energy
                row[2] += idle.gpu_idle_j.get(gpu, 0.0)
        for r in self._requests:
            for gpu, energy in r.gpu_energy_j.items():
                out.setdefault(gpu, [0.0, 0.0, 0.0])[1] += energy
        return {gpu: (row[0], row[1], row[2]) for gpu, row in sorted(out.items())}

    def event_counts(self) -> dict[str, int]:
        """How many events of each kind (``"gpu"``, ``"measurement"``...) the recording holds,
        by kind name."""
        return dict(self._kinds)

    def metrics(self, device: str | None = None) -> list[str]:
        """Metrics with at least one value (of ``device``, if given), in schema order."""
        if device is None:
            present = {m for cols in self._columns.values() for m in cols}
        else:
            present = set(self._columns[self._resolve(device)])
        return [m for _, fields in _SPECS.values() for _, m in fields if m in present]

    def _check_metric(self, metric: str) -> str:
        """``metric`` (an AIPowerMeter name mapped to ours) if present, else ConfigError."""
        metric = AIPOWERMETER_METRICS.get(metric, metric)
        if metric not in self.metrics():
            raise ConfigError(
                f"unknown metric {metric!r} in {self.path}; available: "
                f"{', '.join(self.metrics()) or 'none'}"
            )
        return metric

    def _resolve(self, device: str, within: Collection[str] | None = None) -> str:
        keys = self._columns if within is None else within
        if device in keys:
            return device
        if f"{device}/package" in keys:
            return f"{device}/package"
        raise ConfigError(
            f"unknown device {device!r} in {self.path}; available: {', '.join(keys) or 'none'}"
        )

    # -- data ----------------------------------------------------------------------------------

    def series(self, metric: str, device: str) -> Series:
        """The values of ``metric`` for ``device``.

        Raises:
            ConfigError: Unknown metric, or a device without values of it.
        """
        metric = self._check_metric(metric)
        key = self._resolve(device, self.devices(metric))
        column = self._columns[key][metric]
        return Series(metric, key, column.t.tolist(), column.v.tolist(), self.start_ns)

    def windows(self) -> list[Measurement]:
        """The :class:`~zeus_async.events.Measurement` events recorded, in file order."""
        return list(self._windows)

    def energy(
        self, device: str, t0_ns: int | None = None, t1_ns: int | None = None
    ) -> EnergyEstimate:
        """Energy of a GPU or RAPL domain over ``[t0_ns, t1_ns]``, and how it was obtained.

        Computed by :class:`~zeus_async.aggregate.history.DeviceHistory` (the estimator of the
        measurement windows): energy counter with interpolation inside counter periods where it
        covers the interval, power at the ends where it covers part of it
        (``counter+extrapolated``), integrated power samples for GPUs without a counter
        (``integrated``). ``None`` bounds are the device's first and last sample (with power
        or energy); with both ``None`` this is the device's total, the same figure, to the
        last bit, as ``monitor``/``replay`` give for the same samples (``docs/energy-methods.md``).

        An interval that reaches past the device's samples on either side (the recording's
        own ``[start_ns, end_ns]``, a window cut by a crash) is **clamped** to them: the energy
        is that of the part with samples, and the method says so (``counter+interpolated,
        clamped``). Energy where there are no samples is unknown, never extrapolated.

        Raises:
            ConfigError: Not a GPU or RAPL device of this recording, ``t1_ns < t0_ns``, or an
                interval entirely outside the device's samples.
        """
        key = self._resolve(device, self._histories)
        if t0_ns is None and t1_ns is None:
            return self._histories[key].span_energy()
        first, last = self._spans[key]
        t0 = first if t0_ns is None else t0_ns
        t1 = last if t1_ns is None else t1_ns
        if t1 < t0:
            raise ConfigError(f"interval ends before it starts: [{t0}, {t1}]")
        if t1 < first or t0 > last or (t0 == t1 and not first <= t0 <= last):
            raise ConfigError(
                f"interval [{t0}, {t1}] lies outside the samples of {key} "
                f"([{first}, {last}], {(last - first) / 1e9:.3f} s): energy there is unknown"
            )
        if t0 >= first and t1 <= last:
            return self._histories[key].energy(t0, t1)
        estimate = self._histories[key].energy(max(t0, first), min(t1, last))
        return EnergyEstimate(estimate.energy_j, f"{estimate.method}, clamped")

    def totals(self) -> Totals:
        """Energy, mean power and duration of every GPU and RAPL domain over its span in the
        recording, and the experiment's GPU, CPU (``package``), DRAM and overall sums."""
        devices: dict[str, DeviceTotal] = {}
        for key in self._histories:
            first, last = self._spans[key]
            estimate = self.energy(key)
            duration = (last - first) / 1e9
            mean = (
                estimate.energy_j / duration
                if estimate.energy_j is not None and duration > 0
                else None
            )
            devices[key] = DeviceTotal(
                key, estimate.energy_j, estimate.method, first, last, duration, mean
            )

        def domain_sum(domain: str) -> float | None:
            parts = [
                d.energy_j
                for k, d in devices.items()
                if k.startswith("cpu:") and k.split("@")[0].endswith(f"/{domain}")
            ]
            return sum(p for p in parts if p is not None) if parts else None

        gpu = sum(
            d.energy_j
            for k, d in devices.items()
            if k.startswith("gpu:") and d.energy_j is not None
        )
        cpu, dram = domain_sum("package"), domain_sum("dram")
        processes = self._process_totals()

        def process_sum(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return sum(known) if known else None

        return Totals(
            devices=devices,
            gpu_energy_j=gpu,
            cpu_energy_j=cpu,
            dram_energy_j=dram,
            total_energy_j=gpu + (cpu or 0.0) + (dram or 0.0),
            duration_s=self.duration_s,
            processes=processes,
            process_cpu_energy_j=process_sum([p.cpu_energy_j for p in processes.values()]),
            process_dram_energy_j=process_sum([p.dram_energy_j for p in processes.values()]),
            process_gpu_energy_j=process_sum(
                [e for p in processes.values() for e in p.gpu_energy_j.values()]
            ),
        )

    def _counter_span(self, key: str, metric: str) -> tuple[float, int, int] | None:
        """(last - first value, first t, last t) of a running-total column, if any."""
        column = self._columns.get(key, {}).get(metric)
        if column is None or not len(column.t):
            return None
        return column.v[-1] - column.v[0], column.t[0], column.t[-1]

    def _process_totals(self) -> dict[str, ProcessTotal]:
        found: dict[str, dict[str, Any]] = {}
        for key in self._columns:
            if not key.startswith("proc:"):
                continue
            base, _, host = key.partition("@")
            pid_part, _, gpu_part = base.partition("/")
            pid = pid_part.removeprefix("proc:") + (f"@{host}" if host else "")
            entry = found.setdefault(
                pid, {"cpu": None, "dram": None, "gpu": {}, "t0": None, "t1": None}
            )
            spans = []
            if gpu_part:
                got = self._counter_span(key, "proc.attributed_energy_j")
                if got is not None:
                    entry["gpu"][int(gpu_part.removeprefix("gpu:"))] = got[0]
                    spans.append(got)
            else:
                for metric, slot in (("proc.cpu_energy_j", "cpu"), ("proc.dram_energy_j", "dram")):
                    got = self._counter_span(key, metric)
                    if got is not None:
                        entry[slot] = got[0]
                        spans.append(got)
            for column in self._columns[key].values():
                if len(column.t):
                    spans.append((0.0, column.t[0], column.t[-1]))
            for _, t0, t1 in spans:
                entry["t0"] = t0 if entry["t0"] is None else min(entry["t0"], t0)
                entry["t1"] = t1 if entry["t1"] is None else max(entry["t1"], t1)
        out: dict[str, ProcessTotal] = {}
        for pid, e in found.items():
            if e["t0"] is None:
                continue
            out[pid] = ProcessTotal(
                pid,
                e["cpu"],
                e["dram"],
                dict(sorted(e["gpu"].items())),
                e["t0"],
                e["t1"],
                (e["t1"] - e["t0"]) / 1e9,
            )
        return out

    def total(self, metric: str, device: str | None = None) -> float:
        """Joules of an energy or power metric over the whole recording, summed over devices.

        * ``*energy_j`` metrics (``gpu.energy_j``, ``rapl.energy_j``): the :meth:`energy` of
          each device over its span (counter-based). GPUs without the counter (pre-Volta) have
          no ``gpu.energy_j`` and are not included; :meth:`totals` includes them.
        * ``*power_w`` metrics (``gpu.power_w``, ``gpu.avg_power_w``, ``rapl.power_w``,
          ``proc.attributed_power_w``): the power samples of each device integrated over time
          (trapezoid rule, by :class:`DeviceHistory`) from its first to its last value of that
          metric.

        Args:
            metric: The metric.
            device: One device; by default every device with values of ``metric`` — for
                ``rapl.*`` metrics only the ``package`` and ``dram`` domains, which do not
                overlap (``core``/``uncore`` lie inside ``package``, ``psys`` contains it).

        Raises:
            ConfigError: Unknown metric or device, or a metric that is neither energy nor power.
        """
        metric = self._check_metric(metric)
        if not (_energy_field(metric) or _power_field(metric)):
            raise ConfigError(
                f"total() needs an energy (*energy_j) or power (*power_w) metric, not "
                f"{metric!r}; use series() for the values"
            )
        with_metric = self.devices(metric)
        if device is not None:
            keys = [self._resolve(device, with_metric)]
        elif metric.startswith("rapl."):
            keys = [k for k in with_metric if k.split("@")[0].endswith(("/package", "/dram"))]
            if not keys:
                raise ConfigError(
                    f"no package or dram domain has {metric!r}; pass one device of: "
                    f"{', '.join(with_metric)}"
                )
        else:
            keys = with_metric
        joules = 0.0
        for key in keys:
            if _energy_field(metric) and key in self._histories:
                estimate = self.energy(key)
            else:
                estimate = self._integrate(key, metric)
            if estimate.energy_j is not None:
                joules += estimate.energy_j
        return joules

    def _integrate(self, key: str, metric: str) -> EnergyEstimate:
        """A series through a fresh :class:`DeviceHistory`: power integrated, or a counter."""
        column = self._columns[key][metric]
        history = DeviceHistory(f"{key} {metric}", fine_counter=True)
        counter = _energy_field(metric)
        for t, v in zip(column.t, column.v, strict=True):
            history.add(t, None if counter else v, v if counter else None)
        return history.energy(column.t[0], column.t[-1])


# -- export ------------------------------------------------------------------------------------


def _events(reader: RecordingReader, kinds: str | Collection[str] | None) -> Iterator[Event]:
    """The reader's events of ``kinds``; an unknown kind raises here, before any output."""
    wanted = [kinds] if isinstance(kinds, str) else kinds
    events = reader.events(kinds=wanted)
    first = next(events, None)  # the reader validates the kinds on the first step
    return events if first is None else itertools.chain((first,), events)


@contextmanager
def _open_out(path_out: _PathLike, path_in: _PathLike) -> Iterator[IO[bytes]]:
    if os.fspath(path_out) == "-":
        stream = sys.stdout.buffer
        try:
            yield stream
        finally:
            stream.flush()
    else:
        from .outputs import claim_output

        # Never the recording being read (or one of its parts): truncating it while it is read.
        claim_output(path_out, inputs=[path_in], overwrite=True, what="export")
        with Path(path_out).open("wb") as f:
            yield f


def export_jsonl(
    path_in: _PathLike,
    path_out: _PathLike,
    *,
    kinds: str | Collection[str] | None = None,
    progress: Progress | None = None,
) -> int:
    """Write the events of a recording as JSON lines, as ``zeus-async subscribe --json`` does.

    Streams the file (constant memory). Each line is
    ``event_to_json(event)`` (compact JSON of :func:`event_to_dict`).

    Args:
        path_in: The recording.
        path_out: Output file (truncated; never the recording or one of its parts: that is
            a ``ConfigError``), or ``"-"`` for standard output.
        kinds: Export only these event tags (``"gpu"``, ``"measurement"``, ...).
        progress: ``progress(done_bytes, total_bytes)`` over the input file.

    Returns:
        The number of events written.

    Raises:
        ConfigError: An unknown kind.
    """
    reader = RecordingReader(path_in)
    events = _events(reader, kinds)
    ticker = ProgressTicker(reader, progress)
    written = 0
    with _open_out(path_out, path_in) as out:
        for event in events:
            out.write(event_to_json(event) + b"\n")
            written += 1
            ticker.tick()
    ticker.finish()
    reader.report.warn(path_in, "exported")
    logger.info("exported %d events of %s to %s (JSON lines)", written, path_in, path_out)
    return written


#: Columns every CSV row fills: the event tag, host, time and :func:`event_device`.
CSV_FIXED: Final = ("kind", "host", "t_ns", "device")


def csv_columns(kinds: Iterable[str] | None = None) -> list[str]:
    """The CSV header for events of ``kinds`` (all by default).

    After :data:`CSV_FIXED`, the fields of each kind in schema order (:data:`~zeus_async.events.
    EVENT_TYPES` order, then field order), each name once: fields of the same name share a
    column. A field named ``kind`` becomes ``<tag>_kind`` (``fault_kind``); the ``device``
    field of faults is the ``device`` column.
    """
    wanted = None if kinds is None else set(kinds)
    columns = list(CSV_FIXED)
    for cls in EVENT_TYPES:
        tag = str(cls.__struct_config__.tag)
        if wanted is not None and tag not in wanted:
            continue
        for name in cls.__struct_fields__:
            column = _csv_column(tag, name)
            if column is not None and column not in columns:
                columns.append(column)
    return columns


def _csv_column(tag: str, name: str) -> str | None:
    if name in ("host", "t_ns", "device"):
        return None  # fixed columns (a fault's device is its event_device)
    return f"{tag}_{name}" if name == "kind" else name


_SCALARS: Final = (bool, int, float, str, type(None))


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def export_csv(
    path_in: _PathLike,
    path_out: _PathLike,
    *,
    kinds: str | Collection[str] | None = None,
    progress: Progress | None = None,
) -> int:
    """Write the events of a recording as one CSV table (streamed, constant memory).

    The header is :func:`csv_columns` of the exported kinds. A cell is empty for ``None``, an
    empty string, or a field the row's kind does not have; booleans are ``true``/``false``,
    floats are written so they read back exactly, and dicts and lists (measurement energies,
    stream devices) are JSON.

    Args:
        path_in: The recording.
        path_out: Output file (truncated; never the recording or one of its parts: that is
            a ``ConfigError``), or ``"-"`` for standard output.
        kinds: Export only these event tags (``"gpu"``, ``"rapl"``, ...).
        progress: ``progress(done_bytes, total_bytes)`` over the input file.

    Returns:
        The number of events (rows) written.

    Raises:
        ConfigError: An unknown kind.
    """
    reader = RecordingReader(path_in)
    wanted = [kinds] if isinstance(kinds, str) else kinds
    events = _events(reader, wanted)
    columns = csv_columns(wanted)
    index = {c: i for i, c in enumerate(columns)}
    layout: dict[type[Any], list[tuple[int, str]]] = {}
    for cls in EVENT_TYPES:
        tag = str(cls.__struct_config__.tag)
        layout[cls] = [
            (index[c], name)
            for name in cls.__struct_fields__
            if (c := _csv_column(tag, name)) is not None and c in index
        ]
    ticker = ProgressTicker(reader, progress)
    written = 0
    with _open_out(path_out, path_in) as out:
        text = io.TextIOWrapper(out, encoding="utf-8", newline="")
        try:
            writer = csv.writer(text, lineterminator="\n")
            writer.writerow(columns)
            for event in events:
                row = [""] * len(columns)
                row[0] = event_kind(event)
                row[1] = event.host
                row[2] = str(event.t_ns)
                row[3] = event_device(event) or ""
                builtins: dict[str, Any] | None = None
                for i, name in layout[type(event)]:
                    value = getattr(event, name)
                    if not isinstance(value, _SCALARS):
                        # Nested structs as named fields, the same form as the JSON export.
                        builtins = builtins or event_to_dict(event)
                        value = builtins[name]
                    row[i] = _csv_cell(value)
                writer.writerow(row)
                written += 1
                ticker.tick()
        finally:
            text.flush()
            text.detach()
    ticker.finish()
    reader.report.warn(path_in, "exported")
    logger.info("exported %d events of %s to %s (CSV)", written, path_in, path_out)
    return written
