"""A request meter for serving processes that share GPUs: the node agent attributes.

:class:`~zeus_async.inference.RequestMeter` splits a GPU's energy among the requests of its
own process; with ``uvicorn --workers 4``, or an engine in a process of its own, each process
would see the whole GPU's energy and only its own requests. :class:`RemoteMeter` has the same
serving API, in any number of processes; their edges go to the node agent, which runs one
meter for the node (:mod:`zeus_async.agent.requests`), so each GPU's energy is split once
among every request that used it::

    meter = RemoteMeter()                     # the node agent's socket (start one: start_agent)
    meter.begin(request_id, gpus=(0,))        # on the serving thread: one append
    meter.phase(request_id, "decode")
    meter.end(request_id, tokens_in=812, tokens_out=64)
    ...
    meter.settled(request_id)                 # RequestEnergy, once the agent settled it

On the serving thread each call stamps ``time.time_ns()`` (or takes ``at_ns``) and appends
to a bounded queue; it never raises and never waits. A background thread sends the queue in
batches (one message of columns every ``batch_s``, or as soon as ``batch_edges`` wait), and
takes the agent's results back: each settled request of this process, with this process's
request id and GPU indices (``CUDA_VISIBLE_DEVICES`` applies, as for windows). The agent
names the requests ``<client name>/<id>``, so processes never collide.

Results of another process: ``RemoteMeter(follow=("vllm-core0",))`` also receives the
results of the clients named ``vllm-core0`` (an engine core whose front end answers the
HTTP request). They are kept apart from this process's own, under the sender's ids as it
gave them (never mixed with this process's ids): :meth:`RemoteMeter.settled_from`,
:meth:`RemoteMeter.results_from`, :meth:`RemoteMeter.subscribe_followed`. A name nobody
uses yields nothing; a sender that starts later is followed from then on.

What cannot be sent is dropped and counted (:attr:`RemoteMeter.totals`), never raised: edges
past the queue bound (``queue_full``), edges made while no agent answers (``no_agent``: the
meter reconnects every ``reconnect_s``, to a restarted agent too), batches the agent does not
take in time (``send_failed``). A request whose begin went to an agent that has since gone
is unknown to the next one: its end is counted there as bad input (``unknown_id``).
"""

from __future__ import annotations

import collections
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec
import zmq

from .._liveness import ProcessWatch
from ..agent.protocol import (
    Bye,
    Hello,
    Reply,
    RequestEdges,
    RequestResult,
    RequestStep,
)
from .attribution import Attribution, RequestEnergy

__all__ = ["DROP_REASONS", "RemoteMeter", "RemoteTotals"]

logger = logging.getLogger(__name__)

_BEGIN, _PHASE, _END, _ABORT, _STEP, _DISCARD = 0, 1, 2, 3, 4, 5
#: A discard's kind on the wire (:class:`RequestEdges`; a step travels apart, in ``steps``).
_WIRE_DISCARD = 4

#: Why edges were dropped (``RemoteTotals.dropped``): the queue was full, no agent answered,
#: the agent did not take a batch in time.
DROP_REASONS = ("queue_full", "no_agent", "send_failed")

#: RequestEnergy's fields (``error_j`` where the installed meter has it).
_ENERGY_FIELDS = frozenset(f.name for f in fields(RequestEnergy))


@dataclass
class RemoteTotals:
    """What a :class:`RemoteMeter` sent, dropped and got back."""

    #: Edges (and steps) sent to the agent, in how many batches.
    sent_edges: int = 0
    sent_batches: int = 0
    #: Edges dropped, by reason (:data:`DROP_REASONS`).
    dropped: dict[str, int] = field(default_factory=dict)
    #: Settled requests the agent sent back.
    results: int = 0
    #: Settled requests of the clients followed (``follow``) the agent sent.
    followed_results: int = 0
    #: Connections made to an agent (more than one: it restarted, or was absent a while).
    connects: int = 0

    @property
    def dropped_edges(self) -> int:
        return sum(self.dropped.values())


class RemoteMeter:
    """Request edges of this process, attributed by the node agent (module docstring).

    Args:
        endpoint: The agent's socket (default: the node agent's, when one runs).
        name: This process's name at the agent, which prefixes its request ids there
            (default ``pid<pid>``; the agent makes it unique among its clients).
        start_agent: Start a node agent when none runs (as the first rank of a job does,
            :func:`~zeus_async.agent.client.ensure_node_agent`).
        batch_s: Longest an edge waits before it is sent.
        batch_edges: Edges per message at most (a batch goes as soon as that many wait).
        max_queue: Edges waiting at most; beyond, they are dropped (``queue_full``).
        keep: Settled results kept for :meth:`results` (oldest dropped), and as many of
            the clients followed for :meth:`results_from`.
        follow: Names of other clients (as they named themselves: ``name``) whose results
            this meter receives too (:meth:`settled_from`; at most 16 names).
        reconnect_s: How often an absent agent is looked for again.
        connect_timeout_s: Longest a connection waits for the agent's answer.
        clock: Wall-clock ns for the edges (the agent's readings are stamped with it).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        name: str = "",
        start_agent: bool = False,
        batch_s: float = 0.05,
        batch_edges: int = 4096,
        max_queue: int = 100_000,
        keep: int = 100_000,
        reconnect_s: float = 1.0,
        connect_timeout_s: float = 2.0,
        clock: Callable[[], int] = time.time_ns,
        follow: Sequence[str] = (),
    ) -> None:
        self._endpoint = endpoint
        self.follow = tuple(dict.fromkeys(str(n) for n in follow if n))
        self.name = name or f"pid{os.getpid()}"
        self._start_agent = start_agent
        self._batch_s = batch_s
        self._batch_edges = max(1, batch_edges)
        self._max_queue = max(1, max_queue)
        self._keep = keep
        self._reconnect_s = reconnect_s
        self._connect_timeout_s = connect_timeout_s
        self._clock = clock
        self._queue: collections.deque[tuple[int, Any, Any, Any]] = collections.deque()
        self._full = 0  # edges refused on the serving thread (queue_full)
        self._full_seen = 0  # of which counted in totals
        self.totals = RemoteTotals()
        self._results: collections.OrderedDict[str, RequestEnergy] = collections.OrderedDict()
        self._results_lock = threading.Lock()
        self._subscribers: list[Callable[[Attribution], None]] = []
        #: (sender's name as followed, its request id) -> its result.
        self._followed: collections.OrderedDict[tuple[str, str], RequestEnergy] = (
            collections.OrderedDict()
        )
        self._followed_subscribers: list[Callable[[str, Attribution], None]] = []
        self._now = threading.Event()  # flush at once (settle_soon, close)
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock: Any = None
        self._watch: ProcessWatch | None = None
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Reply)
        #: The agent's endpoint while connected (``None``: none now).
        self.connected_to: str | None = None
        self._thread = threading.Thread(target=self._run, name="zeus-remote-meter", daemon=True)
        self._thread.start()

    # -- the serving thread ----------------------------------------------------------------
    # One append each; never raises (what is wrong is found by the agent's meter, counted).

    def begin(
        self, request_id: str, gpus: Sequence[int] = (0,), *, at_ns: int | None = None
    ) -> None:
        """A request starts (its prefill, when phases are marked) on ``gpus`` (this
        process's indices). ``at_ns``: when (wall-clock ns), default now."""
        q = self._queue
        if len(q) >= self._max_queue:
            self._full += 1
            return
        q.append((_BEGIN, request_id, self._clock() if at_ns is None else at_ns, gpus))

    def phase(self, request_id: str, name: str = "decode", *, at_ns: int | None = None) -> None:
        """The request moves to ``decode`` (its first output token is out)."""
        q = self._queue
        if len(q) >= self._max_queue:
            self._full += 1
            return
        q.append((_PHASE, request_id, self._clock() if at_ns is None else at_ns, name))

    def end(
        self,
        request_id: str,
        *,
        tokens_in: int = 0,
        tokens_out: int = 0,
        route: str = "",
        model: str = "",
        at_ns: int | None = None,
    ) -> None:
        """The request is done (``completed``), with its token counts and labels."""
        q = self._queue
        if len(q) >= self._max_queue:
            self._full += 1
            return
        t = self._clock() if at_ns is None else at_ns
        q.append((_END, request_id, t, (tokens_in, tokens_out, route, model, "")))

    def abort(
        self,
        request_id: str,
        reason: str = "cancelled",
        *,
        tokens_in: int = 0,
        tokens_out: int = 0,
        route: str = "",
        model: str = "",
        at_ns: int | None = None,
    ) -> None:
        """The request stops unfinished: ``cancelled`` (the client went away) or ``error``."""
        q = self._queue
        if len(q) >= self._max_queue:
            self._full += 1
            return
        t = self._clock() if at_ns is None else at_ns
        q.append((_ABORT, request_id, t, (tokens_in, tokens_out, route, model, reason)))

    def discard(self, request_id: str) -> None:
        """The request is not metered after all (an unmatched 404): the agent's meter drops
        it (``RequestMeter.discard``), its time goes to the others in flight or to idle, and
        no result comes back."""
        q = self._queue
        if len(q) >= self._max_queue:
            self._full += 1
            return
        q.append((_DISCARD, request_id, self._clock(), None))

    def step(
        self,
        batch: Sequence[Any],
        *,
        start_ns: int,
        end_ns: int,
        gpus: Sequence[int] | None = None,
    ) -> None:
        """One engine step: ``batch`` of ``StepEntry(request_id, prefill_tokens,
        decode_tokens, context_len)`` (or 4-tuples) over ``[start_ns, end_ns]`` on ``gpus``
        (this process's indices; default: those of its requests)."""
        q = self._queue
        if len(q) >= self._max_queue:
            self._full += 1
            return
        q.append((_STEP, batch, start_ns, (end_ns, gpus)))

    # -- results -------------------------------------------------------------------------------

    def settled(self, request_id: str) -> RequestEnergy | None:
        """A kept request's figures, once the agent settled it."""
        return self._results.get(request_id)

    def results(self) -> list[RequestEnergy]:
        """The settled requests kept so far (the latest ``keep``, oldest first)."""
        with self._results_lock:
            return list(self._results.values())

    def subscribe(self, callback: Callable[[Attribution], None]) -> None:
        """Call ``callback`` with each batch of this process's settled requests (an
        :class:`Attribution` with ``requests`` only: the GPUs' figures are the node's, see
        the agent's ``request_idle`` events), in the meter's background thread."""
        self._subscribers.append(callback)

    def settled_from(self, name: str, request_id: str) -> RequestEnergy | None:
        """A kept request of the client ``name`` followed (``follow``), by its id as that
        client gave it."""
        return self._followed.get((name, request_id))

    def results_from(self, name: str | None = None) -> list[RequestEnergy]:
        """The kept requests of the client ``name`` followed (``None``: of every one),
        oldest first."""
        with self._results_lock:
            return [r for (n, _), r in self._followed.items() if name is None or n == name]

    def subscribe_followed(self, callback: Callable[[str, Attribution], None]) -> None:
        """Call ``callback(name, attribution)`` with each batch of settled requests of a
        client followed (its name as followed; the requests keyed by that client's ids), in
        the meter's background thread."""
        self._followed_subscribers.append(callback)

    def settle_soon(self) -> None:
        """Send the edges waiting now, without waiting for the batch period; results come
        when the agent settles (its ``requests_settle_s``). Returns at once."""
        self._now.set()

    def wait_connected(self, timeout_s: float = 10.0) -> bool:
        """Wait until the meter is connected to an agent (at most ``timeout_s``); whether it
        is. Not needed (edges wait in the queue meanwhile), but the node's attributor counts
        energy from its first reading on, which follows the first connection."""
        deadline = time.monotonic() + timeout_s
        while self.connected_to is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.connected_to is not None

    @property
    def pending(self) -> int:
        """Edges waiting to be sent."""
        return len(self._queue)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what waits, say goodbye (the agent aborts this process's requests still in
        flight, as ``cancelled``) and stop the background thread."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._now.set()
        self._thread.join(timeout_s)  # it closes its sockets and context as it ends

    def __enter__(self) -> RemoteMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the background thread -----------------------------------------------------------------

    def _drop(self, reason: str, count: int) -> None:
        if count <= 0:
            return
        dropped = self.totals.dropped
        first = not dropped.get(reason)
        dropped[reason] = dropped.get(reason, 0) + count
        if first:
            logger.warning(
                "remote request meter: %d edge(s) dropped (%s); counted in totals.dropped",
                count,
                reason,
            )

    def _run(self) -> None:
        while True:
            try:
                self._loop()
                return
            except Exception:  # a bug here must not stop the meter: logged, started again
                logger.exception("remote request meter: its thread failed; starting again")
                try:
                    self._disconnect(bye=False)
                except Exception:
                    self._sock = None
                time.sleep(0.1)

    def _loop(self) -> None:
        next_try = 0.0
        next_send = time.monotonic() + self._batch_s
        while True:
            stopping = self._stop.is_set()
            now = time.monotonic()
            if self._sock is None and not stopping and now >= next_try and not self._connect():
                next_try = time.monotonic() + self._reconnect_s
            # (the serving threads only add to _full: no count is lost to a reset here)
            full = self._full
            self._drop("queue_full", full - self._full_seen)
            self._full_seen = full
            if self._sock is not None and self._watch is not None and not self._watch.alive():
                logger.warning("remote request meter: the agent (pid %d) is gone", self._watch.pid)
                self._disconnect(bye=False)
                next_try = time.monotonic()
            now = time.monotonic()
            if (
                stopping
                or now >= next_send
                or self._now.is_set()
                or len(self._queue) >= self._batch_edges
            ):
                self._now.clear()
                self._flush()
                next_send = now + self._batch_s
            if stopping:
                self._disconnect(bye=True)
                self._ctx.destroy(linger=0)
                return
            wait_s = min(0.01, max(0.0, next_send - time.monotonic()))
            sock = self._sock
            if sock is None:
                self._now.wait(wait_s)
                continue
            try:
                if sock.poll(max(1, round(wait_s * 1e3))):
                    self._read()
            except zmq.ZMQError as exc:
                logger.debug("remote request meter: %s", exc)
                self._disconnect(bye=False)

    def _connect(self) -> bool:
        """Connect to the agent and say hello; whether it answered ready."""
        endpoint = self._endpoint
        try:
            if endpoint is None:
                from ..agent.client import ensure_node_agent, node_agent_endpoint

                endpoint = ensure_node_agent() if self._start_agent else node_agent_endpoint()
            if endpoint is None:
                raise ConnectionError("no node agent runs")
            if endpoint.startswith("ipc://") and not os.path.exists(endpoint[6:]):
                raise ConnectionError(f"no socket at {endpoint}")
            sock = self._ctx.socket(zmq.DEALER)
        except Exception as exc:
            self._absent(str(exc))
            return False
        sock.linger = 0
        sock.sndhwm = 100  # batches: an agent not reading makes sends fail, counted
        try:
            sock.connect(endpoint)
            hello = Hello(
                os.getpid(),
                self.name,
                os.environ.get("CUDA_VISIBLE_DEVICES"),
                gpus=[],
                follow=list(self.follow),
            )
            sock.send(self._enc.encode(hello))
            deadline = time.monotonic() + self._connect_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(max(1, round(left * 1e3))):
                    raise ConnectionError(f"the agent at {endpoint} did not answer")
                reply = self._dec.decode(sock.recv())
                if reply.kind == "error":
                    raise ConnectionError(f"the agent refused: {reply.message}")
                if reply.kind == "ready":
                    break
            # An empty batch: the agent starts its attributor now, so it has readings from
            # before this process's first request.
            sock.send(self._enc.encode(_columns([])))
        except Exception as exc:
            sock.close(linger=0)
            self._absent(str(exc))
            return False
        self._sock = sock
        self._watch = ProcessWatch(reply.agent_pid) if reply.agent_pid else None
        self.connected_to = endpoint
        self.totals.connects += 1
        self._absent_logged = False
        logger.info("remote request meter: connected to the agent at %s", endpoint)
        return True

    _absent_logged = False

    def _absent(self, why: str) -> None:
        # The edges made meanwhile are dropped (no_agent) by the next flush.
        if not self._absent_logged:
            self._absent_logged = True
            logger.warning(
                "remote request meter: no agent (%s); edges are dropped and counted until "
                "one answers (tried every %g s)",
                why,
                self._reconnect_s,
            )

    def _disconnect(self, *, bye: bool) -> None:
        sock, self._sock = self._sock, None
        self.connected_to = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if sock is None:
            return
        if bye:
            try:
                sock.send(self._enc.encode(Bye()), zmq.NOBLOCK)
                # The goodbye is on its way before the socket goes.
                sock.poll(50)
            except zmq.ZMQError:
                pass
            sock.close(linger=200)
        else:
            sock.close(linger=0)

    def _flush(self) -> None:
        """Send every edge waiting now, in messages of ``batch_edges`` at most."""
        q = self._queue
        while q:
            n = min(len(q), self._batch_edges)
            batch = [q.popleft() for _ in range(n)]
            if self._sock is None:
                self._drop("no_agent", n)
                continue
            try:
                data = self._enc.encode(_columns(batch))
            except Exception:
                logger.exception("remote request meter: a batch could not be encoded")
                self._drop("send_failed", n)
                continue
            try:
                self._sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                self._drop("send_failed", n)
                continue
            except zmq.ZMQError as exc:
                logger.debug("remote request meter: %s", exc)
                self._drop("send_failed", n)
                self._disconnect(bye=False)
                continue
            self.totals.sent_edges += n
            self.totals.sent_batches += 1

    def _read(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self._dec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("remote request meter: a reply not understood: %s", exc)
                continue
            if reply.kind == "requests" and reply.requests:
                self._take(reply)

    def _take(self, reply: Reply) -> None:
        out = Attribution(reply.start_ns, reply.end_ns, reply.policy)
        got = [_energy(r) for r in reply.requests]
        if reply.sender:
            self._take_followed(reply.sender, out, got)
            return
        with self._results_lock:
            results = self._results
            for r in got:
                results[r.request_id] = r
                results.move_to_end(r.request_id)
            while len(results) > self._keep:
                results.popitem(last=False)
        self.totals.results += len(got)
        out.requests = {r.request_id: r for r in got}
        for callback in self._subscribers:
            try:
                callback(out)
            except Exception:
                logger.exception("a remote request-meter subscriber failed")

    def _take_followed(self, name: str, out: Attribution, got: list[RequestEnergy]) -> None:
        with self._results_lock:
            kept = self._followed
            for r in got:
                key = (name, r.request_id)
                kept[key] = r
                kept.move_to_end(key)
            while len(kept) > self._keep:
                kept.popitem(last=False)
        self.totals.followed_results += len(got)
        out.requests = {r.request_id: r for r in got}
        for callback in self._followed_subscribers:
            try:
                callback(name, out)
            except Exception:
                logger.exception("a remote request-meter subscriber (followed) failed")


def _energy(r: RequestResult) -> RequestEnergy:
    kwargs: dict[str, Any] = {
        "request_id": r.request_id,
        "energy_j": r.energy_j,
        "gpu_energy_j": dict(r.gpu_energy_j),
        "prefill_j": r.prefill_j,
        "decode_j": r.decode_j,
        "tokens_in": r.tokens_in,
        "tokens_out": r.tokens_out,
        "time_s": r.time_s,
        "method": r.method,
        "begin_ns": r.begin_ns,
        "end_ns": r.end_ns,
        "decode_ns": r.decode_ns,
        "route": r.route,
        "model": r.model,
        "finish_reason": r.finish_reason,
    }
    if "error_j" in _ENERGY_FIELDS:
        kwargs["error_j"] = r.error_j
    return RequestEnergy(**kwargs)


def _index(value: Any, default: int) -> int:
    """An int as given, else ``default`` (the agent's meter counts what stands for bad)."""
    if type(value) is int:
        return value
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except Exception:
        return default


def _count(value: Any) -> int:
    n = _index(value, -1)
    return n if n >= 0 else -1


def _text(value: Any) -> str:
    if type(value) is str:
        return value
    try:
        return "" if value is None else str(value)
    except Exception:
        return ""


def _gpu_list(gpus: Any) -> list[int]:
    try:
        return [operator.index(g) for g in gpus]
    except Exception:
        return []  # the agent's meter counts it (bad input: gpus)


def _columns(batch: list[tuple[int, Any, Any, Any]]) -> RequestEdges:
    """Queued edges as one message of columns (what the app passed made wire-safe)."""
    msg = RequestEdges([], [], [], [], [], [], [], [], [], [])
    kinds, ids, ts, gpus = msg.kind, msg.id, msg.t_ns, msg.gpus
    tin, tout, text, route, model = (
        msg.tokens_in,
        msg.tokens_out,
        msg.text,
        msg.route,
        msg.model,
    )
    for kind, rid, t, payload in batch:
        if kind == _STEP:
            step = _step(rid, t, payload)
            if step is not None:
                msg.steps.append(step)
            continue
        kinds.append(_WIRE_DISCARD if kind == _DISCARD else kind)
        ids.append(_text(rid))
        ts.append(_index(t, 0))
        if kind == _BEGIN:
            gpus.append(_gpu_list(payload))
            tin.append(0)
            tout.append(0)
            text.append("")
            route.append("")
            model.append("")
        elif kind in (_PHASE, _DISCARD):
            gpus.append([])
            tin.append(0)
            tout.append(0)
            text.append("" if kind == _DISCARD else _text(payload))
            route.append("")
            model.append("")
        else:
            a, b, r, m, reason = payload
            gpus.append([])
            tin.append(_count(a))
            tout.append(_count(b))
            text.append(_text(reason))
            route.append(_text(r))
            model.append(_text(m))
    return msg


def _step(batch: Any, start_ns: Any, payload: Any) -> RequestStep | None:
    end_ns, gpus = payload
    try:
        entries = list(batch)
    except Exception:
        return None
    ids: list[str] = []
    prefill: list[int] = []
    decode: list[int] = []
    context: list[int] = []
    for e in entries:
        try:
            rid, p, d, c = e
        except Exception:
            continue
        ids.append(_text(rid))
        prefill.append(max(0, _index(p, 0)))
        decode.append(max(0, _index(d, 0)))
        context.append(max(0, _index(c, 0)))
    return RequestStep(
        _index(start_ns, 0),
        _index(end_ns, 0),
        None if gpus is None else _gpu_list(gpus),
        ids,
        prefill,
        decode,
        context,
    )
