"""The load pass of a recording: its samples as arrays, per device, with their estimators.

:class:`_Loaded` is the base of :class:`~zeus_async.store.analysis.Recording`: it reads the file
once into one numpy array per field of each sample kind (:mod:`zeus_async.store.columns`),
keeps the other events (windows, requests, stream descriptions), finds each device's rows
and builds, on first use, the :class:`~zeus_async.aggregate.history.DeviceHistory` of every
GPU and RAPL domain. :data:`_SPECS` says which field of each sample kind is a metric.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from ...aggregate.history import DeviceHistory, reads_exact
from ...aggregate.live import device_order
from ...errors import ConfigError
from ...events import DeviceInfo, Measurement, RequestIdle, RequestMeasurement, StreamInfo
from ..columns import (
    LAYOUTS,
    SAMPLE_TYPES,
    TYPES_BY_TAG,
    ColumnarLoad,
    SampleTable,
    load_columns,
    nullable_int_fields,
    to_arrow,
)
from ..format import RecordingHeader
from ..progress import Progress
from ..reader import PartOf, RecordingReader, RecoveryReport

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

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


class _Loaded:
    """A recording read into arrays (see :mod:`.loading`); :class:`.Recording` documents the
    arguments and the attributes."""

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
                info = self.device_info().get(key)  # how its power readings lag (issue 37)
                energy = self._column(key, "energy_j")
                period = info.energy_counter_period_s if info else 0.0
                history = DeviceHistory.from_arrays(
                    key,
                    t,
                    self._column(key, "power_w"),
                    energy,
                    fine_counter=reads_exact(period, t, energy),
                    reading_lag_s=info.power_reading_lag_s if info else 0.0,
                    reading_window_s=info.power_reading_window_s if info else 0.0,
                )
                history.set_counter_period(period)
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

    # -- events --------------------------------------------------------------------------------

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

    def windows(self) -> list[Measurement]:
        """The :class:`~zeus_async.events.Measurement` events recorded, in file order."""
        return list(self._windows)
