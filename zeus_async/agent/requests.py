"""The node's request attributor: one :class:`~zeus_async.inference.RequestMeter` for every
serving process of the node.

Each serving process (a uvicorn worker, an engine process, a tensor-parallel rank) meters its
requests with a :class:`~zeus_async.inference.remote.RemoteMeter`, which sends its edges in
batches (:class:`.protocol.RequestEdges`). The agent feeds them all, and its own readings of
every GPU, to one meter, so each GPU's energy is split once among all the requests that used
it, whichever process served them: per GPU, requests plus idle equal the measured energy.

* Made at the first request edges (an agent never asked costs nothing), fed from then on by
  the runtime's readings (a consumer); settling runs in a worker thread every
  ``requests_settle_s``, its horizon kept ``requests_edge_delay_s`` behind now so edges that
  come late from a client's batching still fall in order.
* A request's id is the client's prefixed with the client's name (``<client>/<id>``, as a
  node agent names windows): unique among processes. Its GPUs are the client's indices
  (``CUDA_VISIBLE_DEVICES`` applies), mapped to the agent's.
* Each settled request goes back to the client that sent it (a ``requests`` reply, with the
  client's id and GPU indices), and is published on the agent's hub (``request`` and
  ``request_idle`` events: the bus, the recording).
* A client may *follow* others by name (``Hello.follow``: a vLLM front end follows its engine
  core, ``vllm-core0``): each result of a client of that name (``name`` or the agent's
  ``name#n``) goes to its followers too, with the sender's id, the name followed as
  ``sender`` and the follower's GPU indices, if the follower is the sender's user (or
  root: a system agent serves several users). Bounded: :data:`_MAX_FOLLOW` names per
  follower, :data:`_MAX_FOLLOWERS` followers per name; a follower that does not read is
  bounded by the socket's high-water mark (ZeroMQ drops what is beyond, never queues more).
* A client that leaves or dies with requests in flight: those are aborted as ``cancelled``
  at that moment (counted in ``orphaned``), so they never hold the horizon.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ..events import Event
from ..inference.attribution import Attribution, RequestEnergy
from ..inference.meter import RequestMeter
from .protocol import AgentConfig, Reply, RequestEdges, RequestResult, RequestTotals

if TYPE_CHECKING:
    from ..runtime.runtime import Runtime

__all__ = ["NodeRequests"]

logger = logging.getLogger(__name__)

_BEGIN, _PHASE, _END, _ABORT, _DISCARD = 0, 1, 2, 3, 4
#: Request events waiting for the hub at most.
_EVENTS_QUEUED = 100_000
#: Names one client follows at most, followers of one name at most, a name's length at most.
_MAX_FOLLOW = 16
_MAX_FOLLOWERS = 64
_MAX_NAME = 200


class _ClientLike(Protocol):
    ident: bytes
    name: str
    visible: list[int] | None
    #: The client's user (``None``: a transport without credentials).
    uid: int | None

    def to_agent(self, gpus: list[int] | None) -> list[int] | None: ...


class NodeRequests:
    """The node's request attributor (see the module docstring).

    ``send(ident, reply)`` sends a reply to a client (called on the agent's event loop);
    ``clients``: the agent's clients by connection (those gone get no results).
    """

    def __init__(
        self,
        cfg: AgentConfig,
        rt: Runtime,
        send: Callable[[bytes, Reply], None],
        clients: Mapping[bytes, _ClientLike],
    ) -> None:
        self.cfg = cfg
        self.clients = clients
        self.rt = rt
        self.send = send
        self.meter: RequestMeter | None = None
        #: Full id -> (client connection, client's id, client's name as it asked, its user),
        #: until its result is sent back.
        self._owner: collections.OrderedDict[str, tuple[bytes, str, str, int | None]] = (
            collections.OrderedDict()
        )
        #: Per name followed: the connections of its followers (``Hello.follow``).
        self._followers: dict[str, set[bytes]] = {}
        #: Per follower connection: the names it follows.
        self._following: dict[bytes, list[str]] = {}
        self.followed = 0
        #: Per client connection: the full ids of its requests in flight (aborted if it goes).
        self._open: dict[bytes, set[str]] = {}
        #: Per client connection: its GPU tuples mapped to the agent's (bounded).
        self._gpu_maps: dict[bytes, dict[tuple[int, ...], tuple[int, ...]]] = {}
        self.orphaned = 0
        self.returned = 0
        #: Events for the hub, published by :meth:`run` (awaited: a burst of settled requests
        #: waits for the hub's consumers rather than spawn a task per event).
        self._events_in, self._events_out = anyio.create_memory_object_stream[Event](_EVENTS_QUEUED)
        #: Events not published because that many waited (a hub consumer stuck).
        self.unpublished = 0

    async def run(self) -> None:
        """Publish the attributor's events on the agent's hub (a task of the agent)."""
        async with self._events_out:
            async for event in self._events_out:
                await self.rt.publish(event)

    def _publish(self, event: Event) -> None:
        try:
            self._events_in.send_nowait(event)
        except anyio.WouldBlock:
            self.unpublished += 1
            if self.unpublished == 1:
                logger.warning(
                    "request events not published: %d wait for the hub (counted)", _EVENTS_QUEUED
                )
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the agent is stopping

    # -- the meter ---------------------------------------------------------------------------

    def _ensure(self) -> RequestMeter:
        meter = self.meter
        if meter is not None:
            return meter
        cfg = self.cfg
        tracker = self.rt.tracker
        gpus = sorted(tracker.gpu_indices) if tracker is not None else None
        meter = RequestMeter(
            cfg.requests_policy,  # type: ignore[arg-type]
            gpus=gpus or None,
            max_age_s=cfg.requests_max_age_s,
            max_open=cfg.requests_max_open,
            max_edge_delay_s=cfg.requests_edge_delay_s,
            step_base_w=cfg.requests_step_base_w,
            keep=1,
        )
        meter.publish_with(self._publish, host=self.rt.host)
        meter.subscribe(self._route)
        self.rt.start_consumer(
            functools.partial(meter.consume, every_s=cfg.requests_settle_s),
            isolate="request meter",
        )
        self.meter = meter
        logger.info("request attributor started (policy %s, GPUs %s)", cfg.requests_policy, gpus)
        return meter

    # -- from clients --------------------------------------------------------------------------

    def edges(self, client: _ClientLike, msg: RequestEdges) -> None:
        """Take a client's batch of request edges (never raises: what is wrong is the
        meter's bad input, a failure is logged)."""
        try:
            self._edges(client, msg)
        except Exception:
            logger.exception("request edges of %s not taken", client.name)

    def _edges(self, client: _ClientLike, msg: RequestEdges) -> None:
        meter = self._ensure()
        ident, prefix = client.ident, f"{client.name}/"
        asked = _asked(client.name)
        owner = self._owner
        open_ = self._open.setdefault(ident, set())
        cap = self.cfg.requests_max_open
        n = len(msg.kind)
        columns = (
            msg.id,
            msg.t_ns,
            msg.gpus,
            msg.tokens_in,
            msg.tokens_out,
            msg.text,
            msg.route,
            msg.model,
        )
        if any(len(c) != n for c in columns):
            logger.warning("a request-edge batch of %s with uneven columns ignored", client.name)
            return
        for i in range(n):
            kind, rid, t = msg.kind[i], msg.id[i], msg.t_ns[i]
            full = prefix + rid
            if kind == _BEGIN:
                meter.begin(full, self._gpus(client, msg.gpus[i]), at_ns=t)
                owner[full] = (ident, rid, asked, client.uid)
                owner.move_to_end(full)
                if len(owner) > 2 * cap:
                    owner.popitem(last=False)
                if len(open_) < cap:
                    open_.add(full)
            elif kind == _PHASE:
                meter.phase(full, msg.text[i], at_ns=t)
            elif kind == _DISCARD:
                open_.discard(full)
                owner.pop(full, None)  # no result comes back
                meter.discard(full)
            else:
                open_.discard(full)
                tin, tout = msg.tokens_in[i], msg.tokens_out[i]
                tokens: tuple[Any, Any] = (
                    tin if tin >= 0 else None,
                    tout if tout >= 0 else None,
                )
                if kind == _END:
                    meter.end(
                        full,
                        tokens_in=tokens[0],
                        tokens_out=tokens[1],
                        route=msg.route[i],
                        model=msg.model[i],
                        at_ns=t,
                    )
                else:
                    meter.abort(
                        full,
                        msg.text[i],
                        tokens_in=tokens[0],
                        tokens_out=tokens[1],
                        route=msg.route[i],
                        model=msg.model[i],
                        at_ns=t,
                    )
        for step in msg.steps:
            m = len(step.ids)
            if not (len(step.prefill) == len(step.decode) == len(step.context) == m):
                continue
            batch = [
                (prefix + step.ids[j], step.prefill[j], step.decode[j], step.context[j])
                for j in range(m)
            ]
            gpus = None if step.gpus is None else self._gpus(client, step.gpus)
            meter.step(batch, start_ns=step.start_ns, end_ns=step.end_ns, gpus=gpus)

    def _gpus(self, client: _ClientLike, gpus: list[int]) -> tuple[int, ...]:
        """A client's GPUs as the agent's indices (empty when they are not the client's: the
        meter counts them as bad input)."""
        key = tuple(gpus)
        known = self._gpu_maps.setdefault(client.ident, {})
        got = known.get(key)
        if got is not None:
            return got
        try:
            mapped = tuple(client.to_agent(list(key)) or ())
        except Exception:
            mapped = ()
        if len(known) < 256:
            known[key] = mapped
        return mapped

    def follow(self, client: _ClientLike, names: list[str]) -> None:
        """``client`` receives the results of the clients named ``names`` too (see the
        module docstring; names beyond the bounds are ignored, with a warning)."""
        wanted = list(dict.fromkeys(n for n in names if isinstance(n, str) and n))
        kept = [n for n in wanted if len(n) <= _MAX_NAME][:_MAX_FOLLOW]
        taken: list[str] = []
        for name in kept:
            followers = self._followers.setdefault(name, set())
            if len(followers) < _MAX_FOLLOWERS:
                followers.add(client.ident)
                taken.append(name)
        if len(taken) < len(wanted):
            logger.warning(
                "client %s follows %d name(s) of the %d it asked (at most %d, %d followers "
                "each, names of %d characters)",
                client.name,
                len(taken),
                len(wanted),
                _MAX_FOLLOW,
                _MAX_FOLLOWERS,
                _MAX_NAME,
            )
        if taken:
            self._following[client.ident] = taken

    def left(self, client: _ClientLike) -> None:
        """A client left or died: its requests in flight are aborted as ``cancelled`` now."""
        for name in self._following.pop(client.ident, ()):
            followers = self._followers.get(name)
            if followers is not None:
                followers.discard(client.ident)
                if not followers:
                    del self._followers[name]
        open_ = self._open.pop(client.ident, set())
        self._gpu_maps.pop(client.ident, None)
        meter = self.meter
        if meter is None or not open_:
            return
        now = time.time_ns()
        for full in open_:
            meter.abort(full, "cancelled", at_ns=now)
        self.orphaned += len(open_)
        logger.info(
            "client %s left with %d request(s) in flight: aborted as cancelled",
            client.name,
            len(open_),
        )

    def totals(self) -> RequestTotals:
        """The attributor's figures (``requests`` control)."""
        meter = self.meter
        if meter is None:
            return RequestTotals(policy=self.cfg.requests_policy)
        t, state = meter.totals, meter.state
        return RequestTotals(
            active=True,
            policy=meter.policy,
            energy_j=dict(t.energy_j),
            requests_j=dict(t.requests_j),
            idle_j=dict(t.idle_j),
            requests=t.requests,
            dropped_edges=t.dropped_edges,
            bad_input=dict(t.bad_input),
            finished=dict(t.finished),
            in_flight=state.in_flight,
            unsettled=state.unsettled,
            settled_ns=state.settled_ns,
            orphaned=self.orphaned,
            returned=self.returned,
            followed=self.followed,
            unpublished=self.unpublished,
        )

    # -- back to clients -------------------------------------------------------------------

    def _route(self, out: Attribution) -> None:
        """Send each settled request back to its client (on the agent's event loop)."""
        by_client: dict[bytes, list[RequestResult]] = {}
        #: (follower, name followed) -> the results it gets.
        by_follower: dict[tuple[bytes, str], list[RequestResult]] = {}
        owner = self._owner
        clients = self.clients
        followers = self._followers
        for full, r in out.requests.items():
            entry = owner.pop(full, None)
            if entry is None:
                continue
            ident, rid, asked, uid = entry
            client = clients.get(ident)
            if client is not None:
                by_client.setdefault(ident, []).append(_result(r, rid, client.visible))
            for follower in followers.get(asked, ()):
                who = clients.get(follower)
                # Another user's requests only to root (a system agent serves many users).
                if who is not None and follower != ident and who.uid in (uid, 0):
                    by_follower.setdefault((follower, asked), []).append(
                        _result(r, rid, who.visible)
                    )
        for ident, results in by_client.items():
            self.send(ident, self._reply(out, results))
            self.returned += len(results)
        for (ident, asked), results in by_follower.items():
            self.send(ident, self._reply(out, results, asked))
            self.followed += len(results)

    @staticmethod
    def _reply(out: Attribution, results: list[RequestResult], sender: str = "") -> Reply:
        return Reply(
            kind="requests",
            requests=results,
            start_ns=out.start_ns,
            end_ns=out.end_ns,
            policy=out.policy,
            sender=sender,
        )


def _asked(name: str) -> str:
    """A client's name as it asked for it: the agent's ``#n`` (``name#2``) taken off."""
    base, sep, n = name.rpartition("#")
    return base if sep and base and n.isdigit() else name


def _result(r: RequestEnergy, rid: str, visible: list[int] | None) -> RequestResult:
    """``r`` as its client sees it: its own id, its own GPU indices."""
    gpus = r.gpu_energy_j
    if visible is not None:
        back = {agent: mine for mine, agent in enumerate(visible)}
        gpus = {back[g]: e for g, e in gpus.items() if g in back}
    return RequestResult(
        request_id=rid,
        energy_j=r.energy_j,
        gpu_energy_j=dict(gpus),
        prefill_j=r.prefill_j,
        decode_j=r.decode_j,
        tokens_in=r.tokens_in,
        tokens_out=r.tokens_out,
        time_s=r.time_s,
        method=r.method,
        begin_ns=r.begin_ns,
        end_ns=r.end_ns,
        decode_ns=r.decode_ns,
        route=r.route,
        model=r.model,
        finish_reason=r.finish_reason,
        error_j=float(getattr(r, "error_j", 0.0) or 0.0),
    )
