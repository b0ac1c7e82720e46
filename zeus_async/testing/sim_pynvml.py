"""A pynvml-compatible module served by the GPU simulator (:mod:`zeus_async.devices.sim`).

The functions here have nvidia-ml-py's names, signatures, units (mW, mJ, MHz, bytes, °C) and
error behaviour (``NVMLError(code)`` subclasses; ``NVML_ERROR_UNINITIALIZED`` before
:func:`nvmlInit`; ``TypeError`` where ctypes would reject an argument). Constants, error classes
and result structs are *re-exported from the real* ``pynvml`` when it is importable, so
``except pynvml.NVMLError_NotSupported`` behaves identically whichever module raised.

Ways to use it:

* pass the module itself: ``open_nvml_gpus(pynvml_module=sim_pynvml)``;
* :func:`install_as_pynvml` / :func:`patched_pynvml`: make ``import pynvml`` return this module
  in the current process (tests, benchmarks of third-party code such as Zeus);
* :func:`shim_env`: environment for a *subprocess* whose ``import pynvml`` must get the
  simulator (``PYTHONPATH`` gains a directory holding a one-line ``pynvml.py``), with the node
  configuration in ``ZEUS_ASYNC_SIM``.

Which node is served: the one given to :func:`install`; otherwise :func:`nvmlInit` builds one
from ``ZEUS_ASYNC_SIM`` (JSON or a path) or the defaults, on the real clock. Like real NVML, the
device count ignores ``CUDA_VISIBLE_DEVICES`` (the backend applies it).

As with a driver, what the ``nvmlDeviceSet*`` calls change (power limit, locked SM clocks,
persistence mode) belongs to the node, not the process: every process simulating the same
configuration sees it, and it stays after the process exits (:mod:`zeus_async.devices.sim_state`;
:func:`~zeus_async.testing.read_sim_node_state` reads it and
:func:`~zeus_async.testing.reset_sim_node_state` puts the defaults back).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import operator
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import msgspec

from ..clock import Clock
from ..devices.sim import COMPUTE_CAPABILITY, SIM_ENV_VAR, SimConfig, SimGpu, SimNode
from . import _sim_nvml_base as _b
from ._sim_nvml_base import SHIM_DIR, Handle, NVMLError, _src

logger = logging.getLogger(__name__)

#: Marks this module (and the shim) as the simulator, not the real bindings.
__zeus_async_sim__ = True

_EXTRA_EXPORTS = ("nvmlExceptionClass", "nvmlFriendlyObject", "nvmlStructToFriendlyObject")
for _name, _value in vars(_src).items():
    if (
        _name.startswith(("NVML", "c_nvml"))
        or _name in _EXTRA_EXPORTS
        or (_name.startswith("nvml") and isinstance(_value, int))
    ):
        globals()[_name] = _value


_lock = threading.RLock()
_node: SimNode | None = None
_handles: list[Handle] = []
_init_count = 0


# -- installation -----------------------------------------------------------------------------


def install(
    node: SimNode | None = None, *, config: SimConfig | None = None, clock: Clock | None = None
) -> SimNode:
    """Serve ``node`` (or a new node from ``config``/``ZEUS_ASYNC_SIM``, on ``clock``).

    Does not initialize NVML: callers still call :func:`nvmlInit` as with the real module.
    """
    global _node, _handles
    if node is None:
        node = SimNode(config, clock) if config is not None else SimNode.from_env(clock=clock)
    cfg = node.config
    # On a mixed node (GpuOverride.vendor), NVML serves its NVIDIA GPUs only, in node order.
    mixed = any(ov.vendor is not None for ov in cfg.gpus)
    with _lock:
        _node = node
        _handles = [Handle(g) for g in node.gpus if not mixed or _vendor(cfg, g.index) == "nvidia"]
    return node


def _vendor(config: SimConfig, index: int) -> str:
    ov = config.gpus[index] if index < len(config.gpus) else None
    return (ov.vendor if ov is not None else None) or config.vendor


def uninstall() -> None:
    """Forget the node and reset the init count (the next :func:`nvmlInit` builds a new node)."""
    global _node, _handles, _init_count
    with _lock:
        _node, _handles, _init_count = None, [], 0


def current_node() -> SimNode | None:
    """The node being served, if any."""
    return _node


def install_as_pynvml() -> ModuleType | None:
    """Make ``import pynvml`` return this module; returns the previous ``sys.modules`` entry."""
    previous = sys.modules.get("pynvml")
    sys.modules["pynvml"] = sys.modules[__name__]
    return previous


def restore_pynvml(previous: ModuleType | None) -> None:
    """Undo :func:`install_as_pynvml`."""
    if previous is None:
        sys.modules.pop("pynvml", None)
    else:
        sys.modules["pynvml"] = previous


@contextlib.contextmanager
def patched_pynvml(
    node: SimNode | None = None, *, config: SimConfig | None = None, clock: Clock | None = None
) -> Iterator[ModuleType]:
    """Within the block, ``import pynvml`` gives this module serving ``node``; then restore."""
    global _node, _handles, _init_count
    with _lock:
        saved = (_node, _handles, _init_count)
    install(node, config=config, clock=clock)
    previous = install_as_pynvml()
    try:
        yield sys.modules[__name__]
    finally:
        restore_pynvml(previous)
        with _lock:
            _node, _handles, _init_count = saved


def shim_env(config: SimConfig | None = None) -> dict[str, str]:
    """``PYTHONPATH`` and ``ZEUS_ASYNC_SIM`` for a subprocess that must import the simulator.

    Merge into the child's environment: ``env={**os.environ, **shim_env(cfg)}``. Without
    ``config``, the installed node's config is used (with its counter origin pinned, so the child
    counts energy from the same origin), else the defaults.
    """
    if config is None:
        node = _node
        if node is not None:
            config = msgspec.structs.replace(node.config, counter_origin_ns=node.counter_origin_ns)
        else:
            config = SimConfig()
    path = os.environ.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": str(SHIM_DIR) + (os.pathsep + path if path else ""),
        SIM_ENV_VAR: config.to_json(),
    }


# -- helpers ----------------------------------------------------------------------------------


def _enter() -> SimNode:
    node = _node
    if _init_count == 0 or node is None:
        raise NVMLError(_b.UNINITIALIZED)
    node.spin()
    return node


def _gpu(handle: object) -> tuple[SimNode, SimGpu, int]:
    """Validate a handle; returns the node, the GPU and the current wall time."""
    node = _enter()
    if not isinstance(handle, Handle) or handle.index >= len(node.gpus):
        raise NVMLError(_b.INVALID_ARGUMENT)
    gpu = node.gpus[handle.index]
    if gpu is not handle.gpu:
        raise NVMLError(_b.INVALID_ARGUMENT)  # a handle of a node that is no longer served
    now = node.now_ns()
    if gpu.is_lost(now):
        raise NVMLError(_b.GPU_IS_LOST)
    return node, gpu, now


def _need(gpu: SimGpu, feature: str) -> None:
    if feature in gpu.unsupported:
        raise NVMLError(_b.NOT_SUPPORTED)


def _settable(gpu: SimGpu, feature: str) -> None:
    _need(gpu, feature)
    if gpu.no_permission:
        raise NVMLError(_b.NO_PERMISSION)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _nvmlGetFunctionPointer(name: str) -> Any:
    """There is no C library behind the simulator: every symbol is "not found"."""
    if _init_count == 0:
        raise NVMLError(_b.UNINITIALIZED)
    raise NVMLError(_b.FUNCTION_NOT_FOUND)


def nvmlErrorString(result: int) -> str:
    """Text of an NVML error code."""
    text: str = NVMLError._errcode_to_string.get(result, "Unknown Error")
    return text


# -- init / system ----------------------------------------------------------------------------


def nvmlInitWithFlags(flags: int) -> None:
    """Initialize (reference-counted, like NVML); builds the node from the env if none."""
    global _init_count
    operator.index(flags)
    with _lock:
        if _node is None:
            install()
        _init_count += 1


def nvmlInit() -> None:
    """Initialize NVML."""
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    """Drop one reference from :func:`nvmlInit`; UNINITIALIZED if there is none."""
    global _init_count
    with _lock:
        if _init_count == 0:
            raise NVMLError(_b.UNINITIALIZED)
        _init_count -= 1


def nvmlSystemGetDriverVersion() -> str:
    return _enter().config.driver_version


def nvmlSystemGetNVMLVersion() -> str:
    return _enter().config.nvml_version


def nvmlSystemGetCudaDriverVersion() -> int:
    return _enter().config.cuda_driver_version


nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion


# -- device identity --------------------------------------------------------------------------


def nvmlDeviceGetCount() -> int:
    """Number of GPUs (``CUDA_VISIBLE_DEVICES`` is not applied, as in real NVML)."""
    _enter()
    return len(_handles)


def nvmlDeviceGetHandleByIndex(index: int) -> Handle:
    node = _enter()
    index = operator.index(index)
    if not 0 <= index < len(_handles):
        raise NVMLError(_b.INVALID_ARGUMENT)
    if _handles[index].gpu.is_lost(node.now_ns()):
        raise NVMLError(_b.GPU_IS_LOST)
    return _handles[index]


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> Handle:
    node = _enter()
    wanted = _text(uuid)
    for handle in _handles:
        if handle.gpu.uuid == wanted:
            if handle.gpu.is_lost(node.now_ns()):
                raise NVMLError(_b.GPU_IS_LOST)
            return handle
    raise NVMLError(_b.NOT_FOUND)


def nvmlDeviceGetName(handle: Handle) -> str:
    # A simulated GPU says so in its name, wherever the name goes (recordings, Prometheus'
    # modelName, inspect, plots); the model's name stays a substring for what matches on it.
    return f"{_gpu(handle)[1].name} (simulated)"


def nvmlDeviceGetUUID(handle: Handle) -> str:
    return _gpu(handle)[1].uuid


def nvmlDeviceGetIndex(handle: Handle) -> int:
    return _gpu(handle)[1].index


def nvmlDeviceGetArchitecture(device: Handle) -> int:
    gpu = _gpu(device)[1]
    _need(gpu, "architecture")
    return gpu.arch_code


def nvmlDeviceGetCudaComputeCapability(handle: Handle) -> tuple[int, int]:
    return COMPUTE_CAPABILITY[_gpu(handle)[1].arch]


def nvmlDeviceGetC2cModeInfoV(handle: Handle) -> Any:
    """C2C enabled on a Grace superchip (``SimConfig.grace``); NOT_SUPPORTED on other GPUs."""
    gpu = _gpu(handle)[1]
    if gpu.grace is None:
        raise NVMLError(_b.NOT_SUPPORTED)
    return _src.c_nvmlC2cModeInfo_v1_t(isC2cEnabled=1)


nvmlDeviceGetC2cModeInfoV1 = nvmlDeviceGetC2cModeInfoV


def nvmlDeviceGetPerformanceState(handle: Handle) -> int:
    _gpu(handle)
    return 0


# -- power and energy -------------------------------------------------------------------------


def nvmlDeviceGetPowerUsage(handle: Handle) -> int:
    """Power (mW): averaged over the driver's 1 s window, as on Ampere and later except GA100,
    or the instant sensor on a GA100-like GPU (``power_reading="instant"``)."""
    _, gpu, now = _gpu(handle)
    _need(gpu, "power_usage")
    if gpu.power_reading != "instant":
        _need(gpu, "average_power")
    return gpu.power_usage_mw(now)


def nvmlDeviceGetTotalEnergyConsumption(handle: Handle) -> int:
    """Energy (mJ) since the counter origin; NOT_SUPPORTED before Volta. Burns
    ``energy_call_latency_s`` of CPU (the GPU's counter: never the MODULE scope's)."""
    node, gpu, _ = _gpu(handle)
    node.burn(node.energy_latency_ns)
    now = node.now_ns()
    if not gpu.has_energy_counter:
        raise NVMLError(_b.NOT_SUPPORTED)
    return gpu.energy_counter_mj(now)


_set = ctypes.Structure.__setattr__


def _field(node: SimNode, gpu: SimGpu, now: int, fid: int, scope: int) -> tuple[int, int, int, int]:
    """``(nvmlReturn, valueType, value, timestamp ns)`` of one field."""
    if (
        fid in (_b.FI_POWER_INSTANT, _b.FI_POWER_AVERAGE)
        or _b.FI_POWER_MIN <= fid <= _b.FI_POWER_CURRENT
    ):
        if not gpu.power_fields:  # a driver before 535 knows none of these ids
            return _b.NOT_SUPPORTED, 0, 0, 0
        if scope == _b.SCOPE_MEMORY and fid == _b.FI_POWER_AVERAGE:
            if "memory_power" in gpu.unsupported:
                return _b.NOT_SUPPORTED, 0, 0, 0
            ts = gpu.grid_floor_ns(now, node.average_period_ns)
            return 0, _b.VT_UINT, gpu.memory_power_mw(now), ts
        if scope == _b.SCOPE_MODULE and fid in (_b.FI_POWER_INSTANT, _b.FI_POWER_AVERAGE):
            return _module_field(node, gpu, now, fid)
        if scope != _b.SCOPE_GPU:
            return _b.NOT_SUPPORTED, 0, 0, 0
    if fid == _b.FI_POWER_INSTANT:
        if "instant_power" in gpu.unsupported:
            return _b.NOT_SUPPORTED, 0, 0, 0
        if gpu.power_reading == "average_only":
            ts = gpu.grid_floor_ns(now, node.average_period_ns)
        else:
            ts = gpu.grid_floor_ns(now, node.instant_period_ns)
        return 0, _b.VT_UINT, gpu.instant_field_mw(now), ts
    if fid == _b.FI_POWER_AVERAGE:
        # Documented for Ampere and newer except GA100: none on a GA100-like GPU.
        if "average_power" in gpu.unsupported or gpu.power_reading == "instant":
            return _b.NOT_SUPPORTED, 0, 0, 0
        ts = gpu.grid_floor_ns(now, node.average_period_ns)
        return 0, _b.VT_UINT, gpu.average_power_mw(now), ts
    if fid in (_b.FI_TOTAL_ENERGY, _b.FI_ENERGY):
        if not gpu.has_energy_counter:
            return _b.NOT_SUPPORTED, 0, 0, 0
        ts = gpu.grid_floor_ns(now, node.counter_period_ns)
        return 0, _b.VT_ULL, gpu.energy_counter_mj(now), ts
    if _b.FI_POWER_MIN <= fid <= _b.FI_POWER_CURRENT and "power_limit" not in gpu.unsupported:
        cfg = node.config
        watts = {
            _b.FI_POWER_MIN: cfg.power_limit_min_w,
            _b.FI_POWER_MAX: cfg.power_limit_max_w,
            _b.FI_POWER_DEFAULT: cfg.power_limit_default_w,
            _b.FI_POWER_CURRENT: gpu.power_limit_w,
        }[fid]
        return 0, _b.VT_UINT, round(watts * 1000), now
    return _b.NOT_SUPPORTED, 0, 0, 0


def _module_field(node: SimNode, gpu: SimGpu, now: int, fid: int) -> tuple[int, int, int, int]:
    """A power field in the MODULE scope (GPU + Grace CPU + memory): answered on a Grace
    superchip only, on the GPU scope's grids."""
    if gpu.grace is None:
        return _b.NOT_SUPPORTED, 0, 0, 0
    if fid == _b.FI_POWER_INSTANT:
        if "instant_power" in gpu.unsupported:
            return _b.NOT_SUPPORTED, 0, 0, 0
        average_only = gpu.power_reading == "average_only"
        period = node.average_period_ns if average_only else node.instant_period_ns
        return 0, _b.VT_UINT, gpu.instant_module_mw(now), gpu.grid_floor_ns(now, period)
    if "average_power" in gpu.unsupported or gpu.power_reading == "instant":
        return _b.NOT_SUPPORTED, 0, 0, 0
    ts = gpu.grid_floor_ns(now, node.average_period_ns)
    return 0, _b.VT_UINT, gpu.average_module_mw(now), ts


def _field_id(field: Any) -> int:
    try:
        return int(field[0])
    except TypeError:
        return int(field)


def nvmlDeviceGetFieldValues(handle: Handle, fieldIds: Sequence[Any]) -> Any:
    """Field values; ids are ints or ``(fieldId, scopeId)``. Unknown fields: NOT_SUPPORTED.
    A call that asks for the energy counter burns ``energy_call_latency_s`` of CPU once."""
    node, gpu, _ = _gpu(handle)
    _need(gpu, "field_values")
    if node.energy_latency_ns and any(
        _field_id(f) in (_b.FI_TOTAL_ENERGY, _b.FI_ENERGY) for f in fieldIds
    ):
        node.burn(node.energy_latency_ns)
    now = node.now_ns()
    values = (_src.c_nvmlFieldValue_t * len(fieldIds))()
    for i, field in enumerate(fieldIds):
        out = values[i]
        try:
            fid, scope = field
        except TypeError:
            fid, scope = field, 0
        ret, vtype, value, ts = _field(node, gpu, now, fid, scope)
        # ctypes' own setattr: skips nvidia-ml-py's str-encoding wrapper (we set ints only)
        _set(out, "fieldId", fid)
        _set(out, "scopeId", scope)
        _set(out, "nvmlReturn", ret)
        _set(out, "valueType", vtype)
        _set(out, "timestamp", ts // 1000)
        if ret == 0:
            _set(out.value, "ullVal" if vtype == _b.VT_ULL else "uiVal", value)
    return values


def nvmlDeviceGetPowerManagementLimit(handle: Handle) -> int:
    """The power limit (mW); burns ``power_limit_call_latency_s`` of CPU."""
    node, gpu, _ = _gpu(handle)
    node.burn(node.limit_read_latency_ns)
    _need(gpu, "power_limit")
    return round(gpu.power_limit_w * 1000)


def nvmlDeviceGetEnforcedPowerLimit(handle: Handle) -> int:
    """The power limit in force (mW)."""
    gpu = _gpu(handle)[1]
    _need(gpu, "power_limit")
    return round(gpu.power_limit_w * 1000)


def nvmlDeviceGetPowerManagementDefaultLimit(handle: Handle) -> int:
    node, gpu, _ = _gpu(handle)
    _need(gpu, "power_limit")
    return round(node.config.power_limit_default_w * 1000)


def nvmlDeviceGetPowerManagementLimitConstraints(handle: Handle) -> list[int]:
    node, gpu, _ = _gpu(handle)
    _need(gpu, "power_limit")
    cfg = node.config
    return [round(cfg.power_limit_min_w * 1000), round(cfg.power_limit_max_w * 1000)]


def nvmlDeviceSetPowerManagementLimit(handle: Handle, limit: int) -> None:
    """Set the power limit (mW). NO_PERMISSION / INVALID_ARGUMENT like the driver."""
    limit = operator.index(limit)
    node, gpu, now = _gpu(handle)
    _settable(gpu, "power_limit")
    cfg = node.config
    if not round(cfg.power_limit_min_w * 1000) <= limit <= round(cfg.power_limit_max_w * 1000):
        raise NVMLError(_b.INVALID_ARGUMENT)
    latency = cfg.set_power_limit_latency_s
    if latency > 0:  # the driver takes a while: the limit is in force when the call returns
        time.sleep(latency)
        now = node.now_ns()
    gpu.set_power_limit_w(limit / 1000.0, now)


# -- clocks -----------------------------------------------------------------------------------


def nvmlDeviceGetClockInfo(handle: Handle, type: int) -> int:
    node, gpu, now = _gpu(handle)
    _need(gpu, "clocks")
    type = operator.index(type)
    if type in (0, 1):
        return round(gpu.sm_clock_mhz(now))
    if type == 2:
        return node.config.memory_clock_mhz
    if type == 3:
        return _b.VIDEO_CLOCK_MHZ
    raise NVMLError(_b.INVALID_ARGUMENT)


def nvmlDeviceGetMaxClockInfo(handle: Handle, type: int) -> int:
    node, gpu, _ = _gpu(handle)
    _need(gpu, "clocks")
    type = operator.index(type)
    if type in (0, 1):
        return node.config.max_sm_clock_mhz
    if type == 2:
        return node.config.memory_clock_mhz
    if type == 3:
        return _b.VIDEO_CLOCK_MHZ
    raise NVMLError(_b.INVALID_ARGUMENT)


def nvmlDeviceGetClock(handle: Handle, type: int, id: int) -> int:
    if operator.index(id) == 0:
        return nvmlDeviceGetClockInfo(handle, type)
    if id in (1, 2, 3):
        return nvmlDeviceGetMaxClockInfo(handle, type)
    _gpu(handle)
    raise NVMLError(_b.INVALID_ARGUMENT)


def nvmlDeviceGetSupportedMemoryClocks(handle: Handle) -> list[int]:
    node, gpu, _ = _gpu(handle)
    _need(gpu, "clocks")
    return [node.config.memory_clock_mhz]


def nvmlDeviceGetSupportedGraphicsClocks(handle: Handle, memoryClockMHz: int) -> list[int]:
    memoryClockMHz = operator.index(memoryClockMHz)
    node, gpu, _ = _gpu(handle)
    _need(gpu, "clocks")
    if memoryClockMHz != node.config.memory_clock_mhz:
        raise NVMLError(_b.NOT_FOUND)
    return gpu.supported_sm_clocks_mhz()


def _clock_arg(value: int, maximum: int) -> int:
    value = operator.index(value)
    return maximum if value >= _b.CLOCK_LIMIT_ID_START else value


def nvmlDeviceSetGpuLockedClocks(handle: Handle, minGpuClockMHz: int, maxGpuClockMHz: int) -> None:
    node, gpu, now = _gpu(handle)
    _settable(gpu, "locked_clocks")
    top = node.config.max_sm_clock_mhz
    lo, hi = _clock_arg(minGpuClockMHz, top), _clock_arg(maxGpuClockMHz, top)
    if lo > hi:
        raise NVMLError(_b.INVALID_ARGUMENT)
    latency = node.config.set_clock_latency_s
    if latency > 0:  # the driver takes a while: the clock is in force when the call returns
        time.sleep(latency)
        now = node.now_ns()
    # The SM clock reaches the locked value clock_settle_s after the call returned.
    gpu.lock_sm_clocks_mhz(lo, hi, now + node.clock_settle_ns)


def nvmlDeviceResetGpuLockedClocks(handle: Handle) -> None:
    _, gpu, now = _gpu(handle)
    _settable(gpu, "locked_clocks")
    gpu.reset_sm_clocks(now)


def nvmlDeviceSetMemoryLockedClocks(
    handle: Handle, minMemClockMHz: int, maxMemClockMHz: int
) -> None:
    node, gpu, _ = _gpu(handle)
    _settable(gpu, "locked_clocks")
    top = node.config.memory_clock_mhz
    lo, hi = _clock_arg(minMemClockMHz, top), _clock_arg(maxMemClockMHz, top)
    if lo > hi:
        raise NVMLError(_b.INVALID_ARGUMENT)
    gpu.memory_locked_clocks = (lo, hi)


def nvmlDeviceResetMemoryLockedClocks(handle: Handle) -> None:
    gpu = _gpu(handle)[1]
    _settable(gpu, "locked_clocks")
    gpu.memory_locked_clocks = None


# -- state, thermals, memory, processes ---------------------------------------------------------


def nvmlDeviceGetPersistenceMode(handle: Handle) -> int:
    gpu = _gpu(handle)[1]
    _need(gpu, "persistence")
    return int(gpu.persistence_mode)


def nvmlDeviceSetPersistenceMode(handle: Handle, mode: int) -> None:
    mode = operator.index(mode)
    _, gpu, now = _gpu(handle)
    _settable(gpu, "persistence")
    if mode not in (0, 1):
        raise NVMLError(_b.INVALID_ARGUMENT)
    gpu.set_persistence_mode(bool(mode), now)


def nvmlDeviceGetTemperature(handle: Handle, sensor: int) -> int:
    _, gpu, now = _gpu(handle)
    _need(gpu, "temperature")
    if operator.index(sensor) != 0:
        raise NVMLError(_b.INVALID_ARGUMENT)
    return round(gpu.temperature_c(now))


def nvmlDeviceGetTemperatureV(handle: Handle, sensor: int, version: int = _b.TEMPERATURE_V1) -> int:
    if version != _b.TEMPERATURE_V1:
        raise NVMLError(_b.ARG_VERSION_MISMATCH)
    return nvmlDeviceGetTemperature(handle, sensor)


def nvmlDeviceGetUtilizationRates(handle: Handle) -> Any:
    _, gpu, now = _gpu(handle)
    _need(gpu, "utilization")
    pct_gpu, pct_mem = gpu.utilization_pct(now)
    return _src.c_nvmlUtilization_t(gpu=pct_gpu, memory=pct_mem)


def nvmlDeviceGetMemoryInfo(handle: Handle, version: int | None = None) -> Any:
    node, gpu, _ = _gpu(handle)
    _need(gpu, "memory")
    total, used = node.config.memory_total_bytes, gpu.memory_used_bytes
    if not version:
        return _src.c_nvmlMemory_t(total=total, free=total - used, used=used)
    if version != _b.MEMORY_V2:
        raise NVMLError(_b.ARG_VERSION_MISMATCH)
    reserved = node.config.memory_base_bytes
    return _src.c_nvmlMemory_v2_t(
        version=version, total=total, reserved=reserved, free=total - used, used=used - reserved
    )


def nvmlDeviceGetComputeRunningProcesses(handle: Handle) -> list[Any]:
    gpu = _gpu(handle)[1]
    _need(gpu, "processes")
    return [
        _src.nvmlFriendlyObject(
            {
                "pid": p.pid,
                "usedGpuMemory": p.memory_bytes,
                "gpuInstanceId": _b.UNSET_INSTANCE_ID,
                "computeInstanceId": _b.UNSET_INSTANCE_ID,
            }
        )
        for p in gpu.processes
    ]


nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses
nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses


def _process_samples(handle: Handle, last_seen_us: int) -> tuple[SimGpu, int, int, int]:
    node, gpu, now = _gpu(handle)
    _need(gpu, "processes")
    ts_us = gpu.grid_floor_ns(now, node.instant_period_ns) // 1000
    if operator.index(last_seen_us) >= ts_us or not gpu.processes:
        raise NVMLError(_b.NOT_FOUND)  # no sample newer than the caller's timestamp
    pct_gpu, pct_mem = gpu.utilization_pct(now)
    return gpu, ts_us, pct_gpu, pct_mem


def nvmlDeviceGetProcessUtilization(handle: Handle, timeStamp: int) -> list[Any]:
    """Per-process SM/memory utilization samples newer than ``timeStamp`` (µs)."""
    gpu, ts, pct_gpu, pct_mem = _process_samples(handle, timeStamp)
    return [
        _src.c_nvmlProcessUtilizationSample_t(
            pid=p.pid,
            timeStamp=ts,
            smUtil=round(pct_gpu * p.sm_share),
            memUtil=round(pct_mem * p.sm_share),
            encUtil=0,
            decUtil=0,
        )
        for p in gpu.processes
    ]


def nvmlDeviceGetProcessesUtilizationInfo(handle: Handle, timeStamp: int) -> list[Any]:
    """Like :func:`nvmlDeviceGetProcessUtilization`, as ``c_nvmlProcessUtilizationInfo_v1_t``."""
    gpu, ts, pct_gpu, pct_mem = _process_samples(handle, timeStamp)
    return [
        _src.c_nvmlProcessUtilizationInfo_v1_t(
            timeStamp=ts,
            pid=p.pid,
            smUtil=round(pct_gpu * p.sm_share),
            memUtil=round(pct_mem * p.sm_share),
            encUtil=0,
            decUtil=0,
            jpgUtil=0,
            ofaUtil=0,
        )
        for p in gpu.processes
    ]


def __getattr__(name: str) -> Any:
    """nvidia-ml-py functions the simulator lacks exist, and fail like a driver without them."""
    if name.startswith("nvml") and callable(getattr(_src, name, None)):

        def missing(*args: Any, **kwargs: Any) -> Any:
            _enter()
            raise NVMLError(_b.FUNCTION_NOT_FOUND)

        missing.__name__ = missing.__qualname__ = name
        return missing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(
    {n for n in globals() if n.startswith(("nvml", "NVML", "c_nvml"))}
    | {
        "SHIM_DIR",
        "current_node",
        "install",
        "install_as_pynvml",
        "patched_pynvml",
        "restore_pynvml",
        "shim_env",
        "uninstall",
    }
)
