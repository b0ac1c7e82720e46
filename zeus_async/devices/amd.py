"""AMD Instinct GPUs through ``amdsmi`` (issue 37).

Only documented ``amdsmi`` calls are used, on whatever module ``import amdsmi`` resolves to (or
the module passed as ``amdsmi_module``), so the same code runs on an MI300X and on
:mod:`zeus_async.testing.sim_amdsmi` in CI.

What is read (:meth:`AmdGpu.read`):

* power from ``amdsmi_get_power_info``: ``current_socket_power`` (W, MI300 and later) as
  ``power_w``, else ``average_socket_power`` (W, older parts) as ``avg_power_w``; "N/A" means
  unsupported and is never asked again;
* energy from ``amdsmi_get_energy_count``: ``energy_accumulator`` x ``counter_resolution`` µJ.
  The counter is **checked at start** against integrated power (:data:`CHECK_S` of the
  node's time, for every GPU at once): a counter that is stuck or far off (ROCm/amdsmi#38, VM
  guests) is not used; windows then integrate power, and ``energy_note`` says why. A counter
  that goes backwards (ROCm/amdsmi#115) is never reported going backwards: the drop is taken as
  a discontinuity and ``energy_j`` continues from its last value;
* the power cap (``power_limit_w``) from ``amdsmi_get_power_info``'s ``power_limit``, whose
  units changed between amdsmi versions (W, then µW): they are found at open by comparing
  it with ``amdsmi_get_power_cap_info`` (µW in every version); set with ``amdsmi_set_power_cap``
  (µW);
* temperature (hotspot, °C), graphics activity, VRAM used, the graphics clock.

MI250-style dual-die parts: each die is a GPU to amd-smi, but only one of the two reports power
and energy, for both. A die that reports 0 W and a counter that does not move while its
neighbour reports power has no power or energy fields; both dies say so in ``energy_note``.

Indices: the GPUs are numbered as HIP (PyTorch's ``cuda:N``) numbers them, which on some nodes
(MI350X) differs from amd-smi's order: ``amdsmi_get_gpu_enumeration_info``'s ``hip_id`` maps
one to the other. ``ROCR_VISIBLE_DEVICES`` then ``HIP_VISIBLE_DEVICES`` (``CUDA_VISIBLE_DEVICES``
when that is unset) are honoured as HIP applies them. ``DeviceInfo.index`` is amd-smi's index.

libamd_smi is not thread-safe before ROCm 7.2 (library 26.2): there, every call of every GPU
goes through one lock.

Clocks cannot be locked through this backend (``capabilities.clocks`` is False:
``lock_sm_clocks_hz`` raises :class:`~zeus_async.errors.NotSupportedError`), nor are processes
listed (``per_process`` False).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import logging
import math
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, Final

from ..errors import (
    ConfigError,
    DeviceLostError,
    DriverNotLoadedError,
    NotSupportedError,
    TransientDeviceError,
    ZeusAsyncError,
)
from ..events import Capabilities, DeviceInfo, Event, GpuSample
from .base import GPU_FIELDS, Device, ErrorCodes, typed_error

__all__ = [
    "CHECK_S",
    "AmdGpu",
    "amd_present",
    "hip_visible",
    "map_amdsmi_error",
    "open_amd_gpus",
]

logger = logging.getLogger(__name__)

#: Seconds of the node's time the energy counter is compared with power at start.
#: How often the MI300's current energy counter updates (s): every 1 ms, as its socket power
#: does (``DeviceInfo.energy_counter_period_s``): read every 10 ms, each reading is exact at its
#: read time. (Older GPUs' counters are not described here.)
AMD_COUNTER_PERIOD_S: Final = 0.001
CHECK_S: Final = 0.1
#: Power readings over the check (one every ``CHECK_S / CHECK_STEPS`` s, the ends included),
#: integrated (trapezoid) into the energy the counter is compared with: a load that changes
#: inside the check (a square wave, a kernel starting) is followed, not taken from its ends.
CHECK_STEPS: Final = 20
#: A counter that fails is checked again, this many times in all, before it is given up
#: (a healthy one passes the first time; a stuck or scaled one fails every time).
CHECK_TRIES: Final = 2
#: The counter passes its check when it counted this fraction of integrated power.
CHECK_RANGE: Final = (0.5, 2.0)
#: The first library version that is thread-safe (ROCm 7.2).
THREAD_SAFE_VERSION: Final = (26, 2)

_NOT_SUPPORTED: Final = frozenset({2, 3, 48, 49, 55})
_PERMISSION: Final = frozenset({10})
_LOST: Final = frozenset({54})
_DRIVER: Final = frozenset({4, 5, 18, 32, 34, 45, 51, 52})
_ARGUMENT: Final = frozenset({1, 17, 53})
_NOT_FOUND: Final = frozenset({31})
_CODES: Final = ErrorCodes(_NOT_SUPPORTED, _PERMISSION, _LOST, _DRIVER, _ARGUMENT, _NOT_FOUND)

PRIVILEGE_HINT: Final = (
    "changing AMD GPU power caps needs root (or write access to the hwmon power1_cap files): "
    "run as root or let a privileged helper do it"
)


def map_amdsmi_error(exc: BaseException, device_key: str = "", action: str = "") -> ZeusAsyncError:
    """The zeus_async error for an ``AmdSmiLibraryException`` (or any exception with an int
    ``err_code``): ``NotSupportedError``, ``NoPermissionError``, ``DeviceLostError``,
    ``DriverNotLoadedError``, ``ConfigError``, ``DeviceNotFoundError``, else
    ``TransientDeviceError``."""
    code = getattr(exc, "err_code", None)
    code = code if isinstance(code, int) else None
    try:
        text = str(exc).replace("\n", " ").replace("\t", "")
    except Exception:
        text = type(exc).__name__
    return typed_error(
        "amdsmi",
        code,
        text,
        _CODES,
        device_key=device_key,
        action=action,
        privilege_hint=PRIVILEGE_HINT,
    )


def _import_amdsmi() -> ModuleType:
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints when libamd_smi is missing
            return importlib.import_module("amdsmi")
    except Exception as exc:  # ImportError, OSError (no library), AttributeError, KeyError
        raise DriverNotLoadedError(
            f"amdsmi is not importable: {exc} (it comes with ROCm, in /opt/rocm/share/amd_smi; "
            "without an AMD GPU, --backend sim-amd simulates one)"
        ) from None


def _thread_safe(smi: ModuleType) -> bool:
    """Whether the library may be called from several threads at once (26.2, ROCm 7.2, on)."""
    try:
        version = smi.amdsmi_get_lib_version()
        return (int(version["major"]), int(version["minor"])) >= THREAD_SAFE_VERSION
    except Exception as exc:  # unknown: serialise
        logger.debug("amdsmi_get_lib_version failed: %s", exc)
        return False


class _Session:
    """One ``amdsmi_init`` shared by the GPUs opened together, one lock where the library is
    not thread-safe; ``amdsmi_shut_down`` after the last GPU closes."""

    def __init__(self, smi: ModuleType) -> None:
        self.smi = smi
        self._refs = 0
        self._refs_lock = threading.Lock()
        self.lock: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        self.serialised = False

    def open(self) -> None:
        smi = self.smi
        try:
            smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
        except smi.AmdSmiException as exc:
            raise map_amdsmi_error(exc, action="initializing amdsmi") from None
        self._refs = 1
        if not _thread_safe(smi):
            self.lock = threading.Lock()
            self.serialised = True

    def acquire(self) -> None:
        with self._refs_lock:
            self._refs += 1

    def release(self) -> None:
        with self._refs_lock:
            self._refs -= 1
            if self._refs != 0:
                return
        try:
            with self.lock:
                self.smi.amdsmi_shut_down()
        except self.smi.AmdSmiException as exc:
            logger.debug("amdsmi_shut_down failed: %s", exc)


def _valid(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class AmdGpu:
    """One AMD GPU through amdsmi; a :class:`~zeus_async.devices.base.Device` and a
    :class:`~zeus_async.devices.base.GpuControl` (power caps; no clock locking).

    Args:
        smi: The amdsmi module in use.
        handle: Its processor handle.
        index: Key index (``gpu:<index>``: the HIP index after masking, plus ``first_index``).
        physical_index: amd-smi's index.
        hip_id: HIP's index of the GPU before masking.
        session: Shared initialisation and lock, released by :meth:`close`.
    """

    def __init__(
        self,
        smi: ModuleType,
        handle: Any,
        index: int,
        physical_index: int,
        hip_id: int,
        session: _Session,
    ) -> None:
        self._smi = smi
        self._handle = handle
        self._index = index
        self.physical_index = physical_index
        self.hip_id = hip_id
        self._key = f"gpu:{index}"
        self._session = session
        session.acquire()
        self._lock = session.lock
        self._closed = False
        self._unsupported: set[str] = set()
        self._power_key: str | None = None  # current_socket_power / average_socket_power
        self._limit_scale: float | None = None  # power_limit units -> W; None: use cap info
        self._energy_base = 0.0
        self._last_raw: float | None = None
        self._backwards = 0
        self.counter_ok = True
        self.note = ""
        self.dual_die_role = ""  # "", "primary" or "secondary"
        self._fields: tuple[str, ...] = ()
        self._name = str(
            self._call("reading the ASIC info", smi.amdsmi_get_gpu_asic_info)["market_name"]
        )
        self._uuid = str(self._call("reading the UUID", smi.amdsmi_get_gpu_device_uuid))
        self._caps = self._optional("reading the power cap", smi.amdsmi_get_power_cap_info)
        power = self._call("reading the power", smi.amdsmi_get_power_info)
        for key in ("current_socket_power", "average_socket_power"):
            if _valid(power.get(key)):
                self._power_key = key
                break
        self._power_field = (
            "power_w" if self._power_key == "current_socket_power" else "avg_power_w"
        )
        if self._power_key is None:
            self._unsupported.update(("power_w", "avg_power_w"))
        else:
            self._unsupported.add("avg_power_w" if self._power_field == "power_w" else "power_w")
        self._limit_scale = self._limit_units(power.get("power_limit"))
        self._getters: dict[str, Callable[[], Any]] = {
            "energy_j": self._read_energy,
            "temperature_c": self._read_temperature,
            "sm_clock_hz": self._read_sm_clock,
            "utilization_frac": self._read_utilization,
            "memory_used_bytes": self._read_memory_used,
        }
        if self._caps is None:
            self._unsupported.add("power_limit_w")
        for name, getter in self._getters.items():  # probe: learn what is supported
            try:
                getter()
            except NotSupportedError:
                self._unsupported.add(name)
            except ZeusAsyncError as exc:
                logger.debug("%s: probing %s failed: %s", self._key, name, exc)
        self._last_raw = None
        self._energy_base = 0.0
        self._update_fields()

    # -- calls --------------------------------------------------------------------------------

    def _call(self, action: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            with self._lock:
                return fn(self._handle, *args)
        except self._smi.AmdSmiLibraryException as exc:
            raise map_amdsmi_error(exc, self._key, action) from None

    def _optional(self, action: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return self._call(action, fn, *args)
        except (NotSupportedError, TransientDeviceError, ConfigError):
            return None

    def _limit_units(self, value: Any) -> float | None:
        """W per unit of ``power_info['power_limit']``: its units are found by comparing it
        with the cap in µW (``None``: not comparable; the cap info is read instead)."""
        if self._caps is None or not _valid(value) or not _valid(self._caps.get("power_cap")):
            return None
        cap_w = float(self._caps["power_cap"]) / 1e6
        for scale in (1.0, 1e-6, 1e-3):  # W, µW, mW
            if abs(float(value) * scale - cap_w) <= max(1.0, 0.01 * cap_w):
                return scale
        logger.info(
            "%s: power_limit %r matches no unit of the %g W cap: reading the cap info instead",
            self._key,
            value,
            cap_w,
        )
        return None

    def _update_fields(self) -> None:
        drop = set(self._unsupported)
        if not self.counter_ok:
            drop.add("energy_j")
        self._fields = tuple(f for f in GPU_FIELDS if f not in drop)

    # -- facts --------------------------------------------------------------------------------

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
        caps = self._caps
        has_counter = "energy_j" in self._fields
        has_power = self._power_key is not None and self.dual_die_role != "secondary"
        method = "counter" if has_counter else ("integrated-power" if has_power else "")
        return DeviceInfo(
            key=self._key,
            name=self._name,
            uuid=self._uuid,
            arch="cdna",
            has_energy_counter=has_counter,
            power_limit_min_w=None if caps is None else caps["min_power_cap"] / 1e6,
            power_limit_max_w=None if caps is None else caps["max_power_cap"] / 1e6,
            power_limit_default_w=None if caps is None else caps["default_power_cap"] / 1e6,
            supported_sm_clocks_hz=[],
            index=self.physical_index,
            vendor="amd",
            energy_method=method,
            energy_note=self.note,
            # MI300's current energy counter (and socket power) update every 1 ms.
            energy_counter_period_s=AMD_COUNTER_PERIOD_S,
            capabilities=Capabilities(
                energy_counter=has_counter,
                power_cap=caps is not None,
                clocks=False,
                per_process=False,
            ),
            power_scope="socket",
        )

    # -- start check --------------------------------------------------------------------------

    def _power_now(self) -> float | None:
        if self._power_key is None:
            return None
        value = self._call("reading the power", self._smi.amdsmi_get_power_info)[self._power_key]
        return float(value) if _valid(value) else None

    def _raw_energy_j(self) -> float:
        d = self._call("reading the energy counter", self._smi.amdsmi_get_energy_count)
        ticks = d["energy_accumulator"] if "energy_accumulator" in d else d["power"]  # < 6.2.1
        return float(ticks) * float(d["counter_resolution"]) / 1e6

    def _check_begin(self) -> float | None:
        """The counter (J) at the start of the check; ``None``: no counter to check."""
        if "energy_j" in self._unsupported:
            return None
        return self._raw_energy_j()

    def _check_end(self, e0: float, powers: Sequence[tuple[float, float]], last: bool) -> bool:
        """Judge the counter over the check: ``e0`` the counter at its start, ``powers`` the
        ``(seconds, W)`` readings across it (its ends included), read again now. Whether it
        passed; a failure is final only on the ``last`` try."""
        counted = self._raw_energy_j() - e0
        seconds = powers[-1][0] - powers[0][0] if len(powers) > 1 else 0.0
        expected = sum(
            (p0 + p1) / 2 * (t1 - t0) for (t0, p0), (t1, p1) in itertools.pairwise(powers)
        )
        if len(powers) < 2 or expected < 1e-3:
            if counted <= 0.0:  # no power and no energy: a die that reports nothing
                self.counter_ok = False
                self.note = "reports neither power nor energy"
            else:
                self.note = "no power reading to check the energy counter against"
            self._update_fields()
            return True
        ratio = counted / expected
        if CHECK_RANGE[0] <= ratio <= CHECK_RANGE[1]:
            self.counter_ok = True
            self.note = ""
            self._update_fields()
            return True
        if not last:
            logger.info(
                "%s: the energy counter counted %.3f J against %.3f J of integrated power "
                "(%.2fx): checking it again",
                self._key,
                counted,
                expected,
                ratio,
            )
            return False
        self.counter_ok = False
        self.note = (
            f"the energy counter failed its start check (it counted {counted:.3f} J over "
            f"{seconds:.3g} s against {expected:.3f} J of integrated power, {ratio:.2f}x; "
            "ROCm/amdsmi#38): integrated power"
        )
        logger.warning("%s (%s): %s", self._key, self._name, self.note)
        self._update_fields()
        return False

    # -- sampling -----------------------------------------------------------------------------

    def read(self, fields: Collection[str], host: str, t_ns: int) -> Sequence[Event]:
        """Read ``fields`` now; one :class:`GpuSample` (unsupported fields ``None``)."""
        out: dict[str, Any] = {}
        failure: ZeusAsyncError | None = None
        want_power = self._power_field in fields and self._power_field in self._fields
        want_limit = "power_limit_w" in fields and "power_limit_w" in self._fields
        if want_power or (want_limit and self._limit_scale is not None):
            try:
                info = self._call("reading the power", self._smi.amdsmi_get_power_info)
            except (DeviceLostError, DriverNotLoadedError):
                raise
            except ZeusAsyncError as exc:
                failure = exc
            else:
                if want_power:
                    assert self._power_key is not None
                    value = info.get(self._power_key)
                    if _valid(value):
                        out[self._power_field] = float(value)
                if want_limit and self._limit_scale is not None:
                    value = info.get("power_limit")
                    if _valid(value):
                        out["power_limit_w"] = float(value) * self._limit_scale
        if want_limit and self._limit_scale is None:
            try:
                out["power_limit_w"] = self.get_power_limit_w()
            except (DeviceLostError, DriverNotLoadedError):
                raise
            except ZeusAsyncError as exc:
                failure = exc
        for name, getter in self._getters.items():
            if name not in fields or name not in self._fields:
                continue
            try:
                out[name] = getter()
            except (DeviceLostError, DriverNotLoadedError):
                raise
            except NotSupportedError:
                self._unsupported.add(name)
                self._update_fields()
            except ZeusAsyncError as exc:
                failure = exc
        if failure is not None and not out:
            raise failure
        return [GpuSample(host, t_ns, self._index, **out)]

    def _read_energy(self) -> float:
        raw = self._raw_energy_j()
        last = self._last_raw
        if last is not None and raw < last:
            # ROCm/amdsmi#115: a counter that steps back. Energy never goes back: continue
            # from the last value (the drop is a discontinuity, not negative energy).
            self._energy_base += last - raw
            self._backwards += 1
            if self._backwards == 1:
                logger.warning(
                    "%s: the energy counter went back %.3f J; continuing from its last value",
                    self._key,
                    last - raw,
                )
        self._last_raw = raw
        return self._energy_base + raw

    @property
    def counter_steps_back(self) -> int:
        """How many times the energy counter was seen going backwards."""
        return self._backwards

    def _read_temperature(self) -> float:
        smi = self._smi
        return float(
            self._call(
                "reading the temperature",
                smi.amdsmi_get_temp_metric,
                smi.AmdSmiTemperatureType.HOTSPOT,
                smi.AmdSmiTemperatureMetric.CURRENT,
            )
        )

    def _read_sm_clock(self) -> float:
        smi = self._smi
        info = self._call("reading the clock", smi.amdsmi_get_clock_info, smi.AmdSmiClkType.GFX)
        if not _valid(info.get("clk")):
            raise NotSupportedError(f"{self._key}: no graphics clock", device=self._key)
        return float(info["clk"]) * 1e6

    def _read_utilization(self) -> float:
        value = self._call("reading the activity", self._smi.amdsmi_get_gpu_activity)[
            "gfx_activity"
        ]
        if not _valid(value):
            raise NotSupportedError(f"{self._key}: no graphics activity", device=self._key)
        return float(value) / 100.0

    def _read_memory_used(self) -> int:
        mb = self._call("reading VRAM use", self._smi.amdsmi_get_gpu_vram_usage)["vram_used"]
        return int(mb) << 20

    # -- control ------------------------------------------------------------------------------

    def get_power_limit_w(self) -> float:
        info = self._call("reading the power cap", self._smi.amdsmi_get_power_cap_info)
        return float(info["power_cap"]) / 1e6

    def power_limit_range_w(self) -> tuple[float, float]:
        if self._caps is None:
            raise NotSupportedError(f"{self._key} has no settable power cap", device=self._key)
        return self._caps["min_power_cap"] / 1e6, self._caps["max_power_cap"] / 1e6

    def set_power_limit_w(self, watts: float) -> None:
        """Set the power cap; ``ConfigError`` out of range, ``NoPermissionError`` unprivileged."""
        lo, hi = self.power_limit_range_w()
        if not (math.isfinite(watts) and lo <= watts <= hi):
            raise ConfigError(
                f"power cap {watts} W for {self._key} is outside the supported range "
                f"[{lo:g}, {hi:g}] W"
            )
        self._call("setting the power cap", self._smi.amdsmi_set_power_cap, 0, round(watts * 1e6))

    def supported_sm_clocks_hz(self) -> list[float]:
        return []

    def lock_sm_clocks_hz(self, min_hz: float, max_hz: float) -> None:
        raise NotSupportedError(
            f"{self._key}: clocks are not locked through the amd backend", device=self._key
        )

    def reset_sm_clocks(self) -> None:
        raise NotSupportedError(
            f"{self._key}: clocks are not locked through the amd backend", device=self._key
        )

    def close(self) -> None:
        """Release this GPU's share of the amdsmi session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._session.release()

    def __repr__(self) -> str:
        return f"AmdGpu({self._key}, amd-smi index {self.physical_index}, {self._name!r})"


# -- visibility -------------------------------------------------------------------------------


def _mask(value: str | None, ids: list[int], uuids: Mapping[int, str]) -> list[int]:
    """``ids`` (HIP ids, in order) as a ``*_VISIBLE_DEVICES`` value leaves them: positions or
    ``GPU-`` UUIDs, up to the first entry that names nothing (as HIP reads them)."""
    if value is None:
        return ids
    out: list[int] = []
    for token in (t.strip() for t in value.split(",")):
        if token.isdigit() and int(token) < len(ids):
            chosen = ids[int(token)]
        else:
            match = [i for i in ids if token and uuids.get(i, "").lower() == token.lower()]
            if not match:
                break
            chosen = match[0]
        if chosen in out:
            raise ConfigError(f"GPU {token} repeated in the visible devices {value!r}")
        out.append(chosen)
    return out


def hip_visible(
    hip_ids: Sequence[int], env: Mapping[str, str], uuids: Mapping[int, str] | None = None
) -> list[int]:
    """The HIP ids a process sees, in its own order (position = HIP index after masking):
    ``ROCR_VISIBLE_DEVICES`` first, then ``HIP_VISIBLE_DEVICES`` (or, unset,
    ``CUDA_VISIBLE_DEVICES``) among what ROCr left, as HIP applies them."""
    ids = sorted(hip_ids)
    uuid = uuids or {}
    ids = _mask(env.get("ROCR_VISIBLE_DEVICES"), ids, uuid)
    hip = env.get("HIP_VISIBLE_DEVICES")
    if hip is None:
        hip = env.get("CUDA_VISIBLE_DEVICES")
    return _mask(hip, ids, uuid)


# -- opening ----------------------------------------------------------------------------------


def _sleeper(smi: ModuleType) -> Callable[[float], None]:
    """How the start check waits: on the simulator's clock where the module is the simulator
    (a fake clock costs no real time), else for real."""
    import time

    fn = getattr(smi, "zeus_async_sleep", None)
    return fn if callable(fn) else time.sleep


def _timer(smi: ModuleType) -> Callable[[], float]:
    """The check's time (s): the simulator's clock where the module is the simulator, else
    the monotonic clock."""
    import time

    fn = getattr(smi, "zeus_async_monotonic", None)
    return fn if callable(fn) else time.monotonic


def _check_counters(gpus: list[AmdGpu], smi: ModuleType) -> None:
    """The start check of every GPU's counter over one shared wait of :data:`CHECK_S`: the
    counter's change against power read :data:`CHECK_STEPS` times across the wait and
    integrated; a counter that fails is checked again (:data:`CHECK_TRIES` in all)."""
    sleep, now = _sleeper(smi), _timer(smi)
    step = CHECK_S / CHECK_STEPS
    pending = list(gpus)
    for attempt in range(CHECK_TRIES):
        begins = [(g, g._check_begin()) for g in pending]
        checked = [(g, e0) for g, e0 in begins if e0 is not None]
        if not checked:
            return
        powers: dict[int, list[tuple[float, float]]] = {id(g): [] for g, _ in checked}

        start = now()
        for k in range(CHECK_STEPS + 1):
            wait = start + k * step - now()
            if k and wait > 0:
                sleep(wait)
            for gpu, _ in checked:
                p = gpu._power_now()
                if p is not None:
                    powers[id(gpu)].append((now(), p))
        last = attempt == CHECK_TRIES - 1
        pending = [g for g, e0 in checked if not g._check_end(e0, powers[id(g)], last)]
        if not pending:
            return


def _pair_dies(gpus: list[AmdGpu], every: Mapping[int, AmdGpu]) -> None:
    """Name the dies of MI250-style parts: a GPU that reports nothing next to one that reports
    power, both of a dual-die model."""
    for gpu in gpus:
        if gpu.note != "reports neither power nor energy":
            continue
        primary = every.get(gpu.physical_index - 1) if gpu.physical_index % 2 else None
        gpu._unsupported.update(("power_w", "avg_power_w", "energy_j"))
        gpu._update_fields()
        if primary is not None and "MI250" in gpu.describe().name:
            gpu.dual_die_role, primary.dual_die_role = "secondary", "primary"
            gpu.note = (
                f"second die of a dual-die part: its power and energy are reported by "
                f"{primary.key} (both dies together)"
            )
            extra = f"both dies together ({primary.key} and {gpu.key})"
            primary.note = f"{primary.note}; {extra}" if primary.note else extra
            logger.warning("%s: %s", gpu.key, gpu.note)


def open_amd_gpus(
    indices: Sequence[int] | None = None,
    *,
    amdsmi_module: ModuleType | None = None,
    env: Mapping[str, str] | None = None,
    first_index: int = 0,
) -> list[Device]:
    """Open AMD GPUs through amdsmi, numbered as HIP numbers them.

    Args:
        indices: HIP indices after ``ROCR_VISIBLE_DEVICES``/``HIP_VISIBLE_DEVICES`` masking
            (PyTorch's ``cuda:N``); ``None`` = all visible.
        amdsmi_module: The amdsmi module to use (default: ``import amdsmi`` now).
        env: Environment with the visibility variables (default ``os.environ``).
        first_index: Key index of the first GPU (``gpu:<first_index + i>``) on a mixed node.

    Raises:
        DriverNotLoadedError: No amdsmi library or driver.
        ConfigError: An index out of range or repeated.
        DeviceError: A GPU failed while opening.
    """
    smi = amdsmi_module if amdsmi_module is not None else _import_amdsmi()
    environ = os.environ if env is None else env
    session = _Session(smi)
    session.open()
    opened: list[AmdGpu] = []
    try:
        try:
            with session.lock:
                handles = list(smi.amdsmi_get_processor_handles())
                enum = [smi.amdsmi_get_gpu_enumeration_info(h) for h in handles]
        except smi.AmdSmiLibraryException as exc:
            raise map_amdsmi_error(exc, action="listing GPUs") from None
        by_hip = {int(e["hip_id"]): i for i, e in enumerate(enum)}
        if len(by_hip) != len(handles):  # no usable HIP ids: amd-smi's order
            by_hip = {i: i for i in range(len(handles))}
        uuids = {hip: str(enum[i].get("hip_uuid", "")) for hip, i in by_hip.items()}
        visible = hip_visible(list(by_hip), environ, uuids)
        wanted = list(range(len(visible))) if indices is None else list(indices)
        if len(set(wanted)) != len(wanted):
            raise ConfigError(f"GPU indices repeated: {wanted}")
        for i in wanted:
            if not 0 <= i < len(visible):
                raise ConfigError(
                    f"GPU index {i} out of range: {len(visible)} visible AMD GPU(s) (HIP ids "
                    f"{visible}; ROCR/HIP/CUDA_VISIBLE_DEVICES apply)"
                )
        # Every visible GPU is opened for the start check (a die's neighbour is needed to
        # recognise a dual-die part); those not asked for are closed after it.
        every: dict[int, AmdGpu] = {}
        for pos, hip in enumerate(visible):
            physical = by_hip[hip]
            every[physical] = AmdGpu(
                smi, handles[physical], first_index + pos, physical, hip, session
            )
            opened.append(every[physical])
        _check_counters(opened, smi)
        _pair_dies(opened, every)
        keep = [opened[i] for i in wanted]
        for gpu in opened:
            if gpu not in keep:
                gpu.close()
    except BaseException:
        for gpu in opened:
            gpu.close()
        raise
    finally:
        session.release()
    logger.info(
        "opened %d AMD GPU(s) through amdsmi%s: %s",
        len(keep),
        " (calls serialised: library not thread-safe)" if session.serialised else "",
        [g.describe().name for g in keep],
    )
    return list(keep)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def amd_present() -> bool:
    """Whether this machine has AMD GPUs that ``amdsmi`` answers for (a cheap look at the
    driver's files first: without ``/dev/kfd`` amdsmi is not even imported)."""
    if not os.path.exists("/dev/kfd"):
        return False
    try:
        with _quiet():
            smi = importlib.import_module("amdsmi")
            smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except Exception as exc:
        logger.debug("amdsmi unavailable: %s", exc)
        return False
    try:
        return len(smi.amdsmi_get_processor_handles()) > 0
    except Exception as exc:
        logger.debug("amdsmi lists no GPU: %s", exc)
        return False
    finally:
        with contextlib.suppress(Exception):
            smi.amdsmi_shut_down()
