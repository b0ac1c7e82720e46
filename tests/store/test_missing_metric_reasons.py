"""A metric a recording lacks is explained by its real cause (issue 34 item 6).

A recording made with process tracking on a machine without RAPL (a VM, or no permission to
read the counters) has process samples but no CPU power: the error must say that CPU power is
attributed from RAPL and that RAPL was not readable, not ask for process tracking.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zeus_async.errors import ConfigError
from zeus_async.events import Event, GpuSample, ProcessSample, RaplSample
from zeus_async.store import write_recording
from zeus_async.store.analysis import Recording

T0 = 1_700_000_000 * 10**9
S = 10**9
H = "node1"

NO_RAPL = (
    "it holds no RAPL readings: CPU energy was not readable on the machine that recorded it "
    "(no RAPL, as in most virtual machines, or no permission to read it)"
)
SHARE = "a process's CPU and DRAM power are its shares of the RAPL power, and "


def _write(path: Path, *, processes: bool, rapl: bool) -> Recording:
    """Two GPUs for 3 s; a tracked process (host side only: it runs on no GPU) whose CPU power
    is attributed only when RAPL is there, as the process sampler does."""
    events: list[Event] = []
    for k in range(4):
        t = T0 + k * S
        events += [GpuSample(H, t + g, g, power_w=100.0, energy_j=100.0 * k) for g in range(2)]
        if rapl:
            events.append(RaplSample(H, t + 5, 0, "package", 30.0 * k, 30.0 if k else None))
        if processes:
            events.append(
                ProcessSample(
                    H,
                    t + 7,
                    42,
                    cpu_frac=0.125 if k else None,
                    memory_rss_bytes=2000,
                    cpu_share_frac=0.5 if k else None,
                    cpu_power_w=15.0 if rapl and k else None,
                    cpu_energy_j=15.0 * k if rapl else None,
                )
            )
    write_recording(path, events)
    return Recording(path)


def test_no_cpu_power_without_rapl_names_rapl_not_process_tracking(tmp_path: Path) -> None:
    rec = _write(tmp_path / "vm.zarc", processes=True, rapl=False)
    path = tmp_path / "vm.zarc"
    reads = (
        "'per_process_cpu_power' (CPU power attributed to each process) reads "
        f"proc.cpu_power_w, which {path} does not hold"
    )
    for call in (
        lambda: rec.total("per_process_cpu_power"),
        lambda: rec.series("per_process_cpu_power", "proc:42"),
    ):
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == f"{reads} ({SHARE}{NO_RAPL})"
    with pytest.raises(ConfigError) as info:
        rec.total("proc.cpu_power_w")
    assert str(info.value) == (
        f"unknown metric 'proc.cpu_power_w' in {path} ({SHARE}{NO_RAPL}); available: "
        "gpu.power_w, gpu.energy_j, proc.cpu_frac, proc.memory_rss_bytes, proc.cpu_share_frac"
    )
    with pytest.raises(ConfigError) as info:
        rec.series("intel_power")
    assert str(info.value) == (
        "'intel_power' (RAPL total: psys + uncore + total_cpu) reads rapl.power_w, which "
        f"{path} does not hold ({NO_RAPL})"
    )
    # What needs no RAPL is there.
    assert rec.total("gpu.energy_j") == pytest.approx(600.0)
    assert list(rec.series("per_process_cpu_uses", "proc:42").values) == [50.0, 50.0, 50.0]


def test_other_missing_process_metrics_name_their_cause(tmp_path: Path) -> None:
    rec = _write(tmp_path / "host.zarc", processes=True, rapl=True)
    assert rec.total("per_process_cpu_power") == pytest.approx(30.0)  # 15 W from 1 s to 3 s
    with pytest.raises(ConfigError) as info:
        rec.series("per_gpu_attributable_power")
    assert str(info.value).endswith(
        "does not hold (no tracked process ran on a GPU while it was recorded)"
    )

    gpus = _write(tmp_path / "gpus.zarc", processes=False, rapl=False)
    with pytest.raises(ConfigError) as info:
        gpus.series("per_process_cpu_uses")
    assert str(info.value).endswith("does not hold (record with process tracking)")
    with pytest.raises(ConfigError) as info:
        gpus.total("per_process_cpu_power")
    assert str(info.value).endswith(
        f"does not hold (record with process tracking, where RAPL is readable: {SHARE}{NO_RAPL})"
    )
    with pytest.raises(ConfigError) as info:
        gpus.total("gpu.avg_power_w")  # a real field, never recorded: nothing more to say
    assert str(info.value) == (
        f"unknown metric 'gpu.avg_power_w' in {tmp_path / 'gpus.zarc'}; available: "
        "gpu.power_w, gpu.energy_j"
    )
