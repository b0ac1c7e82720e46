"""Shared helpers of the bus tests: event factories and hypothesis strategies for every event."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import msgspec
from hypothesis import strategies as st

from zeus_async.events import EVENT_TYPES, DeviceInfo, Event, GpuSample

I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FLOATS = st.floats(allow_nan=False)
TEXT = st.text(max_size=20)


def gpu(i: int, *, host: str = "n1", index: int = 0) -> GpuSample:
    """A GPU sample whose ``t_ns`` carries a test counter ``i``."""
    return GpuSample(host=host, t_ns=i, gpu=index, power_w=float(i), energy_j=1.5 * i)


def _strategy(tp: Any) -> st.SearchStrategy[Any]:
    origin = get_origin(tp)
    if origin is typing.Annotated:
        base, *metas = get_args(tp)
        for meta in metas:
            if isinstance(meta, msgspec.Meta) and base is int and meta.ge is not None:
                return st.integers(min_value=int(meta.ge), max_value=2**63 - 1)
            if isinstance(meta, msgspec.Meta) and base is float:
                lo = meta.ge if meta.ge is not None else None
                hi = meta.le if meta.le is not None else None
                return st.floats(min_value=lo, max_value=hi, allow_nan=False)
        return _strategy(base)
    if origin is Literal:
        return st.sampled_from(get_args(tp))
    if origin in (Union, types.UnionType):
        return st.one_of(*[_strategy(a) for a in get_args(tp)])
    if origin is list:
        return st.lists(_strategy(get_args(tp)[0]), max_size=4)
    if origin is dict:
        k, v = get_args(tp)
        return st.dictionaries(_strategy(k), _strategy(v), max_size=4)
    if tp is type(None) or tp is None:
        return st.none()
    if tp is str:
        return TEXT
    if tp is bool:
        return st.booleans()
    if tp is int:
        return I64
    if tp is float:
        return FLOATS
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return struct_strategy(tp)
    raise NotImplementedError(f"no strategy for {tp!r}")


def struct_strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Valid instances of a msgspec struct, derived from its field types (keeps up with the
    schema as fields are appended)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: _strategy(hints[f.name]) for f in msgspec.structs.fields(cls)}
    return st.builds(cls, **fields)


#: Every event kind of the union.
EVENT_STRATEGIES: dict[type[Any], st.SearchStrategy[Any]] = {
    t: struct_strategy(t) for t in EVENT_TYPES
}
any_event: st.SearchStrategy[Event] = st.one_of(*EVENT_STRATEGIES.values())
device_info: st.SearchStrategy[DeviceInfo] = struct_strategy(DeviceInfo)
