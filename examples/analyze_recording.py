"""Read a recording offline and aggregate it with the same code the live monitor uses.

    python examples/analyze_recording.py run.zarc           # a recording you made
    python examples/analyze_recording.py --make demo.zarc   # record 2 s of simulated GPUs first

Prints per-device energy (and how it was obtained), every measured window, and whether the file
was complete (a recording cut short by a crash still yields every complete frame).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from zeus_async.aggregate import LiveTotals
from zeus_async.cli import render_totals
from zeus_async.events import Measurement
from zeus_async.store import RecordingReader


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--make", action="store_true", help="record 2 s of simulated GPUs first")
    args = parser.parse_args()
    if args.make:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "zeus_async",
                "monitor",
                "--backend",
                "sim",
                "--duration",
                "2",
                "--record",
                args.path,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    reader = RecordingReader(args.path)
    print(
        f"recording of {reader.header.host}, devices: "
        f"{', '.join(d.key for d in reader.header.devices)}"
    )
    totals = LiveTotals()
    windows = []
    for event in reader:
        totals.add(event)  # the live monitor's aggregation, fed from the file
        if isinstance(event, Measurement):
            windows.append(event)
    print("\n".join(render_totals(totals)))
    for m in windows:
        joules = sum(m.gpu_energy_j.values())
        print(f"window {m.name}: {m.time_s:.3f} s, {joules:.2f} J on GPUs")
    report = reader.report
    state = "complete" if report.clean else f"recovered ({report})"
    print(f"{report.frames_ok} frames, {report.events_ok} events, {state}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
