"""The Apple Silicon backend (IOReport Energy Model) on the simulator beneath its API."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from zeus_async import Monitor
from zeus_async.clock import FakeClock
from zeus_async.devices import apple
from zeus_async.devices.apple import (
    APPLE_ENERGY_NOTE,
    AppleCpu,
    AppleGpu,
    apple_present,
    open_apple_cpus,
    open_apple_gpus,
)
from zeus_async.devices.sim import SimNode
from zeus_async.devices.sim_config import AppleSim, SimConfig, sim_preset
from zeus_async.devices.sim_workload import ConstantWorkload, SquareWorkload
from zeus_async.errors import ConfigError, DeviceNotFoundError, DriverNotLoadedError
from zeus_async.events import Capabilities, GpuSample, RaplSample
from zeus_async.runtime import Runtime
from zeus_async.testing import sim_ioreport

MS = 1_000_000
T0 = 1_760_000_000_000_000_000 + 3 * MS  # not on the 10 ms update grid


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    sim_ioreport.uninstall()


def config(**apple: Any) -> SimConfig:
    return sim_preset("apple", workload=ConstantWorkload(util=0.5), seed=3, apple=AppleSim(**apple))


def opened(cfg: SimConfig) -> tuple[FakeClock, Any, AppleGpu, AppleCpu]:
    clock = FakeClock(wall_start_ns=T0)
    source = sim_ioreport.install(config=cfg, clock=clock)
    (gpu,) = open_apple_gpus(source=source)
    (cpu,) = open_apple_cpus(source=source)
    return clock, source, gpu, cpu


def counts_mj(node: SimNode, t_ns: int) -> tuple[int, int]:
    """The GPU and GPU SRAM channels (mJ) at the last 10 ms update <= t_ns, from the truth."""
    origin = node.counter_origin_ns
    b = origin + (t_ns - origin) // (10 * MS) * (10 * MS)
    e = node.truth_energy_j(0, origin, b)
    sram = node.config.apple.gpu_sram_frac
    return int(e * (1 - sram) * 1000 + 1e-6), int(e * sram * 1000 + 1e-6)


def test_the_gpu_says_what_it_is_and_cannot_do() -> None:
    _, _, gpu, cpu = opened(config())
    info = gpu.describe()
    assert (info.key, info.name, info.arch, info.index) == (
        "gpu:0",
        "Apple M3 Max GPU (simulated)",
        "apple-m3",
        0,
    )
    assert info.vendor == "apple" and info.power_scope == "gpu"
    assert info.energy_method == "counter" and info.has_energy_counter
    assert (
        info.energy_note
        == APPLE_ENERGY_NOTE
        == "IOReport Energy Model (model-based, ~1 mJ), no sudo"
    )
    assert info.capabilities == Capabilities(energy_counter=True)
    assert info.power_limit_max_w is None and info.supported_sm_clocks_hz == []
    # Marked as simulated in its identity, as the simulated NVIDIA GPUs are.
    assert info.uuid.startswith("APPLE-GPU-") and info.uuid.endswith("515151515151")
    assert gpu.fields == ("power_w", "energy_j")
    cinfo = cpu.describe()
    assert (cinfo.key, cinfo.name, cinfo.arch, cinfo.vendor) == (
        "cpu:0",
        "Apple M3 Max CPU (IOReport) (simulated)",
        "cpu",
        "apple",
    )
    assert cinfo.capabilities == Capabilities(energy_counter=True)
    assert cpu.fields == ("package", "dram", "psys")


def test_gpu_energy_is_the_gpu_and_sram_counters_in_whole_mj() -> None:
    clock, _, gpu, _ = opened(config())
    node = sim_ioreport.current_node()
    assert node is not None
    (first,) = gpu.read(gpu.fields, "h", clock.wall_ns())
    assert isinstance(first, GpuSample)
    assert (first.energy_j, first.power_w) == (0.0, None)  # counts from the first read
    t0 = clock.wall_ns()
    clock.advance_sync(1.234)
    (s,) = gpu.read(gpu.fields, "h", clock.wall_ns())
    assert isinstance(s, GpuSample) and s.energy_j is not None and s.power_w is not None
    g0, r0 = counts_mj(node, t0)
    g1, r1 = counts_mj(node, clock.wall_ns())
    assert round(s.energy_j * 1000) == (g1 + r1) - (g0 + r0)  # exactly the channels' mJ
    assert s.power_w == pytest.approx(s.energy_j / 1.234, rel=1e-12)
    # Against the truth: only the update grid (10 ms at both ends) and the mJ floors differ.
    truth = node.truth_energy_j(0, t0, clock.wall_ns())
    assert abs(s.energy_j - truth) <= 2 * 0.010 * 25.1 + 0.002
    # Fields not asked for are None; the counter still advances.
    clock.advance_sync(0.5)
    (p,) = gpu.read(("power_w",), "h", clock.wall_ns())
    assert isinstance(p, GpuSample) and p.energy_j is None and p.power_w is not None


def test_counter_resolution_is_one_mj_and_one_update_period() -> None:
    clock, _, gpu, _ = opened(config())
    values = []
    for _ in range(40):
        (s,) = gpu.read(("energy_j",), "h", clock.wall_ns())
        assert isinstance(s, GpuSample) and s.energy_j is not None
        values.append(s.energy_j)
        clock.advance_sync(0.0025)  # four reads per 10 ms update
    assert all(v * 1000 == pytest.approx(round(v * 1000), abs=1e-9) for v in values)
    steps = [b - a for a, b in itertools.pairwise(values)]
    # 25.05 W x 10 ms: each update adds about 250 mJ, and the reads between updates repeat.
    moved = [d for d in steps if d]
    assert len(moved) == 10
    assert all(d == pytest.approx(0.2505, abs=0.003) for d in moved)


def test_window_deltas_are_floored_after_differencing_as_the_library_does() -> None:
    clock = FakeClock(wall_start_ns=T0)
    source = sim_ioreport.install(config=config(unit="nJ"), clock=clock)
    monitor = source.AppleEnergyMonitor()
    before = monitor.get_cumulative_energy()
    monitor.begin_window("w")
    clock.advance_sync(0.0137)
    delta = monitor.end_window("w")
    after = monitor.get_cumulative_energy()
    # end_window differences the raw nJ counts, then floors: never below the difference of
    # the floored cumulative values, at most 1 mJ above it.
    assert 0 <= delta.gpu_mj - (after.gpu_mj - before.gpu_mj) <= 1
    assert delta.gpu_mj > 0 and isinstance(delta.efficiency_cores_mj, list)


def test_the_library_interface_and_its_errors() -> None:
    source = sim_ioreport.install(config=config(), clock=FakeClock(wall_start_ns=T0))
    monitor = source.AppleEnergyMonitor()
    m = monitor.get_cumulative_energy()
    assert isinstance(m, source.AppleEnergyMetrics)
    assert m.efficiency_core_manager_mj is None  # not simulated: "unavailable"
    assert len(m.efficiency_cores_mj) == 4 and len(m.performance_cores_mj) == 12
    assert len(m.efficiency_cluster_mj) == 1 and len(m.performance_cluster_mj) == 1
    assert "GPU SRAM: " in repr(m) and "Efficiency core manager: None (unavailable)" in repr(m)
    monitor.begin_window("a")
    with pytest.raises(RuntimeError, match="already exists"):
        monitor.begin_window("a")
    monitor.begin_window("a", restart=True)
    monitor.end_window("a")
    with pytest.raises(RuntimeError, match="had been started"):
        monitor.end_window("a")
    empty = source.AppleEnergyMetrics()
    assert empty.gpu_mj is None and empty.cpu_total_mj is None


def test_cpu_dram_and_the_whole_soc_as_rapl_domains() -> None:
    clock, _, gpu, cpu = opened(config(ane_idle_w=0.5))
    node = SimNode(config(ane_idle_w=0.5), shared_state=False)
    gpu.read(gpu.fields, "h", clock.wall_ns())
    cpu.read(cpu.fields, "h", clock.wall_ns())
    t0 = clock.wall_ns()
    clock.advance_sync(2.0)
    (g,) = gpu.read(gpu.fields, "h", clock.wall_ns())
    samples = cpu.read(cpu.fields, "h", clock.wall_ns())
    assert all(isinstance(s, RaplSample) for s in samples)
    by = {s.domain: s.energy_j for s in samples if isinstance(s, RaplSample)}
    assert set(by) == {"package", "dram", "psys"}
    gpu_j = node.truth_energy_j(0, t0, clock.wall_ns())
    slack = 0.03 * 25.1 * 0.01 * 2 + 0.01  # the update grid at both ends, mJ floors
    assert by["package"] == pytest.approx(1.0 * 2 + 0.3 * gpu_j, abs=slack + 0.2)
    assert by["dram"] == pytest.approx(0.2 * 2 + 0.1 * gpu_j, abs=slack + 0.1)
    # psys: every channel, ANE (0.5 W) included; the ANE is what the others leave.
    assert isinstance(g, GpuSample) and g.energy_j is not None
    ane = by["psys"] - by["package"] - by["dram"] - g.energy_j
    assert ane == pytest.approx(0.5 * 2, abs=0.006)
    metrics = cpu.read_metrics()
    assert metrics.ane_mj is not None and metrics.ane_mj > 0
    assert cpu.read(("package",), "h", clock.wall_ns())[0].domain == "package"  # type: ignore[union-attr]


def test_channels_a_chip_lacks_are_not_offered() -> None:
    _, _, gpu, cpu = opened(config(missing=("dram", "gpu_sram", "cores", "ane")))
    assert cpu.fields == ("package", "psys")
    assert "no GPU SRAM" not in repr(gpu)
    m = cpu.read_metrics()
    assert (m.dram_mj, m.gpu_sram_mj, m.efficiency_cores_mj, m.ane_mj) == (None,) * 4
    sim_ioreport.uninstall()
    source = sim_ioreport.install(config=config(missing=("gpu",)), clock=FakeClock(T0))
    with pytest.raises(DeviceNotFoundError, match="no GPU channel"):
        open_apple_gpus(source=source)
    sim_ioreport.uninstall()
    source = sim_ioreport.install(config=config(subscription_fails=True), clock=FakeClock(T0))
    with pytest.raises(DriverNotLoadedError, match="Failed to create IOReport subscription"):
        open_apple_gpus(source=source)


class _Scripted:
    """A source whose counters follow a script (GPU mJ per call), to go backwards."""

    def __init__(self, values: list[int]) -> None:
        self.values = values

        outer = self

        class Monitor:
            def get_cumulative_energy(self) -> Any:
                return SimpleNamespace(gpu_mj=outer.values.pop(0), gpu_sram_mj=None)

        self.AppleEnergyMonitor = Monitor

    @staticmethod
    def zeus_async_platform() -> tuple[str, str]:
        return "Apple M2", ""


def test_a_counter_that_goes_back_counts_nothing_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = _Scripted([1000, 1000, 1500, 200, 700, 100, 400])
    (gpu,) = open_apple_gpus(source=source, first_index=2)
    assert (
        gpu.key == "gpu:2" and gpu.describe().name == "Apple M2 GPU" and gpu.describe().uuid == ""
    )
    with caplog.at_level(logging.WARNING, logger="zeus_async.devices.apple"):
        energies = [
            gpu.read(("energy_j",), "h", T0 + k * 10 * MS)[0].energy_j  # type: ignore[union-attr]
            for k in range(6)
        ]
    assert energies == [0.0, 0.5, 0.5, 1.0, 1.0, 1.3]
    assert len([r for r in caplog.records if "went back" in r.message]) == 1


def test_open_errors() -> None:
    source = sim_ioreport.install(config=config(), clock=FakeClock(T0))
    with pytest.raises(ConfigError, match="one GPU"):
        open_apple_gpus([1], source=source)
    with pytest.raises(ConfigError, match="one GPU"):
        open_apple_gpus([0, 0], source=source)
    with pytest.raises(ConfigError, match="package 0"):
        open_apple_cpus([1], source=source)
    assert open_apple_cpus([], source=source) == []
    # The real path on this Linux host: not an Apple Silicon Mac, said as such.
    with pytest.raises(DriverNotLoadedError, match="macOS on Apple Silicon"):
        open_apple_gpus()


def test_apple_present_is_false_here_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sys.platform != "darwin"
    assert apple_present() is False
    # On an Apple Silicon Mac it asks whether the package can be imported, without importing.
    monkeypatch.setattr(apple, "_on_apple_silicon", lambda: True)
    assert apple_present() is False  # no zeus_apple_silicon here
    monkeypatch.syspath_prepend(str(sim_ioreport.SHIM_DIR))
    assert apple_present() is True

    def broken(name: str) -> None:
        raise ValueError("broken finder")

    monkeypatch.setattr(apple.importlib.util, "find_spec", broken)
    assert apple_present() is False


def test_a_subprocess_imports_the_simulator_as_zeus_apple_silicon() -> None:
    code = (
        "import zeus_apple_silicon as z\n"
        "m = z.AppleEnergyMonitor()\n"
        "a = m.get_cumulative_energy()\n"
        "print(z.__zeus_async_sim__, a.gpu_mj > 0, a.cpu_total_mj > 0,"
        " len(a.performance_cores_mj))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ZEUS_ASYNC_SIM"}
    env.update(sim_ioreport.shim_env(config()))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "True", "12"]
    assert msgspec.json.decode(env["ZEUS_ASYNC_SIM"])["vendor"] == "apple"


# -- through the runtime: windows against the simulator's truth --------------------------------


def square() -> SimConfig:
    return sim_preset(
        "apple", workload=SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1), seed=5
    )


@pytest.mark.anyio
async def test_two_second_windows_within_one_percent_on_a_fake_clock() -> None:
    cfg = square()
    clock = FakeClock(wall_start_ns=T0)
    results = []
    async with Runtime(
        backend="sim-apple", cpus=None, sim_config=cfg, clock=clock, windows=True
    ) as rt:
        assert rt.backend == "sim-apple"
        assert [d.describe().vendor for d in rt.devices] == ["apple"]
        await clock.sleep_until(clock.monotonic_ns() + 500 * MS)
        for k in range(4):
            await clock.sleep_until(clock.monotonic_ns() + (13 * k + 7) * MS)
            async with rt.window(f"w{k}") as w:
                await clock.sleep_until(clock.monotonic_ns() + 2000 * MS)
            assert w.result is not None
            results.append(w.result)
        for r in results:
            await r.wait_async()
    node = SimNode(cfg, shared_state=False)
    for r in results:
        m = r.wait(0)
        truth = node.truth_energy_j(0, r.start_ns, r.end_ns)
        assert m.methods["gpu:0"] == "counter+interpolated"
        assert abs(m.gpu_energy_j[0] - truth) / truth < 0.01, (m.gpu_energy_j, truth)


@pytest.mark.anyio
async def test_cpu_and_dram_energy_of_windows_come_from_the_apple_cpu() -> None:
    cfg = config()
    clock, _, gpu, cpu = opened(cfg)
    async with Runtime(devices=[gpu, cpu], clock=clock, windows=True) as rt:
        await clock.sleep_until(clock.monotonic_ns() + 300 * MS)
        async with rt.window("w") as w:
            await clock.sleep_until(clock.monotonic_ns() + 2000 * MS)
        assert w.result is not None
        m = await w.result.wait_async()
    gpu_j = SimNode(cfg, shared_state=False).truth_energy_j(0, m.start_ns, m.end_ns)
    assert m.gpu_energy_j[0] == pytest.approx(gpu_j, rel=0.01)
    assert m.cpu_energy_j is not None and m.dram_energy_j is not None
    assert m.cpu_energy_j[0] == pytest.approx(1.0 * 2 + 0.3 * gpu_j, rel=0.01)
    assert m.dram_energy_j[0] == pytest.approx(0.2 * 2 + 0.1 * gpu_j, rel=0.01)


def test_monitor_on_sim_apple_measures_a_two_second_window() -> None:
    # Real clock (the simulator is a pure function of wall time): constant power, so the
    # counter's periods split exactly and only the 1 mJ floors and edge stamps remain.
    cfg = config()
    node = SimNode(cfg, shared_state=False)
    with Monitor(backend="sim-apple", cpu_indices=[], sim_config=cfg, sampler="thread") as mon:
        time.sleep(0.3)
        mon.begin_window("w")
        time.sleep(2.0)
        m = mon.end_window("w").wait(timeout=5)
    truth = node.truth_energy_j(0, m.start_ns, m.end_ns)
    assert m.gpu_energy_j[0] == pytest.approx(truth, rel=0.01)
    assert m.methods["gpu:0"] == "counter+interpolated"


def test_cli_monitor_runs_on_sim_apple() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ZEUS_ASYNC_SIM"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zeus_async",
            "monitor",
            "--backend",
            "sim-apple",
            "--duration",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "backend sim-apple (SIMULATED GPUs)" in out
    rows = [line.split() for line in out.split("Totals")[1].strip().splitlines()[1:]]
    gpu = next(r for r in rows if r[0] == "gpu:0")
    energy, seconds, mean_w = float(gpu[1]), float(gpu[2]), float(gpu[3])
    assert 1.5 < seconds < 5.0
    assert 0.1 <= mean_w <= 50.5  # between the preset's idle and flat-out GPU power
    assert energy == pytest.approx(mean_w * seconds, rel=0.01)
    assert gpu[4].startswith("counter")
    assert "Traceback" not in proc.stderr
