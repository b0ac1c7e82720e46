"""The real-GPU check (bench/hardware/bench_real_gpu.py) runs end to end, here on the simulator.

It is written for the sessions that are lent a GPU machine, which are rare: this keeps it from
rotting in between. Real subprocess, real clock, a few seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "hardware" / "bench_real_gpu.py"


def test_the_real_gpu_check_reports_every_part_and_restores_the_power_limit(
    tmp_path: Path,
) -> None:
    out = tmp_path / "report.md"
    env = {k: v for k, v in os.environ.items() if k != "ZEUS_ASYNC_SIM"}
    args = ["--sim", "--seconds", "4", "--phase", "1", "--calls", "20", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    assert report.strip() == proc.stdout.strip()
    for heading in ("## Machine", "## NVML call cost", "## Under load", "## Power limit"):
        assert heading in report
    # The simulator refreshes every 100 ms, exactly; change times are sample stamps, off by
    # up to a tick (and a stall) each, so the mean over a few seconds is close, the median exact.
    row = re.search(r"\| energy_j \| (\d+) \| ([\d.]+) \| (\d+) \|", report)
    assert row, report
    assert int(row[1]) >= 20 and abs(float(row[2]) - 100.0) < 2.0 and row[3] == "100"
    assert "| adaptive reads |" in report and "vs truth: median" in report
    # Three phases measured, and the limit in force before is the one left afterwards.
    assert "| minimum | 200 | 200 |" in report
    assert "Limit in force afterwards: 700 W (before: 700 W)" in report
