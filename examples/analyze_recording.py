"""Analyze a recording offline: totals, metrics, windows measured again with the live code.

    python examples/analyze_recording.py run.zarc           # a recording you made
    python examples/analyze_recording.py --make demo.zarc   # record 2 s of simulated GPUs first
    python examples/analyze_recording.py tests/data/sim_windows.zarc   # a committed one

Prints per-device energy (and how it was obtained), the available metrics, every measured
window next to the same window measured again from the file's samples (the live aggregation
code, fed by a replay), and whether the file was complete (a recording cut short by a crash
still yields every complete frame). Then the samples as arrays: a power series as numpy, the
all-GPU power under AIPowerMeter's name, and, when pandas is installed
(``pip install 'zeus_async[arrow]'``), the mean power per GPU from a DataFrame.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from zeus_async.aggregate.windows import ReplayedWindows
from zeus_async.errors import ConfigError
from zeus_async.store import RecordingReader
from zeus_async.store.analysis import Recording


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
    rec = Recording(args.path)
    print(f"recording of {rec.header.host}, devices: {', '.join(rec.devices())}")
    print(f"{rec.duration_s:.2f} s; metrics: {', '.join(rec.metrics())}")
    totals = rec.totals()
    for key, d in totals.devices.items():
        energy = "-" if d.energy_j is None else f"{d.energy_j:.2f} J"
        print(f"  {key:<8} {energy:>12}  mean {d.mean_power_w or 0:.1f} W  ({d.method})")
    print(f"  all GPUs {totals.gpu_energy_j:.2f} J")

    # Any interval, from the samples: here the middle second of GPU 0.
    mid = (rec.start_ns + rec.end_ns) // 2
    e = rec.energy(rec.devices()[0], mid - 500_000_000, mid + 500_000_000)
    print(f"middle second of {rec.devices()[0]}: {e.energy_j:.2f} J ({e.method})")

    # The recorded windows, measured again from the file with the live code.
    reader = RecordingReader(args.path)
    again = ReplayedWindows(reader.header.devices)
    for event in reader:
        again.add(event)
    replayed = {m.window_id: m for m in again.finish()}
    for m in again.recorded:
        joules = sum(m.gpu_energy_j.values())
        r = replayed.get(m.window_id)
        same = "same on replay" if r is not None and r.gpu_energy_j == m.gpu_energy_j else "?"
        print(f"window {m.name}: {m.time_s:.3f} s, {joules:.2f} J on GPUs ({same})")
    report = rec.report
    state = "complete" if report.clean else f"recovered ({report})"
    print(f"{report.frames_ok} frames, {report.events_ok} events, {state}")

    # The samples as arrays (numpy), and AIPowerMeter's names.
    power = rec.series("gpu.power_w", rec.devices("gpu.power_w")[0])
    print(f"{power.device} power: {len(power)} readings, peak {power.values.max():.1f} W")
    draw = rec.series("nvidia_draw_absolute")  # every GPU's power, summed
    print(f"all-GPU power (nvidia_draw_absolute): mean {draw.values.mean():.1f} W")
    try:
        frames = rec.to_pandas()
    except ConfigError as exc:  # pandas/pyarrow not installed: say so, the rest stands
        print(f"DataFrames skipped: {exc}")
    else:
        mean = frames["gpu"].groupby("device", observed=True)["power_w"].mean()
        print(
            "mean power per GPU (pandas): " + ", ".join(f"{k} {v:.1f} W" for k, v in mean.items())
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
