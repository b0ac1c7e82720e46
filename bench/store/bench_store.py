"""Recording throughput and size: zeus_async recordings vs JSON lines of the same events.

Writes N realistic ``GpuSample`` events (8 GPUs) with the async :class:`Recorder` (as a
runtime does: events published through a hub to a batched consumer) and ``write_recording``;
reads them back with :class:`RecordingReader`; and, in the same run, writes and reads the same
events as JSON lines (``msgspec.json``, one object per line — the usual interchange format).

Run: ``.venv/bin/python bench/store/bench_store.py [--events N] [--format-version 2|3]
[--json PATH]``. ``--compare-writers`` instead times only the three writer paths, format 2 and
format 3 alternately in one run, each repeat's events/s and CPU time per event (all threads of
the process: the event loop's encoding plus the worker threads' compression), min/median/max.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from zeus_async.events import Event, EventDecoder, EventEncoder, event_to_dict
from zeus_async.runtime.hub import EventBatches, Hub
from zeus_async.store import Recorder, RecordingReader, default_header, write_recording
from zeus_async.testing.fakes import realistic_gpu_samples


def make_events(n: int) -> list[Event]:
    # 1.25 ms apart: 8 GPUs sampled at 100 Hz.
    return realistic_gpu_samples(n, t0_ns=1_763_000_000_000_000_000, step_ns=1_250_000)


async def record_async(path: Path, events: list[Event], version: int = 3) -> float:
    """Publish through a hub into the Recorder, as the runtime does (batched consumer)."""
    hub = Hub()
    # Each repeat replaces the last.
    recorder = Recorder(path, flush_events=4096, overwrite=True, format_version=version)
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


async def record_consumer_only(path: Path, events: list[Event], version: int = 3) -> float:
    """The Recorder's own cost: every event already handed over (buffered in its batches)."""
    batches = EventBatches(len(events))
    for e in events:
        batches.send_nowait(e)
    batches.close()
    # Each repeat replaces the last.
    recorder = Recorder(path, flush_events=4096, overwrite=True, format_version=version)
    t0 = time.perf_counter()
    await recorder.run(batches)
    return time.perf_counter() - t0


def best(repeat: int, fn: Callable[[], float]) -> float:
    """Fastest of ``repeat`` runs (seconds): the VM's noise only ever slows a run down."""
    return min(fn() for _ in range(repeat))


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def compare_writers(events: list[Event], repeat: int, tmp: Path) -> dict[str, Any]:
    """Format 2 and format 3 writers side by side: per path and version, each repeat's wall
    and CPU seconds (versions alternate within each repeat, so noise hits both alike)."""
    n = len(events)
    paths: dict[str, Callable[[int], None]] = {
        "consumer": lambda v: anyio.run(
            record_consumer_only, tmp / f"c{v}.zarc", events, v, backend="asyncio"
        ),
        "end_to_end": lambda v: anyio.run(
            record_async, tmp / f"e{v}.zarc", events, v, backend="asyncio"
        ),
        "write_recording": lambda v: write_recording(
            tmp / f"w{v}.zarc", events, overwrite=True, format_version=v
        ),
    }
    out: dict[str, Any] = {}
    for name, fn in paths.items():
        for r in range(repeat):
            for v in (2, 3) if r % 2 == 0 else (3, 2):
                gc.collect()
                w0, c0 = time.perf_counter(), time.process_time()
                fn(v)
                wall, cpu = time.perf_counter() - w0, time.process_time() - c0
                out.setdefault(f"{name}_v{v}", []).append((wall, cpu))
    print(f"\n### Writers, format 2 vs 3 ({n:,} GpuSample events, {repeat} repeats each)\n")
    print("| path | format | events/s: min / median / max | CPU µs/event: min / median / max |")
    print("|---|---:|---:|---:|")
    for name in paths:
        for v in (2, 3):
            runs = out[f"{name}_v{v}"]
            rate = sorted(n / w for w, _ in runs)
            cpu = sorted(c / n * 1e6 for _, c in runs)
            mid = len(runs) // 2
            print(
                f"| {name} | v{v} | {rate[0] / 1e6:.2f} / {rate[mid] / 1e6:.2f} / "
                f"{rate[-1] / 1e6:.2f} M | {cpu[0]:.3f} / {cpu[mid]:.3f} / {cpu[-1]:.3f} |"
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (best is kept)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--format-version", type=int, choices=(2, 3), default=3)
    parser.add_argument(
        "--compare-writers",
        action="store_true",
        help="only the writers, format 2 and 3 side by side (each repeat reported)",
    )
    args = parser.parse_args()
    events = make_events(args.events)
    n = len(events)
    tmp = Path(tempfile.mkdtemp(prefix="zeus-async-bench-"))
    if args.compare_writers:
        runs = compare_writers(events, args.repeat, tmp)
        if args.json:
            args.json.write_text(json.dumps({"events": n, "runs": runs}, indent=1))
        return 0
    version = args.format_version
    out: dict[str, Any] = {"events": n, "repeat": args.repeat}
    rec = tmp / "async.zarc"
    sync_path = tmp / "sync.zarc"
    plain_path = tmp / "plain.zarc"
    jsonl = tmp / "events.jsonl"

    def read_all() -> None:
        assert sum(1 for _ in RecordingReader(sync_path)) == n

    def read_batches() -> None:
        assert sum(len(b) for b in RecordingReader(sync_path).batches()) == n

    encoder = EventEncoder()
    payloads = [encoder.encode(events[i : i + 4096]) for i in range(0, n, 4096)]
    decoder = EventDecoder()

    def msgspec_only() -> None:
        assert sum(len(decoder.decode_batch(p)) for p in payloads) == n

    # The same number of structs with one field each: what building the objects costs when
    # each event is 2 Python objects instead of 12 (the floor under a struct-per-event reader).
    class OneField(msgspec.Struct, array_like=True, gc=False):
        t_ns: int

    one_dec = msgspec.msgpack.Decoder(list[OneField])
    one_payloads = [
        msgspec.msgpack.encode([OneField(e.t_ns) for e in events[i : i + 4096]])
        for i in range(0, n, 4096)
    ]

    def msgspec_one_field() -> None:
        assert sum(len(one_dec.decode(p)) for p in one_payloads) == n

    json_enc = msgspec.json.Encoder()

    def jsonl_write() -> None:
        with open(jsonl, "wb") as f:
            for e in events:
                f.write(json_enc.encode(event_to_dict(e)))
                f.write(b"\n")

    def jsonl_read() -> None:
        with open(jsonl, "rb") as f:
            assert sum(1 for line in f if msgspec.json.decode(line)) == n

    out["recorder_async_s"] = best(
        args.repeat, lambda: anyio.run(record_async, rec, events, version, backend="asyncio")
    )
    out["recorder_only_s"] = best(
        args.repeat,
        lambda: anyio.run(record_consumer_only, rec, events, version, backend="asyncio"),
    )
    out["write_recording_s"] = best(
        args.repeat,
        timed(lambda: write_recording(sync_path, events, overwrite=True, format_version=version)),
    )
    plain = default_header(compression="none")
    out["write_plain_s"] = best(
        args.repeat,
        timed(
            lambda: write_recording(
                plain_path, events, plain, overwrite=True, format_version=version
            )
        ),
    )
    out["read_s"] = best(args.repeat, timed(read_all))
    out["read_batches_s"] = best(args.repeat, timed(read_batches))
    out["msgspec_decode_s"] = best(args.repeat, timed(msgspec_only))
    out["msgspec_one_field_s"] = best(args.repeat, timed(msgspec_one_field))
    out["jsonl_write_s"] = best(args.repeat, timed(jsonl_write))
    out["jsonl_read_s"] = best(args.repeat, timed(jsonl_read))
    out["size_zarc"] = os.path.getsize(sync_path)
    out["size_async_zarc"] = os.path.getsize(rec)
    out["size_plain_zarc"] = os.path.getsize(plain_path)
    out["size_jsonl"] = os.path.getsize(jsonl)

    print(
        f"\n### Recording benchmark ({n:,} GpuSample events, 8 GPUs, format {version}, "
        f"best of {args.repeat})\n"
    )
    print("| path | events/s | file MB |\n|---|---:|---:|")
    rows = [
        ("Recorder write: the consumer (events handed over)", "recorder_only_s", "size_zarc"),
        (
            "Recorder write: end to end (hub.publish per event + consumer)",
            "recorder_async_s",
            "size_async_zarc",
        ),
        ("write_recording (sync, zstd)", "write_recording_s", "size_zarc"),
        ("write_recording (sync, uncompressed)", "write_plain_s", "size_plain_zarc"),
        ("RecordingReader: for event in reader", "read_s", "size_zarc"),
        ("RecordingReader: reader.batches()", "read_batches_s", "size_zarc"),
        ("msgspec decode of the same payloads, in memory (ceiling)", "msgspec_decode_s", None),
        (
            "msgspec decode, same count of 1-field structs (allocation floor)",
            "msgspec_one_field_s",
            None,
        ),
        ("JSON lines write (msgspec.json)", "jsonl_write_s", "size_jsonl"),
        ("JSON lines read (msgspec.json, to dicts)", "jsonl_read_s", "size_jsonl"),
    ]
    for name, key, size_key in rows:
        size = "-" if size_key is None else f"{out[size_key] / 1e6:.1f}"
        print(f"| {name} | {n / out[key]:,.0f} | {size} |")
    print(
        f"\nsize vs JSON lines: {out['size_zarc'] / out['size_jsonl']:.3f} (zstd), "
        f"{out['size_plain_zarc'] / out['size_jsonl']:.3f} (uncompressed)"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
