"""Configuration of the GPU simulator: :class:`SimConfig`, JSON-serializable.

A configuration travels to other processes as JSON in the ``ZEUS_ASYNC_SIM`` environment variable
(or as the path of a JSON file), so every process of a job can simulate the same node.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Final, Literal

import msgspec

from ..errors import ConfigError
from .sim_workload import IdleWorkload, Workload

__all__ = [
    "ARCH_CODES",
    "COMPUTE_CAPABILITY",
    "SIM_ENV_VAR",
    "ArchName",
    "Feature",
    "GpuOverride",
    "PowerReading",
    "SimConfig",
    "load_sim_config",
]

logger = logging.getLogger(__name__)

#: Environment variable holding a :class:`SimConfig` as JSON, or a path to a JSON file.
SIM_ENV_VAR: Final = "ZEUS_ASYNC_SIM"


ArchName = Literal[
    "kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell"
]
#: NVML architecture codes (``NVML_DEVICE_ARCH_*``).
ARCH_CODES: Final[dict[str, int]] = {
    "kepler": 2,
    "maxwell": 3,
    "pascal": 4,
    "volta": 5,
    "turing": 6,
    "ampere": 7,
    "ada": 8,
    "hopper": 9,
    "blackwell": 10,
}
COMPUTE_CAPABILITY: Final[dict[str, tuple[int, int]]] = {
    "kepler": (3, 5),
    "maxwell": (5, 2),
    "pascal": (6, 0),
    "volta": (7, 0),
    "turing": (7, 5),
    "ampere": (8, 0),
    "ada": (8, 9),
    "hopper": (9, 0),
    "blackwell": (10, 0),
}

#: Features a simulated GPU can be told not to support (the NVML call answers NOT_SUPPORTED).
Feature = Literal[
    "instant_power",
    "average_power",
    "memory_power",
    "power_usage",
    "energy",
    "temperature",
    "clocks",
    "utilization",
    "memory",
    "processes",
    "power_limit",
    "locked_clocks",
    "persistence",
    "field_values",
    "architecture",
]

#: What a simulated GPU's power readings report (:attr:`SimConfig.power_reading`).
PowerReading = Literal["average_1s", "instant", "average_only"]
#: The first driver branch whose NVML knows the power field ids (``NVML_FI_DEV_POWER_AVERAGE``
#: 185 to ``NVML_FI_DEV_POWER_CURRENT_LIMIT`` 190): older drivers answer NOT_SUPPORTED.
POWER_FIELDS_DRIVER = 535

PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Frac = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


#: The vendors the simulator serves, each beneath its own API: ``nvidia`` (``pynvml``),
#: ``amd`` (``amdsmi``), ``jetson`` (INA3221 sysfs rails), ``apple`` (IOReport).
Vendor = Literal["nvidia", "amd", "jetson", "apple"]


class AmdSim(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What the simulated ``amdsmi`` reports beyond the physical model (``vendor="amd"``)."""


class JetsonSim(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What the simulated Jetson INA3221 sysfs tree holds (``vendor="jetson"``)."""


class AppleSim(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What the simulated IOReport energy channels report (``vendor="apple"``)."""


class GraceSim(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A Grace superchip (GH200, GB200) beneath ``pynvml``: NVML answers the MODULE power
    scope (GPU + CPU + memory) besides the GPU one."""


class GpuOverride(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Per-GPU deviations from :class:`SimConfig` (``None`` = inherit).

    Attributes:
        pre_volta: Pascal GPU without an energy counter (``arch`` defaults to ``"pascal"``).
        unsupported: Features whose NVML calls answer ``NVML_ERROR_NOT_SUPPORTED``.
        lost_at_s: From ``epoch + lost_at_s`` on, every call on this GPU raises GPU_IS_LOST.
        no_permission: Set calls (limit, clocks, persistence) raise NO_PERMISSION.
        power_reading: What its power readings report (see :class:`SimConfig`).
    """

    name: str | None = None
    arch: ArchName | None = None
    workload: Workload | None = None
    idle_w: PosFloat | None = None
    max_w: PosFloat | None = None
    memory_bound_frac: Frac | None = None
    pre_volta: bool = False
    unsupported: tuple[Feature, ...] = ()
    lost_at_s: float | None = None
    no_permission: bool = False
    power_reading: PowerReading | None = None
    #: This GPU's vendor on a mixed node (``None``: the node's): each API serves its own.
    vendor: Vendor | None = None


class SimConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Configuration of a simulated node; JSON-serializable (see :data:`SIM_ENV_VAR`).

    Power in W, clocks in MHz, memory in bytes, times in seconds except ``*_ns`` (wall-clock ns).
    ``gpus[i]`` overrides GPU ``i`` (the list may be shorter than ``num_gpus``).

    Less obvious fields:

    * ``epoch_ns``: time origin of the workload traces and of ``lost_at_s`` (0 = Unix epoch);
      set it to a run's start to script "lost after 5 s" scenarios.
    * ``counter_origin_ns``: when the energy counters read 0 and the grid of driver updates
      starts; ``None`` = midnight UTC of the day the node is created (same in every process).
    * ``call_latency_s``: CPU time each pynvml call burns (busy-wait), like a driver ioctl.
    * ``set_clock_latency_s``: how long ``nvmlDeviceSetGpuLockedClocks`` blocks its caller
      (sleeping) before the new SM clock is in force, as a real driver's clock change takes
      milliseconds; 0 (the default) applies it at once.
    * ``power_noise_w``: amplitude of uniform, seeded noise on *reported* power readings.
    * ``memory_bound_frac``: share of the work that does not speed up with the SM clock.
    * ``process_pids``: pids of the simulated processes on every GPU, replacing the
      ``processes_per_gpu`` random ones, so a test or demo can put real pids (its own, its
      children) on the simulated GPUs. Each gets a seeded share of the GPU's SM utilization.
    * ``power_reading``: what the power readings report, as NVIDIA documents
      ``nvmlDeviceGetPowerUsage`` ("on Ampere (except GA100) or newer GPUs, the API returns
      power averaged over 1 sec interval; on GA100 and older architectures, instantaneous
      power is returned"):

      - ``average_1s`` (Ampere and newer except GA100: H100, L4, A10...):
        ``nvmlDeviceGetPowerUsage`` and ``NVML_FI_DEV_POWER_AVERAGE`` are the mean over the
        last ``average_window_s`` (1 s), refreshed every ``average_period_s`` (100 ms);
        ``NVML_FI_DEV_POWER_INSTANT`` is the instant sensor, which on H100s (and A100s) as
        measured averages only the first ``instant_window_s`` (25 ms) of each
        ``instant_period_s`` (100 ms) and reports it once that period has ended.
      - ``instant`` (GA100 and older): ``nvmlDeviceGetPowerUsage`` is the instant sensor too,
        and there is no ``NVML_FI_DEV_POWER_AVERAGE`` (NOT_SUPPORTED).
      - ``average_only``: every power reading is the 1 s average, the instant field too (an
        NVML, or a stand-in for one, with no instant sensor behind it): the case a consumer
        must recognise from the readings alone.

      The power field ids (185-190) exist from driver 535 on (``driver_version``); older
      drivers answer NOT_SUPPORTED for them, so only ``nvmlDeviceGetPowerUsage`` is left.
    """

    num_gpus: NonNegInt = 4
    name: str = "NVIDIA H100 80GB HBM3"
    arch: ArchName = "hopper"
    seed: int = 0
    epoch_ns: int = 0
    counter_origin_ns: int | None = None
    idle_w: PosFloat = 70.0
    max_w: PosFloat = 700.0
    power_limit_min_w: PosFloat = 200.0
    power_limit_max_w: PosFloat = 700.0
    power_limit_default_w: PosFloat = 700.0
    max_sm_clock_mhz: PosInt = 1980
    min_sm_clock_mhz: PosInt = 345
    sm_clock_step_mhz: PosInt = 15
    idle_sm_clock_mhz: PosInt = 345
    memory_clock_mhz: PosInt = 2619
    memory_total_bytes: PosInt = 85_520_809_984
    memory_base_bytes: NonNegInt = 536_870_912
    memory_bound_frac: Frac = 0.3
    counter_period_s: PosFloat = 0.1
    instant_window_s: PosFloat = 0.025
    instant_period_s: PosFloat = 0.1
    average_window_s: PosFloat = 1.0
    average_period_s: PosFloat = 0.1
    call_latency_s: NonNegFloat = 0.0
    set_clock_latency_s: NonNegFloat = 0.0
    power_noise_w: NonNegFloat = 0.0
    ambient_c: float = 30.0
    thermal_c_per_w: NonNegFloat = 0.06
    thermal_tau_s: PosFloat = 10.0
    memory_idle_w: NonNegFloat = 20.0
    memory_dyn_w: NonNegFloat = 60.0
    processes_per_gpu: NonNegInt = 2
    process_pids: tuple[NonNegInt, ...] = ()
    persistence_mode: bool = True
    driver_version: str = "550.90.07"
    nvml_version: str = "12.550.90.07"
    cuda_driver_version: int = 12040
    power_reading: PowerReading = "average_1s"
    workload: Workload = IdleWorkload()
    gpus: tuple[GpuOverride, ...] = ()
    #: Whose API the simulated GPUs answer through (see :data:`Vendor`); ``sim_preset`` gives
    #: each vendor's usual device.
    vendor: Vendor = "nvidia"
    amd: AmdSim = AmdSim()
    jetson: JetsonSim = JetsonSim()
    apple: AppleSim = AppleSim()
    #: A Grace superchip (MODULE power scope answered); ``None``: a board without one.
    grace: GraceSim | None = None

    def __post_init__(self) -> None:
        if not self.power_limit_min_w <= self.power_limit_default_w <= self.power_limit_max_w:
            raise ConfigError("SimConfig needs power_limit_min_w <= default <= max")
        if self.idle_w >= self.max_w:
            raise ConfigError("SimConfig needs idle_w < max_w")
        if self.min_sm_clock_mhz > self.max_sm_clock_mhz:
            raise ConfigError("SimConfig needs min_sm_clock_mhz <= max_sm_clock_mhz")
        if self.instant_window_s > self.instant_period_s:
            raise ConfigError("SimConfig needs instant_window_s <= instant_period_s")
        if len(self.gpus) > self.num_gpus:
            raise ConfigError(f"{len(self.gpus)} GPU overrides for {self.num_gpus} GPUs")

    def to_json(self) -> str:
        """This configuration as JSON text (what :data:`SIM_ENV_VAR` holds)."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, data: str | bytes) -> SimConfig:
        """Parse JSON text; invalid input raises :class:`~zeus_async.errors.ConfigError`."""
        try:
            return msgspec.json.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ConfigError(f"invalid simulator config: {exc}") from None


def load_sim_config(value: str) -> SimConfig:
    """A config from JSON text (starts with ``{``) or from the path of a JSON file."""
    text = value.strip()
    if text.startswith("{"):
        return SimConfig.from_json(text)
    try:
        return SimConfig.from_json(Path(text).read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read simulator config {text!r}: {exc}") from None


#: Each vendor's usual simulated device: the fields that differ from :class:`SimConfig`'s
#: defaults (an H100 SXM). Figures from the vendors' data sheets.
_PRESETS: Final[dict[str, dict[str, object]]] = {
    "nvidia": {},
    "amd": {
        "vendor": "amd",
        "name": "AMD Instinct MI300X",
        "idle_w": 140.0,
        "max_w": 750.0,
        "power_limit_min_w": 400.0,
        "power_limit_max_w": 750.0,
        "power_limit_default_w": 750.0,
        "max_sm_clock_mhz": 2100,
        "min_sm_clock_mhz": 500,
        "idle_sm_clock_mhz": 500,
        "memory_clock_mhz": 1300,
        "memory_total_bytes": 205_822_885_888,
        "counter_period_s": 0.001,
        "power_reading": "instant",
    },
    "jetson": {
        "vendor": "jetson",
        "name": "NVIDIA Jetson AGX Orin",
        "arch": "ampere",
        "num_gpus": 1,
        "idle_w": 5.0,
        "max_w": 60.0,
        "power_limit_min_w": 15.0,
        "power_limit_max_w": 60.0,
        "power_limit_default_w": 60.0,
        "max_sm_clock_mhz": 1300,
        "min_sm_clock_mhz": 306,
        "idle_sm_clock_mhz": 306,
        "memory_total_bytes": 68_719_476_736,
        "power_reading": "instant",
    },
    "apple": {
        "vendor": "apple",
        "name": "Apple M3 Max",
        "num_gpus": 1,
        "idle_w": 1.0,
        "max_w": 60.0,
        "power_limit_min_w": 60.0,
        "power_limit_max_w": 60.0,
        "power_limit_default_w": 60.0,
        "max_sm_clock_mhz": 1398,
        "min_sm_clock_mhz": 338,
        "idle_sm_clock_mhz": 338,
        "memory_total_bytes": 137_438_953_472,
        "power_reading": "instant",
    },
}


def sim_preset(vendor: str = "nvidia", **overrides: object) -> SimConfig:
    """A simulated node of ``vendor``'s usual device (``nvidia``: H100 SXM, ``amd``: MI300X,
    ``jetson``: AGX Orin, ``apple``: M3 Max), with ``overrides`` (any :class:`SimConfig`
    field) on top.

    Raises:
        ConfigError: An unknown vendor or an invalid field.
    """
    if vendor not in _PRESETS:
        raise ConfigError(f"no simulated vendor {vendor!r}; choose one of {', '.join(_PRESETS)}")
    fields = {**_PRESETS[vendor], **overrides}
    try:
        return msgspec.convert(fields, type=SimConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid simulator config: {exc}") from None


def sim_config_for(vendor: str | None, config: SimConfig | None) -> SimConfig:
    """The configuration a ``sim``/``sim-<vendor>`` backend runs: ``config`` (else the one in
    :data:`SIM_ENV_VAR`, else ``vendor``'s preset), served beneath ``vendor``'s API when one
    is named.

    Raises:
        ConfigError: ``config`` names another vendor than ``vendor``, or the variable holds
            an invalid configuration.
    """
    import os

    if config is None:
        text = os.environ.get(SIM_ENV_VAR)
        if text:
            config = SimConfig.from_json(text)
    if config is None:
        return sim_preset(vendor or "nvidia")
    if vendor is not None and config.vendor != vendor:
        if config.vendor != "nvidia":
            raise ConfigError(
                f"backend sim-{vendor} with a simulator config of vendor {config.vendor!r}"
            )
        config = msgspec.structs.replace(config, vendor=vendor)
    return config
