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
    "H100_DRIVER_580_COSTS",
    "SIM_ENV_VAR",
    "AppleSim",
    "ArchName",
    "Feature",
    "GpuOverride",
    "GraceSim",
    "PowerReading",
    "SimConfig",
    "grace_preset",
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
    """What the simulated ``amdsmi`` reports beyond the physical model (``vendor="amd"``),
    with the flaws real parts and library versions show (issue 37).

    Attributes:
        lib_version: ``amdsmi_get_lib_version`` as ``"major.minor.release"`` (the library's
            own numbering: 25.x in ROCm 6.4, 26.x in ROCm 7.x; calls are serialised before
            26.2, ROCm 7.2, where libamd_smi is not thread-safe).
        power_fields: Which ``amdsmi_get_power_info`` power is valid, the other being "N/A":
            ``current`` (``current_socket_power``, MI300 and later) or ``average``
            (``average_socket_power``, MI200 and older).
        power_limit_units: Units of ``amdsmi_get_power_info``'s ``power_limit`` (``W`` in
            older libraries, ``uW`` in newer ones; ``amdsmi_get_power_cap_info`` is µW).
        counter_resolution_uj: µJ per ``energy_accumulator`` tick (about 15.3).
        counter_fault: The energy counter's flaw on the GPUs of ``faulty_gpus``: ``none``,
            ``stuck`` (never moves, ROCm/amdsmi#38 in VM guests), ``scaled`` (advances
            ``counter_scale`` times the truth), ``backwards`` (steps back ``backwards_j`` at
            ``backwards_at_s`` after the epoch, ROCm/amdsmi#115).
        faulty_gpus: amd-smi indices with the fault (empty: every GPU).
        dual_die: MI250-style parts: amd-smi GPUs ``2k`` and ``2k+1`` are the two dies of one
            package; ``2k`` reports the power and energy of both, ``2k+1`` reports 0.
        hip_ids: The HIP index of each amd-smi index (``amdsmi_get_gpu_enumeration_info``'s
            ``hip_id``); empty: the same order.
    """

    lib_version: str = "26.0.2"
    power_fields: Literal["current", "average"] = "current"
    power_limit_units: Literal["W", "uW"] = "uW"
    counter_resolution_uj: float = 15.259022
    counter_fault: Literal["none", "stuck", "scaled", "backwards"] = "none"
    counter_scale: float = 1.0
    backwards_at_s: float = 1.0
    backwards_j: float = 50.0
    faulty_gpus: tuple[int, ...] = ()
    dual_die: bool = False
    hip_ids: tuple[int, ...] = ()


class JetsonRail(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One simulated INA3221 rail besides the GPU's: ``idle_w + dyn_w * u(t)`` watts, ``u``
    the GPU's utilization (CPU, memory and I/O rails follow the work the GPU is fed)."""

    name: str
    idle_w: NonNegFloat = 0.0
    dyn_w: NonNegFloat = 0.0
    voltage_v: PosFloat = 5.0


class JetsonSim(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What the simulated Jetson INA3221 sysfs tree holds (``vendor="jetson"``).

    The physical model's GPU power (:class:`SimConfig`'s ``idle_w``/``max_w``) is the GPU rail;
    the other rails are :class:`JetsonRail`. The defaults are an AGX Orin's two INA3221 chips
    (``1-0040``: VDD_GPU_SOC, VDD_CPU_CV, VIN_SYS_5V0; ``1-0041``: VDDQ_VDD2_1V8AO, two
    channels not connected), which have no rail for the module's total input.

    Attributes:
        layout: ``hwmon`` (the mainline ``ina3221`` driver, JetPack 5 and later: ``in{N}_label``,
            ``in{N}_input`` mV, ``curr{N}_input`` mA) or ``legacy`` (NVIDIA's ``ina3221x`` IIO
            driver, JetPack 4: ``rail_name_{N}``, ``in_power{N}_input`` mW,
            ``in_voltage{N}_input`` mV, ``in_current{N}_input`` mA).
        gpu_rail: The GPU rail's label (``VDD_GPU_SOC`` on Orin, ``GPU`` on Xavier,
            ``VDD_SYS_GPU`` on TX2, ``POM_5V_GPU`` on Nano).
        gpu_voltage_v: The GPU rail's bus voltage.
        rails: The other rails, in channel order after the GPU's (three channels per chip).
        input_rail: A rail carrying the module's total input (``VDD_IN`` on Orin NX/Nano,
            ``POM_5V_IN`` on Nano): every other rail plus ``input_overhead_w``; ``None``: none.
        input_overhead_w: What the input rail carries beyond the rails measured (regulator
            losses, the rest of the module).
        update_period_s: The INA3221's conversion cycle (3 channels x (bus + shunt) conversion
            time x averaged samples; 6.6 ms with the mainline driver's defaults): a reading is
            the mean power over the last completed cycle, refreshed once a cycle.
        gpu_load: Also serve ``/sys/devices/gpu.0/load`` (utilization, per mille), the GPU's
            devfreq ``cur_freq`` (Hz) and a ``GPU-therm`` thermal zone (m°C).
    """

    layout: Literal["hwmon", "legacy"] = "hwmon"
    gpu_rail: str = "VDD_GPU_SOC"
    gpu_voltage_v: PosFloat = 5.0
    rails: tuple[JetsonRail, ...] = (
        JetsonRail(name="VDD_CPU_CV", idle_w=0.8, dyn_w=3.0),
        JetsonRail(name="VIN_SYS_5V0", idle_w=3.2, dyn_w=1.5),
        JetsonRail(name="NC"),
        JetsonRail(name="VDDQ_VDD2_1V8AO", idle_w=0.6, dyn_w=1.2),
    )
    input_rail: str | None = None
    input_overhead_w: NonNegFloat = 1.0
    update_period_s: PosFloat = 0.0066
    gpu_load: bool = True


#: IOReport "Energy Model" channels a simulated Apple chip may lack (:attr:`AppleSim.missing`):
#: ``dram`` (older chips, per zeus-apple-silicon), ``ane``, ``gpu_sram``, ``cores`` (the per-core,
#: per-cluster and core-manager channels), ``gpu`` (a chip whose GPU channel is absent).
AppleChannel = Literal["dram", "ane", "gpu_sram", "cores", "gpu"]
#: Units an IOReport energy channel may count in (the stand-in converts as the library does).
AppleEnergyUnit = Literal["mJ", "uJ", "nJ"]


class AppleSim(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What the simulated IOReport energy channels report (``vendor="apple"``).

    The GPU is the physical model's GPU 0 (``SimConfig.idle_w``/``max_w``, workload): its
    "GPU Energy" plus "GPU SRAM" channels add up to its true energy, ``gpu_sram_frac`` of it in
    the SRAM channel. The other channels follow it: a component's power is
    ``<component>_idle_w + <component>_share * GPU power`` (CPU, DRAM, ANE), so its energy
    over any interval is exact too. Channels count in ``unit`` (integers, as IOReport does) and
    advance every ``update_period_s`` on a grid anchored at the counter origin; the library
    converts each to whole mJ (integer division), hence the ~1 mJ resolution.

    Attributes:
        chip: What ``sysctl machdep.cpu.brand_string`` says (the device names follow it).
        efficiency_cores, performance_cores: Cores per kind (M3 Max: 4 + 12), in one cluster
            each; the CPU's energy is shared between them (``cores`` channels).
        update_period_s: How often the Energy Model counters advance. Not measured on a real
            Mac: an assumption to be replaced by a measurement.
        missing: Channels this chip does not have (their metrics read ``None``).
        subscription_fails: ``AppleEnergyMonitor()`` raises ``RuntimeError`` (what the library
            does when ``IOReportCreateSubscription`` returns nothing).
    """

    chip: str = "Apple M3 Max"
    efficiency_cores: NonNegInt = 4
    performance_cores: NonNegInt = 12
    cpu_idle_w: NonNegFloat = 1.0
    cpu_share: NonNegFloat = 0.3
    dram_idle_w: NonNegFloat = 0.2
    dram_share: NonNegFloat = 0.1
    ane_idle_w: NonNegFloat = 0.0
    ane_share: NonNegFloat = 0.0
    gpu_sram_frac: Frac = 0.05
    unit: AppleEnergyUnit = "mJ"
    update_period_s: PosFloat = 0.01
    missing: tuple[AppleChannel, ...] = ()
    subscription_fails: bool = False


class GraceSim(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A Grace superchip (GH200, GB200) beneath ``pynvml``: NVML answers the MODULE power
    scope (GPU + CPU + memory) besides the GPU one.

    Each simulated GPU is one module with its own Grace CPU and LPDDR5X memory (a GH200; on a
    GB200, whose Grace serves two GPUs, give each GPU half the CPU's figures). The GPU scope,
    the GPU's energy counter and the GPU's ground truth are unchanged; the MODULE scope adds

    * CPU power ``cpu_idle_w + (cpu_max_w - cpu_idle_w) * load`` and
    * memory power ``memory_idle_w + (memory_max_w - memory_idle_w) * load``,

    where ``load`` is ``cpu_load``: ``"gpu"`` (the default) follows the GPU's utilization at
    every instant (the host code feeding the GPU: data loading, kernel launches), times a
    seeded factor per module between ``1 - load_spread`` and 1; a number is a constant load.
    Piecewise constant like the GPU's power, so :meth:`SimNode.truth_module_energy_j
    <zeus_async.devices.sim.SimNode.truth_module_energy_j>` is exact. Reported MODULE
    readings follow the GPU's grids (instant: first ``instant_window_s`` of each
    ``instant_period_s``; average: last ``average_window_s``) and carry ``power_noise_w``.

    Defaults: a GH200's Grace (72 Neoverse V2 cores; NVIDIA gives the CPU + memory up to
    ~250 W of the module's 450-1000 W), idle figures as reported for an idle GH200 node.
    """

    cpu_idle_w: NonNegFloat = 60.0
    cpu_max_w: NonNegFloat = 220.0
    memory_idle_w: NonNegFloat = 15.0
    memory_max_w: NonNegFloat = 35.0
    cpu_load: Frac | Literal["gpu"] = "gpu"
    load_spread: Frac = 0.0

    def __post_init__(self) -> None:
        if self.cpu_idle_w > self.cpu_max_w or self.memory_idle_w > self.memory_max_w:
            raise ConfigError("GraceSim needs cpu_idle_w <= cpu_max_w, memory_idle_w <= max")


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
    * ``energy_call_latency_s``: extra CPU a read of the energy counter burns
      (``nvmlDeviceGetTotalEnergyConsumption``, or a ``nvmlDeviceGetFieldValues`` that asks
      for ``TOTAL_ENERGY_CONSUMPTION`` or ``ENERGY``), on top of ``call_latency_s``.
    * ``power_limit_call_latency_s``: extra CPU ``nvmlDeviceGetPowerManagementLimit`` burns
      (``nvmlDeviceGetEnforcedPowerLimit``, which the sampler reads, was not measured: it
      costs ``call_latency_s``).
    * ``set_power_limit_latency_s``: how long ``nvmlDeviceSetPowerManagementLimit`` blocks
      its caller (sleeping) before the limit is in force.
    * ``clock_settle_s``: after ``nvmlDeviceSetGpuLockedClocks`` returns, the SM clock keeps
      its old value this long before it reads (and runs at) the locked one.
      :data:`H100_DRIVER_580_COSTS` holds the four, as measured on a real H100.
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
    energy_call_latency_s: NonNegFloat = 0.0
    power_limit_call_latency_s: NonNegFloat = 0.0
    set_power_limit_latency_s: NonNegFloat = 0.0
    clock_settle_s: NonNegFloat = 0.0
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
        # current_socket_power: the SMU's socket power, refreshed every millisecond (not
        # NVIDIA's 25-of-100 ms instant sensor).
        "instant_window_s": 0.001,
        "instant_period_s": 0.001,
        "power_reading": "instant",
    },
    "jetson": {
        "vendor": "jetson",
        "name": "NVIDIA Jetson AGX Orin",
        "arch": "ampere",
        "num_gpus": 1,
        # The GPU rail (VDD_GPU_SOC: GPU and SoC); the module draws up to 60 W (MAXN) with
        # the other rails (JetsonSim.rails).
        "idle_w": 2.0,
        "max_w": 40.0,
        "thermal_c_per_w": 0.6,
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
        # M3 Max (16-core CPU: 12 P + 4 E; 40-core GPU at about 1.4 GHz; up to 128 GB).
        # GPU power: tens of mW idle, about 50 W flat out (powermetrics reports of full GPU
        # loads); no power limit can be set, the limits below only satisfy SimConfig.
        "vendor": "apple",
        "name": "Apple M3 Max GPU",
        "num_gpus": 1,
        "idle_w": 0.1,
        "max_w": 50.0,
        "power_limit_min_w": 50.0,
        "power_limit_max_w": 50.0,
        "power_limit_default_w": 50.0,
        "max_sm_clock_mhz": 1398,
        "min_sm_clock_mhz": 338,
        "idle_sm_clock_mhz": 338,
        "memory_total_bytes": 137_438_953_472,
        "power_reading": "instant",
    },
}


#: What NVML calls cost on a real H100 80GB HBM3 (SXM), driver 580.159.04, as measured on
#: 2026-11-27 (``bench/RESULTS.md``, "Real hardware"; ``bench/history/real-h100-2026-11-27/``):
#: a power, clock or temperature read 2-5 us of CPU, a read of the energy counter 3.8 ms more
#: (3.83-3.88 ms a call, by ``nvmlDeviceGetTotalEnergyConsumption`` and by the energy field
#: ids alike), ``nvmlDeviceGetPowerManagementLimit`` ~150 us, setting the power limit ~9 ms
#: (median), locking SM clocks 9-14 ms, after which the SM clock reads the locked value ~20 ms
#: later (median; p90 ~60 ms). Medians, for ``sim_preset("nvidia", **H100_DRIVER_580_COSTS)``;
#: every field's default is 0, so the simulator's figures elsewhere assume free calls.
H100_DRIVER_580_COSTS: Final[dict[str, float]] = {
    "call_latency_s": 4e-6,
    "energy_call_latency_s": 3.84e-3,
    "power_limit_call_latency_s": 146e-6,
    "set_power_limit_latency_s": 9e-3,
    "set_clock_latency_s": 11e-3,
    "clock_settle_s": 20e-3,
}


def grace_preset(**overrides: object) -> SimConfig:
    """A simulated GH200 node: one Grace Hopper superchip (``NVIDIA GH200 480GB``: an H100 with
    96 GB of HBM3, 900 W GPU power limit, and a Grace CPU with 480 GB of LPDDR5X, the
    :class:`GraceSim` defaults), whose NVML answers the MODULE power scope; ``overrides``
    (any :class:`SimConfig` field, ``grace=GraceSim(...)`` included) on top.

    Raises:
        ConfigError: An invalid field.
    """
    fields: dict[str, object] = {
        "name": "NVIDIA GH200 480GB",
        "num_gpus": 1,
        "max_w": 900.0,
        "power_limit_min_w": 100.0,
        "power_limit_max_w": 900.0,
        "power_limit_default_w": 900.0,
        "memory_total_bytes": 102_005_473_280,
        "grace": GraceSim(),
    }
    fields.update(overrides)
    return sim_preset("nvidia", **fields)


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
