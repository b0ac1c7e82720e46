"""The runtime: one sampler task per device, a hub, optional ZeroMQ publisher and consumers.

Lifecycle (structured concurrency, anyio)::

    async with Runtime(backend="sim", publish="tcp://127.0.0.1:5555") as rt:
        events = rt.subscribe()          # lossless in-process consumer
        ...

On entry the publisher binds first (so nothing sampled is published before the socket exists),
then a :class:`~zeus_async.events.StreamInfo` describing every device is published, then every
sampler starts and reports readiness. On exit the order is reversed: samplers stop, consumer
streams are closed and drained (bounded by ``shutdown_timeout_s``), the publisher flushes, and
devices are closed.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

import anyio
from anyio.abc import ObjectReceiveStream, TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from .._threads import run_sync
from ..aggregate.footprints import Carbon
from ..aggregate.windows import WindowResult, WindowTracker
from ..clock import Clock, RealClock
from ..devices import OpenedDevices, is_simulated, open_devices
from ..devices.base import Device, GpuControl, GpuProcessReader
from ..devices.processes import ProcessSource
from ..errors import ConfigError, sole_exception
from ..events import ClockChange, DeviceFault, Event, PowerLimitChange, StreamInfo

if TYPE_CHECKING:
    from ..agent.journal import LeaseEntry, Setting
    from ..agent.leases import Leases
    from ..bus.curve import CurveServerKeys
from .hub import EventBatches, Hub
from .processes import EnergyMeter, ProcessSampler, ProcessTracking, WorkloadOf
from .sampler import Sampler

__all__ = ["DEFAULT_GPU_FIELDS", "Runtime", "WindowHandle"]

logger = logging.getLogger(__name__)

#: Default GPU fields and their periods (``None`` = the base period). Power and energy follow
#: the base period (they feed window energy); slow-moving fields are read less often.
DEFAULT_GPU_FIELDS: Mapping[str, float | None] = {
    "power_w": None,
    "energy_j": None,
    "avg_power_w": 0.1,
    "sm_clock_hz": 0.1,
    "utilization_frac": 0.1,
    "temperature_c": 0.5,
    "memory_used_bytes": 0.5,
    "power_limit_w": 1.0,
}

Consumer = Callable[[Any], Awaitable[None]]
"""A consumer coroutine function: takes an ``ObjectReceiveStream[Event]`` (or an
:class:`~zeus_async.runtime.hub.EventBatches` when started with ``batched=True``)."""


class WindowHandle:
    """What ``async with runtime.window(name) as w`` yields; ``w.result`` is set on exit."""

    __slots__ = ("name", "result")

    def __init__(self, name: str) -> None:
        self.name = name
        self.result: WindowResult | None = None


#: Environment variable: how long an isolated output (recording, window log) may take nothing
#: while events wait before it is detached as stalled (seconds; default 10).
STALL_ENV_VAR = "ZEUS_ASYNC_STALL_S"


def output_stall_s() -> float:
    """The stall timeout of isolated outputs (``$ZEUS_ASYNC_STALL_S``, default 10 s)."""
    text = os.environ.get(STALL_ENV_VAR, "").strip()
    if not text:
        return 10.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(f"{STALL_ENV_VAR} must be a positive number of seconds, got {text!r}")
    return value


#: An energy-counter read at least this long (s) turns adaptive reads on by default (the
#: counter refreshes every ~100 ms: reading it at every 10 ms tick is then mostly waste).
EXPENSIVE_ENERGY_READ_S: Final = 0.5e-3


class Runtime:
    """Samples devices and fans their events out.

    Args:
        devices: Devices to sample; when ``None`` they are opened with ``backend``/``gpus``/
            ``cpus`` (see :func:`~zeus_async.devices.open_devices`) and closed on exit.
        backend: ``auto``, ``nvml`` or ``sim``.
        gpus: Logical GPU indices, ``None`` for all.
        cpus: RAPL packages: ``"auto"`` (if readable), indices, or ``None``.
        period_s: Base sampling period (default 10 ms).
        fields: GPU field name to its period in seconds (``None`` = base period); default
            :data:`DEFAULT_GPU_FIELDS`. Fields a device lacks are skipped.
        adaptive_reads: Skip the reads of power and energy fields (those on the base period)
            that can only repeat their last value, once their refresh period is learnt; what
            consumers integrate is unchanged (:mod:`~zeus_async.runtime.change_tracker`).
            ``None`` (default): on for a device whose energy counter costs at least
            :data:`EXPENSIVE_ENERGY_READ_S` a read (an H100 on driver 580 was measured at
            3.8 ms: reading it every 10 ms took 40 % of a core), off elsewhere.
        clock: Injected clock (tests use :class:`~zeus_async.clock.FakeClock`).
        host: Host id stamped on events (default: the host name).
        publish: A ZeroMQ endpoint to publish on (``tcp://127.0.0.1:5555``, ``ipc://...``) or a
            ready-made :class:`~zeus_async.bus.Publisher`. Publishing requires the asyncio
            backend.
        publish_curve: CURVE server keys for the ``publish`` endpoint
            (:func:`~zeus_async.bus.curve.load_server_keys`).
        sim_config: Simulator settings for the ``sim`` backend.
        power_scope: NVIDIA GPUs' power scope: ``gpu`` (default), ``module`` (Grace
            superchips: GPU + CPU + memory, integrated) or ``auto``
            (:mod:`~zeus_async.devices.nvml`); each device's ``DeviceInfo.power_scope`` says
            which it reads.
        shutdown_timeout_s: Bound on the orderly shutdown (draining consumers, flushing).
        consumers: Coroutine functions started (see :meth:`start_consumer`) before the first
            event is published, so they see the whole stream.
        windows: Keep device histories for measurement windows (:meth:`window`,
            :attr:`tracker`); costs a few microseconds per sample, so it is opt-in.
        finalize_timeout_s: Bound on how long a window's energy waits for post-edge data.
        window_board: With ``windows``: a file to share the power board on, from which other
            processes compute provisional window figures (:mod:`zeus_async.aggregate.board`;
            removed at exit); ``None``: a board read in this process only.
        record: Write every event to this recording file (lossless consumer, see
            :mod:`zeus_async.store`), with the devices in its header. An existing recording
            is refused (:class:`FileExistsError`) unless ``overwrite``.
        overwrite: Let ``record`` replace an existing recording (and drop its old parts).
        rapl_root: powercap sysfs root.
        processes: Track processes (:class:`~.processes.ProcessTracking`; ``True`` = this
            process and its descendants, every second): publishes
            :class:`~zeus_async.events.ProcessSample` events with CPU, memory and attributed
            CPU/DRAM/GPU power (see :mod:`zeus_async.runtime.processes`).
        process_source: Host-side process readings (default: psutil; tests pass a fake).
        process_workload: With ``processes``: ``workload_of(pid, gpus) -> key`` fills each
            process sample's ``workload`` (:data:`~.processes.WorkloadOf`; a node agent passes
            its workload resolver's). Asked from the process sampler's first period on, in its
            thread, so it must be ready when the runtime is entered.
        prometheus_port: Serve a Prometheus endpoint (:mod:`zeus_async.exporters.prometheus`)
            at this port while the runtime runs (``0``: any free port; the bound one is
            :attr:`prometheus_port`).
        prometheus_addr: Address it binds (default loopback; ``0.0.0.0`` for every interface).
        prometheus_names: Its metric names: ``native`` (``zeus_gpu_power_watts``...),
            ``dcgm`` (dcgm-exporter's ``DCGM_FI_DEV_POWER_USAGE``... for the GPU series) or
            ``amd`` (the AMD Device Metrics Exporter's ``gpu_package_power``...).
        otlp: Push the measurements to this OpenTelemetry OTLP/HTTP metrics endpoint
            (:mod:`zeus_async.exporters.otlp`; the ``otel`` extra), with the run metadata
            (``meta``: job, rank...) as resource attributes.
        otlp_interval_s: Seconds between OTLP exports.
        meta: Run metadata, in the recording header (``record``) and the
            :class:`~zeus_async.events.StreamInfo` event.
        carbon: Emissions and cost beside the energy (a
            :class:`~zeus_async.carbon.CarbonConfig`, opened once, or an intensity source):
            every window's footprint (:attr:`WindowResult.footprint
            <zeus_async.aggregate.WindowResult.footprint>`) and the exporters' CO2e
            counters. ``None`` (default): no carbon figures.
    """

    def __init__(
        self,
        devices: Sequence[Device] | None = None,
        *,
        backend: str = "auto",
        gpus: Sequence[int] | None = None,
        cpus: Sequence[int] | str | None = "auto",
        period_s: float = 0.01,
        fields: Mapping[str, float | None] | None = None,
        adaptive_reads: bool | None = None,
        clock: Clock | None = None,
        host: str | None = None,
        publish: str | Any | None = None,
        publish_curve: CurveServerKeys | None = None,
        sim_config: object | None = None,
        power_scope: str = "gpu",
        shutdown_timeout_s: float = 2.0,
        rapl_root: str = "/sys/class/powercap",
        consumers: Sequence[Consumer] = (),
        windows: bool = False,
        finalize_timeout_s: float = 0.5,
        window_board: str | None = None,
        record: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
        processes: ProcessTracking | bool | None = None,
        process_source: ProcessSource | None = None,
        process_workload: WorkloadOf | None = None,
        meta: Mapping[str, str] | None = None,
        prometheus_port: int | None = None,
        prometheus_addr: str = "127.0.0.1",
        prometheus_names: str = "native",
        otlp: str | None = None,
        otlp_interval_s: float = 10.0,
        carbon: Any = None,
    ) -> None:
        if not period_s > 0:
            raise ConfigError(f"period_s must be positive, got {period_s!r}")
        if cpus is not None and isinstance(cpus, str) and cpus != "auto":
            raise ConfigError(
                f"cpus must be 'auto', a list of package indices or None, not {cpus!r}"
            )
        self._given_devices = list(devices) if devices is not None else None
        self._backend = backend
        self._gpus = gpus
        self._cpus = cpus
        self.period_s = period_s
        self._fields = dict(fields if fields is not None else DEFAULT_GPU_FIELDS)
        self._adaptive = adaptive_reads
        self.clock: Clock = clock or RealClock()
        self.host = host or socket.gethostname()
        self._publish_arg = publish
        if publish_curve is not None and not isinstance(publish, str):
            raise ConfigError("publish_curve needs publish= an endpoint to bind")
        self._publish_curve = publish_curve
        self._sim_config = sim_config
        self._power_scope = power_scope
        self._shutdown_timeout_s = shutdown_timeout_s
        self._rapl_root = rapl_root
        self.stream_id = uuid.uuid4().hex
        self.hub = Hub()
        self.devices: list[Device] = []
        self.backend: str = backend
        self.samplers: list[Sampler] = []
        self.publisher: Any | None = None
        self._stack: AsyncExitStack | None = None
        self._tg: TaskGroup | None = None
        # Created on entry: anyio primitives need the running event loop.
        self._sampler_scope: anyio.CancelScope
        self._samplers_done: anyio.Event
        self._consumer_scopes: list[anyio.CancelScope] = []
        self._control_lock = anyio.Lock()
        self._consumers_done: anyio.Event
        self._consumers_running = 0
        self._owns_devices = devices is None
        self._initial_consumers = list(consumers)
        self._windows = windows
        self._finalize_timeout_s = finalize_timeout_s
        self._window_board = window_board
        self.carbon = Carbon.of(carbon)
        self.tracker: WindowTracker | None = None
        self._record = record
        self._overwrite = overwrite
        self._meta = dict(meta or {})
        self.recorder: Any | None = None
        if processes is True:
            processes = ProcessTracking()
        self._processes: ProcessTracking | None = processes or None
        self._process_source = process_source
        self._process_workload = process_workload
        self.process_sampler: ProcessSampler | None = None
        self._meter: EnergyMeter | None = None
        self._prometheus = (prometheus_port, prometheus_addr)
        self._prometheus_names = prometheus_names
        self._otlp = (otlp, otlp_interval_s)
        #: The bound Prometheus port while running (``None`` without an endpoint).
        self.prometheus_port: int | None = None
        self.exporter: Any | None = None
        #: Leases on GPU settings changed through this runtime (created at the first change).
        self.leases: Leases | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Runtime:
        if self._stack is not None:
            raise RuntimeError("a Runtime can be entered only once")
        self._sampler_scope = anyio.CancelScope()
        self._samplers_done = anyio.Event()
        self._consumers_done = anyio.Event()
        self._tracker_scope = anyio.CancelScope()
        self._tracker_done = anyio.Event()
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            if self._owns_devices:
                await self._recover_orphans()
            self._open_devices()
            stack.callback(self._close_devices)
            if self._prometheus[0] is not None:
                # Bind before any task starts, so a port in use is a plain ConfigError.
                self._start_exporter(stack)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._stack = stack
            if self._record is not None:
                from ..store import Recorder, RecordingHeader

                header = RecordingHeader(
                    host=self.host,
                    start_wall_ns=self.clock.wall_ns(),
                    pid=os.getpid(),
                    argv=list(sys.argv),
                    devices=[d.describe() for d in self.devices],
                    meta=dict(self._meta),
                    compression="zstd",
                )
                self.recorder = Recorder(
                    self._record,
                    header=header,
                    clock=self.clock,
                    write_timeout_s=output_stall_s(),
                    overwrite=self._overwrite,
                )
                self.start_consumer(
                    self.recorder.run, max_buffer=16384, batched=True, isolate="recorder"
                )
            if self._windows:
                self.tracker = WindowTracker(
                    self.clock,
                    self.host,
                    [d.describe() for d in self.devices],
                    publish=self.publish_nowait,
                    finalize_timeout_s=self._finalize_timeout_s,
                    board=self._window_board or True,
                    carbon=self.carbon,
                )
                self._stack.callback(self.tracker.close_board)
                # A sink, not a consumer: accounting a sample is a few list appends, and a
                # stream would cost a task switch per event on this thread.
                self.hub.add_sink(self.tracker.add)
                self._tg.start_soon(self._run_tracker_pump)
            for consumer in self._initial_consumers:
                self.start_consumer(consumer)
            if self.exporter is not None:
                self.start_consumer(self.exporter.run, batched=True)
            if self._otlp[0] is not None:
                from ..exporters.otlp import OtlpExporter

                otlp = OtlpExporter(
                    self._otlp[0], interval_s=self._otlp[1], resource=self._meta, carbon=self.carbon
                )
                self._stack.callback(otlp.close)
                self.start_consumer(otlp.run, batched=True, isolate="OTLP export")
            if self._processes is not None:
                self._meter = EnergyMeter()
                self.hub.add_sink(self._meter.add)
            if self._publish_arg is not None:
                await self._start_publisher(self._tg)
            if self.devices:
                # (A runtime without devices, a replay, describes nothing in its events: the
                # replayed stream's own StreamInfo does. Its publisher still answers with one.)
                await self.hub.publish(self.stream_info())
            await self._tg.start(self._run_samplers)
            if self.tracker is not None and self.devices:
                # Ready for windows once every energy counter has moved a few times (~0.3 s): a
                # window opened right away then has exact anchors before it.
                await self.tracker.wait_primed(max(self._finalize_timeout_s, 1.0))
        except BaseException as exc:
            self._sampler_scope.cancel()
            try:
                await stack.__aexit__(type(exc), exc, exc.__traceback__)
            except BaseException as closing:
                # The task group reports a failed start (a bad endpoint, a device that would
                # not open) as a group holding that same error: raise the error itself.
                if sole_exception(closing) is not exc:
                    raise
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._stack is not None and self._tg is not None
        with anyio.CancelScope(shield=True):
            # Put back every setting changed through us while devices are open and consumers
            # (the recorder, the bus) still receive the change events.
            await self._restore_all()
            if self.tracker is not None and exc_type is None:
                # Windows closed last get their exact figures while samples still come.
                await self.tracker.drain(self._finalize_timeout_s + 0.05)
            self._sampler_scope.cancel()
            await self._samplers_done.wait()
            # Finalize pending windows while consumers can still receive the measurements.
            self._tracker_scope.cancel()
            if self.tracker is not None:
                await self._tracker_done.wait()
            self.hub.close()
            if self._consumers_running:
                with anyio.move_on_after(self._shutdown_timeout_s):
                    await self._consumers_done.wait()
                if self._consumers_running:
                    logger.warning(
                        "%d consumer(s) did not drain within %.1f s; cancelling them",
                        self._consumers_running,
                        self._shutdown_timeout_s,
                    )
            for scope in self._consumer_scopes:
                scope.cancel()
            self._tg.cancel_scope.cancel()
        return await self._stack.__aexit__(exc_type, exc, tb)

    def _open_devices(self) -> None:
        if self._given_devices is not None:
            self.devices = self._given_devices
            return
        opened: OpenedDevices = open_devices(
            self._backend,
            self._gpus,
            self._cpus,  # type: ignore[arg-type]
            clock=self.clock,
            sim_config=self._sim_config,
            rapl_root=self._rapl_root,
            power_scope=self._power_scope,
        )
        self.backend = opened.backend
        self.devices = opened.all
        if is_simulated(self.backend) and any(d.key.startswith("gpu:") for d in self.devices):
            # Provenance: the recording header, every StreamInfo (subscribers, exporters) and
            # the OTLP resource say that the GPU figures are simulated.
            self._meta["simulated"] = "true"
        if not self.devices:
            logger.warning("no device to sample (no GPU and no readable RAPL package)")

    def _start_exporter(self, stack: AsyncExitStack) -> None:
        from ..exporters.prometheus import PrometheusExporter

        port, addr = self._prometheus
        assert port is not None
        exporter = PrometheusExporter(names=self._prometheus_names, carbon=self.carbon)
        self.prometheus_port = exporter.serve(port, addr)
        stack.callback(exporter.close)
        self.exporter = exporter
        logger.info("Prometheus endpoint: http://%s:%d/metrics", addr, self.prometheus_port)

    def _close_devices(self) -> None:
        if not self._owns_devices:
            return
        for device in self.devices:
            try:
                device.close()
            except Exception:
                logger.exception("closing %s failed", device.key)

    async def _start_publisher(self, tg: TaskGroup) -> None:
        from ..bus import Publisher

        if isinstance(self._publish_arg, str):
            self.publisher = Publisher(
                self._publish_arg,
                host=self.host,
                stream_id=self.stream_id,
                stream_info=self.stream_info(),
                curve=self._publish_curve,
            )
        else:
            self.publisher = self._publish_arg
        publisher = self.publisher
        assert publisher is not None
        await tg.start(publisher.run)
        self.hub.add_sink(publisher.publish)

    def stream_info(self) -> StreamInfo:
        """The :class:`StreamInfo` event describing this runtime and its devices."""
        return StreamInfo(
            host=self.host,
            t_ns=self.clock.wall_ns(),
            stream_id=self.stream_id,
            pid=os.getpid(),
            argv=list(sys.argv),
            devices=[d.describe() for d in self.devices],
            meta=dict(self._meta),
        )

    async def _run_samplers(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with self._sampler_scope:
                origin = self.clock.monotonic_ns()
                async with anyio.create_task_group() as tg:
                    for device in self.devices:
                        sampler = Sampler(
                            device,
                            self.hub,
                            self.clock,
                            host=self.host,
                            period_s=self.period_s,
                            fields=self._fields_for(device),
                            grid_origin_ns=origin,
                            adaptive=self._adaptive_for(device),
                        )
                        self.samplers.append(sampler)
                        await tg.start(sampler.run)
                    if self._processes is not None:
                        await tg.start(self._make_process_sampler().run)
                    task_status.started()
        finally:
            self._samplers_done.set()

    def _make_process_sampler(self) -> ProcessSampler:
        assert self._processes is not None and self._meter is not None
        source = self._process_source
        if source is None:
            from ..devices.processes import default_source

            source = default_source()
        gpus = [d for d in self.devices if isinstance(d, GpuProcessReader)]
        self.process_sampler = ProcessSampler(
            self._processes,
            source,
            gpus,
            self.hub,
            self.clock,
            self.host,
            self._meter,
            workload_of=self._process_workload,
        )
        return self.process_sampler

    def _fields_for(self, device: Device) -> Mapping[str, float | None]:
        if device.key.startswith("gpu:"):
            info = device.describe()
            if (
                info.power_average_period_s > 0
                and not info.has_energy_counter
                and self._fields.get("avg_power_w", 0.0) is not None
                and "avg_power_w" in self._fields
            ):
                # Window energy comes from the driver's average here: read it every tick,
                # so that its refresh instants are seen to within a tick.
                return {**self._fields, "avg_power_w": None}
            return self._fields
        return dict.fromkeys(device.fields)

    # -- consumers ---------------------------------------------------------------------------

    def subscribe(self, max_buffer: int = 4096) -> ObjectReceiveStream[Event]:
        """A lossless stream of every event published from now on (ends at shutdown)."""
        return self.hub.subscribe(max_buffer)

    async def publish(self, event: Event) -> None:
        """Inject an event (window edges, optimizer decisions, replayed events)."""
        await self.hub.publish(event)

    async def _run_tracker_pump(self) -> None:
        assert self.tracker is not None
        try:
            with self._tracker_scope:
                await self.tracker.run_pump()
        finally:
            self._tracker_done.set()

    async def _recover_orphans(self) -> None:
        from ..agent.leases import recover_orphans

        try:
            await run_sync(recover_orphans)
        except Exception:
            logger.exception("restoring settings left by dead processes failed")

    def _leases(self) -> Leases:
        if self.leases is None:
            from ..agent.leases import Leases
            from ..devices.sim_config import SIM_ENV_VAR

            sim_json: str | None = None
            if is_simulated(self.backend):
                if self._sim_config is not None:
                    import msgspec

                    sim_json = msgspec.json.encode(self._sim_config).decode()
                else:
                    sim_json = os.environ.get(SIM_ENV_VAR)
            self.leases = Leases(self.backend, sim_json)
        return self.leases

    async def _take(
        self,
        control: GpuControl,
        setting: Setting,
        holder: str,
        pid: int | None,
        source: str,
        read_original: Callable[[], float | None],
    ) -> bool:
        """Hold ``setting`` of ``control`` for ``holder``; whether the lease is new."""
        uuid = control.describe().uuid if isinstance(control, Device) else f"index-{control.index}"
        leases = self._leases()
        return await run_sync(
            functools.partial(
                leases.take,
                uuid=uuid or f"index-{control.index}",
                gpu=control.index,
                setting=setting,
                holder=holder,
                read_original=read_original,
                pid=pid,
                source=source,
            )
        )

    async def _take_all(
        self,
        controls: Sequence[GpuControl],
        setting: Setting,
        holder: str,
        pid: int | None,
        source: str,
    ) -> None:
        """Take ``setting``'s lease on every GPU of a request before any GPU is changed, so
        that a lease that cannot be journalled (a full disk) or is held by another client
        leaves every GPU as it was; the leases this request took are dropped again then."""
        new: list[GpuControl] = []
        try:
            for control in controls:
                original: Callable[[], float | None] = (
                    control.get_power_limit_w if setting == "power_limit" else lambda: None
                )
                if await self._take(control, setting, holder, pid, source, original):
                    new.append(control)
        except BaseException:
            held = self._held(holder, new, setting) if new else []
            if held:
                with anyio.CancelScope(shield=True):
                    try:
                        await run_sync(self._leases().forget, held)
                    except Exception as exc:  # kept: restored later, to the value in force
                        logger.warning("dropping the leases of a refused change failed: %s", exc)
            raise

    async def set_power_limit(
        self,
        watts: float,
        gpus: Sequence[int] | None = None,
        *,
        source: str = "",
        holder: str = "",
        pid: int | None = None,
    ) -> list[PowerLimitChange]:
        """Set the power limit of GPUs (all by default); returns the published changes.

        Each NVML call runs in a worker thread (it can take milliseconds), so sampling and the
        event loop never wait on it. A :class:`~zeus_async.events.PowerLimitChange` event is
        published for every GPU whose limit was set, with ``source`` saying who asked.

        The first change of a GPU's limit by ``holder`` takes a lease
        (:mod:`zeus_async.agent.leases`): the limit in force is journalled (fsynced) before
        the change, and put back by :meth:`release`, when the runtime stops, or — if this
        process is killed — by the next runtime or agent to start on the node.

        Raises:
            NoPermissionError: The process may not change power limits.
            ConfigError: ``watts`` outside a GPU's range, or an unknown GPU index.
            LeaseConflictError: Another holder holds the limit of one of the GPUs.
        """
        if not (isinstance(watts, (int, float)) and math.isfinite(watts)):
            raise ConfigError(f"power limit must be a finite number of watts, not {watts!r}")
        controls = self._gpu_controls(gpus)
        changes: list[PowerLimitChange] = []
        # One change at a time, in the order asked (callers from other threads start a task
        # per request; the lock is FIFO, so the last request is the limit left in force).
        async with self._control_lock:
            for control in controls:
                lo, hi = await run_sync(control.power_limit_range_w)
                if not lo <= watts <= hi:
                    raise ConfigError(
                        f"power limit {watts:g} W for gpu:{control.index} is outside the "
                        f"supported range [{lo:g}, {hi:g}] W"
                    )
            # Every lease first: a refusal on one GPU changes none.
            await self._take_all(controls, "power_limit", holder, pid, source)
            for control in controls:
                changes.append(await self._set_one_limit(control, watts, source))
                # Back to the value in force before the lease: nothing left to restore.
                held = self._held(holder, [control], "power_limit")
                if held and held[0].original_w == float(watts):
                    await run_sync(self._leases().forget, held)
        return changes

    async def _set_one_limit(
        self, control: GpuControl, watts: float, source: str
    ) -> PowerLimitChange:
        previous = await run_sync(control.get_power_limit_w)
        await run_sync(control.set_power_limit_w, watts)
        change = PowerLimitChange(
            host=self.host,
            t_ns=self.clock.wall_ns(),
            gpu=control.index,
            power_limit_w=float(watts),
            previous_w=previous,
            source=source,
        )
        await self.publish(change)
        return change

    async def set_sm_clocks(
        self,
        mhz: float | None,
        gpus: Sequence[int] | None = None,
        *,
        source: str = "",
        holder: str = "",
        pid: int | None = None,
    ) -> list[ClockChange]:
        """Lock the SM clock of GPUs (all by default) to ``mhz``, or reset it with ``None``.

        Like :meth:`set_power_limit`: NVML runs in a worker thread, requests are applied one
        at a time in the order made, a :class:`~zeus_async.events.ClockChange` is published
        per GPU, and the first lock takes a lease. A reset by the lease's holder ends it.

        Raises:
            NoPermissionError: The process may not change clocks.
            ConfigError: An invalid clock, or an unknown GPU index.
            LeaseConflictError: Another holder holds the clocks of one of the GPUs.
        """
        if mhz is not None and not (
            isinstance(mhz, (int, float)) and math.isfinite(mhz) and mhz > 0
        ):
            raise ConfigError(f"SM clock must be a positive number of MHz, not {mhz!r}")
        controls = self._gpu_controls(gpus)
        hz = None if mhz is None else float(mhz) * 1e6
        changes: list[ClockChange] = []
        async with self._control_lock:
            if hz is not None:  # every lease first: a refusal on one GPU changes none
                await self._take_all(controls, "sm_clocks", holder, pid, source)
            for control in controls:
                if hz is None:
                    held = self._held(holder, [control], "sm_clocks")
                    await run_sync(control.reset_sm_clocks)
                    if held:
                        await run_sync(self._leases().forget, held)
                else:
                    await run_sync(control.lock_sm_clocks_hz, hz, hz)
                changes.append(await self._publish_clock(control, hz, source))
        return changes

    async def _publish_clock(
        self, control: GpuControl, hz: float | None, source: str
    ) -> ClockChange:
        change = ClockChange(
            host=self.host,
            t_ns=self.clock.wall_ns(),
            gpu=control.index,
            min_hz=hz,
            max_hz=hz,
            source=source,
        )
        await self.publish(change)
        return change

    def _held(
        self, holder: str | None, controls: Sequence[GpuControl] | None, setting: Setting | None
    ) -> list[LeaseEntry]:
        if self.leases is None:
            return []
        uuids = None
        if controls is not None:
            uuids = [c.describe().uuid for c in controls if isinstance(c, Device)]
        return self.leases.held_by(holder, uuids, None if setting is None else [setting])

    async def release(
        self,
        holder: str | None = "",
        gpus: Sequence[int] | None = None,
        setting: Setting | None = None,
        *,
        source: str = "restore",
    ) -> list[Event]:
        """End leases and put their settings back as they were before the first change.

        Args:
            holder: Whose leases (``None``: everyone's; ``""``: this process's own).
            gpus: Which GPUs (default all).
            setting: ``"power_limit"``, ``"sm_clocks"`` or ``None`` for both.
            source: The ``source`` of the published change events.

        Returns the change events published. A setting that cannot be restored stays in the
        journal (and is logged): the next agent start retries it.
        """
        controls = self._gpu_controls(gpus) if gpus is not None else None
        events: list[Event] = []
        async with self._control_lock:
            held = self._held(holder, controls, setting)
            if not held:
                return events
            by_uuid = {d.describe().uuid: d for d in self.devices if isinstance(d, GpuControl)}
            done: list[LeaseEntry] = []
            from ..agent.leases import restore_entry

            for entry in held:
                control = by_uuid.get(entry.uuid)
                if control is None:
                    continue
                try:
                    if entry.setting == "power_limit":
                        assert entry.original_w is not None
                        events.append(await self._set_one_limit(control, entry.original_w, source))
                    else:
                        await run_sync(restore_entry, control, entry)
                        events.append(await self._publish_clock(control, None, source))
                except Exception:
                    logger.exception("restoring %s of gpu:%d failed", entry.setting, entry.gpu)
                else:
                    done.append(entry)
            await run_sync(self._leases().forget, done)
        return events

    async def _restore_all(self) -> None:
        if self.leases is None or not self.leases.entries:
            return
        try:
            await self.release(None)
        except Exception:
            logger.exception("restoring hardware settings at shutdown failed")
        if self.leases.entries:
            self.leases.close()

    def _adaptive_for(self, device: Device) -> bool:
        """Whether ``device`` is sampled with adaptive reads: as asked, or (``None``) when
        reading its energy counter is expensive."""
        if self._adaptive is not None:
            return self._adaptive
        cost = getattr(device, "energy_read_cost_s", None)
        if cost is None or cost < EXPENSIVE_ENERGY_READ_S:
            return False
        logger.info(
            "%s: reading its energy counter costs %.2f ms: adaptive reads on (pass "
            "adaptive_reads=False to read it at every tick)",
            device.key,
            cost * 1e3,
        )
        return True

    def _gpu_controls(self, gpus: Sequence[int] | None) -> list[GpuControl]:
        controls = {d.index: d for d in self.devices if isinstance(d, GpuControl)}
        if gpus is None:
            return [controls[i] for i in sorted(controls)]
        unknown = [g for g in gpus if g not in controls]
        uncontrollable = {
            int(d.key.split(":", 1)[1]): d.describe()
            for d in self.devices
            if d.key.startswith("gpu:") and not isinstance(d, GpuControl)
        }
        if unknown and all(g in uncontrollable for g in unknown):
            info = uncontrollable[unknown[0]]
            raise ConfigError(
                f"gpu:{unknown[0]} ({info.name}, vendor {info.vendor or 'unknown'}) has no "
                "settings this runtime can change: no power cap or clocks through its backend "
                "(its DeviceInfo.capabilities say what it can do)"
            )
        if unknown:
            raise ConfigError(
                f"GPU(s) {unknown} are not controlled by this runtime (it has {sorted(controls)})"
            )
        return [controls[g] for g in gpus]

    def publish_nowait(self, event: Event) -> None:
        """Publish from the runtime's thread without awaiting (a task finishes it if needed)."""
        index = self.hub.try_publish(event)
        if index >= 0 and self._tg is not None:
            self._tg.start_soon(self.hub.resume, event, index)

    @asynccontextmanager
    async def window(self, name: str, *, restart: bool = False) -> AsyncIterator[WindowHandle]:
        """Measure the block as window ``name``: ``async with rt.window("step") as w: ...``.

        On exit ``w.result`` holds the :class:`~zeus_async.aggregate.WindowResult`; await
        ``w.result.wait_async()`` for the final figures. Needs ``Runtime(windows=True)``.
        An exception inside the block cancels the window.
        """
        if self.tracker is None:
            raise RuntimeError("measurement windows need Runtime(windows=True)")
        handle = WindowHandle(name)
        self.tracker.open(name, restart=restart)
        try:
            yield handle
        except BaseException:
            self.tracker.close(name, cancel=True)
            raise
        handle.result = self.tracker.close(name)

    def start_consumer(
        self,
        consumer: Consumer,
        *,
        max_buffer: int = 4096,
        batched: bool = False,
        isolate: str | None = None,
        stall_s: float | None = None,
    ) -> None:
        """Run ``consumer(stream)`` as a task of the runtime.

        ``stream`` is a lossless receive stream of events (:meth:`subscribe`), or with
        ``batched=True`` an :class:`~zeus_async.runtime.hub.EventBatches` yielding lists of
        events (for consumers that handle events in bulk, such as the recorder).
        At shutdown the stream ends after the last event and the runtime waits (up to
        ``shutdown_timeout_s``) for the consumer to return, so nothing buffered is lost.

        With ``isolate`` (a name, e.g. ``"recorder"``), the consumer's failure does not stop
        the runtime: an exception it raises (a full disk, an unwritable path) is logged and
        published as a :class:`~zeus_async.events.DeviceFault` (device ``consumer:<name>``,
        kind ``consumer_failed``), and a consumer that takes nothing for ``stall_s`` seconds
        while events wait for it (a hung file system) is detached (kind
        ``consumer_stalled``): sampling, windows and the other consumers go on without it.
        With ``batched=True`` the watchdog sees every batch taken, so a consumer stuck in one
        write is detached before its buffer fills (and before it holds the publisher up); a
        plain stream's watchdog can only see a full buffer. ``stall_s`` defaults to
        ``$ZEUS_ASYNC_STALL_S``, else 10 s.
        """
        if self._tg is None:
            raise RuntimeError("start_consumer() needs an entered runtime")
        if stall_s is None:
            stall_s = output_stall_s()
        stream: ObjectReceiveStream[Event] | EventBatches = (
            self.hub.subscribe_batches(max_buffer) if batched else self.hub.subscribe(max_buffer)
        )
        if self._consumers_done.is_set():
            self._consumers_done = anyio.Event()
        self._consumers_running += 1

        scope = anyio.CancelScope()
        self._consumer_scopes.append(scope)

        async def run() -> None:
            try:
                with scope:
                    async with stream:
                        if isolate is None:
                            await consumer(stream)
                            return
                        watchdog = anyio.CancelScope()
                        assert self._tg is not None
                        self._tg.start_soon(
                            self._watch_stall, stream, isolate, stall_s, watchdog, scope
                        )
                        try:
                            await consumer(stream)
                        except Exception as exc:
                            self._consumer_fault(isolate, "consumer_failed", sole_exception(exc))
                        finally:
                            watchdog.cancel()
            finally:
                self._consumers_running -= 1
                if self._consumers_running == 0:
                    self._consumers_done.set()

        self._tg.start_soon(run)

    def _consumer_fault(self, name: str, kind: str, exc: BaseException | str) -> None:
        text = f"{name} failed: {exc}" if kind == "consumer_failed" else str(exc)
        logger.error("%s; sampling, windows and restores go on without it", text)
        self.publish_nowait(
            DeviceFault(
                host=self.host,
                t_ns=self.clock.wall_ns(),
                device=f"consumer:{name}",
                kind=kind,
                message=text,
            )
        )

    async def _watch_stall(
        self,
        stream: ObjectReceiveStream[Event] | EventBatches,
        name: str,
        stall_s: float,
        scope: anyio.CancelScope,
        consumer_scope: anyio.CancelScope,
    ) -> None:
        """Detach ``stream`` once its consumer has taken nothing for ``stall_s`` seconds while
        events waited for it (it hung)."""

        def waiting() -> tuple[bool, int]:
            # (events wait, a count that moves when the consumer takes some)
            if isinstance(stream, EventBatches):
                return stream.pending > 0, stream.taken
            if isinstance(stream, MemoryObjectReceiveStream):
                stats = stream.statistics()
                return bool(stats.current_buffer_used >= stats.max_buffer_size), 0
            return False, 0

        step = min(1.0, stall_s / 4)
        with scope:
            stuck_for = 0.0
            last = -1
            step_ns = round(step * 1e9)
            while True:
                await self.clock.sleep_until(self.clock.monotonic_ns() + step_ns)
                pending, taken = waiting()
                stuck_for = stuck_for + step if pending and taken == last else 0.0
                last = taken
                if stuck_for >= stall_s:
                    break
            self._consumer_fault(
                name,
                "consumer_stalled",
                f"{name} has not taken an event for {stall_s:g} s (its target stalled?); "
                "detached, what it had not written is lost",
            )
            await stream.aclose()
            consumer_scope.cancel()
