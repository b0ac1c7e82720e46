"""A request meter for inference servers: edges on the serving thread, attribution behind it.

On the serving thread (any thread, sync or asyncio), each call costs one timestamp and one
append to a deque (about a microsecond)::

    meter = RequestMeter(policy="tokens")
    meter.begin(request_id, gpus=(0,))
    meter.phase(request_id, "decode")          # first token out: prefill is over
    meter.end(request_id, tokens_in=812, tokens_out=64)

Behind it, the meter keeps its own history of each GPU's readings (the estimator of
:mod:`zeus_async.aggregate.history`), fed with the runtime's events (``meter.add(event)``, or
``Runtime(consumers=[meter.consume])``), and :meth:`RequestMeter.settle` attributes energy up
to a *horizon*: the latest instant before which every request has ended and the readings are
in. Each settled interval is split by :func:`~.attribution.attribute`, so over everything
settled, per GPU, the requests' energies plus idle equal the GPU's measured energy.

A request still in flight holds the horizon at its begin (its token rates, which the
``tokens`` policy needs, are known only at its end), so results come at most one request
duration late, and memory holds the requests and readings of that stretch only.

With a carbon configuration (``RequestMeter(carbon=CarbonConfig(...))``), each settled
interval is also cut where the intensity may change (:meth:`Carbon.cuts
<zeus_async.aggregate.footprints.Carbon.cuts>`) and attributed piece by piece, so every
request's ``footprint`` weighs the energy attributed to it in each piece by the intensity in
force there (a time-varying intensity integrated, not averaged over the request).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..aggregate.footprints import Carbon, CarbonSpec, sum_footprints
from ..aggregate.history import DeviceHistory, add_sample
from ..errors import ConfigError
from ..events import Event, GpuSample
from .attribution import (
    POLICIES,
    Attribution,
    GpuAttribution,
    Policy,
    RequestEnergy,
    RequestSpan,
    attribute,
)

if TYPE_CHECKING:
    from ..carbon import Footprint

__all__ = ["MeterTotals", "RequestMeter"]

logger = logging.getLogger(__name__)

_BEGIN, _PHASE, _END = 0, 1, 2

#: Readings kept before the horizon (ns): context for the counter's update grid.
_CONTEXT_NS = 10_000_000_000


@dataclass
class MeterTotals:
    """Per GPU, over everything settled: measured energy, and where it went."""

    energy_j: dict[int, float] = field(default_factory=dict)
    requests_j: dict[int, float] = field(default_factory=dict)
    idle_j: dict[int, float] = field(default_factory=dict)
    requests: int = 0
    #: Edges that could not be used (an end without a begin, a second begin, ...).
    dropped_edges: int = 0


class _Open:
    __slots__ = ("begin_ns", "decode_ns", "gpus")

    def __init__(self, gpus: tuple[int, ...], begin_ns: int) -> None:
        self.gpus = gpus
        self.begin_ns = begin_ns
        self.decode_ns: int | None = None


class RequestMeter:
    """Energy per inference request (see the module docstring).

    Args:
        policy: How a moment's energy is split among the requests in flight: ``"equal"`` or
            ``"tokens"`` (:mod:`.attribution`).
        gpus: The GPUs to account for (default: those the requests name). A GPU listed here
            reports its idle energy even when no request ran on it.
        clock: Wall-clock ns for the edges (the clock the runtime stamps its readings with).
        keep: How many settled results :meth:`results` keeps for the caller (oldest dropped).
        lag_s: How far behind the latest reading the horizon stays, so the energy counter has
            updated past it (the estimator is exact only between counter updates).
        carbon: A :class:`~zeus_async.carbon.CarbonConfig` (opened once, here), an intensity
            source or ``None``: with one, every settled request has a ``footprint``
            (``co2e_g``, ``cost``), see the module docstring.

    Raises:
        ConfigError: An unknown policy, or what the carbon configuration refuses.
    """

    def __init__(
        self,
        policy: Policy = "equal",
        gpus: Sequence[int] | None = None,
        *,
        clock: Callable[[], int] = time.time_ns,
        keep: int = 100_000,
        lag_s: float = 0.25,
        carbon: CarbonSpec = None,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.policy = policy
        #: The opened carbon configuration (``None``: no carbon figures).
        self.carbon: Carbon | None = Carbon.of(carbon)
        #: Footprints of the pieces of requests settled in part so far.
        self._partial_fp: dict[str, list[Footprint]] = {}
        self._clock = clock
        self._lag_ns = round(lag_s * 1e9)
        self._edges: collections.deque[tuple[int, str, int, Any]] = collections.deque()
        self._gpus = set(gpus or ())
        self._open: dict[str, _Open] = {}
        self._done: list[RequestSpan] = []
        #: Requests attributed in part (they ended after a horizon they began before).
        self._partial: dict[str, RequestEnergy] = {}
        #: Each ended request's own edges and token counts, until it is settled.
        self._edges_of: dict[str, tuple[int, int, int | None, int, int, str, str]] = {}
        self._histories: dict[int, DeviceHistory] = {}
        self._settled_ns: int | None = None
        self._lock = threading.Lock()  # settle() from one thread at a time
        self.totals = MeterTotals()
        self._keep = keep
        self._results: collections.OrderedDict[str, RequestEnergy] = collections.OrderedDict()
        self._subscribers: list[Callable[[Attribution], None]] = []

    # -- the serving thread -----------------------------------------------------------------

    def begin(self, request_id: str, gpus: Sequence[int] = (0,)) -> None:
        """A request starts (its prefill, when phases are marked)."""
        self._edges.append((_BEGIN, request_id, self._clock(), tuple(gpus)))

    def phase(self, request_id: str, name: str = "decode") -> None:
        """The request moves to ``decode`` (its first output token is out)."""
        if name != "decode":
            raise ConfigError(f"the phases are prefill (from begin) and decode, not {name!r}")
        self._edges.append((_PHASE, request_id, self._clock(), None))

    def end(
        self,
        request_id: str,
        *,
        tokens_in: int = 0,
        tokens_out: int = 0,
        route: str = "",
        model: str = "",
    ) -> None:
        """The request is done, with its token counts, and optionally the route (a template
        such as ``/v1/chat/completions``, never a raw path) and model that served it, which
        label its figures (:class:`~.metrics.RequestMetrics` keeps their number bounded)."""
        self._edges.append((_END, request_id, self._clock(), (tokens_in, tokens_out, route, model)))

    # -- the data side ----------------------------------------------------------------------

    def add(self, event: Event) -> None:
        """Take a reading (``GpuSample``; other events are ignored)."""
        if type(event) is not GpuSample:
            return
        history = self._histories.get(event.gpu)
        if history is None:
            history = self._histories[event.gpu] = DeviceHistory(f"gpu:{event.gpu}")
        add_sample(history, event)

    def add_all(self, events: Iterable[Event]) -> None:
        for event in events:
            self.add(event)

    async def consume(self, stream: AsyncIterable[Event], *, every_s: float = 0.5) -> None:
        """A runtime consumer: take every reading, settle about every ``every_s``."""
        next_settle = time.monotonic() + every_s
        async for event in stream:
            self.add(event)
            now = time.monotonic()
            if now >= next_settle:
                next_settle = now + every_s
                self.settle()
        self.settle()

    # -- attribution ------------------------------------------------------------------------

    def _drain_edges(self) -> None:
        edges = self._edges
        while edges:
            kind, rid, t, payload = edges.popleft()
            if kind == _BEGIN:
                if rid in self._open:
                    self.totals.dropped_edges += 1
                    logger.warning("request %r began twice; the second begin is ignored", rid)
                    continue
                self._open[rid] = _Open(payload, t)
                continue
            req = self._open.get(rid)
            if req is None:
                self.totals.dropped_edges += 1
                logger.warning("request %r: %s without a begin (ignored)", rid,
                               "phase" if kind == _PHASE else "end")  # fmt: skip
                continue
            if kind == _PHASE:
                req.decode_ns = t
                continue
            del self._open[rid]
            tin, tout, route, model = payload
            self._edges_of[rid] = (req.begin_ns, t, req.decode_ns, tin, tout, route, model)
            self._done.append(RequestSpan(rid, req.gpus, req.begin_ns, t, req.decode_ns, tin, tout))

    def horizon_ns(self) -> int | None:
        """Up to when energy can be attributed now (``None``: nothing yet): no later than
        the first request still in flight began (its token rates are not known yet), nor than
        every GPU's readings cover, less ``lag_s``."""
        gpus = self._gpus | {g for s in self._done for g in s.gpus}
        if not gpus:
            return None
        ends = []
        for g in gpus:
            h = self._histories.get(g)
            if h is None or h.last_t_ns is None:
                return None
            ends.append(h.last_t_ns)
        horizon = min(ends) - self._lag_ns
        if self._open:
            horizon = min(horizon, *(r.begin_ns for r in self._open.values()))
        return horizon

    def settle(self) -> list[RequestEnergy]:
        """Attribute everything that can be now; returns the requests settled this time (also
        kept for :meth:`results`).

        A request that ended after the horizon but began before it is attributed in two
        pieces: up to the horizon now, the rest at a later settle, at the same token rates
        (its whole phases'); it is returned once, whole, when its last piece is settled."""
        with self._lock:
            self._drain_edges()
            horizon = self.horizon_ns()
            if horizon is None:
                return []
            start = self._settled_ns
            if start is None:  # the first interval starts with the readings
                firsts = [h.first_t_ns for h in self._histories.values() if h.first_t_ns]
                start = max(firsts) if firsts else horizon
            if horizon <= start:
                return []
            now: list[RequestSpan] = []
            later: list[RequestSpan] = []
            for span in self._done:
                # A request that began before the readings did is counted from their start.
                span = _clipped(span, start)
                if span.end_ns <= horizon:
                    now.append(span)
                elif span.begin_ns < horizon:
                    head, tail = _split(span, horizon)
                    now.append(head)
                    later.append(tail)
                else:
                    later.append(span)
            self._done = later
            gpus = sorted(self._gpus | {g for s in now for g in s.gpus})
            methods: dict[int, str] = {}
            carbon = self.carbon
            points = [start, *sorted(set(carbon.cuts(start, horizon) if carbon else ())), horizon]

            def cumulative(gpu: int, times: Sequence[int]) -> Sequence[float]:
                h = self._histories.get(gpu)
                got = None if h is None else h.cumulative(times)
                if got is None:
                    methods[gpu] = "unavailable"
                    return [0.0] * len(times)
                methods[gpu] = got[1]
                return got[0]

            # One attribution per piece between the intensity's steps (one piece without
            # carbon, or with a source that does not change in the interval).
            outs: list[Attribution] = []
            rest = now
            footprints: dict[str, list[Footprint]] = {}
            for a, b in itertools.pairwise(points):
                inside, rest = _cut(rest, b) if b < horizon else (rest, [])
                piece = attribute(
                    inside,
                    cumulative=cumulative,
                    start_ns=a,
                    end_ns=b,
                    gpus=gpus,
                    policy=self.policy,
                    method=methods,
                )
                outs.append(piece)
                if carbon is not None:
                    # The intensity is one step over the piece: its requests' energy there
                    # times that step, exactly (spread evenly over its stretch in the piece).
                    for span in inside:
                        r = piece.requests[span.request_id]
                        footprints.setdefault(span.request_id, []).append(
                            carbon.spread(r.energy_j, span.begin_ns, span.end_ns)
                        )
            out = _combine(outs, start, horizon, self.policy)
            totals = self.totals
            for gpu, g in out.gpus.items():
                totals.energy_j[gpu] = totals.energy_j.get(gpu, 0.0) + g.energy_j
                totals.requests_j[gpu] = totals.requests_j.get(gpu, 0.0) + g.requests_j
                totals.idle_j[gpu] = totals.idle_j.get(gpu, 0.0) + g.idle_j
            self._settled_ns = horizon
            for h in self._histories.values():
                # Readings well before the horizon: the counter's update grid is fitted to
                # the brackets around an edge, so some context stays.
                h.trim_before(horizon - _CONTEXT_NS)
            pending = {s.request_id for s in later}
            settled = []
            for rid, part in out.requests.items():
                whole = _merge(self._partial.pop(rid, None), part)
                if carbon is not None:
                    fps = self._partial_fp.pop(rid, []) + footprints.get(rid, [])
                if rid in pending:
                    self._partial[rid] = whole  # more of it at a later settle
                    if carbon is not None:
                        self._partial_fp[rid] = fps
                    continue
                whole = self._finish(whole)
                if carbon is not None:
                    whole.footprint = sum_footprints(fps)
                settled.append(whole)
            totals.requests += len(settled)
            results = self._results
            for r in settled:
                results[r.request_id] = r
            while len(results) > self._keep:
                results.popitem(last=False)
            final = Attribution(out.start_ns, out.end_ns, out.policy)
            final.requests = {r.request_id: r for r in settled}
            final.gpus = out.gpus
        for callback in self._subscribers:
            try:
                callback(final)
            except Exception:
                logger.exception("a request-meter subscriber failed")
        return settled

    def _finish(self, r: RequestEnergy) -> RequestEnergy:
        """The request as reported: its own edges and token counts, not its pieces'."""
        begin, end, decode, tokens_in, tokens_out, route, model = self._edges_of.pop(r.request_id)
        r.begin_ns, r.end_ns, r.decode_ns = begin, end, decode
        r.tokens_in, r.tokens_out = tokens_in, tokens_out
        r.route, r.model = route, model
        r.time_s = (end - begin) / 1e9
        return r

    def results(self) -> list[RequestEnergy]:
        """The settled requests kept so far (the latest ``keep``, oldest first)."""
        return list(self._results.values())

    def settled(self, request_id: str) -> RequestEnergy | None:
        """A kept request's figures, once settled."""
        return self._results.get(request_id)

    def publish_with(self, publish: Callable[[Event], Any], host: str | None = None) -> None:
        """Publish each settled request as a ``request`` event and each settled interval's idle
        energy as a ``request_idle`` event, with ``publish`` (``Monitor.publish``,
        ``Runtime.publish_nowait``...): on the bus and in recordings like any event."""
        import socket

        from ..events import RequestIdle, RequestMeasurement

        name = host or socket.gethostname()

        def send(out: Attribution) -> None:
            now = time.time_ns()
            for r in out.requests.values():
                publish(
                    RequestMeasurement(
                        host=name,
                        t_ns=now,
                        request_id=r.request_id,
                        begin_ns=r.begin_ns,
                        end_ns=r.end_ns,
                        gpu_energy_j=dict(r.gpu_energy_j),
                        decode_ns=r.decode_ns,
                        prefill_j=r.prefill_j,
                        decode_j=r.decode_j,
                        tokens_in=round(r.tokens_in),
                        tokens_out=round(r.tokens_out),
                        policy=out.policy,
                        method=r.method,
                    )
                )
            publish(
                RequestIdle(
                    host=name,
                    t_ns=now,
                    start_ns=out.start_ns,
                    end_ns=out.end_ns,
                    gpu_energy_j={g: a.energy_j for g, a in out.gpus.items()},
                    gpu_idle_j={g: a.idle_j for g, a in out.gpus.items()},
                    policy=out.policy,
                )
            )

        self.subscribe(send)

    def subscribe(self, callback: Callable[[Attribution], None]) -> None:
        """Call ``callback`` with each settled interval (its requests and GPUs), after
        :meth:`settle` (the Prometheus metrics, events)."""
        self._subscribers.append(callback)

    @property
    def in_flight(self) -> int:
        """Requests begun and not yet ended (as of the last :meth:`settle`)."""
        return len(self._open)


def _split(span: RequestSpan, at: int) -> tuple[RequestSpan, RequestSpan]:
    """``span`` cut at ``at``, each piece with its share of the tokens of the phase it cuts, so
    both keep the whole phase's token rate (what the ``tokens`` policy weighs)."""
    b, e, d = span.begin_ns, span.end_ns, span.decode_ns
    tin, tout = float(span.tokens_in), float(span.tokens_out)
    if d is None:  # one phase of all its tokens
        total = tin + tout
        first = total * (at - b) / (e - b)
        return (
            RequestSpan(span.request_id, span.gpus, b, at, None, first, 0.0),
            RequestSpan(span.request_id, span.gpus, at, e, None, total - first, 0.0),
        )
    if at <= d:  # cuts the prefill
        first = tin * (at - b) / (d - b)
        return (
            RequestSpan(span.request_id, span.gpus, b, at, at, first, 0.0),
            RequestSpan(span.request_id, span.gpus, at, e, d, tin - first, tout),
        )
    first = tout * (at - d) / (e - d)  # cuts the decode
    return (
        RequestSpan(span.request_id, span.gpus, b, at, d, tin, first),
        RequestSpan(span.request_id, span.gpus, at, e, at, 0.0, tout - first),
    )


def _cut(spans: Sequence[RequestSpan], at: int) -> tuple[list[RequestSpan], list[RequestSpan]]:
    """``spans`` up to ``at`` and from it (a span across ``at`` cut there, :func:`_split`)."""
    head: list[RequestSpan] = []
    tail: list[RequestSpan] = []
    for span in spans:
        if span.end_ns <= at:
            head.append(span)
        elif span.begin_ns >= at:
            tail.append(span)
        else:
            first, second = _split(span, at)
            head.append(first)
            tail.append(second)
    return head, tail


def _combine(outs: Sequence[Attribution], start: int, end: int, policy: str) -> Attribution:
    """The attributions of consecutive pieces of ``[start, end]`` as one."""
    if len(outs) == 1:
        return outs[0]
    out = Attribution(start, end, policy)
    for piece in outs:
        for rid, part in piece.requests.items():
            out.requests[rid] = _merge(out.requests.get(rid), part)
        for gpu, g in piece.gpus.items():
            have = out.gpus.get(gpu)
            if have is None:
                out.gpus[gpu] = GpuAttribution(
                    gpu, g.energy_j, g.requests_j, g.idle_j, g.busy_s, g.idle_s
                )
                continue
            have.energy_j += g.energy_j
            have.requests_j += g.requests_j
            have.idle_j += g.idle_j
            have.busy_s += g.busy_s
            have.idle_s += g.idle_s
    return out


def _merge(earlier: RequestEnergy | None, part: RequestEnergy) -> RequestEnergy:
    """A request's figures over its pieces so far."""
    if earlier is None:
        return part
    gpus = dict(earlier.gpu_energy_j)
    for gpu, joules in part.gpu_energy_j.items():
        gpus[gpu] = gpus.get(gpu, 0.0) + joules

    def add(a: float | None, b: float | None) -> float | None:
        return None if a is None and b is None else (a or 0.0) + (b or 0.0)

    earlier.gpu_energy_j = gpus
    earlier.energy_j = math.fsum(gpus.values())
    earlier.prefill_j = add(earlier.prefill_j, part.prefill_j)
    earlier.decode_j = add(earlier.decode_j, part.decode_j)
    earlier.method = part.method or earlier.method
    return earlier


def _clipped(span: RequestSpan, start: int) -> RequestSpan:
    if span.begin_ns >= start:
        return span
    decode = None if span.decode_ns is None else max(span.decode_ns, start)
    return RequestSpan(
        span.request_id,
        span.gpus,
        start,
        max(span.end_ns, start),
        decode,
        span.tokens_in,
        span.tokens_out,
    )
