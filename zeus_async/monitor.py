"""``Monitor``: measurement windows for synchronous programs (training scripts, notebooks).

The replacement for Zeus's ``ZeusMonitor`` and ``ZeusProfilingService``::

    from zeus_async import Monitor

    monitor = Monitor()                      # all GPUs, RAPL if readable, 10 ms sampling
    monitor.begin_window("epoch")
    train_one_epoch()
    m = monitor.end_window("epoch")          # returns at once
    print(m.time, m.gpu_energy, m.total_energy)   # at once: provisional until exact (~0.1 s)
    m.wait()                                 # the exact, counter-based figures

    with monitor.window("step") as w:        # or as a context manager
        step()
    print(w.result.total_energy)

    monitor.push_window(); work(); res = monitor.pop_window()   # stack semantics

Sampling runs in a child process by default (:class:`~zeus_async.runtime.SamplerProcess`), so it
never competes with the training thread for the GIL; ``sampler="thread"`` runs it on an
:class:`~zeus_async.runtime.EmbeddedRuntime` thread instead (fake clocks, ``consumers``...). A
window edge costs the caller an optional device synchronization, a clock read and one small
local message (process) or queue append (thread); it never waits on NVML or I/O. Energy comes
from the GPUs' energy counters (split inside a counter period from the instant-power
readings, so short windows are never 0 J) or, before Volta, from integrated power; each
:class:`~zeus_async.aggregate.WindowResult` says per device which was used.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, cast

from ._exit import ClosedOnExit, call_at_exit
from .aggregate.footprints import Carbon, sum_footprints
from .aggregate.windows import WindowResult, WindowTracker, next_window_id, pop_open_window
from .carbon import CarbonConfig
from .errors import ConfigError
from .events import DeviceInfo, Event
from .model_complexity import ModelComplexity, model_complexity
from .ranks import RankInfo, rank_info, rank_path
from .runtime import EmbeddedRuntime, ProcessTracking
from .runtime.sampler_process import Edge, SamplerProcess
from .store.outputs import claim_output
from .store.window_log import window_log_consumer

__all__ = ["Monitor", "ProfilingResult", "WindowContext", "window_log_consumer"]

logger = logging.getLogger(__name__)

_Setting = Literal["power_limit", "sm_clocks"]


class ProfilingResult:
    """Result of :meth:`Monitor.pop_window`: seconds, and joules per GPU in the monitor's GPU
    order; unpacks and indexes like the ``(time, energy)`` tuple Zeus returns.

    The energies are provisional when :attr:`provisional` is true (the exact, counter-based
    figures come ~0.1 s after the window's end); :meth:`exact` waits for those.
    """

    __slots__ = ("_gpus", "_provisional", "energy", "time", "window")

    _gpus: Sequence[int]

    def __init__(
        self,
        time: float,
        energy: list[float],
        window: WindowResult | None = None,
        gpus: Sequence[int] = (),
    ) -> None:
        self.time = time
        self.energy = energy
        #: The window's full result (methods, error bounds, CPU energy...).
        self.window = window
        self._gpus = gpus
        self._provisional = False

    @property
    def provisional(self) -> bool:
        """Whether :attr:`energy` holds provisional figures (see the class docstring)."""
        return self.window is not None and self._provisional

    def exact(self, timeout: float | None = None) -> ProfilingResult:
        """The same window with its exact figures (waits for them, ``timeout`` seconds at most;
        :class:`TimeoutError` after)."""
        if self.window is None:
            return self
        energies = self.window.wait(timeout).gpu_energy_j
        return ProfilingResult(
            self.time, [energies.get(i, 0.0) for i in self._gpus], self.window, self._gpus
        )

    def __iter__(self) -> Iterator[Any]:
        return iter((self.time, self.energy))

    def __getitem__(self, index: int) -> Any:
        return (self.time, self.energy)[index]

    def __len__(self) -> int:
        return 2

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ProfilingResult | tuple):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.time, tuple(self.energy)))

    def __repr__(self) -> str:
        mark = ", provisional" if self.provisional else ""
        return f"ProfilingResult(time={self.time!r}, energy={self.energy!r}{mark})"


def _agent_endpoint(agent: str | bool | None, *, private_only: bool) -> str | None:
    """The endpoint to attach to, or ``None`` for a private agent (see ``Monitor(agent=)``)."""
    from .agent.client import (
        check_endpoint,
        ensure_node_agent,
        node_agent_endpoint,
        system_agent_endpoint,
    )

    if isinstance(agent, str):
        check_endpoint(agent)
        return agent
    if agent is False:
        return None
    if agent is None:
        if os.environ.get("ZEUS_ASYNC_AGENT", "").lower() in ("0", "off", "no", "false"):
            return None
        if private_only:
            return None
        running = node_agent_endpoint() or system_agent_endpoint()
        if running is not None:
            return running
        if "LOCAL_RANK" not in os.environ:
            return None
    return ensure_node_agent()


def _rank_gpus(info: RankInfo) -> list[int] | None:
    """A rank's GPU by default: the only visible one, else its local rank's; ``None`` (every
    GPU) outside a job of several ranks."""
    if not info.distributed and info.launcher != "LOCAL_RANK":
        return None
    return _local_gpus(info.local_rank)


def _local_gpus(local_rank: int) -> list[int]:
    """The GPU of the rank ``local_rank`` of its node: the only visible one, else its own."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1:
        return [0]
    return [local_rank]


def _indices(value: Sequence[int] | None, what: str) -> list[int] | None:
    """Device indices as given (``None``: all), or a :class:`ConfigError` naming the value."""
    if value is None:
        return None
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return [operator.index(i) for i in value]  # ints, numpy's too
    except TypeError:
        raise ConfigError(
            f"{what} must be a list of device indices such as [0, 1], not {value!r}"
        ) from None


#: Labels of push_window's callers, by (code, line): the name is formatted once per call site.
_CALLERS: dict[tuple[Any, int], str] = {}

#: Every monitor of this process (a fork's child rebuilds them; see ``Monitor._forked``).
_MONITORS: weakref.WeakSet[Monitor] = weakref.WeakSet()
#: The samplers of the parent that a forked child holds on to and never touches.
_INHERITED: list[tuple[object, ...]] = []


def _after_fork() -> None:
    for monitor in list(_MONITORS):
        monitor._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class WindowContext:
    """Yielded by :meth:`Monitor.window`; ``result`` is set when the block ends."""

    __slots__ = ("name", "result")

    def __init__(self, name: str) -> None:
        self.name = name
        self.result: WindowResult | None = None


def _torch_sync(gpu_indices: Sequence[int]) -> None:
    """``torch.cuda.synchronize`` on each GPU when torch is loaded and CUDA usable; else no-op."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return
    cuda = torch.cuda
    if not cuda.is_available():
        return
    for index in gpu_indices:
        cuda.synchronize(index)


class Monitor(ClosedOnExit):
    """Measure time and energy of named windows in a synchronous program.

    Args:
        gpu_indices: GPUs to measure (indices after ``CUDA_VISIBLE_DEVICES``; also ``gpus=``, the
            name ``Runtime`` and the CLI use); ``None`` = all,
            or, on a rank of a distributed job (:mod:`zeus_async.ranks`), the rank's own: the
            only visible GPU, else its local rank's. Made before a launcher set the rank
            (Lightning's ``ddp`` and ``ddp_spawn``, accelerate's notebook launcher), all until
            the rank is known, then the rank's (:meth:`resolve_gpus`).
        cpu_indices: RAPL packages (also ``cpus=``); ``None`` = all that are readable,
            ``[]`` = none.
        backend: ``auto`` (NVML if a driver is present, else the simulator), ``nvml``, ``sim``.
        sample_period: Sampling period in seconds.
        publish: Also publish every sample and measurement on this ZeroMQ endpoint.
        sync_execution_with: ``"torch"`` to ``torch.cuda.synchronize`` at edges when asked
            (no-op without CUDA), or ``None``.
        log_file: Append every finished window to this file: CSV (``.csv``) or JSON lines,
            with the window's host and (several ranks) rank. Like ``record``, per rank.
        finalize_timeout_s: Longest wait for post-edge data (bound on energy resolution).
        sampler: ``"process"`` (default: sample in a child process, no GIL sharing) or
            ``"thread"`` (sample on a thread of this process).
        record: Write every sample, window edge and measurement to this recording file
            (:mod:`zeus_async.store`; read it with ``RecordingReader``). An existing recording
            is refused (:class:`FileExistsError`) unless ``overwrite=True``. May hold
            ``{rank}``, ``{local_rank}``, ``{world_size}``, ``{node}``, ``{host}``; in a job
            of several ranks a path without them gets the rank before its suffix
            (``run.zarc`` → ``run.rank1.zarc``), so ranks never share a file.
        overwrite: Let ``record`` replace an existing recording (its old rotated parts
            are removed too).
        processes: Per-process metrics (:class:`~zeus_async.runtime.ProcessTracking`;
            ``True`` = this process and its descendants, every second): CPU, memory and
            attributed CPU/DRAM/GPU power, as :class:`~zeus_async.events.ProcessSample`
            events in the recording and on the bus.
        model: A ``torch.nn.Module`` whose parameter count and FLOPs/MACs for ``input_size``
            are measured once and written into the run metadata (:attr:`model_complexity`).
        input_size: Input shape for ``model``, batch dimension first.
        meta: More run metadata (recording header and stream info).
        prometheus_port: Serve the samples, process metrics and window energies on a
            Prometheus endpoint at this port (``0``: any free port, see
            :attr:`prometheus_port`).
        prometheus_addr: The address it binds: loopback by default, ``0.0.0.0`` for every
            interface (a Prometheus server on another machine).
        prometheus_names: ``native`` metric names, ``dcgm`` for dcgm-exporter's names,
            units and labels on the GPU series (its Grafana dashboards work unchanged), or
            ``amd`` for the AMD Device Metrics Exporter's.
        otlp: Push the measurements to this OpenTelemetry OTLP/HTTP metrics endpoint
            (``http://collector:4318``; the ``otel`` extra), with the rank's job, rank and host
            as resource attributes (:mod:`zeus_async.exporters.otlp`).
        otlp_interval_s: Seconds between OTLP exports.
        agent: Where sampling runs with ``sampler="process"`` (``docs/agent.md``). ``None``
            (default): attach to this user's node agent when one runs (``zeus-async agent``),
            else to the system agent when one answers (``zeus-async agent --system``, on
            ``$ZEUS_ASYNC_SYSTEM_AGENT`` or ``/run/zeus-async/agent.sock``), else start a node
            agent when this is a torchrun rank (the first rank starts it), else a private one;
            options that only a private agent has (``record``, ``publish``, ``log_file``,
            ``prometheus_port``, ``processes``, other sampling settings) also pick a private
            one. ``False``: always a private agent. ``True``: the node agent (started if none
            runs). A string: the endpoint of an agent to attach to. The environment variable
            ``ZEUS_ASYNC_AGENT=off`` makes ``None`` mean ``False``.
        carbon: Emissions and cost beside every joule: a
            :class:`~zeus_async.carbon.CarbonConfig` (``CarbonConfig(zone="FR")``: the offline
            yearly table; ``source="electricitymaps"``, ``"file"``, ``"constant"``), opened
            once, or an intensity source. Every window then has ``footprint``, ``co2e_g`` and
            ``cost`` (:class:`~zeus_async.aggregate.WindowResult`), with the intensity's
            source, the PUE and the overhead. ``None`` (default): no carbon figures (the
            location is never guessed).
        emissions_file: Append one row for this monitor's run (construction to
            :meth:`close`) to this CSV, with CodeCarbon's ``emissions.csv`` columns and units
            (:mod:`zeus_async.store.emissions_csv`; ``project_name`` is ``meta["project"]``
            when given). Needs ``carbon``. The run is measured as a window named
            ``emissions`` (it shows in window logs and recordings). Like ``record``, per rank.
        **runtime_options: More :class:`~zeus_async.runtime.Runtime` arguments (``clock``,
            ``sim_config``, ``fields``, ...). By default only ``power_w`` and ``energy_j`` are
            sampled, at ``sample_period``: that is all windows need. ``adaptive_reads=True``
            skips the reads that can only repeat the last value (window energy unchanged);
            by default it is on where reading the energy counter is expensive (3.8 ms a read
            on an H100 with driver 580), off elsewhere.
            ``power_scope="module"`` reads a Grace superchip's whole module (GPU + CPU +
            memory; ``"gpu"`` by default, ``"auto"``: see :mod:`zeus_async.devices.nvml`).
            With ``sampler='process'`` only ``fields``, ``sim_config``, ``adaptive_reads`` and
            ``power_scope`` apply.

    The monitor starts at construction and stops at :meth:`close`, at exit of a ``with``
    block, or at interpreter exit. It pickles as its arguments: the process that unpickles it
    (a rank ``ddp_spawn`` starts) samples with a monitor of its own from its first use, and a
    child made by ``fork`` likewise; neither closes or changes this process's sampler.
    """

    def __init__(
        self,
        gpu_indices: Sequence[int] | None = None,
        cpu_indices: Sequence[int] | None = None,
        backend: str = "auto",
        sample_period: float = 0.01,
        publish: str | None = None,
        sync_execution_with: str | None = "torch",
        *,
        log_file: str | Path | None = None,
        finalize_timeout_s: float = 0.5,
        sampler: str = "process",
        record: str | Path | None = None,
        overwrite: bool = False,
        processes: ProcessTracking | bool | None = None,
        model: Any = None,
        input_size: Sequence[int] | None = None,
        meta: Mapping[str, str] | None = None,
        prometheus_port: int | None = None,
        prometheus_addr: str = "127.0.0.1",
        prometheus_names: str = "native",
        otlp: str | None = None,
        otlp_interval_s: float = 10.0,
        agent: str | bool | None = None,
        gpus: Sequence[int] | None = None,
        cpus: Sequence[int] | None = None,
        carbon: Any = None,
        emissions_file: str | Path | None = None,
        **runtime_options: Any,
    ) -> None:
        # One name for GPU indices across Monitor, Runtime and the CLI (``gpus``, ``--gpus``);
        # ``gpu_indices``/``cpu_indices`` stay, as Zeus names them.
        for name, alias, value in (
            ("gpus", "gpu_indices", gpu_indices),
            ("cpus", "cpu_indices", cpu_indices),
        ):
            given = gpus if name == "gpus" else cpus
            if given is not None and value is not None:
                raise ConfigError(f"{name} and {alias} name the same thing: pass one of them")
        gpu_indices = gpus if gpus is not None else gpu_indices
        cpu_indices = cpus if cpus is not None else cpu_indices
        if sync_execution_with not in ("torch", None):
            raise ConfigError(
                f"sync_execution_with must be 'torch' or None, not {sync_execution_with!r}"
            )
        if sampler not in ("process", "thread"):
            raise ConfigError(f"sampler must be 'process' or 'thread', not {sampler!r}")
        if emissions_file is not None and carbon is None:
            raise ConfigError(
                "emissions_file needs carbon=CarbonConfig(...): the grid's intensity is never "
                "guessed (CarbonConfig(zone='FR') for the offline table)"
            )
        self.model_complexity: ModelComplexity | None = None
        meta = dict(meta or {})
        if model is not None:
            if input_size is None:
                raise ConfigError("model complexity needs input_size (batch dimension first)")
            self.model_complexity = model_complexity(model, input_size)
            meta.update(self.model_complexity.as_meta())
        # What the monitor was made with (the model measured once, as metadata): what a
        # resolution rebuilds it from, and what a pickled monitor carries to another process.
        self._args: dict[str, Any] = dict(
            gpu_indices=_indices(gpu_indices, "gpus"),
            cpu_indices=_indices(cpu_indices, "cpus"),
            backend=backend,
            sample_period=sample_period,
            publish=publish,
            sync_execution_with=sync_execution_with,
            log_file=log_file,
            finalize_timeout_s=finalize_timeout_s,
            sampler=sampler,
            record=record,
            overwrite=overwrite,
            processes=processes,
            meta=meta,
            prometheus_port=prometheus_port,
            prometheus_addr=prometheus_addr,
            prometheus_names=prometheus_names,
            otlp=otlp,
            otlp_interval_s=otlp_interval_s,
            agent=agent,
            carbon=carbon,
            emissions_file=emissions_file,
            runtime_options=runtime_options,
        )
        self._fresh()
        self._build(None)
        _MONITORS.add(self)
        call_at_exit(self.close)

    def _fresh(self) -> None:
        """The state of a monitor with nothing open and no sampler yet."""
        self._sync = self._args["sync_execution_with"]
        self._open: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._stack: list[str] = []
        self._stack_lock = threading.Lock()
        self._closed = False
        self._close_hooks: list[Callable[[], None]] = []
        self._process: SamplerProcess | None = None
        self._embedded: EmbeddedRuntime | None = None
        self._tracker: WindowTracker | None = None
        self._gpu_indices: list[int] = []
        self._cpu_indices: list[int] = []
        self._prometheus_port: int | None = None
        #: This process's rank in its job (from the launcher's environment, ``zeus_async.ranks``).
        self.rank: RankInfo = RankInfo()
        # Not built yet (a monitor unpickled, or inherited through fork, builds where it is
        # used), waiting for the launcher, or a resolution waiting for windows to close: each
        # of them sets _attention, the one flag a window edge looks at.
        self._built = False
        self._pending = False
        self._final = False
        self._want: list[int] | None = None
        self._attention = True
        self._environ_size = -1
        self._pid = os.getpid()
        self._warned_unresolved = False
        #: The carbon configuration, opened (``None``: no carbon figures).
        self.carbon: Carbon | None = Carbon.of(self._args.get("carbon"))
        # The run's window for emissions_file (name, id, start), and its closed parts (one
        # per sampler: a rank resolution restarts it).
        self._run_window: tuple[str, int, int] | None = None
        self._run_parts: list[WindowResult] = []

    def _build(self, target: list[int] | None) -> None:
        """Start sampling: the GPUs asked for, else ``target`` (a resolution's), else this
        rank's (:func:`_rank_gpus`), else every GPU, waiting for a launcher."""
        args = self._args
        backend: str = args["backend"]
        sample_period: float = args["sample_period"]
        publish: str | None = args["publish"]
        finalize_timeout_s: float = args["finalize_timeout_s"]
        overwrite: bool = args["overwrite"]
        prometheus_port: int | None = args["prometheus_port"]
        otlp: str | None = args["otlp"]
        cpu_indices: list[int] | None = args["cpu_indices"]
        runtime_options = dict(args["runtime_options"])
        requested: list[int] | None = args["gpu_indices"]
        self.rank = rank_info()
        record = args["record"]
        if record is not None:
            record = rank_path(record, self.rank)
        log_file = args["log_file"]
        if log_file is not None:
            log_file = rank_path(log_file, self.rank)
        gpu_indices = requested if requested is not None else target
        if gpu_indices is None:
            gpu_indices = _rank_gpus(self.rank)
        # Every GPU for now: a launcher may still say which rank this is (Lightning's ddp, in
        # trainer.fit()), unless one already said (a job of one rank) or there is one GPU.
        pending = gpu_indices is None and not self.rank.launcher
        run_meta = {**self.rank.as_meta(), **args["meta"]}
        processes = args["processes"]
        tracking = ProcessTracking() if processes is True else (processes or None)
        # Windows need power and energy only; other fields cost reads (pass ``fields`` for more).
        runtime_options.setdefault("fields", {"power_w": None, "energy_j": None})
        if args["sampler"] == "process":
            unknown = set(runtime_options) - {
                "fields",
                "sim_config",
                "adaptive_reads",
                "power_scope",
            }
            if unknown:
                raise ConfigError(
                    f"{', '.join(sorted(unknown))}: not available with sampler='process' "
                    "(use sampler='thread')"
                )
            # Refused here, with the path in the error, not later in the agent.
            if record is not None:
                claim_output(
                    record,
                    overwrite=overwrite,
                    what="recording",
                    recording=True,
                    force_hint="overwrite=True",
                )
            if log_file is not None:  # appended to: only that it can be written
                claim_output(log_file, overwrite=True, what="window log")
            private_only = (
                record is not None
                or publish is not None
                or log_file is not None
                or prometheus_port is not None
                or otlp is not None
                or tracking is not None
                or sample_period != 0.01
                or backend != "auto"
                or bool(set(runtime_options) - {"fields"})
                or runtime_options["fields"] != {"power_w": None, "energy_j": None}
            )
            attach = _agent_endpoint(args["agent"], private_only=bool(private_only))
            self._process = SamplerProcess(
                attach=attach,
                backend=backend,
                gpus=gpu_indices,
                cpus=cpu_indices,
                period_s=sample_period,
                publish=publish,
                log_file=log_file,
                finalize_timeout_s=finalize_timeout_s,
                record=record,
                overwrite=overwrite,
                processes=tracking,
                meta=run_meta,
                prometheus_port=prometheus_port,
                prometheus_addr=args["prometheus_addr"],
                prometheus_names=args["prometheus_names"],
                otlp=otlp,
                otlp_interval_s=args["otlp_interval_s"],
                carbon=self._agent_carbon(prometheus_port is not None or otlp is not None),
                **runtime_options,
            )
            self._prometheus_port = self._process.prometheus_port
            # Attached: the agent checked and kept the GPUs asked for.
            self._gpu_indices = list(self._process.gpu_indices)
            self._cpu_indices = list(self._process.cpu_indices)
        else:
            consumers = list(runtime_options.pop("consumers", ()))
            if log_file is not None:
                rank = self.rank.rank if self.rank.distributed else None
                consumers.append(window_log_consumer(log_file, rank=rank))
            self._embedded = EmbeddedRuntime(
                carbon=self.carbon,
                backend=backend,
                gpus=gpu_indices,
                cpus="auto" if cpu_indices is None else cpu_indices,
                period_s=sample_period,
                publish=publish,
                windows=True,
                finalize_timeout_s=finalize_timeout_s,
                consumers=consumers,
                record=record,
                overwrite=overwrite,
                processes=tracking,
                meta=run_meta,
                prometheus_port=prometheus_port,
                prometheus_addr=args["prometheus_addr"],
                prometheus_names=args["prometheus_names"],
                otlp=otlp,
                otlp_interval_s=args["otlp_interval_s"],
                **runtime_options,
            )
            self._embedded.start()
            runtime = self._embedded.runtime
            assert runtime is not None and runtime.tracker is not None
            self._tracker = runtime.tracker
            self._prometheus_port = runtime.prometheus_port
            self._gpu_indices = sorted(self._tracker.gpu_indices)
            self._cpu_indices = sorted(self._tracker.cpu_packages)
        if requested is not None and sorted(set(requested)) == sorted(self._gpu_indices):
            # In the caller's order, as Zeus keeps it: pop_window()'s energies follow it.
            self._gpu_indices = list(dict.fromkeys(requested))
        self._built = True
        self._pid = os.getpid()
        self._pending = pending and len(self._gpu_indices) > 1
        self._final = self._final or requested is not None
        self._attention = self._pending or self._want is not None
        if args.get("emissions_file") is not None:
            self._open_run()

    # -- the run's emissions (emissions_file) ---------------------------------------------------

    _RUN_WINDOW = "emissions"

    def _open_run(self) -> None:
        """Open the window the run's emissions row measures: on the sampler, not among
        :attr:`open_windows` (a rank resolution does not wait for it)."""
        window_id = next_window_id()
        t_ns = time.time_ns()
        name = self._RUN_WINDOW
        if self._process is not None:
            self._process.send_edge(Edge(True, name, window_id, t_ns, restart=True))
        else:
            assert self._tracker is not None
            self._tracker.open(name, restart=True, t_ns=t_ns, window_id=window_id)
        self._run_window = (name, window_id, t_ns)

    def _close_run(self) -> None:
        """End the run's window (the sampler stopping next finalizes it)."""
        run, self._run_window = self._run_window, None
        if run is None:
            return
        name, window_id, start_ns = run
        t_ns = time.time_ns()
        try:
            if self._process is not None:
                result = self._send_close(name, window_id, start_ns, t_ns)
            elif self._tracker is not None:
                result = self._tracker.close(name, t_ns=t_ns)
            else:
                return
        except Exception:
            logger.exception("the run's emissions window could not be closed")
            return
        self._run_parts.append(result)

    def _write_emissions(self) -> None:
        """Append the run's row to ``emissions_file`` (after the sampler stopped)."""
        from .store.emissions_csv import RunEnergy, append_emissions_row, emissions_row

        parts, self._run_parts = self._run_parts, []
        path = self._args.get("emissions_file")
        if path is None or not parts:
            return
        timeout = self._args["finalize_timeout_s"] + 1.0
        gpu = cpu = dram = duration = 0.0
        footprints = []
        for result in parts:
            try:
                m = result.wait(timeout)
            except Exception:
                logger.exception("the run's emissions window was not measured")
                continue
            gpu += sum(m.gpu_energy_j.values())
            cpu += sum((m.cpu_energy_j or {}).values())
            dram += sum((m.dram_energy_j or {}).values())
            duration += result.time
            if result.footprint is not None:
                footprints.append(result.footprint)
        total = sum_footprints(footprints)
        if total is None:
            return
        try:
            models = [d.name for d in self.gpu_devices]
        except Exception:
            models = []
        config = self.carbon.config if self.carbon is not None else None
        row = emissions_row(
            RunEnergy(duration, gpu, cpu, dram, total, gpu_model=models),
            project_name=self._args["meta"].get("project", "zeus_async"),
            zone=getattr(config, "zone", "") or "",
            tracking_mode="machine",
        )
        out = append_emissions_row(rank_path(path, self.rank), row)
        logger.info("emissions of this run appended to %s", out)

    # -- which GPUs -----------------------------------------------------------------------------

    @property
    def gpu_indices(self) -> list[int]:
        """The GPUs measured (indices after ``CUDA_VISIBLE_DEVICES``), in the caller's order
        when given; every GPU while :attr:`gpus_resolved` is false."""
        if not self._built:
            self._ensure_built()
        return self._gpu_indices

    @property
    def cpu_indices(self) -> list[int]:
        """The RAPL packages measured."""
        if not self._built:
            self._ensure_built()
        return self._cpu_indices

    @property
    def prometheus_port(self) -> int | None:
        """Port of the Prometheus endpoint (``None`` without one)."""
        if not self._built:
            self._ensure_built()
        return self._prometheus_port

    @property
    def gpus_resolved(self) -> bool:
        """Whether the monitor knows its GPUs: false for one made, without ``gpu_indices``,
        before a launcher said which rank this process is (it measures every GPU meanwhile,
        see :meth:`resolve_gpus`), and while a resolution waits for windows to end."""
        if not self._built:
            self._ensure_built()
        return not self._pending and self._want is None

    def resolve_gpus(
        self,
        gpus: Sequence[int] | None = None,
        *,
        local_rank: int | None = None,
        final: bool = False,
    ) -> bool:
        """Measure this rank's GPU(s) from now on, now that the launcher has said which rank
        this process is; returns :attr:`gpus_resolved`.

        A monitor made without ``gpu_indices`` before any launcher variable was set measures
        every GPU: Lightning's ``ddp`` launcher runs rank 0 as the script's own process and
        sets ``LOCAL_RANK`` only inside ``trainer.fit()``; ``ddp_spawn`` and accelerate's
        notebook launcher start the ranks after the script made its monitor. Such a monitor
        looks for the rank when a window opens with none open, and here: ``gpus`` (a
        framework's device for this rank, Lightning's ``trainer.strategy.root_device``), else
        ``local_rank`` (its GPU, or the only visible one), else the launcher's variables
        (:mod:`zeus_async.ranks`), else ``torch.distributed``'s group (global rank modulo the
        GPUs). Resolving restarts sampling on those GPUs, as if the monitor had been made
        then; windows still open keep it waiting until none is (they were opened on every
        GPU). ``gpus`` or ``local_rank`` also correct a rank's GPU inferred from
        ``LOCAL_RANK`` when the framework knows better (``devices=[2, 3]``).

        ``final=True`` (the power-limit optimizer's first step): the GPUs are final from now
        on, every GPU when nothing said otherwise; later calls change nothing. A monitor made
        with ``gpu_indices`` is final from the start. Not while a resolution waits for windows
        to end (``False`` is returned then): no GPU is fixed before it is the rank's.
        """
        if gpus is None and local_rank is not None:
            gpus = _local_gpus(local_rank)
        target = None if gpus is None else [int(i) for i in gpus]
        if not self._built:
            if self._closed:
                return False
            if target is not None and not self._final:
                self._want = target
            self._ensure_built()
        if self._closed or self._final:
            asked = self._args["gpu_indices"] is not None
            if target is not None and sorted(target) != sorted(self._gpu_indices) and not asked:
                logger.warning(
                    "this monitor keeps measuring GPU(s) %s, not %s: its GPUs were fixed already",
                    self._gpu_indices,
                    target,
                )
            return self.gpus_resolved
        if target is None and self._pending:
            target = self._launcher_gpus()
        if target is not None and (self._pending or target != self._gpu_indices):
            self._want = target
            self._attention = True
            self._attend()
        if final and self._want is None:  # nothing waits for windows to end: fixed now
            self._final = True
            self._pending = False
            self._attention = False
        return self.gpus_resolved

    def _launcher_gpus(self, *, every_time: bool = True) -> list[int] | None:
        """This rank's GPUs once something says which rank this is, else ``None``.

        A window edge asks while the monitor waits, so that must be cheap: without
        ``every_time`` the environment is read only when its size changed (a launcher adds
        its variables: ``LOCAL_RANK``, ``WORLD_SIZE``, ...; a missing key costs an exception
        in ``os.environ``, ~1 us), and the process group is a look-up and a call.
        """
        environ = os.environ
        size = len(environ)
        if (every_time or size != self._environ_size) and (
            "LOCAL_RANK" in environ or "RANK" in environ
        ):
            info = rank_info()
            gpus = _rank_gpus(info)
            if gpus is not None:
                return gpus
            if info.launcher:  # a job of one rank: every GPU, as for any single process
                return list(self._gpu_indices)
        self._environ_size = size
        dist: Any = sys.modules.get("torch.distributed")
        initialized = getattr(dist, "is_initialized", None)  # absent: no distributed build
        if initialized is not None and initialized():
            size = int(dist.get_world_size())
            if size > 1:
                return _local_gpus(int(dist.get_rank()) % max(len(self._gpu_indices), 1))
        return None

    def _ensure_built(self) -> None:
        """Build the sampler of a monitor that has none (unpickled, or inherited by fork)."""
        with self._lock:
            if self._built or self._closed:
                return
            want, self._want = self._want, None
            self._build(want)

    def _attend(self) -> None:
        """Whatever a window edge must do first: build, resolve (a no-op while waiting)."""
        if not self._built:
            self._ensure_built()
        if self._want is None:
            if not self._pending:
                self._attention = False
                return
            if self._open:
                return  # opened on every GPU: nothing changes until they end
            target = self._launcher_gpus(every_time=False)
            if target is None:
                return
            self._want = target
        with self._lock:
            if self._open or self._want is None:
                return  # the windows open were opened on every GPU: after they end
            target, self._want = self._want, None
            if target != self._gpu_indices:
                self._restart(target)
            self._pending = False
            self._attention = False

    def _restart(self, target: list[int]) -> None:
        """Sample ``target`` from now on: the old sampler stops, a new one starts as this
        monitor would have started with the rank known (its node agent, its paths)."""
        old = self._gpu_indices
        self._close_run()  # the old sampler finalizes its part as it stops
        process, embedded = self._process, self._embedded
        self._process = self._embedded = self._tracker = None
        if process is not None:
            process.stop()
        if embedded is not None:
            embedded.stop()
        try:
            self._build(target)
        except BaseException:
            self._closed = True  # nothing samples any more: every later call says so
            raise
        logger.info(
            "rank %d: measuring GPU(s) %s, not %s (the launcher said the rank after this "
            "monitor was made)",
            self.rank.rank,
            self._gpu_indices,
            old,
        )

    # -- pickling and fork ----------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What another process needs to make its own monitor: the constructor's arguments.
        (A spawned rank unpickles the callbacks holding this monitor: it samples there, on
        that rank's GPUs, from its first use, and this process's monitor is left alone.)"""
        return {"args": self._args, "model_complexity": self.model_complexity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._args = state["args"]
        self.model_complexity = state["model_complexity"]
        self._fresh()
        _MONITORS.add(self)
        call_at_exit(self.close)

    def _forked(self) -> None:
        """In a child made by ``fork``: the parent's sampler is the parent's (its threads did
        not come along, and stopping it would stop the parent's); build a new one here."""
        inherited = (self._process, self._embedded, self._tracker)
        args, complexity, hooks, closed = (
            self._args,
            self.model_complexity,
            self._close_hooks,
            self._closed,
        )
        self._fresh()
        self._args, self.model_complexity = args, complexity
        self._close_hooks, self._closed = hooks, closed
        _INHERITED.append(inherited)  # never used, never stopped, never collected here

    # -- windows --------------------------------------------------------------------------------

    def _sync_devices(self, sync: bool) -> None:
        if sync and self._sync == "torch":
            _torch_sync(self.gpu_indices)

    def synchronize(self) -> None:
        """Wait for the monitored GPUs' queued work (``torch.cuda.synchronize``) when the
        monitor was made with ``sync_execution_with="torch"``; otherwise do nothing."""
        self._sync_devices(True)

    def begin_window(self, key: str, sync_execution: bool = True, restart: bool = False) -> None:
        """Start window ``key``.

        Raises:
            TypeError: ``key`` is not a string.
            ValueError: ``key`` is already open (pass ``restart=True`` to replace it).
        """
        if not isinstance(key, str):
            raise TypeError(f"window key must be a str, not {type(key).__name__} ({key!r})")
        self._check_open(attend=True)
        if sync_execution and self._sync == "torch":
            _torch_sync(self._gpu_indices)
        t_ns = time.time_ns()
        with self._lock:
            if key in self._open and not restart:
                raise ValueError(
                    f"measurement window {key!r} is already open; end it first, or pass "
                    "restart=True to discard it and start again"
                )
            window_id = next_window_id()
            self._open[key] = (t_ns, window_id)
            if self._process is not None:
                self._process.send_edge(Edge(True, key, window_id, t_ns, restart=restart))
            else:
                assert self._tracker is not None
                self._tracker.open(key, restart=restart, t_ns=t_ns, window_id=window_id)

    def end_window(
        self, key: str, sync_execution: bool = True, cancel: bool = False
    ) -> WindowResult:
        """End window ``key`` and return its result at once.

        ``result.time`` is known immediately, and so are the energy attributes: provisional
        figures from the sampler's latest power readings (a few microseconds to compute, no
        message; ``result.provisional`` is true) until the exact, counter-based ones are in,
        within ``finalize_timeout_s`` (0.5 s by default; ~0.2 s with a 100 ms energy counter)
        of the window's end. ``result.wait()`` (or ``result.measurement``) waits for the
        exact ones. With ``cancel=True`` the window is discarded and an empty, cancelled
        result is returned.

        With the sampler in a child process (the default), this call only queues the edge:
        it reaches the child with the I/O thread's next wake-up, at once when something waits
        for the exact result and within 0.1 s otherwise. So the window's ``measurement`` event (bus,
        recording, window log) may come up to 0.1 s after the bound above when nobody reads
        the result in between. In exchange, a loop with a window per step wakes no thread per
        step.

        Raises:
            ValueError: No window ``key`` is open.
        """
        self._check_open()
        if sync_execution and self._sync == "torch":
            _torch_sync(self._gpu_indices)
        t_ns = time.time_ns()
        with self._lock:
            start_ns, window_id = pop_open_window(self._open, key)
            if self._process is None:
                assert self._tracker is not None
                return self._tracker.close(key, cancel=cancel, t_ns=t_ns)
            if cancel:
                self._process.send_edge(Edge(False, key, window_id, t_ns, cancel=True))
                return WindowResult.cancelled_result(key, window_id, start_ns, t_ns)
            result = self._send_close(key, window_id, start_ns, t_ns)
        return result

    def _agent_carbon(self, exporting: bool) -> CarbonConfig | None:
        """The carbon configuration a private agent's exporters get: this monitor's, when it
        exports from the agent (Prometheus, OTLP) and the configuration can travel (a
        :class:`~zeus_async.carbon.CarbonConfig`, not an opened source object)."""
        if not exporting or self.carbon is None:
            return None
        if self.carbon.config is None:
            logger.warning(
                "the agent's exporters get no carbon configuration from an intensity source "
                "object (give Monitor(carbon=CarbonConfig(...))): no CO2e series there"
            )
        return self.carbon.config

    def _send_close(self, name: str, window_id: int, start_ns: int, t_ns: int) -> WindowResult:
        """The result of a window the sampler process measures, expected before its closing
        edge leaves (so its reply always finds it). With a carbon configuration, the edge
        asks the agent to split the window's energy where the intensity changes, so that the
        footprint integrates it as in this process (cheap: no network asked)."""
        assert self._process is not None
        result = WindowResult(name, window_id, start_ns, t_ns)
        cuts: list[int] = []
        if self.carbon is not None:
            result._carbon = self.carbon
            cuts = self.carbon.cuts(start_ns, t_ns)
            result._cuts = cuts
        self._process.expect(result)
        self._process.send_edge(Edge(False, name, window_id, t_ns, cuts=cuts))
        return result

    @contextmanager
    def window(self, key: str, sync_execution: bool = True) -> Iterator[WindowContext]:
        """``with monitor.window("step") as w: ...`` then ``w.result``.

        An exception inside the block cancels the window and propagates.
        """
        ctx = WindowContext(key)
        self.begin_window(key, sync_execution=sync_execution)
        try:
            yield ctx
        except BaseException:
            self.end_window(key, sync_execution=False, cancel=True)
            raise
        ctx.result = self.end_window(key, sync_execution=sync_execution)

    def push_window(self, name: str | None = None) -> None:
        """Open a window on top of the stack (Zeus ``push_window`` semantics).

        Its name, in window logs, recordings and on the bus, is ``name`` when given, else its
        place and its caller — ``stack0 train_step (train.py:42)`` — which a reader can match
        to the code (it was ``__stack_0_7f34edd311d0``).
        """
        label = None
        if name is None:
            caller = sys._getframe(1)
            where = (caller.f_code, caller.f_lineno)
            label = _CALLERS.get(where)
            if label is None:
                code = caller.f_code
                label = f"{code.co_name} ({os.path.basename(code.co_filename)}:{caller.f_lineno})"
                if len(_CALLERS) < 4096:
                    _CALLERS[where] = label
        with self._stack_lock:
            key = f"stack{len(self._stack)} {label}" if name is None else name
            self.begin_window(key)
            self._stack.append(key)

    def pop_window(self, *, exact: bool = False) -> ProfilingResult:
        """Close the most recently pushed window and return its time and per-GPU energy (in
        the order of :attr:`gpu_indices`: the caller's ``gpu_indices`` order, as in Zeus).

        Returns at once: the energies are then the provisional figures (see
        :class:`~zeus_async.aggregate.WindowResult`; ``result.provisional`` says so, and
        ``result.exact()`` waits for the exact ones). ``exact=True`` waits for the exact
        figures here (bounded by ``finalize_timeout_s``).

        Raises:
            RuntimeError: No window was pushed.
        """
        with self._stack_lock:
            if not self._stack:
                raise RuntimeError("no profiling window is active; call push_window() first")
            key = self._stack.pop()
        result = self.end_window(key)
        if exact:
            result.wait()
        figures = result._current()
        energies = figures.gpu_energy_j
        out = ProfilingResult(
            result.time, [energies.get(i, 0.0) for i in self.gpu_indices], result, self.gpu_indices
        )
        out._provisional = figures is result._provisional
        return out

    @property
    def open_windows(self) -> list[str]:
        """Names of the windows currently open."""
        with self._lock:
            return list(self._open)

    # -- device control -------------------------------------------------------------------------

    @property
    def gpu_devices(self) -> list[DeviceInfo]:
        """Descriptions of the monitored GPUs (model, architecture, power-limit range, ...)."""
        if not self._built:
            self._ensure_built()
        if self._process is not None:
            return list(self._process.devices)
        if self._embedded is None or self._embedded.runtime is None:
            return []  # closed before it was ever built (unpickled, never used)
        return [d.describe() for d in self._embedded.runtime.devices if d.key.startswith("gpu:")]

    def _control_gpus(self, gpus: Sequence[int] | None, what: str) -> Sequence[int]:
        """The GPUs a change without ``gpus`` means: this rank's. A monitor made before the
        launcher said the rank looks for it first (:meth:`resolve_gpus`); if nothing says it
        yet, the change goes to every GPU watched, as for a single process, said once in the
        log (INFO: a plain script on several GPUs is such a process; a Lightning ``ddp`` script
        changing settings before ``trainer.fit()`` finds its cause there)."""
        if gpus is not None:
            return gpus
        if not self.gpus_resolved and not self.resolve_gpus() and not self._warned_unresolved:
            self._warned_unresolved = True
            logger.info(
                "changing the %s of every GPU watched (%s): no launcher has said which rank "
                "this process is yet; pass gpus=[...] or call resolve_gpus() first",
                what,
                ", ".join(map(str, self.gpu_indices)),
            )
        return self.gpu_indices

    def set_power_limit(
        self, watts: float, gpus: Sequence[int] | None = None, *, source: str = ""
    ) -> Future[Any]:
        """Set the power limit of monitored GPUs (all by default) without waiting.

        The change runs where the devices are sampled (the sampler process or the runtime's
        thread), is published as a ``PowerLimitChange`` event, and takes effect in the
        measurements from then on. Returns a future: ``.result()`` waits for it and raises
        ``NoPermissionError`` / ``ConfigError`` on failure.
        """
        self._check_open(attend=True)
        gpus = self._control_gpus(gpus, "power limit")
        if self._process is not None:
            return self._process.control("set_power_limit", watts=watts, gpus=gpus, source=source)
        assert self._embedded is not None and self._embedded.runtime is not None
        runtime = self._embedded.runtime
        return self._embedded.call_soon(
            functools.partial(runtime.set_power_limit, watts, gpus, source=source)
        )

    def set_sm_clocks(
        self, mhz: float | None, gpus: Sequence[int] | None = None, *, source: str = ""
    ) -> Future[Any]:
        """Lock the SM clock of monitored GPUs (all by default) to ``mhz``; ``None`` resets it.

        Like :meth:`set_power_limit`: runs where the devices are sampled, never waited for,
        published as a ``ClockChange`` event; the future fails with ``NoPermissionError`` /
        ``ConfigError``.
        """
        self._check_open(attend=True)
        gpus = self._control_gpus(gpus, "SM clock")
        if self._process is not None:
            return self._process.control("set_sm_clocks", mhz=mhz, gpus=gpus, source=source)
        assert self._embedded is not None and self._embedded.runtime is not None
        runtime = self._embedded.runtime
        return self._embedded.call_soon(
            functools.partial(runtime.set_sm_clocks, mhz, gpus, source=source)
        )

    def release(self, gpus: Sequence[int] | None = None, setting: str | None = None) -> Future[Any]:
        """Put back the power limits and clocks changed through this monitor (all GPUs, both
        settings by default) as they were before the first change, without waiting.

        ``setting`` is ``"power_limit"`` or ``"sm_clocks"``. :meth:`close` does this too,
        and the agent does it when this process dies.
        """
        self._check_open()
        if setting not in (None, "power_limit", "sm_clocks"):
            raise ConfigError(
                f"setting must be 'power_limit', 'sm_clocks' or None, not {setting!r}"
            )
        if self._process is not None:
            return self._process.control(
                "release", gpus=gpus, setting=cast(_Setting, setting), source="restore"
            )
        assert self._embedded is not None and self._embedded.runtime is not None
        runtime = self._embedded.runtime
        return self._embedded.call_soon(
            functools.partial(runtime.release, "", gpus, cast(_Setting, setting))
        )

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` first when this monitor closes (optimizers built on it restore their
        settings through it, so they must close before it)."""
        self._close_hooks.append(hook)

    def publish(self, event: Event) -> Future[Any]:
        """Publish ``event`` on the monitor's stream (bus, recording, log) without waiting."""
        self._check_open()
        if self._process is not None:
            return self._process.control("publish", event=event)
        assert self._embedded is not None and self._embedded.runtime is not None
        return self._embedded.call_soon(self._embedded.runtime.publish, event)

    # -- lifecycle ------------------------------------------------------------------------------

    def _check_open(self, attend: bool = False) -> None:
        """Raise when closed; build a sampler not yet built (an unpickled or forked monitor);
        with ``attend`` (a window opening, a setting changing), also take the rank's GPUs if a
        launcher said it since (see :meth:`resolve_gpus`)."""
        if self._closed:
            raise RuntimeError("this Monitor is closed")
        if attend and self._attention:
            self._attend()
        elif not self._built:
            self._ensure_built()

    def close(self) -> None:
        """Stop sampling. Windows already closed first get their exact figures (waiting at most
        ``finalize_timeout_s`` for the data that completes them); windows still open are
        dropped. Idempotent."""
        if self._closed:
            return
        hooks, self._close_hooks = self._close_hooks, []
        for hook in reversed(hooks):
            try:
                hook()
            except Exception:
                logger.exception("closing %r before the monitor failed", hook)
        self._closed = True
        if os.getpid() != self._pid:
            return  # the sampler is the parent's (fork): it closes its own
        self._close_run()
        if self._process is not None:
            self._process.stop()
        if self._embedded is not None:
            self._embedded.stop()
        try:
            self._write_emissions()
        except Exception:
            logger.exception("writing %s failed", self._args.get("emissions_file"))
