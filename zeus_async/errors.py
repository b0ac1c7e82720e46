"""Typed exceptions for zeus_async.

Every error the package raises on purpose derives from :class:`ZeusAsyncError`, so a caller
can catch the package's errors without catching programming mistakes. Device errors map the
NVML/RAPL failure modes that callers handle differently (retry, skip a field, give up on a
device, ask for privileges).
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup as _ExceptionGroup
else:  # pragma: no cover - anyio installs the backport on 3.10
    from exceptiongroup import BaseExceptionGroup as _ExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = [
    "CodecError",
    "ConfigError",
    "DeviceError",
    "DeviceLostError",
    "DeviceNotFoundError",
    "DriverNotLoadedError",
    "JournalError",
    "LeaseConflictError",
    "NoPermissionError",
    "NotSupportedError",
    "PolicyDeniedError",
    "PolicyError",
    "SchemaVersionError",
    "TransientDeviceError",
    "WorkloadSourceError",
    "ZeusAsyncError",
    "sole_exception",
]


class ZeusAsyncError(Exception):
    """Base class of every error raised on purpose by zeus_async."""


class ConfigError(ZeusAsyncError, ValueError):
    """Invalid settings or arguments (bad period, unknown backend, bad endpoint, ...)."""


class LeaseConflictError(ZeusAsyncError):
    """A hardware setting (a GPU's power limit or locked clocks) is held by another client.

    Two clients asking different settings for one GPU would undo each other's changes; the
    second is refused until the first releases its lease (see :mod:`zeus_async.agent`).
    """


class PolicyError(ConfigError):
    """A system agent's policy file (``/etc/zeus-async/policy.toml``) that cannot be used: not
    TOML, an unknown key, a value of the wrong type. The message names the file and the key."""


class PolicyDeniedError(ZeusAsyncError, PermissionError):
    """The system agent's policy refuses this user a request: connecting to read, or changing
    a setting on a GPU (not granted by a rule, outside the rule's range, not allocated to the
    job). The message names the policy file. Also a :class:`PermissionError`."""


class JournalError(ZeusAsyncError):
    """A hardware setting was left unchanged because the value to put back could not be
    journalled first (a full or read-only private directory): a change is never applied
    unjournalled, since nothing could then restore it after a crash."""


class WorkloadSourceError(ZeusAsyncError):
    """A source of workload identity (the kubelet's pod-resources socket) could not be read:
    missing, no permission, not answering. The message is one line that names the source and
    what to do; the resolver logs it and goes on with what it knew and with its other sources
    (:mod:`zeus_async.agent.workloads`)."""


class CodecError(ZeusAsyncError, ValueError):
    """Bytes that do not decode into valid events or frames."""


class SchemaVersionError(CodecError):
    """A frame or file written with a schema version this build cannot read."""


class DeviceError(ZeusAsyncError):
    """A device (GPU, CPU package) failed an operation.

    Attributes:
        device: Key of the device, e.g. ``"gpu:0"`` or ``"cpu:1"``; empty when not known.
        code: Backend error code (the NVML return code), or ``None``.
    """

    #: Short machine-readable kind, carried by fault events.
    kind: str = "error"

    def __init__(self, message: str, *, device: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.device = device
        self.code = code


class NotSupportedError(DeviceError):
    """The device does not support this query or setting (e.g. no energy counter)."""

    kind = "not_supported"


class NoPermissionError(DeviceError, RuntimeError):
    """The process lacks the privilege for this operation (setting power limits or clocks).

    Also a :class:`RuntimeError`, what Zeus raises there: code written for Zeus that catches
    ``RuntimeError`` around its optimizer keeps working.
    """

    kind = "no_permission"


class DeviceLostError(DeviceError):
    """The device fell off the bus or needs a reset; later calls will keep failing."""

    kind = "gpu_lost"


class DeviceNotFoundError(DeviceError):
    """No device with this index/UUID, or no device of this kind on the host."""

    kind = "not_found"


class DriverNotLoadedError(DeviceError):
    """The NVIDIA driver (or NVML library) is not present on this host."""

    kind = "driver_not_loaded"


class TransientDeviceError(DeviceError):
    """An error worth retrying (timeout, busy driver, unknown error)."""

    kind = "transient"


def sole_exception(exc: BaseException) -> BaseException:
    """The one error inside exception groups of a single member (nested or not), else ``exc``.

    A task group reports a failed start as a group of one; a caller of ``async with
    Runtime(...)`` or of the CLI should see the :class:`ConfigError` itself.
    """
    while isinstance(exc, _ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
