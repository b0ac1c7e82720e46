"""Format 3 frame payloads: the sample events of a frame as typed, compressed columns.

The byte layout is specified in ``docs/recording-format.md`` (*Format 3*); this module is its
reference implementation. A payload is::

    payload   := u32 dir_len (big-endian)  directory (msgpack, dir_len bytes)  block*
    directory := [events, order: Block | nil, groups: [Group, ...]]
    Group     := [kind, rows, columns: [Column, ...], records: Block | nil]
    Column    := [name, dtype, encoding, presence, base, dictionary: [str, ...] | nil,
                  bitmap: Block | nil, values: Block | nil]
    Block     := [codec (0 none, 1 zstd), stored_len, raw_len]

Blocks follow the directory in directory order (the order block, then per group each
column's bitmap and values, then its records). A column group holds the events of one kind
with a column layout (:data:`COLUMN_TYPES`: GPU, RAPL and process samples) as one
little-endian array per field; a records group (kind ``""``) holds events as the msgpack array
a format-2 payload holds. ``order`` gives, per event, the group it comes from, so the frame's
events are rebuilt in the order they were written.

Writing (:func:`encode_columns` then :meth:`PreparedFrame.seal`) takes the columns straight
from msgspec's encoding of the events when every event of a group encodes with the same
layout (the usual case: one sampler's samples); otherwise from the event objects. Reading
(:func:`decode_payload`) validates everything before returning: sizes add up, every block
expands to its declared size (never more than :data:`~.format.MAX_FRAME_BYTES` in all), every
dtype and code is legal; any other input raises :class:`~zeus_async.errors.CodecError`.
"""

from __future__ import annotations

import itertools
import logging
import struct
import typing
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt
import zstandard

from ..errors import CodecError
from ..events import Event, EventDecoder, GpuSample, ProcessSample, RaplSample

__all__ = [
    "COLUMN_TYPES",
    "ColumnGroup",
    "ColumnarFrame",
    "DecodedColumn",
    "PreparedFrame",
    "decode_payload",
    "encode_columns",
]

logger = logging.getLogger(__name__)

#: Event types stored as columns in format 3, by their tag.
COLUMN_TYPES: Final[dict[str, type[Any]]] = {
    "gpu": GpuSample,
    "rapl": RaplSample,
    "proc": ProcessSample,
}
_TAG_OF: Final = {cls: tag for tag, cls in COLUMN_TYPES.items()}

#: Codecs of a block.
CODEC_NONE: Final = 0
CODEC_ZSTD: Final = 1
#: Column encodings.
ENC_PLAIN: Final = 0
ENC_CONST: Final = 1
ENC_DELTA: Final = 2
#: Presence of an optional field.
PRESENT_ALL: Final = 0
PRESENT_NONE: Final = 1
PRESENT_BITMAP: Final = 2

#: dtypes a column may have, per storage.
_INT_DTYPES: Final = ("<i1", "<i2", "<i4", "<i8")
_CODE_DTYPES: Final = ("<u1", "<u2", "<u4")
_FLOAT_DTYPES: Final = ("<f8",)
#: Blocks smaller than this are stored uncompressed (zstd would only add its frame header).
_MIN_COMPRESS: Final = 64
_DIR_LEN = struct.Struct("!I")
#: Most rows of one group :func:`directory_rows` counts (a bound on what a hint may claim).
_MAX_HINT_ROWS: Final = 64 * 1024 * 1024

Storage = Literal["int", "float", "str"]


@dataclass(frozen=True)
class FieldSpec:
    """How one field of a column kind is stored."""

    name: str
    storage: Storage
    optional: bool
    choices: frozenset[str] | None  # a Literal's values


def _spec(name: str, hint: Any) -> FieldSpec:
    args = set(typing.get_args(hint) or (hint,))
    optional = type(None) in args
    args.discard(type(None))
    if typing.get_origin(hint) is Literal:
        return FieldSpec(name, "str", False, frozenset(typing.get_args(hint)))
    if args == {str}:
        return FieldSpec(name, "str", optional, None)
    if args == {int}:
        return FieldSpec(name, "int", optional, None)
    if args == {float}:
        return FieldSpec(name, "float", optional, None)
    raise TypeError(f"no column storage for {name}: {hint!r}")  # a new field type: extend here


#: Per column kind, its fields in schema order.
LAYOUTS: Final[dict[str, tuple[FieldSpec, ...]]] = {
    tag: tuple(_spec(name, typing.get_type_hints(cls)[name]) for name in cls.__struct_fields__)
    for tag, cls in COLUMN_TYPES.items()
}


# -- the directory ----------------------------------------------------------------------------


class Block(msgspec.Struct, array_like=True, frozen=True):
    codec: int
    stored: int
    raw: int


class Column(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    encoding: int
    presence: int
    base: int
    dictionary: list[str] | None
    bitmap: Block | None
    values: Block | None


class Group(msgspec.Struct, array_like=True):
    kind: str
    rows: int
    columns: list[Column]
    records: Block | None


class Directory(msgspec.Struct, array_like=True):
    events: int
    order: Block | None
    groups: list[Group]


_dir_encoder = msgspec.msgpack.Encoder()
_one_encoder = msgspec.msgpack.Encoder()
_dir_decoder = msgspec.msgpack.Decoder(Directory)


# -- writing ----------------------------------------------------------------------------------


_INT_RANGES: Final = tuple(
    (name, int(np.iinfo(name).min), int(np.iinfo(name).max)) for name in _INT_DTYPES
)


def _int_dtype(lo: int, hi: int) -> str:
    for name, low, high in _INT_RANGES:
        if low <= lo and hi <= high:
            return name
    return "<i8"


def _code_dtype(size: int) -> str:
    return "<u1" if size <= 256 else "<u2" if size <= 65536 else "<u4"


class _RawColumn:
    """A column before sealing: its directory entry and the raw bytes of its blocks."""

    __slots__ = ("base", "bitmap", "dictionary", "dtype", "encoding", "name", "presence", "values")

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = "<i8"
        self.encoding = ENC_PLAIN
        self.presence = PRESENT_ALL
        self.base = 0
        self.dictionary: list[str] | None = None
        self.bitmap: bytes | None = None
        self.values: bytes | None = None

    def set_ints(self, v: npt.NDArray[np.int64]) -> None:
        if len(v) == 1 or not (v != v[0]).any():
            self.encoding, self.dtype, self.values = ENC_CONST, "<i8", v[:1].tobytes()
            return
        lo, hi = int(v.min()), int(v.max())
        d = np.diff(v)  # wraps modulo 2**64; the cumulative sum wraps back
        dlo, dhi = int(d.min()), int(d.max())
        plain, delta = _int_dtype(lo, hi), _int_dtype(min(dlo, 0), max(dhi, 0))
        if np.dtype(delta).itemsize < np.dtype(plain).itemsize:
            out = np.empty(len(v), dtype=delta)
            out[0] = 0
            out[1:] = d
            self.encoding, self.dtype, self.base, self.values = (
                ENC_DELTA,
                delta,
                int(v[0]),
                out.tobytes(),
            )
        else:
            self.dtype, self.values = plain, v.astype(plain).tobytes()

    def set_floats(self, v: npt.NDArray[np.float64]) -> None:
        bits = v.view(np.int64)
        self.dtype = "<f8"
        if len(v) == 1 or not (bits != bits[0]).any():
            self.encoding, self.values = ENC_CONST, v[:1].tobytes()
        else:
            self.values = v.astype("<f8", copy=False).tobytes()

    def set_strings(self, values: Sequence[str]) -> None:
        index = dict.fromkeys(values)
        names = list(index)
        self.dictionary = names
        if len(names) == 1:
            self.encoding, self.dtype, self.values = ENC_CONST, "<u1", b"\x00"
            return
        for i, k in enumerate(names):
            index[k] = i
        self.dtype = _code_dtype(len(names))
        codes = np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values))
        self.values = codes.astype(self.dtype).tobytes()

    def set_codes(self, codes: npt.NDArray[np.intp], names: list[str]) -> None:
        self.dictionary = names
        if len(names) == 1:
            self.encoding, self.dtype, self.values = ENC_CONST, "<u1", b"\x00"
            return
        self.dtype = _code_dtype(len(names))
        self.values = codes.astype(self.dtype).tobytes()

    def absent(self, spec: FieldSpec) -> None:
        self.presence = PRESENT_NONE
        self.dtype = {"int": "<i8", "float": "<f8", "str": "<u1"}[spec.storage]
        self.values = None


class _Unsupported(Exception):
    """A group's events cannot be stored as columns (they are stored as records)."""


def _columns_from_objects(kind: str, group: Sequence[Any]) -> list[_RawColumn]:
    """Columns of a group read from the event objects (any mix of values and ``None``)."""
    out = []
    n = len(group)
    for spec in LAYOUTS[kind]:
        col = _RawColumn(spec.name)
        values = [getattr(e, spec.name) for e in group]
        types = set(map(type, values))
        nones = values.count(None) if type(None) in types else 0
        types.discard(type(None))
        if nones and not spec.optional:
            raise _Unsupported(spec.name)
        if nones == n:
            col.absent(spec)
            out.append(col)
            continue
        if spec.storage == "str":
            if types != {str} or nones:
                raise _Unsupported(spec.name)
            if spec.choices is not None and not set(values) <= spec.choices:
                raise _Unsupported(spec.name)
            col.set_strings(values)
            out.append(col)
            continue
        allowed = {int} if spec.storage == "int" else {int, float}
        if not types <= allowed:
            raise _Unsupported(spec.name)
        if nones:
            present = np.fromiter((v is not None for v in values), dtype=bool, count=n)
            fill: Any = 0 if spec.storage == "int" else float("nan")
            values = [fill if v is None else v for v in values]
            col.presence = PRESENT_BITMAP
            col.bitmap = np.packbits(present, bitorder="little").tobytes()
        try:
            if spec.storage == "int":
                col.set_ints(np.array(values, dtype=np.int64))
            else:
                col.set_floats(np.array(values, dtype=np.float64))
        except OverflowError:
            raise _Unsupported(spec.name) from None
        out.append(col)
    return out


# msgpack tokens of the fast path: first byte -> (kind, bytes after the type byte).
_FIXED: Final[dict[int, tuple[str, str]]] = {
    0xCB: ("float", ">f8"),
    0xCA: ("float", ">f4"),
    0xCC: ("int", ">u1"),
    0xCD: ("int", ">u2"),
    0xCE: ("int", ">u4"),
    0xCF: ("int", ">u8"),
    0xD0: ("int", ">i1"),
    0xD1: ("int", ">i2"),
    0xD2: ("int", ">i4"),
    0xD3: ("int", ">i8"),
}


class _Token(typing.NamedTuple):
    kind: str  # "nil", "posfix", "negfix", "int", "float", "str"
    pos: int  # offset of the type byte within the event
    head: int  # bytes of type and length prefix (compared across rows)
    size: int  # value bytes after the head
    dtype: str  # numpy dtype of the value bytes ("" for fixints, nil, str)


def _tokens(one: bytes) -> list[_Token] | None:
    """The tokens of one msgpack-encoded event (an array), or ``None`` when a token is not
    one the fast path reads."""
    b0 = one[0]
    if 0x90 <= b0 <= 0x9F:
        count, pos = b0 & 0x0F, 1
    elif b0 == 0xDC and len(one) >= 3:
        count, pos = int.from_bytes(one[1:3], "big"), 3
    else:
        return None
    out = [_Token("str", 0, pos, 0, "")]  # the array header, compared whole
    for _ in range(count):
        if pos >= len(one):
            return None
        b = one[pos]
        if b <= 0x7F:
            out.append(_Token("posfix", pos, 0, 1, ""))
            pos += 1
        elif b >= 0xE0:
            out.append(_Token("negfix", pos, 0, 1, ""))
            pos += 1
        elif b == 0xC0:
            out.append(_Token("nil", pos, 1, 0, ""))
            pos += 1
        elif 0xA0 <= b <= 0xBF:
            out.append(_Token("str", pos, 1, b & 0x1F, ""))
            pos += 1 + (b & 0x1F)
        elif b == 0xD9 and pos + 1 < len(one):
            out.append(_Token("str", pos, 2, one[pos + 1], ""))
            pos += 2 + one[pos + 1]
        elif b in _FIXED:
            kind, dtype = _FIXED[b]
            size = np.dtype(dtype).itemsize
            out.append(_Token(kind, pos, 1, size, dtype))
            pos += 1 + size
        else:
            return None
    return out if pos == len(one) else None


_ARRAY_HEAD: Final = (1, 3, 5)  # msgpack array header of a batch: fixarray, array16, array32
_I64_MAX: Final = 2**63 - 1


def _columns_from_msgpack(kind: str, group: Sequence[Any], encoder: Any) -> list[_RawColumn]:
    """Columns of a group read from msgspec's encoding of it, when every event encodes with
    the same layout (same token types and string lengths); :class:`_Unsupported` otherwise."""
    n = len(group)
    # Not ``encoder``: an EventEncoder reuses one buffer, which a single event would shrink
    # (and the batch then grow again, a copy per step).
    one = _one_encoder.encode(group[0])
    tokens = _tokens(one)
    layout = LAYOUTS[kind]
    if tokens is None or len(tokens) != len(layout) + 2:  # header, tag, fields
        raise _Unsupported("layout")
    buf = encoder.encode(group)
    width = len(one)
    hdr = len(buf) - n * width
    if hdr != _ARRAY_HEAD[0 if n < 16 else 1 if n < 65536 else 2]:
        raise _Unsupported("length")
    rows = np.frombuffer(buf, dtype=np.uint8, count=n * width, offset=hdr).reshape(n, width)
    first = np.frombuffer(one, dtype=np.uint8)
    # Every row has the first event's layout: its type bytes and length prefixes where the
    # first event's are (a row that matches them parses exactly as the first; by induction
    # every row starts where it is assumed to), fixints in their range.
    fixed = [i for t in tokens for i in range(t.pos, t.pos + t.head)]
    tag = tokens[1]
    fixed.extend(range(tag.pos + tag.head, tag.pos + tag.head + tag.size))
    at = np.array(fixed, dtype=np.intp)
    if not (rows[:, at] == first[at]).all():
        raise _Unsupported("layout")
    for t in tokens[2:]:
        if t.kind == "posfix" and (rows[:, t.pos] > 0x7F).any():
            raise _Unsupported("layout")
        if t.kind == "negfix" and (rows[:, t.pos] < 0xE0).any():
            raise _Unsupported("layout")
    # The numeric fields as one structured view of the rows (a field per token, at its offset
    # and in its big-endian dtype): each column is then one strided, byte-swapping copy.
    names, formats, offsets = [], [], []
    for k, t in enumerate(tokens[2:]):
        if t.kind in ("int", "float", "posfix", "negfix"):
            names.append(f"f{k}")
            formats.append(t.dtype or ("u1" if t.kind == "posfix" else "i1"))
            offsets.append(t.pos + t.head)
    record = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": width})
    table = np.frombuffer(buf, dtype=record, count=n, offset=hdr)
    out = []
    for k, (spec, t) in enumerate(zip(layout, tokens[2:], strict=True)):
        col = _RawColumn(spec.name)
        out.append(col)
        start = t.pos + t.head
        if t.kind == "nil":
            if not spec.optional:
                raise _Unsupported(spec.name)
            col.absent(spec)
            continue
        if spec.storage == "str":
            if t.kind != "str":
                raise _Unsupported(spec.name)
            raw = rows[:, start : start + t.size]
            if not (raw != first[start : start + t.size]).any():
                text = one[start : start + t.size].decode()
                if spec.choices is not None and text not in spec.choices:
                    raise _Unsupported(spec.name)
                col.set_codes(np.zeros(n, dtype=np.intp), [text])
                continue
            void = np.ascontiguousarray(raw).view(f"V{max(t.size, 1)}").reshape(n)
            uniq, inverse = np.unique(void, return_inverse=True)
            names = [bytes(u).decode() for u in uniq]
            if spec.choices is not None and not set(names) <= spec.choices:
                raise _Unsupported(spec.name)
            col.set_codes(inverse.reshape(-1), names)
            continue
        if t.kind == "str" or (spec.storage == "int" and t.kind == "float"):
            raise _Unsupported(spec.name)
        field = table[f"f{k}"]
        if spec.storage == "int":
            if t.dtype == ">u8" and int(field.max()) > _I64_MAX:
                raise _Unsupported(spec.name)
            col.set_ints(field.astype(np.int64))
        else:
            col.set_floats(field.astype(np.float64))
    return out


@dataclass
class PreparedFrame:
    """A frame's events as raw column and record blocks, ready to compress (:meth:`seal`,
    which releases the GIL for most of its work, so a writer runs it in a worker thread)."""

    events: int
    first_t_ns: int
    order: bytes | None
    groups: list[tuple[str, int, list[_RawColumn] | bytes]]

    def seal(self, cctx: zstandard.ZstdCompressor | None) -> bytes:
        """The payload: the directory and every block, compressed with ``cctx`` (``None``:
        stored as they are)."""
        blocks: list[bytes] = []

        def block(raw: bytes | None) -> Block | None:
            if raw is None:
                return None
            if cctx is not None and len(raw) >= _MIN_COMPRESS:
                stored = cctx.compress(raw)
                if len(stored) < len(raw):
                    blocks.append(stored)
                    return Block(CODEC_ZSTD, len(stored), len(raw))
            blocks.append(raw)
            return Block(CODEC_NONE, len(raw), len(raw))

        order = block(self.order)
        groups = []
        for kind, rows, body in self.groups:
            if isinstance(body, bytes):
                groups.append(Group("", rows, [], block(body)))
                continue
            columns = []
            for c in body:
                bitmap = block(c.bitmap)
                values = block(c.values)
                columns.append(
                    Column(
                        c.name,
                        c.dtype,
                        c.encoding,
                        c.presence,
                        c.base,
                        c.dictionary,
                        bitmap,
                        values,
                    )
                )
            groups.append(Group(kind, rows, columns, None))
        directory = _dir_encoder.encode(Directory(self.events, order, groups))
        return b"".join([_DIR_LEN.pack(len(directory)), directory, *blocks])


def encode_columns(events: Sequence[Event], encoder: Any) -> PreparedFrame:
    """Split a non-empty batch into groups (one per column kind, one of records for the rest)
    and take each group's columns (see the module docstring).

    Args:
        events: The frame's events, in order.
        encoder: A ``msgspec.msgpack.Encoder`` (or :class:`~zeus_async.events.EventEncoder`).
    """
    if not events:
        raise CodecError("a frame needs at least one event")
    kind = _TAG_OF.get(type(events[0]))
    if kind is not None:
        # The usual frame: one sampler's samples. The fast path checks every row's tag bytes
        # against the first's, so success means one kind throughout (no per-event type pass).
        try:
            columns = _columns_from_msgpack(kind, events, encoder)
        except _Unsupported:
            pass  # not one layout throughout (or not one kind): split, below
        else:
            return PreparedFrame(len(events), events[0].t_ns, None, [(kind, len(events), columns)])
    types = set(map(type, events))
    if len(types) == 1:
        (cls,) = types
        split: dict[Any, list[Any]] = {cls: list(events)}
        order = None
    else:
        split = {}
        for e in events:
            split.setdefault(type(e), []).append(e)
    # Kinds without columns are records; kinds whose columns fail are records too.
    records: list[Any] = []
    record_types: set[Any] = set()
    groups: list[tuple[str, int, list[_RawColumn] | bytes]] = []
    group_of: dict[Any, int] = {}
    for cls, group in split.items():
        kind = _TAG_OF.get(cls)
        if kind is not None:
            try:
                try:
                    if len(split) == 1:  # the whole batch: the fast path failed above
                        raise _Unsupported("layout")
                    columns = _columns_from_msgpack(kind, group, encoder)
                except _Unsupported:
                    columns = _columns_from_objects(kind, group)
            except _Unsupported as why:
                logger.debug("%d %s events stored as records (%s)", len(group), kind, why)
            else:
                group_of[cls] = len(groups)
                groups.append((kind, len(group), columns))
                continue
        record_types.add(cls)
    if record_types:
        records = [e for e in events if type(e) in record_types]
        for cls in record_types:
            group_of[cls] = len(groups)
        groups.append(("", len(records), encoder.encode(records)))
    if len(groups) == 1:
        order = None
    else:
        lut = {cls: g for cls, g in group_of.items()}
        order = bytes(map(lut.__getitem__, map(type, events)))
    return PreparedFrame(len(events), events[0].t_ns, order, groups)


# -- reading ----------------------------------------------------------------------------------


@dataclass
class DecodedColumn:
    """One column of a decoded group.

    Attributes:
        spec: The field.
        values: The stored array, widened: int64 (ints, after undoing a delta), float64, or
            the dictionary codes (int64); length ``rows``, or 1 for a constant column; ``None``
            when no row has a value.
        present: Per row, whether it has a value (``None``: every row has one unless
            ``values`` is ``None``).
        dictionary: The strings the codes index (string fields).
    """

    spec: FieldSpec
    values: npt.NDArray[Any] | None
    present: npt.NDArray[np.bool_] | None
    dictionary: list[str] | None
    const: bool

    def dense(self, rows: int) -> npt.NDArray[Any] | None:
        """The values, one per row (a constant repeated), absent rows as stored."""
        if self.values is None:
            return None
        if self.const:
            return np.full(rows, self.values[0], dtype=self.values.dtype)
        return self.values

    def pylist(self, rows: int) -> Iterator[Any] | list[Any]:
        """The field's Python values (what the event holds), one per row."""
        if self.values is None:
            return itertools.repeat(None, rows)
        if self.dictionary is not None:
            if self.const:
                return itertools.repeat(self.dictionary[int(self.values[0])], rows)
            names = self.dictionary
            return [names[c] for c in self.values.tolist()]
        if self.const and self.present is None:
            return itertools.repeat(self.values.tolist()[0], rows)
        out: list[Any] = self.dense(rows).tolist()  # type: ignore[union-attr]
        if self.present is not None:
            for i in np.flatnonzero(~self.present).tolist():
                out[i] = None
        return out


@dataclass
class ColumnGroup:
    """The events of one column kind in a frame, as columns (see :class:`DecodedColumn`)."""

    kind: str
    rows: int
    columns: dict[str, DecodedColumn]

    def events(self) -> list[Event]:
        cls = COLUMN_TYPES[self.kind]
        return list(map(cls, *(c.pylist(self.rows) for c in self.columns.values())))

    @property
    def first_t_ns(self) -> int:
        t = self.columns["t_ns"].values
        assert t is not None
        return int(t[0])


@dataclass
class ColumnarFrame:
    """A decoded format-3 frame: its groups, and the order of its events across them."""

    groups: list[ColumnGroup | list[Event]]
    order: npt.NDArray[np.uint8] | None
    count: int
    compressed: bool = False  # whether a block of it is zstd

    def __len__(self) -> int:
        return self.count

    @property
    def first_t_ns(self) -> int:
        g = self.groups[0 if self.order is None else int(self.order[0])]
        return g.first_t_ns if isinstance(g, ColumnGroup) else g[0].t_ns

    def records(self, kinds: Collection[str] | None = None) -> list[Event]:
        """The events stored as records (not columns), in written order; only those of
        ``kinds`` when given."""
        lists = [g for g in self.groups if isinstance(g, list)]
        if not lists:
            return []
        if len(lists) == 1:
            out = lists[0]
        else:
            assert self.order is not None
            placed: list[tuple[int, Event]] = []
            for k, g in enumerate(self.groups):
                if isinstance(g, list):
                    placed.extend(zip(np.flatnonzero(self.order == k).tolist(), g, strict=True))
            out = [e for _, e in sorted(placed, key=lambda p: p[0])]
        if kinds is not None:
            out = [e for e in out if str(type(e).__struct_config__.tag) in kinds]
        return out

    def events(self, kinds: Collection[str] | None = None) -> list[Event]:
        """The frame's events in written order (only those of ``kinds``, when given)."""
        built: list[list[Event] | None] = []
        for g in self.groups:
            if isinstance(g, ColumnGroup):
                built.append(g.events() if kinds is None or g.kind in kinds else None)
            else:
                built.append(g)
        if self.order is None:
            only = built[0]
            assert only is not None
            return only
        out: list[Any] = [None] * self.count
        for k, events in enumerate(built):
            if events is None:
                continue
            for i, e in zip(np.flatnonzero(self.order == k).tolist(), events, strict=True):
                out[i] = e
        if kinds is not None:
            return [e for e in out if e is not None]
        return out


def _expand(payload: memoryview, at: int, block: Block, dctx: zstandard.ZstdDecompressor) -> bytes:
    stored = payload[at : at + block.stored]
    if block.codec == CODEC_NONE:
        if block.raw != block.stored:
            raise CodecError("a stored block's sizes differ")
        return bytes(stored)
    if block.codec != CODEC_ZSTD:
        raise CodecError(f"unknown block codec {block.codec}")
    try:
        declared = zstandard.frame_content_size(stored)
        if declared != block.raw:
            raise CodecError("a block's declared size differs from its zstd frame's")
        raw = dctx.decompress(stored, max_output_size=block.raw)
    except zstandard.ZstdError as exc:
        raise CodecError(f"block does not decompress: {exc}") from None
    if len(raw) != block.raw:
        raise CodecError("a block expands to another size than declared")
    return raw


def _blocks(directory: Directory) -> Iterator[Block]:
    if directory.order is not None:
        yield directory.order
    for g in directory.groups:
        for c in g.columns:
            if c.bitmap is not None:
                yield c.bitmap
            if c.values is not None:
                yield c.values
        if g.records is not None:
            yield g.records


_LEGAL: Final[dict[Storage, tuple[str, ...]]] = {
    "int": _INT_DTYPES,
    "float": _FLOAT_DTYPES,
    "str": _CODE_DTYPES,
}


def _column(
    spec: FieldSpec, c: Column, rows: int, bitmap: bytes | None, values: bytes | None
) -> DecodedColumn:
    if c.name != spec.name:
        raise CodecError(f"column {c.name!r} where {spec.name!r} belongs")
    if c.dtype not in _LEGAL[spec.storage]:
        raise CodecError(f"column {c.name!r}: dtype {c.dtype!r} is not allowed")
    if (c.dictionary is not None) != (spec.storage == "str"):
        raise CodecError(f"column {c.name!r}: a dictionary where none belongs, or none")
    present = None
    if c.presence == PRESENT_NONE:
        if not spec.optional or values is not None or bitmap is not None:
            raise CodecError(f"column {c.name!r}: absent values of a required field")
        return DecodedColumn(spec, None, None, c.dictionary, False)
    if values is None:
        raise CodecError(f"column {c.name!r} has no values")
    if c.presence == PRESENT_BITMAP:
        if not spec.optional or bitmap is None or len(bitmap) != (rows + 7) // 8:
            raise CodecError(f"column {c.name!r}: bad presence bitmap")
        bits = np.frombuffer(bitmap, dtype=np.uint8)
        present = np.unpackbits(bits, count=rows, bitorder="little").astype(bool)
    elif c.presence != PRESENT_ALL or bitmap is not None:
        raise CodecError(f"column {c.name!r}: bad presence {c.presence}")
    dtype = np.dtype(c.dtype)
    if c.encoding == ENC_CONST:
        count = 1
    elif c.encoding in (ENC_PLAIN, ENC_DELTA):
        count = rows
    else:
        raise CodecError(f"column {c.name!r}: unknown encoding {c.encoding}")
    if c.encoding == ENC_DELTA and spec.storage != "int":
        raise CodecError(f"column {c.name!r}: delta encoding of a non-integer")
    if len(values) != count * dtype.itemsize:
        raise CodecError(f"column {c.name!r}: {len(values)} bytes for {count} values")
    array: npt.NDArray[Any] = np.frombuffer(values, dtype=dtype)
    if spec.storage == "str":
        assert c.dictionary is not None
        if array.size and int(array.max()) >= len(c.dictionary):
            raise CodecError(f"column {c.name!r}: a code outside its dictionary")
        if spec.choices is not None and not set(c.dictionary) <= spec.choices:
            raise CodecError(f"column {c.name!r}: a value outside {sorted(spec.choices)}")
        array = array.astype(np.int64)
    elif spec.storage == "int":
        if c.encoding == ENC_DELTA:
            if not -(2**63) <= c.base <= _I64_MAX:
                raise CodecError(f"column {c.name!r}: base outside int64")
            array = np.cumsum(array, dtype=np.int64)
            array += np.int64(c.base)
        elif dtype.itemsize != 8:
            array = array.astype(np.int64)
    elif c.encoding == ENC_DELTA:
        raise CodecError(f"column {c.name!r}: delta encoding of floats")
    elif c.base:
        raise CodecError(f"column {c.name!r}: a base without delta encoding")
    return DecodedColumn(spec, array, present, c.dictionary, c.encoding == ENC_CONST)


def directory_rows(payload: bytes | memoryview) -> dict[str, int] | None:
    """Rows per column kind a format-3 payload's directory declares, read from the directory
    alone (nothing expanded, no CRC checked): a capacity hint for a columnar load, which the
    load itself does not trust (it grows or trims its arrays to what decodes). ``None`` when
    the directory does not decode or does not add up."""
    view = memoryview(payload)
    if len(view) < _DIR_LEN.size:
        return None
    (dir_len,) = _DIR_LEN.unpack_from(view, 0)
    start = _DIR_LEN.size + dir_len
    if start > len(view):
        return None
    try:
        directory = _dir_decoder.decode(view[_DIR_LEN.size : start])
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    if sum(g.rows for g in directory.groups) != directory.events:
        return None
    rows: dict[str, int] = {}
    for g in directory.groups:
        if g.kind in COLUMN_TYPES and 0 < g.rows <= _MAX_HINT_ROWS:
            rows[g.kind] = rows.get(g.kind, 0) + g.rows
    return rows


def decode_payload(
    payload: bytes | memoryview,
    dctx: zstandard.ZstdDecompressor,
    decoder: EventDecoder,
    *,
    limit: int,
) -> ColumnarFrame:
    """Decode and validate a format-3 payload.

    Args:
        payload: The stored payload (its CRC already checked).
        dctx: Zstandard decompressor (one per thread).
        decoder: Event decoder for records blocks.
        limit: Most bytes the blocks may expand to in all.

    Raises:
        CodecError: Anything that is not a valid payload.
    """
    view = memoryview(payload)
    if len(view) < _DIR_LEN.size:
        raise CodecError("payload shorter than its directory length")
    (dir_len,) = _DIR_LEN.unpack_from(view, 0)
    start = _DIR_LEN.size + dir_len
    if start > len(view):
        raise CodecError("directory runs past the payload")
    try:
        directory = _dir_decoder.decode(view[_DIR_LEN.size : start])
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise CodecError(f"invalid frame directory: {exc}") from None
    blocks = list(_blocks(directory))
    if any(b.stored < 0 or b.raw < 0 for b in blocks):
        raise CodecError("negative block size")
    if start + sum(b.stored for b in blocks) != len(view):
        raise CodecError("blocks do not add up to the payload")
    if sum(b.raw for b in blocks) > limit:
        raise CodecError(f"frame declares more than {limit} bytes expanded")
    if directory.events < 1 or not directory.groups or len(directory.groups) > 255:
        raise CodecError("empty frame")
    if sum(g.rows for g in directory.groups) != directory.events:
        raise CodecError("groups do not add up to the frame's events")
    at = start

    def take(block: Block | None) -> bytes | None:
        nonlocal at
        if block is None:
            return None
        raw = _expand(view, at, block, dctx)
        at += block.stored
        return raw

    order = None
    order_raw = take(directory.order)
    if order_raw is not None:
        if len(order_raw) != directory.events:
            raise CodecError("order block of another length than the frame's events")
        order = np.frombuffer(order_raw, dtype=np.uint8)
        counts = np.bincount(order, minlength=len(directory.groups))
        if len(counts) != len(directory.groups) or any(
            int(c) != g.rows for c, g in zip(counts.tolist(), directory.groups, strict=True)
        ):
            raise CodecError("order block does not match the groups")
    elif len(directory.groups) != 1:
        raise CodecError("several groups without an order")
    groups: list[ColumnGroup | list[Event]] = []
    for g in directory.groups:
        if g.rows < 1:
            raise CodecError("empty group")
        if g.kind == "":
            if g.columns or g.records is None:
                raise CodecError("bad records group")
            try:
                records = decoder.decode_batch(take(g.records) or b"")
            except ValueError as exc:  # invalid UTF-8 in a string
                raise CodecError(f"undecodable records: {exc}") from None
            if len(records) != g.rows:
                raise CodecError("records group of another length than declared")
            groups.append(records)
            continue
        layout = LAYOUTS.get(g.kind)
        if layout is None or g.records is not None or len(g.columns) != len(layout):
            raise CodecError(f"bad column group {g.kind!r}")
        columns = {}
        for spec, c in zip(layout, g.columns, strict=True):
            bitmap = take(c.bitmap)
            values = take(c.values)
            columns[spec.name] = _column(spec, c, g.rows, bitmap, values)
        groups.append(ColumnGroup(g.kind, g.rows, columns))
    compressed = any(b.codec == CODEC_ZSTD for b in blocks)
    return ColumnarFrame(groups, order, directory.events, compressed)
