"""A mixed node is one runtime: a simulated node with NVIDIA and AMD GPUs (``GpuOverride.vendor``)
opened by backend ``sim``, each vendor's GPUs through its own simulated API; ``auto`` picks every
vendor present."""

from __future__ import annotations

import pytest
from vendor_cases import T0

import zeus_async.devices as devices
from zeus_async.clock import FakeClock
from zeus_async.devices import open_devices
from zeus_async.devices.amd import AmdGpu
from zeus_async.devices.nvml import NvmlGpu
from zeus_async.devices.sim import SimNode
from zeus_async.devices.sim_config import GpuOverride, SimConfig
from zeus_async.devices.sim_workload import SquareWorkload
from zeus_async.errors import ConfigError, DriverNotLoadedError, NoPermissionError
from zeus_async.runtime import Runtime

MS = 1_000_000
MI300X = GpuOverride(vendor="amd", name="AMD Instinct MI300X", idle_w=140.0, max_w=700.0)
MIXED = SimConfig(
    num_gpus=4,
    seed=9,
    workload=SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1),
    gpus=(GpuOverride(), GpuOverride(), MI300X, MI300X),
)


def test_open_devices_serves_each_vendor_through_its_api() -> None:
    opened = open_devices("sim", cpus=None, clock=FakeClock(wall_start_ns=T0), sim_config=MIXED)
    try:
        assert opened.backend == "sim"
        assert [type(g) for g in opened.gpus] == [NvmlGpu, NvmlGpu, AmdGpu, AmdGpu]
        infos = [g.describe() for g in opened.gpus]
        assert [i.key for i in infos] == ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]
        assert [i.vendor for i in infos] == ["nvidia", "nvidia", "amd", "amd"]
        assert [i.index for i in infos] == [0, 1, 0, 1]  # each driver's own numbering
        assert infos[2].name == "AMD Instinct MI300X (simulated)" and "H100" in infos[0].name
        assert all(i.capabilities is not None and i.capabilities.power_cap for i in infos)
    finally:
        for g in opened.gpus:
            g.close()
    # Indices are positions on the whole node, as on a real nvml+amd one.
    opened = open_devices(
        "sim", gpus=[3, 0], cpus=None, clock=FakeClock(wall_start_ns=T0), sim_config=MIXED
    )
    assert [g.key for g in opened.gpus] == ["gpu:3", "gpu:0"]
    for g in opened.gpus:
        g.close()


def test_a_mixed_node_only_of_nvidia_and_amd() -> None:
    config = SimConfig(num_gpus=2, gpus=(GpuOverride(), GpuOverride(vendor="apple")))
    with pytest.raises(ConfigError, match="NVIDIA and AMD"):
        open_devices("sim", cpus=None, clock=FakeClock(wall_start_ns=T0), sim_config=config)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_one_runtime_measures_both_vendors_against_the_truth() -> None:
    clock = FakeClock(wall_start_ns=T0 + 3 * MS)
    truth = SimNode(MIXED, shared_state=False)
    async with Runtime(backend="sim", cpus=None, sim_config=MIXED, clock=clock, windows=True) as rt:
        await clock.sleep_until(clock.monotonic_ns() + 500 * MS)
        async with rt.window("both") as w:
            await clock.sleep_until(clock.monotonic_ns() + 2000 * MS)
        assert w.result is not None
        m = await w.result.wait_async()
    assert set(m.gpu_energy_j) == {0, 1, 2, 3}
    for gpu in range(4):
        assert m.methods[f"gpu:{gpu}"].startswith("counter"), m.methods
        expected = truth.truth_energy_j(gpu, m.start_ns, m.end_ns)
        assert m.gpu_energy_j[gpu] == pytest.approx(expected, rel=0.01), gpu
    # The MI300X override's power range, not the H100's: the AMD GPUs are that model.
    assert m.gpu_energy_j[2] != pytest.approx(m.gpu_energy_j[0], rel=0.01)


@pytest.mark.parametrize(
    ("nvml", "present", "chosen"),
    [
        ("ok", [], "nvml"),
        ("ok", ["amd"], "nvml+amd"),
        ("none", ["amd"], "amd"),
        ("none", ["jetson"], "jetson"),
        ("none", ["apple"], "apple"),
        ("none", [], "sim"),
        ("ok", ["amd", "apple"], "nvml+amd+apple"),
    ],
)
def test_auto_picks_every_vendor_present(
    monkeypatch: pytest.MonkeyPatch, nvml: str, present: list[str], chosen: str
) -> None:
    from zeus_async.devices import amd, apple, jetson

    error = None if nvml == "ok" else DriverNotLoadedError("no NVIDIA driver")
    monkeypatch.setattr(devices, "nvml_error", lambda: error)
    monkeypatch.setattr(devices, "_DRIVER_PATHS", ())
    monkeypatch.setattr(amd, "amd_present", lambda: "amd" in present)
    monkeypatch.setattr(jetson, "jetson_present", lambda: "jetson" in present)
    monkeypatch.setattr(apple, "apple_present", lambda: "apple" in present)
    assert devices.auto_backend() == chosen
    assert devices.resolve_backend("auto") == chosen


def test_auto_never_hides_a_broken_nvidia_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeus_async.devices import amd

    monkeypatch.setattr(devices, "nvml_error", lambda: NoPermissionError("no access"))
    monkeypatch.setattr(amd, "amd_present", lambda: True)
    with pytest.raises(NoPermissionError, match="not falling back to simulated GPUs"):
        devices.auto_backend()


def test_a_probe_that_raises_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeus_async.devices import amd, apple, jetson

    def broken() -> bool:
        raise OSError("sysfs went away")

    monkeypatch.setattr(devices, "nvml_error", lambda: DriverNotLoadedError("none"))
    monkeypatch.setattr(devices, "_DRIVER_PATHS", ())
    monkeypatch.setattr(amd, "amd_present", broken)
    monkeypatch.setattr(jetson, "jetson_present", lambda: True)
    monkeypatch.setattr(apple, "apple_present", lambda: False)
    assert devices.auto_backend() == "jetson"
