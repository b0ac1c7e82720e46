"""Apple Silicon energy through IOReport's "Energy Model" channels (issue 37).

What is read. macOS keeps, for every Apple Silicon chip, a set of IOReport channels in the
group "Energy Model": cumulative energy estimates of the CPU (total, clusters, cores), the GPU
(and its SRAM), the Apple Neural Engine (ANE) and DRAM. They are read through the
``zeus-apple-silicon`` package (module ``zeus_apple_silicon``, the one Zeus 0.16 uses), whose
``AppleEnergyMonitor().get_cumulative_energy()`` returns an ``AppleEnergyMetrics`` with one
integer per channel, in mJ (``None`` where the chip has no such channel). No direct ctypes
binding of IOReport is made here: that library is private API, and its calls are only
exercised through the package. Reading them needs no privilege (``powermetrics`` needs sudo;
this does not).

How they surface, within the existing events:

* **The GPU** is one :class:`AppleGpu` (``gpu:<first_index>``, the chip has one GPU):
  :class:`~zeus_async.events.GpuSample` with ``energy_j`` from "GPU Energy" + "GPU SRAM"
  (the SRAM channel is a separate channel, not part of "GPU Energy"; both are the GPU's
  energy), accumulated from the first read (so the first read gives 0.0 J, as RAPL's), and
  ``power_w`` the mean power between this read and the previous one, derived from that
  counter (``None`` on the first read). Every other GPU field (temperature, clocks,
  utilization, memory, power limit) is not in the Energy Model: not offered.
* **The CPU, DRAM and ANE** are one :class:`AppleCpu` (``cpu:0``) in the RAPL form, because
  that is what they are: a package counter and a memory counter. Its
  :class:`~zeus_async.events.RaplSample` domains are ``package`` (= "CPU Energy", every
  cluster and core), ``dram`` (= the DRAM channels) and ``psys`` (= the whole modelled SoC:
  CPU + GPU + GPU SRAM + ANE + DRAM), so windows' ``cpu_energy``/``dram_energy`` work as on
  an Intel host. The ANE has no domain of its own in the event schema: its energy is
  ``psys - package - dram - GPU`` and :meth:`AppleCpu.read_metrics` gives every channel as
  the library reports it. ``psys`` is the platform domain on Intel too; windows do not add
  it to any total, so nothing is counted twice.

Counters. Values are whole mJ (the library converts each channel with an integer division),
so a window's energy is exact to about 1 mJ per edge; they are cumulative from an arbitrary
origin (boot). A counter that goes backwards (a new origin) is taken as a restart: that
interval adds nothing and a WARNING says so once per device.

Capabilities: an energy counter; no power cap, no clocks, no per-process use (macOS exposes
none of these without private, privileged interfaces).

The same code runs on a Linux CI host over :mod:`zeus_async.testing.sim_ioreport`, a module
with ``zeus_apple_silicon``'s interface served by the GPU simulator (``backend="sim-apple"``);
the only other thing read from the platform (chip name, host UUID) comes from the source
when it provides ``zeus_async_platform()``, the simulator's stand-in for ``sysctl``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.util
import logging
import platform
import re
import sys
import threading
import uuid
from collections.abc import Collection, Sequence
from typing import Any, Final

from ..errors import (
    ConfigError,
    DeviceError,
    DeviceNotFoundError,
    DriverNotLoadedError,
    TransientDeviceError,
)
from ..events import Capabilities, DeviceInfo, Event, GpuSample, RaplDomain, RaplSample

__all__ = [
    "APPLE_ENERGY_NOTE",
    "AppleCpu",
    "AppleGpu",
    "apple_present",
    "open_apple_cpus",
    "open_apple_gpus",
]

logger = logging.getLogger(__name__)

#: How often IOReport's Energy Model updates its counters (s; ``DeviceInfo.
#: energy_counter_period_s``): every 10 ms, on the model's own grid. An assumption (what the
#: simulator does and what reads of real chips suggest), not a documented figure.
APPLE_COUNTER_PERIOD_S: Final = 0.01

#: How window energy is obtained on an Apple device (``DeviceInfo.energy_note``).
APPLE_ENERGY_NOTE: Final = "IOReport Energy Model (model-based, ~1 mJ), no sudo"
_MODULE: Final = "zeus_apple_silicon"
#: The ``AppleEnergyMetrics`` fields summed into the whole SoC (``psys``).
_SOC_FIELDS: Final = ("cpu_total_mj", "gpu_mj", "gpu_sram_mj", "ane_mj", "dram_mj")
_INSTALL_HINT: Final = (
    "the apple backend reads IOReport through the zeus-apple-silicon package: "
    "`pip install zeus-apple-silicon` (macOS on Apple Silicon only)"
)


def _on_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def apple_present() -> bool:
    """Whether this is an Apple Silicon Mac (Darwin, arm64) with ``zeus_apple_silicon``
    importable. Cheap (nothing is imported or opened) and never raises."""
    try:
        return _on_apple_silicon() and importlib.util.find_spec(_MODULE) is not None
    except Exception as exc:  # a broken install is "not present"
        logger.debug("probing %s failed: %s", _MODULE, exc)
        return False


def _import_source() -> Any:
    if not _on_apple_silicon():
        raise DriverNotLoadedError(
            f"the apple backend needs macOS on Apple Silicon (this is {sys.platform}/"
            f"{platform.machine()}); use backend 'sim-apple' for the simulator"
        )
    try:
        return importlib.import_module(_MODULE)
    except ImportError as exc:
        raise DriverNotLoadedError(
            f"{_MODULE} is not importable ({exc}); {_INSTALL_HINT}"
        ) from None


def _sysctl_string(name: str) -> str | None:
    """``sysctlbyname(name)`` as text (Darwin), ``None`` when it fails."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.dylib")
        size = ctypes.c_size_t(0)
        if libc.sysctlbyname(name.encode(), None, ctypes.byref(size), None, 0) != 0:
            return None
        buf = ctypes.create_string_buffer(size.value)
        if libc.sysctlbyname(name.encode(), buf, ctypes.byref(size), None, 0) != 0:
            return None
        return buf.value.decode("utf-8", "replace").strip() or None
    except Exception as exc:
        logger.debug("sysctlbyname(%s) failed: %s", name, exc)
        return None


def _host_uuid() -> str | None:
    """The Mac's hardware UUID (``gethostuuid``), ``None`` when it fails."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.dylib")
        raw = (ctypes.c_ubyte * 16)()
        wait = (ctypes.c_long * 2)(0, 0)  # struct timespec {0, 0}
        if libc.gethostuuid(raw, wait) != 0:
            return None
        return str(uuid.UUID(bytes=bytes(raw)))
    except Exception as exc:
        logger.debug("gethostuuid failed: %s", exc)
        return None


def _platform(source: Any) -> tuple[str, str]:
    """``(chip name, host UUID)``: the simulator's when the source has them, else the Mac's."""
    ask = getattr(source, "zeus_async_platform", None)
    if callable(ask):
        chip, host = ask()
        return str(chip), str(host)
    return _sysctl_string("machdep.cpu.brand_string") or "Apple Silicon", _host_uuid() or ""


def _named(chip: str, part: str) -> str:
    """``"Apple M3 Max GPU"``; a simulated chip's ``(simulated)`` stays at the end."""
    sim = " (simulated)"
    if chip.endswith(sim):
        return f"{chip.removesuffix(sim)} {part}{sim}"
    return f"{chip} {part}"


def _arch(chip: str) -> str:
    """``apple-m3`` for "Apple M3 Max", ``apple`` when the name says no generation."""
    match = re.search(r"\bM(\d+)\b", chip)
    return f"apple-m{match.group(1)}" if match else "apple"


def _map_error(exc: BaseException, key: str, action: str) -> DeviceError:
    """The typed error for what the library raised (nanobind turns ``std::runtime_error``
    into ``RuntimeError`` and ``std::invalid_argument`` into ``ValueError``)."""
    message = f"{action} on {key}: {type(exc).__name__}: {exc}"
    if isinstance(exc, ValueError):  # a channel unit the library does not know
        return DeviceError(message, device=key)
    return TransientDeviceError(message, device=key)


class _Counter:
    """One cumulative mJ channel, turned into energy since the first read."""

    __slots__ = ("last_mj", "last_t_ns", "name", "total_mj", "warned")

    def __init__(self, name: str) -> None:
        self.name = name
        self.last_mj: int | None = None
        self.last_t_ns = 0
        self.total_mj = 0
        self.warned = False

    def update(self, mj: int, t_ns: int, key: str) -> float | None:
        """Account a reading; the mean power (W) since the previous one, if any."""
        power: float | None = None
        if self.last_mj is not None:
            delta = mj - self.last_mj
            if delta < 0:  # a new origin: count nothing for this interval
                if not self.warned:
                    self.warned = True
                    logger.warning(
                        "%s: IOReport %s went back from %d to %d mJ; taken as a counter "
                        "restart (this interval counts 0 J)",
                        key,
                        self.name,
                        self.last_mj,
                        mj,
                    )
                delta = 0
            self.total_mj += delta
            dt_ns = t_ns - self.last_t_ns
            if dt_ns > 0:
                power = delta * 1e6 / dt_ns  # mJ/ns = 1e6 W
        self.last_mj = mj
        self.last_t_ns = t_ns
        return power


class _Reader:
    """One ``AppleEnergyMonitor`` (an IOReport subscription), used under a lock."""

    def __init__(self, source: Any, key: str) -> None:
        self.key = key
        self.lock = threading.Lock()
        self.closed = False
        try:
            self.monitor = source.AppleEnergyMonitor()
        except Exception as exc:
            raise DriverNotLoadedError(
                f"{key}: cannot subscribe to IOReport's Energy Model ({type(exc).__name__}: {exc})",
                device=key,
            ) from None

    def sample(self) -> Any:
        """``get_cumulative_energy()``; call under :attr:`lock`."""
        if self.closed:
            raise DeviceError(f"{self.key} (IOReport) is closed", device=self.key)
        try:
            return self.monitor.get_cumulative_energy()
        except Exception as exc:
            raise _map_error(exc, self.key, "reading IOReport") from None

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.monitor = None


def _mj(metrics: Any, name: str) -> int | None:
    value = getattr(metrics, name, None)
    return None if value is None else int(value)


class AppleGpu:
    """The GPU of an Apple Silicon chip; implements :class:`~zeus_async.devices.base.Device`.

    Fields: ``power_w`` (mean since the previous read, from the counter) and ``energy_j``
    ("GPU Energy" + "GPU SRAM", J since the first read). Thread-safe.

    Raises:
        DriverNotLoadedError: The IOReport subscription cannot be made.
        DeviceNotFoundError: The chip reports no GPU energy channel.
    """

    def __init__(self, source: Any, index: int = 0) -> None:
        self._index = index
        self._key = f"gpu:{index}"
        chip, host = _platform(source)
        self._reader = _Reader(source, self._key)
        first = self._reader.sample()
        if _mj(first, "gpu_mj") is None:
            self._reader.close()
            raise DeviceNotFoundError(
                f"{self._key}: IOReport's Energy Model has no GPU channel on this {chip}",
                device=self._key,
            )
        self._sram = _mj(first, "gpu_sram_mj") is not None
        self._counter = _Counter("GPU Energy" + (" + GPU SRAM" if self._sram else ""))
        self._info = DeviceInfo(
            key=self._key,
            name=_named(chip, "GPU"),
            uuid=f"APPLE-GPU-{host}" if host else "",
            arch=_arch(chip),
            has_energy_counter=True,
            index=0,
            vendor="apple",
            energy_method="counter",
            energy_note=APPLE_ENERGY_NOTE,
            capabilities=Capabilities(energy_counter=True),
            power_scope="gpu",
            energy_counter_period_s=APPLE_COUNTER_PERIOD_S,
        )
        logger.info(
            "%s: %s through IOReport (GPU Energy%s)",
            self._key,
            self._info.name,
            " + GPU SRAM" if self._sram else "; no GPU SRAM channel",
        )

    @property
    def key(self) -> str:
        return self._key

    @property
    def index(self) -> int:
        return self._index

    @property
    def fields(self) -> tuple[str, ...]:
        return ("power_w", "energy_j")

    def describe(self) -> DeviceInfo:
        return self._info

    def read(self, fields: Collection[str], host: str, t_ns: int) -> Sequence[Event]:
        """One :class:`GpuSample`; ``power_w``/``energy_j`` when asked for, else ``None``."""
        with self._reader.lock:
            metrics = self._reader.sample()
            gpu = _mj(metrics, "gpu_mj")
            if gpu is None:
                raise TransientDeviceError(
                    f"{self._key}: an IOReport sample without the GPU channel", device=self._key
                )
            sram = _mj(metrics, "gpu_sram_mj") if self._sram else 0
            power = self._counter.update(gpu + (sram or 0), t_ns, self._key)
            energy = self._counter.total_mj / 1000.0
        return [
            GpuSample(
                host,
                t_ns,
                self._index,
                power_w=power if "power_w" in fields else None,
                energy_j=energy if "energy_j" in fields else None,
            )
        ]

    def close(self) -> None:
        """Drop the IOReport subscription. Idempotent."""
        self._reader.close()

    def __repr__(self) -> str:
        return f"AppleGpu({self._key}, {self._info.name!r})"


class AppleCpu:
    """The CPU, DRAM and whole-SoC energy of an Apple Silicon chip, as RAPL-like domains
    (``package``, ``dram``, ``psys``: see the module docstring); implements
    :class:`~zeus_async.devices.base.Device`. Thread-safe.

    Raises:
        DriverNotLoadedError: The IOReport subscription cannot be made.
        DeviceNotFoundError: The chip reports no CPU energy channel.
    """

    def __init__(self, source: Any, package: int = 0) -> None:
        self._package = package
        self._key = f"cpu:{package}"
        chip, _ = _platform(source)
        self._reader = _Reader(source, self._key)
        first = self._reader.sample()
        if _mj(first, "cpu_total_mj") is None:
            self._reader.close()
            raise DeviceNotFoundError(
                f"{self._key}: IOReport's Energy Model has no CPU channel on this {chip}",
                device=self._key,
            )
        self._soc_fields = tuple(f for f in _SOC_FIELDS if _mj(first, f) is not None)
        domains: list[RaplDomain] = ["package"]
        if _mj(first, "dram_mj") is not None:
            domains.append("dram")
        domains.append("psys")
        self._domains: tuple[RaplDomain, ...] = tuple(domains)
        self._counters = {d: _Counter(d) for d in self._domains}
        self._info = DeviceInfo(
            key=self._key,
            name=_named(chip, "CPU (IOReport)"),
            arch="cpu",
            has_energy_counter=True,
            vendor="apple",
            energy_method="counter",
            energy_note=APPLE_ENERGY_NOTE,
            capabilities=Capabilities(energy_counter=True),
        )
        logger.info(
            "%s: %s, domains %s (psys = %s)",
            self._key,
            self._info.name,
            ", ".join(self._domains),
            " + ".join(self._soc_fields),
        )

    @property
    def key(self) -> str:
        return self._key

    @property
    def package(self) -> int:
        return self._package

    @property
    def fields(self) -> tuple[str, ...]:
        return self._domains

    def describe(self) -> DeviceInfo:
        return self._info

    def read_metrics(self) -> Any:
        """The library's ``AppleEnergyMetrics`` now (cumulative mJ per channel, ANE and the
        per-core and per-cluster figures included), for what the domains do not carry."""
        with self._reader.lock:
            return self._reader.sample()

    def read(self, fields: Collection[str], host: str, t_ns: int) -> Sequence[Event]:
        """One :class:`RaplSample` per requested domain this device has."""
        wanted = [d for d in self._domains if d in fields]
        with self._reader.lock:
            metrics = self._reader.sample()
            values: dict[RaplDomain, int | None] = {
                "package": _mj(metrics, "cpu_total_mj"),
                "dram": _mj(metrics, "dram_mj"),
            }
            parts = [_mj(metrics, f) for f in self._soc_fields]
            values["psys"] = None if None in parts else sum(p or 0 for p in parts)
            missing = [d for d in wanted if values.get(d) is None]
            if missing:
                raise TransientDeviceError(
                    f"{self._key}: an IOReport sample without {', '.join(missing)}",
                    device=self._key,
                )
            samples: list[Event] = []
            for domain in wanted:
                counter = self._counters[domain]
                value = values[domain]
                assert value is not None
                power = counter.update(value, t_ns, self._key)
                samples.append(
                    RaplSample(
                        host=host,
                        t_ns=t_ns,
                        package=self._package,
                        domain=domain,
                        energy_j=counter.total_mj / 1000.0,
                        power_w=power,
                    )
                )
        return samples

    def close(self) -> None:
        """Drop the IOReport subscription. Idempotent."""
        self._reader.close()

    def __repr__(self) -> str:
        return f"AppleCpu({self._key}, domains={self._domains})"


def open_apple_gpus(
    indices: Sequence[int] | None = None,
    *,
    source: Any = None,
    first_index: int = 0,
) -> list[AppleGpu]:
    """Open the chip's GPU (there is one).

    Args:
        indices: ``None`` or ``[0]`` (positions among this backend's GPUs).
        source: A module with ``zeus_apple_silicon``'s interface (default: import it; the
            simulator passes :mod:`zeus_async.testing.sim_ioreport`).
        first_index: The key of the GPU on a mixed node (``gpu:<first_index>``).

    Raises:
        DriverNotLoadedError: Not an Apple Silicon Mac, the package is missing, or the
            IOReport subscription fails.
        ConfigError: An index other than 0.
        DeviceNotFoundError: No GPU channel in the Energy Model.
    """
    wanted = [0] if indices is None else list(indices)
    bad = [i for i in wanted if i != 0]
    if bad or len(wanted) > 1:
        raise ConfigError(
            f"GPU index {bad[0] if bad else 0} repeated or out of range: an Apple Silicon chip "
            "has one GPU (index 0)"
        )
    src = source if source is not None else _import_source()
    if not wanted:
        return []
    return [AppleGpu(src, first_index)]


def open_apple_cpus(
    packages: Sequence[int] | None = None,
    *,
    source: Any = None,
) -> list[AppleCpu]:
    """Open the chip's CPU/DRAM/SoC counters as ``cpu:0`` (see :class:`AppleCpu`).

    Args:
        packages: ``None`` or ``[0]``; ``[]`` opens nothing.
        source: As for :func:`open_apple_gpus`.

    Raises:
        As :func:`open_apple_gpus`; ``ConfigError`` for a package other than 0.
    """
    wanted = [0] if packages is None else list(dict.fromkeys(packages))
    bad = [p for p in wanted if p != 0]
    if bad:
        raise ConfigError(f"no CPU package {bad[0]}: an Apple Silicon chip is package 0")
    if not wanted:
        return []
    src = source if source is not None else _import_source()
    return [AppleCpu(src, 0)]
