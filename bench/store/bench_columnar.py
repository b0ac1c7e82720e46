"""Recordings as arrays: columnar load, Parquet and CSV, beside the struct reader and msgspec.

One recording of ``--samples`` GPU samples (8 GPUs at 100 Hz, every field populated, energy
counter updating every 100 ms) plus RAPL package/DRAM samples at 10 Hz is written once (cached
under ``--dir``). Each measurement then runs in a fresh child process, so its peak memory is
its own (``ru_maxrss`` after the phase minus after the imports):

* ``zstd``: expanding every frame payload, nothing decoded (the floor of any reader here);
* ``msgspec``: msgspec decoding the expanded payloads into the event structs (its ceiling);
* ``struct``: :class:`RecordingReader` reading the file into structs (target: >= 60 % of
  msgspec in the same run);
* ``columns``: :func:`load_columns`, the file into one numpy array per field (target:
  >= 10 M samples/s, peak memory <= 1.5x the arrays, issue 39);
* ``recording``: ``Recording(path)``, then ``totals()`` and one ``energy()`` query;
* ``parquet`` / ``csv``: the exports, their sizes, and pandas reading each back.

Run: ``.venv/bin/python bench/store/bench_columnar.py [--samples 10000000] [--json PATH]``. The
``recording`` pass also runs against an older checkout of the package, for a before/after:
``PYTHONPATH=/path/to/old/checkout .venv/bin/python bench/store/bench_columnar.py
--phases recording``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

T0 = 1_763_000_000_000_000_000
GPUS = 8


def events(samples: int) -> Iterator[Any]:
    from zeus_async.events import GpuSample, RaplSample

    ticks = samples // GPUS
    counters = [1.0e6 + 1000.0 * g for g in range(GPUS)]
    package = dram = 0.0
    for k in range(ticks):
        t = T0 + k * 10_000_000
        for g in range(GPUS):
            power = 250.0 + ((k * 7 + g * 13) % 97)
            if k % 10 == 0:
                counters[g] += power * 0.1
            yield GpuSample(
                "node-01",
                t + g * 1000,
                g,
                power_w=power,
                avg_power_w=248.5,
                energy_j=counters[g],
                temperature_c=61.0 + (k % 7),
                sm_clock_hz=1.98e9,
                utilization_frac=0.97,
                memory_used_bytes=42_000_000_000 + k,
                power_limit_w=700.0,
            )
        if k % 10 == 0:
            package += 12.0
            dram += 1.5
            yield RaplSample("node-01", t + 9000, 0, "package", package, 120.0 if k else None)
            yield RaplSample("node-01", t + 9500, 0, "dram", dram, 15.0 if k else None)


def ensure_recording(directory: Path, samples: int, version: int = 3) -> Path:
    from zeus_async.store import write_recording

    path = directory / f"columnar_{samples}.v{version}.zarc"
    if not path.exists():
        t = time.perf_counter()
        write_recording(
            path.with_suffix(".tmp"), events(samples), overwrite=True, format_version=version
        )
        path.with_suffix(".tmp").rename(path)
        print(f"# wrote {path} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return path


def _payloads(path: Path) -> list[bytes]:
    from zeus_async.store import RecordingReader
    from zeus_async.store.format import FRAME_PREFIX_SIZE, unpack_frame_prefix

    reader = RecordingReader(path)
    data = path.read_bytes()
    out = []
    for offset, _ in reader.frame_index():
        prefix = unpack_frame_prefix(data, offset)
        assert prefix is not None
        start = offset + FRAME_PREFIX_SIZE
        out.append(data[start : start + prefix.payload_len])
    del data
    return out


def phase(name: str, path: Path, work: Path) -> dict[str, Any]:
    """Run one measurement here (in the child); return its figures."""
    import numpy as np
    import pandas as pd

    from zeus_async.events import EventDecoder
    from zeus_async.store import RecordingReader
    from zeus_async.store.analysis import Recording, export_csv
    from zeus_async.store.format import PayloadCodec

    out: dict[str, Any] = {}
    reader = RecordingReader(path)
    codec = PayloadCodec(reader.header.compression)
    if reader.format_version >= 3 and name in ("zstd", "floor"):
        # Format 3: expanding every block of every frame (zstd), nothing decoded; "floor" adds
        # what any columnar load must also do: view each column and concatenate the frames'.
        from zeus_async.store.columnar import _DIR_LEN, _blocks, _dir_decoder

        stored = _payloads(path)
        dctx = codec.decompressor()
        t = time.perf_counter()
        parts: dict[tuple[int, int], list[Any]] = {}
        for p in stored:
            view = memoryview(p)
            (dir_len,) = _DIR_LEN.unpack_from(view, 0)
            at = _DIR_LEN.size + dir_len
            directory = _dir_decoder.decode(view[_DIR_LEN.size : at])
            for k, block in enumerate(_blocks(directory)):
                chunk = view[at : at + block.stored]
                at += block.stored
                raw = dctx.decompress(chunk) if block.codec == 1 else chunk
                if name == "floor":
                    parts.setdefault((len(directory.groups), k), []).append(
                        np.frombuffer(raw, dtype=np.uint8)
                    )
        if name == "floor":
            arrays = [np.concatenate(v) for v in parts.values()]
            out["bytes_expanded"] = sum(a.nbytes for a in arrays)
        out["seconds"] = time.perf_counter() - t
        return out
    if name in ("zstd", "msgspec"):
        if reader.format_version >= 3:
            # msgspec's decode of the same events (the format-2 file's payloads)
            path = ensure_recording(path.parent, int(path.name.split("_")[1].split(".")[0]), 2)
            codec = PayloadCodec(RecordingReader(path).header.compression)
        stored = _payloads(path)
        t = time.perf_counter()
        expanded = [codec.expand(p) for p in stored]
        out["zstd_s"] = time.perf_counter() - t
        if name == "msgspec":
            decoder = EventDecoder()
            base = _maxrss()
            t = time.perf_counter()
            n = 0
            for p in expanded:
                n += len(decoder.decode_batch(p))
            out["seconds"] = time.perf_counter() - t
            out["events"] = n
            out["peak_mib"] = (_maxrss() - base) / 1024
        else:
            out["seconds"] = out["zstd_s"]
        return out
    base = _maxrss()
    t = time.perf_counter()
    if name == "struct":
        n = sum(len(b) for b in RecordingReader(path).batches())
        out["events"] = n
    elif name == "columns":
        from zeus_async.store.columns import load_columns

        load = load_columns(RecordingReader(path), keep_others=False)
        out["seconds"] = time.perf_counter() - t
        out["samples"] = sum(len(tb) for tb in load.tables.values())
        out["array_mib"] = sum(tb.nbytes for tb in load.tables.values()) / 2**20
    elif name == "recording":
        rec = Recording(path)
        out["load_s"] = time.perf_counter() - t
        t1 = time.perf_counter()
        totals = rec.totals()
        out["totals_s"] = time.perf_counter() - t1
        out["gpu_energy_j"] = totals.gpu_energy_j
        first, last = totals.devices["gpu:0"].start_ns, totals.devices["gpu:0"].end_ns
        t1 = time.perf_counter()
        e = rec.energy("gpu:3", first + (last - first) // 3, first + (last - first) // 2)
        out["energy_query_s"] = time.perf_counter() - t1
        out["energy_query_j"] = e.energy_j
        t1 = time.perf_counter()
        s = rec.series("gpu.power_w", "gpu:5")
        out["series_s"] = time.perf_counter() - t1
        out["series_len"] = len(s)
    elif name == "colframes":
        # What a recording could load at if its frames held columns (not a format of ours yet):
        # the same GPU samples as frames of 4,096 rows, each field's values as raw bytes,
        # zstd level 1; timed: expand every frame and view its columns (np.frombuffer), then
        # one array per field.
        import zstandard

        from zeus_async.store.columns import load_columns

        table = load_columns(RecordingReader(path), keep_others=False).tables["gpu"]
        names = [n for n in table.columns if n != "host"]
        blocks = []
        level = zstandard.ZstdCompressor(level=1)
        for i in range(0, len(table), 4096):
            raw = b"".join(table.columns[n][i : i + 4096].tobytes() for n in names)
            blocks.append((min(4096, len(table) - i), level.compress(raw)))
        dtypes = [table.columns[n].dtype for n in names]
        del table
        expand = zstandard.ZstdDecompressor()
        base = _maxrss()
        t = time.perf_counter()
        parts: list[list[Any]] = [[] for _ in names]
        for rows, block in blocks:
            raw = expand.decompress(block)
            at = 0
            for k, dtype in enumerate(dtypes):
                parts[k].append(np.frombuffer(raw, dtype=dtype, count=rows, offset=at))
                at += rows * dtype.itemsize
        arrays = [np.concatenate(p) for p in parts]
        out["seconds"] = time.perf_counter() - t
        out["samples"] = len(arrays[0])
        out["bytes"] = sum(len(b) for _, b in blocks)
    elif name == "parquet":
        from zeus_async.store.columns import export_parquet

        target = work / "columnar_parquet"
        written = export_parquet(path, target, overwrite=True)
        out["export_s"] = time.perf_counter() - t
        out["bytes"] = sum(f.stat().st_size for f in target.glob("*.parquet"))
        out["rows"] = written
        base = _maxrss()
        t1 = time.perf_counter()
        frame = pd.read_parquet(target / "gpu.parquet")
        out["read_s"] = time.perf_counter() - t1
        out["read_rows"] = len(frame)
        out["read_peak_mib"] = (_maxrss() - base) / 1024
    elif name == "csv":
        target = work / "columnar.csv"
        n = export_csv(path, target)
        out["export_s"] = time.perf_counter() - t
        out["bytes"] = target.stat().st_size
        base = _maxrss()
        t1 = time.perf_counter()
        frame = pd.read_csv(target, low_memory=False)
        out["read_s"] = time.perf_counter() - t1
        out["read_rows"] = len(frame)
        out["read_peak_mib"] = (_maxrss() - base) / 1024
        del n
    else:
        raise SystemExit(f"unknown phase {name}")
    out.setdefault("seconds", time.perf_counter() - t)
    out["peak_mib"] = (_maxrss() - base) / 1024
    return out


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


PHASES = (
    "zstd",
    "floor",
    "msgspec",
    "struct",
    "columns",
    "recording",
    "colframes",
    "parquet",
    "csv",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/zeus_async_bench"))
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--format-version", type=int, choices=(2, 3), default=3)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = ensure_recording(args.dir, args.samples, args.format_version)
    if args.phase:
        print(json.dumps(phase(args.phase, path, args.dir)))
        return 0
    results: dict[str, Any] = {
        "samples": args.samples,
        "file_bytes": path.stat().st_size,
        "format_version": args.format_version,
    }
    from zeus_async.store import RecordingReader

    results["events"] = RecordingReader(path).report.events_ok or None
    for name in args.phases.split(","):
        child = subprocess.run(
            [sys.executable, __file__, "--samples", str(args.samples), "--dir", str(args.dir),
             "--format-version", str(args.format_version), "--phase", name],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results[name] = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"# {name}: {results[name]}", file=sys.stderr)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def report(r: dict[str, Any]) -> None:
    n = r["samples"]
    events = r.get("msgspec", {}).get("events") or r.get("struct", {}).get("events") or n
    mib = r["file_bytes"] / 2**20
    print(f"recording: {n:,} GPU samples ({events:,} events with RAPL), {mib:.1f} MiB (zstd)")
    print()
    print("| pass | seconds | events/s | peak memory |")
    print("|---|---:|---:|---:|")

    def row(label: str, seconds: float, peak: float | None) -> None:
        rate = events / seconds
        mem = "-" if peak is None else f"{peak:,.0f} MiB"
        print(f"| {label} | {seconds:.2f} | {rate / 1e6:.2f} M | {mem} |")

    if "zstd" in r:
        row("zstd expand only (floor of any reader)", r["zstd"]["seconds"], None)
    if "floor" in r:
        row("zstd expand + concatenate every column (v3 floor)", r["floor"]["seconds"], None)
    if "msgspec" in r:
        row("msgspec decode to structs, in memory (ceiling)", r["msgspec"]["seconds"], None)
    if "struct" in r:
        s = r["struct"]
        row("struct reader (RecordingReader.batches)", s["seconds"], s["peak_mib"])
    if "columns" in r:
        c = r["columns"]
        row("columnar load (load_columns)", c["seconds"], c["peak_mib"])
    if "recording" in r:
        rec = r["recording"]
        row("Recording(path) (columns + devices)", rec["load_s"], rec["peak_mib"])
    print()
    if "msgspec" in r and "struct" in r:
        share = r["msgspec"]["seconds"] / r["struct"]["seconds"]
        print(f"struct reader at {share:.0%} of msgspec's decode (target >= 60 %)")
    if "columns" in r:
        c = r["columns"]
        print(
            f"columnar load: {c['samples'] / c['seconds'] / 1e6:.2f} M samples/s "
            "(target >= 10 M); "
            f"arrays {c['array_mib']:.0f} MiB, peak {c['peak_mib']:.0f} MiB = "
            f"{c['peak_mib'] / c['array_mib']:.2f}x the arrays (target <= 1.5x)"
        )
    if "colframes" in r:
        c = r["colframes"]
        print(
            f"floor of a columnar frame format (prototype, GPU samples only): "
            f"{c['samples'] / c['seconds'] / 1e6:.1f} M samples/s, "
            f"{c['bytes'] / 2**20:.0f} MiB for the GPU samples"
        )
    if "recording" in r:
        rec = r["recording"]
        print(
            f"Recording: totals() {rec['totals_s']:.2f} s (every device's estimator built from "
            f"the arrays), one energy() query {rec['energy_query_s'] * 1e3:.2f} ms, one series "
            f"{rec['series_s'] * 1e3:.1f} ms ({rec['series_len']:,} values)"
        )
    if "parquet" in r or "csv" in r:
        print()
        print("| format | export s | size | vs recording | pandas read s | pandas peak |")
        print("|---|---:|---:|---:|---:|---:|")
        for name in ("parquet", "csv"):
            if name not in r:
                continue
            x = r[name]
            print(
                f"| {name} | {x['export_s']:.1f} | {x['bytes'] / 2**20:,.0f} MiB | "
                f"{x['bytes'] / r['file_bytes']:.2f}x | {x['read_s']:.2f} | "
                f"{x['read_peak_mib']:,.0f} MiB |"
            )
        print(f"| recording (format {r['format_version']}) | - | {mib:,.0f} MiB | 1.00x | - | - |")


if __name__ == "__main__":
    raise SystemExit(main())
