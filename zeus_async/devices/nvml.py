"""NVML backend: GPUs through nvidia-ml-py (``pynvml``), the one hardware path.

Only documented nvidia-ml-py calls are used, on whatever module ``import pynvml`` resolves to at
open time (or the module passed as ``pynvml_module``), so the very same code runs on a real H100
and on :mod:`zeus_async.testing.sim_pynvml` in CI.

Reading (:meth:`NvmlGpu.read`, the hot path: 100 Hz x 8 GPUs):

* ``power_w`` / ``avg_power_w`` / ``energy_j`` are fetched in **one**
  ``nvmlDeviceGetFieldValues`` call (``NVML_FI_DEV_POWER_INSTANT``, ``NVML_FI_DEV_POWER_AVERAGE``,
  ``NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION``). A field id the driver rejects falls back to the
  per-call API: ``nvmlDeviceGetTotalEnergyConsumption`` for energy and
  ``nvmlDeviceGetPowerUsage``, which NVML documents as a 1 s average on Ampere and later except
  GA100 (used for ``avg_power_w``) and as instantaneous on GA100 (A100, A30, A800) and older
  architectures (used for ``power_w``). ``power_w`` is never a 1 s average: on a newer GPU
  whose driver lacks the instant field (before 535) it is ``None``.
  :attr:`NvmlGpu.power_source` says where ``power_w`` comes from (the estimators check what
  the readings describe anyway, :attr:`~zeus_async.aggregate.history.DeviceHistory.power_readings`).
* A field the device does not support is ``None`` and is remembered, so it is not queried again.
  A lost GPU raises :class:`~zeus_async.errors.DeviceLostError`; other per-field failures leave
  that field ``None`` for this tick, unless every field failed, which raises the mapped error.
* Read plans (which field ids, which getters) are precomputed per requested field set.

Power scope (``power_scope``, :data:`POWER_SCOPES`): NVML reports power per scope, the GPU
(``NVML_POWER_SCOPE_GPU``, every GPU) and, on Grace superchips (GH200, GB200), the whole module
(``NVML_POWER_SCOPE_MODULE``: GPU + Grace CPU + memory). ``gpu`` (the default) reads the GPU
scope, as above. ``module`` reads both power fields in the MODULE scope, and no per-call
fallback (those are GPU-scope); the energy counter is the GPU's, so it is not read and window
energy integrates the module power (``energy_method`` ``integrated-power``); a GPU that does not
answer the MODULE scope is a :class:`~zeus_async.errors.ConfigError` at open. ``auto`` reads the
GPU scope where the GPU answers it and the MODULE scope where only that one is answered (some
C2C superchips, as Zeus found), with a WARNING. :meth:`NvmlGpu.describe` says which
(``DeviceInfo.power_scope``).

``CUDA_VISIBLE_DEVICES`` is honoured here, not by NVML: logical index ``i`` (key ``gpu:<i>``) is
the i-th visible GPU. Error handling: :func:`map_nvml_error` turns every ``NVMLError`` into the
package's typed errors.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from types import ModuleType
from typing import Any, Final

from ..errors import (
    ConfigError,
    DeviceError,
    DeviceNotFoundError,
    DriverNotLoadedError,
    NotSupportedError,
    TransientDeviceError,
    ZeusAsyncError,
)
from ..events import Capabilities, DeviceInfo, Event, GpuSample
from .base import GPU_FIELDS, ErrorCodes, GpuProcesses, typed_error
from .nvml_visible import parse_cuda_visible_devices

__all__ = [
    "POWER_SCOPES",
    "NvmlGpu",
    "map_nvml_error",
    "nvml_available",
    "open_nvml_gpus",
    "parse_cuda_visible_devices",
    "visible_nvml_indices",
]

logger = logging.getLogger(__name__)

ARCH_NAMES: Final[dict[int, str]] = {
    2: "kepler",
    3: "maxwell",
    4: "pascal",
    5: "volta",
    6: "turing",
    7: "ampere",
    8: "ada",
    9: "hopper",
    10: "blackwell",
}
_VOLTA, _AMPERE = 5, 7
#: GA100 products, whose ``nvmlDeviceGetPowerUsage`` NVML documents as instantaneous although
#: they are Ampere (A100, A30, A800; not the RTX A1000/A3000/A800x).
_GA100 = re.compile(r"\bA(?:100|30|800)\b")

# NVML return codes (C ABI values) grouped by how a caller reacts to them.
_NOT_SUPPORTED_CODES: Final = frozenset({3, 13, 22, 25, 26, 30})
_PERMISSION_CODES: Final = frozenset({4, 17})  # NO_PERMISSION, OPERATING_SYSTEM
_LOST_CODES: Final = frozenset({8, 11, 15, 16})  # INSUFFICIENT_POWER, IRQ, GPU_IS_LOST, RESET
_DRIVER_CODES: Final = frozenset({1, 9, 12, 18})  # UNINITIALIZED, NOT_LOADED, NO_LIBRARY, RM
_ARGUMENT_CODES: Final = frozenset({2, 24})  # INVALID_ARGUMENT, FREQ_NOT_SUPPORTED
_NOT_FOUND_CODES: Final = frozenset({6, 28})  # NOT_FOUND, GPU_NOT_FOUND
_CODES: Final = ErrorCodes(
    _NOT_SUPPORTED_CODES,
    _PERMISSION_CODES,
    _LOST_CODES,
    _DRIVER_CODES,
    _ARGUMENT_CODES,
    _NOT_FOUND_CODES,
)
_NVML_NOT_FOUND: Final = 6  # also "no sample newer than the timestamp"
_FATAL_CODES: Final = _LOST_CODES | _DRIVER_CODES

PRIVILEGE_HINT: Final = (
    "changing GPU power limits, clocks or persistence mode needs root or CAP_SYS_ADMIN: run as "
    "root, grant the capability (e.g. `sudo setcap cap_sys_admin+ep <python>`), or let a "
    "privileged helper do it; `sudo nvidia-smi -pm 1` (persistence mode) keeps the settings "
    "between processes"
)

#: The power scopes a caller may ask for (see the module docstring).
POWER_SCOPES: Final = ("gpu", "module", "auto")
#: ``DeviceInfo.energy_note`` in the MODULE scope.
MODULE_ENERGY_NOTE: Final = "MODULE scope (GPU + CPU + memory): integrated power"

# nvmlValue_t member for each NVML_VALUE_TYPE_* (0..6).
_VALUE_ATTRS: Final = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def map_nvml_error(exc: BaseException, device_key: str = "", action: str = "") -> ZeusAsyncError:
    """The zeus_async error for an ``NVMLError`` (or any exception with an int ``value``).

    Args:
        exc: The exception raised by pynvml.
        device_key: Device it concerns (``"gpu:0"``), for the message and ``error.device``.
        action: What was being done (``"setting the power limit"``), for the message.

    Returns:
        ``NotSupportedError`` (NOT_SUPPORTED, FUNCTION_NOT_FOUND, ...), ``NoPermissionError``
        (with the privilege needed), ``DeviceLostError`` (GPU_IS_LOST, RESET_REQUIRED, ...),
        ``DriverNotLoadedError`` (DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, UNINITIALIZED, ...),
        ``ConfigError`` (INVALID_ARGUMENT, FREQ_NOT_SUPPORTED), ``DeviceNotFoundError``
        (NOT_FOUND, GPU_NOT_FOUND), else ``TransientDeviceError`` (TIMEOUT, UNKNOWN, ...).
    """
    code = _code(exc)
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not hide the original error
        text = type(exc).__name__
    return typed_error(
        "NVML",
        code,
        text,
        _CODES,
        device_key=device_key,
        action=action,
        privilege_hint=PRIVILEGE_HINT,
    )


def _import_pynvml() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise DriverNotLoadedError(
            f"nvidia-ml-py (module pynvml) is not importable: {exc}"
        ) from None


class _Session:
    """One ``nvmlInit`` shared by the GPUs opened together; ``nvmlShutdown`` after the last."""

    def __init__(self, nv: ModuleType) -> None:
        self.nv = nv
        self._refs = 0
        self._lock = threading.Lock()

    def open(self) -> None:
        try:
            self.nv.nvmlInit()
        except self.nv.NVMLError as exc:
            raise map_nvml_error(exc, action="initializing NVML") from None
        self._refs = 1

    def acquire(self) -> None:
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            if self._refs != 0:
                return
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError as exc:
            logger.debug("nvmlShutdown failed: %s", exc)


_Plan = tuple[list[Any], list[str], list[tuple[str, Callable[[], Any]]]]


class NvmlGpu:
    """One GPU through NVML; implements :class:`~zeus_async.devices.base.Device` and
    :class:`~zeus_async.devices.base.GpuControl`.

    Args:
        nv: The pynvml module in use.
        handle: Its device handle.
        index: Logical index (after ``CUDA_VISIBLE_DEVICES``).
        physical_index: NVML index.
        session: Shared NVML initialization, released by :meth:`close`.
        power_scope: ``gpu``, ``module`` or ``auto`` (see the module docstring).

    Raises:
        ConfigError: An unknown power scope, or ``module`` on a GPU that does not answer it.
    """

    def __init__(
        self,
        nv: ModuleType,
        handle: Any,
        index: int,
        physical_index: int,
        *,
        session: _Session | None = None,
        power_scope: str = "gpu",
    ) -> None:
        if power_scope not in POWER_SCOPES:
            raise ConfigError(
                f"unknown power scope {power_scope!r}; choose one of {', '.join(POWER_SCOPES)}"
            )
        self._requested_scope = power_scope
        self._nv = nv
        self._handle = handle
        self._index = index
        self.physical_index = physical_index
        self._key = f"gpu:{index}"
        self._error: type[BaseException] = nv.NVMLError
        self._session = session
        if session is not None:
            session.acquire()
        self._closed = False
        self._plans: dict[Collection[str], _Plan] = {}
        self._unsupported: set[str] = set()  # fields the device cannot read at all
        self._no_field_value: set[str] = set()  # fields whose field id the driver rejected
        self._use_temperature_v = hasattr(nv, "nvmlDeviceGetTemperatureV")
        self._info = self._describe()  # resolves the power scope too
        self._module = self._info.power_scope == "module"
        scope = (
            getattr(nv, "NVML_POWER_SCOPE_MODULE", 1)
            if self._module
            else getattr(nv, "NVML_POWER_SCOPE_GPU", 0)
        )
        ids = {
            "power_w": getattr(nv, "NVML_FI_DEV_POWER_INSTANT", None),
            "avg_power_w": getattr(nv, "NVML_FI_DEV_POWER_AVERAGE", None),
            "energy_j": getattr(nv, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", None),
        }
        self._field_ids: dict[str, Any] = {
            name: (fid if name == "energy_j" else (fid, scope))
            for name, fid in ids.items()
            if fid is not None
        }
        if not self._info.has_energy_counter:  # none, or the GPU's under the MODULE scope
            self._unsupported.add("energy_j")
        if self._arch is None or (self._arch >= _AMPERE and not _GA100.search(self._info.name)):
            self._power_usage_field = "avg_power_w"  # documented as a 1 s average here
        else:
            self._power_usage_field = "power_w"
        self._getters: dict[str, Callable[[], Any]] = {
            "energy_j": self._read_energy,
            "temperature_c": self._read_temperature,
            "sm_clock_hz": self._read_sm_clock,
            "utilization_frac": self._read_utilization,
            "memory_used_bytes": self._read_memory_used,
            "power_limit_w": self._read_power_limit,
        }
        if not self._module:  # nvmlDeviceGetPowerUsage is the GPU scope's
            self._getters[self._power_usage_field] = self._read_power_usage
        self.read(GPU_FIELDS, "", 0)  # probe: learn which fields this device supports
        self._fields = tuple(f for f in GPU_FIELDS if f not in self._unsupported)
        logger.info(
            "%s (%s): power_w from %s, %s power scope",
            self._key,
            self._info.name,
            self.power_source or "nowhere (no instant reading; avg_power_w only)",
            self._info.power_scope,
        )

    # -- static facts -----------------------------------------------------------------------

    def _call(self, action: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(self._handle, *args)
        except self._error as exc:
            raise map_nvml_error(exc, self._key, action) from None

    def _optional(self, action: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn`` or ``None`` when not supported; lost GPUs and driver errors still raise."""
        try:
            return self._call(action, fn, *args)
        except (NotSupportedError, TransientDeviceError, ConfigError, DeviceNotFoundError):
            return None

    def _describe(self) -> DeviceInfo:
        nv = self._nv
        name = str(self._call("reading the name", nv.nvmlDeviceGetName))
        uuid = str(self._call("reading the UUID", nv.nvmlDeviceGetUUID))
        power_scope = self._resolve_scope(name)
        arch = self._optional("reading the architecture", nv.nvmlDeviceGetArchitecture)
        self._arch: int | None = arch
        has_counter = False
        #: What one read of the energy counter costs here (s; the cheaper of two probes):
        #: 3.8 ms on an H100 with driver 580, where power reads cost µs. ``None``: no counter.
        self.energy_read_cost_s: float | None = None
        if arch is None or arch >= _VOLTA:
            costs: list[float] = []
            for _ in range(2):
                t0 = time.perf_counter()
                probed = self._optional(
                    "probing the energy counter", nv.nvmlDeviceGetTotalEnergyConsumption
                )
                costs.append(time.perf_counter() - t0)
                if probed is None:
                    break
            has_counter = probed is not None
            if has_counter:
                self.energy_read_cost_s = min(costs)
        limits = self._optional(
            "reading power limit constraints", nv.nvmlDeviceGetPowerManagementLimitConstraints
        )
        self._limit_range: tuple[float, float] | None = (
            None if limits is None else (limits[0] / 1000.0, limits[1] / 1000.0)
        )
        default = self._optional(
            "reading the default power limit", nv.nvmlDeviceGetPowerManagementDefaultLimit
        )
        clocks: list[float] = []
        mem_clocks = self._optional("reading memory clocks", nv.nvmlDeviceGetSupportedMemoryClocks)
        if mem_clocks:
            sm = self._optional(
                "reading SM clocks", nv.nvmlDeviceGetSupportedGraphicsClocks, max(mem_clocks)
            )
            clocks = sorted((c * 1e6 for c in sm or ()), reverse=True)
        self._sm_clocks_hz = clocks
        gpu_counter = has_counter
        note = "" if has_counter else "no energy counter before Volta: integrated power"
        if power_scope == "module":  # the counter is the GPU's: not the scope read
            has_counter, note = False, MODULE_ENERGY_NOTE
        return DeviceInfo(
            key=self._key,
            name=name,
            uuid=uuid,
            arch=ARCH_NAMES.get(arch, "unknown") if arch is not None else "unknown",
            has_energy_counter=has_counter,
            power_limit_min_w=None if limits is None else limits[0] / 1000.0,
            power_limit_max_w=None if limits is None else limits[1] / 1000.0,
            power_limit_default_w=None if default is None else default / 1000.0,
            supported_sm_clocks_hz=list(clocks),
            index=self.physical_index,
            vendor="nvidia",
            energy_method="counter" if has_counter else "integrated-power",
            energy_note=note,
            capabilities=Capabilities(
                energy_counter=gpu_counter,
                power_cap=limits is not None,
                clocks=bool(clocks),
                per_process=True,
            ),
            power_scope=power_scope,
            # power_w is the instant sensor (NVML_FI_DEV_POWER_INSTANT, or GetPowerUsage where
            # it is one): as measured on H100s, the mean of the first 25 ms of each 100 ms
            # period, shown once the period has ended, so up to two periods old.
            power_reading_lag_s=0.2,
            power_reading_window_s=0.025,
            # The MODULE scope has no counter but answers NVML_FI_DEV_POWER_AVERAGE (probed in
            # _scope_refusal): the mean over the last 1 s, refreshed every 100 ms on the
            # driver's grid, from which windows take their energy (issue 37).
            power_average_window_s=1.0 if power_scope == "module" else 0.0,
            power_average_period_s=0.1 if power_scope == "module" else 0.0,
        )

    def _scope_refusal(self, scope: str) -> str | None:
        """Why this GPU does not answer the power fields in NVML's ``scope`` power scope
        (``GPU``, ``MODULE``); ``None`` when it answers one of them. A lost GPU raises."""
        nv = self._nv
        instant = getattr(nv, "NVML_FI_DEV_POWER_INSTANT", None)
        average = getattr(nv, "NVML_FI_DEV_POWER_AVERAGE", None)
        scope_id = getattr(nv, f"NVML_POWER_SCOPE_{scope}", None)
        if instant is None or average is None or scope_id is None:
            return "this nvidia-ml-py has no power scopes"
        try:
            values = nv.nvmlDeviceGetFieldValues(
                self._handle, [(instant, scope_id), (average, scope_id)]
            )
        except self._error as exc:
            if _code(exc) in _FATAL_CODES:
                raise map_nvml_error(exc, self._key, f"probing the {scope} power scope") from None
            return str(exc)
        codes = [int(v.nvmlReturn) for v in values]
        if 0 in codes:
            return None
        try:
            return str(self._error(codes[0]))
        except Exception:  # an unknown code
            return f"NVML error {codes[0]}"

    def _resolve_scope(self, name: str) -> str:
        """The power scope to read (``gpu`` or ``module``) for the one asked for."""
        asked = self._requested_scope
        if asked == "gpu":
            return "gpu"
        where = f"{self._key} ({name}, NVML index {self.physical_index})"
        module_refused = self._scope_refusal("MODULE")
        if asked == "module":
            if module_refused is not None:
                raise ConfigError(
                    f"{where} does not answer NVML's MODULE power scope "
                    f"(NVML_POWER_SCOPE_MODULE: {module_refused}); only Grace superchips "
                    "(GH200, GB200) report module power (GPU + CPU + memory): use "
                    "power_scope='gpu'"
                )
            return "module"
        gpu_refused = self._scope_refusal("GPU")
        if gpu_refused is not None and module_refused is None:
            logger.warning(
                "%s does not answer the GPU power scope (%s) but the MODULE one: reading "
                "module power (GPU + CPU + memory)",
                where,
                gpu_refused,
            )
            return "module"
        return "gpu"

    @property
    def key(self) -> str:
        return self._key

    @property
    def index(self) -> int:
        return self._index

    @property
    def fields(self) -> tuple[str, ...]:
        return self._fields

    def describe(self) -> DeviceInfo:
        return self._info

    @property
    def power_source(self) -> str | None:
        """Where ``power_w`` comes from: ``"NVML_FI_DEV_POWER_INSTANT"`` (the instant field,
        drivers from 535 on), ``"nvmlDeviceGetPowerUsage"`` (where NVML documents it as
        instantaneous: GA100 and older architectures, on drivers without the field), or
        ``None`` (no instant reading: a newer GPU on an older driver, whose only power reading
        is the 1 s average in ``avg_power_w``)."""
        if "power_w" in self._unsupported:
            return None
        if "power_w" in self._field_ids and "power_w" not in self._no_field_value:
            return "NVML_FI_DEV_POWER_INSTANT" + (" (MODULE scope)" if self._module else "")
        if self._module:
            return None
        if self._power_usage_field == "power_w":
            return "nvmlDeviceGetPowerUsage"
        return None

    # -- sampling ---------------------------------------------------------------------------

    def _plan(self, fields: Collection[str]) -> _Plan:
        fv_ids: list[Any] = []
        fv_names: list[str] = []
        getters: list[tuple[str, Callable[[], Any]]] = []
        for name in GPU_FIELDS:
            if name not in fields or name in self._unsupported:
                continue
            if name in self._field_ids and name not in self._no_field_value:
                fv_ids.append(self._field_ids[name])
                fv_names.append(name)
            elif name in self._getters:
                getters.append((name, self._getters[name]))
            else:
                self._unsupported.add(name)
        return fv_ids, fv_names, getters

    def _forget_plans(self) -> None:
        self._plans = {}
        self._fields = tuple(f for f in GPU_FIELDS if f not in self._unsupported)

    def read(self, fields: Collection[str], host: str, t_ns: int) -> Sequence[Event]:
        """Read ``fields`` now; one :class:`GpuSample` (unsupported fields ``None``)."""
        key = fields if isinstance(fields, (tuple, frozenset)) else tuple(fields)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(key)
        fv_ids, fv_names, getters = plan
        out: dict[str, Any] = {}
        failure: ZeusAsyncError | None = None
        replan = False
        if fv_ids:
            try:
                values = self._nv.nvmlDeviceGetFieldValues(self._handle, fv_ids)
            except self._error as exc:
                if _code(exc) not in _NOT_SUPPORTED_CODES:
                    failure = self._failed(exc, "reading field values")
                else:  # no field values on this driver: per-call APIs from now on
                    self._no_field_value.update(fv_names)
                    self._forget_plans()
                    return self.read(key, host, t_ns)
            else:
                for name, value in zip(fv_names, values, strict=False):
                    ret = value.nvmlReturn
                    if ret == 0:
                        raw = getattr(value.value, _VALUE_ATTRS[value.valueType])
                        out[name] = raw / 1000.0  # mW -> W, mJ -> J
                    elif ret in _NOT_SUPPORTED_CODES:
                        self._no_field_value.add(name)
                        replan = True
                        getter = self._getters.get(name)
                        if getter is not None:
                            failure = self._get(name, getter, out) or failure
                        else:
                            self._unsupported.add(name)
                    else:
                        failure = self._failed(self._error(ret), f"reading {name}") or failure
        for name, getter in getters:
            failure = self._get(name, getter, out) or failure
        if replan:
            self._forget_plans()
        if failure is not None and not out:
            raise failure
        return [GpuSample(host, t_ns, self._index, **out)]

    def _failed(self, exc: BaseException, action: str) -> ZeusAsyncError:
        """Map a read error; lost GPUs and a vanished driver raise at once."""
        err = map_nvml_error(exc, self._key, action)
        if _code(exc) in _FATAL_CODES:
            raise err
        logger.debug("%s", err)
        return err

    def _get(
        self, name: str, getter: Callable[[], Any], out: dict[str, Any]
    ) -> ZeusAsyncError | None:
        try:
            out[name] = getter()
        except self._error as exc:
            if _code(exc) in _NOT_SUPPORTED_CODES:
                self._unsupported.add(name)
                self._forget_plans()
                return None
            return self._failed(exc, f"reading {name}")
        return None

    def _read_energy(self) -> float:
        mj: int = self._nv.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        return mj / 1000.0

    def _read_power_usage(self) -> float:
        mw: int = self._nv.nvmlDeviceGetPowerUsage(self._handle)
        return mw / 1000.0

    def _read_temperature(self) -> float:
        nv = self._nv
        if self._use_temperature_v:
            try:
                return float(nv.nvmlDeviceGetTemperatureV(self._handle, nv.NVML_TEMPERATURE_GPU))
            except self._error as exc:
                if _code(exc) not in _NOT_SUPPORTED_CODES:
                    raise
                self._use_temperature_v = False  # older driver: the deprecated call
        return float(nv.nvmlDeviceGetTemperature(self._handle, nv.NVML_TEMPERATURE_GPU))

    def _read_sm_clock(self) -> float:
        return float(self._nv.nvmlDeviceGetClockInfo(self._handle, self._nv.NVML_CLOCK_SM)) * 1e6

    def _read_utilization(self) -> float:
        return float(self._nv.nvmlDeviceGetUtilizationRates(self._handle).gpu) / 100.0

    def _read_memory_used(self) -> int:
        return int(self._nv.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _read_power_limit(self) -> float:
        return float(self._nv.nvmlDeviceGetEnforcedPowerLimit(self._handle)) / 1000.0

    # -- processes --------------------------------------------------------------------------

    def read_processes(self, since_us: int) -> GpuProcesses:
        """Processes on this GPU (see :meth:`GpuProcessReader.read_processes`).

        Memory comes from the running compute and graphics processes; SM utilization from
        ``nvmlDeviceGetProcessUtilization`` (several samples of one pid are averaged). NVML
        answers NOT_FOUND when no process ran since ``since_us``: that is an empty result.
        """
        nv = self._nv
        memory: dict[int, int | None] = {}
        listed = False
        for name in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ):
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                procs = fn(self._handle)
            except self._error as exc:
                if _code(exc) in _NOT_SUPPORTED_CODES:
                    continue
                raise map_nvml_error(exc, self._key, "listing processes") from None
            listed = True
            for proc in procs:
                used = getattr(proc, "usedGpuMemory", None)
                pid = int(proc.pid)
                held = None if used is None else int(used)
                previous = memory.get(pid)
                memory[pid] = held if previous is None else previous + (held or 0)
        if not listed:
            raise NotSupportedError(
                f"{self._key}: the driver does not list the processes using the GPU",
                device=self._key,
            )
        sums: dict[int, list[float]] = {}
        last_seen = since_us
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(self._handle, since_us)
        except self._error as exc:
            code = _code(exc)
            if code != _NVML_NOT_FOUND and code not in _NOT_SUPPORTED_CODES:
                raise map_nvml_error(exc, self._key, "reading process utilization") from None
            samples = ()
        for sample in samples:
            acc = sums.setdefault(int(sample.pid), [0.0, 0.0])
            acc[0] += float(sample.smUtil)
            acc[1] += 1.0
            last_seen = max(last_seen, int(sample.timeStamp))
        sm = {pid: total / count / 100.0 for pid, (total, count) in sums.items()}
        return GpuProcesses(memory, sm, last_seen)

    # -- control ----------------------------------------------------------------------------

    def get_power_limit_w(self) -> float:
        mw = self._call("reading the power limit", self._nv.nvmlDeviceGetPowerManagementLimit)
        return float(mw) / 1000.0

    def power_limit_range_w(self) -> tuple[float, float]:
        if self._limit_range is None:
            raise NotSupportedError(f"{self._key} has no settable power limit", device=self._key)
        return self._limit_range

    def set_power_limit_w(self, watts: float) -> None:
        """Set the limit; ``ConfigError`` out of range, ``NoPermissionError`` if unprivileged."""
        lo, hi = self.power_limit_range_w()
        if not (math.isfinite(watts) and lo <= watts <= hi):
            raise ConfigError(
                f"power limit {watts} W for {self._key} is outside the supported range "
                f"[{lo:g}, {hi:g}] W"
            )
        self._call(
            "setting the power limit",
            self._nv.nvmlDeviceSetPowerManagementLimit,
            round(watts * 1000),
        )

    def supported_sm_clocks_hz(self) -> list[float]:
        return list(self._sm_clocks_hz)

    def lock_sm_clocks_hz(self, min_hz: float, max_hz: float) -> None:
        """Lock SM clocks to ``[min_hz, max_hz]`` (rounded to MHz)."""
        if not (math.isfinite(min_hz) and math.isfinite(max_hz) and 0 < min_hz <= max_hz):
            raise ConfigError(f"invalid SM clock range {min_hz}..{max_hz} Hz for {self._key}")
        self._call(
            "locking SM clocks",
            self._nv.nvmlDeviceSetGpuLockedClocks,
            round(min_hz / 1e6),
            round(max_hz / 1e6),
        )

    def reset_sm_clocks(self) -> None:
        self._call("resetting SM clocks", self._nv.nvmlDeviceResetGpuLockedClocks)

    def close(self) -> None:
        """Release this GPU's share of the NVML session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._session is not None:
            self._session.release()

    def __repr__(self) -> str:
        return f"NvmlGpu({self._key}, nvml index {self.physical_index}, {self._info.name!r})"


def _uuids(nv: ModuleType, count: int) -> list[str]:
    out: list[str] = []
    for i in range(count):
        try:
            out.append(str(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i))))
        except nv.NVMLError:
            out.append("")  # an unreadable GPU matches no UUID, as for CUDA
    return out


def _visible(nv: ModuleType, env: Mapping[str, str] | None) -> list[int]:
    try:
        count = int(nv.nvmlDeviceGetCount())
    except nv.NVMLError as exc:
        raise map_nvml_error(exc, action="counting GPUs") from None
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return parse_cuda_visible_devices(value, count, lambda: _uuids(nv, count))


def open_nvml_gpus(
    indices: Sequence[int] | None = None,
    *,
    pynvml_module: ModuleType | None = None,
    env: Mapping[str, str] | None = None,
    power_scope: str = "gpu",
) -> list[NvmlGpu]:
    """Open GPUs through NVML, honouring ``CUDA_VISIBLE_DEVICES``.

    Args:
        indices: Logical indices (positions among the visible GPUs); ``None`` = all visible.
        pynvml_module: The pynvml module to use (default: ``import pynvml`` now).
        env: Environment to read ``CUDA_VISIBLE_DEVICES`` from (default ``os.environ``).
        power_scope: ``gpu`` (default), ``module`` (Grace superchips: GPU + CPU + memory) or
            ``auto`` (see the module docstring).

    Raises:
        DriverNotLoadedError: No NVML library or driver.
        ConfigError: An index out of range, repeated, or a MIG device in ``CUDA_VISIBLE_DEVICES``;
            an unknown power scope, or ``module`` on a GPU that does not answer it.
        DeviceError: A GPU failed while opening (e.g. ``DeviceLostError``).
    """
    nv = pynvml_module if pynvml_module is not None else _import_pynvml()
    session = _Session(nv)
    session.open()
    gpus: list[NvmlGpu] = []
    try:
        visible = _visible(nv, env)
        wanted = list(range(len(visible))) if indices is None else list(indices)
        if len(set(wanted)) != len(wanted):
            raise ConfigError(f"GPU indices repeated: {wanted}")
        for i in wanted:
            if not 0 <= i < len(visible):
                raise ConfigError(
                    f"GPU index {i} out of range: {len(visible)} visible GPU(s) "
                    f"(NVML indices {visible}; CUDA_VISIBLE_DEVICES applies)"
                )
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(visible[i])
            except nv.NVMLError as exc:
                raise map_nvml_error(exc, f"gpu:{i}", "opening") from None
            gpus.append(
                NvmlGpu(nv, handle, i, visible[i], session=session, power_scope=power_scope)
            )
    except BaseException:
        for gpu in gpus:
            gpu.close()
        raise
    finally:
        session.release()  # the GPUs hold their own references
    logger.info("opened %d GPU(s) through NVML: %s", len(gpus), [g.describe().name for g in gpus])
    return gpus


def nvml_available(pynvml_module: ModuleType | None = None) -> bool:
    """Whether NVML initializes (library and driver present)."""
    try:
        nv = pynvml_module if pynvml_module is not None else _import_pynvml()
        nv.nvmlInit()
    except (DriverNotLoadedError, OSError) as exc:
        logger.debug("NVML unavailable: %s", exc)
        return False
    except Exception as exc:  # pynvml.NVMLError of whichever module
        logger.debug("NVML unavailable: %s", exc)
        return False
    try:
        nv.nvmlShutdown()
    except Exception as exc:
        logger.debug("nvmlShutdown failed: %s", exc)
    return True


def visible_nvml_indices(
    *, pynvml_module: ModuleType | None = None, env: Mapping[str, str] | None = None
) -> list[int]:
    """NVML indices of the GPUs this process may use; ``[]`` without a driver (auto-detection)."""
    if not nvml_available(pynvml_module):
        return []
    nv = pynvml_module if pynvml_module is not None else _import_pynvml()
    session = _Session(nv)
    try:
        session.open()
    except DeviceError:
        return []
    try:
        return _visible(nv, env)
    except DeviceError as exc:
        logger.debug("cannot list GPUs: %s", exc)
        return []
    finally:
        session.release()
