"""NVIDIA Jetson GPUs: power from the INA3221 rail monitors in sysfs (issue 37).

A Jetson module has no NVML and no energy counter: its INA3221 chips (three channels each)
measure the bus voltage and current of a few supply rails, which the kernel exposes in one of
two layouts::

    legacy (NVIDIA's ina3221x IIO driver, JetPack 4 / L4T 32: Nano, TX2, Xavier)
        /sys/bus/i2c/drivers/ina3221x/<bus>-<addr>/iio:device<K>/
            rail_name_<N>            "GPU", "VDD_SYS_GPU", "POM_5V_GPU", ...
            in_power<N>_input        mW
            in_voltage<N>_input      mV (bus)
            in_current<N>_input      mA

    hwmon (the mainline ina3221 driver, JetPack 5 and later: Orin, Xavier on L4T 35)
        /sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon<K>/
            in<N>_label              "VDD_GPU_SOC", "VDD_IN", "NC" (not connected), ...
            in<N>_input              mV (bus)
            curr<N>_input            mA
            in<N>_enable             0 for a channel switched off (optional)

Both are searched; a rail is known by its label, never by its channel number. Power is
``in_power<N>_input`` where the legacy driver gives it, else bus voltage x current (the
mainline driver computes no power; an ``hwmon`` ``power<N>_input`` would be µW by the hwmon ABI
and is not relied on).

What a device reports (one GPU per module, key ``gpu:<first_index>``):

* ``power_w``: the rails of its *power scope* (``power_scope=``, or the environment variable
  ``ZEUS_ASYNC_JETSON_SCOPE``): ``gpu`` (default) is the GPU rail (:data:`GPU_RAILS`:
  ``VDD_GPU_SOC`` on Orin, which also feeds the SoC; ``GPU`` on Xavier; ``VDD_SYS_GPU`` on
  TX2; ``POM_5V_GPU`` on Nano; ``VDD_CPU_GPU_CV`` on Orin NX/Nano, shared with the CPU and
  the vision accelerators), ``module`` the module's total input rail (:data:`INPUT_RAILS`:
  ``VDD_IN``, ``POM_5V_IN``) or, on modules without one (AGX Orin, AGX Xavier), the sum of
  every connected rail, which leaves out the regulators' losses. ``rail=`` (or
  ``ZEUS_ASYNC_JETSON_RAIL``) names the GPU rail where its label is none of the known ones.
  :attr:`~zeus_async.events.DeviceInfo.energy_note` says which rails were read.
* no ``energy_j``: the INA3221 has no energy accumulator, so windows integrate ``power_w``
  (``energy_method="integrated-power"``, with its error bound, as NVML GPUs without a counter).
* ``utilization_frac`` (``/sys/devices/gpu.0/load``, per mille), ``sm_clock_hz`` (the GPU's
  devfreq ``cur_freq``) and ``temperature_c`` (the ``GPU-therm`` thermal zone) where sysfs has
  them.
* no power cap (the module's power budget is an ``nvpmodel`` mode, which needs root, changes
  CPU and memory clocks too, and is out of scope), no clock locking, no per-process use.

Every file access goes through a small filesystem protocol (:class:`SysFs`: read a text file,
list a directory, test a path), served by :class:`RealSysFs` (the real sysfs, or a static tree
under ``root`` for tests) or by the simulator's virtual tree
(:mod:`zeus_async.testing.sim_jetson`), so the same code runs on both.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, Protocol, runtime_checkable

from ..errors import (
    ConfigError,
    DeviceError,
    DeviceLostError,
    DeviceNotFoundError,
    NoPermissionError,
    TransientDeviceError,
)
from ..events import Capabilities, DeviceInfo, Event, GpuSample
from .base import Device

__all__ = [
    "DRIVER_DIRS",
    "GPU_RAILS",
    "INPUT_RAILS",
    "JetsonGpu",
    "Rail",
    "RealSysFs",
    "SysFs",
    "find_rails",
    "jetson_present",
    "open_jetson_gpus",
]

logger = logging.getLogger(__name__)

#: Where each INA3221 driver lists its chips: NVIDIA's IIO driver, then the mainline hwmon one.
DRIVER_DIRS: Final = ("/sys/bus/i2c/drivers/ina3221x", "/sys/bus/i2c/drivers/ina3221")
#: GPU rail labels, most specific first.
GPU_RAILS: Final = (
    "VDD_GPU_SOC",
    "VDD_GPU",
    "GPU",
    "VDD_SYS_GPU",
    "POM_5V_GPU",
    "VDD_CPU_GPU_CV",
)
#: Labels of a rail carrying the module's whole input.
INPUT_RAILS: Final = ("VDD_IN", "POM_5V_IN")
#: Labels of channels that measure nothing.
_UNCONNECTED: Final = frozenset({"NC", "N/C", ""})
SCOPE_ENV_VAR: Final = "ZEUS_ASYNC_JETSON_SCOPE"
RAIL_ENV_VAR: Final = "ZEUS_ASYNC_JETSON_RAIL"
PowerScope = Literal["gpu", "module"]
_SCOPES: Final = ("gpu", "module", "auto")

_TEGRA_MARKERS: Final = ("/etc/nv_tegra_release", "/sys/module/tegra_fuse")
_LOAD_FILES: Final = ("/sys/devices/gpu.0/load", "/sys/devices/platform/gpu.0/load")
_DEVFREQ_DIR: Final = "/sys/class/devfreq"
_DEVFREQ_GPU: Final = re.compile(r"gpu|ga10b|gv11b|gp10b|gm20b", re.IGNORECASE)
_THERMAL_DIR: Final = "/sys/class/thermal"
_GPU_THERMAL: Final = frozenset({"gpu-therm", "gpu-thermal"})
_CHIP_DIR: Final = re.compile(r"^\d+-[0-9a-fA-F]{4}$")
_LEGACY_RAIL: Final = re.compile(r"^rail_name_(\d+)$")
_HWMON_LABEL: Final = re.compile(r"^in(\d+)_label$")


@runtime_checkable
class SysFs(Protocol):
    """The few filesystem operations the backend needs; paths are absolute (``/sys/...``).

    ``read_text`` and ``listdir`` raise :class:`OSError` as the real filesystem does
    (``FileNotFoundError``, ``PermissionError``, ``EIO``...).
    """

    def read_text(self, path: str) -> str: ...

    def listdir(self, path: str) -> list[str]: ...

    def exists(self, path: str) -> bool: ...


class RealSysFs:
    """The real filesystem, or a tree under ``root`` standing for ``/`` (tests)."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else Path("/")

    def _path(self, path: str) -> str:
        return str(self.root / path.lstrip("/"))

    def read_text(self, path: str) -> str:
        # sysfs attributes are regenerated on each open+read; at most a page.
        with open(self._path(path), "rb", buffering=0) as f:
            return f.read(4096).decode("ascii", "replace")

    def listdir(self, path: str) -> list[str]:
        return os.listdir(self._path(path))

    def exists(self, path: str) -> bool:
        return os.path.exists(self._path(path))

    def __repr__(self) -> str:
        return f"RealSysFs({str(self.root)!r})"


def _os_error(exc: OSError, path: str, device: str) -> DeviceError:
    """The :class:`DeviceError` for an ``OSError`` raised on an INA3221 file."""
    detail = f"{path}: {exc.strerror or exc}"
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM):
        return NoPermissionError(
            f"permission denied reading {detail}; the INA3221 rails are world-readable on "
            "stock JetPack: check the file's mode and any container's /sys mount",
            device=device,
            code=exc.errno,
        )
    if exc.errno in (errno.ENOENT, errno.ENODEV, errno.ENXIO):
        return DeviceLostError(
            f"INA3221 rail file disappeared ({detail}); was the driver unbound?",
            device=device,
            code=exc.errno,
        )
    if exc.errno in (errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.EIO, errno.ETIMEDOUT):
        return TransientDeviceError(f"reading {detail}", device=device, code=exc.errno)
    return DeviceError(f"reading {detail}", device=device, code=exc.errno)


def _read_int(fs: SysFs, path: str, device: str) -> int:
    """An integer sysfs attribute; a malformed one is a :class:`DeviceError`."""
    try:
        text = fs.read_text(path)
    except OSError as exc:
        raise _os_error(exc, path, device) from None
    value = text.strip()
    try:
        return int(value)
    except ValueError:
        raise DeviceError(
            f"malformed value in {path}: expected an integer, got {value[:32]!r}", device=device
        ) from None


@dataclass(frozen=True)
class Rail:
    """One INA3221 channel, found by its label.

    Attributes:
        name: Its label (``VDD_GPU_SOC``).
        layout: ``legacy`` (``ina3221x`` IIO) or ``hwmon`` (mainline ``ina3221``).
        directory: The directory holding its files.
        channel: Its channel number in that directory's file names.
        power_file: The file giving mW directly (legacy), or ``None``: voltage x current.
        voltage_file: Bus voltage (mV).
        current_file: Current (mA).
    """

    name: str
    layout: Literal["legacy", "hwmon"]
    directory: str
    channel: int
    power_file: str | None
    voltage_file: str
    current_file: str

    def read_w(self, fs: SysFs, device: str = "") -> float:
        """The rail's power now, in watts."""
        if self.power_file is not None:
            return _read_int(fs, self.power_file, device) / 1000.0
        mv = _read_int(fs, self.voltage_file, device)
        ma = _read_int(fs, self.current_file, device)
        return mv * ma / 1e6

    def describe(self) -> str:
        how = "in_power (mW)" if self.power_file is not None else "V x I"
        return f"{self.name} ({self.layout} {self.directory}, channel {self.channel}, {how})"


def _listdir(fs: SysFs, path: str) -> list[str]:
    try:
        return sorted(fs.listdir(path))
    except OSError:
        return []


def _read_label(fs: SysFs, path: str) -> str | None:
    try:
        return fs.read_text(path).strip()
    except OSError as exc:
        logger.debug("cannot read %s: %s", path, exc)
        return None


def _legacy_rails(fs: SysFs, directory: str) -> list[Rail]:
    rails: list[Rail] = []
    for entry in _listdir(fs, directory):
        match = _LEGACY_RAIL.match(entry)
        if match is None:
            continue
        n = int(match.group(1))
        label = _read_label(fs, f"{directory}/{entry}")
        if label is None or label.upper() in _UNCONNECTED:
            continue
        power = f"{directory}/in_power{n}_input"
        voltage = f"{directory}/in_voltage{n}_input"
        current = f"{directory}/in_current{n}_input"
        has_power = fs.exists(power)
        if not has_power and not (fs.exists(voltage) and fs.exists(current)):
            logger.debug("legacy rail %s in %s has no power nor V/I files", label, directory)
            continue
        rails.append(
            Rail(label, "legacy", directory, n, power if has_power else None, voltage, current)
        )
    return rails


def _hwmon_rails(fs: SysFs, directory: str) -> list[Rail]:
    rails: list[Rail] = []
    for entry in _listdir(fs, directory):
        match = _HWMON_LABEL.match(entry)
        if match is None:
            continue
        n = int(match.group(1))
        label = _read_label(fs, f"{directory}/{entry}")
        if label is None or label.upper() in _UNCONNECTED:
            continue
        voltage = f"{directory}/in{n}_input"
        current = f"{directory}/curr{n}_input"
        if not (fs.exists(voltage) and fs.exists(current)):
            continue  # the shunt-voltage and sum channels have no bus voltage/current pair
        enable = f"{directory}/in{n}_enable"
        if fs.exists(enable) and _read_label(fs, enable) == "0":
            logger.debug("rail %s in %s is disabled (in%d_enable = 0)", label, directory, n)
            continue
        rails.append(Rail(label, "hwmon", directory, n, None, voltage, current))
    return rails


def find_rails(fs: SysFs) -> list[Rail]:
    """Every connected INA3221 rail, in both layouts (chips in bus/address order)."""
    rails: list[Rail] = []
    for driver in DRIVER_DIRS:
        for chip in _listdir(fs, driver):
            if not _CHIP_DIR.match(chip):
                continue  # bind, unbind, uevent, module, new_id...
            base = f"{driver}/{chip}"
            for entry in _listdir(fs, base):
                if entry.startswith("iio:device"):
                    rails.extend(_legacy_rails(fs, f"{base}/{entry}"))
            for entry in _listdir(fs, f"{base}/hwmon"):
                if entry.startswith("hwmon"):
                    rails.extend(_hwmon_rails(fs, f"{base}/hwmon/{entry}"))
    return rails


def _rails_message(rails: Sequence[Rail]) -> str:
    names = ", ".join(r.name for r in rails) or "none"
    return f"rails found: {names}"


def _gpu_rail(rails: Sequence[Rail], wanted: str | None, device: str) -> Rail:
    """The GPU rail: the one named ``wanted``, else the first of :data:`GPU_RAILS`."""
    by_name = {r.name.upper(): r for r in rails}
    if wanted:
        rail = by_name.get(wanted.upper())
        if rail is None:
            raise DeviceNotFoundError(
                f"no INA3221 rail named {wanted!r} ({RAIL_ENV_VAR} or rail=); "
                f"{_rails_message(rails)}",
                device=device,
            )
        return rail
    for name in GPU_RAILS:
        rail = by_name.get(name)
        if rail is not None:
            return rail
    raise DeviceNotFoundError(
        f"no GPU rail among the INA3221 rails (looked for {', '.join(GPU_RAILS)}); "
        f"{_rails_message(rails)}. Name the rail that feeds the GPU with rail= or "
        f"{RAIL_ENV_VAR}=<label>",
        device=device,
    )


def _module_rails(rails: Sequence[Rail]) -> tuple[list[Rail], str]:
    """The rails of the module scope and the note saying what they are."""
    by_name = {r.name.upper(): r for r in rails}
    for name in INPUT_RAILS:
        rail = by_name.get(name)
        if rail is not None:
            return [rail], f"module scope: the input rail {rail.name}"
    names = " + ".join(r.name for r in rails)
    return list(rails), (
        f"module scope: the sum of every rail ({names}); this module has no input rail, so "
        "regulator losses are left out"
    )


def _scope(power_scope: str | None, env: Mapping[str, str]) -> PowerScope:
    value = power_scope if power_scope is not None else env.get(SCOPE_ENV_VAR) or "gpu"
    if value not in _SCOPES:
        raise ConfigError(
            f"unknown Jetson power scope {value!r}; choose one of {', '.join(_SCOPES)}"
        )
    return "module" if value == "module" else "gpu"  # auto: the GPU rail, always there


def _find_devfreq(fs: SysFs) -> str | None:
    for entry in _listdir(fs, _DEVFREQ_DIR):
        if _DEVFREQ_GPU.search(entry) and fs.exists(f"{_DEVFREQ_DIR}/{entry}/cur_freq"):
            return f"{_DEVFREQ_DIR}/{entry}/cur_freq"
    return None


def _find_thermal(fs: SysFs) -> str | None:
    for entry in _listdir(fs, _THERMAL_DIR):
        if not entry.startswith("thermal_zone"):
            continue
        kind = _read_label(fs, f"{_THERMAL_DIR}/{entry}/type")
        if kind is not None and kind.lower() in _GPU_THERMAL:
            return f"{_THERMAL_DIR}/{entry}/temp"
    return None


def _model(fs: SysFs) -> str:
    """The module's name from the device tree (``NVIDIA Jetson AGX Orin ...``)."""
    for path in ("/proc/device-tree/model", "/sys/firmware/devicetree/base/model"):
        text = _read_label(fs, path) if fs.exists(path) else None
        if text:
            return text.rstrip("\x00").strip()
    return "NVIDIA Jetson"


def _serial(fs: SysFs) -> str | None:
    """The module's serial number from the device tree, if readable."""
    path = "/sys/firmware/devicetree/base/serial-number"
    text = _read_label(fs, path) if fs.exists(path) else None
    return text.rstrip("\x00").strip() or None if text else None


class JetsonGpu:
    """A Jetson module's GPU; implements :class:`~zeus_async.devices.base.Device`.

    Args:
        fs: Where sysfs is read.
        rails: The rails summed into ``power_w`` (the GPU rail, or the module's).
        scope: ``gpu`` or ``module``.
        note: What the rails are, for :attr:`DeviceInfo.energy_note`.
        index: Its logical index (``gpu:<index>``).
    """

    def __init__(
        self,
        fs: SysFs,
        rails: Sequence[Rail],
        scope: PowerScope,
        note: str,
        index: int = 0,
    ) -> None:
        self._fs = fs
        self._rails = tuple(rails)
        self._scope = scope
        self._index = index
        self._key = f"gpu:{index}"
        self._closed = False
        self._load_file = next((p for p in _LOAD_FILES if fs.exists(p)), None)
        self._freq_file = _find_devfreq(fs)
        self._temp_file = _find_thermal(fs)
        self._optional: dict[str, str | None] = {
            "utilization_frac": self._load_file,
            "sm_clock_hz": self._freq_file,
            "temperature_c": self._temp_file,
        }
        self._fields: tuple[str, ...] = (
            "power_w",
            *(
                name
                for name in ("temperature_c", "sm_clock_hz", "utilization_frac")
                if self._optional[name] is not None
            ),
        )
        name = _model(fs)
        self._info = DeviceInfo(
            key=self._key,
            name=name,
            uuid=f"JETSON-{_serial(fs) or 'unknown'}",
            arch="unknown",
            has_energy_counter=False,
            supported_sm_clocks_hz=[],
            index=0,
            vendor="nvidia-jetson",
            energy_method="integrated-power",
            energy_note=f"INA3221 power rails, integrated (no energy counter); {note}",
            capabilities=Capabilities(
                energy_counter=False, power_cap=False, clocks=False, per_process=False
            ),
            power_scope=scope,
            # A reading is the mean power over the INA3221's last completed conversion cycle
            # (6.6 ms with the mainline driver's defaults), refreshed once a cycle: it
            # describes power up to two cycles before it is read.
            power_reading_lag_s=2 * 0.0066,
            power_reading_window_s=0.0066,
        )
        self.read_power_w()  # fails now, with the file named, rather than at the first tick
        logger.info("%s (%s): power_w from %s", self._key, name, note)

    @property
    def key(self) -> str:
        return self._key

    @property
    def index(self) -> int:
        return self._index

    @property
    def fields(self) -> tuple[str, ...]:
        return self._fields

    @property
    def rails(self) -> tuple[Rail, ...]:
        """The rails summed into ``power_w``."""
        return self._rails

    @property
    def power_scope(self) -> PowerScope:
        return self._scope

    def describe(self) -> DeviceInfo:
        return self._info

    def read_power_w(self) -> float:
        """The power of this device's scope now (W)."""
        return sum(rail.read_w(self._fs, self._key) for rail in self._rails)

    def _read_optional(self, name: str) -> float | None:
        path = self._optional.get(name)
        if path is None:
            return None
        try:
            raw = _read_int(self._fs, path, self._key)
        except DeviceError as exc:
            logger.debug("%s", exc)
            return None
        if name == "utilization_frac":
            return min(max(raw / 1000.0, 0.0), 1.0)
        if name == "temperature_c":
            return raw / 1000.0
        return float(raw)  # devfreq cur_freq is in Hz

    def read(self, fields: Collection[str], host: str, t_ns: int) -> Sequence[Event]:
        """One :class:`GpuSample`: ``power_w`` (a rail that cannot be read raises the mapped
        error) and the optional fields asked for (``None`` when their file fails)."""
        out: dict[str, Any] = {}
        if "power_w" in fields:
            out["power_w"] = self.read_power_w()
        for name in ("temperature_c", "sm_clock_hz", "utilization_frac"):
            if name in fields and self._optional[name] is not None:
                out[name] = self._read_optional(name)
        return [GpuSample(host, t_ns, self._index, **out)]

    def close(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"JetsonGpu({self._key}, {self._scope}: {', '.join(r.name for r in self._rails)})"


def jetson_present(root: str | Path | None = None) -> bool:
    """Whether this machine is a Jetson (a Tegra marker) with INA3221 rails in sysfs; cheap
    (a few ``stat``/``listdir`` calls), never raises."""
    try:
        fs = RealSysFs(root)
        if not any(fs.exists(p) for p in _TEGRA_MARKERS):
            return False
        return any(_CHIP_DIR.match(c) for d in DRIVER_DIRS for c in _listdir(fs, d))
    except Exception as exc:  # a probe must never fail the caller
        logger.debug("probing for Jetson rails failed: %s", exc)
        return False


def open_jetson_gpus(
    indices: Sequence[int] | None = None,
    *,
    root: str | Path | None = None,
    fs: Any = None,
    first_index: int = 0,
    power_scope: str | None = None,
    rail: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Device]:
    """Open the Jetson module's GPU (there is one).

    Args:
        indices: ``None`` or ``[first_index]`` (positions on a mixed node).
        root: A directory standing for ``/`` (a static test tree); default the real one.
        fs: A :class:`SysFs` to read instead (the simulator's virtual tree).
        first_index: The GPU's key on a mixed node (``gpu:<first_index>``).
        power_scope: ``gpu`` (the GPU rail), ``module`` (the input rail, else every rail) or
            ``auto`` (``gpu``: every module has a GPU rail; the name NVML's scopes share);
            ``None``: ``$ZEUS_ASYNC_JETSON_SCOPE``, else ``gpu``.
        rail: The GPU rail's label where it is none of :data:`GPU_RAILS`; default
            ``$ZEUS_ASYNC_JETSON_RAIL``.
        env: Environment for those two variables (default ``os.environ``).

    Raises:
        DriverNotLoadedError: No INA3221 rail in either layout.
        DeviceNotFoundError: No GPU rail (or none named ``rail``): the message lists the rails.
        ConfigError: A bad index or scope.
        DeviceError: A rail file cannot be read (``NoPermissionError``, ...).
    """
    from ..errors import DriverNotLoadedError

    environ = os.environ if env is None else env
    scope = _scope(power_scope, environ)
    sysfs: SysFs = fs if fs is not None else RealSysFs(root)
    key = f"gpu:{first_index}"
    if indices is not None:
        bad = [i for i in indices if i != first_index]
        if bad or len(indices) > 1:
            raise ConfigError(
                f"no GPU {bad[0] if bad else indices[0]} on this Jetson: it has one GPU "
                f"(index {first_index})"
            )
        if not indices:
            return []
    rails = find_rails(sysfs)
    if not rails:
        raise DriverNotLoadedError(
            "no INA3221 power rails in sysfs (looked under "
            f"{DRIVER_DIRS[0]}/*/iio:device*/ and {DRIVER_DIRS[1]}/*/hwmon/hwmon*/); is this "
            "a Jetson, and is /sys mounted (containers: --runtime nvidia or -v /sys:/sys:ro)?",
            device=key,
        )
    gpu = _gpu_rail(rails, rail or environ.get(RAIL_ENV_VAR), key)
    if scope == "gpu":
        chosen, note = [gpu], f"gpu scope: the rail {gpu.name}"
    else:
        chosen, note = _module_rails(rails)
    logger.debug("Jetson rails: %s", "; ".join(r.describe() for r in rails))
    return [JetsonGpu(sysfs, chosen, scope, note, first_index)]
