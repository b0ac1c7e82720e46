"""Recording throughput and size: zeus_async recordings vs JSON lines of the same events.

Writes N realistic ``GpuSample`` events (8 GPUs) with the async :class:`Recorder` (as a
runtime does: events published through a hub to a batched consumer) and ``write_recording``;
reads them back with :class:`RecordingReader`; and, in the same run, writes and reads the same
events as JSON lines (``msgspec.json``, one object per line — the usual interchange format).

Run: ``.venv/bin/python bench/bench_store.py [--events N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

from zeus_async.events import Event, event_to_dict
from zeus_async.runtime.hub import Hub
from zeus_async.store import Recorder, RecordingReader, write_recording
from zeus_async.testing.fakes import realistic_gpu_samples


def make_events(n: int) -> list[Event]:
    # 1.25 ms apart: 8 GPUs sampled at 100 Hz.
    return realistic_gpu_samples(n, t0_ns=1_763_000_000_000_000_000, step_ns=1_250_000)


async def record_async(path: Path, events: list[Event]) -> float:
    """Publish through a hub into the Recorder, as the runtime does (batched consumer)."""
    hub = Hub()
    recorder = Recorder(path, flush_events=4096)
    batches = hub.subscribe_batches(16384)
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(recorder.run, batches)
        for e in events:
            index = hub.try_publish(e)
            if index >= 0:
                await hub.resume(e, index)
        hub.close()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    events = make_events(args.events)
    n = len(events)
    tmp = Path(tempfile.mkdtemp(prefix="zeus-async-bench-"))
    out: dict[str, Any] = {"events": n}

    rec = tmp / "async.zarc"
    out["recorder_async_s"] = anyio.run(record_async, rec, events, backend="asyncio")
    sync_path = tmp / "sync.zarc"
    t0 = time.perf_counter()
    write_recording(sync_path, events)
    out["write_recording_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    count = sum(1 for _ in RecordingReader(sync_path))
    out["read_s"] = time.perf_counter() - t0
    assert count == n, (count, n)

    jsonl = tmp / "events.jsonl"
    enc = msgspec.json.Encoder()
    t0 = time.perf_counter()
    with open(jsonl, "wb") as f:
        for e in events:
            f.write(enc.encode(event_to_dict(e)))
            f.write(b"\n")
    out["jsonl_write_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(jsonl, "rb") as f:
        back = [msgspec.json.decode(line) for line in f]
    out["jsonl_read_s"] = time.perf_counter() - t0
    assert len(back) == n
    out["size_zarc"] = os.path.getsize(sync_path)
    out["size_async_zarc"] = os.path.getsize(rec)
    out["size_jsonl"] = os.path.getsize(jsonl)

    print(f"\n### Recording benchmark ({n:,} GpuSample events, 8 GPUs)\n")
    print("| path | events/s | file MB |\n|---|---:|---:|")
    rows = [
        (
            "Recorder (hub -> batched consumer, aiofiles) write",
            out["recorder_async_s"],
            out["size_async_zarc"],
        ),
        ("write_recording (sync) write", out["write_recording_s"], out["size_zarc"]),
        ("RecordingReader read + decode to structs", out["read_s"], out["size_zarc"]),
        ("JSON lines write (msgspec.json)", out["jsonl_write_s"], out["size_jsonl"]),
        ("JSON lines read (msgspec.json, to dicts)", out["jsonl_read_s"], out["size_jsonl"]),
    ]
    for name, seconds, size in rows:
        print(f"| {name} | {n / seconds:,.0f} | {size / 1e6:.1f} |")
    print(f"\nsize ratio recording / JSON lines: {out['size_zarc'] / out['size_jsonl']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
