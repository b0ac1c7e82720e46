"""Cost of one redraw of ``monitor``'s terminal view (rich), per terminal size.

Builds the view of 8 GPUs and N tracked processes and renders it, as ``LiveView.update`` does,
into a console of the given size writing to a null device; beside it, the one line written per
refresh when the output is not a terminal. Prints a table of medians.

    .venv/bin/python bench/observability/bench_live_view.py [--repeat 200] [--processes 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from rich.console import Console

from zeus_async.aggregate import LiveTotals
from zeus_async.cli.monitor import live_view, render_line
from zeus_async.cli.processes import ProcessTable
from zeus_async.events import GpuSample, ProcessSample


def _state(gpus: int, processes: int) -> tuple[LiveTotals, ProcessTable]:
    totals = LiveTotals()
    for t in (0, 10**9):
        for g in range(gpus):
            totals.add(
                GpuSample(
                    "h", t, g, power_w=300.0 + g, energy_j=1e6 + t / 1e7, temperature_c=60,
                    sm_clock_hz=1.98e9, utilization_frac=0.9, memory_used_bytes=2**36,
                    power_limit_w=700, avg_power_w=299.0,
                )
            )  # fmt: skip
    table = ProcessTable()
    for pid in range(1000, 1000 + processes):
        table.add(ProcessSample("h", 0, pid, cpu_frac=0.5, memory_rss_bytes=2**30))
    return totals, table


def _median_ms(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--processes", type=int, default=50)
    args = parser.parse_args()
    totals, table = _state(8, args.processes)
    print(f"8 GPUs, {args.processes} processes, median of {args.repeat} redraws")
    print(f"{'view':<28}{'ms per redraw':>14}{'CPU at 0.5 s refresh':>22}")
    with open(os.devnull, "w") as null:
        for width, height in ((80, 24), (140, 40), (200, 60)):
            console = Console(file=null, width=width, height=height, force_terminal=True)

            def redraw(w: int = width, h: int = height, c: Console = console) -> None:
                c.print(live_view(totals, table, 12.3, w, h, title="bench"))

            ms = _median_ms(redraw, args.repeat)
            print(f"{f'terminal {width}x{height}':<28}{ms:>14.2f}{ms / 500 * 100:>21.2f}%")
        ms = _median_ms(lambda: null.write(render_line(totals, 12.3) + "\n"), args.repeat)
        print(f"{'one line (not a terminal)':<28}{ms:>14.3f}{ms / 500 * 100:>21.3f}%")


if __name__ == "__main__":
    main()
