"""AIPowerMeter's recorded fields (seed 002) by their own names, in their own units."""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import pytest

from zeus_async.errors import ConfigError
from zeus_async.events import Event, GpuSample, ProcessSample, RaplSample
from zeus_async.store import write_recording
from zeus_async.store.aipowermeter import FIELDS
from zeus_async.store.analysis import Recording

T0 = 1_700_000_000 * 10**9
S = 10**9
H = "node1"

#: Every field name AIPowerMeter's documentation lists as recorded (seed 002).
SEED_NAMES = [
    "per_process_mem_use_abs",
    "per_process_cpu_uses",
    "per_process_mem_use_percent",
    "intel_power",
    "psys_power",
    "uncore_power",
    "per_process_cpu_power",
    "total_cpu_power",
    "per_process_mem_use_uss",
    "nvidia_draw_absolute",
    "nvidia_attributable_power",
    "nvidia_mem_use",
    "nvidia_sm_use",
    "per_gpu_power_draw",
    "per_gpu_attributable_power",
    "per_gpu_estimated_attributable_utilization",
    "cpu_uses",
    "mem_use_abs",
    "mem_use_percent",
    "per_process_dram_power",
    "per_gpu_attributable_mem_use",
    "per_gpu_per_pid_utilization_absolute",
    "per_gpu_absolute_percent_usage",
    "rel_intel_power",
]


def events() -> list[Event]:
    out: list[Event] = []
    energy = {"psys": 0.0, "uncore": 0.0, "core": 0.0, "package": 0.0, "dram": 0.0}
    watts = {"psys": 40.0, "uncore": 5.0, "core": 20.0, "package": 30.0, "dram": 4.0}
    for k in range(11):
        t = T0 + k * S
        for g in range(2):
            out.append(GpuSample(H, t + g, g, power_w=100.0 * (g + 1) + k, utilization_frac=0.5))
        for domain, w in watts.items():
            if k:
                energy[domain] += w
            out.append(RaplSample(H, t + 5, 0, domain, energy[domain], w if k else None))
        out.append(
            ProcessSample(
                H,
                t + 7,
                42,
                cpu_frac=0.125,
                memory_rss_bytes=2000,
                memory_pss_bytes=1000,
                memory_uss_bytes=500,
                memory_frac=0.25,
                cpu_share_frac=0.75,
                cpu_power_w=15.0,
                dram_power_w=1.0,
            )
        )
        for g in range(2):
            out.append(
                ProcessSample(
                    H,
                    t + 7,
                    42,
                    gpu=g,
                    gpu_sm_frac=0.4,
                    gpu_memory_bytes=10**9,
                    attributed_power_w=50.0,
                    gpu_power_share_frac=0.8,
                )
            )
    return out


@pytest.fixture
def rec(tmp_path: Path) -> Recording:
    path = tmp_path / "aipm.zarc"
    write_recording(path, events())
    return Recording(path)


def test_every_seed_name_is_accepted(rec: Recording) -> None:
    assert sorted(SEED_NAMES) == sorted(FIELDS)
    assert rec.aipowermeter_metrics() == list(FIELDS)
    for name in SEED_NAMES:
        devices = rec.devices(name)
        assert devices, name
        scope = FIELDS[name].scope
        if scope == "all":
            series = rec.series(name)
            assert series.device == "all"
        elif scope == "per-gpu":
            series = rec.series(name, "gpu:1")
        else:
            series = rec.series(name, devices[-1])
        assert series.metric == name and len(series) > 0, name


def test_percent_where_the_seed_says_percent(rec: Recording) -> None:
    assert set(rec.series("per_process_cpu_uses", "proc:42").values) == {75.0}
    assert set(rec.series("per_process_mem_use_percent", "proc:42").values) == {25.0}
    assert set(rec.series("mem_use_percent", "proc:42").values) == {25.0}
    assert set(rec.series("cpu_uses", "proc:42").values) == {12.5}
    assert set(rec.series("per_gpu_per_pid_utilization_absolute", "proc:42/gpu:1").values) == {40.0}
    assert set(rec.series("per_gpu_absolute_percent_usage", "gpu:0").values) == {40.0}
    assert set(rec.series("nvidia_sm_use").values) == {80.0}  # 40 % on each of two GPUs
    # bytes stay bytes, fractions the seed calls relative stay fractions
    assert set(rec.series("per_process_mem_use_abs", "proc:42").values) == {1000.0}
    assert set(rec.series("mem_use_abs", "proc:42").values) == {2000.0}
    assert set(rec.series("nvidia_mem_use").values) == {2e9}
    share = rec.series("per_gpu_estimated_attributable_utilization", "gpu:0")
    assert set(share.values) == {0.8}


def test_intel_power_is_psys_plus_uncore_plus_core(rec: Recording) -> None:
    intel = rec.series("intel_power")
    parts = [rec.series(n) for n in ("psys_power", "uncore_power", "total_cpu_power")]
    assert all(np.array_equal(p.t_ns, intel.t_ns) for p in parts)
    assert np.array_equal(intel.values, sum(p.values for p in parts))
    assert set(intel.values) == {65.0}  # 40 + 5 + 20 (core, not package)
    assert set(rec.series("total_cpu_power").values) == {20.0}
    # joules from the RAPL counters: 10 s at 65 W
    assert rec.total("intel_power") == pytest.approx(650.0)
    assert rec.total("rel_intel_power") == pytest.approx(150.0)  # 15 W for 10 s


def test_total_cpu_power_falls_back_to_package(tmp_path: Path) -> None:
    path = tmp_path / "server.zarc"
    only = [e for e in events() if not (isinstance(e, RaplSample) and e.domain != "package")]
    write_recording(path, only)
    rec = Recording(path)
    assert set(rec.series("intel_power").values) == {30.0}
    assert rec.aipowermeter_metrics().count("psys_power") == 0
    with pytest.raises(ConfigError, match="covers no device"):
        rec.series("psys_power")


def test_nvidia_draw_absolute_is_an_all_gpu_series(rec: Recording) -> None:
    series = rec.series("nvidia_draw_absolute")
    gpu0, gpu1 = rec.series("gpu.power_w", "gpu:0"), rec.series("gpu.power_w", "gpu:1")
    # one value per instant either GPU was read while both have readings (gpu:1 starts 1 ns
    # after gpu:0 and ends 1 ns after it): each GPU interpolated there
    assert series.t_ns.tolist() == sorted(
        [T0 + k * S for k in range(1, 11)] + [T0 + k * S + 1 for k in range(10)]
    )
    at = {t: v for t, v in zip(series.t_ns.tolist(), series.values.tolist(), strict=True)}
    for k in range(1, 11):
        t = T0 + k * S
        assert at[t] == pytest.approx(gpu0.values[k] + gpu1.values[k - 1] + (1.0 - 1e-9) * 1.0)
    assert at[T0 + 1] == pytest.approx(100.0 + 1e-9 + 200.0)  # both GPUs, never one alone
    # energy: each GPU over its own samples, so a little more than the series' integral
    assert rec.total("nvidia_draw_absolute") == pytest.approx(rec.total("gpu.power_w"))
    assert rec.total("per_gpu_power_draw", "gpu:1") == pytest.approx(10 * 205.0)


def _staggered(n_gpus: int, offset_ns: int) -> list[Event]:
    """Four 100 W GPUs (and two 30 W RAPL packages) read once a second, each at its own offset:
    GPU g (package p) first at T0 + g * offset, last 10 s later."""
    out: list[Event] = []
    for k in range(11):
        for g in range(n_gpus):
            out.append(GpuSample(H, T0 + k * S + g * offset_ns, g, power_w=100.0))
        for p in range(2):
            t = T0 + k * S + p * offset_ns + 1
            out.append(RaplSample(H, t, p, "package", 30.0 * k, 30.0))
    return out


def test_all_gpu_series_has_points_only_where_every_gpu_has_a_reading(tmp_path: Path) -> None:
    """Issue 34: the all-GPU power dropped GPUs at the edges of a recording (1382.6, 998.7,
    456.1, 385.4 W over its last four points): a GPU before its first or after its last sample
    is unknown, not 0 W."""
    path = tmp_path / "staggered.zarc"
    write_recording(path, sorted(_staggered(4, S // 4), key=lambda e: e.t_ns))
    rec = Recording(path)
    draw = rec.series("nvidia_draw_absolute")
    assert set(draw.values.tolist()) == {400.0}  # four GPUs at 100 W at every point
    assert draw.t_ns[0] == T0 + 3 * S // 4 and draw.t_ns[-1] == T0 + 10 * S  # common span
    # every other all-device series: the RAPL packages, each read at its own offset
    cpu = rec.series("total_cpu_power")
    assert set(cpu.values.tolist()) == {60.0}
    assert cpu.t_ns[0] == T0 + S // 4 + 1 and cpu.t_ns[-1] == T0 + 10 * S + 1
    assert set(rec.series("intel_power").values.tolist()) == {60.0}
    # no instant in common: refused, not a partial sum
    path = tmp_path / "disjoint.zarc"
    write_recording(path, [GpuSample(H, T0, 0, power_w=1.0), GpuSample(H, T0 + S, 0, power_w=1.0),
                           GpuSample(H, T0 + 2 * S, 1, power_w=1.0)])  # fmt: skip
    with pytest.raises(ConfigError, match="no instant where every one has a reading"):
        Recording(path).series("nvidia_draw_absolute")


def test_process_series_count_a_process_0_outside_its_samples_within_its_hosts_tracking(
    tmp_path: Path,
) -> None:
    """A process that has exited draws nothing; a host whose tracking has not started yet is
    unknown: node2's sampler starts 3 s after node1's."""
    events: list[Event] = []
    for k in range(11):
        t = T0 + k * S
        if k <= 5:  # pid 7 on node1 exits after 5 s
            events.append(ProcessSample("node1", t, 7, gpu=0, attributed_power_w=30.0))
        events.append(ProcessSample("node1", t, 8, gpu=0, attributed_power_w=50.0))
        if k >= 3:
            events.append(ProcessSample("node2", t, 9, gpu=0, attributed_power_w=20.0))
    path = tmp_path / "hosts.zarc"
    write_recording(path, events)
    series = Recording(path).series("nvidia_attributable_power")
    assert series.t_ns.tolist() == [T0 + k * S for k in range(3, 11)]
    assert series.values.tolist() == [100.0] * 3 + [70.0] * 5


def test_per_gpu_names_sum_the_processes_on_each_gpu(tmp_path: Path) -> None:
    """AIPowerMeter keys its per-GPU process fields by GPU: the tracked pids summed."""
    events: list[Event] = []
    for k in range(5):
        t = T0 + k * S
        for pid, watts, share in ((7, 30.0, 0.25), (8, 50.0, 0.5)):
            events.append(
                ProcessSample(
                    H, t, pid, gpu=0, attributed_power_w=watts, gpu_power_share_frac=share,
                    gpu_sm_frac=share,
                )
            )  # fmt: skip
    path = tmp_path / "two.zarc"
    write_recording(path, events)
    rec = Recording(path)
    assert rec.devices("per_gpu_attributable_power") == ["gpu:0"]
    assert set(rec.series("per_gpu_attributable_power", "gpu:0").values) == {80.0}
    assert set(rec.series("per_gpu_estimated_attributable_utilization").values) == {0.75}
    assert set(rec.series("per_gpu_absolute_percent_usage", "gpu:0").values) == {75.0}
    assert rec.total("per_gpu_attributable_power", "gpu:0") == pytest.approx(4 * 80.0)
    assert rec.total("per_gpu_attributable_power") == pytest.approx(4 * 80.0)


def test_print_and_duration(rec: Recording) -> None:
    text = str(rec)
    lines = text.splitlines()
    assert "Available metrics :" in lines
    cpu, gpu, exp = lines.index("CPU"), lines.index("GPU"), lines.index("Experiments")
    assert "per_process_cpu_uses" in lines[cpu + 1] and "intel_power" in lines[cpu + 1]
    assert "per_gpu_power_draw" in lines[gpu + 1]
    assert "nvidia_draw_absolute" in lines[exp + 1] and "rel_intel_power" in lines[exp + 1]
    d, start, end = rec.get_duration()
    assert d == rec.duration_s
    assert start == datetime.datetime(2023, 11, 14, 22, 13, 20, tzinfo=datetime.timezone.utc)
    assert (end - start).total_seconds() == pytest.approx(d, abs=1e-6)
    assert start.isoformat(timespec="milliseconds") in lines[0]


def test_errors_name_what_is_missing(rec: Recording, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pass one of: gpu:0, gpu:1"):
        rec.series("per_gpu_attributable_power")
    with pytest.raises(ConfigError, match="pass one of: proc:42/gpu:0, proc:42/gpu:1"):
        rec.series("per_gpu_attributable_mem_use")
    with pytest.raises(ConfigError, match="without a device"):
        rec.series("nvidia_draw_absolute", "gpu:0")
    with pytest.raises(ConfigError, match="use series"):
        rec.total("per_process_cpu_uses")
    path = tmp_path / "gpus.zarc"
    write_recording(path, [e for e in events() if isinstance(e, GpuSample)])
    with pytest.raises(ConfigError, match="process tracking"):
        Recording(path).series("per_process_cpu_power")
