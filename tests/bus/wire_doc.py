"""Renders event field types and defaults the way ``docs/wire-format.md`` writes them."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import msgspec

_NAMES = {str: "str", int: "int", float: "float", bool: "bool"}


def render_type(tp: Any) -> str:
    """``float or nil``, ``int ≥ 0``, ``array of str``, ``map int → float``, ..."""
    origin = get_origin(tp)
    if origin is typing.Annotated:
        base, *metas = get_args(tp)
        text = render_type(base)
        for meta in metas:
            if isinstance(meta, msgspec.Meta) and meta.ge is not None:
                text += f" ≥ {meta.ge}"
            if isinstance(meta, msgspec.Meta) and meta.le is not None:
                text += f" ≤ {meta.le}"
        return text
    if origin is Literal:
        return "str, one of " + ", ".join(f"`{v}`" for v in get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        text = " or ".join(render_type(a) for a in args)
        return text + " or nil" if len(args) < len(get_args(tp)) else text
    if origin is list:
        return "array of " + render_type(get_args(tp)[0])
    if origin is dict:
        k, v = get_args(tp)
        return f"map {render_type(k)} → {render_type(v)}"
    if tp in _NAMES:
        return _NAMES[tp]
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp.__name__
    raise NotImplementedError(repr(tp))


def render_default(field: msgspec.structs.FieldInfo) -> str:
    """The default as msgpack-ish text; empty for a required field."""
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return ""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list):
        return "`[]`"
    if isinstance(value, dict):
        return "`{}`"
    return f"`{value}`"
