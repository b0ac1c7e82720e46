"""Sampling in a child process, for programs whose own thread must not share the GIL.

A sampler thread inside a training process competes with it for the GIL: a background thread
that holds the GIL 0.5 ms in every 10 ms slows a small torch training step by ~5 %
(``bench/windows/bench_monitor.py --parts gil``). :class:`SamplerProcess` runs the whole
:class:`~zeus_async.runtime.Runtime` (samplers, hub, window tracker, publisher) in a child
process. The parent stamps window edges with its own wall clock and pushes them over a local
ZeroMQ socket: the caller only appends the encoded edge to a queue, and an I/O thread sends it
and resolves each window's result when the child reports it. That thread sleeps until there is
work, and a window edge alone is not urgent: the child keeps 30 s of history and measures a
window from its edges' timestamps whenever they arrive, so queued edges go out with the next
wake-up — at most ``_IDLE_WAKE_S`` later, which also bounds how soon a dead child is noticed.
The child's replies wait in the socket likewise, drained at each wake-up. What wakes the
thread at once: a reader blocking on a window's result (``WindowResult.wait``, or any of its
energy attributes) — the thread then also wakes for replies until that result is resolved — a
control request (and its reply), and stop. A training loop that opens and closes a window per
step and reads no result mid-loop thus costs ``1 / _IDLE_WAKE_S`` wake-ups a second whatever
its step rate, instead of two wake-ups (two GIL hand-offs) per step.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import msgspec
import zmq

from .._liveness import ProcessWatch, pid_alive
from .._paths import private_dir
from ..agent.protocol import (
    AgentConfig,
    Bye,
    Control,
    ControlOp,
    Edge,
    Hello,
    Reply,
    error_from_reply,
)
from ..aggregate.board import BoardReader, provisional_measurement
from ..aggregate.windows import WindowResult
from ..carbon import CarbonConfig
from ..errors import ConfigError
from ..events import DeviceInfo, Event, Measurement
from .processes import ProcessTracking

__all__ = ["Edge", "SamplerProcess"]

logger = logging.getLogger(__name__)

#: Longest the I/O thread sleeps: the most an edge waits before it is sent when nobody waits for
#: its result, and how soon a dead child is noticed (seconds).
_IDLE_WAKE_S = 0.1


class SamplerProcess:
    """A runtime with measurement windows in an agent process: a private one it starts, or a
    node agent it attaches to (:mod:`zeus_async.agent`).

    Args:
        backend, gpus, cpus, period_s, fields, adaptive_reads, publish, finalize_timeout_s: As for
            :class:`~zeus_async.runtime.Runtime`.
        log_file: Window log written by the agent (CSV or JSON lines).
        sim_config: A :class:`~zeus_async.devices.sim.SimConfig` for the ``sim`` backend.
        power_scope: NVIDIA GPUs' power scope (``gpu``, ``module``, ``auto``), as for
            :class:`~zeus_async.runtime.Runtime`.
        start_timeout_s: How long to wait for the agent to be sampling.
        record: Recording file written by the agent (every event, lossless).
        processes: Process tracking; by default the tree of *this* (the parent) process,
            without the agent itself.
        meta: Run metadata (recording header, stream info).
        prometheus_port: Serve a Prometheus endpoint from the agent on this port (0: any
            free port; :attr:`prometheus_port` then says which).
        prometheus_addr: Address the Prometheus endpoint binds.
        prometheus_names: Its metric names (``native``, ``dcgm`` or ``amd``).
        otlp, otlp_interval_s: Push to an OpenTelemetry OTLP/HTTP endpoint from the agent.
        carbon: A :class:`~zeus_async.carbon.CarbonConfig` for the CO2e and cost series of
            the private agent's exporters (``prometheus_port``, ``otlp``); ignored with
            ``attach`` (a node agent keeps none).
        attach: The endpoint of a running agent to use instead of starting a private one
            (the sampling options above are then the agent's; only ``start_timeout_s``
            applies).
        name: This client's name on a node agent (window names are published as
            ``<name>/<window>``); default ``rank<RANK>`` under torchrun, else ``pid<pid>``.

    Raises:
        ConfigError, NoPermissionError, FileNotFoundError, ...: The agent could not start;
            the same type it failed with there.
        RuntimeError: The agent process died while starting (its error output is in the
            message), or did not answer within ``start_timeout_s``.
    """

    def __init__(
        self,
        *,
        backend: str = "auto",
        gpus: Sequence[int] | None = None,
        cpus: Sequence[int] | None = None,
        period_s: float = 0.01,
        fields: Mapping[str, float | None] | None = None,
        adaptive_reads: bool | None = None,
        publish: str | None = None,
        log_file: str | os.PathLike[str] | None = None,
        finalize_timeout_s: float = 0.5,
        sim_config: object | None = None,
        power_scope: str = "gpu",
        start_timeout_s: float = 60.0,
        record: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
        processes: ProcessTracking | None = None,
        meta: Mapping[str, str] | None = None,
        prometheus_port: int | None = None,
        prometheus_addr: str = "127.0.0.1",
        prometheus_names: str = "native",
        otlp: str | None = None,
        otlp_interval_s: float = 10.0,
        carbon: CarbonConfig | None = None,
        attach: str | None = None,
        name: str = "",
    ) -> None:
        if not period_s > 0:
            raise ConfigError(f"period_s must be positive, got {period_s!r}")
        if processes is not None and processes.root is None and processes.pids is None:
            processes = msgspec.structs.replace(processes, root=os.getpid())
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Reply)
        # Edges go through this queue; the I/O thread sends them (it alone owns the socket).
        self._outbox: collections.deque[bytes] = collections.deque()
        # Written to wake the I/O thread (one byte per wake-up, see _wake).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._woken = False
        #: Times the I/O thread woke up (a figure for tests and benchmarks).
        self.io_wakeups = 0
        self._pending: dict[int, WindowResult] = {}
        # Windows whose result a reader is blocked on: replies wake the I/O thread meanwhile.
        self._hurried: set[int] = set()
        self._controls: dict[int, Future[Any]] = {}
        self._control_seq = 0
        # Reentrant: a signal handler may restore limits or clocks (a control request) while
        # the code it interrupted on this thread holds the lock.
        self._pending_lock = threading.RLock()
        self._hurry_cb = self._hurry_result  # bound once: set on every window's result
        self._stopped = False
        self._bye = threading.Event()
        self._failure: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.attached = attach is not None
        self._agent_pid = 0
        self._system_agent = False
        self._agent_watch: ProcessWatch | None = None
        self._agent_fd: int | None = None
        # A private agent's socket (removed at close; swept at a later start when its owner
        # died without closing), and the read end of its stderr.
        self._files: list[Path] = []
        self._agent_out: int | None = None
        self._out_partial = b""
        self._out_tail = b""
        if attach is None:
            directory = private_dir()
            sweep_dead_owners(directory)
            stem = directory / f"a-{os.getpid()}-{os.urandom(4).hex()}"
            self._files = [stem.with_suffix(".sock")]
            endpoint = f"ipc://{self._files[0]}"
            sim_json = None
            if sim_config is not None:
                sim_json = msgspec.json.encode(sim_config).decode()
            cfg = AgentConfig(
                endpoint=endpoint,
                backend=backend,
                gpus=list(gpus) if gpus is not None else None,
                cpus=list(cpus) if cpus is not None else None,
                period_s=period_s,
                fields=dict(fields) if fields is not None else None,
                adaptive_reads=adaptive_reads,
                power_scope=power_scope,
                publish=publish,
                log_file=os.fspath(log_file) if log_file is not None else None,
                finalize_timeout_s=finalize_timeout_s,
                sim_config=sim_json,
                owner_pid=os.getpid(),
                record=os.fspath(record) if record is not None else None,
                overwrite=overwrite,
                processes=processes,
                meta=dict(meta or {}),
                prometheus_port=prometheus_port,
                prometheus_addr=prometheus_addr,
                prometheus_names=prometheus_names,
                otlp=otlp,
                otlp_interval_s=otlp_interval_s,
                carbon=carbon,
            )
            # The agent's warnings (a recording that failed, a restore) come through a pipe of
            # our own, which the I/O thread passes on to this process's logging, where the
            # user looks; its start-up errors also come back typed (see Hello). Never our
            # stderr itself: a launcher that reads our output to the end before it reaps us
            # would wait for the agent to close that pipe, and the agent for us to exit. Not a
            # file either: on a full disk the agent's warnings are the ones that matter. Both
            # ends non-blocking: an agent never waits on a reader that stopped reading (a line
            # that does not fit is dropped).
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            os.set_blocking(write_end, False)
            self._agent_out = read_end
            # Its own session: a Ctrl-C in the terminal or a SIGTERM to this job's process
            # group reaches only us; we then close it (restoring), or it sees us gone.
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "zeus_async.agent.server", msgspec.json.encode(cfg)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=write_end,
                    start_new_session=True,
                )
            finally:
                os.close(write_end)
        else:
            endpoint = attach
        #: The agent's endpoint.
        self.agent_endpoint = endpoint
        self._sock.connect(endpoint)
        hello = Hello(
            os.getpid(),
            name or _default_name(),
            os.environ.get("CUDA_VISIBLE_DEVICES") if attach is not None else None,
            # Attached: the agent measures these GPUs only (it samples all of them anyway).
            gpus=list(gpus) if attach is not None and gpus is not None else None,
        )
        self._sock.send(self._enc.encode(hello))
        try:
            ready = self._wait_ready(start_timeout_s)
        except BaseException:
            self._kill()
            self._cleanup()
            raise
        self.gpu_indices: list[int] = ready.gpus
        self.cpu_indices: list[int] = ready.cpus
        self.backend = ready.backend
        self.endpoint = ready.endpoint
        self.devices: list[DeviceInfo] = ready.devices
        self.prometheus_port: int | None = ready.prometheus_port
        # The agent's power board: provisional figures for windows, read here.
        self._board: BoardReader | None = None
        self._board_keys: dict[str, str] = {}
        if ready.board is not None:
            try:
                self._board = BoardReader(ready.board)
            except (OSError, ValueError) as exc:
                logger.warning("no provisional window figures (power board: %s)", exc)
            else:
                self._board_keys = {
                    f"gpu:{mine}": f"gpu:{theirs}"
                    for mine, theirs in zip(ready.gpus, ready.board_gpus, strict=False)
                }
                for package in ready.cpus:
                    for domain in ("package", "dram"):
                        self._board_keys[f"cpu:{package}/{domain}"] = f"cpu:{package}/{domain}"
        self._estimate_cb = self._estimate
        self._host = socket.gethostname()
        # Attached: watch the agent, which is not our child (a pidfd becomes readable when it
        # exits, zombie or not, and cannot name a later process that reuses the pid).
        self._agent_pid = ready.agent_pid
        # A system agent's journals are root's: nothing for this process to restore.
        self._system_agent = ready.system
        if attach is not None and ready.agent_pid:
            self._agent_watch = ProcessWatch(ready.agent_pid)
            self._agent_fd = self._agent_watch.fileno
        self._reader = threading.Thread(
            target=self._read_replies, name="zeus-async-sampler-io", daemon=True
        )
        self._reader.start()

    # -- start-up -------------------------------------------------------------------------------

    def _child_error(self) -> str:
        self._relay_agent_log(final=True)
        text = self._out_tail.decode(errors="replace").strip()
        code = self._proc.poll() if self._proc is not None else None
        return text[-2000:] or f"exit code {code}"

    def _wait_ready(self, timeout_s: float) -> Reply:
        waited = 0.0
        while waited < timeout_s:
            if self._sock.poll(100):
                reply = self._dec.decode(self._sock.recv())
                if reply.kind == "ready":
                    return reply
                if reply.kind == "error":
                    raise error_from_reply(reply)
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"sampler process exited: {self._child_error()}")
            waited += 0.1
        raise RuntimeError(f"sampler process not ready within {timeout_s:g} s")

    # -- edges ------------------------------------------------------------------------------------

    def send_edge(self, edge: Edge) -> None:
        """Queue one edge for the child: a deque append on the caller's thread.

        The edge is sent by the I/O thread's next wake-up, within ``_IDLE_WAKE_S``, or at once
        when a reader blocks on the window's result (see :meth:`expect`).
        """
        if self._failure is not None:
            raise RuntimeError(self._failure)
        self._outbox.append(self._enc.encode(edge))

    def _wake(self) -> None:
        """Wake the I/O thread (one pipe write per wake-up, however many callers ask)."""
        if self._woken:
            return
        self._woken = True
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe already holds a wake-up, or it is closed (stopping)

    def expect(self, result: WindowResult) -> None:
        """Resolve ``result`` when the child reports its window.

        A reader blocking on ``result`` first wakes the I/O thread, so the window's queued
        closing edge is sent without waiting for the next idle wake-up, and its reply is read
        as soon as it comes.
        """
        # On the caller's thread at every window end, so no lock: one dict store (atomic), then
        # the failure check. _fail_all sets _failure before it takes the dict, so a result
        # stored after that is failed here (failing twice is harmless), and one stored before
        # is in the dict it fails.
        result._on_wait = self._hurry_cb
        if self._board is not None:
            result._estimate = self._estimate_cb
        self._pending[result.window_id] = result
        if self._failure is not None:
            result._fail(RuntimeError(self._failure))

    def _estimate(self, result: WindowResult) -> Measurement | None:
        assert self._board is not None
        return provisional_measurement(
            self._board, result, self._board_keys, host=self._host, now_ns=time.time_ns()
        )

    def _hurry_result(self, result: WindowResult) -> None:
        window_id = result.window_id
        with self._pending_lock:
            if window_id not in self._pending:
                return  # resolved meanwhile
            self._hurried.add(window_id)
        self._wake()

    def control(
        self,
        op: ControlOp,
        *,
        watts: float = 0.0,
        mhz: float | None = None,
        gpus: Sequence[int] | None = None,
        source: str = "",
        event: Event | None = None,
        setting: Literal["power_limit", "sm_clocks"] | None = None,
    ) -> Future[Any]:
        """Ask the child to act (see :class:`Control`); returns at once with a future.

        The future resolves when the child has done it, or fails with the child's error
        (typed: ``NoPermissionError``, ``ConfigError``, ...).
        """
        future: Future[Any] = Future()
        with self._pending_lock:
            if self._failure is not None:
                future.set_exception(RuntimeError(self._failure))
                return future
            self._control_seq += 1
            seq = self._control_seq
            self._controls[seq] = future
        msg = Control(
            seq,
            op,
            watts,
            None if gpus is None else list(gpus),
            source=source,
            event=event,
            mhz=mhz,
            setting=setting,
        )
        self._outbox.append(self._enc.encode(msg))
        self._wake()
        return future

    def _flush_edges(self) -> None:
        outbox = self._outbox
        while outbox:
            try:
                self._sock.send(outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return  # child busy: retry on the next turn
            outbox.popleft()

    def _read_replies(self) -> None:
        # Replies wake the thread only while someone waits for one (see the module docstring).
        urgent = zmq.Poller()
        urgent.register(self._sock, zmq.POLLIN)
        urgent.register(self._wake_r, zmq.POLLIN)
        # Plain descriptors only: the stdlib's poll, whose timed sleep costs a third less CPU
        # than pyzmq's (bench/history/RESULTS-journal-2026-11.md, issue 20), and this is the
        # state the thread idles in.
        relaxed = select.poll()
        relaxed.register(self._wake_r, select.POLLIN)
        if self._agent_fd is not None:
            urgent.register(self._agent_fd, zmq.POLLIN)
            relaxed.register(self._agent_fd, select.POLLIN)
        timeout_ms = round(_IDLE_WAKE_S * 1e3)
        while True:
            # Clear the flag before sending, so a request queued after this flush wakes us again.
            self._woken = False
            self._flush_edges()
            if not self._drain_replies():
                return
            poller = urgent if self._hurried or self._controls else relaxed
            try:
                # Edges left in the outbox (the child's queue was full) are retried soon.
                ready = dict(poller.poll(5 if self._outbox else timeout_ms))
            except zmq.ZMQError:
                return
            self.io_wakeups += 1
            self._relay_agent_log()
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self._proc is None and self._agent_exited(ready):
                self._drain_replies()
                self._bye.set()  # nobody is left to answer a goodbye
                if not self._stopped:
                    outcome = self._recover_after_agent()  # first: the error says how it went
                    self._fail_all(
                        f"the agent (pid {self._agent_pid}) exited: windows in flight are lost; "
                        f"{outcome} (see docs/agent.md)"
                    )
                return
            if ready and not self._stopped:
                continue
            if self._proc is None:  # attached to an agent that is not our child
                if self._stopped and self._bye.is_set():
                    self._fail_all("the monitor was closed before this window was measured")
                    return
                continue
            if self._proc.poll() is not None:
                self._drain_replies()  # its last replies (a stop finalizes every window)
                if not self._stopped:
                    # Killed (SIGKILL, OOM): its journal is orphaned; put it back from here.
                    outcome = self._recover_after_agent()
                    self._fail_all(f"sampler process exited: {self._child_error()}; {outcome}")
                else:
                    self._fail_all("the monitor was closed before this window was measured")
                return

    def _agent_exited(self, ready: dict[Any, int]) -> bool:
        if self._agent_fd is not None:
            return self._agent_fd in ready
        return self._agent_watch is not None and not self._agent_watch.alive()

    def _relay_agent_log(self, *, final: bool = False) -> None:
        """Pass what a private agent wrote to its stderr since the last call on to this
        process's logger, whole lines only (``final``: the rest too). One ``read`` that finds
        nothing when nothing is new."""
        if self._agent_out is None:
            return
        chunks = []
        while True:
            try:
                chunk = os.read(self._agent_out, 65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        if not chunks and not (final and self._out_partial):
            return
        data = b"".join(chunks)
        self._out_tail = (self._out_tail + data)[-4000:]
        lines = (self._out_partial + data).split(b"\n")
        self._out_partial = b"" if final else lines.pop()
        for line in lines:
            if line.strip():
                logger.warning("%s", line.decode(errors="replace"))

    def _recover_after_agent(self) -> str:
        """Restore the dead agent's journal from here rather than wait for the next agent or
        runtime to start (whichever process gets the lock first does it); what really became
        of its settings, as a clause for the error message."""
        from zeus_async.agent.leases import recover_after

        if self._system_agent:
            return (
                "it is the node's system agent: the settings it held are restored when it "
                "starts again (or by `zeus-async agent --system --restore`, as root)"
            )
        try:
            return recover_after(self._agent_pid)  # logs what it restores and what it cannot
        except Exception as exc:
            logger.exception("restoring the dead agent's settings failed")
            return (
                f"restoring the settings it held failed ({exc}); run `zeus-async agent --restore`"
            )

    def _drain_replies(self) -> bool:
        """Handle every reply waiting on the socket (one wake-up for a burst of them).

        Returns ``False`` when the socket is gone or the stream is garbage (stop reading).
        """
        while True:
            try:
                reply = self._dec.decode(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            except (zmq.ZMQError, msgspec.DecodeError):
                return False
            if reply.kind == "measurement" and reply.measurement is not None:
                with self._pending_lock:
                    result = self._pending.pop(reply.measurement.window_id, None)
                    self._hurried.discard(reply.measurement.window_id)
                if result is not None:
                    if reply.pieces:
                        result._pieces = reply.pieces
                    result._resolve(reply.measurement)
            elif reply.kind == "control":
                with self._pending_lock:
                    future = self._controls.pop(reply.seq, None)
                if future is not None:
                    if reply.error_type or reply.message:
                        future.set_exception(error_from_reply(reply))
                    else:
                        future.set_result(None)
            elif reply.kind == "bye":
                self._bye.set()
            elif reply.kind == "error":
                self._fail_all(f"sampler process failed: {error_from_reply(reply)!r}")

    def _fail_all(self, message: str) -> None:
        with self._pending_lock:
            self._failure = message
            pending, self._pending = self._pending, {}
            self._hurried.clear()
            controls, self._controls = self._controls, {}
        if not self._stopped:
            logger.error("%s", message)
        for result in pending.values():
            result._fail(RuntimeError(message))
        for future in controls.values():
            if not future.done():
                future.set_exception(RuntimeError(message))

    # -- shutdown ---------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 10.0) -> None:
        """Say goodbye: the agent finalizes pending windows and restores what this client
        changed (a private agent then exits; it is killed if it does not)."""
        if self._stopped:
            return
        self._stopped = True
        self._outbox.append(self._enc.encode(Bye()))
        self._wake()
        if self._proc is None:
            # The I/O thread reads the agent's last replies, then its goodbye.
            if not self._bye.wait(timeout_s):
                logger.warning("the agent did not answer goodbye within %.0f s", timeout_s)
                self._bye.set()
        else:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("sampler process did not stop within %.0f s; killing it", timeout_s)
                self._kill()
        self._woken = False  # one more wake-up, even if stop's own is still unread:
        self._wake()  # the I/O thread sees that the agent is gone, and ends
        self._reader.join(timeout=5)
        self._relay_agent_log(final=True)
        self._cleanup()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _cleanup(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
        if self._agent_out is not None:
            os.close(self._agent_out)
            self._agent_out = None
        self._woken = True  # no more wake-ups: the descriptors below may be reused
        if self._agent_watch is not None:
            self._agent_watch.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._proc is None or self._proc.poll() is not None:
            for path in self._files:
                with contextlib.suppress(OSError):
                    path.unlink()


#: Names of a private agent's files in the private directory: ``a-<owner pid>-<id>.<kind>``.
_PRIVATE_FILE = re.compile(r"a-(\d+)-[0-9a-f]+\.sock")


def sweep_dead_owners(directory: Path) -> int:
    """Remove the sockets of private agents whose owner has exited (zombie or not) without
    closing them; how many files went."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        match = _PRIVATE_FILE.fullmatch(name)
        if match is None or pid_alive(int(match[1])):
            continue
        with contextlib.suppress(OSError):
            (directory / name).unlink()
            removed += 1
    if removed:
        logger.debug("removed %d file(s) of private agents whose owner died", removed)
    return removed


def _default_name() -> str:
    rank = os.environ.get("RANK")
    return f"rank{rank}" if rank is not None else f"pid{os.getpid()}"
