"""Recordings as arrays: the sample events of a recording as typed columns (numpy), and their
Arrow, pandas and Parquet forms.

A recording's samples (:class:`~zeus_async.events.GpuSample`, ``RaplSample``,
``ProcessSample``) are read frame by frame into one :class:`SampleTable` per event kind: one
numpy array per field of the event, in schema order, so a column holds exactly the values the
struct reader gives for that field:

* ``t_ns`` and the non-optional integers (``gpu`` of a GPU sample, ``package``, ``pid``):
  ``int64``;
* every optional number (``power_w``, ``energy_j``, ``memory_used_bytes``, the ``gpu`` of a
  process sample, ...): ``float64``, **NaN where the event has** ``None`` (integers up to
  2**53 are exact in a float64: byte counts, clocks);
* strings (``host``, a RAPL ``domain``): ``int32`` codes into the table's categories.

Each row also has a ``device`` code: the device key analysis uses (``gpu:0``,
``cpu:0/package``, ``proc:42/gpu:0``, with ``@host`` when the recording holds several hosts).

:class:`~zeus_async.store.Recording` is built on these tables (its series, energies and totals
read the arrays; its energy estimator is fed from them by
:meth:`~zeus_async.aggregate.history.DeviceHistory.from_arrays`, bit for bit what the live
estimator holds), and :func:`to_arrow` / :func:`export_parquet` turn them into Arrow tables
and Parquet files: typed columns, ``host``/``device``/``domain`` as dictionary (pandas
categorical) columns, a ``time`` column (UTC timestamp) beside ``t_ns``, nulls where the event
had ``None``. The other event kinds (measurements, window edges, faults, ...) become tables
too, one per kind, from their fields' types (nested dicts and lists as JSON text).

pyarrow and pandas are an optional extra (``pip install 'zeus_async[arrow]'``); numpy is a
dependency of the package.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import types
import typing
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
import numpy.typing as npt

from ..aggregate.live import device_order
from ..errors import ConfigError
from ..events import EVENT_TYPES, Event, GpuSample, ProcessSample, RaplSample, event_to_dict
from .columnar import ColumnarFrame, ColumnGroup
from .progress import Progress, ProgressTicker
from .reader import RecordingReader

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "SAMPLE_KINDS",
    "ColumnarLoad",
    "SampleTable",
    "event_table",
    "export_parquet",
    "load_columns",
    "sample_table_to_arrow",
    "to_arrow",
]

logger = logging.getLogger(__name__)

_PathLike = str | os.PathLike[str]

_MISSING_ARROW = (
    "Arrow, pandas and Parquet need pyarrow (and pandas for DataFrames): "
    "pip install 'zeus_async[arrow]'"
)

#: The event kinds read into arrays, by tag.
SAMPLE_KINDS: Final = ("gpu", "rapl", "proc")
#: The sample event types, and their tags.
SAMPLE_TYPES: Final[dict[type[Any], str]] = {
    GpuSample: "gpu",
    RaplSample: "rapl",
    ProcessSample: "proc",
}

# A column's storage: "int" (int64), "float" (float64, NaN for None), "cat" (int32 codes).
_Storage = Literal["int", "float", "cat"]


def _storage(hint: Any) -> _Storage:
    args = set(typing.get_args(hint) or (hint,))
    optional = type(None) in args
    args.discard(type(None))
    if typing.get_origin(hint) is Literal or args == {str}:
        return "cat"
    if args == {int} and not optional:
        return "int"
    if args and args <= {int, float}:
        return "float"
    raise TypeError(f"no column storage for {hint!r}")  # a new field type: extend here


def _layout(cls: type[Any]) -> tuple[tuple[str, _Storage], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((name, _storage(hints[name])) for name in cls.__struct_fields__)


#: Per sample kind: its fields in schema order and how each is stored.
LAYOUTS: Final[dict[str, tuple[tuple[str, _Storage], ...]]] = {
    tag: _layout(cls) for cls, tag in SAMPLE_TYPES.items()
}


def nullable_int_fields(cls: type[Any]) -> list[str]:
    """The optional integer fields of an event type (``int | None``): nullable ``Int64`` in
    pandas, where a plain int64 column would turn into floats."""
    hints = typing.get_type_hints(cls)
    return [n for n in cls.__struct_fields__ if set(typing.get_args(hints[n])) == {int, type(None)}]


#: The optional integer fields (stored as float64 with NaN), typed int64 again in Arrow.
_NULLABLE_INTS: Final = frozenset(
    (tag, name) for cls, tag in SAMPLE_TYPES.items() for name in nullable_int_fields(cls)
)


#: Fields that identify the device a sample is about (part of its device key).
ID_FIELDS: Final = {"gpu": ("gpu",), "rapl": ("package", "domain"), "proc": ("pid", "gpu")}


@dataclass
class SampleTable:
    """The samples of one kind, one array per field (see the module docstring).

    Attributes:
        kind: ``"gpu"``, ``"rapl"`` or ``"proc"``.
        columns: Field name to its array, in schema order (``host`` and ``domain`` as codes).
        categories: For each coded field, the strings its codes index.
        device: Device code of each row, indexing :attr:`devices`.
        devices: Device keys as analysis names them (``gpu:0``, or ``gpu:0@node1`` when the
            recording holds several hosts), in :func:`~zeus_async.aggregate.live.device_order`.
        keys: Each device's key without the host (the Arrow ``device`` column; ``host`` is a
            column of its own).
    """

    kind: str
    columns: dict[str, npt.NDArray[Any]]
    categories: dict[str, list[str]]
    device: npt.NDArray[np.int32]
    devices: list[str]
    keys: list[str]
    _rows: dict[int, npt.NDArray[np.intp]] | None = field(default=None, repr=False)
    _present: dict[str, npt.NDArray[np.bool_]] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.columns["t_ns"])

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return sum(a.nbytes for a in self.columns.values()) + self.device.nbytes

    def present(self, name: str) -> npt.NDArray[np.bool_]:
        """Per device code, whether field ``name`` has a value (not ``None``) in any row."""
        got = self._present.get(name)
        if got is None:
            column = self.columns[name]
            holes = np.isnan(column) if column.dtype.kind == "f" else None
            if holes is not None and holes.any():
                device = self.device[~holes]
                got = np.bincount(device, minlength=len(self.devices)) > 0
            else:  # every row has a value (the usual column): every device that has a row
                got = self._present.get("")  # (no field is named "")
                if got is None:
                    got = self._present[""] = (
                        np.bincount(self.device, minlength=len(self.devices)) > 0
                    )
            self._present[name] = got
        return got

    def rows(self, code: int) -> npt.NDArray[np.intp]:
        """Indices of the rows of device ``code``, in file order."""
        if self._rows is None:
            n = len(self.devices)
            if n <= 64:
                self._rows = {d: np.flatnonzero(self.device == d) for d in range(n)}
            else:
                order = np.argsort(self.device, kind="stable")
                cuts = np.searchsorted(self.device[order], np.arange(n + 1))
                self._rows = {d: order[cuts[d] : cuts[d + 1]] for d in range(n)}
        return self._rows[code]


class _Categories:
    """Strings to int32 codes, in order of first appearance."""

    __slots__ = ("index", "names")

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []

    def lut(self, names: list[str]) -> npt.NDArray[np.int32]:
        """Codes of ``names`` (a frame's dictionary), adding the new ones."""
        index = self.index
        for v in names:
            if v not in index:
                index[v] = len(self.names)
                self.names.append(v)
        return np.fromiter(map(index.__getitem__, names), dtype=np.int32, count=len(names))

    def codes(self, values: list[str]) -> npt.NDArray[np.int32]:
        index = self.index
        if not set(values) <= index.keys():
            for v in dict.fromkeys(values):  # new strings in order of first appearance
                if v not in index:
                    index[v] = len(self.names)
                    self.names.append(v)
        if len(index) == 1:
            return np.zeros(len(values), dtype=np.int32)
        return np.fromiter(map(index.__getitem__, values), dtype=np.int32, count=len(values))


_DTYPES: Final[dict[_Storage, type[Any]]] = {"int": np.int64, "float": np.float64, "cat": np.int32}


class _KindBuilder:
    """Accumulates one kind's columns frame by frame, each frame written into one array per
    field (sized from a capacity hint, grown as needed and trimmed at the end in place where
    the allocator can: ``ndarray.resize``), so a load holds the arrays and one frame, never
    the frames' pieces and their concatenation at once."""

    def __init__(self, kind: str, hosts: _Categories, capacity: int = 0) -> None:
        self.kind = kind
        self.layout = LAYOUTS[kind]
        self.cats: dict[str, _Categories] = {
            name: (hosts if name == "host" else _Categories())
            for name, storage in self.layout
            if storage == "cat"
        }
        self.getters = [operator.attrgetter(name) for name, _ in self.layout]
        # Device identities (see _ident) in order of first appearance, and each row's index
        # into them (self.device), computed frame by frame (a few distinct values per frame).
        self.idents: dict[tuple[int, ...], int] = {}
        self.count = 0
        # Growth past the capacity: by half again without a hint, by a sixteenth past one (a
        # hint misses only samples kept as records, or frames found past damage; numpy
        # zero-fills what it grows, so the margin is resident until trimmed).
        self.growth = 16 if capacity else 2
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        try:
            self.columns: dict[str, npt.NDArray[Any]] = {
                name: np.empty(capacity, dtype=_DTYPES[storage]) for name, storage in self.layout
            }
            self.device: npt.NDArray[np.int32] = np.empty(capacity, dtype=np.int32)
        except MemoryError:  # a hint no machine holds (a damaged file's directories): grow
            if not capacity:
                raise
            self._allocate(0)
            return
        self.capacity = capacity

    def _reserve(self, n: int) -> tuple[int, int]:
        """Room for ``n`` more rows; the slice they go to."""
        a = self.count
        b = a + n
        if b > self.capacity:
            capacity = max(b, self.capacity + self.capacity // self.growth, 4096)
            for array in (*self.columns.values(), self.device):
                array.resize(capacity, refcheck=False)  # realloc: no copy where it can
            self.capacity = capacity
        return a, b

    def add(self, group: list[Any]) -> None:
        n = len(group)
        a, b = self._reserve(n)
        frame: dict[str, npt.NDArray[Any]] = {}
        for (name, storage), getter in zip(self.layout, self.getters, strict=True):
            out = self.columns[name][a:b]
            if storage == "cat":
                out[:] = self.cats[name].codes(list(map(getter, group)))
            elif storage == "int":
                out[:] = np.fromiter(map(getter, group), dtype=np.int64, count=n)
            else:
                try:  # straight from the structs when the field has no None in this frame
                    out[:] = np.fromiter(map(getter, group), dtype=np.float64, count=n)
                except TypeError:
                    out[:] = np.array(list(map(getter, group)), dtype=np.float64)  # None: NaN
            frame[name] = out
        self._identify(frame, n, a)

    def add_columns(self, group: ColumnGroup) -> None:
        """A format-3 column group, its arrays written into the columns (no event objects)."""
        n = group.rows
        a, b = self._reserve(n)
        frame: dict[str, npt.NDArray[Any]] = {}
        for name, storage in self.layout:
            column = group.columns[name]
            values = column.values
            out = self.columns[name][a:b]
            if storage == "cat":
                assert column.dictionary is not None and values is not None
                lut = self.cats[name].lut(column.dictionary)
                if column.const:
                    out.fill(lut[int(values[0])])
                else:  # codes checked against the dictionary by the decoder
                    np.take(lut, values, out=out, mode="clip")
            elif values is None:
                out.fill(np.nan)
            else:
                if column.const:
                    out.fill(values[0])
                else:
                    out[:] = values
                if column.present is not None:
                    out[~column.present] = np.nan
            frame[name] = out
        if self.kind == "gpu" and group.columns["host"].const:
            gpu = frame["gpu"]
            lo, hi = int(gpu.min()), int(gpu.max())
            if lo >= 0 and hi < 65536:  # one host, a few GPUs: count them
                host = int(frame["host"][0])
                lut = np.empty(hi + 1, dtype=np.int32)
                for g in np.flatnonzero(np.bincount(gpu)).tolist():
                    lut[g] = self.idents.setdefault((host, g), len(self.idents))
                np.take(lut, gpu, out=self.device[a:b], mode="clip")
                self.count = b
                return
        self._identify(frame, n, a)

    def _identify(self, frame: dict[str, npt.NDArray[Any]], n: int, a: int) -> None:
        out = self.device[a : a + n]
        ident = _ident(self.kind, frame)
        first = ident[0]
        if (ident == first).all():  # one device in the frame
            out.fill(self.idents.setdefault(tuple(first.tolist()), len(self.idents)))
        else:
            packed = _packed(ident)
            if packed is not None and int(packed.max()) < 65536:  # a few devices: count them
                uniq_packed = np.flatnonzero(np.bincount(packed))
                lut = np.empty(int(uniq_packed[-1]) + 1, dtype=np.int32)
                where = np.empty(len(lut), dtype=np.intp)
                where[packed] = np.arange(n)  # a row of each value, to read its identity
                for v, row in zip(uniq_packed.tolist(), where[uniq_packed].tolist(), strict=True):
                    lut[v] = self.idents.setdefault(tuple(ident[row].tolist()), len(self.idents))
                np.take(lut, packed, out=out, mode="clip")
            else:
                if packed is not None:  # a 1-D unique, far cheaper than axis=0
                    _, first_rows, inverse = np.unique(
                        packed, return_index=True, return_inverse=True
                    )
                    uniq = ident[first_rows]
                else:
                    uniq, inverse = np.unique(ident, axis=0, return_inverse=True)
                lut = np.array(
                    [self.idents.setdefault(tuple(v), len(self.idents)) for v in uniq.tolist()],
                    dtype=np.int32,
                )
                out[:] = lut[inverse.reshape(-1)]
        self.count = a + n

    def take(self) -> tuple[dict[str, npt.NDArray[Any]], npt.NDArray[np.int32]]:
        """The columns of everything added so far, and each row's device (index into
        :attr:`idents`); the builder starts again empty (without a capacity)."""
        n = self.count
        out = self.columns
        codes = self.device
        if self.capacity != n:  # trimmed in place (realloc), nothing else refers to them
            for array in (*out.values(), codes):
                array.resize(n, refcheck=False)
        self.count = 0
        self.growth = 2
        self._allocate(0)
        return out, codes


def _ident(kind: str, columns: dict[str, npt.NDArray[Any]]) -> npt.NDArray[np.int64]:
    """Each row's (host, device) as a row of integers; :func:`_decode` reads one back. Any
    value an event may hold fits (no packing into one integer that large or negative values
    could overflow)."""
    host = columns["host"].astype(np.int64)
    if kind == "gpu":
        return np.stack([host, columns["gpu"]], axis=1)
    if kind == "rapl":
        return np.stack([host, columns["package"], columns["domain"].astype(np.int64)], axis=1)
    on = columns["gpu"]
    off = np.isnan(on)
    gpu = np.where(off, 0, on).astype(np.int64)
    return np.stack([host, columns["pid"], (~off).astype(np.int64), gpu], axis=1)


def _packed(ident: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | None:
    """Identity rows packed into one integer each, the same rows giving the same integer, when
    their values are non-negative and fit together in 62 bits; else ``None``."""
    if int(ident.min()) < 0:
        return None
    bits = [int(m).bit_length() for m in ident.max(axis=0).tolist()]
    if sum(bits) > 62:
        return None
    packed: npt.NDArray[np.int64] = ident[:, 0].copy()
    for j in range(1, ident.shape[1]):
        packed <<= bits[j]
        packed |= ident[:, j]
    return packed


def _decode(kind: str, row: tuple[int, ...], categories: dict[str, list[str]]) -> tuple[int, str]:
    """(host code, device key) of an identity row from :func:`_ident`."""
    if kind == "gpu":
        return row[0], f"gpu:{row[1]}"
    if kind == "rapl":
        return row[0], f"cpu:{row[1]}/{categories['domain'][row[2]]}"
    return row[0], f"proc:{row[1]}" + (f"/gpu:{row[3]}" if row[2] else "")


@dataclass
class ColumnarLoad:
    """What :func:`load_columns` read: the sample tables and every other event.

    Attributes:
        tables: Kind to its :class:`SampleTable` (kinds without samples are absent).
        others: The events of every other kind, in file order.
        hosts: Every host with samples, in order of first appearance.
        counts: Events per kind tag.
    """

    tables: dict[str, SampleTable]
    others: list[Event]
    hosts: list[str]
    counts: dict[str, int]


def _tag(cls: type[Any]) -> str:
    return str(getattr(cls, "__struct_config__").tag)  # noqa: B009 (mypy: not on type)


def _frames_into(
    reader: RecordingReader,
    progress: Progress | None,
    builders: dict[str, _KindBuilder],
    others: list[Event] | None,
    counts: dict[str, int],
    kinds: Collection[str] | None = None,
    stream_hosts: set[str] | None = None,
) -> Iterator[None]:
    """Read frames into the builders (and ``others``, and the hosts of StreamInfo events into
    ``stream_hosts``); yields after each frame."""
    ticker = ProgressTicker(reader, progress)
    for frame in reader.frames(kinds=kinds):
        if isinstance(frame, ColumnarFrame):
            for group in frame.groups:
                if isinstance(group, ColumnGroup) and (kinds is None or group.kind in kinds):
                    counts[group.kind] = counts.get(group.kind, 0) + group.rows
                    builders[group.kind].add_columns(group)
            batch = frame.records(kinds)
            if not batch:
                ticker.tick()
                yield None
                continue
        else:
            batch = frame
        present = set(map(type, batch))
        for cls in present:
            group = batch if len(present) == 1 else [e for e in batch if type(e) is cls]
            tag = _tag(cls)
            counts[tag] = counts.get(tag, 0) + len(group)
            kind = SAMPLE_TYPES.get(cls)
            if kind is not None:
                builders[kind].add(group)
                continue
            if others is not None:
                others.extend(group)
            if stream_hosts is not None and tag == "stream":
                stream_hosts.update(e.host for e in group)
        ticker.tick()
        yield None
    ticker.finish()


def _finish_tables(
    builders: dict[str, _KindBuilder], hosts: _Categories, several_hosts: bool | None = None
) -> dict[str, SampleTable]:
    several = len(hosts.names) > 1 if several_hosts is None else several_hosts
    tables: dict[str, SampleTable] = {}
    for kind, builder in builders.items():
        if not builder.count:
            continue
        categories = {name: list(c.names) for name, c in builder.cats.items()}
        idents = list(builder.idents)
        columns, codes = builder.take()
        parts = [_decode(kind, v, categories) for v in idents]
        keys = [f"{key}@{hosts.names[h]}" if several else key for h, key in parts]
        order = sorted(
            range(len(keys)),
            key=lambda i: device_order(f"{parts[i][1]}@{hosts.names[parts[i][0]]}"),
        )
        remap = np.empty(len(keys), dtype=np.int32)
        remap[order] = np.arange(len(keys), dtype=np.int32)
        tables[kind] = SampleTable(
            kind,
            columns,
            categories,
            remap[codes],
            [keys[i] for i in order],
            [parts[i][1] for i in order],
        )
    return tables


def load_columns(
    reader: RecordingReader,
    progress: Progress | None = None,
    *,
    keep_others: bool = True,
    several_hosts: bool | None = None,
) -> ColumnarLoad:
    """One pass over a recording: its samples as :class:`SampleTable` columns.

    Args:
        reader: The recording.
        progress: ``progress(done_bytes, total_bytes)`` over the pass.
        keep_others: Keep the events of the other kinds (in :attr:`ColumnarLoad.others`).
        several_hosts: Whether device keys carry ``@host``; by default when the recording
            holds more than one host (its samples' and its streams' descriptions), as
            :class:`~zeus_async.store.Recording` names devices.
    """
    hosts = _Categories()
    rows = reader.column_rows()  # format 3: each kind's arrays sized once, up front
    builders = {kind: _KindBuilder(kind, hosts, rows.get(kind, 0)) for kind in SAMPLE_KINDS}
    others: list[Event] = []
    counts: dict[str, int] = {}
    stream_hosts: set[str] = set()
    kept = others if keep_others else None
    for _ in _frames_into(reader, progress, builders, kept, counts, stream_hosts=stream_hosts):
        pass
    if several_hosts is None:
        several_hosts = len(set(hosts.names) | stream_hosts) > 1
    tables = _finish_tables(builders, hosts, several_hosts)
    return ColumnarLoad(tables, others, list(hosts.names), dict(sorted(counts.items())))


# -- Arrow ------------------------------------------------------------------------------------


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError as exc:
        raise ConfigError(_MISSING_ARROW) from exc
    return pyarrow


def _dictionary(pa: Any, codes: npt.NDArray[np.int32], names: Sequence[str]) -> Any:
    return pa.DictionaryArray.from_arrays(
        pa.array(codes, type=pa.int32()), pa.array(names, pa.string())
    )


def sample_table_to_arrow(table: SampleTable) -> pa.Table:
    """One kind's samples as an Arrow table: ``time`` (timestamp, UTC), then every field in
    schema order (``host`` and ``domain`` dictionary-encoded, optional numbers null where the
    event had ``None``, optional integers as int64), then ``device`` (dictionary)."""
    pa = _pyarrow()
    names: list[str] = ["time"]
    arrays: list[Any] = [
        pa.array(table.columns["t_ns"], type=pa.int64()).cast(pa.timestamp("ns", tz="UTC"))
    ]
    for name, storage in LAYOUTS[table.kind]:
        values = table.columns[name]
        if storage == "cat":
            array = _dictionary(pa, values, table.categories[name])
        elif storage == "int":
            array = pa.array(values, type=pa.int64())
        else:
            missing = np.isnan(values)
            if (table.kind, name) in _NULLABLE_INTS:
                array = pa.array(np.where(missing, 0, values).astype(np.int64), mask=missing)
            else:
                array = pa.array(values, mask=missing if missing.any() else None)
        names.append(name)
        arrays.append(array)
    names.append("device")
    position: dict[str, int] = {}
    for k in table.keys:
        position.setdefault(k, len(position))
    unique = list(position)
    to_unique = np.array([position[k] for k in table.keys], dtype=np.int32)
    arrays.append(_dictionary(pa, to_unique[table.device], unique))
    return pa.Table.from_arrays(arrays, names=names)


def _arrow_type(pa: Any, hint: Any) -> tuple[Any, Callable[[Any], Any]]:
    """An Arrow type for an event field, and how to convert a builtins value to it."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        args = set(typing.get_args(hint))
    else:
        args = {hint}
    args.discard(type(None))
    same: Callable[[Any], Any] = lambda v: v  # noqa: E731
    if any(not isinstance(a, type) and typing.get_origin(a) is not Literal for a in args) or any(
        isinstance(a, type) and not issubclass(a, (str, int, float)) for a in args
    ):
        # containers and nested structs
        return pa.string(), lambda v: None if v is None else json.dumps(v, separators=(",", ":"))
    if any(typing.get_origin(a) is Literal for a in args) or args == {str}:
        return pa.dictionary(pa.int32(), pa.string()), same
    if args == {bool}:
        return pa.bool_(), same
    if args == {int}:
        return pa.int64(), same
    if args and args <= {int, float}:
        return pa.float64(), lambda v: None if v is None else float(v)
    return pa.string(), lambda v: None if v is None else json.dumps(v, separators=(",", ":"))


def event_table(events: Iterable[Event], cls: type[Any]) -> pa.Table:
    """Events of one (non-sample) kind as an Arrow table: ``time`` then every field, typed by
    its annotation (strings dictionary-encoded, nested values as JSON text)."""
    pa = _pyarrow()
    hints = typing.get_type_hints(cls)
    rows = [event_to_dict(e) for e in events]
    names = ["time"]
    t = pa.array([r["t_ns"] for r in rows], type=pa.int64())
    arrays: list[Any] = [t.cast(pa.timestamp("ns", tz="UTC"))]
    for name in cls.__struct_fields__:
        arrow_type, convert = _arrow_type(pa, hints[name])
        values = [convert(r[name]) for r in rows]
        if pa.types.is_dictionary(arrow_type):
            array = pa.array(values, type=pa.string()).dictionary_encode()
        else:
            array = pa.array(values, type=arrow_type)
        names.append(name)
        arrays.append(array)
    return pa.Table.from_arrays(arrays, names=names)


#: Every event type, by tag.
TYPES_BY_TAG: Final = {_tag(cls): cls for cls in EVENT_TYPES}


def _empty_table(tag: str) -> pa.Table:
    """A table of kind ``tag`` with no rows, its columns typed as a full one's."""
    if tag in LAYOUTS:
        hosts = _Categories()
        builder = _KindBuilder(tag, hosts)
        columns, _ = builder.take()
        categories: dict[str, list[str]] = {name: [] for name in builder.cats}
        empty = SampleTable(tag, columns, categories, np.empty(0, dtype=np.int32), [], [])
        return sample_table_to_arrow(empty)
    return event_table([], TYPES_BY_TAG[tag])


def _event_tables(events: Iterable[Event]) -> dict[str, pa.Table]:
    """Events of any kinds as one Arrow table per kind, by tag (in order of first appearance)."""
    grouped: dict[str, list[Event]] = {}
    for event in events:
        grouped.setdefault(_tag(type(event)), []).append(event)
    return {tag: event_table(group, TYPES_BY_TAG[tag]) for tag, group in grouped.items()}


def to_arrow(load: ColumnarLoad) -> dict[str, pa.Table]:
    """Every kind of a :class:`ColumnarLoad` as an Arrow table, by tag (samples first)."""
    out: dict[str, Any] = {k: sample_table_to_arrow(t) for k, t in load.tables.items()}
    out.update(_event_tables(load.others))
    return out


# -- Parquet ----------------------------------------------------------------------------------

#: Events read between two row groups of a streamed Parquet export.
PARQUET_CHUNK: Final = 1_048_576


def export_parquet(
    path_in: _PathLike,
    path_out: _PathLike,
    *,
    kinds: str | Collection[str] | None = None,
    progress: Progress | None = None,
    overwrite: bool = True,
) -> dict[str, int]:
    """Write a recording as Parquet: one file per event kind (streamed; memory bounded by
    :data:`PARQUET_CHUNK` events, not by the recording).

    Output: with exactly one kind (``kinds="gpu"``) and a ``path_out`` ending in
    ``.parquet``, that file; otherwise ``path_out`` is a directory (created) holding
    ``<kind>.parquet`` for every kind with events. Each file reads back with
    ``pandas.read_parquet`` / ``pyarrow.parquet.read_table`` as :func:`to_arrow` gives it (the
    dictionary of ``host``/``device``/``domain`` columns is that of the whole file).

    Args:
        path_in: The recording.
        path_out: Output file or directory (never the recording or one of its parts).
        kinds: Only these event kinds.
        progress: ``progress(done_bytes, total_bytes)`` over the input file.
        overwrite: Replace existing output files.

    Returns:
        Rows written per kind.

    Every output file is claimed before anything is written: without ``overwrite``, an
    existing ``<kind>.parquet`` of any kind that may be written refuses the whole export; with
    it, the ``<kind>.parquet`` files of an earlier export into the same directory are replaced
    or removed, so the directory holds this recording's kinds only. A single-kind export
    without events of that kind writes an empty table (its columns typed).

    Raises:
        ConfigError: pyarrow missing, an unknown kind, an output that is the recording.
        FileExistsError: An output file exists and ``overwrite`` is false.
    """
    _pyarrow()
    import pyarrow.parquet as pq

    from .outputs import claim_output

    wanted = [kinds] if isinstance(kinds, str) else (list(kinds) if kinds is not None else None)
    if wanted is not None:
        unknown = sorted(set(wanted) - TYPES_BY_TAG.keys())
        if unknown:
            raise ConfigError(
                f"unknown event kind(s) {unknown}; known: {', '.join(sorted(TYPES_BY_TAG))}"
            )
    out = Path(path_out)
    single = wanted is not None and len(wanted) == 1 and out.suffix == ".parquet"
    if not single:
        if out.exists() and not out.is_dir():
            # The recording itself (or a part of it) is refused as such, before anything else.
            claim_output(out, inputs=[path_in], overwrite=True, what="Parquet export")
            raise ConfigError(
                f"{out} is a file: a Parquet export goes to a directory (a <kind>.parquet per "
                "kind), or, with a single kind, to a file named *.parquet"
            )
        out.mkdir(parents=True, exist_ok=True)

    def target(kind: str) -> Path:
        return out if single else out / f"{kind}.parquet"

    for tag in wanted if wanted is not None else TYPES_BY_TAG:
        claim_output(target(tag), inputs=[path_in], overwrite=overwrite, what="Parquet export")
    if not single:
        for tag in TYPES_BY_TAG:
            stale = target(tag)
            if stale.is_file():
                stale.unlink()  # claimed above: overwrite is on

    reader = RecordingReader(path_in)
    hosts = _Categories()
    builders = {kind: _KindBuilder(kind, hosts) for kind in SAMPLE_KINDS}
    others: list[Event] = []
    counts: dict[str, int] = {}
    writers: dict[str, Any] = {}
    written: dict[str, int] = {}

    def write(tag: str, table: Any) -> None:
        writer = writers.get(tag)
        if writer is None:
            writer = pq.ParquetWriter(target(tag), table.schema, compression="zstd")
            writers[tag] = writer
        elif not table.schema.equals(writer.schema):
            table = table.cast(writer.schema)
        writer.write_table(table)
        written[tag] = written.get(tag, 0) + table.num_rows

    def flush() -> None:
        tables = _finish_tables(builders, hosts, False)
        for kind, sample in tables.items():
            write(kind, sample_table_to_arrow(sample))
        for tag, table in _event_tables(others).items():
            write(tag, table)
        others.clear()

    try:
        pending = 0
        for _ in _frames_into(reader, progress, builders, others, counts, kinds=wanted):
            pending = sum(b.count for b in builders.values()) + len(others)
            if pending >= PARQUET_CHUNK:
                flush()
                pending = 0
        if pending or not written:
            flush()
        if single and not written:
            assert wanted is not None
            (tag,) = wanted
            write(tag, _empty_table(tag))
    finally:
        for writer in writers.values():
            writer.close()
    reader.report.warn(path_in, "exported")
    logger.info("exported %s to Parquet at %s: %s", path_in, out, written)
    return dict(sorted(written.items()))
