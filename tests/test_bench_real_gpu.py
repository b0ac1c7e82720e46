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


def test_the_amd_path_runs_on_sim_amdsmi_and_restores_the_power_cap(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    env = {k: v for k, v in os.environ.items() if k != "ZEUS_ASYNC_SIM"}
    args = ["--sim", "--backend", "amd", "--seconds", "4", "--phase", "1", "--calls", "20"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = out.read_text()
    assert report.strip() == proc.stdout.strip()
    for heading in ("## Machine", "## amdsmi call cost", "## Under load", "## Power limit"):
        assert heading in report
    assert "NVML" not in report
    # What the amd backend makes of the simulated MI300X, through the devices API.
    assert "| GPU | AMD Instinct MI300X (simulated) |" in report
    assert "| power scope | socket |" in report
    assert "power_cap=True, clocks=False" in report
    assert "| power cap min / default / max W | 400.0 / 750.0 / 750.0 |" in report
    # Each raw amdsmi call was timed (none refused).
    for call in ("amdsmi_get_power_info", "amdsmi_get_energy_count", "amdsmi_get_power_cap_info"):
        assert re.search(rf"\| {call} \| [\d.]+ \| [\d.]+ \|", report), call
    # MI300: current_socket_power (power_w) only, refreshed every ms by the simulator (the
    # SMU's socket power): it changes at every 10 ms read.
    row = re.search(r"\| power_w \| (\d+) \| ([\d.]+) \| (\d+) \|", report)
    assert row, report
    assert int(row[1]) >= 20 and row[3] == "10"
    assert "| avg_power_w |" not in report and "average power (trapezoid)" not in report
    # The counter (1 ms updates) passed its start check under the random load (power
    # integrated across the check) and changes at every 10 ms read.
    assert "| energy method | counter |" in report, report
    assert "failed its start check" not in report
    row = re.search(r"\| energy_j \| (\d+) \| ([\d.]+) \| (\d+) \|", report)
    assert row and row[3] == "10", report
    assert "| adaptive reads |" in report and "vs truth: median" in report
    # The cap at its minimum, then the one in force before, left in force.
    assert "| minimum | 400 | 400 |" in report
    assert "Limit in force afterwards: 750 W (before: 750 W)" in report
