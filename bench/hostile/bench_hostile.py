"""Reader cost on crafted worst-case recordings: time linear in the size, memory bounded.

    python bench/hostile/bench_hostile.py [--sizes 64,256,1024,4096] [--timeout 120]

Each file (sizes in KiB) is a valid header followed by frame prefixes packed every 24 bytes,
each declaring a payload that runs to the end of the file with a wrong CRC: every one is a
resynchronization candidate whose check would read the rest of the file (the quadratic case
of a naive resync), and a decompression bomb (a 1 GiB zstd frame with a valid CRC) in the
middle. One subprocess per file reads it with ``RecordingReader`` and reports its time and
peak RSS; a file that takes longer than ``--timeout`` is reported as such. Prints a Markdown
table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import zstandard

from zeus_async.store import RecordingHeader
from zeus_async.store.format import FRAME_MAGIC, MAX_FRAME_BYTES, encode_header, pack_frame_prefix

ROOT = Path(__file__).resolve().parents[2]
READ = """
import json, resource, sys, time
from zeus_async.store import RecordingReader
t0 = time.perf_counter()
reader = RecordingReader(sys.argv[1])
n = sum(1 for _ in reader)
print(json.dumps({
    "s": time.perf_counter() - t0,
    "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "events": n,
    "corrupt": len(reader.report.corrupt_frames),
    "last": reader.report.corrupt_frames[-1][1] if reader.report.corrupt_frames else "",
    "unchecked": reader.report.unchecked_candidates,
}))
"""


def _bomb() -> bytes:
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(
        out, size=1024**3, closefd=False
    ) as writer:
        chunk = bytes(1 << 20)
        for _ in range(1024):
            writer.write(chunk)
    stored = out.getvalue()
    return pack_frame_prefix(len(stored), zlib.crc32(stored), 1) + stored


def craft(path: Path, size: int, bomb: bytes) -> None:
    head = encode_header(RecordingHeader(host="h", start_wall_ns=1, pid=1, compression="zstd"))
    body = bytearray()
    half = size // 2
    while len(head) + len(body) < size:
        if half and len(body) >= half:
            body += bomb
            half = 0
            continue
        remaining = size - len(head) - len(body) - 20
        declared = max(0, min(remaining, MAX_FRAME_BYTES))
        body += pack_frame_prefix(declared, 0xDEADBEEF, 1) + b"\x00\x01\x02\x03"
    assert body.count(FRAME_MAGIC) > 0
    path.write_bytes(head + bytes(body))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,256,1024,4096", help="file sizes in KiB")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    bomb = _bomb()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    print(
        "| crafted file | candidates | read time s | µs per KiB | peak RSS MB "
        "| candidates skipped unchecked | reported |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for kib in (int(x) for x in args.sizes.split(",")):
            path = Path(tmp) / f"hostile-{kib}.zarc"
            craft(path, kib * 1024, bomb)
            candidates = path.read_bytes().count(FRAME_MAGIC)
            try:
                proc = subprocess.run(
                    [sys.executable, "-c", READ, str(path)],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=args.timeout,
                    check=True,
                )
            except subprocess.TimeoutExpired:
                print(f"| {kib} KiB | {candidates} | > {args.timeout:g} (stopped) | | | | |")
                continue
            r = json.loads(proc.stdout)
            print(
                f"| {kib} KiB | {candidates} | {r['s']:.3f} | {r['s'] * 1e6 / kib:.0f} "
                f"| {r['rss_mb']:.0f} | {r['unchecked']} "
                f"| {r['corrupt']} damaged range(s); last: {r['last']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
