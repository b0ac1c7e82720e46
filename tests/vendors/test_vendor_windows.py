"""Windows on every vendor's simulator: energy against the simulator's ground truth on a fake
clock, provisional then exact figures, and a GPU without a counter on the integrated-power path
with its error bound (issue 37)."""

from __future__ import annotations

import time

import pytest
from vendor_cases import T0, VendorCase

from zeus_async import Monitor
from zeus_async.aggregate import WindowResult
from zeus_async.clock import FakeClock
from zeus_async.devices.sim import SimNode
from zeus_async.devices.sim_config import AmdSim, GpuOverride, SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload, SquareWorkload, Workload
from zeus_async.runtime import Runtime

pytestmark = pytest.mark.anyio

MS = 1_000_000


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def square(vendor: VendorCase, **kw: object) -> SimConfig:
    return vendor.config(
        num_gpus=min(2, vendor.num_gpus),
        workload=SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1),
        seed=5,
        **kw,
    )


async def run_windows(
    vendor: VendorCase, config: SimConfig, spans_ms: list[tuple[int, int]]
) -> list[WindowResult]:
    """Windows at (start offset, length) ms after a 500 ms lead, on a fake clock."""
    clock = FakeClock(wall_start_ns=T0 + 3 * MS)
    results: list[WindowResult] = []
    async with Runtime(
        backend=vendor.backend, cpus=None, sim_config=config, clock=clock, windows=True
    ) as rt:
        await clock.sleep_until(clock.monotonic_ns() + 500 * MS)
        for offset, length in spans_ms:
            await clock.sleep_until(clock.monotonic_ns() + offset * MS)
            async with rt.window(f"w{len(results)}") as w:
                await clock.sleep_until(clock.monotonic_ns() + length * MS)
            assert w.result is not None
            results.append(w.result)
        for r in results:
            await r.wait_async()
    return results


@pytest.mark.parametrize("length_ms", [50, 2000])
async def test_window_energy_against_ground_truth(vendor: VendorCase, length_ms: int) -> None:
    config = square(vendor)
    truth_node = SimNode(config, shared_state=False)
    results = await run_windows(vendor, config, [(k * 13, length_ms) for k in range(3)])
    gpus = range(config.num_gpus)
    method = "counter" if vendor.energy_counter else "integrated"
    swing_w = config.max_w - config.idle_w
    for r in results:
        m = r.wait(0)
        assert set(m.gpu_energy_j) == set(gpus)
        for gpu in gpus:
            truth = truth_node.truth_energy_j(gpu, r.start_ns, r.end_ns)
            got = m.gpu_energy_j[gpu]
            assert m.methods[f"gpu:{gpu}"].startswith(method), m.methods
            assert got > 0
            if length_ms >= 2000:  # the figures: 1 % with a counter, 3 % integrated
                assert abs(got - truth) / truth <= (0.01 if vendor.energy_counter else 0.03), (
                    got,
                    truth,
                )
            else:  # short windows: what an edge leaves open, at each edge
                assert abs(got - truth) <= 2 * vendor.edge_s * swing_w, (got, truth)


async def test_window_devices_say_vendor_method_and_capabilities(vendor: VendorCase) -> None:
    clock = FakeClock(wall_start_ns=T0)
    async with Runtime(
        backend=vendor.backend, cpus=None, sim_config=vendor.config(), clock=clock, windows=True
    ) as rt:
        infos = [d.describe() for d in rt.devices if d.key.startswith("gpu:")]
    assert len(infos) == vendor.num_gpus
    for info in infos:
        assert info.vendor == vendor.device_vendor
        assert info.energy_method == ("counter" if vendor.energy_counter else "integrated-power")
        assert info.capabilities is not None
        assert info.capabilities.energy_counter == vendor.energy_counter
        assert info.capabilities.power_cap == vendor.power_cap
        assert info.has_energy_counter == vendor.energy_counter
        if vendor.power_cap:
            assert info.power_limit_min_w is not None and info.power_limit_max_w is not None
        else:
            assert info.power_limit_min_w is None and info.power_limit_max_w is None


def no_counter(vendor: VendorCase, workload: Workload) -> SimConfig | None:
    """A GPU of this vendor without a usable energy counter (``None``: none can be made)."""
    if vendor.vendor == "nvidia":  # before Volta
        return vendor.config(num_gpus=1, workload=workload, gpus=(GpuOverride(pre_volta=True),))
    if vendor.vendor == "amd":  # a counter stuck in a VM guest, caught at start
        return vendor.config(num_gpus=1, workload=workload, amd=AmdSim(counter_fault="stuck"))
    if vendor.vendor == "jetson":  # power rails only
        return vendor.config(workload=workload)
    return None  # an Apple GPU's energy is IOReport's counter or nothing


async def test_a_gpu_without_a_counter_integrates_power_within_its_bound(
    vendor: VendorCase,
) -> None:
    # Constant power: the integral is exact, and says which path it took.
    config = no_counter(vendor, ConstantWorkload(util=0.6))
    if config is None:
        pytest.skip(f"an {vendor} GPU always has its energy counter")
    [r] = await run_windows(vendor, config, [(0, 2000)])
    m = r.wait(0)
    assert m.methods["gpu:0"] == "integrated", m.methods
    truth = SimNode(config, shared_state=False).truth_energy_j(0, m.start_ns, m.end_ns)
    assert m.gpu_energy_j[0] == pytest.approx(truth, rel=1e-6)
    assert m.error_j["gpu:0"] == pytest.approx(0.0, abs=1e-6)

    # A square load, edges off the sensors' grids: the edges' bound (error_j) plus the
    # sensor's lag. Jetson's INA3221 lags one 6.6 ms cycle (+ a sampling period): the issue's
    # 3 %; NVIDIA's and AMD's instant sensors (25 ms of every 100 ms, reported after the
    # period) lag up to 2 periods, which windows without a counter cannot correct.
    config = no_counter(vendor, SquareWorkload(period_s=0.77, duty=0.5, high=1.0, low=0.1))
    assert config is not None
    truth_node = SimNode(config, shared_state=False)
    results = await run_windows(vendor, config, [(k * 13, 2000) for k in range(4)])
    for r in results:
        m = r.wait(0)
        assert m.methods["gpu:0"] == "integrated", m.methods
        truth = truth_node.truth_energy_j(0, m.start_ns, m.end_ns)
        err = abs(m.gpu_energy_j[0] - truth)
        bound = m.error_j["gpu:0"]
        assert bound >= 0
        if vendor.vendor == "jetson":
            assert err / truth <= 0.03, (m.gpu_energy_j[0], truth)
        else:
            # + one 10 ms sampling gap per edge of the square inside the window (2 s / 0.385 s).
            lag_s = 2 * config.instant_period_s + 0.01 * 2.0 / 0.385
            assert err <= bound + (config.max_w - config.idle_w) * lag_s, (err, bound)


def test_energy_is_there_at_once_then_exact(vendor: VendorCase) -> None:
    config = vendor.config(num_gpus=1, workload=ConstantWorkload(util=0.6), seed=3)
    node = SimNode(config, shared_state=False)
    with Monitor(
        backend=vendor.backend, cpu_indices=[], sim_config=config, sampler="thread"
    ) as monitor:
        monitor.begin_window("w")
        time.sleep(0.05)
        result = monitor.end_window("w")
        assert not result.done() and result.provisional
        energy = result.gpu_energy
        assert set(energy) == {0}
        truth = node.truth_energy_j(0, result.start_ns, result.end_ns)
        assert energy[0] == pytest.approx(truth, rel=0.25)
        assert result.methods["gpu:0"].startswith("integrated")
        assert result.error_j["gpu:0"] >= 0
        m = result.wait(timeout=5)
        assert not result.provisional
        assert result.gpu_energy == m.gpu_energy_j
        exact = "counter" if vendor.energy_counter else "integrated"
        assert m.methods["gpu:0"].startswith(exact), m.methods
        truth = node.truth_energy_j(0, m.start_ns, m.end_ns)
        # Constant power; the edges of a 50 ms window: a counter period or sensor cycle each;
        # Apple's 10 ms counter, read every ~10.25 ms, on its own grid (issue 37).
        rel = 0.03 if vendor.vendor == "apple" else 0.25
        assert m.gpu_energy_j[0] == pytest.approx(truth, rel=rel)
