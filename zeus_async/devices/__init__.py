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
    "is_simulated",
    "open_devices",
    "resolve_backend",
]

logger = logging.getLogger(__name__)

#: NVML return codes: the kernel driver is not loaded; the NVML library is missing.
_NVML_DRIVER_NOT_LOADED = 9
_NVML_LIBRARY_NOT_FOUND = 12

Backend = Literal[
    "auto", "nvml", "amd", "jetson", "apple", "sim", "sim-amd", "sim-jetson", "sim-apple"
]
#: The GPU backends of real hardware, in the order ``auto`` numbers their GPUs on a mixed node.
VENDOR_BACKENDS: tuple[str, ...] = ("nvml", "amd", "jetson", "apple")
#: Every backend name: ``auto``, the real ones, and the simulator beneath each vendor's API
#: (``sim`` is the simulator beneath ``pynvml``, or beneath the API its config's vendor names).
BACKENDS: tuple[str, ...] = ("auto", *VENDOR_BACKENDS, "sim", "sim-amd", "sim-jetson", "sim-apple")
#: The simulated vendor of each ``sim-*`` backend.
SIM_VENDORS: dict[str, str] = {"sim-amd": "amd", "sim-jetson": "jetson", "sim-apple": "apple"}


def is_simulated(backend: str) -> bool:
    """Whether ``backend`` (as :func:`resolve_backend` or :class:`OpenedDevices` name it)
    serves simulated devices."""
    return backend == "sim" or backend.startswith("sim-")


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
    power_scope: str = "gpu",
) -> OpenedDevices:
    """Open the GPUs (and CPU packages) to sample.

    Args:
        backend: ``auto`` (every vendor present; the simulator where none is), ``nvml``,
            ``amd``, ``jetson``, ``apple`` (that vendor's real API, an error if absent),
            ``sim`` or ``sim-<vendor>`` (the simulator beneath that vendor's API), or several
            real ones joined by ``+`` (``nvml+amd``: one mixed node, GPUs numbered in that
            order).
        gpus: Logical GPU indices (after ``CUDA_VISIBLE_DEVICES``; on a mixed node, positions
            in the order above); ``None`` = all.
        cpus: RAPL package indices; ``"auto"`` = all if readable (skipped with a log line
            otherwise); ``None`` or ``[]`` = none. Explicit indices raise when unreadable.
        clock: Clock the simulator follows (``sim`` backend only).
        sim_config: A :class:`~zeus_async.devices.sim.SimConfig` for the ``sim`` backend.
        rapl_root: powercap root (tests point it at a fake tree).
        power_scope: NVIDIA GPUs' power scope (:data:`~zeus_async.devices.nvml.POWER_SCOPES`):
            ``gpu`` (default), ``module`` (Grace superchips: GPU + CPU + memory; a GPU that
            does not answer it is a ``ConfigError``) or ``auto``; other vendors have one.

    Raises:
        ConfigError: Unknown backend or bad indices; a power scope no GPU opened can read.
        DriverNotLoadedError: ``backend="nvml"`` on a host without a driver.
    """
    from .nvml import POWER_SCOPES, NvmlGpu

    if power_scope not in POWER_SCOPES:
        raise ConfigError(
            f"unknown power scope {power_scope!r}; choose one of {', '.join(POWER_SCOPES)}"
        )
    chosen = resolve_backend(backend)
    parts = chosen.split("+")
    if len(parts) == 1:
        gpu_devices = _open_gpus(parts[0], gpus, 0, clock, sim_config, power_scope)
    else:  # a mixed node: every GPU of each vendor, numbered in order; then the ones asked for
        every: list[Device] = []
        for part in parts:
            every.extend(_open_gpus(part, None, len(every), clock, sim_config, power_scope))
        gpu_devices = _select(every, gpus)
    from .jetson import JetsonGpu

    if (
        power_scope == "module"
        and gpu_devices
        and not any(isinstance(d, (NvmlGpu, JetsonGpu)) for d in gpu_devices)
    ):
        for d in gpu_devices:
            d.close()
        raise ConfigError(
            f"power scope 'module' is NVML's (Grace superchips) and Jetson's (the module's "
            f"input rail); backend {chosen} has neither: use power_scope='gpu'"
        )
    cpu_devices = _open_cpus(cpus, rapl_root, parts)
    return OpenedDevices(chosen, gpu_devices, cpu_devices)


def _select(devices: list[Device], indices: Sequence[int] | None) -> list[Device]:
    """``devices[i]`` for each of ``indices`` (all for ``None``); the others closed.

    Raises:
        ConfigError: An index past the last GPU.
    """
    if indices is None:
        return devices
    bad = [i for i in indices if not 0 <= i < len(devices)]
    if bad:
        for d in devices:
            d.close()
        raise ConfigError(f"no GPU {bad[0]}: this node has {len(devices)} (indices 0..)")
    keep = [devices[i] for i in indices]
    for d in devices:
        if d not in keep:
            d.close()
    return keep


def _open_gpus(
    backend: str,
    indices: Sequence[int] | None,
    first_index: int,
    clock: Clock | None,
    sim_config: object | None,
    power_scope: str = "gpu",
) -> list[Device]:
    """The GPUs of one backend (``first_index``: the key of its first GPU on a mixed node)."""
    from . import nvml

    if backend == "sim" or backend in SIM_VENDORS:
        from .sim_config import SimConfig, sim_config_for

        config = sim_config_for(
            SIM_VENDORS.get(backend), sim_config if isinstance(sim_config, SimConfig) else None
        )
        vendor = config.vendor
        mixed = {ov.vendor or vendor for ov in config.gpus} | (
            {vendor} if len(config.gpus) < config.num_gpus else set()
        )
        if backend == "sim" and len(mixed) > 1:
            return _open_mixed_sim(config, indices, clock, power_scope)
        if vendor == "nvidia":
            from ..testing import sim_pynvml

            sim_pynvml.install(config=config, clock=clock)
            return list(
                nvml.open_nvml_gpus(indices, pynvml_module=sim_pynvml, power_scope=power_scope)
            )
        if vendor == "amd":
            from ..testing import sim_amdsmi
            from .amd import open_amd_gpus

            sim_amdsmi.install(config=config, clock=clock)
            return list(open_amd_gpus(indices, amdsmi_module=sim_amdsmi, first_index=first_index))
        if vendor == "jetson":
            from ..testing import sim_jetson
            from .jetson import open_jetson_gpus

            fs = sim_jetson.install(config=config, clock=clock)
            return list(
                open_jetson_gpus(
                    indices, fs=fs, first_index=first_index, power_scope=_jetson_scope(power_scope)
                )
            )
        if vendor == "apple":
            from ..testing import sim_ioreport
            from .apple import open_apple_gpus

            source = sim_ioreport.install(config=config, clock=clock)
            return list(open_apple_gpus(indices, source=source, first_index=first_index))
        raise ConfigError(f"the simulator has no vendor {vendor!r}")
    if backend == "nvml":
        if first_index:
            raise ConfigError("NVIDIA GPUs come first on a mixed node (nvml+...)")
        return list(nvml.open_nvml_gpus(indices, power_scope=power_scope))
    if backend == "amd":
        from .amd import open_amd_gpus

        return list(open_amd_gpus(indices, first_index=first_index))
    if backend == "jetson":
        from .jetson import open_jetson_gpus

        return list(
            open_jetson_gpus(
                indices, first_index=first_index, power_scope=_jetson_scope(power_scope)
            )
        )
    if backend == "apple":
        from .apple import open_apple_gpus

        return list(open_apple_gpus(indices, first_index=first_index))
    raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def _open_mixed_sim(
    config: object, indices: Sequence[int] | None, clock: Clock | None, power_scope: str
) -> list[Device]:
    """A simulated node whose GPUs are of several vendors (``GpuOverride.vendor``): one node,
    each vendor's GPUs through its own simulated API, NVIDIA's (``pynvml``) then AMD's
    (``amdsmi``), numbered in that order as on a real ``nvml+amd`` node.

    Raises:
        ConfigError: A vendor other than NVIDIA and AMD on the node.
    """
    from ..testing import sim_amdsmi, sim_pynvml
    from . import nvml
    from .amd import open_amd_gpus
    from .sim_config import SimConfig

    assert isinstance(config, SimConfig)
    vendors = {(ov.vendor or config.vendor) for ov in config.gpus} | {config.vendor}
    if not vendors <= {"nvidia", "amd"}:
        raise ConfigError(
            f"a mixed simulated node holds NVIDIA and AMD GPUs; this one names {sorted(vendors)}"
        )
    node = sim_pynvml.install(config=config, clock=clock)
    sim_amdsmi.install(node)
    every: list[Device] = list(
        nvml.open_nvml_gpus(None, pynvml_module=sim_pynvml, power_scope=power_scope)
    )
    every.extend(open_amd_gpus(None, amdsmi_module=sim_amdsmi, first_index=len(every)))
    return _select(every, indices)


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


def other_vendors_present() -> list[str]:
    """The backends besides NVML whose hardware this machine has (``amd``, ``jetson``,
    ``apple``), each asked through its own module's ``*_present()``."""
    found: list[str] = []
    from . import amd, apple, jetson

    for name, present in (
        ("amd", amd.amd_present),
        ("jetson", jetson.jetson_present),
        ("apple", apple.apple_present),
    ):
        try:
            if present():
                found.append(name)
        except Exception as exc:  # a probe must never stop the others
            logger.debug("probing %s failed: %s", name, exc)
    return found


def auto_backend() -> str:
    """What ``auto`` means here: every vendor present, joined by ``+`` in the order of
    :data:`VENDOR_BACKENDS` (``nvml``, ``amd``, ``nvml+amd``, ``jetson``...), and ``sim``
    where none is and no NVIDIA driver is installed at all (nothing said: callers say it
    their way).

    Raises:
        DeviceError: The NVIDIA driver is installed but fails (the typed NVML error:
            ``NoPermissionError``, ``DriverNotLoadedError``, ...).
    """
    error = nvml_error()
    others = other_vendors_present()
    if error is None:
        return "+".join(["nvml", *others])
    if no_driver_installed(error):
        return "+".join(others) if others else "sim"
    message = (
        f"an NVIDIA driver is installed but NVML fails ({error}); not falling back to "
        "simulated GPUs: fix the driver or its permissions, or pass backend='sim' "
        "(--backend sim) for simulated ones"
    )
    raise type(error)(message, device=error.device, code=error.code)


def resolve_backend(backend: str) -> str:
    """The backend ``backend`` names (``nvml``, ``amd``, ``sim-amd``, ``nvml+amd``, ...):
    ``auto`` as :func:`auto_backend` decides, with a WARNING (once per process) when that is
    the simulator.

    Raises:
        ConfigError: An unknown backend.
        DeviceError: ``auto`` on a machine whose NVIDIA driver is installed but fails.
    """
    global _warned_simulated
    parts = backend.split("+")
    if backend not in BACKENDS and not (
        len(parts) > 1
        and all(p in VENDOR_BACKENDS for p in parts)
        and len(set(parts)) == len(parts)
    ):
        raise ConfigError(
            f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}, or real ones "
            "joined by '+' (nvml+amd)"
        )
    if backend != "auto":
        return backend
    chosen = auto_backend()
    if not is_simulated(chosen):
        logger.info("sampling real GPUs through %s", chosen)
    elif not _warned_simulated:
        _warned_simulated = True
        logger.warning(
            "no NVIDIA driver on this machine: sampling SIMULATED GPUs (backend 'sim'); every "
            "GPU figure is simulated (pass backend='sim' to choose this without this warning)"
        )
    return chosen


def _jetson_scope(power_scope: str) -> str | None:
    """The Jetson backend's scope for ``power_scope``: ``None`` (its default, or
    ``ZEUS_ASYNC_JETSON_SCOPE``) unless one was asked for."""
    return None if power_scope == "gpu" else power_scope


def _open_cpus(
    cpus: Sequence[int] | Literal["auto"] | None, root: str | Path, backends: Sequence[str] = ()
) -> list[Device]:
    """The CPU packages: RAPL, or on Apple Silicon (``apple``/``sim-apple`` among
    ``backends``) the chip's CPU/DRAM/SoC counters, which stand in for RAPL there."""
    from . import rapl

    if cpus is None or (not isinstance(cpus, str) and len(cpus) == 0):
        return []
    apple = next((b for b in backends if b in ("apple", "sim-apple")), None)
    if apple is not None:
        from .apple import open_apple_cpus

        source = None
        if apple == "sim-apple":
            from ..testing import sim_ioreport

            source = sim_ioreport
        packages = None if cpus == "auto" else list(cpus)
        return list(open_apple_cpus(packages, source=source))
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
