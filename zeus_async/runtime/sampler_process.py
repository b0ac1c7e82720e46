"""Sampling in a child process, for programs whose own thread must not share the GIL.

A sampler thread inside a training process competes with it for the GIL: a background thread
that holds the GIL 0.5 ms in every 10 ms slows a small torch training step by ~5 %
(``bench/bench_monitor.py --parts gil``). :class:`SamplerProcess` runs the whole
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
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import msgspec
import zmq

from .. import errors
from ..aggregate.windows import WindowResult
from ..errors import ConfigError
from ..events import DeviceInfo, Event, Measurement
from .processes import ProcessTracking

__all__ = ["SamplerProcess"]

logger = logging.getLogger(__name__)

#: Longest the I/O thread sleeps: the most an edge waits before it is sent when nobody waits for
#: its result, and how soon a dead child is noticed (seconds).
_IDLE_WAKE_S = 0.1


class ChildConfig(msgspec.Struct, frozen=True):
    """Settings handed to the child process (JSON on its command line)."""

    edges: str
    replies: str
    backend: str = "auto"
    gpus: list[int] | None = None
    cpus: list[int] | None = None
    period_s: float = 0.01
    fields: dict[str, float | None] | None = None
    adaptive_reads: bool = False
    publish: str | None = None
    log_file: str | None = None
    finalize_timeout_s: float = 0.5
    sim_config: str | None = None
    parent_pid: int = 0
    record: str | None = None
    processes: ProcessTracking | None = None
    meta: dict[str, str] = {}
    prometheus_port: int | None = None
    prometheus_addr: str = "127.0.0.1"


class Edge(msgspec.Struct, tag="edge", array_like=True):
    """A window edge, parent to child."""

    open: bool
    name: str
    id: int
    t_ns: int
    restart: bool = False
    cancel: bool = False


class Stop(msgspec.Struct, tag="stop", array_like=True):
    """Parent to child: finalize pending windows and exit."""


ControlOp = Literal["set_power_limit", "set_sm_clocks", "publish"]


class Control(msgspec.Struct, tag="control", array_like=True):
    """Parent to child: act on the devices or the stream; answered by a ``control`` reply.

    ``op`` is ``set_power_limit`` (``watts`` on ``gpus``, all when ``None``), ``set_sm_clocks``
    (``mhz`` on ``gpus``; ``None`` resets) or ``publish`` (``event`` published on the child's
    hub).
    """

    seq: int
    op: ControlOp
    watts: float = 0.0
    gpus: list[int] | None = None
    source: str = ""
    event: Event | None = None
    mhz: float | None = None


class Reply(msgspec.Struct, omit_defaults=True):
    """Child to parent."""

    kind: Literal["ready", "measurement", "error", "control"]
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


def control_error(error_type: str, message: str) -> Exception:
    """The exception a failed control reply stands for (typed where it is one of ours)."""
    cls = getattr(errors, error_type, None)
    if isinstance(cls, type) and issubclass(cls, errors.ZeusAsyncError):
        return cls(message)
    return RuntimeError(f"{error_type}: {message}" if error_type else message)


class SamplerProcess:
    """A runtime with measurement windows, running in a child process.

    Args:
        backend, gpus, cpus, period_s, fields, adaptive_reads, publish, finalize_timeout_s: As for
            :class:`~zeus_async.runtime.Runtime`.
        log_file: Window log written by the child (CSV or JSON lines).
        sim_config: A :class:`~zeus_async.devices.sim.SimConfig` for the ``sim`` backend.
        start_timeout_s: How long to wait for the child to be sampling.
        record: Recording file written by the child (every event, lossless).
        processes: Process tracking; by default the tree of *this* (the parent) process,
            without the sampler process itself.
        meta: Run metadata (recording header, stream info).
        prometheus_port: Serve a Prometheus endpoint from the child on this port (0: any
            free port; :attr:`prometheus_port` then says which).
        prometheus_addr: Address the Prometheus endpoint binds.

    Raises:
        RuntimeError: The child failed to start (its error output is in the message).
    """

    def __init__(
        self,
        *,
        backend: str = "auto",
        gpus: Sequence[int] | None = None,
        cpus: Sequence[int] | None = None,
        period_s: float = 0.01,
        fields: Mapping[str, float | None] | None = None,
        adaptive_reads: bool = False,
        publish: str | None = None,
        log_file: str | os.PathLike[str] | None = None,
        finalize_timeout_s: float = 0.5,
        sim_config: object | None = None,
        start_timeout_s: float = 60.0,
        record: str | os.PathLike[str] | None = None,
        processes: ProcessTracking | None = None,
        meta: Mapping[str, str] | None = None,
        prometheus_port: int | None = None,
        prometheus_addr: str = "127.0.0.1",
    ) -> None:
        if not period_s > 0:
            raise ConfigError(f"period_s must be positive, got {period_s!r}")
        if processes is not None and processes.root is None and processes.pids is None:
            processes = msgspec.structs.replace(processes, root=os.getpid())
        self._dir = tempfile.mkdtemp(prefix="zeus-async-")
        self._ctx = zmq.Context()
        self._edges = self._ctx.socket(zmq.PUSH)
        self._edges.bind(f"ipc://{self._dir}/edges")
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir}/replies")
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Reply)
        # Edges go through this queue; the I/O thread sends them (it alone owns the sockets).
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
        self._stopped = False
        self._failure: str | None = None
        sim_json = None
        if sim_config is not None:
            sim_json = msgspec.json.encode(sim_config).decode()
        cfg = ChildConfig(
            edges=f"ipc://{self._dir}/edges",
            replies=f"ipc://{self._dir}/replies",
            backend=backend,
            gpus=list(gpus) if gpus is not None else None,
            cpus=list(cpus) if cpus is not None else None,
            period_s=period_s,
            fields=dict(fields) if fields is not None else None,
            adaptive_reads=adaptive_reads,
            publish=publish,
            log_file=os.fspath(log_file) if log_file is not None else None,
            finalize_timeout_s=finalize_timeout_s,
            sim_config=sim_json,
            parent_pid=os.getpid(),
            record=os.fspath(record) if record is not None else None,
            processes=processes,
            meta=dict(meta or {}),
            prometheus_port=prometheus_port,
            prometheus_addr=prometheus_addr,
        )
        self._stderr = open(os.path.join(self._dir, "stderr"), "w+b")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "zeus_async.runtime._sampler_child", msgspec.json.encode(cfg)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )
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
        self._reader = threading.Thread(
            target=self._read_replies, name="zeus-async-sampler-io", daemon=True
        )
        self._reader.start()

    # -- start-up -------------------------------------------------------------------------------

    def _child_error(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace").strip()
        return text[-2000:] or f"exit code {self._proc.poll()}"

    def _wait_ready(self, timeout_s: float) -> Reply:
        waited = 0.0
        while waited < timeout_s:
            if self._replies.poll(100):
                reply = self._dec.decode(self._replies.recv())
                if reply.kind == "ready":
                    return reply
                if reply.kind == "error":
                    raise RuntimeError(f"sampler process failed: {reply.message}")
            if self._proc.poll() is not None:
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
        with self._pending_lock:
            if self._failure is not None:
                result._fail(RuntimeError(self._failure))
                return
            result._on_wait = functools.partial(self._hurry, result.window_id)
            self._pending[result.window_id] = result

    def _hurry(self, window_id: int) -> None:
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
        )
        self._outbox.append(self._enc.encode(msg))
        self._wake()
        return future

    def _flush_edges(self) -> None:
        outbox = self._outbox
        while outbox:
            try:
                self._edges.send(outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return  # child busy: retry on the next turn
            outbox.popleft()

    def _read_replies(self) -> None:
        # Replies wake the thread only while someone waits for one (see the module docstring).
        urgent = zmq.Poller()
        urgent.register(self._replies, zmq.POLLIN)
        urgent.register(self._wake_r, zmq.POLLIN)
        relaxed = zmq.Poller()
        relaxed.register(self._wake_r, zmq.POLLIN)
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
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if ready and not self._stopped:
                continue
            if self._proc.poll() is not None:
                self._drain_replies()  # its last replies (a stop finalizes every window)
                if not self._stopped:
                    self._fail_all(f"sampler process exited: {self._child_error()}")
                else:
                    self._fail_all("the monitor was closed before this window was measured")
                return

    def _drain_replies(self) -> bool:
        """Handle every reply waiting on the socket (one wake-up for a burst of them).

        Returns ``False`` when the socket is gone or the stream is garbage (stop reading).
        """
        while True:
            try:
                reply = self._dec.decode(self._replies.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            except (zmq.ZMQError, msgspec.DecodeError):
                return False
            if reply.kind == "measurement" and reply.measurement is not None:
                with self._pending_lock:
                    result = self._pending.pop(reply.measurement.window_id, None)
                    self._hurried.discard(reply.measurement.window_id)
                if result is not None:
                    result._resolve(reply.measurement)
            elif reply.kind == "control":
                with self._pending_lock:
                    future = self._controls.pop(reply.seq, None)
                if future is not None:
                    if reply.error_type or reply.message:
                        future.set_exception(control_error(reply.error_type, reply.message))
                    else:
                        future.set_result(None)
            elif reply.kind == "error":
                self._fail_all(f"sampler process failed: {reply.message}")

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
        """Ask the child to finalize pending windows and exit; kill it if it does not."""
        if self._stopped:
            return
        self._stopped = True
        self._outbox.append(self._enc.encode(Stop()))
        self._wake()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("sampler process did not stop within %.0f s; killing it", timeout_s)
            self._kill()
        self._woken = False  # one more wake-up, even if stop's own is still unread:
        self._wake()  # the I/O thread sees that the child is gone, and ends
        self._reader.join(timeout=5)
        self._cleanup()

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _cleanup(self) -> None:
        self._edges.close(linger=0)
        self._replies.close(linger=0)
        self._ctx.term()
        self._stderr.close()
        self._woken = True  # no more wake-ups: the descriptors below may be reused
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self._dir, ignore_errors=True)
