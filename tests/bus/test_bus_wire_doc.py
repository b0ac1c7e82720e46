"""``docs/wire-format.md`` stays in sync with the code: every tag and field in order, the header
layout, and a worked example that really decodes."""

from __future__ import annotations

import re
import struct
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec
import pytest
from wire_doc import render_default, render_type

from zeus_async.bus import HEADER_SIZE, FrameDecoder, FrameEncoder
from zeus_async.bus.codec import _HEADER
from zeus_async.events import EVENT_TYPES, Capabilities, DeviceInfo, GpuSample, event_topic

DOC = Path(__file__).parents[2] / "docs" / "wire-format.md"


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _section(doc: str, heading_re: str) -> str:
    m = re.search(heading_re + r"\n(.*?)(?=\n#{2,3} |\Z)", doc, re.S)
    assert m, f"no section matching {heading_re!r}"
    return m.group(1)


def _rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]  # without the column titles


def _expected_rows(cls: type[msgspec.Struct]) -> list[tuple[str, str, str]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return [
        (f.name, render_type(hints[f.name]), render_default(f)) for f in msgspec.structs.fields(cls)
    ]


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda t: t.__name__)
def test_every_event_is_documented_field_by_field(doc: str, cls: type[msgspec.Struct]) -> None:
    tag = cls.__struct_config__.tag
    section = _section(doc, rf"### `{re.escape(str(tag))}` — {cls.__name__}")
    rows = _rows(section)
    assert rows[0][:2] == ["0", "(tag)"] and rows[0][4] == f'`"{tag}"`'
    documented = [(r[1], r[2], r[3]) for r in rows[1:]]
    assert documented == _expected_rows(cls)
    assert [r[0] for r in rows] == [str(i) for i in range(len(rows))]
    topic = re.search(r"Topic `([^`]+)`", section)
    assert topic, "each event section names its topic"
    assert topic.group(1).split("/")[0] == _kind(cls)


def _kind(cls: type[msgspec.Struct]) -> str:
    """The topic kind of an instance of ``cls`` built from placeholder values."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in msgspec.structs.fields(cls):
        if f.required:
            tp = hints[f.name]
            placeholder = {int: 0, float: 0.0, str: "x"}.get(tp, {})
            values[f.name] = get_args(tp)[0] if get_origin(tp) is Literal else placeholder
    event: Any = cls(**values)
    return event_topic(event).split("/")[0]


def test_no_undocumented_or_stale_event_sections(doc: str) -> None:
    documented = re.findall(r"^### `([a-z_]+)` — (\w+)$", doc, re.M)
    assert documented == [(str(t.__struct_config__.tag), t.__name__) for t in EVENT_TYPES]


def test_device_info_is_documented(doc: str) -> None:
    rows = _rows(_section(doc, r"### DeviceInfo \(inside `stream`\)"))
    assert [(r[1], r[2], r[3]) for r in rows] == _expected_rows(DeviceInfo)


def test_capabilities_are_documented(doc: str) -> None:
    rows = _rows(_section(doc, r"### Capabilities \(inside `DeviceInfo`\)"))
    assert [(r[1], r[2], r[3]) for r in rows] == _expected_rows(Capabilities)


def test_header_table_matches_the_codec(doc: str) -> None:
    rows = _rows(_section(doc, r"## 4\. Header"))
    sizes = {"s": None, "B": 1, "H": 2, "I": 4, "Q": 8}
    offset = 0
    layout = []
    for m in re.finditer(r"(\d*)([sBHIQ])", _HEADER.format.lstrip("!")):
        size = int(m.group(1)) if m.group(2) == "s" else sizes[m.group(2)]
        assert size is not None
        layout.append((offset, size))
        offset += size
    assert offset == HEADER_SIZE == 52
    assert [(int(r[0]), int(r[1])) for r in rows] == layout
    assert f"`{_HEADER.format}`" in doc


def _hexdump(block: str) -> bytes:
    out = bytearray()
    for line in block.strip().splitlines():
        hexpart = line[6:53]
        out += bytes.fromhex(hexpart)
    return bytes(out)


def test_worked_example_decodes_and_is_what_the_encoder_produces(doc: str) -> None:
    section = _section(doc, r"## 11\. Worked example")
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    topic, header, payload = (_hexdump(b) for b in blocks[:3])
    frame = FrameDecoder().decode([topic, header, payload])
    assert frame.topic == "gpu/node1/0"
    h = frame.header
    assert (h.stream_id, h.seq, h.topic_seq) == ("5f0c6b1e-8a3d-4c2b-9e7f-0123456789ab", 41, 7)
    assert (h.wall_ns, h.event_count, h.flags) == (1700000000010250000, 2, 0)
    first = GpuSample(
        host="node1",
        t_ns=1700000000000000000,
        gpu=0,
        power_w=312.5,
        avg_power_w=298.0,
        energy_j=123456.75,
        temperature_c=61.0,
        sm_clock_hz=1.98e9,
        utilization_frac=0.97,
        memory_used_bytes=42949672960,
        power_limit_w=700.0,
    )
    second = GpuSample(host="node1", t_ns=1700000000010000000, gpu=0, power_w=315.0)
    assert frame.events == [first, second]
    # The dump is byte for byte what the encoder produces for this frame.
    enc = FrameEncoder(h.stream_id)
    for _ in range(7):  # seven earlier frames of this topic...
        enc.skip("gpu/node1/0", 0)
    for _ in range(41 - 7):  # ...and of other topics
        enc.skip("gpu/node1/1", 0)
    assert enc.encode("gpu/node1/0", [first, second], wall_ns=h.wall_ns) == [
        topic,
        header,
        payload,
    ]
    assert struct.unpack(">Q", header[24:32]) == (41,)
