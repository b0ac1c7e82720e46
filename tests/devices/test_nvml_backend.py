"""The NVML backend, running unchanged on the simulated pynvml module."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, NamedTuple

import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices.base import GPU_FIELDS, Device, GpuControl
from zeus_async.devices.nvml import (
    NvmlGpu,
    map_nvml_error,
    nvml_available,
    open_nvml_gpus,
    parse_cuda_visible_devices,
    visible_nvml_indices,
)
from zeus_async.devices.sim import (
    ConstantWorkload,
    GpuOverride,
    SimConfig,
    SimNode,
    SquareWorkload,
)
from zeus_async.errors import (
    ConfigError,
    DeviceLostError,
    DeviceNotFoundError,
    DriverNotLoadedError,
    NoPermissionError,
    NotSupportedError,
    TransientDeviceError,
)
from zeus_async.events import GpuSample
from zeus_async.testing import _sim_nvml_base, sim_pynvml

# The real nvidia-ml-py module, as the simulator found it (never the simulator itself, even if a
# test elsewhere left ``sys.modules["pynvml"]`` pointing at it).
real_pynvml: Any = _sim_nvml_base._real
assert real_pynvml is not None and not hasattr(real_pynvml, "__zeus_async_sim__")

NS = 1_000_000_000
E0 = 1_700_000_000 * NS
POWER = ("power_w", "avg_power_w", "energy_j")


def config(*overrides: GpuOverride, num_gpus: int = 4) -> SimConfig:
    return SimConfig(
        num_gpus=num_gpus,
        epoch_ns=E0,
        counter_origin_ns=E0,
        workload=ConstantWorkload(util=0.5),
        gpus=overrides,
    )


class Sim(NamedTuple):
    clock: FakeClock
    node: SimNode


@pytest.fixture
def sim() -> Iterator[Sim]:
    clock = FakeClock(E0)
    node = SimNode(config(), clock)
    with sim_pynvml.patched_pynvml(node):
        yield Sim(clock, node)


def spy(base: Any = sim_pynvml, **overrides: Any) -> tuple[ModuleType, Counter[str]]:
    """A copy of ``base`` that counts device calls; ``overrides`` replace or (None) hide names."""
    calls: Counter[str] = Counter()
    mod = ModuleType("pynvml_spy")
    for name in dir(base):
        if name.startswith("__"):
            continue
        value = getattr(base, name)
        if name.startswith("nvml") and callable(value):

            def counted(*args: Any, _f: Callable[..., Any] = value, _n: str = name) -> Any:
                calls[_n] += 1
                return _f(*args)

            value = counted
        setattr(mod, name, value)
    for name, value in overrides.items():
        if value is None:
            delattr(mod, name)
        else:
            setattr(mod, name, value)
    return mod, calls


def one(gpu: NvmlGpu, fields: tuple[str, ...] = GPU_FIELDS) -> GpuSample:
    events = gpu.read(fields, "host", 123)
    assert len(events) == 1 and isinstance(events[0], GpuSample)
    return events[0]


# -- opening and describing ---------------------------------------------------------------------


def test_open_all_and_describe(sim: Sim) -> None:
    gpus = open_nvml_gpus(env={})
    assert [g.key for g in gpus] == ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]
    g = gpus[0]
    assert isinstance(g, Device) and isinstance(g, GpuControl)
    info = g.describe()
    assert info.key == "gpu:0" and info.name == "NVIDIA H100 80GB HBM3 (simulated)"
    assert info.uuid == sim.node.gpus[0].uuid and info.arch == "hopper"
    assert info.has_energy_counter
    assert (info.power_limit_min_w, info.power_limit_max_w, info.power_limit_default_w) == (
        200.0,
        700.0,
        700.0,
    )
    assert info.supported_sm_clocks_hz[0] == 1980e6 and info.supported_sm_clocks_hz[-1] == 345e6
    assert g.fields == GPU_FIELDS
    assert g.index == 0 and g.physical_index == 0


def test_read_values_and_units(sim: Sim) -> None:
    gpu = open_nvml_gpus([0], env={})[0]
    sim.clock.set_ns(20 * NS + 50_000_000)
    s = one(gpu)
    assert (s.host, s.t_ns, s.gpu) == ("host", 123, 0)
    assert s.power_w == 385.0 and s.avg_power_w == 385.0
    assert s.energy_j == pytest.approx(385.0 * 20)
    assert s.temperature_c == 53.0
    assert s.sm_clock_hz == 1980e6
    assert s.utilization_frac == 0.5
    assert s.memory_used_bytes == sim.node.gpus[0].memory_used_bytes
    assert s.power_limit_w == 700.0


def test_power_fields_share_one_field_values_call(sim: Sim) -> None:
    nv, calls = spy()
    gpu = open_nvml_gpus([0], pynvml_module=nv, env={})[0]
    calls.clear()
    s = one(gpu, POWER)
    assert calls == Counter({"nvmlDeviceGetFieldValues": 1})
    assert (s.power_w, s.avg_power_w, s.energy_j) == (385.0, 385.0, 0.0)
    calls.clear()
    s = one(gpu, ("temperature_c", "memory_used_bytes"))
    assert calls == Counter({"nvmlDeviceGetTemperatureV": 1, "nvmlDeviceGetMemoryInfo": 1})
    assert s.power_w is None and s.temperature_c == 53.0
    calls.clear()
    one(gpu, frozenset({"energy_j"}))
    assert calls == Counter({"nvmlDeviceGetFieldValues": 1})


def test_pre_volta_has_no_energy_counter() -> None:
    with sim_pynvml.patched_pynvml(SimNode(config(GpuOverride(pre_volta=True)), FakeClock(E0))):
        gpu = open_nvml_gpus([0], env={})[0]
        assert not gpu.describe().has_energy_counter and gpu.describe().arch == "pascal"
        assert "energy_j" not in gpu.fields
        s = one(gpu, POWER)
        assert s.energy_j is None and s.power_w == 385.0


def test_unsupported_fields_are_none_and_not_requeried() -> None:
    cfg = config(GpuOverride(unsupported=("temperature", "instant_power", "average_power")))
    with sim_pynvml.patched_pynvml(SimNode(cfg, FakeClock(E0))):
        nv, calls = spy()
        gpu = open_nvml_gpus([0], pynvml_module=nv, env={})[0]
        assert "temperature_c" not in gpu.fields and "power_w" not in gpu.fields
        assert "avg_power_w" not in gpu.fields and "energy_j" in gpu.fields
        calls.clear()
        s = one(gpu)
        assert s.temperature_c is None and s.power_w is None and s.avg_power_w is None
        assert s.energy_j == 0.0 and s.utilization_frac == 0.5
        assert "nvmlDeviceGetTemperatureV" not in calls and "nvmlDeviceGetPowerUsage" not in calls
        assert calls["nvmlDeviceGetFieldValues"] == 1  # energy only


def test_missing_field_ids_fall_back_to_per_call_apis(sim: Sim) -> None:
    nv, calls = spy(NVML_FI_DEV_POWER_INSTANT=None, NVML_FI_DEV_POWER_AVERAGE=None)
    gpu = open_nvml_gpus([0], pynvml_module=nv, env={})[0]
    calls.clear()
    sim.clock.set_ns(NS)
    s = one(gpu, POWER)
    assert s.power_w is None  # Hopper: nvmlDeviceGetPowerUsage is a 1 s average
    assert s.avg_power_w == 385.0 and s.energy_j == 385.0
    assert calls == Counter({"nvmlDeviceGetFieldValues": 1, "nvmlDeviceGetPowerUsage": 1})


def test_field_values_unsupported_uses_per_call_apis() -> None:
    cfg = config(GpuOverride(unsupported=("field_values",), arch="volta"))
    with sim_pynvml.patched_pynvml(SimNode(cfg, FakeClock(E0 + NS))):
        nv, calls = spy()
        gpu = open_nvml_gpus([0], pynvml_module=nv, env={})[0]
        calls.clear()
        s = one(gpu, POWER)
        # Volta: nvmlDeviceGetPowerUsage is instantaneous, so it serves power_w
        assert (s.power_w, s.avg_power_w, s.energy_j) == (385.0, None, 385.0)
        assert "nvmlDeviceGetFieldValues" not in calls
        assert calls["nvmlDeviceGetTotalEnergyConsumption"] == 1


@pytest.mark.parametrize(
    ("name", "overrides", "source", "power_w", "avg_power_w"),
    [
        # From driver 535 on, the instant field; nvmlDeviceGetPowerUsage is the 1 s average.
        ("NVIDIA H100 80GB HBM3", {}, "NVML_FI_DEV_POWER_INSTANT", 70.0, 637.0),
        # An older driver: the 1 s average is all there is, and it is never power_w.
        ("NVIDIA H100 80GB HBM3", {"driver_version": "525.147.05"}, None, None, 637.0),
        ("NVIDIA RTX A3000 Laptop GPU", {"driver_version": "525.147.05"}, None, None, 637.0),
        # GA100: nvmlDeviceGetPowerUsage is documented as instantaneous (no POWER_AVERAGE).
        (
            "NVIDIA A100-SXM4-80GB",
            {"power_reading": "instant", "driver_version": "525.147.05"},
            "nvmlDeviceGetPowerUsage",
            70.0,
            None,
        ),
        (
            "NVIDIA A100-SXM4-80GB",
            {"power_reading": "instant"},
            "NVML_FI_DEV_POWER_INSTANT",
            70.0,
            None,
        ),
        # A GA100 whose driver averages nvmlDeviceGetPowerUsage after all: the backend goes
        # by the documentation; the estimators judge the readings themselves
        # (tests/aggregate/test_power_readings.py).
        (
            "NVIDIA A100-SXM4-80GB",
            {"driver_version": "525.147.05"},
            "nvmlDeviceGetPowerUsage",
            637.0,
            None,
        ),
    ],
)
def test_power_w_is_an_instant_reading_and_says_where_it_comes_from(
    name: str,
    overrides: dict[str, Any],
    source: str | None,
    power_w: float | None,
    avg_power_w: float | None,
) -> None:
    cfg = SimConfig(
        num_gpus=1,
        epoch_ns=E0,
        counter_origin_ns=E0,
        workload=SquareWorkload(period_s=10.0, duty=0.5),  # 5 s at 700 W, 5 s at 70 W
        name=name,
        arch="hopper" if "H100" in name else "ampere",
        **overrides,
    )
    with sim_pynvml.patched_pynvml(SimNode(cfg, clock := FakeClock(E0), shared_state=False)):
        gpu = open_nvml_gpus([0], pynvml_module=sim_pynvml, env={})[0]
        assert gpu.power_source == source
        # 5.1 s: the head of the period that just ended is at 70 W; the last second averages
        # 0.9 s at 700 W and 0.1 s at 70 W.
        clock.set_ns(E0 + 5_100_000_000)
        s = one(gpu, POWER)
        assert (s.power_w, s.avg_power_w) == (power_w, avg_power_w)
        gpu.close()


def test_lost_gpu_raises_device_lost() -> None:
    serve_cfg = config(GpuOverride(lost_at_s=5.0))
    with sim_pynvml.patched_pynvml(SimNode(serve_cfg, clock := FakeClock(E0))):
        gpu = open_nvml_gpus([0], env={})[0]
        clock.set_ns(4 * NS)
        assert one(gpu, POWER).power_w == 385.0
        clock.set_ns(5 * NS)
        for fields in (POWER, ("temperature_c",), GPU_FIELDS):
            with pytest.raises(DeviceLostError) as info:
                gpu.read(fields, "host", 1)
            assert info.value.device == "gpu:0" and info.value.code == 15
        with pytest.raises(DeviceLostError):
            open_nvml_gpus([0], env={})


def test_transient_errors_leave_fields_none_unless_all_fail(sim: Sim) -> None:
    def timeout(*args: Any) -> Any:
        raise real_pynvml.NVMLError(real_pynvml.NVML_ERROR_TIMEOUT)

    nv, _ = spy()
    gpu = open_nvml_gpus([0], pynvml_module=nv, env={})[0]
    nv.nvmlDeviceGetTemperatureV = timeout  # type: ignore[attr-defined]
    s = one(gpu, ("temperature_c", "utilization_frac"))
    assert s.temperature_c is None and s.utilization_frac == 0.5
    assert "temperature_c" in gpu.fields  # transient: still supported
    nv.nvmlDeviceGetFieldValues = timeout  # type: ignore[attr-defined]
    with pytest.raises(TransientDeviceError):
        gpu.read(("temperature_c", "power_w"), "host", 1)


# -- control ------------------------------------------------------------------------------------


def test_power_limit_control(sim: Sim) -> None:
    gpu = open_nvml_gpus([0], env={})[0]
    assert gpu.power_limit_range_w() == (200.0, 700.0)
    gpu.set_power_limit_w(350.0)
    assert gpu.get_power_limit_w() == 350.0
    sim.clock.set_ns(2 * NS)
    assert sim.node.truth_power_w(0, sim.clock.wall_ns()) == 350.0  # 385 W capped
    with pytest.raises(ConfigError, match=r"\[200, 700\] W"):
        gpu.set_power_limit_w(100.0)
    with pytest.raises(ConfigError):
        gpu.set_power_limit_w(float("nan"))


def test_no_permission_says_what_is_needed() -> None:
    with sim_pynvml.patched_pynvml(SimNode(config(GpuOverride(no_permission=True)), FakeClock(E0))):
        gpu = open_nvml_gpus([0], env={})[0]
        with pytest.raises(NoPermissionError, match="CAP_SYS_ADMIN") as info:
            gpu.set_power_limit_w(300.0)
        assert info.value.device == "gpu:0" and info.value.code == 4
        assert "setting the power limit" in str(info.value)
        with pytest.raises(NoPermissionError, match="root"):
            gpu.lock_sm_clocks_hz(990e6, 990e6)


def test_clock_control() -> None:
    cfg = config(num_gpus=1)
    with sim_pynvml.patched_pynvml(SimNode(cfg, clock := FakeClock(E0))):
        gpu = open_nvml_gpus(env={})[0]
        gpu.lock_sm_clocks_hz(990e6, 990e6)
        clock.set_ns(NS)
        assert one(gpu, ("sm_clock_hz",)).sm_clock_hz == 990e6
        gpu.reset_sm_clocks()
        assert one(gpu, ("sm_clock_hz",)).sm_clock_hz == 1980e6
        assert gpu.supported_sm_clocks_hz()[:2] == [1980e6, 1965e6]
        with pytest.raises(ConfigError):
            gpu.lock_sm_clocks_hz(1e9, 5e8)


# -- CUDA_VISIBLE_DEVICES -------------------------------------------------------------------------

UUIDS = [
    "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
    "GPU-1b2c3d4e-0000-0000-0000-000000000000",
    "GPU-8932aaaa-0000-0000-0000-000000000000",
    "GPU-ffff0000-0000-0000-0000-000000000000",
]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("2,0", [2, 0]),
        (" 1 , 3 ", [1, 3]),
        ("0,7,1", [0]),  # stops at the first invalid index
        ("-1", []),
        ("1,-1,2", [1]),
        ("0,0,1", [0]),  # a repeated GPU is invalid
        ("1,,2", [1]),
        ("abc,1", []),
        ("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", [0]),
        ("GPU-1b2c,GPU-ffff", [1, 3]),  # unique prefixes
        ("1b2c3d4e", [1]),  # without "GPU-"
        ("GPU-8932,1", []),  # ambiguous prefix: stop
        ("3,GPU-8932f,GPU-nope,1", [3, 0]),
        ("2,GPU-1B2C", [2, 1]),
    ],
)
def test_parse_cuda_visible_devices(value: str | None, expected: list[int]) -> None:
    assert parse_cuda_visible_devices(value, 4, UUIDS) == expected


def test_parse_reads_uuids_only_when_needed() -> None:
    def boom() -> list[str]:
        raise AssertionError("UUIDs looked up")

    assert parse_cuda_visible_devices("1,0", 4, boom) == [1, 0]
    assert parse_cuda_visible_devices("GPU-ffff", 4, lambda: UUIDS) == [3]


def test_mig_devices_are_refused() -> None:
    with pytest.raises(ConfigError, match="MIG"):
        parse_cuda_visible_devices("MIG-GPU-8932f937/1/0", 4, UUIDS)


def test_open_honours_cuda_visible_devices(sim: Sim) -> None:
    uuid3 = sim.node.gpus[3].uuid
    gpus = open_nvml_gpus(env={"CUDA_VISIBLE_DEVICES": f"2,{uuid3[:12]}"})
    assert [(g.key, g.physical_index) for g in gpus] == [("gpu:0", 2), ("gpu:1", 3)]
    assert gpus[1].describe().uuid == uuid3
    only = open_nvml_gpus([1], env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert [(g.key, g.physical_index) for g in only] == [("gpu:1", 3)]
    assert one(only[0], ("power_w",)).gpu == 1
    assert open_nvml_gpus(env={"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_nvml_indices(env={"CUDA_VISIBLE_DEVICES": "3,1"}) == [3, 1]


def test_bad_indices_are_config_errors(sim: Sim) -> None:
    with pytest.raises(ConfigError, match="GPU index 2 out of range: 2 visible"):
        open_nvml_gpus([2], env={"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ConfigError, match="repeated"):
        open_nvml_gpus([0, 0], env={})
    with pytest.raises(ConfigError, match="out of range"):
        open_nvml_gpus([-1], env={})


# -- NVML sessions and availability ---------------------------------------------------------------


def test_close_releases_nvml(sim: Sim) -> None:
    gpus = open_nvml_gpus(env={})
    assert sim_pynvml.nvmlDeviceGetCount() == 4  # initialized while GPUs are open
    for g in gpus:
        g.close()
        g.close()  # idempotent
    with pytest.raises(real_pynvml.NVMLError_Uninitialized):
        sim_pynvml.nvmlDeviceGetCount()


def test_nvml_available() -> None:
    with sim_pynvml.patched_pynvml(SimNode(config(), FakeClock(E0))):
        assert nvml_available()
        assert nvml_available(sim_pynvml)
    # this machine has no NVIDIA driver: the real bindings cannot initialize
    assert not nvml_available(real_pynvml)
    assert visible_nvml_indices(pynvml_module=real_pynvml) == []
    with pytest.raises(DriverNotLoadedError, match="initializing NVML"):
        open_nvml_gpus(pynvml_module=real_pynvml)


# -- error mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("NOT_SUPPORTED", NotSupportedError),
        ("FUNCTION_NOT_FOUND", NotSupportedError),
        ("ARGUMENT_VERSION_MISMATCH", NotSupportedError),
        ("DEPRECATED", NotSupportedError),
        ("NO_PERMISSION", NoPermissionError),
        ("OPERATING_SYSTEM", NoPermissionError),
        ("GPU_IS_LOST", DeviceLostError),
        ("RESET_REQUIRED", DeviceLostError),
        ("IRQ_ISSUE", DeviceLostError),
        ("INSUFFICIENT_POWER", DeviceLostError),
        ("DRIVER_NOT_LOADED", DriverNotLoadedError),
        ("LIBRARY_NOT_FOUND", DriverNotLoadedError),
        ("LIB_RM_VERSION_MISMATCH", DriverNotLoadedError),
        ("UNINITIALIZED", DriverNotLoadedError),
        ("INVALID_ARGUMENT", ConfigError),
        ("FREQ_NOT_SUPPORTED", ConfigError),
        ("NOT_FOUND", DeviceNotFoundError),
        ("GPU_NOT_FOUND", DeviceNotFoundError),
        ("TIMEOUT", TransientDeviceError),
        ("UNKNOWN", TransientDeviceError),
        ("IN_USE", TransientDeviceError),
        ("MEMORY", TransientDeviceError),
        ("NO_DATA", TransientDeviceError),
        ("CORRUPTED_INFOROM", TransientDeviceError),
        ("ALREADY_INITIALIZED", TransientDeviceError),
        ("INSUFFICIENT_SIZE", TransientDeviceError),
        ("INSUFFICIENT_RESOURCES", TransientDeviceError),
        ("NOT_READY", TransientDeviceError),
        ("INVALID_STATE", TransientDeviceError),
    ],
)
def test_map_nvml_error(code: str, expected: type[Exception]) -> None:
    value = getattr(real_pynvml, "NVML_ERROR_" + code)
    err = map_nvml_error(real_pynvml.NVMLError(value), "gpu:3", "reading power")
    assert type(err) is expected
    assert f"reading power on gpu:3: NVML error {value}" in str(err)
    if not isinstance(err, ConfigError):
        assert err.device == "gpu:3" and err.code == value  # type: ignore[attr-defined]


def test_every_nvml_error_code_maps_to_a_package_error() -> None:
    codes = [v for k, v in vars(real_pynvml).items() if k.startswith("NVML_ERROR_")]
    assert len(codes) >= 30
    for value in codes:
        err = map_nvml_error(real_pynvml.NVMLError(value))
        assert isinstance(err, (ConfigError, NotSupportedError, TransientDeviceError)) or (
            err.kind in ("no_permission", "gpu_lost", "driver_not_loaded", "not_found")  # type: ignore[attr-defined]
        )


def test_map_non_nvml_exception() -> None:
    err = map_nvml_error(RuntimeError("boom"), "gpu:0")
    assert isinstance(err, TransientDeviceError) and err.code is None and "boom" in str(err)
