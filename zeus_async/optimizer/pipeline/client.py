"""Rank side of pipeline frequency optimization: a PFO client and ``PipelineFrequencyOptimizer``.

Each rank of a pipeline-parallel job creates a :class:`PipelineFrequencyOptimizer` after
``torch.distributed.init_process_group``::

    pfo = PipelineFrequencyOptimizer(rank=..., dp_rank=..., pp_rank=..., tp_rank=...,
                                     device_id=local_rank, dp_degree=..., pp_degree=...,
                                     tp_degree=..., world_size=..., server_url="tcp://host:7787")
    for batch in loader:
        pfo.on_step_begin()
        for instruction, microbatch in my_pipeline_schedule:
            pfo.on_instruction_begin("forward")   # or "backward"
            ...
            pfo.on_instruction_end("forward")
        pfo.on_step_end()
    pfo.close()                                   # also at exit and on SIGINT/SIGTERM

Rank 0 registers the job and broadcasts its id (``torch.distributed.broadcast_object_list``);
every rank registers its GPU clocks and fetches its first schedule (these calls block, once, at
start). After that, nothing on the training thread waits on the server or on NVML:

* clocks are set ahead: when an instruction ends (its GPU work synchronized), the next
  instruction's clock is handed to a :class:`FrequencyController`, which sets it on the
  monitor's runtime (sampler process or thread) while the pipeline communicates; when the next
  instruction begins, its clock is in force, or the training thread waits for it (at most
  ``clock_wait_s``), so the instruction runs at its planned clock rather than at the previous
  one. Each instruction is counted on time, late (its clock landed while it ran) or missed
  (:class:`ClockStats`, :attr:`PipelineFrequencyOptimizer.clock_stats`); the counts are
  published every ``stats_every`` iterations as an ``OptimizerState`` event
  (``optimizer="pfo"``, ``state="clocks"``), and a warning is logged when fewer than
  ``warn_below`` of them ran on time;
* every instruction and iteration is a measurement window of the monitor; after
  ``warmup_iters + profile_iters`` iterations of a schedule, a background thread waits for the
  windows' energies, reports a :class:`ProfilingResult` and fetches the next schedule, which
  takes effect at the next ``on_step_begin`` after it arrives (training keeps running the
  current one meanwhile).

Clocks are reset on :meth:`close`, at interpreter exit and on SIGINT/SIGTERM; then the rank
leaves the job, and once every rank has left, the server ends it.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import zmq

from ..._exit import ClosedOnExit, SignalRestorer, call_at_exit
from ...bus.curve import CurveClientKeys, apply_client_keys, load_client_keys
from ...errors import ConfigError, NoPermissionError, NotSupportedError, ZeusAsyncError
from . import protocol as p
from .messages import FrequencySchedule, JobInfo, ProfilingResult, RankInfo

if TYPE_CHECKING:
    from ...aggregate.windows import WindowResult
    from ...monitor import Monitor

__all__ = [
    "ClockStats",
    "FrequencyController",
    "PfoClient",
    "PfoServerError",
    "PipelineFrequencyOptimizer",
]

logger = logging.getLogger(__name__)

#: ``source`` of the clock changes this module makes.
SOURCE = "pfo"


#: Environment variables naming a client's CURVE certificates (both, or neither).
CURVE_ENV = ("ZEUS_PFO_CURVE_CLIENT_SECRET", "ZEUS_PFO_CURVE_SERVER_KEY")

#: How long rank 0 waits for the server to answer its registration (seconds): a running
#: server answers at once, so a longer wait only delays the error.
REGISTER_TIMEOUT_S = 10.0


def curve_from_env() -> CurveClientKeys | None:
    """CURVE client keys from :data:`CURVE_ENV`, or ``None`` when neither is set."""
    secret, server = (os.environ.get(name) for name in CURVE_ENV)
    if not secret and not server:
        return None
    if not secret or not server:
        raise ConfigError(f"set both {CURVE_ENV[0]} and {CURVE_ENV[1]}, or neither")
    return load_client_keys(secret, server_public_file=server)


class PfoServerError(ZeusAsyncError):
    """The PFO server answered a request with an error (``code``: see ``protocol.ERROR_CODES``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class PfoClient:
    """Blocking request/reply client of the PFO server (one request at a time per client).

    Requests about a job carry its token (:mod:`.protocol`): the one :meth:`register_job`
    received, or one given to :meth:`join` (the other ranks get it from rank 0).

    Args:
        endpoint: The server's endpoint (``tcp://host:7787``).
        timeout_s: How long a request may wait for its reply (``get_schedule`` waits for every
            rank, so it takes its own, longer timeout).
        curve: CURVE client keys, for a server that has them (default: from
            ``ZEUS_PFO_CURVE_CLIENT_SECRET`` and ``ZEUS_PFO_CURVE_SERVER_KEY``, certificate files,
            when both are set).
        admin_token: The server's admin token, for :meth:`info` of every job.
    """

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 30.0,
        *,
        curve: CurveClientKeys | None = None,
        admin_token: str = "",
    ) -> None:
        if "://" not in endpoint:
            raise ConfigError(f"PFO server endpoint must look like tcp://host:port: {endpoint!r}")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.admin_token = admin_token
        #: Job id -> token, for the jobs this client may act for.
        self.tokens: dict[str, str] = {}
        curve = curve if curve is not None else curve_from_env()
        self._sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            apply_client_keys(self._sock, curve)
        self._sock.connect(endpoint)
        self._next_id = 0
        self._lock = threading.Lock()
        #: Set to make a waiting request give up (``close`` from another thread).
        self.cancelled = threading.Event()

    def request(self, request: p.Request, timeout_s: float | None = None) -> p.Reply:
        """Send ``request`` and return its reply.

        Raises:
            PfoServerError: The server answered with an error.
            TimeoutError: No reply in time.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            req_id = self._send(request)
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no reply from the PFO server at {self.endpoint} within {timeout:g} s "
                        f"({type(request).__name__})"
                    )
                if self.cancelled.is_set():
                    raise TimeoutError("the PFO client was closed while waiting")
                if not self._sock.poll(max(1, int(min(left, 0.2) * 1000))):
                    continue
                parts = self._sock.recv_multipart()
                if len(parts) == 3 and parts[1] == req_id:
                    break  # anything else is a late reply to a request that timed out
        reply: p.Reply = p.reply_decoder.decode(parts[2])
        if isinstance(reply, p.ErrorReply):
            raise PfoServerError(reply.code, reply.message)
        return reply

    def _send(self, request: p.Request, flags: int = 0) -> bytes:
        """Send ``request`` under a new request id (the caller holds the lock); the id."""
        self._next_id += 1
        req_id = struct.pack("<Q", self._next_id)
        self._sock.send_multipart([b"", req_id, p.encoder.encode(request)], flags)
        return req_id

    def _expect(self, reply: p.Reply, kind: type[Any]) -> Any:
        if not isinstance(reply, kind):
            raise PfoServerError("bad_request", f"unexpected reply {type(reply).__name__}")
        return reply

    def register_job(self, job: JobInfo, timeout_s: float | None = None) -> str:
        """Register a job; returns its id (its token is kept in :attr:`tokens`)."""
        reply = self._expect(self.request(p.RegisterJob(job=job), timeout_s), p.JobRegistered)
        self.tokens[reply.job_id] = reply.token
        return str(reply.job_id)

    def join(self, job_id: str, token: str) -> None:
        """Act for a job another client registered (rank 0 shares its id and token)."""
        self.tokens[job_id] = token

    def register_rank(self, job_id: str, rank: RankInfo) -> None:
        request = p.RegisterRank(job_id=job_id, rank=rank, token=self.tokens.get(job_id, ""))
        self._expect(self.request(request), p.Ok)

    def get_schedule(
        self, job_id: str, rank: int, timeout_s: float | None = None
    ) -> p.ScheduleReply:
        request = p.GetSchedule(job_id=job_id, rank=rank, token=self.tokens.get(job_id, ""))
        reply = self.request(request, timeout_s)
        result: p.ScheduleReply = self._expect(reply, p.ScheduleReply)
        if result.schedule.rank != rank:
            raise PfoServerError(
                "bad_rank", f"asked for rank {rank}'s schedule, got rank {result.schedule.rank}'s"
            )
        return result

    def report(self, job_id: str, result: ProfilingResult) -> None:
        request = p.ReportProfile(job_id=job_id, result=result, token=self.tokens.get(job_id, ""))
        self._expect(self.request(request), p.Ok)

    def info(self, job_id: str = "") -> p.InfoReply:
        """A job's status (with its token), or every job's (with the admin token; without
        it, only how many jobs the server holds)."""
        token = self.tokens.get(job_id, self.admin_token) if job_id else self.admin_token
        reply: p.InfoReply = self._expect(
            self.request(p.Info(job_id=job_id, token=token)), p.InfoReply
        )
        return reply

    def leave(self, job_id: str, rank: int, linger_s: float = 0.5) -> None:
        """Tell the server this rank stops, and close the client: the job ends once all its
        ranks have left. Nothing is waited for but the send (at most ``linger_s``; a server
        that is gone costs that much once)."""
        request = p.Leave(job_id=job_id, rank=rank, token=self.tokens.get(job_id, ""))

        def send() -> None:
            try:
                self._send(request, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("could not tell the PFO server that rank %d leaves: %s", rank, exc)

        self.close(linger_s, before=send)

    def close(self, linger_s: float = 0.0, *, before: Callable[[], None] | None = None) -> None:
        """Close the socket, after ``before()`` (under the lock) and up to ``linger_s`` to send
        what is queued (call from the thread that makes the requests, or after it ends; a
        request still holding the socket after 1 s is left to end on its own)."""
        self.cancelled.set()
        if not self._lock.acquire(timeout=1.0):  # e.g. a signal handler interrupted a request
            return
        try:
            if self._sock.closed:
                return
            if before is not None:
                before()
            self._sock.close(linger=max(0, int(linger_s * 1000)))
        finally:
            self._lock.release()


class FrequencyController:
    """Set one GPU's SM clock through a monitor without waiting; the latest request wins.

    ``set_frequency`` costs the caller a lock and, when no change is in flight, one hand-off
    to the monitor's runtime (``Monitor.set_sm_clocks``). While a change is in flight, newer
    requests only replace the target; when it lands, the newest target (if different) is sent.
    Requests are handed off under the lock, and the runtime applies them in order, so after
    :meth:`reset` no earlier request can lock the clock again; a reset controller ignores
    further requests. A permission or support error stops further attempts (logged once).
    The lock is reentrant: a signal handler that resets the clock on the thread that was
    interrupted inside ``set_frequency`` does not deadlock.
    """

    def __init__(self, monitor: Monitor, gpu: int) -> None:
        self._monitor = monitor
        self._gpu = gpu
        self._lock = threading.RLock()
        self._landed_cond = threading.Condition(self._lock)
        self._wanted: int | None = None
        self._sent: int | None = None
        self._inflight = False
        self._warned = False
        self._closed = False
        self._disabled = False
        #: The clock last confirmed set (MHz), and when (``time.monotonic()``).
        self.applied: int | None = None
        self.applied_at: float | None = None
        self.changes = 0

    def set_frequency(self, mhz: int) -> None:
        """Lock the SM clock to ``mhz`` soon (``0``: leave it as it is)."""
        if mhz <= 0:
            return
        with self._lock:
            if self._closed or self._disabled:
                return
            self._wanted = mhz
            if self._inflight or mhz == self._sent:
                return
            self._inflight = True
            self._sent = mhz
            self._submit(mhz)

    def _submit(self, mhz: int) -> None:
        # Called with the lock held, so submissions (and a reset) reach the runtime in order.
        try:
            future = self._monitor.set_sm_clocks(mhz, [self._gpu], source=SOURCE)
        except Exception as exc:
            self._failed(exc, mhz)
            return
        future.add_done_callback(lambda f: self._landed(mhz, f))

    def settled(self, mhz: int) -> bool:
        """Whether ``mhz`` is the clock in force and stays so: it was the last change to land
        and no other change is on its way (one that would land later, mid-instruction)."""
        with self._lock:
            return self.applied == mhz and not self._inflight

    def wait_applied(self, mhz: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the clock to be ``mhz`` with no other change on its
        way (:meth:`settled`); whether it is."""
        with self._landed_cond:
            return self._landed_cond.wait_for(
                lambda: self.settled(mhz) or self._disabled or self._closed, timeout_s
            ) and self.settled(mhz)

    def _failed(self, exc: BaseException, mhz: int) -> None:
        with self._lock:
            self._landed_cond.notify_all()
            self._inflight = False
            self._sent = None
            first = not self._warned
            self._warned = True
            if isinstance(exc, (NoPermissionError, NotSupportedError)):
                self._disabled = True
            wanted = self._wanted
            if not (self._disabled or self._closed) and wanted not in (None, mhz):
                # A newer clock was asked for while this one failed: send it now.
                self._inflight = True
                self._sent = wanted
                self._submit(wanted)
        if first:
            logger.warning("could not set the SM clock of GPU %d: %s", self._gpu, exc)

    def _landed(self, mhz: int, future: Future[Any]) -> None:
        exc = future.exception()
        if exc is not None:
            self._failed(exc, mhz)
            return
        with self._lock:
            if self._closed:
                return
            self.applied = mhz
            self.applied_at = time.monotonic()
            self.changes += 1
            self._landed_cond.notify_all()
            wanted = self._wanted
            if wanted is None or wanted == mhz:
                self._inflight = False
                return
            self._sent = wanted
            self._submit(wanted)

    def reset(self, timeout_s: float = 10.0) -> None:
        """Reset the clock to the driver's default (waits for it); later requests are ignored."""
        with self._lock:
            self._closed = True
            self._wanted = self._sent = None
            future = self._monitor.set_sm_clocks(None, [self._gpu], source=f"{SOURCE}: reset")
        future.result(timeout=timeout_s)
        self.applied = None


@dataclass
class ClockStats:
    """How the plan's clocks were applied, instruction by instruction (see
    :class:`PipelineFrequencyOptimizer`).

    Attributes:
        instructions: Instructions run (with the hooks, while the optimizer was open).
        on_time: Those whose planned clock was in force when they started, with no other
            change on its way (one that would land while they ran).
        late: Those whose planned clock landed while they ran (they ran partly at the
            clock before).
        missed: Those whose planned clock never landed while they ran (superseded, failed, or
            not settable on this GPU).
        waited_s: Time the training thread waited for clocks to land, in total.
        max_wait_s: The longest single wait.
    """

    instructions: int = 0
    on_time: int = 0
    late: int = 0
    missed: int = 0
    waited_s: float = 0.0
    max_wait_s: float = 0.0

    @property
    def on_time_frac(self) -> float:
        """The share of instructions run at their planned clock (1.0 before any)."""
        return self.on_time / self.instructions if self.instructions else 1.0

    def since(self, earlier: ClockStats) -> ClockStats:
        """The counts accumulated after ``earlier`` (a copy taken before)."""
        return ClockStats(
            self.instructions - earlier.instructions,
            self.on_time - earlier.on_time,
            self.late - earlier.late,
            self.missed - earlier.missed,
            self.waited_s - earlier.waited_s,
            self.max_wait_s,
        )


class _Iteration:
    __slots__ = ("instructions", "window")

    def __init__(self, window: WindowResult | None) -> None:
        self.window = window
        self.instructions: list[tuple[str, WindowResult]] = []


class PipelineFrequencyOptimizer(ClosedOnExit):
    """Run the PFO server's frequency schedules on this rank (see the module docstring).

    Args:
        rank, dp_rank, pp_rank, tp_rank: This process's global and per-dimension ranks.
        device_id: Index of this rank's GPU (as the monitor numbers them).
        dp_degree, pp_degree, tp_degree, world_size: The job's parallel degrees.
        server_url: The PFO server's ZeroMQ endpoint (``tcp://host:7787``).
        job_metadata: Free text appended to the job id.
        monitor: The monitor to measure and set clocks with (default: a new one on
            ``device_id``, closed with this optimizer).
        warmup_iters: Iterations run with a new schedule before profiling it.
        profile_iters: Iterations profiled per schedule.
        timeout_s: Longest wait for the server at start (``get_schedule`` waits for every rank).
        restore_on_signals: Reset clocks on SIGINT/SIGTERM (main thread only).
        curve: CURVE client keys for a server that has them (default: from the environment,
            see :class:`PfoClient`).
        clock_wait_s: Longest wait, when an instruction begins, for its clock to land (0: never
            wait; the instruction then runs late or misses its clock when the GPU is slower to
            change clocks than the pipeline is to start it).
        wait_for_lower_clocks: Wait for a clock lower than the one in force too (default).
            ``False`` waits only for higher clocks: an instruction that starts at a higher
            clock than planned runs faster (a little more energy, no delay), while one that
            starts lower would stretch the pipeline; its clock then lands late, and is
            counted so.
        stats_every: Iterations between two published ``OptimizerState`` events of the clock
            counts.
        warn_below: Warn when fewer than this share of the instructions since the last
            event ran at their planned clock.
    """

    def __init__(
        self,
        rank: int,
        dp_rank: int,
        pp_rank: int,
        tp_rank: int,
        device_id: int,
        dp_degree: int,
        pp_degree: int,
        tp_degree: int,
        world_size: int,
        server_url: str,
        job_metadata: str | None = None,
        *,
        monitor: Monitor | None = None,
        warmup_iters: int = 1,
        profile_iters: int = 3,
        timeout_s: float = 120.0,
        restore_on_signals: bool = True,
        curve: CurveClientKeys | None = None,
        clock_wait_s: float = 0.05,
        wait_for_lower_clocks: bool = True,
        stats_every: int = 10,
        warn_below: float = 0.99,
    ) -> None:
        if warmup_iters < 0 or profile_iters < 1:
            raise ConfigError("warmup_iters must be >= 0 and profile_iters >= 1")
        if not (math.isfinite(clock_wait_s) and clock_wait_s >= 0):
            raise ConfigError(f"clock_wait_s must be >= 0 s, not {clock_wait_s!r}")
        if stats_every < 1 or not 0.0 <= warn_below <= 1.0:
            raise ConfigError("stats_every must be >= 1 and warn_below within 0..1")
        self.clock_wait_s = clock_wait_s
        self.wait_for_lower_clocks = wait_for_lower_clocks
        self.stats_every = stats_every
        self.warn_below = warn_below
        #: How the plan's clocks were applied so far.
        self.clock_stats = ClockStats()
        self._stats_mark = ClockStats()
        self._planned = 0
        self._on_time = False
        self.rank, self.dp_rank, self.pp_rank, self.tp_rank = rank, dp_rank, pp_rank, tp_rank
        self.device_id = device_id
        self.warmup_iters, self.profile_iters = warmup_iters, profile_iters
        self._timeout = timeout_s
        self._closed = False
        job = JobInfo(
            pp_degree=pp_degree,
            dp_degree=dp_degree,
            tp_degree=tp_degree,
            world_size=world_size,
            job_metadata=job_metadata,
        )
        self._client = PfoClient(server_url, timeout_s=timeout_s, curve=curve)
        self._own_monitor = monitor is None
        try:
            self.job_id = self._register_job(job, world_size)
            if monitor is None:
                from ...monitor import Monitor

                monitor = Monitor(gpu_indices=[device_id])
            self.monitor = monitor
            self._start(monitor, device_id, rank, dp_rank, pp_rank, tp_rank, timeout_s)
        except BaseException:
            self._client.close()
            if self._own_monitor and monitor is not None:
                monitor.close()
            raise
        self._signals = SignalRestorer(self.close, "resetting GPU clocks")
        if restore_on_signals:
            self._signals.install()
        call_at_exit(self.close)
        # Closing the monitor first closes this (its restores go through the monitor).
        on_close = getattr(self.monitor, "on_close", None)
        if on_close is not None:
            on_close(self.close)

    def _start(
        self,
        monitor: Monitor,
        device_id: int,
        rank: int,
        dp_rank: int,
        pp_rank: int,
        tp_rank: int,
        timeout_s: float,
    ) -> None:
        devices = {int(d.key.split(":")[1]): d for d in monitor.gpu_devices}
        if device_id not in devices:
            raise ConfigError(f"GPU {device_id} is not measured by the monitor ({sorted(devices)})")
        freqs = sorted({round(hz / 1e6) for hz in devices[device_id].supported_sm_clocks_hz})
        if not freqs:
            raise ConfigError(f"GPU {device_id} reports no supported SM clocks")
        self._client.register_rank(
            self.job_id,
            RankInfo(
                rank=rank,
                dp_rank=dp_rank,
                pp_rank=pp_rank,
                tp_rank=tp_rank,
                available_frequencies=freqs[::-1],
            ),
        )
        self.controller = FrequencyController(monitor, device_id)
        first = self._client.get_schedule(self.job_id, rank, timeout_s)
        self.schedule: FrequencySchedule = first.schedule
        #: Round number of the schedule in force.
        self.round = first.round
        #: Whether the schedule in force is the scheduler's last (no more profiling).
        self.final = first.final
        self._pos = 0
        self._in_step = False
        self._iters_run = 0
        self._iters_total = 0
        self._collected: list[_Iteration] = []
        self._current: _Iteration | None = None
        self._pending: p.ScheduleReply | None = None
        self._next_lock = threading.Lock()
        self._work: queue.SimpleQueue[list[_Iteration] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._worker = threading.Thread(
            target=self._report_loop, name=f"zeus-async-pfo-{rank}", daemon=True
        )
        self._worker.start()
        self._set_ahead()  # the first instruction's clock, before training starts

    def _register_job(self, job: JobInfo, world_size: int) -> str:
        job_id: str | None = None
        token = error = ""
        code = "bad_request"
        if self.rank == 0:
            try:
                job_id = self._client.register_job(job, min(self._timeout, REGISTER_TIMEOUT_S))
                token = self._client.tokens[job_id]
            except TimeoutError:
                code = "unreachable"
                error = (
                    f"no PFO server answered at {self._client.endpoint} within "
                    f"{min(self._timeout, REGISTER_TIMEOUT_S):g} s (is `zeus-async pfo-server` "
                    "running there?)"
                )
            except PfoServerError as exc:  # the server's own code (busy, bad_request, ...)
                code = exc.code
                error = f"rank 0 could not register the job: {exc.message}"
            except Exception as exc:
                error = f"rank 0 could not register the job: {exc}"
        if world_size > 1:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise ConfigError(
                    "create PipelineFrequencyOptimizer after torch.distributed.init_process_group"
                )
            box: list[Any] = [(job_id, token, error, code)]
            dist.broadcast_object_list(box, src=0)
            job_id, token, error, code = box[0]
        if error or job_id is None:
            raise PfoServerError(code, error or "no job id from rank 0")
        self._client.join(job_id, token)
        return job_id

    # -- training hooks -----------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"PFO background reporting failed: {error}") from error

    def on_step_begin(self) -> None:
        """Mark the start of an iteration (switches to a newly fetched schedule)."""
        self._check()
        with self._next_lock:
            if self._pending is not None:
                reply, self._pending = self._pending, None
                self.schedule, self.round, self.final = reply.schedule, reply.round, reply.final
                self._iters_run = 0
        self._pos = 0
        self._in_step = True
        profiling = (
            not self.final
            and not self._closed
            and self.warmup_iters <= self._iters_run < self.warmup_iters + self.profile_iters
        )
        self._current = None
        if profiling:
            self.monitor.begin_window("pfo:iteration", sync_execution=True, restart=True)
            self._current = _Iteration(None)

    def on_instruction_begin(self, name: str) -> None:
        """Mark the start of an instruction (``forward``/``backward``): apply its clock."""
        if not self._in_step:
            raise RuntimeError("on_instruction_begin outside on_step_begin/on_step_end")
        freqs = self.schedule.frequencies
        if self._pos >= len(freqs):
            raise RuntimeError(
                f"the schedule has {len(freqs)} instructions per iteration; this is one more"
            )
        expected, mhz = freqs[self._pos]
        if expected != name:
            raise RuntimeError(
                f"instruction {self._pos} of the iteration should be {expected!r}, not {name!r}"
            )
        self._pos += 1
        if self._closed:
            return
        self._begin_clock(mhz)  # a wait for the clock is no part of the instruction's figures
        if self._current is not None:
            self.monitor.begin_window(f"pfo:{name}", sync_execution=True, restart=True)

    def on_instruction_end(self, name: str) -> None:
        """Mark the end of an instruction (waits for its GPU work, then sets the next
        instruction's clock ahead)."""
        if self._current is not None:
            self._current.instructions.append(
                (name, self.monitor.end_window(f"pfo:{name}", sync_execution=True))
            )
        elif not self._closed:
            self.monitor.synchronize()  # it ran at its own clock; now the next one's
        if self._closed or self._planned <= 0:
            return
        stats = self.clock_stats
        stats.instructions += 1
        if self._on_time:
            stats.on_time += 1
        elif self.controller.applied == self._planned:
            stats.late += 1
        else:
            stats.missed += 1
        self._planned = 0
        self._set_ahead()

    def _begin_clock(self, mhz: int) -> None:
        """Make ``mhz`` the clock in force (waiting up to ``clock_wait_s``); note whether it
        is, for the count at the instruction's end."""
        controller = self.controller
        self._planned = mhz
        if mhz <= 0:  # "leave the clock as it is": nothing planned to count
            self._planned = 0
            return
        if not controller.settled(mhz):
            controller.set_frequency(mhz)
            lower = controller.applied is not None and mhz < controller.applied
            if self.clock_wait_s > 0 and (self.wait_for_lower_clocks or not lower):
                t0 = time.monotonic()
                controller.wait_applied(mhz, self.clock_wait_s)
                waited = time.monotonic() - t0
                self.clock_stats.waited_s += waited
                self.clock_stats.max_wait_s = max(self.clock_stats.max_wait_s, waited)
        # On time only if nothing else is on its way: a change sent earlier (for an
        # instruction since passed) would land while this one runs.
        self._on_time = controller.settled(mhz)

    def _set_ahead(self) -> None:
        """Hand the next instruction's clock to the controller now, so it lands before that
        instruction begins (the next iteration's first after the last one)."""
        freqs = self.schedule.frequencies
        if not freqs:
            return
        self.controller.set_frequency(
            freqs[self._pos][1] if self._pos < len(freqs) else freqs[0][1]
        )

    def on_step_end(self) -> None:
        """Mark the end of an iteration."""
        if not self._in_step:
            raise RuntimeError("on_step_end without on_step_begin")
        self._in_step = False
        if self._pos != len(self.schedule.frequencies):
            raise RuntimeError(
                f"the iteration ran {self._pos} instructions; the schedule has "
                f"{len(self.schedule.frequencies)}"
            )
        self._iters_run += 1
        self._iters_total += 1
        if self._iters_total % self.stats_every == 0:
            self._publish_clock_stats()
        current, self._current = self._current, None
        if current is None:
            return
        current.window = self.monitor.end_window("pfo:iteration", sync_execution=False)
        self._collected.append(current)
        if len(self._collected) == self.profile_iters:
            batch, self._collected = self._collected, []
            self._work.put(batch)

    def _publish_clock_stats(self) -> None:
        """Publish the clock counts (totals, and the share on time since the last event);
        warn when that share is below ``warn_below``."""
        from ...events import OptimizerState

        stats = self.clock_stats
        recent = stats.since(self._stats_mark)
        self._stats_mark = replace(stats)
        values = {
            "instructions": float(stats.instructions),
            "on_time": float(stats.on_time),
            "late": float(stats.late),
            "missed": float(stats.missed),
            "on_time_frac": stats.on_time_frac,
            "recent_on_time_frac": recent.on_time_frac,
            "waited_s": stats.waited_s,
            "max_wait_s": stats.max_wait_s,
        }
        try:
            self.monitor.publish(
                OptimizerState(
                    host=socket.gethostname(),
                    t_ns=time.time_ns(),
                    optimizer="pfo",
                    state="clocks",
                    detail=f"job {self.job_id} rank {self.rank} round {self.round}",
                    values=values,
                )
            )
        except Exception as exc:  # the stream may be closing; the counts stay in clock_stats
            logger.debug("could not publish the clock counts: %s", exc)
        if recent.instructions and recent.on_time_frac < self.warn_below:
            logger.warning(
                "rank %d: %d of the last %d instructions ran at their planned clock "
                "(%d late, %d missed); the GPU changes clocks more slowly than the pipeline "
                "starts instructions (raise clock_wait_s, now %g s)",
                self.rank,
                recent.on_time,
                recent.instructions,
                recent.late,
                recent.missed,
                self.clock_wait_s,
            )

    # -- background -------------------------------------------------------------------------

    def _energy(self, window: WindowResult) -> float:
        energy = window.gpu_energy.get(self.device_id)
        if energy is None:  # the GPU was lost during the window: no figure to report
            raise RuntimeError(
                f"window {window.name!r} has no energy for GPU {self.device_id} "
                f"({window.methods.get(f'gpu:{self.device_id}', 'not measured')})"
            )
        return energy

    def _result(self, batch: Sequence[_Iteration]) -> ProfilingResult:
        time_b: dict[str, list[list[float]]] = {}
        energy_b: dict[str, list[list[float]]] = {}
        for it in batch:
            per_t: dict[str, list[float]] = {}
            per_e: dict[str, list[float]] = {}
            for name, w in it.instructions:
                per_t.setdefault(name, []).append(w.time)
                per_e.setdefault(name, []).append(self._energy(w))
            for name in set(per_t) | set(time_b):
                time_b.setdefault(name, []).append(per_t.get(name, []))
                energy_b.setdefault(name, []).append(per_e.get(name, []))
        windows = [it.window for it in batch if it.window is not None]
        return ProfilingResult(
            rank=self.rank,
            iter_time=[w.time for w in windows],
            iter_energy=[self._energy(w) for w in windows],
            time_breakdown=time_b,
            energy_breakdown=energy_b,
        )

    def _report_loop(self) -> None:
        while True:
            batch = self._work.get()
            if batch is None:
                return
            try:
                result = self._result(batch)
                self._client.report(self.job_id, result)
                reply = self._client.get_schedule(self.job_id, self.rank, math.inf)
            except Exception as exc:
                if self._closed:
                    return
                logger.error("rank %d: PFO reporting failed: %s", self.rank, exc)
                self._error = exc
                return
            with self._next_lock:
                self._pending = reply
            logger.debug("rank %d: schedule of round %d received", self.rank, reply.round)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Reset the GPU clock (waiting for it) and stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.controller.reset()
        except Exception as exc:  # the monitor may be gone already at interpreter exit
            logger.warning("could not reset the SM clock of GPU %d: %s", self.device_id, exc)
        self._signals.uninstall()
        self._work.put(None)
        self._client.cancelled.set()
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout=5.0)
        # Leave (and close the client): the job ends once every rank has left.
        self._client.leave(self.job_id, self.rank)
        if self._own_monitor:
            self.monitor.close()
