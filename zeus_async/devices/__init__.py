"""Hardware access: the only package that touches devices.

:func:`open_devices` picks the GPU backend (``auto``: NVML when a driver answers, otherwise the
simulator, with a log line saying which) and adds RAPL CPU packages when powercap is readable.
The ``sim`` backend is the NVML backend itself, running over the simulated ``pynvml`` module.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from ..clock import Clock
from ..errors import ConfigError, DeviceError, NoPermissionError
from .base import GPU_FIELDS, Device, GpuControl

__all__ = ["GPU_FIELDS", "Backend", "Device", "GpuControl", "OpenedDevices", "open_devices"]

logger = logging.getLogger(__name__)

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

    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    chosen = backend
    if backend == "auto":
        if nvml.nvml_available():
            chosen = "nvml"
            logger.info("NVIDIA driver found: sampling real GPUs through NVML")
        else:
            chosen = "sim"
            logger.info("no NVIDIA driver found: sampling simulated GPUs (backend 'sim')")
    if chosen == "sim":
        from ..testing import sim_pynvml

        sim_pynvml.install(config=sim_config, clock=clock)  # type: ignore[arg-type]
        gpu_devices: list[Device] = list(nvml.open_nvml_gpus(gpus, pynvml_module=sim_pynvml))
    else:
        gpu_devices = list(nvml.open_nvml_gpus(gpus))
    cpu_devices = _open_cpus(cpus, rapl_root)
    return OpenedDevices(chosen, gpu_devices, cpu_devices)


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
