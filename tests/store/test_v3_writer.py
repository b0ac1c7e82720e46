"""The format-3 writer's fast path (columns read from msgspec's encoding of a whole batch)
gives the same frame as the object path, and only ever for one kind of event."""

from __future__ import annotations

import zstandard

from zeus_async.events import EventDecoder, EventEncoder, GpuSample, RaplSample
from zeus_async.store.columnar import (
    PreparedFrame,
    _columns_from_msgpack,
    _columns_from_objects,
    decode_payload,
    encode_columns,
)
from zeus_async.testing.fakes import realistic_gpu_samples


def _payload(frame: PreparedFrame) -> bytes:
    return frame.seal(zstandard.ZstdCompressor(level=1))


def test_the_fast_path_equals_the_object_path_to_the_byte() -> None:
    events = realistic_gpu_samples(4096, t0_ns=1_763_000_000_000_000_000, step_ns=1_250_000)
    # Every row the same layout: a u64 time, None in the same places.
    same = [GpuSample("h", 2**62 + i, 7, -1.0 * i, None, float(i)) for i in range(300)]
    for batch in (events, same):
        fast = _columns_from_msgpack("gpu", batch, EventEncoder())
        slow = _columns_from_objects("gpu", batch)
        n = len(batch)
        assert _payload(PreparedFrame(n, batch[0].t_ns, None, [("gpu", n, fast)])) == _payload(
            PreparedFrame(n, batch[0].t_ns, None, [("gpu", n, slow)])
        )
        assert _payload(encode_columns(batch, EventEncoder())) == _payload(
            PreparedFrame(n, batch[0].t_ns, None, [("gpu", n, slow)])
        )


def test_a_batch_of_several_kinds_is_split_whatever_its_first_event() -> None:
    gpu = realistic_gpu_samples(64, t0_ns=1_000, step_ns=10)
    rapl = [RaplSample("node-01", 1_000 + 10 * i, 0, "package", float(i), 5.0) for i in range(8)]
    events = [*gpu[:30], *rapl, *gpu[30:]]
    frame = encode_columns(events, EventEncoder())
    assert [kind for kind, _, _ in frame.groups] == ["gpu", "rapl"]
    decoded = decode_payload(
        _payload(frame), zstandard.ZstdDecompressor(), EventDecoder(), limit=2**20
    )
    assert decoded.events() == events
    # A layout that changes mid-batch (a None appears) falls back to the objects, exactly.
    odd = [*gpu[:10], GpuSample("node-01", 2_000, 1), *gpu[10:20]]
    frame = encode_columns(odd, EventEncoder())
    assert [kind for kind, _, _ in frame.groups] == ["gpu"]
    decoded = decode_payload(
        _payload(frame), zstandard.ZstdDecompressor(), EventDecoder(), limit=2**20
    )
    assert decoded.events() == odd
