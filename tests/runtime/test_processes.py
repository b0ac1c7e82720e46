"""Per-process metrics: attribution arithmetic, tracked sets, the sampler in a runtime, psutil."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import anyio
import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices.base import GpuProcesses
from zeus_async.devices.processes import HostStat, ProcessStat, PsutilSource
from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload
from zeus_async.errors import ConfigError, NotSupportedError
from zeus_async.events import GpuSample, ProcessSample, RaplSample
from zeus_async.runtime import ProcessTracking, Runtime
from zeus_async.runtime.hub import Hub
from zeus_async.runtime.processes import EnergyMeter, ProcessAttributor, ProcessSampler
from zeus_async.testing.fakes import FakeProcessSource

GIB = 1 << 30
S = 1_000_000_000
T0 = 1_760_000_000 * S


def by_key(samples: list[ProcessSample]) -> dict[tuple[int, int | None], ProcessSample]:
    return {(s.pid, s.gpu): s for s in samples}


# -- attribution arithmetic against hand-computed values ----------------------------------------


def test_attribution_over_three_periods() -> None:
    att = ProcessAttributor("h")
    host = HostStat(cpu_busy_s=100.0, cpu_count=4, memory_total_bytes=16 * GIB,
                    memory_used_bytes=8 * GIB)  # fmt: skip
    procs = {
        10: ProcessStat(5.0, 2 * GIB, 1 * GIB, GIB // 2),
        11: ProcessStat(1.0, 1 * GIB, None, None),
    }
    meter = {
        ("package", 0): (T0, 1000.0),
        ("package", 1): (T0, 500.0),
        ("dram", 0): (T0, 100.0),
        ("gpu", 0): (T0, 5000.0),
    }
    gpu0 = GpuProcesses({10: 4 * GIB, 11: 2 * GIB, 99: 2 * GIB}, {10: 0.5, 99: 0.25}, 1)
    first = by_key(att.tick(T0, host, procs, {0: gpu0}, {10, 11}, meter))
    assert set(first) == {(10, None), (11, None), (10, 0), (11, 0)}
    p10 = first[(10, None)]
    # First sample: memory only; rates unknown, cumulative energies start at zero.
    assert (p10.cpu_frac, p10.cpu_share_frac, p10.cpu_power_w, p10.dram_power_w) == (None,) * 4
    assert (p10.cpu_energy_j, p10.dram_energy_j) == (0.0, 0.0)
    assert p10.memory_frac == 1 / 16  # PSS / physical memory
    assert (p10.memory_rss_bytes, p10.memory_pss_bytes, p10.memory_uss_bytes) == (
        2 * GIB,
        GIB,
        GIB // 2,
    )
    assert first[(11, None)].memory_frac == 1 / 16  # RSS when PSS is unknown
    g10, g11 = first[(10, 0)], first[(11, 0)]
    assert (g10.gpu_sm_frac, g11.gpu_sm_frac) == (0.5, 0.0)
    assert (g10.gpu_sm_share_frac, g11.gpu_sm_share_frac) == (1.0, 0.0)  # among tracked pids
    assert (g10.gpu_memory_share_frac, g11.gpu_memory_share_frac) == (4 / 6, 2 / 6)
    assert (g10.gpu_power_share_frac, g11.gpu_power_share_frac) == (0.5 / 0.75, 0.0)
    assert (g10.attributed_power_w, g10.attributed_energy_j) == (None, 0.0)

    # Period 2 (2 s): 4 busy CPU seconds on the machine, pid 10 used 2, pid 11 used 0.5.
    host = host._replace(cpu_busy_s=104.0)
    procs = {10: procs[10]._replace(cpu_s=7.0), 11: procs[11]._replace(cpu_s=1.5)}
    meter = {
        ("package", 0): (T0 + 2 * S, 1300.0),
        ("package", 1): (T0 + 2 * S, 600.0),  # 400 J in 2 s: 200 W over both packages
        ("dram", 0): (T0 + 2 * S, 120.0),  # 20 J: 10 W
        ("gpu", 0): (T0 + 2 * S, 5800.0),  # 800 J: 400 W
    }
    gpu0 = GpuProcesses({10: 4 * GIB, 11: 2 * GIB, 99: 2 * GIB}, {10: 0.6, 11: 0.2, 99: 0.2}, 2)
    second = by_key(att.tick(T0 + 2 * S, host, procs, {0: gpu0}, {10, 11}, meter))
    p10, p11 = second[(10, None)], second[(11, None)]
    assert p10.cpu_frac == pytest.approx(2 / (2 * 4))
    assert p10.cpu_share_frac == pytest.approx(0.5)
    assert p10.cpu_power_w == pytest.approx(100.0)
    assert p10.cpu_energy_j == pytest.approx(200.0)
    assert p10.dram_power_w == pytest.approx(10 / 8)  # PSS 1 GiB of 8 GiB in use
    assert p10.dram_energy_j == pytest.approx(20 / 8)
    assert p11.cpu_frac == pytest.approx(0.5 / 8)
    assert p11.cpu_share_frac == pytest.approx(0.125)
    assert p11.cpu_power_w == pytest.approx(25.0)
    assert p11.cpu_energy_j == pytest.approx(50.0)
    g10, g11 = second[(10, 0)], second[(11, 0)]
    assert g10.gpu_power_share_frac == pytest.approx(0.6)
    assert g11.gpu_power_share_frac == pytest.approx(0.2)
    assert g10.gpu_sm_share_frac == pytest.approx(0.75)  # 0.6 of the tracked 0.8
    assert g10.attributed_power_w == pytest.approx(240.0)
    assert g10.attributed_energy_j == pytest.approx(480.0)
    assert g11.attributed_power_w == pytest.approx(80.0)
    assert g11.attributed_energy_j == pytest.approx(160.0)

    # Period 3: pid 11 is gone; the GPU is idle, so its power is split by memory held.
    procs = {10: procs[10]._replace(cpu_s=7.0)}
    host = host._replace(cpu_busy_s=104.0)  # an idle machine: no share to give
    meter = {
        ("package", 0): (T0 + 4 * S, 1300.0),
        ("package", 1): (T0 + 4 * S, 600.0),
        ("dram", 0): (T0 + 4 * S, 120.0),
        ("gpu", 0): (T0 + 4 * S, 6000.0),  # 200 J: 100 W
    }
    gpu0 = GpuProcesses({10: 4 * GIB, 99: 4 * GIB}, {}, 3)
    third = by_key(att.tick(T0 + 4 * S, host, procs, {0: gpu0}, {10}, meter))
    assert set(third) == {(10, None), (10, 0)}
    assert third[(10, None)].cpu_share_frac == 0.0
    assert third[(10, None)].cpu_energy_j == pytest.approx(200.0)  # unchanged running total
    g10 = third[(10, 0)]
    assert g10.gpu_sm_share_frac is None  # no tracked SM use to share
    assert g10.gpu_power_share_frac == 0.5
    assert g10.attributed_power_w == pytest.approx(50.0)
    assert g10.attributed_energy_j == pytest.approx(580.0)


def test_idle_gpu_without_memory_figures_splits_power_equally() -> None:
    att = ProcessAttributor("h")
    host = HostStat(0.0, 1, GIB, GIB)
    reading = GpuProcesses({1: None, 2: None, 3: None, 4: None}, {}, 0)
    meter0 = {("gpu", 0): (T0, 0.0)}
    att.tick(T0, host, {}, {0: reading}, {1, 2}, meter0)
    meter1 = {("gpu", 0): (T0 + S, 80.0)}
    out = by_key(att.tick(T0 + S, host, {}, {0: reading}, {1, 2}, meter1))
    assert set(out) == {(1, 0), (2, 0)}  # a tracked pid on a GPU needs no host-side reading
    assert out[(1, 0)].gpu_power_share_frac == 0.25
    assert out[(1, 0)].attributed_power_w == pytest.approx(20.0)
    assert out[(1, 0)].gpu_memory_share_frac is None


def test_without_rapl_cpu_power_is_none_not_zero() -> None:
    att = ProcessAttributor("h")
    host = HostStat(10.0, 2, 4 * GIB, 2 * GIB)
    att.tick(T0, host, {5: ProcessStat(1.0, GIB, GIB, GIB)}, {}, {5}, {})
    out = att.tick(T0 + S, host._replace(cpu_busy_s=11.0),
                   {5: ProcessStat(1.5, GIB, GIB, GIB)}, {}, {5}, {})  # fmt: skip
    (sample,) = out
    assert sample.cpu_share_frac == 0.5 and sample.cpu_frac == 0.25
    assert (sample.cpu_power_w, sample.cpu_energy_j) == (None, None)
    assert (sample.dram_power_w, sample.dram_energy_j) == (None, None)


def test_gpu_attribution_conserves_energy_when_every_process_is_tracked() -> None:
    att = ProcessAttributor("h")
    host = HostStat(0.0, 1, GIB, GIB)
    energy = 0.0
    totals: dict[int, float] = {}
    readings = [
        GpuProcesses({1: GIB, 2: 3 * GIB}, {1: 0.3, 2: 0.1}, 0),
        GpuProcesses({1: GIB, 2: 3 * GIB}, {1: 0.9}, 0),
        GpuProcesses({1: GIB, 2: 3 * GIB}, {}, 0),
        GpuProcesses({1: GIB, 2: 3 * GIB}, {1: 0.2, 2: 0.6}, 0),
    ]
    for i, reading in enumerate(readings * 3):
        energy += 0.0 if i == 0 else 100.0 + 37.0 * (i % 4)
        for s in att.tick(T0 + i * S, host, {}, {0: reading}, {1, 2},
                          {("gpu", 0): (T0 + i * S, energy)}):  # fmt: skip
            assert s.attributed_energy_j is not None
            totals[s.pid] = s.attributed_energy_j
    assert sum(totals.values()) == pytest.approx(energy)


# -- energy meter --------------------------------------------------------------------------------


def test_energy_meter_uses_counters_and_integrates_power_without_one() -> None:
    meter = EnergyMeter()
    meter.add(GpuSample("h", T0, 0, power_w=100.0, energy_j=50.0))
    meter.add(GpuSample("h", T0 + S, 0, power_w=100.0, energy_j=None))  # a power-only tick
    meter.add(GpuSample("h", T0, 1, power_w=100.0))  # GPU 1 has no counter
    meter.add(GpuSample("h", T0 + S // 2, 1, power_w=300.0))
    meter.add(GpuSample("h", T0 + S, 1, power_w=0.0))
    meter.add(RaplSample("h", T0, 0, "package", 12.0))
    meter.add(RaplSample("h", T0, 0, "core", 7.0))  # inside package: not used
    snap = meter.snapshot()
    assert snap[("gpu", 0)] == (T0, 50.0)
    assert snap[("gpu", 1)] == (T0 + S, pytest.approx(50.0 + 150.0))
    assert snap[("package", 0)] == (T0, 12.0)
    assert ("core", 0) not in snap


# -- the sampler: tracked sets -------------------------------------------------------------------


class FakeGpu:
    def __init__(self, index: int, reading: GpuProcesses | Exception) -> None:
        self.index = index
        self.reading = reading
        self.asked: list[int] = []

    def read_processes(self, since_us: int) -> GpuProcesses:
        self.asked.append(since_us)
        if isinstance(self.reading, Exception):
            raise self.reading
        return self.reading


def make_sampler(
    tracking: ProcessTracking, source: FakeProcessSource, gpus: list[FakeGpu] | None = None
) -> tuple[ProcessSampler, FakeClock]:
    clock = FakeClock(wall_start_ns=T0)
    sampler = ProcessSampler(tracking, source, gpus or [], Hub(), clock, "h", EnergyMeter())
    return sampler, clock


def test_tracks_root_and_descendants_rescanning_on_its_own_cadence() -> None:
    stat = ProcessStat(1.0, GIB, GIB, GIB)
    source = FakeProcessSource(stats={1: stat, 2: stat, 3: stat, 4: stat},
                               tree={1: [2], 2: [3]})  # fmt: skip
    sampler, clock = make_sampler(ProcessTracking(root=1, rescan_s=5.0, exclude=(3,)), source)
    assert {s.pid for s in sampler.tick(clock.wall_ns(), {})} == {1, 2}  # 3 is excluded
    source.tree[1].append(4)
    clock.advance_sync(1.0)
    assert {s.pid for s in sampler.tick(clock.wall_ns(), {})} == {1, 2}  # not rescanned yet
    clock.advance_sync(4.0)
    assert {s.pid for s in sampler.tick(clock.wall_ns(), {})} == {1, 2, 4}
    assert source.descendant_calls == 2
    del source.stats[2]  # exits: dropped, and the source forgets it
    clock.advance_sync(1.0)
    assert {s.pid for s in sampler.tick(clock.wall_ns(), {})} == {1, 4}
    assert 2 in source.forgotten


def test_explicit_pids_and_gpu_all() -> None:
    stat = ProcessStat(1.0, GIB, GIB, GIB)
    source = FakeProcessSource(stats={7: stat, 8: stat, 50: stat})
    gpu = FakeGpu(0, GpuProcesses({50: GIB, 60: GIB}, {50: 0.5}, 1234))
    sampler, clock = make_sampler(ProcessTracking(pids=(7,)), source, [gpu])
    assert {(s.pid, s.gpu) for s in sampler.tick(clock.wall_ns(), {})} == {(7, None)}
    sampler, clock = make_sampler(ProcessTracking(pids=(7,), gpu_all=True), source, [gpu])
    out = {(s.pid, s.gpu) for s in sampler.tick(clock.wall_ns(), {})}
    # Every process on the GPU; 60 has no host-side reading (another pid namespace, say).
    assert out == {(7, None), (50, None), (50, 0), (60, 0)}
    sampler.tick(clock.wall_ns(), {})
    assert gpu.asked == [0, 0, 1234]  # each sampler asks only for samples it has not seen


def test_a_gpu_without_process_accounting_is_skipped_after_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = FakeProcessSource(stats={7: ProcessStat(1.0, GIB, GIB, GIB)})
    gpu = FakeGpu(0, NotSupportedError("no accounting"))
    sampler, clock = make_sampler(ProcessTracking(pids=(7,)), source, [gpu])
    with caplog.at_level("INFO"):
        sampler.tick(clock.wall_ns(), {})
        sampler.tick(clock.wall_ns(), {})
    assert len(gpu.asked) == 1
    assert sum("per-process metrics not available" in r.message for r in caplog.records) == 1


def test_bad_tracking_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="period_s"):
        ProcessTracking(period_s=0)
    with pytest.raises(ConfigError, match="positive"):
        ProcessTracking(pids=(1, -2))


# -- the sampler in a runtime over the simulator -------------------------------------------------


@pytest.mark.anyio
async def test_runtime_publishes_process_samples_with_attributed_gpu_energy() -> None:
    me = os.getpid()
    clock = FakeClock(wall_start_ns=T0)
    sim = SimConfig(num_gpus=2, process_pids=(me, 4242), workload=ConstantWorkload(util=0.8))
    stat = ProcessStat(1.0, GIB, GIB, GIB)
    source = FakeProcessSource(stats={me: stat})
    samples: list[ProcessSample] = []
    gpu_energy: dict[int, list[tuple[int, float]]] = {0: [], 1: []}

    async def consumer(stream: anyio.abc.ObjectReceiveStream[object]) -> None:
        async for event in stream:
            if isinstance(event, ProcessSample):
                samples.append(event)
            elif isinstance(event, GpuSample) and event.energy_j is not None:
                gpu_energy[event.gpu].append((event.t_ns, event.energy_j))

    tracking = ProcessTracking(pids=(me,), gpu_all=True, period_s=1.0)
    async with Runtime(backend="sim", cpus=None, clock=clock, sim_config=sim, host="h",
                       processes=tracking, process_source=source,
                       consumers=[consumer]) as rt:  # fmt: skip
        while len({s.t_ns for s in samples}) < 6:
            await anyio.sleep(0)  # the fake clock jumps whenever every task waits on it
        assert rt.process_sampler is not None
    pairs = {(s.pid, s.gpu) for s in samples}
    assert pairs == {(me, None), (me, 0), (me, 1), (4242, 0), (4242, 1)}
    for gpu in (0, 1):
        last_t = max(s.t_ns for s in samples if s.gpu == gpu)
        per_pid = {s.pid: s for s in samples if s.gpu == gpu and s.t_ns == last_t}
        shares = [s.gpu_power_share_frac for s in per_pid.values()]
        assert sum(x for x in shares if x is not None) == pytest.approx(1.0)
        first_t = min(s.t_ns for s in samples if s.gpu == gpu)

        # Every process is tracked: their attributed energy is the GPU's energy between the
        # meter snapshots of the first and last process ticks. A GPU sample stamped at the
        # very instant of a tick may land on either side of the snapshot, hence the bracket.
        def energy_at(t_ns: int, inclusive: bool, gpu: int = gpu) -> float:
            seen = [e for t, e in gpu_energy[gpu] if t < t_ns or (inclusive and t == t_ns)]
            return seen[-1] if seen else gpu_energy[gpu][0][1]

        attributed = sum(s.attributed_energy_j or 0.0 for s in per_pid.values())
        low = energy_at(last_t, False) - energy_at(first_t, True)
        high = energy_at(last_t, True) - energy_at(first_t, False)
        assert low - 1e-6 <= attributed <= high + 1e-6
        assert attributed > 0


# -- real processes through psutil ---------------------------------------------------------------


@pytest.fixture
def busy_child() -> Iterator[subprocess.Popen[bytes]]:
    """A child that burns CPU and holds ~64 MiB it has written to (so it counts in USS)."""
    code = "b = bytearray(64 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nwhile True: pass"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def test_psutil_source_reads_a_real_child_and_notices_its_exit(
    busy_child: subprocess.Popen[bytes],
) -> None:
    source = PsutilSource()
    clock = FakeClock(wall_start_ns=time.time_ns())
    tracking = ProcessTracking(period_s=1.0)  # this process and its descendants
    sampler = ProcessSampler(tracking, source, [], Hub(), clock, "h", EnergyMeter())
    deadline = time.monotonic() + 10
    while busy_child.pid not in {s.pid for s in sampler.tick(time.time_ns(), {})}:
        assert time.monotonic() < deadline, "child never appeared"
        clock.advance_sync(tracking.rescan_s)
    time.sleep(0.3)  # let the child burn some CPU between two readings
    out = {s.pid: s for s in sampler.tick(time.time_ns(), {})}
    child = out[busy_child.pid]
    assert child.cpu_frac is not None and child.cpu_frac > 0
    assert child.cpu_share_frac is not None and 0 < child.cpu_share_frac <= 1
    assert child.memory_uss_bytes is not None and child.memory_uss_bytes >= 60 << 20
    assert child.memory_pss_bytes is not None and child.memory_rss_bytes is not None
    assert child.memory_frac is not None and 0 < child.memory_frac < 1
    assert os.getpid() in out
    busy_child.kill()
    busy_child.wait()
    clock.advance_sync(tracking.rescan_s)
    assert busy_child.pid not in {s.pid for s in sampler.tick(time.time_ns(), {})}


# -- NVML per-process view on the simulator ------------------------------------------------------


def test_nvml_backend_reads_simulated_processes() -> None:
    from zeus_async.devices import open_devices

    me = os.getpid()
    config = SimConfig(num_gpus=1, process_pids=(me, 77), workload=ConstantWorkload(util=0.5))
    clock = FakeClock(wall_start_ns=T0 + S // 2)
    (gpu,) = open_devices("sim", cpus=None, sim_config=config, clock=clock).gpus
    try:
        reading = gpu.read_processes(0)  # type: ignore[attr-defined]
        assert set(reading.memory_bytes) == {me, 77}
        assert all(m is not None and m > 0 for m in reading.memory_bytes.values())
        # The simulated GPU splits its 50 % utilization between its processes.
        assert sum(reading.sm_frac.values()) == pytest.approx(0.5, abs=0.011)
        again = gpu.read_processes(reading.last_seen_us)  # type: ignore[attr-defined]
        assert again.sm_frac == {}  # no sample newer than the last one seen
        assert again.last_seen_us == reading.last_seen_us
        clock.advance_sync(0.1)  # the driver's next sample
        later = gpu.read_processes(reading.last_seen_us)  # type: ignore[attr-defined]
        assert later.last_seen_us == reading.last_seen_us + 100_000
        assert later.sm_frac == reading.sm_frac
    finally:
        gpu.close()


def test_nvml_backend_without_process_accounting_raises_not_supported() -> None:
    from zeus_async.devices import open_devices
    from zeus_async.devices.sim_config import GpuOverride

    config = SimConfig(num_gpus=1, gpus=(GpuOverride(unsupported=("processes",)),))
    (gpu,) = open_devices("sim", cpus=None, sim_config=config).gpus
    try:
        with pytest.raises(NotSupportedError, match="processes"):
            gpu.read_processes(0)  # type: ignore[attr-defined]
    finally:
        gpu.close()


def test_procfs_source_agrees_with_psutil_and_reads_smaps_only_when_asked(
    busy_child: subprocess.Popen[bytes],
) -> None:
    import psutil

    from zeus_async.devices.processes import ProcfsSource, default_source

    assert isinstance(default_source(), ProcfsSource)  # Linux with smaps_rollup
    fast, slow = ProcfsSource(), PsutilSource()
    time.sleep(0.2)
    a = fast.process(busy_child.pid)
    b = slow.process(busy_child.pid)
    assert a is not None and b is not None
    assert a.cpu_s == pytest.approx(b.cpu_s, abs=0.05)
    assert a.rss_bytes == pytest.approx(b.rss_bytes, rel=0.05)
    assert a.pss_bytes == pytest.approx(b.pss_bytes, rel=0.05)
    assert a.uss_bytes == pytest.approx(b.uss_bytes, rel=0.05)
    assert a.uss_bytes is not None and a.uss_bytes >= 60 << 20
    psutil.Process(busy_child.pid).cpu_times()  # (psutil agrees the child is alive)
    later = fast.process(busy_child.pid, smaps=False)
    assert later is not None and later.cpu_s >= a.cpu_s
    assert (later.pss_bytes, later.uss_bytes) == (a.pss_bytes, a.uss_bytes)  # kept, not reread
    busy_child.kill()
    busy_child.wait()
    assert fast.process(busy_child.pid) is None  # the open descriptor reads as gone
    assert fast.process(2**22 + 12345) is None  # never existed
    fast.close()


def test_smaps_are_read_on_their_own_cadence_and_for_new_pids() -> None:
    stat = ProcessStat(1.0, GIB, GIB, GIB)
    source = FakeProcessSource(stats={1: stat})
    sampler, clock = make_sampler(ProcessTracking(pids=(1, 2), smaps_s=3.0), source)
    for _ in range(3):  # t = 0, 1, 2 s: smaps at 0 only
        sampler.tick(clock.wall_ns(), {})
        clock.advance_sync(1.0)
    assert source.smaps_calls == 1
    source.stats[2] = stat  # pid 2 appears at t = 3 s, a smaps tick anyway
    sampler.tick(clock.wall_ns(), {})
    assert source.smaps_calls == 3
    clock.advance_sync(1.0)
    source.stats[3] = stat
    sampler.tracking = ProcessTracking(pids=(1, 2, 3), smaps_s=3.0)
    sampler.tick(clock.wall_ns(), {})  # t = 4 s: only the new pid 3 reads smaps
    assert source.smaps_calls == 4
