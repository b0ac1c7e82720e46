"""Event schema: every record zeus_async produces, as msgspec structs.

All events form one tagged union, :data:`Event`. On the wire and on disk an event is a msgpack
array whose first element is the tag (``"gpu"``, ``"rapl"``, ...) followed by the fields in the
order declared here (``array_like=True``): compact, fast, and language-neutral.

Conventions:

* SI units, with the unit in the field name: ``power_w``, ``energy_j``, ``t_ns``,
  ``sm_clock_hz``, ``memory_used_bytes``, ``temperature_c``; fractions end in ``_frac`` (0..1).
* Every event carries ``host`` (host id) and ``t_ns`` (wall-clock ns, ``time.time_ns()``).
* A field a device could not read is ``None``; it is never faked as 0.

Schema evolution (:data:`SCHEMA_VERSION`): new fields are only *appended* to a struct and always
have a default, so older frames still decode; new event kinds get new tags. Removing or
reordering fields requires a new schema version.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Final, Literal

import msgspec

from .errors import CodecError

__all__ = [
    "SCHEMA_VERSION",
    "Capabilities",
    "ClockChange",
    "DeviceFault",
    "DeviceInfo",
    "Event",
    "EventDecoder",
    "EventEncoder",
    "GpuSample",
    "Heartbeat",
    "Measurement",
    "OptimizerState",
    "PowerLimitChange",
    "ProcessSample",
    "RaplSample",
    "RequestIdle",
    "RequestMeasurement",
    "StreamInfo",
    "WindowClose",
    "WindowOpen",
    "WorkloadChange",
    "WorkloadEnergy",
    "described_gpus",
    "event_kind",
    "event_to_dict",
    "event_to_json",
    "event_topic",
    "window_energies",
]

#: Version of this schema; carried in every frame header and recording header.
SCHEMA_VERSION: Final = 1

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Frac = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]

# Shared struct options: positional encoding, no GC tracking (events hold no cycles).
_OPTS: dict[str, Any] = {"array_like": True, "gc": False, "omit_defaults": False}


class GpuSample(msgspec.Struct, tag="gpu", **_OPTS):
    """One reading of one GPU. Fields not sampled in this tick (or unsupported) are ``None``.

    Attributes:
        host: Host id.
        t_ns: Wall-clock time of the reading (ns since epoch).
        gpu: GPU index as seen by this process (after ``CUDA_VISIBLE_DEVICES``).
        power_w: Instantaneous power (NVML ``POWER_INSTANT`` field).
        avg_power_w: Power averaged by the driver (NVML ``POWER_AVERAGE``, ~1 s on H100).
        energy_j: Energy counter (J since driver load); ``None`` before Volta.
        temperature_c: GPU core temperature.
        sm_clock_hz: Current SM clock.
        utilization_frac: GPU utilization (fraction of time a kernel ran).
        memory_used_bytes: Device memory in use.
        power_limit_w: Power limit in force.
    """

    host: str
    t_ns: int
    gpu: int
    power_w: float | None = None
    avg_power_w: float | None = None
    energy_j: float | None = None
    temperature_c: float | None = None
    sm_clock_hz: float | None = None
    utilization_frac: float | None = None
    memory_used_bytes: int | None = None
    power_limit_w: float | None = None


RaplDomain = Literal["package", "core", "uncore", "dram", "psys"]


class RaplSample(msgspec.Struct, tag="rapl", **_OPTS):
    """One reading of a RAPL energy counter (CPU package or one of its sub-domains).

    Attributes:
        package: CPU package (socket) index.
        domain: ``package``, ``core``, ``uncore``, ``dram`` or ``psys``.
        energy_j: Unwrapped cumulative energy since the sampler started.
        power_w: Mean power since the previous sample of this domain (``None`` on the first).
    """

    host: str
    t_ns: int
    package: int
    domain: RaplDomain
    energy_j: float
    power_w: float | None = None


class ProcessSample(msgspec.Struct, tag="proc", **_OPTS):
    """Resource use of one tracked process: on the host (``gpu is None``) or on one GPU.

    A process sampler (:mod:`zeus_async.runtime.processes`) publishes, every period, one
    host-side sample per tracked pid and one sample per (pid, GPU) the pid runs on. Rates and
    powers are over the period that ends at ``t_ns``; they are ``None`` on a pid's first sample
    (nothing to difference yet), whose cumulative energies are ``0.0``.

    Host side (``gpu is None``):
        cpu_frac: CPU time used / (wall time * logical CPUs): share of the whole machine.
        memory_rss_bytes, memory_pss_bytes, memory_uss_bytes: Resident, proportional and unique
            set sizes (PSS/USS need ``/proc/<pid>/smaps_rollup``; ``None`` when unreadable).
        memory_frac: PSS (RSS when PSS is unknown) / physical memory.
        cpu_share_frac: This pid's CPU time / CPU time used by the whole machine in the period.
        cpu_power_w, cpu_energy_j: ``cpu_share_frac`` * RAPL package power, and its running
            total since the pid was first sampled (``None`` without RAPL).
        dram_power_w, dram_energy_j: PSS / memory in use * RAPL DRAM power, and its total.

    On a GPU (``gpu`` set):
        gpu_sm_frac: SM utilization of the pid (NVML per-process samples, mean over the period).
        gpu_memory_bytes: Device memory the pid holds.
        gpu_sm_share_frac, gpu_memory_share_frac: The pid's SM utilization and memory relative
            to all tracked pids on this GPU.
        gpu_power_share_frac: The pid's share of the GPU's power: its SM utilization over the
            SM utilization of every process on the GPU (tracked or not); on an idle GPU, its
            memory over all processes' memory.
        attributed_power_w: The GPU's reported power averaged over the period *
            ``gpu_power_share_frac`` (never above the GPU's own power).
        attributed_energy_j: Running total, since the pair was first sampled, of
            ``gpu_power_share_frac`` * the GPU energy counter's increase (the pids on a GPU add
            up to its energy).

    Both:
        workload: The key of the workload the pid works for (``slurm:4711``,
            ``k8s:<namespace>/<pod>/<container>``, ``uid:1001``: a node agent's resolver,
            :mod:`zeus_async.agent.workloads`); ``""`` where none was asked (a runtime of
            its own) or it is unknown.
    """

    host: str
    t_ns: int
    pid: int
    cpu_frac: float | None = None
    memory_rss_bytes: int | None = None
    memory_pss_bytes: int | None = None
    memory_uss_bytes: int | None = None
    gpu: int | None = None
    gpu_sm_frac: float | None = None
    gpu_memory_bytes: int | None = None
    attributed_power_w: float | None = None
    memory_frac: float | None = None
    cpu_share_frac: float | None = None
    cpu_power_w: float | None = None
    cpu_energy_j: float | None = None
    dram_power_w: float | None = None
    dram_energy_j: float | None = None
    gpu_sm_share_frac: float | None = None
    gpu_memory_share_frac: float | None = None
    gpu_power_share_frac: float | None = None
    attributed_energy_j: float | None = None
    workload: str = ""


class WindowOpen(msgspec.Struct, tag="win_open", **_OPTS):
    """A measurement window began."""

    host: str
    t_ns: int
    name: str
    window_id: int


class WindowClose(msgspec.Struct, tag="win_close", **_OPTS):
    """A measurement window ended (``cancelled`` when it was discarded)."""

    host: str
    t_ns: int
    name: str
    window_id: int
    cancelled: bool = False


#: How an energy figure was obtained.
EnergyMethod = Literal["counter", "counter+interpolated", "integrated", "unavailable"]


class Measurement(msgspec.Struct, tag="measurement", **_OPTS):
    """Time and energy of one finished window.

    ``gpu_energy_j`` maps GPU index to joules; ``cpu_energy_j`` / ``dram_energy_j`` map CPU
    package index to joules, or are ``None`` when RAPL is unavailable. ``methods`` maps a device
    key (``"gpu:0"``, ``"cpu:0"``) to the :data:`EnergyMethod` used for it, and ``lost`` lists
    the devices that failed during the window.
    """

    host: str
    t_ns: int
    name: str
    window_id: int
    start_ns: int
    end_ns: int
    time_s: float
    gpu_energy_j: dict[int, float]
    cpu_energy_j: dict[int, float] | None = None
    dram_energy_j: dict[int, float] | None = None
    methods: dict[str, str] = msgspec.field(default_factory=dict)
    lost: list[str] = msgspec.field(default_factory=list)
    #: Per device key, what the data around the window's edges leaves uncertain (J; see
    #: ``docs/energy-methods.md``). Absent in recordings made before it existed.
    error_j: dict[str, float] = msgspec.field(default_factory=dict)


class PowerLimitChange(msgspec.Struct, tag="power_limit", **_OPTS):
    """A GPU power limit was set (``previous_w`` is what was in force before)."""

    host: str
    t_ns: int
    gpu: int
    power_limit_w: float
    previous_w: float | None = None
    source: str = ""


class OptimizerState(msgspec.Struct, tag="optimizer", **_OPTS):
    """An optimizer changed state or decided something (power limit, frequency plan, ...).

    Attributes:
        optimizer: Which optimizer (``"power_limit"``).
        state: The state entered (``ready``, ``warmup``, ``profiling``, ``done``, ...).
        power_limit_w: The power limit the state is about (being profiled, or chosen).
        steps: Steps the state lasts (or lasted), when it counts steps.
        detail: Human-readable context (why the state changed, the selector, ...).
        values: Figures behind the decision (``energy_j``, ``time_s``, ``cost``, ...).
    """

    host: str
    t_ns: int
    optimizer: str
    state: str
    power_limit_w: float | None = None
    steps: int | None = None
    detail: str = ""
    values: dict[str, float] = msgspec.field(default_factory=dict)


class ClockChange(msgspec.Struct, tag="clock", **_OPTS):
    """GPU SM clocks were locked to ``[min_hz, max_hz]``, or reset when both are ``None``."""

    host: str
    t_ns: int
    gpu: int
    min_hz: float | None = None
    max_hz: float | None = None
    source: str = ""


class DeviceFault(msgspec.Struct, tag="fault", **_OPTS):
    """A device operation failed.

    Attributes:
        device: Device key (``"gpu:0"``, ``"cpu:0"``).
        kind: Error kind (``not_supported``, ``no_permission``, ``gpu_lost``, ``transient``, ...).
        message: Human-readable text.
        retry_in_s: When the sampler will try again (``None`` if it gave up).
    """

    host: str
    t_ns: int
    device: str
    kind: str
    message: str
    retry_in_s: float | None = None


class Capabilities(msgspec.Struct, array_like=True, gc=False):
    """What a device can and cannot do, as its backend found it (issue 37).

    Attributes:
        energy_counter: A hardware (or firmware-model) energy counter that windows difference;
            without one, window energy integrates power readings (with its error bound).
        power_cap: The power limit (NVIDIA) or power cap (AMD) can be read and set.
        clocks: SM/graphics clocks can be locked and reset.
        per_process: The driver lists the processes on the device and their use.
    """

    energy_counter: bool = False
    power_cap: bool = False
    clocks: bool = False
    per_process: bool = False


class DeviceInfo(msgspec.Struct, array_like=True, gc=False):
    """Static description of one device, as published in :class:`StreamInfo`.

    Power figures are in W, clocks in Hz; ``arch`` is the NVML architecture name
    (``"hopper"``, ``"pascal"``, ...) or ``"cpu"``.
    """

    key: str
    name: str
    uuid: str = ""
    arch: str = ""
    has_energy_counter: bool = False
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    power_limit_default_w: float | None = None
    supported_sm_clocks_hz: list[float] = msgspec.field(default_factory=list)
    #: The device's index as the driver numbers it (``nvidia-smi``'s, NVML's), whatever
    #: ``CUDA_VISIBLE_DEVICES`` made of it: ``gpu:1`` may be physical GPU 3 (``None``: unknown).
    index: int | None = None
    #: ``nvidia``, ``amd``, ``apple``, ``nvidia-jetson``, ``intel``/``amd`` (CPU packages);
    #: ``""`` in recordings made before vendors were named (NVIDIA or a CPU package).
    vendor: str = ""
    #: How window energy is obtained: ``counter`` (the device's energy counter) or
    #: ``integrated-power`` (power readings integrated over time); ``""``: before this field.
    energy_method: str = ""
    #: Why, in words, when it is not the obvious one: "the counter failed its start check
    #: (it read 0.0 J over 1.0 s at 180 W): integrated power", "IOReport Energy Model (model-
    #: based, ~1 mJ)", "MODULE scope (GPU + CPU + memory): integrated power".
    energy_note: str = ""
    #: What the device can do; ``None`` in recordings made before capabilities were said.
    capabilities: Capabilities | None = None
    #: The power scope read (NVML: ``gpu`` or ``module`` on Grace superchips); ``""``: the
    #: device's only one.
    power_scope: str = ""
    #: How the power readings relate to time (issue 37): the most a reading can describe power
    #: earlier than its own timestamp (s; 0: its own moment, and in recordings made before
    #: this field). A window integrating the readings widens its ``error_j`` by it.
    power_reading_lag_s: float = 0.0
    #: Each reading is the mean power over a window this long (s), lying within the lag
    #: above (0: a point reading, or unknown).
    power_reading_window_s: float = 0.0
    #: ``avg_power_w`` is the mean power over the last ``power_average_window_s``, refreshed
    #: every ``power_average_period_s`` on the driver's grid (NVML's POWER_AVERAGE in a Grace
    #: superchip's MODULE scope: 1 s, 0.1 s); a device without an energy counter then takes
    #: window energy from it (``integrated+average``). 0: no such average, or not used.
    power_average_window_s: float = 0.0
    power_average_period_s: float = 0.0
    #: How often the energy counter updates (s), as the device says (issue 37): a counter read
    #: at least twice as often apart is exact at every read; a slower one is fitted to an
    #: update grid of this period (phase only). 0: unknown (learned from the samples, as for
    #: NVIDIA's ~100 ms), and in recordings made before this field.
    energy_counter_period_s: float = 0.0


class StreamInfo(msgspec.Struct, tag="stream", **_OPTS):
    """Describes a stream: who publishes it and which devices it covers. Sent on start.

    ``meta`` is the run metadata (as in a recording header): job name, model complexity
    (``model.params``, ``model.flops``, ...) and whatever the user passed.
    """

    host: str
    t_ns: int
    stream_id: str
    schema_version: int = SCHEMA_VERSION
    pid: int = 0
    argv: list[str] = msgspec.field(default_factory=list)
    devices: list[DeviceInfo] = msgspec.field(default_factory=list)
    meta: dict[str, str] = msgspec.field(default_factory=dict)


class Heartbeat(msgspec.Struct, tag="heartbeat", **_OPTS):
    """Periodic liveness record of a stream, with counters a subscriber can cross-check."""

    host: str
    t_ns: int
    stream_id: str
    events_published: NonNegInt = 0
    frames_published: NonNegInt = 0
    #: Frames sequenced before this one on each topic (the next topic seq of each): sent in the
    #: FINAL heartbeat only, so a topic-filtered subscriber can count the loss at the tail of
    #: every topic it follows. ``None`` in periodic heartbeats.
    topic_frames: dict[str, NonNegInt] | None = None


class RequestMeasurement(msgspec.Struct, tag="request", **_OPTS):
    """The energy attributed to one inference request (:mod:`zeus_async.inference`).

    ``gpu_energy_j`` maps GPU index to joules; ``prefill_j``/``decode_j`` split it by phase
    when the server marked them; ``policy`` is how concurrent requests shared each moment
    (``equal``, ``tokens``), and ``method`` adds the energy estimator's method.
    ``finish_reason``: ``completed``, ``cancelled``, ``error`` or ``unfinished`` (settled past
    the meter's maximum age without an end). ``error_j``: a bound on the measurement part of
    the energy (the estimator's edge uncertainty, shared as the energy is), not on the policy.
    """

    host: str
    t_ns: int
    request_id: str
    begin_ns: int
    end_ns: int
    gpu_energy_j: dict[int, float]
    decode_ns: int | None = None
    prefill_j: float | None = None
    decode_j: float | None = None
    tokens_in: NonNegInt = 0
    tokens_out: NonNegInt = 0
    policy: str = ""
    method: str = ""
    finish_reason: str = "completed"
    error_j: float = 0.0


class RequestIdle(msgspec.Struct, tag="request_idle", **_OPTS):
    """Over one interval the request meter settled: each GPU's measured energy and the part
    of it with no request in flight (the rest went to the ``request`` events of the
    interval)."""

    host: str
    t_ns: int
    start_ns: int
    end_ns: int
    gpu_energy_j: dict[int, float]
    gpu_idle_j: dict[int, float]
    policy: str = ""


class WorkloadChange(msgspec.Struct, tag="workload", **_OPTS):
    """A workload (a Slurm job, a pod container, a user's processes) began or ceased to hold
    GPUs of this host, as the node agent learned it (:mod:`zeus_async.agent.workloads`).

    ``state`` is ``started`` (it holds ``gpus``; sent again when they change), ``ended`` (no
    source holds it any more; its energy stays exported for a while) or ``expired`` (it is
    forgotten: exporters drop its series). ``key`` is stable and unique per workload
    (``slurm:4711``, ``k8s:<namespace>/<pod>/<container>``, ``uid:1001``); the identity fields
    are ``""`` (``uid``: -1) where unknown.
    """

    host: str
    t_ns: int
    key: str
    state: Literal["started", "ended", "expired"]
    kind: str
    gpus: list[int] = msgspec.field(default_factory=list)
    job_id: str = ""
    user: str = ""
    uid: int = -1
    partition: str = ""
    namespace: str = ""
    pod: str = ""
    container: str = ""
    command: str = ""


class WorkloadEnergy(msgspec.Struct, tag="workload_energy", **_OPTS):
    """The energy a workload's GPUs drew while it held them, as monotonic counters: GPU index
    to joules since the workload started on this host (the GPUs' energy counters, credited to
    the holder of each GPU sample by sample). Sent periodically by the node agent; a counter
    never goes down, including across agent restarts (the agent keeps its ledger on disk), so
    ``increase()`` over any range survives missed scrapes."""

    host: str
    t_ns: int
    key: str
    gpu_energy_j: dict[int, float]


Event = (
    GpuSample
    | RaplSample
    | ProcessSample
    | WindowOpen
    | WindowClose
    | Measurement
    | PowerLimitChange
    | ClockChange
    | DeviceFault
    | StreamInfo
    | Heartbeat
    | OptimizerState
    | RequestMeasurement
    | RequestIdle
    | WorkloadChange
    | WorkloadEnergy
)
"""The tagged union of every event kind."""

EVENT_TYPES: Final[tuple[type[Any], ...]] = Event.__args__


def window_energies(m: Measurement) -> Iterator[tuple[str, float]]:
    """A window's joules per device key: ``gpu:N``, ``cpu:N`` (RAPL package), ``dram:N``."""
    for prefix, energies in (
        ("gpu", m.gpu_energy_j),
        ("cpu", m.cpu_energy_j),
        ("dram", m.dram_energy_j),
    ):
        for index, joules in (energies or {}).items():
            yield f"{prefix}:{index}", joules


def described_gpus(info: StreamInfo) -> Iterator[tuple[int, DeviceInfo]]:
    """The GPUs a stream describes: ``(index, description)``."""
    for device in info.devices:
        kind, _, index = device.key.partition(":")
        if kind == "gpu" and index.isdigit():
            yield int(index), device


def event_topic(event: Event) -> str:
    """The bus topic of an event: ``gpu/<host>/<index>``, ``cpu/<host>/<pkg>``, ``window/<name>``...

    Topics are prefix-filterable: subscribing to ``gpu/`` receives every GPU sample of every
    host; ``gpu/node1/`` the GPUs of one host.
    """
    if isinstance(event, GpuSample):
        return f"gpu/{event.host}/{event.gpu}"
    if isinstance(event, RaplSample):
        return f"cpu/{event.host}/{event.package}"
    if isinstance(event, (WindowOpen, WindowClose, Measurement)):
        return f"window/{event.host}/{event.name}"
    if isinstance(event, ProcessSample):
        return f"proc/{event.host}/{event.pid}"
    if isinstance(event, (PowerLimitChange, ClockChange)):
        return f"control/{event.host}/{event.gpu}"
    if isinstance(event, DeviceFault):
        return f"fault/{event.host}/{event.device}"
    if isinstance(event, OptimizerState):
        return f"optimizer/{event.host}/{event.optimizer}"
    if isinstance(event, RequestMeasurement):
        return f"request/{event.host}/{event.request_id}"
    if isinstance(event, RequestIdle):
        return f"request/{event.host}"
    if isinstance(event, (WorkloadChange, WorkloadEnergy)):
        return f"workload/{event.host}/{event.key}"
    return f"stream/{event.host}"


class EventEncoder:
    """Encodes batches of events to msgpack, reusing one buffer."""

    __slots__ = ("_buf", "_enc")

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray(4096)

    def encode(self, events: list[Event] | Event) -> bytes:
        """Encode one event or a list of events (a batch) to bytes."""
        self._enc.encode_into(events, self._buf)
        return bytes(self._buf)


class EventDecoder:
    """Decodes msgpack into events; any malformed input raises :class:`CodecError`."""

    __slots__ = ("_batch", "_one")

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(list[Event])
        self._one = msgspec.msgpack.Decoder(Event)

    def decode_batch(self, data: bytes | bytearray | memoryview) -> list[Event]:
        try:
            return self._batch.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CodecError(f"invalid event batch: {exc}") from None

    def decode(self, data: bytes | bytearray | memoryview) -> Event:
        try:
            event: Event = self._one.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CodecError(f"invalid event: {exc}") from None
        return event


def _to_builtin(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return {f: _to_builtin(getattr(value, f)) for f in value.__struct_fields__}
    if isinstance(value, list):
        return [_to_builtin(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_builtin(v) for k, v in value.items()}
    return value


def event_kind(event: Event) -> str:
    """The tag of an event (``"gpu"``, ``"rapl"``, ``"measurement"``, ...)."""
    return str(type(event).__struct_config__.tag)


_json_encoder = msgspec.json.Encoder()


def event_to_json(event: Event) -> bytes:
    """One compact JSON object for an event (:func:`event_to_dict`), no trailing newline: the
    line format of ``export --format jsonl`` and log files (``subscribe --json`` adds the
    frame that carried the event)."""
    return _json_encoder.encode(event_to_dict(event))


def event_to_dict(event: Event) -> dict[str, Any]:
    """A JSON-friendly dict of an event: ``{"kind": tag, field: value, ...}``.

    Events are array-like on the wire; this form names every field (used by
    ``zeus-async subscribe --json`` and the exporters). A field itself named ``kind``
    (``DeviceFault.kind``) is written as ``<tag>_kind`` (``fault_kind``) so it cannot hide the
    event's tag.
    """
    kind = event_kind(event)
    out: dict[str, Any] = {}
    for name, value in _to_builtin(event).items():
        out[f"{kind}_kind" if name == "kind" else name] = value
    return {"kind": kind, **out}
