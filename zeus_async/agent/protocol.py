"""Messages between an agent and its clients (msgpack over a local ZeroMQ socket).

The agent binds a ROUTER socket (an ipc path in the private directory), each client connects
a DEALER. A client's first message is :class:`Hello`; then window edges (:class:`Edge`),
request edges of a serving process (:class:`RequestEdges`, batched), requests
(:class:`Control`) and finally :class:`Bye`. The agent answers with :class:`Reply` (settled
inference requests are pushed as ``requests`` replies).
Not a public interface: both ends come from the same installed package.
"""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from .. import errors
from ..carbon import CarbonConfig
from ..events import DeviceInfo, Event, Measurement
from ..runtime.processes import ProcessTracking

__all__ = [
    "AgentConfig",
    "Bye",
    "Control",
    "ControlOp",
    "Edge",
    "Hello",
    "Reply",
    "RequestEdges",
    "RequestResult",
    "RequestStep",
    "RequestTotals",
    "error_from_reply",
    "error_reply_fields",
]


class AgentConfig(msgspec.Struct, frozen=True):
    """Settings of an agent process (JSON on its command line).

    ``owner_pid`` makes it a *private* agent: it serves that one process, exits when that
    process is gone, and keeps window names as they are. Without one it is a *node* agent
    (``zeus-async agent``): any number of clients, window names published as
    ``<client>/<name>``, and ``exit_when_idle_s`` (when set) ends it that long after its last
    client left.
    """

    endpoint: str
    backend: str = "auto"
    gpus: list[int] | None = None
    cpus: list[int] | None = None
    period_s: float = 0.01
    fields: dict[str, float | None] | None = None
    #: ``None``: on where the energy counter is expensive to read (see ``Runtime``).
    adaptive_reads: bool | None = None
    #: NVIDIA GPUs' power scope (``gpu``, ``module``, ``auto``: :mod:`zeus_async.devices.nvml`).
    power_scope: str = "gpu"
    publish: str | None = None
    #: CURVE for ``publish``: the secret certificate file, and a directory of the client
    #: certificates allowed (``None``: any client that knows the public key).
    publish_curve_secret: str | None = None
    publish_curve_allow: str | None = None
    log_file: str | None = None
    finalize_timeout_s: float = 0.5
    sim_config: str | None = None
    owner_pid: int = 0
    record: str | None = None
    overwrite: bool = False
    processes: ProcessTracking | None = None
    meta: dict[str, str] = {}
    prometheus_port: int | None = None
    prometheus_addr: str = "127.0.0.1"
    prometheus_names: str = "native"
    otlp: str | None = None
    otlp_interval_s: float = 10.0
    exit_when_idle_s: float | None = None
    #: Hold the node lock (``agent.lock``): exit with code 3 if another node agent holds it.
    node: bool = False
    #: A *system* agent (``zeus-async agent --system``, root): serves every user its policy
    #: lets in, on a socket of ``system_group`` (``endpoint`` is ``ipc://<socket>``), keeps
    #: its journals in ``state_dir`` (root's alone) and checks each change against
    #: ``policy`` (a TOML file; ``None``: ``/etc/zeus-async/policy.toml``, the defaults when
    #: it is absent). See :mod:`zeus_async.agent.system` and :mod:`zeus_async.agent.policy`.
    system: bool = False
    system_group: str = "zeus-async"
    policy: str | None = None
    state_dir: str | None = None
    #: Host id stamped on the events (default: the host name); several agents on one machine
    #: (a test of a cluster) each need their own.
    host: str | None = None
    #: Learn which workload (Slurm job, pod container, user) holds each GPU and keep energy
    #: per workload (:mod:`.ledger`); a node or system agent does by default.
    workloads: bool = False
    #: The kubelet's PodResources socket, read for pods (``None``: no Kubernetes source).
    k8s_socket: str | None = None
    #: How long an ended workload's figures stay exported (seconds).
    workload_expire_s: float = 300.0
    #: A private agent's carbon configuration, for the CO2e and cost series of its exporters
    #: (``prometheus_port``, ``otlp``): its owner's ``Monitor(carbon=...)``. A node agent
    #: keeps none (its clients each have their own; it ignores one given, with a warning).
    carbon: CarbonConfig | None = None
    #: The node's request attributor (made at the first request edges of a client's
    #: :class:`~zeus_async.inference.remote.RemoteMeter`): how a GPU's energy is split among
    #: the requests in flight (``equal``, ``tokens``, ``steps``), a request's maximum age
    #: (settled ``unfinished`` past it), how late edges may come (the clients' batching,
    #: ``RequestMeter(max_edge_delay_s=...)``), how often it settles (seconds), the
    #: requests in flight at most, and the ``steps`` policy's base power (W, every GPU's:
    #: ``RequestMeter(step_base_w=...)``; ``None``: estimated per GPU from its idle power).
    requests_policy: str = "equal"
    requests_max_age_s: float = 600.0
    requests_edge_delay_s: float = 1.0
    requests_settle_s: float = 0.5
    requests_max_open: int = 100_000
    requests_step_base_w: float | None = None


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """Client to agent, first: who the client is and which GPUs it means."""

    pid: int
    name: str = ""
    #: The client's ``CUDA_VISIBLE_DEVICES`` (``None``: unset), so its GPU indices can be
    #: mapped onto the agent's.
    cuda_visible: str | None = None
    #: The GPUs (the client's indices) its windows measure; ``None``: every GPU it sees.
    gpus: list[int] | None = None
    #: Names of other clients (as they named themselves, before the agent's ``#n``) whose
    #: settled requests this client receives too (``RemoteMeter(follow=...)``): ``requests``
    #: replies with :attr:`Reply.sender` set.
    follow: list[str] = []


class Edge(msgspec.Struct, tag="edge", array_like=True):
    """A window edge, client to agent."""

    open: bool
    name: str
    id: int
    t_ns: int
    restart: bool = False
    cancel: bool = False
    #: A closing edge of a client with a time-varying carbon intensity: the instants inside
    #: the window where the intensity may change (``Carbon.cuts``); the agent's reply then
    #: carries the window's energy split there (:attr:`Reply.pieces`). Each client its own:
    #: clients of one agent may have different carbon configurations.
    cuts: list[int] = []


class Bye(msgspec.Struct, tag="stop", array_like=True):
    """Client to agent: finalize my windows, release my leases, forget me (a private agent
    then exits)."""


ControlOp = Literal[
    "set_power_limit",
    "set_sm_clocks",
    "publish",
    "release",
    "job_start",
    "job_end",
    "jobs",
    "requests",
]


class RequestStep(msgspec.Struct, array_like=True):
    """One engine step of a :class:`RequestEdges` batch (``RequestMeter.step``): its
    requests (the client's ids) with their prefill and decode tokens and context length."""

    start_ns: int
    end_ns: int
    #: The client's GPU indices that ran it (``None``: those of its requests).
    gpus: list[int] | None
    ids: list[str]
    prefill: list[int]
    decode: list[int]
    context: list[int]


class RequestEdges(msgspec.Struct, tag="requests", array_like=True):
    """Client to agent: a batch of a :class:`~zeus_async.inference.remote.RemoteMeter`'s
    request edges, in columns (one row per edge, in the order they were made).

    ``kind``: 0 begin, 1 phase, 2 end, 3 abort, 4 discard (not metered after all). ``id``:
    the client's request id (the agent prefixes it with the client's name). ``gpus``: a
    begin's GPUs (the client's indices, ``CUDA_VISIBLE_DEVICES`` applies), else empty.
    ``text``: a phase's name, an abort's reason. A token count of -1 stands for one that was
    not a non-negative integer (counted as bad input by the agent's meter).
    """

    kind: list[int]
    id: list[str]
    t_ns: list[int]
    gpus: list[list[int]]
    tokens_in: list[int]
    tokens_out: list[int]
    text: list[str]
    route: list[str]
    model: list[str]
    steps: list[RequestStep] = []


class RequestResult(msgspec.Struct, array_like=True, omit_defaults=True):
    """Agent to client: one settled request (``RequestEnergy`` on the wire), with the
    client's request id and GPU indices."""

    request_id: str
    energy_j: float
    gpu_energy_j: dict[int, float]
    prefill_j: float | None
    decode_j: float | None
    tokens_in: float
    tokens_out: float
    time_s: float
    method: str
    begin_ns: int
    end_ns: int
    decode_ns: int | None = None
    route: str = ""
    model: str = ""
    finish_reason: str = "completed"
    error_j: float = 0.0


class RequestTotals(msgspec.Struct, omit_defaults=True):
    """The node's request attributor as a ``requests`` control reply has it: per GPU (the
    agent's indices) over everything settled, the measured energy and where it went; the
    agent's own counts (``MeterTotals``) and backlog (``MeterState``)."""

    active: bool = False
    policy: str = ""
    energy_j: dict[int, float] = {}
    requests_j: dict[int, float] = {}
    idle_j: dict[int, float] = {}
    requests: int = 0
    dropped_edges: int = 0
    bad_input: dict[str, int] = {}
    finished: dict[str, int] = {}
    in_flight: int = 0
    unsettled: int = 0
    settled_ns: int | None = None
    #: Requests of clients that left (or died) aborted as ``cancelled`` by the agent.
    orphaned: int = 0
    #: Results sent back to their clients.
    returned: int = 0
    #: Results sent to followers (``Hello.follow``) too.
    followed: int = 0
    #: ``request`` / ``request_idle`` events not published (too many waited for the hub).
    unpublished: int = 0


class JobSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """A Slurm job as its prolog announces it (``job_start``) or its epilog ends it
    (``job_end``: only ``job_id`` counts). ``gpus``: NVML indices or ``GPU-...`` UUIDs."""

    job_id: str
    gpus: list[str] = []
    user: str | None = None
    uid: int | None = None
    partition: str | None = None
    name: str | None = None


class JobReport(msgspec.Struct, omit_defaults=True):
    """A workload's energy as the agent's ledger has it (``job_end``, ``jobs``)."""

    key: str
    kind: str
    gpus: list[int] = []
    energy_j: dict[int, float] = {}
    job_id: str | None = None
    user: str | None = None
    uid: int | None = None
    partition: str | None = None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    started_ns: int | None = None
    ended_ns: int | None = None

    @property
    def total_j(self) -> float:
        return sum(self.energy_j.values())


class Control(msgspec.Struct, tag="control", array_like=True):
    """Client to agent: act on the devices or the stream; answered by a ``control`` reply.

    ``op`` is ``set_power_limit`` (``watts`` on ``gpus``, all when ``None``), ``set_sm_clocks``
    (``mhz`` on ``gpus``; ``None`` resets), ``release`` (put back what this client changed on
    ``gpus``; ``setting`` narrows it), ``publish`` (``event`` published on the agent's hub),
    ``job_start`` / ``job_end`` (a Slurm prolog announces ``job``, its epilog ends it and gets
    its energy back), ``jobs`` (every workload the agent knows, with its energy) or
    ``requests`` (the node's request attributor's totals: :attr:`Reply.requests_totals`).
    """

    seq: int
    op: ControlOp
    watts: float = 0.0
    gpus: list[int] | None = None
    source: str = ""
    event: Event | None = None
    mhz: float | None = None
    setting: Literal["power_limit", "sm_clocks"] | None = None
    #: ``job_start`` / ``job_end``: the job (a prolog's or epilog's; root or the agent's user).
    job: JobSpec | None = None


class Reply(msgspec.Struct, omit_defaults=True):
    """Agent to client."""

    kind: Literal["ready", "measurement", "error", "control", "bye", "requests"]
    gpus: list[int] = []
    cpus: list[int] = []
    backend: str = ""
    endpoint: str | None = None
    measurement: Measurement | None = None
    message: str = ""
    seq: int = 0
    error_type: str = ""
    devices: list[DeviceInfo] = []
    prometheus_port: int | None = None
    #: ``ready``: the agent's pid, which attached clients watch (they fail fast if it dies).
    agent_pid: int = 0
    #: ``ready``: the power board's file (provisional window figures), and the agent's GPU
    #: index of each of the client's ``gpus``, in order.
    board: str | None = None
    board_gpus: list[int] = []
    #: ``ready``: the agent is a system agent (root's): a client that sees it die cannot
    #: restore its settings (its journals are root's); the next system agent start does.
    system: bool = False
    #: For ``error`` replies about a path: the path (``FileNotFoundError`` and friends).
    filename: str | None = None
    errno: int | None = None
    #: ``control`` replies to ``job_end`` (the job) and ``jobs`` (every workload known).
    jobs: list[JobReport] = []
    #: ``measurement`` replies to a window closed with ``cuts``: per piece between the
    #: window's start, its cuts and its end, the joules of every device it measures and of
    #: its GPUs only.
    pieces: list[tuple[float, float]] = []
    #: ``requests`` replies (pushed, unasked): requests of this client the node's attributor
    #: settled over ``[start_ns, end_ns]`` of ``policy``; or, ``sender`` set, requests of the
    #: client of that name this one follows (:attr:`Hello.follow`), with that client's ids.
    requests: list[RequestResult] = []
    sender: str = ""
    start_ns: int = 0
    end_ns: int = 0
    policy: str = ""
    #: ``control`` replies to ``requests``.
    requests_totals: RequestTotals | None = None


_BUILTIN_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        KeyError,
        OSError,
        FileNotFoundError,
        FileExistsError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
        TimeoutError,
    )
}


def error_reply_fields(exc: BaseException) -> dict[str, object]:
    """What a reply carries of ``exc`` so the client can raise the same type."""
    fields: dict[str, object] = {
        "error_type": type(exc).__name__,
        "message": str(exc) if not isinstance(exc, OSError) else (exc.strerror or str(exc)),
    }
    if isinstance(exc, OSError):
        fields["errno"] = exc.errno
        if exc.filename is not None:
            fields["filename"] = os.fsdecode(exc.filename)
    return fields


def error_from_reply(reply: Reply, context: str = "") -> Exception:
    """The exception a failed reply stands for, of the type raised in the agent where that
    type is one of ours or a built-in one (``ConfigError``, ``NoPermissionError``,
    ``FileNotFoundError`` naming the path, ...); else a ``RuntimeError``."""
    name, message = reply.error_type, reply.message
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.ZeusAsyncError):
        return cls(f"{context}{message}")
    builtin = _BUILTIN_ERRORS.get(name)
    if builtin is not None and issubclass(builtin, OSError):
        if reply.errno is not None:
            return builtin(reply.errno, f"{context}{message}", reply.filename)
        return builtin(f"{context}{message}")
    if builtin is not None:
        return builtin(f"{context}{message}")
    return RuntimeError(f"{context}{name}: {message}" if name else f"{context}{message}")
