"""Analysis of recordings: per-device series, energy over any interval, totals and export.

This is the offline counterpart of the live aggregation (the role of AIPowerMeter's
``ExpResults``): :class:`Recording` reads a recording once into arrays, one numpy array per
field of each sample kind (:mod:`zeus_async.store.columns`; :meth:`Recording.tables`,
:meth:`Recording.to_arrow`, :meth:`Recording.to_pandas`). Series are slices of them, and each
energy-measurable device gets, on first use, a
:class:`~zeus_async.aggregate.history.DeviceHistory` built from them
(:meth:`~zeus_async.aggregate.history.DeviceHistory.from_arrays`: the same estimator the
measurement windows use, holding bit for bit what it holds when fed sample by sample), so
energy over any interval is what a window over that interval would have reported.

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
AIPowerMeter's field names are accepted too, in its units (:mod:`~zeus_async.store.
aipowermeter`: ``total("per_process_cpu_power")``, ``series("nvidia_draw_absolute")``, percent
where it gives percent), and ``print(recording)`` lists them grouped as it does.

Progress
--------

Loading and the exporters take ``progress(done_bytes, total_bytes)``: bytes of the file read so
far and the file size. It is called about every 64k events (:data:`PROGRESS_EVERY`), and once
more with ``done_bytes == total_bytes`` when the pass ends.
"""

from __future__ import annotations

import csv
import datetime
import io
import itertools
import json
import logging
import os
import sys
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from ..aggregate.history import DeviceHistory, EnergyEstimate
from ..aggregate.live import device_order
from ..errors import ConfigError
from ..events import (
    EVENT_TYPES,
    DeviceInfo,
    Event,
    Measurement,
    RequestIdle,
    RequestMeasurement,
    StreamInfo,
    event_kind,
    event_to_dict,
    event_to_json,
)
from . import aipowermeter as aipm
from .columns import (
    LAYOUTS,
    SAMPLE_TYPES,
    TYPES_BY_TAG,
    ColumnarLoad,
    SampleTable,
    load_columns,
    nullable_int_fields,
    to_arrow,
)
from .format import RecordingHeader
from .progress import PROGRESS_EVERY, Progress, ProgressTicker
from .reader import PartOf, RecordingReader, RecoveryReport, event_device

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

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


# Event type -> (kind, ((field, metric), ...)) for the event kinds that form series: every
# int/float (optionally ``None``) field that does not identify the device, in schema order.
_SPECS: Final[dict[type[Any], tuple[str, tuple[tuple[str, str], ...]]]] = {
    cls: (
        tag,
        tuple(
            (f, f"{tag}.{f}")
            for f, storage in LAYOUTS[tag]
            if storage != "cat" and f not in _ID_FIELDS
        ),
    )
    for cls, tag in SAMPLE_TYPES.items()
}


#: Sample kind tag to its event type.
_KIND_TYPES: Final = {tag: cls for cls, (tag, _) in _SPECS.items()}

_MISSING_PANDAS = "DataFrames need pandas and pyarrow: pip install 'zeus_async[arrow]'"


#: AIPowerMeter's field names and the metric each reads (:mod:`zeus_async.store.aipowermeter`
#: has their units and scopes), accepted wherever a metric is (``total("per_process_cpu_power")``).
AIPOWERMETER_METRICS: Final = {name: f.metric for name, f in aipm.FIELDS.items()}


@dataclass(frozen=True, eq=False)
class Series:
    """Values of one metric of one device, in file order (time order for one recorder).

    Series compare by identity (their arrays have no single truth value); compare
    ``t_ns``/``values`` with ``numpy.array_equal``.

    Attributes:
        metric: ``"<kind>.<field>"``.
        device: Device key.
        t_ns: Time of each value (wall-clock ns), an ``int64`` array.
        values: The values, a ``float64`` array (samples where the field was ``None`` are left
            out).
        start_ns: Start of the recording, the origin of :meth:`seconds`.
    """

    metric: str
    device: str
    t_ns: npt.NDArray[np.int64]
    values: npt.NDArray[np.float64]
    start_ns: int

    def seconds(self) -> npt.NDArray[np.float64]:
        """Time of each value in seconds since the start of the recording."""
        return (self.t_ns - self.start_ns) / 1e9

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
class _Device:
    """Where a device's rows are: its table and device code."""

    table: SampleTable
    code: int
    rows: npt.NDArray[np.intp] | None = None

    def take(self) -> npt.NDArray[np.intp]:
        if self.rows is None:
            self.rows = self.table.rows(self.code)
        return self.rows


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
        part_of: Given a later part of a rotated recording (``run.3.zarc``), which part of
            which recording it is (:class:`~zeus_async.store.reader.PartOf`): its figures are
            that part's only. ``None`` otherwise.
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
        self.part_of: PartOf | None = reader.part_of
        loaded = load_columns(reader, progress)
        self.report: RecoveryReport = reader.report
        self._tables = loaded.tables
        self._others = loaded.others
        self._kinds = loaded.counts
        self._windows = [e for e in loaded.others if isinstance(e, Measurement)]
        self._requests = [e for e in loaded.others if isinstance(e, RequestMeasurement)]
        self._request_idle = [e for e in loaded.others if isinstance(e, RequestIdle)]
        self._streams: dict[str, StreamInfo] = {}
        for event in loaded.others:
            if isinstance(event, StreamInfo):
                # Every stream's own description (a stream that joined a recording after its
                # header was written is only here); the first one of each stream is kept.
                self._streams.setdefault(event.stream_id, event)
        self._hosts = list(
            dict.fromkeys([info.host for info in self._streams.values()] + loaded.hosts)
        )
        self._several_hosts = len(self._hosts) > 1
        where = [
            (key, _Device(table, code))
            for table in loaded.tables.values()
            for code, key in enumerate(table.devices)
        ]
        self._where: dict[str, _Device] = dict(sorted(where, key=lambda kv: device_order(kv[0])))
        self._present: dict[str, list[str]] = {}
        self._histories: dict[str, DeviceHistory] = {}
        self._history_keys = [k for k in self._where if self._has_history(k)]
        stamps = [int(t.columns["t_ns"].min()) for t in loaded.tables.values()]
        stamps += [int(t.columns["t_ns"].max()) for t in loaded.tables.values()]
        stamps += [e.t_ns for e in loaded.others]
        self.start_ns: int = min(stamps) if stamps else self.header.start_wall_ns
        self.end_ns: int = max(stamps) if stamps else self.start_ns
        self.report.warn(self.path, "analyzed")
        logger.info(
            "loaded %s: %d events, %d devices, %.3f s%s",
            self.path,
            self.report.events_ok,
            len(self._where),
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

    def get_duration(self) -> tuple[float, datetime.datetime, datetime.datetime]:
        """``(seconds, start, end)`` of the recording, start and end as UTC datetimes (the
        form of AIPowerMeter's ``get_duration()``)."""
        utc = datetime.timezone.utc

        def when(t_ns: int) -> datetime.datetime:
            return datetime.datetime.fromtimestamp(t_ns // 10**9, utc) + datetime.timedelta(
                microseconds=(t_ns % 10**9) // 1000
            )

        return self.duration_s, when(self.start_ns), when(self.end_ns)

    def __str__(self) -> str:
        """What the recording holds: duration with start and end, which part of which
        recording it is when it is a later part of a rotated one read alone, devices, then the
        metrics available, AIPowerMeter's names grouped as it groups them (CPU, GPU,
        Experiments)."""
        seconds, start, end = self.get_duration()
        lines = [
            f"Recording {self.path}: {seconds:.3f} s, "
            f"{start.isoformat(timespec='milliseconds')} to "
            f"{end.isoformat(timespec='milliseconds')}",
            *([f"This file is {self.part_of}"] if self.part_of is not None else []),
            f"Hosts: {', '.join(self.hosts) or '-'}",
            f"Devices: {', '.join(self.devices()) or '-'}",
            "Available metrics :",
        ]
        names = self.aipowermeter_metrics()
        for group in aipm.GROUPS:
            lines.append(group)
            lines.append(
                "  " + (",".join(n for n in names if aipm.FIELDS[n].group == group) or "-")
            )
        lines.append("zeus_async")
        lines.append("  " + (",".join(self.metrics()) or "-"))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Recording {self.path} {self.duration_s:.3f} s, {len(self._where)} devices>"

    # -- arrays --------------------------------------------------------------------------------

    def _column(self, key: str, name: str) -> npt.NDArray[Any]:
        """Field ``name`` of every row of device ``key`` (NaN where it was ``None``)."""
        where = self._where[key]
        return where.table.columns[name][where.take()]

    def _values(
        self, key: str, metric: str
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        """Times and values of ``metric`` for ``key``, samples without a value left out."""
        name = metric.rpartition(".")[2]
        t, v = self._column(key, "t_ns"), self._column(key, name).astype(np.float64, copy=False)
        known = ~np.isnan(v)
        return (t, v) if known.all() else (t[known], v[known])

    def _running(
        self, key: str, metric: str
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        """:meth:`_values` of the samples a total takes: each later than every earlier sample
        of the device, as the estimator takes them (:meth:`DeviceHistory.add`). A duplicate
        or a sample delivered out of order (late) is left out, so it can neither add energy
        nor move a span's end back."""
        t = self._column(key, "t_ns")
        keep = np.ones(len(t), dtype=bool)
        if len(t) > 1:
            keep[1:] = t[1:] > np.maximum.accumulate(t)[:-1]
        name = metric.rpartition(".")[2]
        v = self._column(key, name).astype(np.float64, copy=False)
        keep &= ~np.isnan(v)
        return (t, v) if keep.all() else (t[keep], v[keep])

    def _metrics_of(self, key: str) -> list[str]:
        """Metrics with at least one value for ``key``, in schema order."""
        present = self._present.get(key)
        if present is None:
            where = self._where[key]
            kind = where.table.kind
            present = self._present[key] = [
                metric
                for name, metric in _SPECS[_KIND_TYPES[kind]][1]
                if where.table.present(name)[where.code]
            ]
        return present

    def _has_history(self, key: str) -> bool:
        kind = self._where[key].table.kind
        if kind == "rapl":
            return True
        return kind == "gpu" and bool({"gpu.power_w", "gpu.energy_j"} & set(self._metrics_of(key)))

    def _history(self, key: str) -> DeviceHistory:
        """The estimator of a GPU or RAPL domain, fed every sample of the device (built once,
        on first use, from the arrays: :meth:`DeviceHistory.from_arrays`)."""
        history = self._histories.get(key)
        if history is None:
            t = self._column(key, "t_ns")
            if self._where[key].table.kind == "gpu":
                history = DeviceHistory.from_arrays(
                    key, t, self._column(key, "power_w"), self._column(key, "energy_j")
                )
            else:
                history = DeviceHistory.from_arrays(
                    key, t, None, self._column(key, "energy_j"), fine_counter=True
                )
            self._histories[key] = history
        return history

    def _span(self, key: str) -> tuple[int, int]:
        """First and last sample of a device: of those its estimator took (not a duplicate or
        an out-of-order one, nor one with neither power nor energy) when it has one, the span
        of its monitor/replay total; else of all its samples."""
        if key in self._history_keys:
            history = self._history(key)
            if history.first_t_ns is not None:
                assert history.last_t_ns is not None
                return history.first_t_ns, history.last_t_ns
        t = self._column(key, "t_ns")
        return int(t.min()), int(t.max())

    def tables(self) -> dict[str, SampleTable]:
        """The samples as arrays, one :class:`~zeus_async.store.columns.SampleTable` per kind
        (``"gpu"``, ``"rapl"``, ``"proc"``): one numpy array per field (see
        :mod:`zeus_async.store.columns`). They are the recording's own arrays: do not modify."""
        return dict(self._tables)

    def to_arrow(self) -> dict[str, pa.Table]:
        """Every event kind of the recording as an Arrow table, by tag (``"gpu"``,
        ``"rapl"``, ``"proc"``, ``"measurement"``, ...): typed columns, a ``time`` column (UTC
        timestamp), ``host``/``device`` dictionary-encoded, nulls where an event had ``None``
        (:func:`~zeus_async.store.columns.to_arrow`).

        Raises:
            ConfigError: pyarrow is not installed (``pip install 'zeus_async[arrow]'``).
        """
        return to_arrow(ColumnarLoad(self._tables, self._others, self._hosts, self._kinds))

    def to_pandas(self) -> dict[str, pd.DataFrame]:
        """:meth:`to_arrow` as pandas DataFrames (``host``/``device``/``domain`` categorical,
        ``time`` a ``datetime64[ns, UTC]`` column, optional integers as nullable ``Int64``).

        Raises:
            ConfigError: pyarrow or pandas is not installed.
        """
        try:
            import pandas as pd
        except ImportError as exc:
            raise ConfigError(_MISSING_PANDAS) from exc
        import pyarrow

        as_int64 = {pyarrow.int64(): pd.Int64Dtype()}.get
        frames: dict[str, pd.DataFrame] = {}
        for kind, table in self.to_arrow().items():
            frame = table.to_pandas()
            for name in nullable_int_fields(TYPES_BY_TAG[kind]):
                frame[name] = table.column(name).to_pandas(types_mapper=as_int64)
            frames[kind] = frame
        return frames

    # -- names ---------------------------------------------------------------------------------

    def devices(self, metric: str | None = None) -> list[str]:
        """Device keys with data (GPUs, then RAPL domains, then processes), optionally only
        those with values of ``metric``."""
        if metric is None:
            return list(self._where)
        field = aipm.FIELDS.get(metric)
        if field is not None:
            keys = self._aipm_devices(field)
            return list(self._per_gpu(keys)) if field.scope == "per-gpu" else keys
        metric = self._check_metric(metric)
        return [d for d in self._where if metric in self._metrics_of(d)]

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
            present = {m for key in self._where for m in self._metrics_of(key)}
        else:
            present = set(self._metrics_of(self._resolve(device)))
        return [m for _, fields in _SPECS.values() for _, m in fields if m in present]

    def aipowermeter_metrics(self) -> list[str]:
        """AIPowerMeter's names with data in this recording (:mod:`~zeus_async.store.
        aipowermeter`), in its order."""
        return [name for name, f in aipm.FIELDS.items() if self._aipm_devices(f, strict=False)]

    def _rapl_domains(self, device: str) -> list[str]:
        """The RAPL domains of the package (and host) of a ``cpu:P/domain`` key."""
        base, _, host = device.partition("@")
        package = base.rpartition("/")[0]
        return [
            k.split("@")[0].rpartition("/")[2]
            for k in self._where
            if k.split("@")[0].startswith(package + "/") and k.partition("@")[2] == host
        ]

    def _aipm_devices(self, field: aipm.AipmField, *, strict: bool = True) -> list[str]:
        """The devices with values of ``field``'s metric that it covers."""
        if field.metric not in self.metrics():
            if not strict:
                return []
            raise ConfigError(
                f"{field.name!r} ({field.description}) reads {field.metric}, which "
                f"{self.path} does not hold" + aipm.why_absent(field.metric, self.metrics())
            )
        keys = [k for k in self.devices(field.metric) if aipm.covers(field, k, self._rapl_domains)]
        if strict and not keys:
            raise ConfigError(
                f"{field.name!r} ({field.description}) covers no device of {self.path}"
            )
        return keys

    def _aipm_series(self, field: aipm.AipmField, device: str | None) -> Series:
        keys = self._aipm_devices(field)
        if field.scope == "all":
            if device not in (None, "all"):
                raise ConfigError(
                    f"{field.name!r} is one series over every device it covers; "
                    f"call series({field.name!r}) without a device"
                )
            t, v = aipm.combine(self._aipm_parts(field, keys))
            if not len(t):
                raise ConfigError(
                    f"{field.name!r} sums {', '.join(keys)}, which have no instant where "
                    f"every one has a reading; read them one by one"
                )
            return Series(field.name, "all", t, v * field.scale, self.start_ns)
        if field.scope == "per-gpu":
            groups = self._per_gpu(keys)
            key = self._pick(field.name, device, list(groups))
            t, v = aipm.combine(self._aipm_parts(field, groups[key]))
            return Series(field.name, key, t, v * field.scale, self.start_ns)
        key = self._pick(field.name, device, keys)
        t, v = self._values(key, field.metric)
        return Series(field.name, key, t, v * field.scale, self.start_ns)

    def _aipm_parts(
        self, field: aipm.AipmField, keys: list[str]
    ) -> list[tuple[str, npt.NDArray[np.int64], npt.NDArray[np.float64]]]:
        """``(source, t_ns, values)`` of each key, for :func:`~.aipowermeter.combine`."""
        return [(aipm.source_of(field, k), *self._values(k, field.metric)) for k in keys]

    @staticmethod
    def _per_gpu(keys: list[str]) -> dict[str, list[str]]:
        """``proc:P/gpu:N[@host]`` keys grouped by their ``gpu:N[@host]``."""
        groups: dict[str, list[str]] = {}
        for k in keys:
            base, _, host = k.partition("@")
            gpu = base.partition("/")[2] + (f"@{host}" if host else "")
            groups.setdefault(gpu, []).append(k)
        return groups

    def _pick(self, name: str, device: str | None, keys: list[str]) -> str:
        if device is None:
            if len(keys) == 1:
                return keys[0]
            raise ConfigError(f"{name!r} has a series per device; pass one of: {', '.join(keys)}")
        return self._resolve(device, keys)

    def _check_metric(self, metric: str) -> str:
        """``metric`` (an AIPowerMeter name mapped to ours) if present, else ConfigError."""
        metric = AIPOWERMETER_METRICS.get(metric, metric)
        if metric not in self.metrics():
            raise ConfigError(
                f"unknown metric {metric!r} in {self.path}"
                f"{aipm.why_absent(metric, self.metrics())}; available: "
                f"{', '.join(self.metrics()) or 'none'}"
            )
        return metric

    def _resolve(self, device: str, within: Collection[str] | None = None) -> str:
        keys = self._where if within is None else within
        if device in keys:
            return device
        if f"{device}/package" in keys:
            return f"{device}/package"
        raise ConfigError(
            f"unknown device {device!r} in {self.path}; available: {', '.join(keys) or 'none'}"
        )

    # -- data ----------------------------------------------------------------------------------

    def series(self, metric: str, device: str | None = None) -> Series:
        """The values of ``metric`` for ``device``.

        ``metric`` may be one of AIPowerMeter's names (:mod:`~zeus_async.store.aipowermeter`):
        its values are then in AIPowerMeter's units (percent where it gives percent), and an
        experiment-wide name (``nvidia_draw_absolute``, ``intel_power``) is one series over
        every device it covers, with ``device`` ``"all"``, with points only where every one of
        those devices has a reading (:func:`~zeus_async.store.aipowermeter.combine`).

        Args:
            metric: The metric.
            device: The device; may be left out when only one device has the metric.

        Raises:
            ConfigError: Unknown metric, a device without values of it, or an experiment-wide
                name whose devices have no instant in common.
        """
        field = aipm.FIELDS.get(metric)
        if field is not None:
            return self._aipm_series(field, device)
        metric = self._check_metric(metric)
        if device is None:
            device = self._pick(metric, None, self.devices(metric))
        key = self._resolve(device, self.devices(metric))
        t, v = self._values(key, metric)
        return Series(metric, key, t, v, self.start_ns)

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
        key = self._resolve(device, self._history_keys)
        if t0_ns is None and t1_ns is None:
            return self._history(key).span_energy()
        first, last = self._span(key)
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
            return self._history(key).energy(t0, t1)
        estimate = self._history(key).energy(max(t0, first), min(t1, last))
        return EnergyEstimate(estimate.energy_j, f"{estimate.method}, clamped")

    def totals(self) -> Totals:
        """Energy, mean power and duration of every GPU and RAPL domain over its span in the
        recording, and the experiment's GPU, CPU (``package``), DRAM and overall sums."""
        devices: dict[str, DeviceTotal] = {}
        for key in self._history_keys:
            first, last = self._span(key)
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
        if metric not in self._metrics_of(key):
            return None
        t, v = self._running(key, metric)
        if not len(t):
            return None
        return float(v[-1] - v[0]), int(t[0]), int(t[-1])

    def _process_totals(self) -> dict[str, ProcessTotal]:
        found: dict[str, dict[str, Any]] = {}
        for key in self._where:
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
            for metric in self._metrics_of(key):
                t, _ = self._running(key, metric)
                if len(t):
                    spans.append((0.0, int(t[0]), int(t[-1])))
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
        field = aipm.FIELDS.get(metric)
        if field is not None:
            return self._aipm_total(field, device)
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
            if _energy_field(metric) and key in self._history_keys:
                estimate = self.energy(key)
            else:
                estimate = self._integrate(key, metric)
            if estimate.energy_j is not None:
                joules += estimate.energy_j
        return joules

    def _aipm_total(self, field: aipm.AipmField, device: str | None) -> float:
        """Joules of an AIPowerMeter power name: each covered RAPL domain from its counter,
        other devices' power integrated, summed."""
        if field.unit != "W":
            raise ConfigError(
                f"total() needs a power name; {field.name!r} is in {field.unit} "
                f"({field.description}): use series()"
            )
        keys = self._aipm_devices(field)
        if device is not None and device != "all":
            if field.scope == "all":
                raise ConfigError(f"{field.name!r} covers every device; call it without one")
            if field.scope == "per-gpu":
                groups = self._per_gpu(keys)
                keys = groups[self._resolve(device, groups)]
            else:
                keys = [self._resolve(device, keys)]
        joules = 0.0
        for key in keys:
            if key.startswith("cpu:"):
                estimate = self.energy(key)
            else:
                estimate = self._integrate(key, field.metric)
            if estimate.energy_j is not None:
                joules += estimate.energy_j
        return joules

    def _integrate(self, key: str, metric: str) -> EnergyEstimate:
        """A series through a fresh :class:`DeviceHistory`: power integrated, or a counter."""
        t, v = self._running(key, metric)
        counter = _energy_field(metric)
        history = DeviceHistory.from_arrays(
            f"{key} {metric}", t, None if counter else v, v if counter else None, fine_counter=True
        )
        return history.energy(int(t[0]), int(t[-1]))


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
