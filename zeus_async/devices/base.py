"""The one device Protocol every backend implements.

A device is anything the runtime samples on its own cadence: one GPU (NVML backend, also used
over the simulator), or one CPU package with its RAPL domains. ``read`` is a *blocking* call
that touches hardware; the runtime decides on which thread it runs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from ..errors import (
    ConfigError,
    DeviceLostError,
    DeviceNotFoundError,
    DriverNotLoadedError,
    NoPermissionError,
    NotSupportedError,
    TransientDeviceError,
    ZeusAsyncError,
)
from ..events import DeviceInfo, Event

__all__ = [
    "GPU_FIELDS",
    "Device",
    "ErrorCodes",
    "GpuControl",
    "GpuProcessReader",
    "GpuProcesses",
    "typed_error",
]

#: Every GPU field a GPU device may read; names match :class:`~zeus_async.events.GpuSample`.
GPU_FIELDS: tuple[str, ...] = (
    "power_w",
    "avg_power_w",
    "energy_j",
    "temperature_c",
    "sm_clock_hz",
    "utilization_frac",
    "memory_used_bytes",
    "power_limit_w",
)


@runtime_checkable
class Device(Protocol):
    """A sampled device.

    Attributes:
        key: Stable id within the process, ``"gpu:<index>"`` or ``"cpu:<package>"``.
        fields: Names of the fields this device can read (a subset of its event's fields).
    """

    @property
    def key(self) -> str: ...

    @property
    def fields(self) -> tuple[str, ...]: ...

    def describe(self) -> DeviceInfo:
        """Static facts about the device (name, uuid, architecture, limits)."""
        ...

    def read(self, fields: Collection[str], host: str, t_ns: int) -> Sequence[Event]:
        """Read ``fields`` now and return the resulting events stamped ``host``/``t_ns``.

        Fields the device does not support come back as ``None``; a failure of the whole read
        raises a :class:`~zeus_async.errors.DeviceError` subclass.
        """
        ...

    def close(self) -> None:
        """Release backend resources. Idempotent."""
        ...


@runtime_checkable
class GpuControl(Protocol):
    """Settings a GPU backend can change (used by the optimizers, restored on exit)."""

    @property
    def index(self) -> int: ...

    def get_power_limit_w(self) -> float: ...

    def power_limit_range_w(self) -> tuple[float, float]:
        """``(min, max)`` power limit the device accepts."""
        ...

    def set_power_limit_w(self, watts: float) -> None:
        """Raises ``NoPermissionError`` without privileges, ``ConfigError`` when out of range."""
        ...

    def supported_sm_clocks_hz(self) -> list[float]: ...

    def lock_sm_clocks_hz(self, min_hz: float, max_hz: float) -> None: ...

    def reset_sm_clocks(self) -> None: ...


class GpuProcesses(NamedTuple):
    """What one GPU reports about the processes using it.

    Attributes:
        memory_bytes: Device memory held by each process on the GPU (compute and graphics
            contexts), ``None`` where the driver does not say (some MIG and container setups).
        sm_frac: Mean SM utilization (0..1) of each process over the driver's samples newer
            than the timestamp asked for; processes that ran no kernel since then are absent.
        last_seen_us: Timestamp (driver µs) of the newest sample, to ask from next time.
    """

    memory_bytes: dict[int, int | None]
    sm_frac: dict[int, float]
    last_seen_us: int


@runtime_checkable
class GpuProcessReader(Protocol):
    """A GPU that can say which processes use it and how much (NVML, simulator)."""

    @property
    def index(self) -> int: ...

    def read_processes(self, since_us: int) -> GpuProcesses:
        """Processes on the GPU now, with utilization samples newer than ``since_us``.

        Blocking (several driver calls). Raises a :class:`~zeus_async.errors.DeviceError`
        subclass when the GPU cannot be read at all (``NotSupportedError`` when the driver has
        no per-process accounting).
        """
        ...


class ErrorCodes(NamedTuple):
    """A vendor library's return codes, by the zeus_async error each one means."""

    not_supported: frozenset[int]
    permission: frozenset[int]
    lost: frozenset[int]
    driver: frozenset[int]
    argument: frozenset[int]
    not_found: frozenset[int]


def typed_error(
    library: str,
    code: int | None,
    text: str,
    codes: ErrorCodes,
    *,
    device_key: str = "",
    action: str = "",
    privilege_hint: str = "",
) -> ZeusAsyncError:
    """The zeus_async error for return ``code`` of ``library`` (``"NVML"``, ``"amdsmi"``):
    ``NotSupportedError``, ``NoPermissionError`` (with ``privilege_hint``), ``DeviceLostError``,
    ``DriverNotLoadedError``, ``ConfigError``, ``DeviceNotFoundError``, else
    ``TransientDeviceError``; the message names the action and the device."""
    where = " ".join(p for p in (action, f"on {device_key}" if device_key else "") if p)
    message = f"{where + ': ' if where else ''}{library} error {code} ({text})"
    if code in codes.not_supported:
        return NotSupportedError(message, device=device_key, code=code)
    if code in codes.permission:
        hint = f"; {privilege_hint}" if privilege_hint else ""
        return NoPermissionError(f"{message}{hint}", device=device_key, code=code)
    if code in codes.lost:
        return DeviceLostError(message, device=device_key, code=code)
    if code in codes.driver:
        return DriverNotLoadedError(message, device=device_key, code=code)
    if code in codes.argument:
        return ConfigError(message)
    if code in codes.not_found:
        return DeviceNotFoundError(message, device=device_key, code=code)
    return TransientDeviceError(message, device=device_key, code=code)
