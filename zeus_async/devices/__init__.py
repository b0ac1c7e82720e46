"""Hardware access: the only package that touches devices.

:func:`open_devices` picks the GPU backend and adds RAPL CPU packages when powercap is readable.
The ``sim`` backend is the NVML backend itself, running over the simulated ``pynvml`` module.

``auto`` means NVML when it answers. It falls back to the simulator only where no NVIDIA driver
is installed at all (no NVML library, or one with no kernel driver behind it:
``/proc/driver/nvidia`` and ``/dev/nvidiactl`` absent), and then says so once, at WARNING: a
library user whose figures would otherwise be plausible fakes must hear it. A driver that is
there but fails (no permission, a library/driver version mismatch, any NVML error) is that
error, typed and named, never a quiet fallback to simulated GPUs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from ..clock import Clock
from ..errors import ConfigError, DeviceError, DriverNotLoadedError, NoPermissionError
from .base import GPU_FIELDS, Device, GpuControl

__all__ = [
    "GPU_FIELDS",
    "Backend",
    "Device",
    "GpuControl",
    "OpenedDevices",
    "auto_backend",
    "open_devices",
    "resolve_backend",
]

logger = logging.getLogger(__name__)

#: NVML return codes: the kernel driver is not loaded; the NVML library is missing.
_NVML_DRIVER_NOT_LOADED = 9
_NVML_LIBRARY_NOT_FOUND = 12

Backend = Literal["auto", "nvml", "sim"]
BACKENDS: tuple[str, ...] = ("auto", "nvml", "sim")


class OpenedDevices:
    """Result of :func:`open_devices`: the devices and which backend served the GPUs."""

    __slots__ = ("backend", "cpus", "gpus")

    def __init__(self, backend: str, gpus: list[Device], cpus: list[Device]) -> None:
        self.backend = backend
        self.gpus = gpus
        self.cpus = cpus

    @property
    def all(self) -> list[Device]:
        return [*self.gpus, *self.cpus]


def open_devices(
    backend: str = "auto",
    gpus: Sequence[int] | None = None,
    cpus: Sequence[int] | Literal["auto"] | None = "auto",
    *,
    clock: Clock | None = None,
    sim_config: object | None = None,
    rapl_root: str | Path = "/sys/class/powercap",
) -> OpenedDevices:
    """Open the GPUs (and CPU packages) to sample.

    Args:
        backend: ``auto``, ``nvml`` (real driver, error if absent) or ``sim``.
        gpus: Logical GPU indices (after ``CUDA_VISIBLE_DEVICES``); ``None`` = all.
        cpus: RAPL package indices; ``"auto"`` = all if readable (skipped with a log line
            otherwise); ``None`` or ``[]`` = none. Explicit indices raise when unreadable.
        clock: Clock the simulator follows (``sim`` backend only).
        sim_config: A :class:`~zeus_async.devices.sim.SimConfig` for the ``sim`` backend.
        rapl_root: powercap root (tests point it at a fake tree).

    Raises:
        ConfigError: Unknown backend or bad indices.
        DriverNotLoadedError: ``backend="nvml"`` on a host without a driver.
    """
    from . import nvml

    chosen = resolve_backend(backend)
    if chosen == "sim":
        from ..testing import sim_pynvml

        sim_pynvml.install(config=sim_config, clock=clock)  # type: ignore[arg-type]
        gpu_devices: list[Device] = list(nvml.open_nvml_gpus(gpus, pynvml_module=sim_pynvml))
    else:
        gpu_devices = list(nvml.open_nvml_gpus(gpus))
    cpu_devices = _open_cpus(cpus, rapl_root)
    return OpenedDevices(chosen, gpu_devices, cpu_devices)


#: Where a kernel driver shows itself (the library alone may be in a container's image).
_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl")

_warned_simulated = False


def nvml_error() -> DeviceError | None:
    """Why NVML does not initialize here (typed), or ``None`` when it does."""
    from . import nvml

    try:
        nv = nvml._import_pynvml()
        nv.nvmlInit()
    except DeviceError as exc:
        return exc
    except Exception as exc:  # pynvml.NVMLError of whichever module
        mapped = nvml.map_nvml_error(exc, action="initializing NVML")
        if isinstance(mapped, DeviceError):
            return mapped
        return DriverNotLoadedError(str(mapped))
    try:
        nv.nvmlShutdown()
    except Exception as exc:
        logger.debug("nvmlShutdown failed: %s", exc)
    return None


def no_driver_installed(error: DeviceError) -> bool:
    """Whether ``error`` means that this machine has no NVIDIA driver at all (as opposed to one
    that is installed and fails)."""
    if not isinstance(error, DriverNotLoadedError):
        return False
    if error.code not in (None, _NVML_DRIVER_NOT_LOADED, _NVML_LIBRARY_NOT_FOUND):
        return False  # a library/driver mismatch, a failed init: installed, and broken
    return not any(os.path.exists(path) for path in _DRIVER_PATHS)


def auto_backend() -> str:
    """What ``auto`` means here: ``nvml`` when NVML answers, ``sim`` where no NVIDIA driver is
    installed at all (nothing said: callers say it their way).

    Raises:
        DeviceError: The driver is installed but fails (the typed NVML error:
            ``NoPermissionError``, ``DriverNotLoadedError``, ...).
    """
    error = nvml_error()
    if error is None:
        return "nvml"
    if no_driver_installed(error):
        return "sim"
    message = (
        f"an NVIDIA driver is installed but NVML fails ({error}); not falling back to "
        "simulated GPUs: fix the driver or its permissions, or pass backend='sim' "
        "(--backend sim) for simulated ones"
    )
    raise type(error)(message, device=error.device, code=error.code)


def resolve_backend(backend: str) -> str:
    """``nvml`` or ``sim`` for ``backend``: ``auto`` as :func:`auto_backend` decides, with a
    WARNING (once per process) when that is the simulator.

    Raises:
        ConfigError: An unknown backend.
        DeviceError: ``auto`` on a machine whose NVIDIA driver is installed but fails.
    """
    global _warned_simulated
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    chosen = auto_backend()
    if chosen == "nvml":
        logger.info("NVIDIA driver found: sampling real GPUs through NVML")
    elif not _warned_simulated:
        _warned_simulated = True
        logger.warning(
            "no NVIDIA driver on this machine: sampling SIMULATED GPUs (backend 'sim'); every "
            "GPU figure is simulated (pass backend='sim' to choose this without this warning)"
        )
    return chosen


def _open_cpus(cpus: Sequence[int] | Literal["auto"] | None, root: str | Path) -> list[Device]:
    from . import rapl

    if cpus is None or (not isinstance(cpus, str) and len(cpus) == 0):
        return []
    if cpus == "auto":
        try:
            return list(rapl.open_rapl_packages(root))
        except NoPermissionError as exc:
            # The user can fix this one: say so loudly rather than dropping CPU energy quietly.
            logger.warning("CPU energy (RAPL) not sampled: %s", exc)
            return []
        except DeviceError as exc:
            logger.info("CPU energy (RAPL) not sampled: %s", exc)
            return []
    return list(rapl.open_rapl_packages(root, packages=list(cpus)))
