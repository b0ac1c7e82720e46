"""Format 3 (columns) beside format 2 and Parquet, on the same GPU samples, in one run.

``--samples`` GPU samples (8 GPUs at 100 Hz, every field populated; issue 39's stream) are
written once as a format-2 and a format-3 recording and as a zstd Parquet file of the same
columns (``load_columns``' arrays: what a user would have converted to). Each measurement runs
``--repeat`` times, each in a fresh child process (its peak memory its own):

* ``v3``: ``load_columns`` of the format-3 file (arrays, no event objects);
* ``v2``: ``load_columns`` of the format-2 file (the struct path);
* ``parquet``: ``pyarrow.parquet.read_table`` of the Parquet file;
* ``recording``: ``Recording(v3)`` then ``totals()``.

Run: ``.venv/bin/python bench/store/bench_v3.py [--samples 1600000] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

T0 = 1_763_000_000_000_000_000
GPUS = 8


def gpu_samples(samples: int) -> Iterator[Any]:
    from zeus_async.events import GpuSample

    counters = [1.0e6 + 1000.0 * g for g in range(GPUS)]
    for k in range(samples // GPUS):
        t = T0 + k * 10_000_000
        for g in range(GPUS):
            power = 250.0 + ((k * 7 + g * 13) % 97)
            if k % 10 == 0:
                counters[g] += power * 0.1
            yield GpuSample(
                "node-01", t + g * 1000, g, power, 248.5, counters[g], 61.0 + (k % 7), 1.98e9,
                0.97, 42_000_000_000 + k, 700.0,
            )  # fmt: skip


def ensure(directory: Path, samples: int) -> dict[str, Path]:
    from zeus_async.store import RecordingReader, write_recording

    paths = {v: directory / f"v3bench_{samples}.v{v}.zarc" for v in (2, 3)}
    for v, path in paths.items():
        if not path.exists():
            t = time.perf_counter()
            write_recording(path, gpu_samples(samples), format_version=v, overwrite=True)
            print(f"# wrote {path} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    pq_path = directory / f"v3bench_{samples}.parquet"
    if not pq_path.exists():
        import pyarrow as pa
        import pyarrow.parquet as pq

        from zeus_async.store.columns import load_columns

        table = load_columns(RecordingReader(paths[3]), keep_others=False).tables["gpu"]
        arrow = pa.table(dict(table.columns))  # the same columns, as load_columns gives them
        pq.write_table(arrow, pq_path, compression="zstd")
    return {"v2": paths[2], "v3": paths[3], "parquet": pq_path}


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB


def phase(name: str, paths: dict[str, Path]) -> dict[str, Any]:
    import numpy as np  # noqa: F401  (imported before the baseline)
    import pyarrow.parquet as pq

    from zeus_async.store import RecordingReader
    from zeus_async.store.analysis import Recording
    from zeus_async.store.columns import load_columns

    out: dict[str, Any] = {}
    base = _maxrss()
    t = time.perf_counter()
    if name in ("v2", "v3"):
        import tracemalloc

        t = time.perf_counter()
        load = load_columns(RecordingReader(paths[name]), keep_others=False)
        out["seconds"] = time.perf_counter() - t
        # Peak memory of the load two ways. ru_maxrss (the process's resident peak, what the
        # machine must have) of the timed load; and tracemalloc's peak (live allocations,
        # numpy's arrays included) of a second, untimed one. They differ where the load frees
        # memory that the allocator keeps resident: per-frame pieces freed after their
        # concatenation stayed in the heap, so the loads that concatenated traced 1.10x but
        # held 2.0x resident.
        out["rss_peak_mib"] = (_maxrss() - base) / 1024
        tracemalloc.start()
        load_columns(RecordingReader(paths[name]), keep_others=False)
        out["traced_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        table = load.tables["gpu"]
        out["rows"] = len(table)
        out["array_mib"] = table.nbytes / 2**20
    elif name == "parquet":
        arrow = pq.read_table(paths["parquet"])
        out["seconds"] = time.perf_counter() - t
        out["rows"] = arrow.num_rows
        out["array_mib"] = arrow.nbytes / 2**20
    elif name == "recording":
        rec = Recording(paths["v3"])
        out["load_s"] = time.perf_counter() - t
        totals = rec.totals()
        out["seconds"] = time.perf_counter() - t
        out["gpu_energy_j"] = totals.gpu_energy_j
    out["peak_mib"] = (_maxrss() - base) / 1024
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1_600_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/zeus_async_bench"))
    parser.add_argument("--phases", default="v3,parquet,v2,recording")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    paths = ensure(args.dir, args.samples)
    if args.phase:
        print(json.dumps(phase(args.phase, paths)))
        return 0
    results: dict[str, list[dict[str, Any]]] = {}
    names = args.phases.split(",")
    for _ in range(args.repeat):  # interleaved, so a noisy moment hits every phase alike
        for name in names:
            child = subprocess.run(
                [sys.executable, __file__, "--samples", str(args.samples), "--dir",
                 str(args.dir), "--phase", name],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            results.setdefault(name, []).append(json.loads(child.stdout.strip().splitlines()[-1]))
    sizes = {k: p.stat().st_size for k, p in paths.items()}
    n = args.samples
    print(f"\n### {n:,} GPU samples (8 GPUs, 100 Hz, every field); {args.repeat} runs each\n")
    print("| pass | seconds min / median / max | M samples/s (best) | peak MiB (max) | file MB |")
    print("|---|---:|---:|---:|---:|")
    label = {
        "v3": "format 3: load_columns (arrays)",
        "parquet": "pyarrow.parquet.read_table (zstd Parquet)",
        "v2": "format 2: load_columns",
        "recording": "format 3: Recording(path) + totals()",
    }
    size_of = {"v3": "v3", "parquet": "parquet", "v2": "v2", "recording": "v3"}
    for name in names:
        s = sorted(r["seconds"] for r in results[name])
        peak = max(r["peak_mib"] for r in results[name])
        print(
            f"| {label[name]} | {s[0]:.3f} / {statistics.median(s):.3f} / {s[-1]:.3f} | "
            f"{n / s[0] / 1e6:.1f} | {peak:,.0f} | {sizes[size_of[name]] / 1e6:.1f} |"
        )
    if "v3" in results and "parquet" in results:
        v3 = sorted(r["seconds"] for r in results["v3"])
        pq_s = sorted(r["seconds"] for r in results["parquet"])
        print(
            f"\nv3 load vs read_table: {pq_s[0] / v3[0]:.2f}x (best vs best), "
            f"{statistics.median(pq_s) / statistics.median(v3):.2f}x (median vs median); "
            "target >= 1.0x"
        )
        print(f"v3 file vs Parquet: {sizes['v3'] / sizes['parquet']:.2f}x (target <= 1.5x)")
    if "v3" in results:
        arrays = results["v3"][0]["array_mib"]
        peak = max(r["traced_peak_mib"] for r in results["v3"])
        rss = max(r["rss_peak_mib"] for r in results["v3"])
        print(
            f"v3 load peak memory for {arrays:.0f} MiB of arrays: resident (ru_maxrss) "
            f"{rss:.0f} MiB = {rss / arrays:.2f}x, traced (tracemalloc) {peak:.0f} MiB = "
            f"{peak / arrays:.2f}x (target <= 1.5x)"
        )
    if args.json:
        args.json.write_text(json.dumps({"samples": n, "sizes": sizes, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
