"""An ``amdsmi``-compatible module served by the GPU simulator (:mod:`zeus_async.devices.sim`).

The functions here have the names, signatures, return dicts and units of AMD's ``amdsmi``
Python package (7.0.2, ``amdsmi_interface.py``) for what zeus_async and Zeus use: power in W
(``amdsmi_get_power_info``, "N/A" where a field is unsupported), power caps in µW
(``amdsmi_get_power_cap_info``, ``amdsmi_set_power_cap``), energy as
``energy_accumulator`` x ``counter_resolution`` µJ (``amdsmi_get_energy_count``), HIP ids
(``amdsmi_get_gpu_enumeration_info``). Errors are ``AmdSmiLibraryException(code)`` with
amdsmi's status codes (``AMDSMI_STATUS_NOT_INIT`` before :func:`amdsmi_init`), and
``AmdSmiParameterException`` for a handle that is not one.

The simulated node's GPUs whose vendor is ``amd`` (:attr:`SimConfig.vendor
<zeus_async.devices.sim_config.SimConfig.vendor>`, or a GPU's override) are served, in
amd-smi index order. What real parts and library versions get wrong is reproduced from
:class:`~zeus_async.devices.sim_config.AmdSim`: stuck, scaled or backwards energy counters,
``power_limit`` units, MI250-style dual dies, HIP ids that differ from amd-smi indices, and a
library that is not thread-safe (calls that overlap are counted: :func:`overlapping_calls`).

As with ``sim_pynvml``, a power cap set here belongs to the node (every process simulating the
same configuration sees it, and it stays after the process exits).

Ways to use it: pass the module (``open_amd_gpus(amdsmi_module=sim_amdsmi)``), or
:func:`shim_env` for a subprocess whose ``import amdsmi`` must get the simulator (Zeus 0.16's AMD
path in a benchmark).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from enum import IntEnum
from pathlib import Path
from typing import Any

import msgspec

from ..clock import Clock, FakeClock
from ..devices.sim import SIM_ENV_VAR, SimConfig, SimGpu, SimNode
from ..devices.sim_config import GpuOverride, load_sim_config, sim_preset

logger = logging.getLogger(__name__)

#: Marks this module (and the shim) as the simulator, not AMD's bindings.
__zeus_async_sim__ = True

#: A directory holding a one-line ``amdsmi.py`` that re-exports this module.
SHIM_DIR = Path(__file__).resolve().parent / "_amdsmi_shim"

# -- amdsmi's status codes (amdsmi_wrapper) ------------------------------------------------------

AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_TIMEOUT = 8
AMDSMI_STATUS_RETRY = 9
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_BUSY = 30
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
AMDSMI_STATUS_NO_DATA = 40
AMDSMI_STATUS_UNKNOWN_ERROR = 4294967295

_ERROR_TEXT = {
    AMDSMI_STATUS_INVAL: "AMDSMI_STATUS_INVAL - Invalid parameters",
    AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
    AMDSMI_STATUS_TIMEOUT: "AMDSMI_STATUS_TIMEOUT - Timeout in API call",
    AMDSMI_STATUS_RETRY: "AMDSMI_STATUS_RETRY - Retry operation",
    AMDSMI_STATUS_NO_PERM: "AMDSMI_STATUS_NO_PERM - Permission Denied",
    AMDSMI_STATUS_INIT_ERROR: "AMDSMI_STATUS_INIT_ERROR - Initialization error",
    AMDSMI_STATUS_BUSY: "AMDSMI_STATUS_BUSY - Device busy",
    AMDSMI_STATUS_NOT_FOUND: "AMDSMI_STATUS_NOT_FOUND - Device Not found",
    AMDSMI_STATUS_NOT_INIT: "AMDSMI_STATUS_NOT_INIT - Device not initialized",
    AMDSMI_STATUS_DRIVER_NOT_LOADED: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded",
    AMDSMI_STATUS_NO_DATA: "AMDSMI_STATUS_NO_DATA - No data was found for given input",
}

_NA_U16 = 0xFFFF  # what amdsmi turns into "N/A" in power and activity dicts


class AmdSmiException(Exception):
    """Base smi exception class (as ``amdsmi.AmdSmiException``)."""


class AmdSmiLibraryException(AmdSmiException):
    """A failed library call, with amdsmi's status code (as ``amdsmi.AmdSmiLibraryException``)."""

    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _ERROR_TEXT.get(
            err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred"
        )

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_info(self, detailed: bool = True) -> str:
        return self.err_info if detailed else self.err_info.split(" - ")[0]

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    """An argument of the wrong type (as ``amdsmi.AmdSmiParameterException``)."""

    def __init__(self, receivedValue: object, expectedType: object, msg: str | None = None) -> None:
        super().__init__(msg)
        self.err_code = None
        self.actualType = type(receivedValue)
        self.expectedType = expectedType
        self.err_msg = msg or (
            f"Invalid parameter:\nActual type: {self.actualType}\nExpected type: {expectedType}"
        )

    def __str__(self) -> str:
        return self.err_msg


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 4294967295
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2
    INIT_AMD_APUS = 3
    INIT_NON_AMD_CPUS = 4
    INIT_NON_AMD_GPUS = 8


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4
    PCIE = 5


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    MAX = 1
    MIN = 2


class processor_handle:  # amdsmi's name
    """A processor handle (amdsmi's are ``c_void_p``): amd-smi index ``index`` of ``gpu``."""

    __slots__ = ("gpu", "index")

    def __init__(self, gpu: SimGpu, index: int) -> None:
        self.gpu = gpu
        self.index = index

    def __repr__(self) -> str:
        return f"<amdsmi processor_handle {self.index}>"


# -- served node ------------------------------------------------------------------------------

_lock = threading.RLock()
_node: SimNode | None = None
_handles: list[processor_handle] = []
_init_count = 0
# Overlap detection: calls in progress, and how many began while another was in progress.
_calls_lock = threading.Lock()
_in_call = 0
_overlaps = 0


def _is_amd(config: SimConfig, index: int) -> bool:
    ov = config.gpus[index] if index < len(config.gpus) else GpuOverride()
    return (ov.vendor or config.vendor) == "amd"


def install(
    node: SimNode | None = None, *, config: SimConfig | None = None, clock: Clock | None = None
) -> SimNode:
    """Serve ``node`` (or a new node from ``config``/``ZEUS_ASYNC_SIM``/the ``amd`` preset, on
    ``clock``). Callers still call :func:`amdsmi_init` as with the real module."""
    global _node, _handles
    if node is None:
        if config is None:
            value = os.environ.get(SIM_ENV_VAR)
            config = load_sim_config(value) if value else sim_preset("amd")
        node = SimNode(config, clock)
    cfg = node.config
    amd = [g for g in node.gpus if _is_amd(cfg, g.index)]
    with _lock:
        _node = node
        _handles = [processor_handle(g, i) for i, g in enumerate(amd)]
    return node


def uninstall() -> None:
    """Forget the node and the init count (the next :func:`amdsmi_init` builds a new node)."""
    global _node, _handles, _init_count, _overlaps
    with _lock:
        _node, _handles, _init_count, _overlaps = None, [], 0, 0


def current_node() -> SimNode | None:
    """The node being served, if any."""
    return _node


def overlapping_calls() -> int:
    """How many calls began while another thread was inside the library (a library that is
    not thread-safe would have failed or corrupted them)."""
    return _overlaps


def shim_env(config: SimConfig | None = None) -> dict[str, str]:
    """``PYTHONPATH`` and ``ZEUS_ASYNC_SIM`` for a subprocess whose ``import amdsmi`` must get
    this simulator: ``env={**os.environ, **shim_env(cfg)}``. Without ``config``: the installed
    node's (counter origin pinned), else the ``amd`` preset."""
    if config is None:
        node = _node
        if node is not None:
            config = msgspec.structs.replace(node.config, counter_origin_ns=node.counter_origin_ns)
        else:
            config = sim_preset("amd")
    path = os.environ.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": str(SHIM_DIR) + (os.pathsep + path if path else ""),
        SIM_ENV_VAR: config.to_json(),
    }


def zeus_async_sleep(seconds: float) -> None:
    """Let ``seconds`` pass on the simulated node's clock (not in amdsmi: the backend's start
    check waits through it, so that on a ``FakeClock`` it costs no real time)."""
    node = _node
    if node is not None and isinstance(node.clock, FakeClock):
        node.clock.advance_sync(seconds)
    else:
        time.sleep(seconds)


def zeus_async_monotonic() -> float:
    """Seconds on the simulated node's clock (not in amdsmi: the backend's start check times
    its power readings with it, so that on a ``FakeClock`` they are where its waits put them)."""
    node = _node
    if node is not None:
        return node.clock.monotonic_ns() / 1e9
    return time.monotonic()


class _Call:
    """Enter one library call: counts overlapping calls, burns the call latency."""

    __slots__ = ()

    def __enter__(self) -> SimNode:
        global _in_call, _overlaps
        node = _node
        if _init_count == 0 or node is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        with _calls_lock:
            _in_call += 1
            if _in_call > 1:
                _overlaps += 1
        node.spin()
        return node

    def __exit__(self, *exc: object) -> None:
        global _in_call
        with _calls_lock:
            _in_call -= 1


_call = _Call()


def _check(handle: object) -> processor_handle:
    if not isinstance(handle, processor_handle):
        raise AmdSmiParameterException(handle, processor_handle)
    node = _node
    if node is None or handle.index >= len(_handles) or _handles[handle.index] is not handle:
        raise AmdSmiLibraryException(AMDSMI_STATUS_INVAL)
    if handle.gpu.is_lost(node.now_ns()):
        raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_FOUND)
    return handle


def _faulty(node: SimNode, index: int) -> bool:
    amd = node.config.amd
    return amd.counter_fault != "none" and (not amd.faulty_gpus or index in amd.faulty_gpus)


def _secondary_die(node: SimNode, index: int) -> bool:
    return node.config.amd.dual_die and index % 2 == 1


def _package(index: int) -> list[processor_handle]:
    """The dies whose power a GPU reports: itself, or both dies of an MI250-style package."""
    node = _node
    assert node is not None
    if node.config.amd.dual_die and index + 1 < len(_handles):
        return [_handles[index], _handles[index + 1]]
    return [_handles[index]]


# -- init / system ----------------------------------------------------------------------------


def amdsmi_init(flag: AmdSmiInitFlags = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
    """Initialize (reference-counted); builds the node from the environment if none."""
    global _init_count
    if not isinstance(flag, IntEnum):
        raise AmdSmiParameterException(flag, AmdSmiInitFlags)
    with _lock:
        if _node is None:
            install()
        _init_count += 1


def amdsmi_shut_down() -> None:
    """Drop one reference from :func:`amdsmi_init`."""
    global _init_count
    with _lock:
        if _init_count == 0:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        _init_count -= 1


def amdsmi_get_lib_version() -> dict[str, Any]:
    with _call as node:
        major, minor, release = (int(p) for p in node.config.amd.lib_version.split(".")[:3])
        return {"major": major, "minor": minor, "release": release, "build": "sim"}


def amdsmi_get_processor_handles() -> list[processor_handle]:
    with _call:
        return list(_handles)


# -- identity ---------------------------------------------------------------------------------


def amdsmi_get_gpu_asic_info(processor_handle: processor_handle) -> dict[str, Any]:
    with _call:
        h = _check(processor_handle)
        return {
            # A simulated GPU says so in its name, wherever the name goes (as sim_pynvml's).
            "market_name": f"{h.gpu.name} (simulated)",
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002",
            "device_id": "0x74a1",
            "rev_id": "0x00",
            "asic_serial": f"0x{int(h.gpu.uuid[-12:], 16):016X}",
            "oam_id": h.index,
            "num_compute_units": 304,
            "target_graphics_version": "gfx942",
            "subsystem_id": "0x74a1",
        }


def amdsmi_get_gpu_device_uuid(processor_handle: processor_handle) -> str:
    """The GPU's UUID: the simulated GPU's, without NVIDIA's ``GPU-`` prefix."""
    with _call:
        return _check(processor_handle).gpu.uuid.removeprefix("GPU-")


def amdsmi_get_gpu_device_bdf(processor_handle: processor_handle) -> str:
    with _call:
        return f"0000:{0x11 + 0x10 * _check(processor_handle).index:02x}:00.0"


def amdsmi_get_gpu_enumeration_info(processor_handle: processor_handle) -> dict[str, Any]:
    with _call as node:
        h = _check(processor_handle)
        hip_ids = node.config.amd.hip_ids
        hip = hip_ids[h.index] if h.index < len(hip_ids) else h.index
        return {
            "drm_render": 128 + h.index,
            "drm_card": h.index,
            "hsa_id": 2 + h.index,
            "hip_id": hip,
            "hip_uuid": "GPU-" + h.gpu.uuid[-16:],
        }


# -- power and energy -------------------------------------------------------------------------


def amdsmi_get_power_info(processor_handle: processor_handle) -> dict[str, Any]:
    """Power in W (ints): ``current_socket_power`` (MI300 and later) or
    ``average_socket_power`` (older), the other "N/A"; ``power_limit`` in the units of
    :attr:`AmdSim.power_limit_units`."""
    with _call as node:
        h = _check(processor_handle)
        amd = node.config.amd
        now = node.now_ns()
        if _secondary_die(node, h.index):
            current = average = 0
        else:
            dies = _package(h.index)
            if amd.power_fields == "current":
                current = round(sum(d.gpu.instant_power_mw(now) for d in dies) / 1000)
                average = _NA_U16
            else:
                current = _NA_U16
                average = round(sum(d.gpu.average_power_mw(now) for d in dies) / 1000)
        limit_w = h.gpu.power_limit_w
        limit = round(limit_w) if amd.power_limit_units == "W" else round(limit_w * 1e6)
        info: dict[str, Any] = {
            "socket_power": current if amd.power_fields == "current" else average,
            "current_socket_power": current,
            "average_socket_power": average,
            "gfx_voltage": _NA_U16,
            "soc_voltage": _NA_U16,
            "mem_voltage": _NA_U16,
            "power_limit": limit,
        }
        return {k: ("N/A" if v == _NA_U16 else v) for k, v in info.items()}


def amdsmi_get_energy_count(processor_handle: processor_handle) -> dict[str, Any]:
    """``energy_accumulator`` ticks of ``counter_resolution`` µJ since the counter origin, and
    the time (ns) of the counter's last update."""
    with _call as node:
        h = _check(processor_handle)
        amd = node.config.amd
        now = node.now_ns()
        resolution = amd.counter_resolution_uj
        stamp = h.gpu.grid_floor_ns(now, node.counter_period_ns) - node.counter_origin_ns
        if _secondary_die(node, h.index):
            uj = 0.0
        else:
            uj = sum(d.gpu.energy_counter_mj(now) for d in _package(h.index)) * 1000.0
        if _faulty(node, h.index):
            fault = amd.counter_fault
            if fault == "stuck":
                uj = 1_234_567.0
            elif fault == "scaled":
                uj *= amd.counter_scale
            elif fault == "backwards":
                at = node.config.epoch_ns + round(amd.backwards_at_s * 1e9)
                if now >= at:
                    uj = max(0.0, uj - amd.backwards_j * 1e6)
        return {
            "energy_accumulator": int(uj / resolution),
            "counter_resolution": resolution,
            "timestamp": max(stamp, 0),
        }


def amdsmi_get_power_cap_info(processor_handle: processor_handle) -> dict[str, Any]:
    """Power caps in µW."""
    with _call as node:
        h = _check(processor_handle)
        cfg = node.config
        return {
            "power_cap": round(h.gpu.power_limit_w * 1e6),
            "default_power_cap": round(cfg.power_limit_default_w * 1e6),
            "dpm_cap": 0,
            "min_power_cap": round(cfg.power_limit_min_w * 1e6),
            "max_power_cap": round(cfg.power_limit_max_w * 1e6),
        }


def amdsmi_set_power_cap(processor_handle: processor_handle, sensor_ind: int, cap: int) -> None:
    """Set the power cap (µW); node-wide, like the driver's."""
    if not isinstance(sensor_ind, int):
        raise AmdSmiParameterException(sensor_ind, int)
    if not isinstance(cap, int):
        raise AmdSmiParameterException(cap, int)
    with _call as node:
        h = _check(processor_handle)
        cfg = node.config
        if h.gpu.no_permission:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NO_PERM)
        watts = cap / 1e6
        if not cfg.power_limit_min_w - 1e-6 <= watts <= cfg.power_limit_max_w + 1e-6:
            raise AmdSmiLibraryException(AMDSMI_STATUS_INVAL)
        h.gpu.set_power_limit_w(watts, node.now_ns())


# -- other readings ---------------------------------------------------------------------------


def amdsmi_get_temp_metric(
    processor_handle: processor_handle,
    sensor_type: AmdSmiTemperatureType,
    metric: AmdSmiTemperatureMetric,
) -> int:
    """Temperature in °C."""
    with _call as node:
        h = _check(processor_handle)
        return round(h.gpu.temperature_c(node.now_ns()))


def amdsmi_get_gpu_activity(processor_handle: processor_handle) -> dict[str, Any]:
    with _call as node:
        h = _check(processor_handle)
        gfx, umc = h.gpu.utilization_pct(node.now_ns())
        return {"gfx_activity": gfx, "umc_activity": umc, "mm_activity": "N/A"}


def amdsmi_get_gpu_vram_usage(processor_handle: processor_handle) -> dict[str, Any]:
    """VRAM total and used, in MB."""
    with _call as node:
        h = _check(processor_handle)
        mb = 1 << 20
        return {
            "vram_total": node.config.memory_total_bytes // mb,
            "vram_used": h.gpu.memory_used_bytes // mb,
        }


def amdsmi_get_clock_info(
    processor_handle: processor_handle, clock_type: AmdSmiClkType
) -> dict[str, Any]:
    """Clocks in MHz (GFX: the simulated SM clock; MEM: the memory clock)."""
    if not isinstance(clock_type, IntEnum):
        raise AmdSmiParameterException(clock_type, AmdSmiClkType)
    with _call as node:
        h = _check(processor_handle)
        cfg = node.config
        if clock_type == AmdSmiClkType.MEM:
            clk = lo = hi = cfg.memory_clock_mhz
        else:
            clk = round(h.gpu.sm_clock_mhz(node.now_ns()))
            lo, hi = cfg.min_sm_clock_mhz, cfg.max_sm_clock_mhz
        return {
            "clk": clk,
            "min_clk": lo,
            "max_clk": hi,
            "clk_locked": False,
            "clk_deep_sleep": "N/A",
        }


def amdsmi_get_gpu_process_list(processor_handle: processor_handle) -> list[dict[str, Any]]:
    with _call:
        h = _check(processor_handle)
        return [
            {
                "name": f"python{p.pid}",
                "pid": p.pid,
                "mem": p.memory_bytes,
                "engine_usage": {"gfx": 0, "enc": 0},
                "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": p.memory_bytes},
                "cu_occupancy": "N/A",
            }
            for p in h.gpu.processes
        ]
