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

With the ``equal`` and ``steps`` policies, a request's weights do not depend on its end
(equal: 1; steps: its step entries, and an equal share between steps), so a request still in
flight does not hold the horizon: each settle attributes its piece up to the horizon (a
prefill piece until its decode mark, a decode piece after it), the rest later, and it is
returned once, whole, when it ends; nothing waits for it. With ``tokens``, a request still
in flight holds the horizon at its begin (its token rates are known only at its end), so
results come at most one request duration late, and memory holds the requests and readings
of that stretch only; a request never ended holds the others up to ``max_age_s``. Past that
age a request is settled as ``unfinished`` (its energy up to then, whatever the policy), and
an end that comes later is dropped and counted.

Every result has a ``finish_reason``: ``completed`` (:meth:`RequestMeter.end`),
``cancelled`` or ``error`` (:meth:`RequestMeter.abort`), ``unfinished`` (past ``max_age_s``,
or the oldest of more than ``max_open`` requests in flight). What the app gets wrong (an
unknown id, an end twice, token counts that are not non-negative integers, GPUs that are not
indices) never raises on the serving thread: it is counted in ``totals.bad_input`` by kind
and logged once per kind, then at most once a minute.

Settling is bounded per call (``settle_batch`` requests: the horizon stops before the next
request's begin once that many have been taken; with ``equal`` and ``steps``, a piece of each
request in flight besides, ``max_open`` at most), and :meth:`RequestMeter.consume` runs it in
a worker thread, one slice after another, so the event loop never waits for it;
:meth:`RequestMeter.settle_soon` asks for a settle in the meter's own thread.

An engine gives its edges after the fact with ``at_ns=`` (its own clock mapped by
:class:`~.clocks.ClockMap`): with ``max_edge_delay_s``, the horizon stays that far behind now,
so edges come in any order within it (each request's own in the order of its calls); an edge
stamped before what is settled is taken as stamped then and counted (``late``). It reports
its forward passes with :meth:`RequestMeter.step`, which the ``steps`` policy splits by
``step_weight``; steps cut by a horizon keep their weights on both sides.

With a carbon configuration (``RequestMeter(carbon=CarbonConfig(...))``), each settled
interval is also cut where the intensity may change (:meth:`Carbon.cuts
<zeus_async.aggregate.footprints.Carbon.cuts>`) and attributed piece by piece, so every
request's ``footprint`` weighs the energy attributed to it in each piece by the intensity in
force there (a time-varying intensity integrated, not averaged over the request).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import operator
import sys
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from .._threads import DaemonExecutor, run_sync
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
    StepEntry,
    StepSpan,
    attribute,
    default_step_weight,
)
from .fit import StepWeightFit

if TYPE_CHECKING:
    from ..carbon import Footprint

__all__ = ["BAD_INPUT_KINDS", "FINISH_REASONS", "MeterTotals", "RequestMeter"]

logger = logging.getLogger(__name__)

_BEGIN, _PHASE, _END, _STEP, _DISCARD = 0, 1, 2, 3, 4

#: Readings kept before the horizon (ns): context for the counter's update grid.
_CONTEXT_NS = 10_000_000_000

#: How a request finished: ended by the server, aborted (:meth:`RequestMeter.abort`: the
#: client went away, or the server failed), or settled past ``max_age_s`` without an end.
FINISH_REASONS: Final = ("completed", "cancelled", "error", "unfinished")

#: What the app can get wrong, counted in ``MeterTotals.bad_input`` (a fixed set: bounded
#: metric labels). ``unknown_id``: a phase, end, abort or discard of a request never begun
#: (or forgotten); ``began_twice``: a begin of a request in flight or not yet settled;
#: ``ended_twice``: a second end or abort; ``ended_after_max_age``: an end of a request
#: already settled as unfinished; ``tokens``: a token count not a non-negative integer
#: (counted as 0); ``gpus``: GPUs not a non-empty sequence of indices, or one the meter does
#: not account for (the meter's GPUs used instead); ``phase``: a phase other than decode;
#: ``reason``: an abort reason other than cancelled or error (taken as error);
#: ``too_many_open``: more than ``max_open`` requests in flight (the oldest settled as
#: unfinished); ``overflow``: an edge or reading dropped because more than ``max_pending``
#: were waiting for a settle; ``late``: an edge (or step) stamped before what is already
#: settled, taken as stamped then (a step wholly before it dropped), or a timestamp not an
#: integer (taken as now); ``step``: a step not well formed (its end before its start, a
#: batch that is not a sequence of entries, an entry's weight negative or NaN: that entry
#: weighs 0).
BAD_INPUT_KINDS: Final = (
    "unknown_id",
    "began_twice",
    "ended_twice",
    "ended_after_max_age",
    "tokens",
    "gpus",
    "phase",
    "reason",
    "too_many_open",
    "overflow",
    "late",
    "step",
)
#: The kinds whose edge is dropped whole (``MeterTotals.dropped_edges``).
_DROPPING: Final = frozenset(
    {"unknown_id", "began_twice", "ended_twice", "ended_after_max_age", "phase", "overflow"}
)
#: Ids of settled or expired requests remembered, to tell ``ended_twice`` from ``unknown_id``.
_RECENT_IDS = 10_000
#: Seconds between two log lines of one kind of bad input (the first is logged at once).
_LOG_EVERY_S = 60.0
#: Idle seconds (settled, no request in flight) a GPU needs before the ``steps`` policy's
#: automatic base power is its mean idle power; until then, its ``_BASE_LOWEST``-th lowest
#: power reading so far (one glitch reading of 0 W does not make it).
_BASE_MIN_IDLE_S = 1.0
_BASE_LOWEST = 5
#: Requests per settle slice at most in :meth:`RequestMeter.consume`'s worker thread.
_CONSUME_SLICE = 1000


@dataclass
class MeterTotals:
    """Per GPU, over everything settled: measured energy, and where it went."""

    energy_j: dict[int, float] = field(default_factory=dict)
    requests_j: dict[int, float] = field(default_factory=dict)
    idle_j: dict[int, float] = field(default_factory=dict)
    #: Seconds with no request in flight (the time ``idle_j`` was drawn over).
    idle_s: dict[int, float] = field(default_factory=dict)
    requests: int = 0
    #: Edges that could not be used (an end without a begin, a second begin, ...).
    dropped_edges: int = 0
    #: Bad input from the app, by kind (:data:`BAD_INPUT_KINDS`), never an exception.
    bad_input: dict[str, int] = field(default_factory=dict)
    #: Settled requests by finish reason (:data:`FINISH_REASONS`).
    finished: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MeterState:
    """The meter's backlog, as of its last settle (:attr:`RequestMeter.state`)."""

    #: Requests begun and not ended.
    in_flight: int = 0
    #: Requests ended (or aborted, or expired) and not settled yet.
    unsettled: int = 0
    #: When the oldest request in flight began (wall-clock ns; ``None``: none in flight).
    oldest_begin_ns: int | None = None
    #: Up to when energy is settled (``None``: nothing yet).
    settled_ns: int | None = None
    #: Edges and readings waiting for the next settle.
    pending: int = 0


class _Open:
    __slots__ = ("begin_ns", "decode_ns", "gpus")

    def __init__(self, gpus: tuple[int, ...], begin_ns: int) -> None:
        self.gpus = gpus
        self.begin_ns = begin_ns
        self.decode_ns: int | None = None


class RequestMeter:
    """Energy per inference request (see the module docstring).

    Args:
        policy: How a moment's energy is split among the requests in flight: ``"equal"``,
            ``"tokens"`` or ``"steps"`` (:mod:`.attribution`; ``steps`` uses :meth:`step`).
        gpus: The GPUs to account for (default: those the requests name). A GPU listed here
            reports its idle energy even when no request ran on it; with a list, a request
            naming another GPU is counted as bad input and runs on these.
        clock: Wall-clock ns for the edges (the clock the runtime stamps its readings with).
        keep: How many settled results :meth:`results` keeps for the caller (oldest dropped).
        lag_s: How far behind the latest reading the horizon stays, so the energy counter has
            updated past it (the estimator is exact only between counter updates).
        carbon: A :class:`~zeus_async.carbon.CarbonConfig` (opened once, here), an intensity
            source or ``None``: with one, every settled request has a ``footprint``
            (``co2e_g``, ``cost``), see the module docstring.
        max_age_s: A request in flight longer than this is settled as ``unfinished``, with
            the energy up to then (with ``tokens``, it holds the horizon no longer;
            with ``equal`` and ``steps`` it never holds it). Set it to the server's
            request timeout or above.
        max_open: Requests in flight at most; beyond, the oldest is settled as
            ``unfinished`` (bounds memory whatever clients do).
        settle_batch: Requests settled per :meth:`settle` call at most (bounded work).
        max_pending: Edges, and readings, waiting for a settle at most; beyond, they are
            dropped and counted (``overflow``): only when nothing settles at all.
        max_edge_delay_s: How late an edge may come (``at_ns`` that far before it is
            given): the horizon stays that far behind now, and edges within it may come in
            any order. An edge stamped before what is settled is taken as stamped then and
            counted (``late``). 0 (the default): edges are stamped as they are given.
        step_weight: The ``steps`` policy's weight of a request in a step (a
            :class:`~.attribution.StepEntry` -> float >= 0), or ``"fit"``: learnt from
            the GPU's measured energy and the steps' composition (:mod:`.fit`;
            :attr:`step_weight_fit` has its coefficients; a
            :class:`~.fit.StepWeightFit` of your own for other settings), with the default
            until enough is measured; default: :func:`~.attribution.default_step_weight`
            (tokens, weighted by context).
        step_base_w: The ``steps`` policy's base power (W): the power a GPU draws whatever
            a step computes (its idle power); in a step, that much (never more than the
            step's own power) is split equally among the step's requests and only the rest
            by ``step_weight``. ``None`` (the default): estimated per GPU
            (:meth:`base_power_w`); a number: that for every GPU (0: all of a step's energy
            by the weights); a mapping: per GPU (those it leaves out estimated).

    Raises:
        ConfigError: An unknown policy, a limit that is not positive, or what the carbon
            configuration refuses.
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
        max_age_s: float = 600.0,
        max_open: int = 100_000,
        settle_batch: int = 10_000,
        max_pending: int = 1_000_000,
        max_edge_delay_s: float = 0.0,
        step_weight: Callable[[StepEntry], float] | Literal["fit"] | StepWeightFit | None = None,
        step_base_w: float | Mapping[int, float] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if not (max_age_s > 0 and max_open > 0 and settle_batch > 0 and max_pending > 0):
            raise ConfigError("max_age_s, max_open, settle_batch and max_pending must be > 0")
        given: dict[int, float] | float | None
        if isinstance(step_base_w, Mapping):
            given = {int(g): float(w) for g, w in step_base_w.items()}
            bases = list(given.values())
        else:
            given = None if step_base_w is None else float(step_base_w)
            bases = [] if given is None else [given]
        if not (max_edge_delay_s >= 0 and all(w >= 0 and w != math.inf for w in bases)):
            raise ConfigError("max_edge_delay_s must be >= 0, step_base_w finite and >= 0")
        #: The base power given (per GPU, or for all; ``None``: estimated).
        self._base_given = given
        #: Per GPU, its ``_BASE_LOWEST`` lowest power readings so far, negated (a heap: the
        #: highest of them first), for the base power's estimate before idle time.
        self._lowest: dict[int, list[float]] = {}
        self._base_from_idle: set[int] = set()  # GPUs whose base power is their idle power
        self._watch_power = policy == "steps" and not isinstance(given, float)
        self._delay_ns = round(max_edge_delay_s * 1e9)
        #: The fitted step weight (``step_weight="fit"``; ``None`` otherwise): its
        #: ``coefficients``, ``None`` while the default weight is used.
        self.step_weight_fit: StepWeightFit | None = None
        if isinstance(step_weight, StepWeightFit):
            self.step_weight_fit = step_weight
            step_weight = step_weight.weight
        elif step_weight == "fit":
            self.step_weight_fit = StepWeightFit()
            step_weight = self.step_weight_fit.weight
        elif isinstance(step_weight, str):
            raise ConfigError(f"step_weight must be a function or 'fit', not {step_weight!r}")
        self._step_weight = step_weight or default_step_weight
        #: Steps taken from the edges and not settled yet (policy ``steps`` only).
        self._steps: list[StepSpan] = []
        self.policy = policy
        #: The opened carbon configuration (``None``: no carbon figures).
        self.carbon: Carbon | None = Carbon.of(carbon)
        #: Footprints of the pieces of requests settled in part so far.
        self._partial_fp: dict[str, list[Footprint]] = {}
        self._clock = clock
        self._lag_ns = round(lag_s * 1e9)
        self._max_age_ns = round(max_age_s * 1e9)
        self._max_open = max_open
        self._batch = settle_batch
        self._max_pending = max_pending
        self._edges: collections.deque[tuple[int, str, int, Any]] = collections.deque()
        # GPU tuples already checked (bounded): a request's usual (0,) is not checked again.
        self._gpus_seen: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self._readings: collections.deque[GpuSample] = collections.deque()
        self._gpus = set(gpus or ())
        self._fixed_gpus = gpus is not None and len(self._gpus) > 0
        #: GPUs named by requests -> when first named (a GPU without readings is waited for
        #: no longer than ``max_age_s``).
        self._named: dict[int, int] = {}
        self._open: dict[str, _Open] = {}
        #: (begin_ns, id) of the requests in flight, oldest first (stale entries skipped).
        self._open_heap: list[tuple[int, str]] = []
        #: Ended requests not settled yet: (begin_ns, sequence, span), earliest begin first.
        self._done: list[tuple[int, int, RequestSpan]] = []
        self._seq = itertools.count()
        #: Requests attributed in part (they ended after a horizon they began before).
        self._partial: dict[str, RequestEnergy] = {}
        #: Each ended request's own edges, token counts and finish reason, until settled.
        self._edges_of: dict[str, tuple[int, int, int | None, int, int, str, str, str]] = {}
        #: Ids settled (True) or expired (False) lately, to name a late edge's fault.
        self._recent: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self._histories: dict[int, DeviceHistory] = {}
        self._settled_ns: int | None = None
        self._lock = threading.RLock()  # settle() from one thread at a time
        self.totals = MeterTotals()
        #: The backlog as of the last settle (read by the gauges from any thread).
        self.state = MeterState()
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (last logged, count then)
        self._keep = keep
        self._results: collections.OrderedDict[str, RequestEnergy] = collections.OrderedDict()
        self._subscribers: list[Callable[[Attribution], None]] = []
        self._executor: DaemonExecutor | None = None
        self._soon = False  # a settle_soon() is queued and not started
        self._lock_soon = threading.Lock()

    # -- the serving thread -----------------------------------------------------------------
    # Never raises: what is wrong with the arguments is found and counted at the next settle.

    def _push(self, edge: tuple[int, str, int, Any]) -> None:
        edges = self._edges
        if len(edges) >= self._max_pending:
            self._bad("overflow", "", "edges waiting for a settle")
            return
        edges.append(edge)

    def _bound_edges(self) -> None:
        """Drop the newest edges past ``max_pending`` (counted as overflow): the bound on
        memory, kept where readings arrive (every sampling period) and at each settle rather
        than on the serving thread's every call."""
        edges = self._edges
        excess = len(edges) - self._max_pending
        if excess > 0:
            for _ in range(excess):
                edges.pop()
            self._bad("overflow", "", "edges waiting for a settle past the bound", excess)

    def begin(
        self, request_id: str, gpus: Sequence[int] = (0,), *, at_ns: int | None = None
    ) -> None:
        """A request starts (its prefill, when phases are marked). ``at_ns``: when, in ns on
        the meter's clock (``None``: now; an engine's own clock is mapped with
        :class:`~.clocks.ClockMap`)."""
        # A bare append: this is the serving thread's whole cost (the bound on what waits is
        # kept where readings come in and at each settle: _bound_edges).
        self._edges.append((_BEGIN, request_id, self._clock() if at_ns is None else at_ns, gpus))

    def phase(self, request_id: str, name: str = "decode", *, at_ns: int | None = None) -> None:
        """The request moves to ``decode`` (its first output token is out). Another phase
        name is counted as bad input (``phase``) and ignored."""
        self._edges.append((_PHASE, request_id, self._clock() if at_ns is None else at_ns, name))

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
        """The request is done, with its token counts, and optionally the route (a template
        such as ``/v1/chat/completions``, never a raw path) and model that served it, which
        label its figures (:class:`~.metrics.RequestMetrics` keeps their number bounded).
        Its ``finish_reason`` is ``completed``. ``at_ns``: as for :meth:`begin`."""
        self._edges.append(
            (
                _END,
                request_id,
                self._clock() if at_ns is None else at_ns,
                (tokens_in, tokens_out, route, model, ""),
            )
        )

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
        """The request stops unfinished: ``reason`` is ``"cancelled"`` (the client went away)
        or ``"error"`` (the server failed); the tokens it got through, if known. It is
        attributed like an ended request, with that ``finish_reason``. ``at_ns``: as for
        :meth:`begin`."""
        edge = (tokens_in, tokens_out, route, model, reason or "?")
        self._push((_END, request_id, self._clock() if at_ns is None else at_ns, edge))

    def discard(self, request_id: str) -> None:
        """Forget a request begun and not settled yet, as if it had never begun: no result,
        no finish count; its time goes to the other requests in flight then, or to idle (an
        ASGI request that matched no route, say). A request ended and settled in part (it
        ended after a settle's horizon it began before) loses its result, not the energy
        already settled. An id not begun, or already settled, is counted as bad input
        (``unknown_id``). Never raises."""
        self._edges.append((_DISCARD, request_id, 0, None))

    def step(
        self,
        batch: Sequence[StepEntry | tuple[str, int, int, int]],
        *,
        start_ns: int,
        end_ns: int,
        gpus: Sequence[int] | None = None,
    ) -> None:
        """One engine step (a forward pass) over ``[start_ns, end_ns]`` (the meter's clock):
        the requests in it, each a :class:`~.attribution.StepEntry` (or a plain
        ``(request_id, prefill_tokens, decode_tokens, context_len)``); ``gpus``: those that
        ran it (default: those of its requests). With ``policy="steps"``, the step's energy
        is split by ``step_weight`` of each entry; other policies ignore steps. Checked at
        the next settle (bad input counted as ``step``, ``unknown_id`` or ``late``)."""
        self._push((_STEP, "", start_ns, (end_ns, batch, gpus)))

    # -- the data side ----------------------------------------------------------------------

    def add(self, event: Event) -> None:
        """Take a reading (``GpuSample``; other events are ignored). From any thread: it is
        queued, and taken into the meter's history by the next settle."""
        if type(event) is not GpuSample:
            return
        if len(self._edges) > self._max_pending:
            self._bound_edges()
        readings = self._readings
        if len(readings) >= self._max_pending:
            self._bad("overflow", "", "readings waiting for a settle")
            return
        readings.append(event)

    def add_all(self, events: Iterable[Event]) -> None:
        for event in events:
            self.add(event)

    async def consume(
        self,
        stream: AsyncIterable[Event],
        *,
        every_s: float = 0.5,
        switch_interval_s: float | None = 0.001,
    ) -> None:
        """A runtime consumer: take every reading, settle about every ``every_s``, in a
        worker thread (one bounded slice after another until caught up), so the event loop
        goes on; subscribers are called back on the loop.

        ``switch_interval_s``: while it runs, Python's GIL switch interval
        (:func:`sys.setswitchinterval`) is lowered to this (1 ms) where it is larger (5 ms
        by default), and put back when the last consume running ends (unless someone else
        changed it meanwhile); ``None``: left alone. Why: the settling thread holds the GIL
        for up to the switch interval each time the loop's thread wants it back, so a
        handler on the loop waits that long while a settle runs; with 5 ms the loop's p99
        lag under load is 8-13 ms, with 1 ms 2.4-5 ms (``bench/inference/bench_loop_lag.py``).
        The interval is process-wide: a shorter one costs some throughput in CPU-bound
        threads (more switches). Its slices are of ``settle_batch`` requests at most, and
        1,000 at most (shorter stretches between the loop's turns: p99 lag 4.6-7.7 ms
        against 6.2-9.3 ms with 10,000, in the same bench)."""

        _lower_switch_interval(switch_interval_s)
        try:
            await self._consume(stream, every_s)
        finally:
            _restore_switch_interval(switch_interval_s)

    async def _consume(self, stream: AsyncIterable[Event], every_s: float) -> None:
        import anyio

        busy = False
        slice_ = min(self._batch, _CONSUME_SLICE)

        async def catch_up() -> None:
            nonlocal busy
            try:
                more = True
                while more:
                    out, more = await run_sync(self._settle_slice, slice_)
                    self._notify(out)
            except Exception:
                logger.exception("settling requests failed")
            finally:
                busy = False

        next_settle = time.monotonic() + every_s
        async with anyio.create_task_group() as tg:
            async for event in stream:
                self.add(event)
                now = time.monotonic()
                if now >= next_settle and not busy:
                    next_settle = now + every_s
                    busy = True
                    tg.start_soon(catch_up)
        await catch_up()

    def settle_soon(self) -> None:
        """Ask for a settle in the meter's own thread, and return at once (subscribers are
        then called back in that thread). Does nothing while one is already queued."""
        with self._lock_soon:
            if self._soon:
                return
            self._soon = True
            if self._executor is None:
                self._executor = DaemonExecutor("zeus-request-settle")
        try:
            self._executor.submit(self._settle_queued)
        except RuntimeError:  # interpreter exit: no more settles
            self._soon = False

    def _settle_queued(self) -> None:
        self._soon = False
        try:
            self.settle()
        except Exception:
            logger.exception("settling requests failed")

    # -- bad input --------------------------------------------------------------------------

    def _bad(self, kind: str, rid: str, detail: str, count: int = 1) -> None:
        """Count (and log, rate-limited) ``count`` bad inputs of ``kind``."""
        totals = self.totals
        bad = totals.bad_input
        n = bad[kind] = bad.get(kind, 0) + count
        if kind in _DROPPING:
            totals.dropped_edges += count
        last = self._logged.get(kind)
        now = time.monotonic()
        if last is None:
            self._logged[kind] = (now, n)
            logger.warning("request meter: bad input (%s) for request %r: %s; counted in "
                           "totals.bad_input, logged at most once a minute", kind, rid,
                           detail)  # fmt: skip
        elif now - last[0] >= _LOG_EVERY_S:
            self._logged[kind] = (now, n)
            logger.warning("request meter: %d more bad inputs (%s) in %.0f s, the last for "
                           "request %r: %s", n - last[1], kind, now - last[0], rid,
                           detail)  # fmt: skip

    def _count(self, rid: str, value: Any) -> int:
        """A token count as given, or 0 (counted as bad input) when it is not one."""
        if type(value) is int and value >= 0:
            return value
        try:
            if isinstance(value, bool):
                raise TypeError
            n = operator.index(value)
        except Exception:
            n = -1
        if n >= 0:
            return n
        self._bad("tokens", rid, f"token count {_show(value)} is not a non-negative integer")
        return 0

    def _gpus_of(self, rid: str, gpus: Any) -> tuple[int, ...]:
        known = self._gpus_seen.get(gpus) if type(gpus) is tuple else None
        if known is not None:  # (the same few tuples come with every request)
            return known
        try:
            got = tuple(operator.index(g) for g in gpus)
            ok = bool(got) and all(g >= 0 for g in got)
            if ok and self._fixed_gpus:
                ok = all(g in self._gpus for g in got)
        except Exception:
            got, ok = (), False
        if ok:
            if type(gpus) is tuple and len(self._gpus_seen) < 256:
                self._gpus_seen[gpus] = got
            return got
        self._bad("gpus", rid, f"gpus {_show(gpus)}: not indices of the meter's GPUs")
        return tuple(sorted(self._gpus)) or (0,)

    def _label(self, value: Any) -> str:
        if type(value) is str:
            return value
        try:
            return "" if value is None else str(value)
        except Exception:
            return ""

    # -- attribution ------------------------------------------------------------------------

    def _drain_readings(self) -> None:
        readings = self._readings
        histories = self._histories
        while readings:
            event = readings.popleft()
            history = histories.get(event.gpu)
            if history is None:
                history = histories[event.gpu] = DeviceHistory(f"gpu:{event.gpu}")
            add_sample(history, event)
            p = event.power_w
            if self._watch_power and p is not None and event.gpu not in self._base_from_idle:
                low = self._lowest.get(event.gpu)
                if low is None:
                    low = self._lowest[event.gpu] = []
                if len(low) < _BASE_LOWEST:
                    if p >= 0:  # (NaN and negative readings are not power)
                        heapq.heappush(low, -p)
                elif 0 <= p < -low[0]:
                    heapq.heapreplace(low, -p)

    def base_power_w(self, gpu: int) -> float:
        """The ``steps`` policy's base power of ``gpu`` (W): the ``step_base_w`` given for
        it, or its estimate: the GPU's mean power while no request was in flight (settled
        idle energy over idle time) once it has been idle ``_BASE_MIN_IDLE_S`` (1 s) in all;
        before that, its 5th lowest power reading so far (a GPU at rest when the meter
        started; a GPU busy all along: its lightest moment, above its idle power, but a step
        never gets more than its own energy split equally); 0 without either."""
        given = self._base_given
        if isinstance(given, float):
            return given
        if given is not None and gpu in given:
            return given[gpu]
        totals = self.totals
        idle_s = totals.idle_s.get(gpu, 0.0)
        if idle_s >= _BASE_MIN_IDLE_S:
            self._base_from_idle.add(gpu)
            self._lowest.pop(gpu, None)
            return max(0.0, totals.idle_j.get(gpu, 0.0) / idle_s)
        low = self._lowest.get(gpu)
        return -low[0] if low else 0.0

    def _drain_edges(self, budget: int | None = None) -> int | None:
        """Take the queued edges (at most ``budget``); returns the time of the first edge
        left queued (``None``: none left), which the horizon must not pass."""
        edges = self._edges
        taken = 0
        settled = self._settled_ns
        while edges:
            if budget is not None and taken >= budget:
                # (an edge given later may be stamped up to the delay before this one)
                first = edges[0][2]
                return (first if type(first) is int else self._clock()) - self._delay_ns
            taken += 1
            kind, rid, t, payload = edges.popleft()
            if kind == _DISCARD:
                self._discard(rid)
                continue
            if type(t) is not int:
                t = self._time(rid, t)
            if settled is not None and t < settled:
                if kind == _STEP:
                    self._take_step(t, payload, settled)
                    continue
                self._bad("late", rid, f"edge stamped {(settled - t) / 1e6:.3f} ms before "
                          "the settled horizon (taken as stamped then)")  # fmt: skip
                t = settled
            if kind == _STEP:
                self._take_step(t, payload, settled)
                continue
            if kind == _BEGIN:
                if rid in self._open or rid in self._edges_of:
                    self._bad("began_twice", rid, "a begin of a request not yet settled")
                    continue
                gpus = payload if type(payload) is tuple and payload else None
                gpus = self._gpus_of(rid, payload if gpus is None else gpus)
                for g in gpus:
                    if g not in self._named:
                        self._named[g] = t
                self._recent.pop(rid, None)  # an id used again after it was settled
                self._open[rid] = _Open(gpus, t)
                heapq.heappush(self._open_heap, (t, rid))
                if len(self._open) > self._max_open:
                    self._bad("too_many_open", rid, f"more than {self._max_open} in flight")
                    oldest = self._oldest_open()
                    if oldest is not None:
                        self._close(oldest, self._open[oldest], t, None, "unfinished")
                continue
            req = self._open.get(rid)
            if req is None:
                what = "phase" if kind == _PHASE else "end"
                recent = self._recent.get(rid)
                if kind == _PHASE:
                    bad = "unknown_id" if recent is None else "ended_twice"
                elif rid in self._edges_of or recent is True:
                    bad = "ended_twice"
                elif recent is False:
                    bad = "ended_after_max_age"
                else:
                    bad = "unknown_id"
                self._bad(bad, rid, f"{what} of a request not in flight (ignored)")
                continue
            if kind == _PHASE:
                if payload != "decode":
                    self._bad("phase", rid, f"phase {_show(payload)}: the phases are prefill "
                              "(from begin) and decode")  # fmt: skip
                    continue
                req.decode_ns = max(t, req.begin_ns)
                continue
            tin, tout, route, model, reason = payload
            if reason == "":
                reason = "completed"
            elif reason not in ("cancelled", "error"):
                self._bad("reason", rid, f"abort reason {_show(reason)}: cancelled or error")
                reason = "error"
            # (the usual case inline: ints and strs, as a server passes them)
            if type(tin) is not int or tin < 0:
                tin = self._count(rid, tin)
            if type(tout) is not int or tout < 0:
                tout = self._count(rid, tout)
            if type(route) is not str:
                route = self._label(route)
            if type(model) is not str:
                model = self._label(model)
            self._close(rid, req, t, (tin, tout, route, model), reason)
        return None

    def _time(self, rid: str, t: Any) -> int:
        """A timestamp given that is not an int: as an integer (a float's rounding), or now
        (counted as ``late``) when it is not a finite number."""
        try:
            if isinstance(t, bool):
                raise TypeError
            f = float(t)
            if math.isfinite(f):
                return round(f)
        except Exception:
            pass
        self._bad("late", rid, f"timestamp {_show(t)} is not a number of ns (taken as now)")
        return self._clock()

    def _take_step(self, start: int, payload: Any, settled: int | None) -> None:
        """A step from the edges, checked, weighed and kept for the settles."""
        if self.policy != "steps":
            return
        end, batch, gpus = payload
        if type(end) is not int:
            end = self._time("", end)
        if end < start:
            self._bad("step", "", f"a step ending {(start - end) / 1e6:.3f} ms before it starts")
            return
        if settled is not None and start < settled:
            self._bad("late", "", f"a step stamped {(settled - start) / 1e6:.3f} ms before "
                      "the settled horizon")  # fmt: skip
            if end <= settled:
                return
            start = settled
        if gpus is not None:
            gpus = self._gpus_of("", gpus)
        weights: list[tuple[str, float]] = []
        weigh = self._step_weight
        fit = self.step_weight_fit
        kept: list[StepEntry] = []
        try:
            entries = list(batch)
        except Exception:
            entries = None
        if entries is None or isinstance(batch, (str, bytes)):
            self._bad("step", "", f"batch {_show(batch)} is not a sequence of entries")
            return
        for entry in entries:
            try:
                if type(entry) is not StepEntry:
                    entry = StepEntry(*entry)
                rid = entry.request_id
                w = float(weigh(entry))
                if type(rid) is not str:
                    raise TypeError("request id")
            except Exception as e:
                self._bad("step", "", f"step entry {_show(entry)}: {_show(e)} (dropped)")
                continue
            if not w >= 0 or w == math.inf:
                self._bad("step", rid, f"step weight {_show(w)} (taken as 0)")
                continue
            weights.append((rid, w))
            if fit is not None:
                kept.append(entry)
        steps = self._steps
        if len(steps) >= self._max_pending:
            self._bad("overflow", "", "steps waiting for a settle")
            return
        if fit is not None and kept:
            on = gpus or {g for e in kept if e[0] in self._open for g in self._open[e[0]].gpus}
            fit.add_step(start, end, on, kept)
        steps.append(StepSpan(start, end, gpus, tuple(weights)))

    def _close(
        self,
        rid: str,
        req: _Open,
        t: int,
        info: tuple[int, int, str, str] | None,
        reason: str,
    ) -> None:
        """Request ``rid`` (in flight) ends at ``t``: on to be settled."""
        del self._open[rid]
        # (a request in flight may be settled in part already, up to _settled_ns)
        end = max(t, req.begin_ns, self._settled_ns or 0)
        decode = None if req.decode_ns is None else min(req.decode_ns, end)
        tin, tout, route, model = info or (0, 0, "", "")
        self._edges_of[rid] = (req.begin_ns, end, decode, tin, tout, route, model, reason)
        span = RequestSpan(rid, req.gpus, req.begin_ns, end, decode, tin, tout)
        heapq.heappush(self._done, (req.begin_ns, next(self._seq), span))
        if reason == "unfinished":
            self._remember(rid, False)

    def _discard(self, rid: str) -> None:
        """Request ``rid`` forgotten (:meth:`discard`), with its entries in steps taken."""
        if self._steps:
            self._steps = [
                st
                if all(e[0] != rid for e in st.weights)
                else StepSpan(
                    st.start_ns,
                    st.end_ns,
                    st.gpus,
                    tuple(e for e in st.weights if e[0] != rid),
                    st.duration_ns,
                )
                for st in self._steps
            ]
        if self._open.pop(rid, None) is not None:
            # (its entry in _open_heap is stale now: skipped; its pieces settled so far lose
            # their result, not their energy)
            self._partial.pop(rid, None)
            self._partial_fp.pop(rid, None)
            return
        if rid in self._edges_of:
            del self._edges_of[rid]
            self._partial.pop(rid, None)
            self._partial_fp.pop(rid, None)
            self._done = [d for d in self._done if d[2].request_id != rid]
            heapq.heapify(self._done)
            return
        self._bad("unknown_id", rid, "discard of a request not in flight (ignored)")

    def _remember(self, rid: str, settled: bool) -> None:
        recent = self._recent
        recent[rid] = settled
        recent.move_to_end(rid)
        while len(recent) > _RECENT_IDS:
            recent.popitem(last=False)

    def _oldest_open(self) -> str | None:
        """The request in flight that began first (``None``: none)."""
        heap, open_ = self._open_heap, self._open
        while heap:
            t, rid = heap[0]
            req = open_.get(rid)
            if req is not None and req.begin_ns == t:
                return rid
            heapq.heappop(heap)
        return None

    def _expire(self, now: int) -> None:
        """Settle as unfinished the requests in flight for longer than ``max_age_s``."""
        limit = now - self._max_age_ns
        while True:
            rid = self._oldest_open()
            if rid is None:
                break
            req = self._open[rid]
            if req.begin_ns > limit:
                break
            self._close(rid, req, req.begin_ns + self._max_age_ns, None, "unfinished")
        heap = self._open_heap
        if len(heap) > 2 * len(self._open) + 1024:  # stale entries: rebuild
            self._open_heap = [(r.begin_ns, rid) for rid, r in self._open.items()]
            heapq.heapify(self._open_heap)

    def horizon_ns(self) -> int | None:
        """Up to when energy can be attributed now (``None``: nothing yet): no later than
        every GPU's readings cover, less ``lag_s``, nor than now less ``max_edge_delay_s``,
        and with the ``tokens`` policy, nor than the first request still in flight began (its
        token rates are not known yet; ``equal`` and ``steps`` settle past it in pieces)."""
        with self._lock:
            self._drain_readings()
            return self._horizon(self._clock())

    def _horizon(self, now: int) -> int | None:
        gpus = self._gpus | self._named.keys()
        if not gpus:
            return None
        ends = []
        for g in gpus:
            h = self._histories.get(g)
            if h is None or h.last_t_ns is None:
                if g in self._gpus or now - self._named[g] < self._max_age_ns:
                    return None
                continue  # named by a request, and never read since: not waited for
            ends.append(h.last_t_ns)
        if not ends:
            return None
        horizon = min(ends) - self._lag_ns
        if self._delay_ns:  # edges stamped up to the delay ago may still come
            horizon = min(horizon, now - self._delay_ns)
        if self.policy == "tokens":
            oldest = self._oldest_open()
            if oldest is not None:
                horizon = min(horizon, self._open[oldest].begin_ns)
        return horizon

    def settle(self, max_requests: int | None = None) -> list[RequestEnergy]:
        """Attribute what can be now, up to ``max_requests`` requests (default: the meter's
        ``settle_batch``); returns the requests settled this time (also kept for
        :meth:`results`). Subscribers are called back in the calling thread.

        A request that ended after the horizon but began before it is attributed in two
        pieces: up to the horizon now, the rest at a later settle, at the same token rates
        (its whole phases'); it is returned once, whole, when its last piece is settled. With
        ``equal`` and ``steps``, so is a request still in flight (a piece up to each horizon)."""
        out, _ = self._settle_slice(max_requests)
        self._notify(out)
        return [] if out is None else list(out.requests.values())

    def settle_all(self) -> list[RequestEnergy]:
        """:meth:`settle` until nothing more can be settled now."""
        settled: list[RequestEnergy] = []
        more = True
        while more:
            out, more = self._settle_slice(None)
            self._notify(out)
            if out is not None:
                settled += out.requests.values()
        return settled

    def _notify(self, final: Attribution | None) -> None:
        if final is None:
            return
        for callback in self._subscribers:
            try:
                callback(final)
            except Exception:
                logger.exception("a request-meter subscriber failed")

    def _settle_slice(self, max_requests: int | None) -> tuple[Attribution | None, bool]:
        """One bounded settle: the attribution (``None``: nothing settled) and whether more
        could be settled now."""
        budget = self._batch if max_requests is None else max(1, max_requests)
        with self._lock:
            try:
                return self._settle_locked(budget)
            finally:
                self._snapshot()

    def _snapshot(self) -> None:
        oldest = self._oldest_open()
        self.state = MeterState(
            in_flight=len(self._open),
            unsettled=len(self._edges_of),
            oldest_begin_ns=None if oldest is None else self._open[oldest].begin_ns,
            settled_ns=self._settled_ns,
            pending=len(self._edges) + len(self._readings),
        )

    def _settle_locked(self, budget: int) -> tuple[Attribution | None, bool]:
        self._bound_edges()
        self._drain_readings()
        cap = self._drain_edges(4 * budget)
        now = self._clock()
        self._expire(now)
        horizon = self._horizon(now)
        if horizon is None:
            return None, False
        more = cap is not None and cap < horizon
        if more:
            assert cap is not None
            horizon = cap
        start = self._settled_ns
        if start is None:  # the first interval starts with the readings
            firsts = [h.first_t_ns for h in self._histories.values() if h.first_t_ns]
            start = max(firsts) if firsts else horizon
        if horizon <= start:
            # (edges left queued: the next slice takes them, and may settle then)
            return None, more and bool(self._edges)
        # The requests that began before the horizon, earliest first; past ``budget`` of
        # them (beginning after ``start``: those in flight at ``start`` always come), the
        # horizon stops at the next one's begin.
        done = self._done
        taken: list[RequestSpan] = []
        counted = 0
        while done and done[0][0] < horizon:
            b = done[0][0]
            if b > start:
                if counted >= budget:
                    horizon, more = b, True
                    break
                counted += 1
            taken.append(heapq.heappop(done)[2])
        now_spans: list[RequestSpan] = []
        pending: set[str] = set()
        for span in taken:
            # A request that began before the readings did is counted from their start.
            span = _clipped(span, start)
            if span.end_ns <= horizon:
                now_spans.append(span)
            else:
                head, tail = _split(span, horizon)
                now_spans.append(head)
                heapq.heappush(done, (tail.begin_ns, next(self._seq), tail))
                pending.add(span.request_id)
        if self._open and self.policy != "tokens":
            # Requests in flight (their weights do not depend on their end): each one's piece
            # up to the horizon now, the rest at later settles; a prefill piece until its
            # decode mark (_finish drops the phases of one that never marks it).
            for rid, req in self._open.items():
                b = req.begin_ns
                if b >= horizon:
                    continue
                if b < start:
                    b = start
                d = req.decode_ns
                d = horizon if d is None or d > horizon else (d if d > b else b)
                now_spans.append(RequestSpan(rid, req.gpus, b, horizon, d))
                pending.add(rid)
        now_steps: list[StepSpan] = []
        if self._steps:
            ids = {s.request_id for s in now_spans}
            now_steps, self._steps = _cut_steps(self._steps, horizon, ids, ids - pending)
            now_steps = [_clipped_step(st, start) for st in now_steps if st.end_ns > start]
        gpus = sorted(self._gpus | {g for s in now_spans for g in s.gpus})
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

        def errors(gpu: int, times: Sequence[int]) -> tuple[list[float], list[float]] | None:
            h = self._histories.get(gpu)
            got = methods.get(gpu)
            if h is None or got is None or got == "unavailable":
                return None
            begins, ends = h.edge_errors(times, got)
            if got.startswith("counter"):
                # The counter's split of its bracket, whole (the readings' step at an edge
                # is one cause of its error: the larger of the two bounds)
                inside = h.bracket_errors(times)
                begins = [a if a > b else b for a, b in zip(begins, inside, strict=True)]
                ends = [a if a > b else b for a, b in zip(ends, inside, strict=True)]
            return begins, ends

        # One attribution per piece between the intensity's steps (one piece without
        # carbon, or with a source that does not change in the interval).
        outs: list[Attribution] = []
        bases = {g: self.base_power_w(g) for g in gpus} if self.policy == "steps" else {}
        rest = now_spans
        rest_steps = now_steps
        footprints: dict[str, list[Footprint]] = {}
        for a, b in itertools.pairwise(points):
            inside, rest = _cut(rest, b) if b < horizon else (rest, [])
            inside_steps = rest_steps
            if rest_steps and b < horizon:
                ids = {s.request_id for s in inside}
                ended = {s.request_id for s in inside if s.end_ns < b}
                inside_steps, rest_steps = _cut_steps(rest_steps, b, ids, ended)
            piece = attribute(
                inside,
                cumulative=cumulative,
                start_ns=a,
                end_ns=b,
                gpus=gpus,
                policy=self.policy,
                method=methods,
                steps=inside_steps,
                errors=errors,
                step_base_w=bases,
            )
            for kind, count in piece.bad_input.items():
                self._bad(kind, "", "a step entry for a request not in flight on the step's "
                          "GPUs (its weight dropped)", count)  # fmt: skip
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
            totals.idle_s[gpu] = totals.idle_s.get(gpu, 0.0) + g.idle_s
        fit = self.step_weight_fit
        if fit is not None:  # (the settled energy above base, against the steps' features)
            for gpu, g in out.gpus.items():
                measured = methods.get(gpu, "unavailable") != "unavailable"
                energy = g.energy_j if measured else None
                fit.update(gpu, start, horizon, energy, bases.get(gpu, 0.0))
        self._settled_ns = horizon
        for h in self._histories.values():
            # Readings well before the horizon: the counter's update grid is fitted to
            # the brackets around an edge, so some context stays.
            h.trim_before(horizon - _CONTEXT_NS)
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
        finished = totals.finished
        results = self._results
        for r in settled:
            results[r.request_id] = r
            finished[r.finish_reason] = finished.get(r.finish_reason, 0) + 1
        while len(results) > self._keep:
            results.popitem(last=False)
        final = Attribution(out.start_ns, out.end_ns, out.policy)
        final.requests = {r.request_id: r for r in settled}
        final.gpus = out.gpus
        return final, more

    def _finish(self, r: RequestEnergy) -> RequestEnergy:
        """The request as reported: its own edges and token counts, not its pieces'."""
        rid = r.request_id
        begin, end, decode, tokens_in, tokens_out, route, model, reason = self._edges_of.pop(rid)
        r.begin_ns, r.end_ns, r.decode_ns = begin, end, decode
        if decode is None:  # (its pieces settled in flight were prefill pieces)
            r.prefill_j = r.decode_j = None
        r.tokens_in, r.tokens_out = tokens_in, tokens_out
        r.route, r.model = route, model
        r.time_s = (end - begin) / 1e9
        r.finish_reason = reason
        if reason != "unfinished":
            self._remember(rid, True)
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
                        finish_reason=r.finish_reason,
                        error_j=r.error_j,
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


#: consume()'s lowering of the GIL switch interval: how many consume calls run, the interval
#: before the first of them lowered it, and what they set it to (to tell whether someone else
#: changed it since).
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved: float | None = None
_switch_set: float | None = None


def _lower_switch_interval(to: float | None) -> None:
    global _switch_users, _switch_saved, _switch_set
    if to is None:
        return
    with _switch_lock:
        _switch_users += 1
        now = sys.getswitchinterval()
        if to > 0 and now > to:
            if _switch_saved is None:
                _switch_saved = now
            sys.setswitchinterval(to)
            _switch_set = sys.getswitchinterval()


def _restore_switch_interval(to: float | None) -> None:
    global _switch_users, _switch_saved, _switch_set
    if to is None:
        return
    with _switch_lock:
        _switch_users -= 1
        if _switch_users > 0:
            return
        if _switch_saved is not None and sys.getswitchinterval() == _switch_set:
            sys.setswitchinterval(_switch_saved)
        _switch_saved = _switch_set = None


def _show(value: Any) -> str:
    """``repr(value)``, short, whatever it is."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


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
    earlier.error_j += part.error_j
    return earlier


def _cut_steps(
    steps: Sequence[StepSpan], at: int, ids: set[str], ended: set[str]
) -> tuple[list[StepSpan], list[StepSpan]]:
    """``steps`` up to ``at`` and from it; a step across ``at`` is cut there, its head
    keeping the entries of the requests in ``ids`` (those attributed up to ``at``: one that
    begins after it is not an unknown id there), its tail all but those in ``ended`` (ended by
    ``at``), each with its weight."""
    head: list[StepSpan] = []
    tail: list[StepSpan] = []
    for st in steps:
        if st.end_ns <= at:
            head.append(st)
        elif st.start_ns >= at:
            tail.append(st)
        else:
            w, whole = st.weights, st.whole_ns
            head.append(
                StepSpan(st.start_ns, at, st.gpus, tuple(e for e in w if e[0] in ids), whole)
            )
            tail.append(
                StepSpan(at, st.end_ns, st.gpus, tuple(e for e in w if e[0] not in ended), whole)
            )
    return head, tail


def _clipped_step(step: StepSpan, start: int) -> StepSpan:
    if step.start_ns >= start:
        return step
    return StepSpan(start, step.end_ns, step.gpus, step.weights, step.whole_ns)


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
