"""The pynvml-compatible simulator module: names, units, errors, installation, subprocess shim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from types import ModuleType
from typing import Any, NamedTuple

import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices.sim import (
    ConstantWorkload,
    GpuOverride,
    RandomWorkload,
    SimConfig,
    SimNode,
    SquareWorkload,
)
from zeus_async.testing import _nvml_fallback, _sim_nvml_base, sim_pynvml

# The real nvidia-ml-py module, as the simulator found it (never the simulator itself, even if a
# test elsewhere left ``sys.modules["pynvml"]`` pointing at it).
real_pynvml: Any = _sim_nvml_base._real
assert real_pynvml is not None and not hasattr(real_pynvml, "__zeus_async_sim__")

NS = 1_000_000_000
E0 = 1_700_000_000 * NS

CONFIG = SimConfig(
    num_gpus=4,
    epoch_ns=E0,
    counter_origin_ns=E0,
    workload=ConstantWorkload(util=0.5),
    gpus=(
        GpuOverride(),
        GpuOverride(pre_volta=True),
        GpuOverride(lost_at_s=10.0, no_permission=True),
        GpuOverride(unsupported=("temperature", "instant_power", "processes", "locked_clocks")),
    ),
)


class Sim(NamedTuple):
    nv: Any
    clock: FakeClock
    node: SimNode


@pytest.fixture
def sim() -> Iterator[Sim]:
    clock = FakeClock(E0)
    node = SimNode(CONFIG, clock)
    with sim_pynvml.patched_pynvml(node) as nv:
        nv.nvmlInit()
        yield Sim(nv, clock, node)


def test_reuses_the_real_error_classes_and_constants() -> None:
    assert sim_pynvml.NVMLError is real_pynvml.NVMLError
    assert sim_pynvml.NVMLError_NotSupported is real_pynvml.NVMLError_NotSupported
    assert sim_pynvml.NVML_FI_DEV_POWER_INSTANT == real_pynvml.NVML_FI_DEV_POWER_INSTANT == 186
    assert sim_pynvml.c_nvmlMemory_t is real_pynvml.c_nvmlMemory_t
    assert type(real_pynvml.NVMLError(3)) is sim_pynvml.NVMLError_NotSupported
    assert "nvmlDeviceGetFieldValues" in sim_pynvml.__all__


def test_fallback_matches_the_real_module() -> None:
    for name, value in vars(_nvml_fallback).items():
        if name.startswith("NVML_") or name in ("nvmlTemperature_v1", "nvmlMemory_v2"):
            assert getattr(real_pynvml, name) == value, name
    err = _nvml_fallback.NVMLError(15)
    assert type(err).__name__ == "NVMLError_GpuIsLost" and err.value == 15
    assert str(err) == "GPU is lost"
    assert isinstance(_nvml_fallback.NVMLError_NoPermission(), _nvml_fallback.NVMLError)
    assert _nvml_fallback.NVMLError_NoPermission().value == 4
    for struct in ("c_nvmlFieldValue_t", "c_nvmlMemory_t", "c_nvmlUtilization_t"):
        mine, theirs = getattr(_nvml_fallback, struct), getattr(real_pynvml, struct)
        assert [f[0] for f in mine._fields_] == [f[0] for f in theirs._fields_]


def test_uninitialized_and_refcounted_init() -> None:
    with sim_pynvml.patched_pynvml(SimNode(CONFIG, FakeClock(E0))) as nv:
        with pytest.raises(real_pynvml.NVMLError_Uninitialized):
            nv.nvmlDeviceGetCount()
        with pytest.raises(real_pynvml.NVMLError_Uninitialized):
            nv.nvmlShutdown()
        nv.nvmlInit()
        nv.nvmlInitWithFlags(0)
        assert nv.nvmlDeviceGetCount() == 4
        nv.nvmlShutdown()
        assert nv.nvmlDeviceGetCount() == 4  # still one reference
        nv.nvmlShutdown()
        with pytest.raises(real_pynvml.NVMLError_Uninitialized):
            nv.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(real_pynvml.NVMLError_Uninitialized):
            nv._nvmlGetFunctionPointer("nvmlInit")


def test_patched_pynvml_restores_sys_modules() -> None:
    before = sys.modules.get("pynvml")
    with sim_pynvml.patched_pynvml(config=CONFIG, clock=FakeClock(E0)):
        import pynvml

        assert pynvml is sim_pynvml
        assert sim_pynvml.current_node() is not None
    assert sys.modules.get("pynvml") is before
    previous = sim_pynvml.install_as_pynvml()
    assert sys.modules["pynvml"] is sim_pynvml
    sim_pynvml.restore_pynvml(previous)
    assert sys.modules.get("pynvml") is before


def test_init_without_install_reads_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEUS_ASYNC_SIM", SimConfig(num_gpus=3, seed=5).to_json())
    with sim_pynvml.patched_pynvml(SimNode(CONFIG, FakeClock(E0))) as nv:
        sim_pynvml.uninstall()
        nv.nvmlInit()
        assert nv.nvmlDeviceGetCount() == 3
        assert sim_pynvml.current_node() is not None


def test_count_ignores_cuda_visible_devices(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert sim.nv.nvmlDeviceGetCount() == 4


def test_identity(sim: Sim) -> None:
    nv = sim.nv
    h = nv.nvmlDeviceGetHandleByIndex(0)
    uuid = nv.nvmlDeviceGetUUID(h)
    assert uuid == sim.node.gpus[0].uuid and uuid.startswith("GPU-") and len(uuid) == 40
    assert nv.nvmlDeviceGetHandleByUUID(uuid) is h
    assert nv.nvmlDeviceGetHandleByUUID(uuid.encode()) is h
    assert nv.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3 (simulated)"  # it says so
    assert nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByIndex(3)) == 3
    assert nv.nvmlDeviceGetArchitecture(h) == nv.NVML_DEVICE_ARCH_HOPPER
    assert nv.nvmlDeviceGetArchitecture(nv.nvmlDeviceGetHandleByIndex(1)) == 4  # Pascal
    assert nv.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    assert nv.nvmlSystemGetDriverVersion() == "550.90.07"
    assert nv.nvmlSystemGetNVMLVersion() == "12.550.90.07"
    assert nv.nvmlSystemGetCudaDriverVersion() == 12040
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(4)
    with pytest.raises(TypeError):
        nv.nvmlDeviceGetHandleByIndex(None)
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID("GPU-nope")
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetName(object())


def test_power_energy_units(sim: Sim) -> None:
    nv, clock = sim.nv, sim.clock
    h = nv.nvmlDeviceGetHandleByIndex(0)
    clock.set_ns(2 * NS + 50_000_000)  # t = 2.05 s
    assert nv.nvmlDeviceGetPowerUsage(h) == 385_000  # mW, 1 s average
    assert nv.nvmlDeviceGetTotalEnergyConsumption(h) == 770_000  # mJ at the 2.0 s update
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetTotalEnergyConsumption(nv.nvmlDeviceGetHandleByIndex(1))


def test_field_values(sim: Sim) -> None:
    nv, clock = sim.nv, sim.clock
    h = nv.nvmlDeviceGetHandleByIndex(0)
    clock.set_ns(2 * NS + 50_000_000)
    values = nv.nvmlDeviceGetFieldValues(
        h,
        [
            (nv.NVML_FI_DEV_POWER_INSTANT, nv.NVML_POWER_SCOPE_GPU),
            (nv.NVML_FI_DEV_POWER_AVERAGE, nv.NVML_POWER_SCOPE_GPU),
            nv.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
            (nv.NVML_FI_DEV_POWER_AVERAGE, nv.NVML_POWER_SCOPE_MEMORY),
            (nv.NVML_FI_DEV_POWER_INSTANT, nv.NVML_POWER_SCOPE_MODULE),
            nv.NVML_FI_DEV_POWER_CURRENT_LIMIT,
            12345,
        ],
    )
    assert len(values) == 7
    got = [(v.fieldId, v.scopeId, v.nvmlReturn) for v in values]
    assert got == [
        (186, 0, 0),
        (185, 0, 0),
        (83, 0, 0),
        (185, 2, 0),
        (186, 1, nv.NVML_ERROR_NOT_SUPPORTED),
        (190, 0, 0),
        (12345, 0, nv.NVML_ERROR_NOT_SUPPORTED),
    ]
    assert (
        values[0].value.uiVal == 385_000 and values[0].valueType == nv.NVML_VALUE_TYPE_UNSIGNED_INT
    )
    assert values[1].value.uiVal == 385_000
    assert values[2].value.ullVal == 770_000
    assert values[2].valueType == nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert values[3].value.uiVal == 50_000  # memory: 20 W + 60 W * 0.5
    assert values[5].value.uiVal == 700_000
    assert values[0].timestamp == (E0 + 2 * NS) // 1000  # µs of the last driver update
    pascal = nv.nvmlDeviceGetFieldValues(
        nv.nvmlDeviceGetHandleByIndex(1), [nv.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION]
    )
    assert pascal[0].nvmlReturn == nv.NVML_ERROR_NOT_SUPPORTED
    limited = nv.nvmlDeviceGetFieldValues(
        nv.nvmlDeviceGetHandleByIndex(3), [(nv.NVML_FI_DEV_POWER_INSTANT, 0)]
    )
    assert limited[0].nvmlReturn == nv.NVML_ERROR_NOT_SUPPORTED


def test_power_limit_calls(sim: Sim) -> None:
    nv, node = sim.nv, sim.node
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetPowerManagementLimitConstraints(h) == [200_000, 700_000]
    assert nv.nvmlDeviceGetPowerManagementDefaultLimit(h) == 700_000
    nv.nvmlDeviceSetPowerManagementLimit(h, 300_000)
    assert nv.nvmlDeviceGetPowerManagementLimit(h) == 300_000
    assert nv.nvmlDeviceGetEnforcedPowerLimit(h) == 300_000
    assert node.gpus[0].power_limit_w == 300.0
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceSetPowerManagementLimit(h, 100_000)
    with pytest.raises(TypeError):
        nv.nvmlDeviceSetPowerManagementLimit(h, 300.5)
    with pytest.raises(nv.NVMLError_NoPermission):
        nv.nvmlDeviceSetPowerManagementLimit(nv.nvmlDeviceGetHandleByIndex(2), 300_000)


def test_clock_calls(sim: Sim) -> None:
    nv, clock, node = sim.nv, sim.clock, sim.node
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetSupportedMemoryClocks(h) == [2619]
    graphics = nv.nvmlDeviceGetSupportedGraphicsClocks(h, 2619)
    assert graphics[0] == 1980 and graphics[-1] == 345
    with pytest.raises(TypeError):
        nv.nvmlDeviceGetSupportedGraphicsClocks(h, None)  # as ctypes rejects None
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetSupportedGraphicsClocks(h, 1000)
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 1980  # busy at 50 %
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM) == 2619
    assert nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_GRAPHICS) == 1980
    nv.nvmlDeviceSetGpuLockedClocks(h, 990, 990)
    assert nv.nvmlDeviceGetClock(h, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_ID_CURRENT) == 990
    assert nv.nvmlDeviceGetClock(h, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_ID_CUSTOMER_BOOST_MAX) == 1980
    assert node.truth_power_w(0, clock.wall_ns()) == pytest.approx(70 + 315 * 0.125)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceSetGpuLockedClocks(h, 1500, 1000)
    nv.nvmlDeviceResetGpuLockedClocks(h)
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 1980
    nv.nvmlDeviceSetMemoryLockedClocks(h, 2619, 2619)
    assert node.gpus[0].memory_locked_clocks == (2619, 2619)
    nv.nvmlDeviceResetMemoryLockedClocks(h)
    assert node.gpus[0].memory_locked_clocks is None
    h3 = nv.nvmlDeviceGetHandleByIndex(3)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceSetGpuLockedClocks(h3, 990, 990)


def test_state_thermals_memory_processes(sim: Sim) -> None:
    nv, clock, node = sim.nv, sim.clock, sim.node
    h = nv.nvmlDeviceGetHandleByIndex(0)
    clock.set_ns(20 * NS)
    assert nv.nvmlDeviceGetPersistenceMode(h) == nv.NVML_FEATURE_ENABLED
    nv.nvmlDeviceSetPersistenceMode(h, nv.NVML_FEATURE_DISABLED)
    assert nv.nvmlDeviceGetPersistenceMode(h) == nv.NVML_FEATURE_DISABLED
    assert nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) == 53  # 30 + 0.06 * 385
    assert nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU) == 53
    with pytest.raises(nv.NVMLError_ArgumentVersionMismatch):
        nv.nvmlDeviceGetTemperatureV(h, 0, version=1)
    util = nv.nvmlDeviceGetUtilizationRates(h)
    assert (util.gpu, util.memory) == (50, 15)
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    gpu = node.gpus[0]
    assert (mem.total, mem.used) == (85_520_809_984, gpu.memory_used_bytes)
    assert mem.free == mem.total - mem.used
    mem2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
    assert mem2.reserved + mem2.used + mem2.free == mem2.total
    procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
    assert [p.pid for p in procs] == [p.pid for p in gpu.processes]
    assert procs[0].usedGpuMemory == gpu.processes[0].memory_bytes
    assert procs[0].gpuInstanceId == 0xFFFFFFFF
    samples = nv.nvmlDeviceGetProcessUtilization(h, 0)
    assert [s.pid for s in samples] == [p.pid for p in gpu.processes]
    assert samples[0].smUtil == round(50 * gpu.processes[0].sm_share)
    assert samples[0].timeStamp == (E0 + 20 * NS) // 1000
    with pytest.raises(nv.NVMLError_NotFound):  # nothing newer than the last sample
        nv.nvmlDeviceGetProcessUtilization(h, samples[0].timeStamp)
    info = nv.nvmlDeviceGetProcessesUtilizationInfo(h, 0)
    assert [s.pid for s in info] == [s.pid for s in samples]
    h3 = nv.nvmlDeviceGetHandleByIndex(3)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetTemperature(h3, 0)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetComputeRunningProcesses(h3)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetC2cModeInfoV(h)


def test_lost_gpu_raises_gpu_is_lost_from_its_time_on(sim: Sim) -> None:
    nv, clock = sim.nv, sim.clock
    h = nv.nvmlDeviceGetHandleByIndex(2)
    clock.set_ns(9 * NS)
    assert nv.nvmlDeviceGetPowerUsage(h) == 385_000
    clock.set_ns(10 * NS)
    calls = [
        lambda: nv.nvmlDeviceGetPowerUsage(h),
        lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h),
        lambda: nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION]),
        lambda: nv.nvmlDeviceGetName(h),
        lambda: nv.nvmlDeviceGetHandleByIndex(2),
        lambda: nv.nvmlDeviceGetMemoryInfo(h),
    ]
    for call in calls:
        with pytest.raises(nv.NVMLError_GpuIsLost):
            call()
    assert nv.nvmlDeviceGetCount() == 4
    assert nv.nvmlDeviceGetPowerUsage(nv.nvmlDeviceGetHandleByIndex(0)) == 385_000


# -- Zeus 0.16 compatibility ----------------------------------------------------------------------

# Every pynvml call and constant of zeus/device/gpu/nvidia.py (Zeus 0.16), in its call forms.
ZEUS_SMOKE = textwrap.dedent(
    """
    def zeus_smoke(pynvml):
        assert hasattr(pynvml, "_nvmlGetFunctionPointer")  # Zeus rejects unofficial bindings
        pynvml.nvmlInit()
        assert pynvml.nvmlDeviceGetCount() >= 1
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        try:
            pynvml.nvmlDeviceGetC2cModeInfoV(handle)
        except pynvml.NVMLError as e:
            assert e.value == pynvml.NVML_ERROR_NOT_SUPPORTED
        assert isinstance(pynvml.nvmlDeviceGetName(handle), str)
        lo, hi = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
        assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == hi
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, lo)
        assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == lo
        default = pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle)
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, default)
        mode = pynvml.nvmlDeviceGetPersistenceMode(handle)
        assert mode in (pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_DISABLED)
        pynvml.nvmlDeviceSetPersistenceMode(handle, pynvml.NVML_FEATURE_ENABLED)
        mem = pynvml.nvmlDeviceGetSupportedMemoryClocks(handle)
        pynvml.nvmlDeviceSetMemoryLockedClocks(handle, min(mem), max(mem))
        pynvml.nvmlDeviceResetMemoryLockedClocks(handle)
        sm = pynvml.nvmlDeviceGetSupportedGraphicsClocks(handle, max(mem))
        pynvml.nvmlDeviceSetGpuLockedClocks(handle, min(sm), max(sm))
        pynvml.nvmlDeviceResetGpuLockedClocks(handle)
        out = {}
        for name, fid, scope in [
            ("avg", pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_POWER_SCOPE_GPU),
            ("instant", pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_GPU),
            ("memory", pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_POWER_SCOPE_MEMORY),
            ("module", pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_POWER_SCOPE_MODULE),
        ]:
            metric = pynvml.nvmlDeviceGetFieldValues(handle, [(fid, scope)])[0]
            if (ret := metric.nvmlReturn) != pynvml.NVML_SUCCESS:
                err = pynvml.NVMLError(ret)
                assert isinstance(err, pynvml.NVMLError_NotSupported)
                out[name] = None
            else:
                out[name] = metric.value.uiVal
        volta = pynvml.nvmlDeviceGetArchitecture(handle) >= pynvml.NVML_DEVICE_ARCH_VOLTA
        out["energy"] = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) if volta else None
        out["temperature"] = pynvml.nvmlDeviceGetTemperatureV(handle, pynvml.NVML_TEMPERATURE_GPU)
        for code in [
            "UNINITIALIZED", "INVALID_ARGUMENT", "NOT_SUPPORTED", "NO_PERMISSION",
            "ALREADY_INITIALIZED", "NOT_FOUND", "INSUFFICIENT_SIZE", "INSUFFICIENT_POWER",
            "DRIVER_NOT_LOADED", "TIMEOUT", "IRQ_ISSUE", "LIBRARY_NOT_FOUND",
            "FUNCTION_NOT_FOUND", "CORRUPTED_INFOROM", "GPU_IS_LOST", "RESET_REQUIRED",
            "OPERATING_SYSTEM", "LIB_RM_VERSION_MISMATCH", "MEMORY", "UNKNOWN",
        ]:
            assert isinstance(getattr(pynvml, "NVML_ERROR_" + code), int)
        pynvml.nvmlShutdown()
        return out
    """
)


def test_zeus_calls_in_process() -> None:
    namespace: dict[str, Any] = {}
    exec(ZEUS_SMOKE, namespace)
    node = SimNode(CONFIG, FakeClock(E0 + 3 * NS))
    with sim_pynvml.patched_pynvml(node):
        import pynvml

        out = namespace["zeus_smoke"](pynvml)
    assert out == {
        "avg": 385_000,
        "instant": 385_000,
        "memory": 50_000,
        "module": None,
        "energy": 1_155_000,
        "temperature": 53,  # 30 + 0.06 * 385: the trace also runs before the epoch
    }


CHILD = ZEUS_SMOKE + textwrap.dedent(
    """
    import json, sys, time
    import pynvml
    from zeus_async.testing import sim_pynvml

    assert getattr(pynvml, "__zeus_async_sim__", False), pynvml
    smoke = zeus_smoke(pynvml)
    pynvml.nvmlInit()
    node = sim_pynvml.current_node()
    probe = [int(x) for x in sys.argv[1:]]
    handle = pynvml.nvmlDeviceGetHandleByIndex(1)
    t0 = time.time_ns()
    power = pynvml.nvmlDeviceGetPowerUsage(handle)
    energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    t1 = time.time_ns()
    print(json.dumps({
        "smoke": smoke,
        "uuids": [g.uuid for g in node.gpus],
        "truth": [node.truth_power_w(0, t) for t in probe],
        "power": power, "energy": energy, "t0": t0, "t1": t1,
        "error_module": pynvml.NVMLError_NotSupported.__module__,
    }))
    """
)


@pytest.mark.slow
def test_subprocess_through_the_shim_sees_the_same_node(tmp_path: Any) -> None:
    import time

    origin = time.time_ns() - 30 * NS
    cfg = SimConfig(
        num_gpus=2,
        seed=9,
        counter_origin_ns=origin,
        workload=RandomWorkload(seg_min_s=0.05, seg_max_s=0.5, repeat_s=30.0),
        gpus=(
            GpuOverride(),
            GpuOverride(workload=SquareWorkload(period_s=3600.0, duty=1.0, high=0.5)),
        ),
    )
    parent = SimNode(cfg)  # real clock, like the child
    probe = [origin + k * 123_456_789 for k in range(40)]
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, **sim_pynvml.shim_env(cfg)}
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(sim_pynvml.SHIM_DIR)
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, probe)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["uuids"] == [g.uuid for g in parent.gpus]
    assert out["truth"] == [parent.truth_power_w(0, t) for t in probe]
    assert out["power"] == 385_000  # GPU 1 draws a constant 385 W
    lo, hi = (parent.gpus[1].energy_counter_mj(t) for t in (out["t0"], out["t1"]))
    assert lo <= out["energy"] <= hi and lo > 0
    assert out["error_module"] == "_zeus_async_real_pynvml"  # the real classes, loaded privately
    assert out["smoke"]["memory"] is not None and out["smoke"]["module"] is None


def test_shim_env_pins_the_installed_counter_origin() -> None:
    node = SimNode(SimConfig(num_gpus=1), FakeClock(E0))
    with sim_pynvml.patched_pynvml(node):
        env = sim_pynvml.shim_env()
    cfg = SimConfig.from_json(env["ZEUS_ASYNC_SIM"])
    assert cfg.counter_origin_ns == node.counter_origin_ns
    assert cfg.num_gpus == 1


def test_shim_module_reexports() -> None:
    shim_file = sim_pynvml.SHIM_DIR / "pynvml.py"
    assert shim_file.is_file()
    namespace: dict[str, Any] = {}
    exec(compile(shim_file.read_text(), str(shim_file), "exec"), namespace)
    assert namespace["nvmlInit"] is sim_pynvml.nvmlInit
    assert namespace["_nvmlGetFunctionPointer"] is sim_pynvml._nvmlGetFunctionPointer
    assert namespace["NVMLError_GpuIsLost"] is real_pynvml.NVMLError_GpuIsLost
    assert namespace["__zeus_async_sim__"] is True
    assert namespace["__getattr__"] is sim_pynvml.__getattr__
    assert isinstance(sim_pynvml, ModuleType)


def test_functions_the_simulator_lacks_fail_like_an_old_driver(sim: Sim) -> None:
    nv = sim.nv
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert hasattr(real_pynvml, "nvmlDeviceGetPciInfo")
    with pytest.raises(nv.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetPciInfo(h)
    with pytest.raises(AttributeError):
        nv.nvmlNoSuchFunction  # noqa: B018
    nv.nvmlShutdown()
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlDeviceGetPciInfo(h)
    nv.nvmlInit()


# -- what the power readings report (SimConfig.power_reading, driver version) ----------------


def _power_queries(config: SimConfig, seconds: float) -> tuple[int | None, ...]:
    """(nvmlDeviceGetPowerUsage, POWER_INSTANT, POWER_AVERAGE) in mW at ``seconds``, None
    where NOT_SUPPORTED, on a 10 s square wave (5 s at 700 W, then 70 W)."""
    clock = FakeClock(E0)
    node = SimNode(config, clock, shared_state=False)
    with sim_pynvml.patched_pynvml(node) as nv:
        nv.nvmlInit()
        clock.set_ns(E0 + round(seconds * NS))
        h = nv.nvmlDeviceGetHandleByIndex(0)
        fields = nv.nvmlDeviceGetFieldValues(
            h, [(nv.NVML_FI_DEV_POWER_INSTANT, 0), (nv.NVML_FI_DEV_POWER_AVERAGE, 0)]
        )
        values = tuple(v.value.uiVal if v.nvmlReturn == 0 else None for v in fields)
        out = (nv.nvmlDeviceGetPowerUsage(h), *values)
        nv.nvmlShutdown()
    return out


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # H100 (Ampere and newer except GA100): the 1 s average, the 25 ms head sensor beside it.
        ({}, (637_000, 70_000, 637_000)),
        # GA100 and older: nvmlDeviceGetPowerUsage is the instant sensor; no POWER_AVERAGE.
        ({"power_reading": "instant", "name": "NVIDIA A100-SXM4-80GB"}, (70_000, 70_000, None)),
        # No instant sensor behind any reading (the stand-in of issue 34).
        ({"power_reading": "average_only"}, (637_000, 637_000, 637_000)),
        # A driver before 535 knows no power field ids: only nvmlDeviceGetPowerUsage is left.
        ({"driver_version": "525.147.05"}, (637_000, None, None)),
        (
            {"power_reading": "instant", "driver_version": "470.239.06", "arch": "volta"},
            (70_000, None, None),
        ),
    ],
)
def test_power_readings_report_what_the_device_reports(
    overrides: dict[str, Any], expected: tuple[int | None, ...]
) -> None:
    config = SimConfig(
        num_gpus=1,
        epoch_ns=E0,
        counter_origin_ns=E0,
        workload=SquareWorkload(period_s=10.0, duty=0.5),
        **overrides,
    )
    # At 5.1 s: the last second is 0.9 s at 700 W and 0.1 s at 70 W; the head of the last
    # completed 100 ms period (5.0-5.1 s) is at 70 W.
    assert _power_queries(config, 5.1) == expected


def test_power_reading_is_per_gpu() -> None:
    config = SimConfig(
        num_gpus=2,
        epoch_ns=E0,
        counter_origin_ns=E0,
        workload=SquareWorkload(period_s=10.0, duty=0.5),
        power_reading="instant",
        gpus=(GpuOverride(), GpuOverride(power_reading="average_only")),
    )
    node = SimNode(config, FakeClock(E0), shared_state=False)
    assert [g.power_reading for g in node.gpus] == ["instant", "average_only"]
    t = E0 + 5_100_000_000
    assert [g.power_usage_mw(t) for g in node.gpus] == [70_000, 637_000]
    assert [g.instant_field_mw(t) for g in node.gpus] == [70_000, 637_000]
    with pytest.raises(Exception, match="power_reading"):
        SimConfig.from_json('{"power_reading": "sometimes"}')
