"""A simulated LLM inference engine with continuous batching, a simulated GPU it drives, and
what a :class:`~zeus_async.inference.RequestMeter` fed as a server would feed it makes of it.

**The engine** (per engine process): requests arrive as a Poisson process, wait in a FIFO
queue, and are *scheduled* (admitted to the running batch, as vLLM does when it gives them KV
cache) while fewer than ``max_batch`` run. Each *step* (one forward pass) serves every running
request: those decoding get one token each, then prompts are prefilled in chunks within a
token budget per step (chunked prefill). A request's first output token comes at the end of
the step that finishes its prompt; it ends at the end of the step that makes its last token.
Between steps the GPU idles for ``s_gap`` (the scheduler on the CPU).

**The GPU** (:class:`~zeus_async.devices.sim.SimGpu`, an H100 with idle 70 W): during a step
it draws idle power plus the sum, over the step's batch, of each request's *own* load; a
request's own energy in a step is a function of ITS OWN work (:meth:`DeviceModel.own_j`:
prefill tokens, decode tokens, and the context it attends to) times a per-request factor
(random, ``Workload.spread``: prompts differ in what they make the GPU do, so token counts are
not a perfect proxy). A tensor-parallel request's work is split evenly over its GPUs; engines
sharing a GPU add their loads (they are not slowed down by each other: a simplification).
At the power limit (an engine's share of it when several share the GPU) a step lasts longer
for the same energy, as lower clocks do.

**Ground truth** per request: the energy of its own load (every GPU), plus, on each GPU, an
equal share of the idle power over every moment it is *running* (scheduled and not finished),
shared with the other requests running on that GPU then (the split the meter's conservation
asks for, and the definition of ``bench_requests.py``'s first accuracy section). A request
waiting in the queue draws nothing: the GPU is busy with the others. Power while no request
runs is idle, nobody's. Per GPU, truth + idle == the simulator's energy (checked).

**The meter** never sees the truth: it gets what a runtime reads through NVML every 10 ms
(:func:`readings`: the instant power field, which on an H100 averages the first 25 ms of each
100 ms, the 1 s average power, and the energy counter, updated every 100 ms), and the engine's
edges: ``begin`` (at scheduling, or at arrival: ``Workload.begin_at``), ``phase`` (first
token), ``end`` (with its token counts) and, for the ``steps`` policy only, each step's batch
(``meter.step``). Edges carry their own times (``at_ns``); engines' streams are delivered in
batches a little late, as over the node agent's socket.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from zeus_async.clock import FakeClock as SimClock
from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.events import GpuSample
from zeus_async.inference import RequestMeter

logger = logging.getLogger(__name__)

MS = 1_000_000
S = 1_000_000_000
T0 = 1_700_000_000 * S
IDLE_W = 70.0
MAX_W = 700.0
#: Readings, as the runtime samples NVML.
READ_EVERY_NS = 10 * MS


@dataclass(frozen=True)
class DeviceModel:
    """What a request's own work costs in one step (joules and seconds, before the request's
    own factor): ``j_prefill_token`` per prompt token, ``j_decode_token`` per generated token,
    ``j_context`` per generated token per token of context it reads from the KV cache, and
    ``j_attention`` per prompt token per token it attends to (earlier context, and the chunk's
    own tokens causally). Step time: ``s_step`` (the weights' read, launches) plus the same
    terms in seconds."""

    name: str
    j_prefill_token: float
    j_decode_token: float
    j_context: float
    j_attention: float
    s_step: float
    s_prefill_token: float
    s_decode_token: float
    s_context: float
    s_gap: float = 0.001

    @staticmethod
    def _terms(prefill: int, decode: int, context: int) -> tuple[float, float, float, float]:
        attended = prefill * context + prefill * (prefill + 1) / 2
        return float(prefill), float(decode), float(decode * (context + 1)), attended

    def own_j(self, prefill: int, decode: int, context: int) -> float:
        """Energy of this work (J), before the request's own factor."""
        p, d, c, a = self._terms(prefill, decode, context)
        return (
            p * self.j_prefill_token
            + d * self.j_decode_token
            + c * self.j_context
            + a * self.j_attention
        )

    def time_s(self, prefill: int, decode: int, context: int) -> float:
        """Step time this work adds (s)."""
        p, d, c, a = self._terms(prefill, decode, context)
        return p * self.s_prefill_token + d * self.s_decode_token + c * self.s_context + a * 2e-11

    def context_ratio(self, context: int) -> float:
        """A decode token's context cost over its token cost at this context length."""
        return self.j_context * (context + 1) / self.j_decode_token


#: Decode bound by the KV cache's reads: a 7B model with multi-head attention (fp16 KV cache,
#: 512 KiB per token), where a token's own compute (14 GFLOP at ~0.8 pJ/FLOP, ~12 mJ) costs as
#: much as reading 400 tokens of context (~30 uJ each at ~60 pJ/byte of HBM).
MEMORY_BOUND = DeviceModel(
    name="memory_bound",
    j_prefill_token=0.012,
    j_decode_token=0.012,
    j_context=0.012 / 400,
    j_attention=3.5e-7,
    s_step=0.006,
    s_prefill_token=0.00004,
    s_decode_token=0.00001,
    s_context=1.7e-7,
)
#: Decode bound by compute: a larger model with grouped-query attention (a 70B on 8 GPUs'
#: worth), where a token's own compute costs as much as reading 6,000 tokens of context.
COMPUTE_BOUND = DeviceModel(
    name="compute_bound",
    j_prefill_token=0.03,
    j_decode_token=0.03,
    j_context=0.03 / 6000,
    j_attention=6e-7,
    s_step=0.012,
    s_prefill_token=0.00008,
    s_decode_token=0.00003,
    s_context=5e-8,
)
DEVICES: dict[str, DeviceModel] = {
    "memory_bound": MEMORY_BOUND,
    "compute_bound": COMPUTE_BOUND,
}


@dataclass(frozen=True)
class Workload:
    """One serving scenario (per engine process)."""

    name: str
    description: str
    rate_per_s: float  # Poisson arrivals, per engine
    max_batch: int
    token_budget: int = 512  # tokens per step (chunked prefill)
    prompt: tuple[int, int] = (32, 2048)  # log-uniform
    output: tuple[int, int] = (8, 512)  # log-uniform
    spread: tuple[float, float] = (0.8, 1.25)  # per-request factor on its own energy
    gpus: int = 1  # tensor parallel: each request's work split evenly over this many GPUs
    engines: int = 1  # engine processes sharing the GPU(s), each with its own edge stream
    begin_at: Literal["scheduled", "arrival"] = "scheduled"


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("one_at_a_time", "one request at a time (batch of 1)", 0.3, 1),
        Workload(
            "tokens_unrelated",
            "batching, each request's power factor 0.25-4x: tokens unrelated to power",
            16.0,
            32,
            spread=(0.25, 4.0),
        ),
        Workload(
            "batching", "continuous batching up to 32, decode cost grows with context", 16.0, 32
        ),
        Workload(
            "queueing_arrival",
            "batch of 8 near saturation: queueing, begin at arrival",
            6.0,
            8,
            begin_at="arrival",
        ),
        Workload(
            "queueing_scheduled",
            "batch of 8 near saturation: queueing, begin at scheduling",
            6.0,
            8,
        ),
        Workload("tensor_parallel", "batching, each request on 2 GPUs (TP=2)", 16.0, 32, gpus=2),
        Workload(
            "processes",
            "2 engine processes on one GPU, edges from both merged",
            8.0,
            16,
            engines=2,
        ),
    )
}


@dataclass
class SimRequest:
    rid: str
    engine: int
    arrival_ns: int
    prompt: int
    output: int
    factor: float
    gpus: tuple[int, ...]
    scheduled_ns: int = -1
    first_token_ns: int = -1
    end_ns: int = -1
    own_j: float = 0.0  # over every GPU
    prefilled: int = 0
    generated: int = 0


@dataclass
class SimStep:
    engine: int
    start_ns: int
    end_ns: int
    gpus: tuple[int, ...]
    #: (request id, prefill tokens, decode tokens, context length): what ``meter.step`` gets.
    entries: list[tuple[str, int, int, int]]
    dyn_w: float  # per GPU


@dataclass
class Trace:
    """One simulated run: what happened, and the truth."""

    workload: Workload
    device: DeviceModel
    requests: list[SimRequest]
    steps: list[SimStep]
    truth: dict[str, float]
    node: SimNode
    start_ns: int
    end_ns: int
    #: Per GPU: the simulator's energy over the run, and the part no request was running in.
    energy_j: dict[int, float] = field(default_factory=dict)
    idle_j: dict[int, float] = field(default_factory=dict)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _run_engine(wl: Workload, dev: DeviceModel, reqs: list[SimRequest]) -> list[SimStep]:
    assert wl.token_budget > wl.max_batch
    cap_w = (MAX_W - IDLE_W) / wl.engines * 0.999
    gpus = reqs[0].gpus if reqs else (0,)
    waiting: deque[SimRequest] = deque()
    running: list[SimRequest] = []
    steps: list[SimStep] = []
    k = 0
    t = reqs[0].arrival_ns if reqs else 0
    gap = round(dev.s_gap * S)
    while k < len(reqs) or waiting or running:
        while k < len(reqs) and reqs[k].arrival_ns <= t:
            waiting.append(reqs[k])
            k += 1
        while waiting and len(running) < wl.max_batch:
            r = waiting.popleft()
            r.scheduled_ns = t
            running.append(r)
        if not running:
            t = reqs[k].arrival_ns
            continue
        budget = wl.token_budget
        work: list[tuple[SimRequest, int, int, int]] = []
        for r in running:  # the running decodes first, then prompts within the budget
            if r.prefilled == r.prompt:
                work.append((r, 0, 1, r.prompt + r.generated - 1))
                budget -= 1
        for r in running:
            if r.prefilled < r.prompt and budget > 0:
                n = min(r.prompt - r.prefilled, budget)
                budget -= n
                work.append((r, n, 0, r.prefilled))
        d_s = dev.s_step + sum(dev.time_s(p, d, c) for _, p, d, c in work)
        own = [r.factor * dev.own_j(p, d, c) for r, p, d, c in work]
        # At the power limit (this engine's share of it) the clocks drop: the step takes
        # longer, at the limit, for the same energy.
        d_s = max(d_s, math.fsum(own) / len(gpus) / cap_w)
        end = t + round(d_s * S)
        steps.append(
            SimStep(
                reqs[0].engine,
                t,
                end,
                gpus,
                [(r.rid, p, d, c) for r, p, d, c in work],
                math.fsum(own) / ((end - t) / S) / len(gpus),
            )
        )
        for (r, p, d, _), e in zip(work, own, strict=True):
            r.own_j += e
            if p:
                r.prefilled += p
                if r.prefilled == r.prompt:
                    r.generated = 1
                    r.first_token_ns = end
            if d:
                r.generated += 1
            if r.prefilled == r.prompt and r.generated >= r.output:
                r.end_ns = end
        running = [r for r in running if r.end_ns < 0]
        t = end + gap
    return steps


def simulate(
    workload: Workload | str,
    device: DeviceModel | str = "memory_bound",
    requests: int = 500,
    seed: int = 1,
) -> Trace:
    """Run ``requests`` requests (over all engines) through the engine and the GPU."""
    wl = WORKLOADS[workload] if isinstance(workload, str) else workload
    dev = DEVICES[device] if isinstance(device, str) else device
    rng = random.Random(seed)
    start = T0 + 500 * MS
    gpus = tuple(range(wl.gpus))
    per_engine: list[list[SimRequest]] = [[] for _ in range(wl.engines)]
    for e in range(wl.engines):
        t = start
        for i in range(requests // wl.engines):
            t += round(rng.expovariate(wl.rate_per_s) * S)
            per_engine[e].append(
                SimRequest(
                    rid=f"p{e}-r{i}",
                    engine=e,
                    arrival_ns=t,
                    prompt=round(_log_uniform(rng, *wl.prompt)),
                    output=round(_log_uniform(rng, *wl.output)),
                    factor=_log_uniform(rng, *wl.spread),
                    gpus=gpus,
                )
            )
    steps = [s for reqs in per_engine for s in _run_engine(wl, dev, reqs)]
    steps.sort(key=lambda s: (s.start_ns, s.engine))
    reqs = [r for rs in per_engine for r in rs]
    end = max(r.end_ns for r in reqs) + 500 * MS
    node = SimNode(
        SimConfig(num_gpus=wl.gpus, counter_origin_ns=0, idle_w=IDLE_W, max_w=MAX_W),
        SimClock(T0),
        shared_state=False,
    )
    trace = Trace(wl, dev, reqs, steps, {r.rid: r.own_j for r in reqs}, node, start, end)
    for g in range(node.config.num_gpus):
        _drive(node, g, [s for s in steps if g in s.gpus])
        shared = _idle_shares(trace, g)
        total = node.gpus[g].energy_j(T0, end)
        trace.energy_j[g] = total
        own = math.fsum(r.own_j / len(r.gpus) for r in reqs if g in r.gpus)
        # Conservation of the truth: own loads + idle shared while running + idle == energy.
        assert abs(own + shared + trace.idle_j[g] - total) <= 1e-7 * total, (g, own, total)
    return trace


def _drive(node: SimNode, g: int, steps: Sequence[SimStep]) -> None:
    """Set GPU ``g``'s load at every change: the sum of the steps running on it."""
    changes: dict[int, list[tuple[int, float]]] = {}
    for i, s in enumerate(steps):
        changes.setdefault(s.start_ns, []).append((i, s.dyn_w))
        changes.setdefault(s.end_ns, []).append((-i - 1, 0.0))
    active: dict[int, float] = {}
    gpu = node.gpus[g]
    gpu.set_load(0.0, T0)
    for t in sorted(changes):
        for k, w in changes[t]:
            if k >= 0:
                active[k] = w
            else:
                active.pop(-k - 1, None)
        u = math.fsum(active.values()) / (MAX_W - IDLE_W)
        if u > 1.0 + 1e-9:
            raise ValueError(f"gpu {g} above its maximum power at {t}: the model has no throttle")
        gpu.set_load(min(u, 1.0), t)


def _idle_shares(trace: Trace, g: int) -> float:
    """Add to the truth each request's equal share of GPU ``g``'s idle power while it runs,
    and note the idle energy while none runs; returns the idle energy shared."""
    on = [r for r in trace.requests if g in r.gpus]
    points = sorted(
        {trace.start_ns, trace.end_ns, *(x for r in on for x in (r.scheduled_ns, r.end_ns))}
    )
    delta = [0] * len(points)
    for r in on:
        delta[bisect.bisect_left(points, r.scheduled_ns)] += 1
        delta[bisect.bisect_left(points, r.end_ns)] -= 1
    cum = [0.0] * len(points)
    running = 0
    idle = shared = acc = 0.0
    for i in range(len(points) - 1):
        running += delta[i]
        dt_j = IDLE_W * (points[i + 1] - points[i]) / S
        if running:
            acc += dt_j / running
            shared += dt_j
        else:
            idle += dt_j
        cum[i + 1] = acc
    # before the run (T0..start) nothing runs either
    trace.idle_j[g] = idle + IDLE_W * (trace.start_ns - T0) / S
    for r in on:
        a = cum[bisect.bisect_left(points, r.scheduled_ns)]
        b = cum[bisect.bisect_left(points, r.end_ns)]
        trace.truth[r.rid] += b - a
    return shared


def readings(node: SimNode, t_ns: int) -> list[GpuSample]:
    """What the runtime publishes at ``t_ns`` for each GPU, from NVML as the simulator answers
    it: instant power (``NVML_FI_DEV_POWER_INSTANT``), 1 s average power, energy counter."""
    return [
        GpuSample(
            "sim",
            t_ns,
            g.index,
            power_w=g.instant_field_mw(t_ns) / 1000,
            avg_power_w=g.average_power_mw(t_ns) / 1000,
            energy_j=g.energy_counter_mj(t_ns) / 1000,
        )
        for g in node.gpus
    ]


# -- the meter's side ----------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """One meter to run: a label, the meter's policy, its step weight (``None``: the meter's
    default), and whether the engine reports steps to it."""

    label: str
    policy: str
    #: ``"fit"``: the meter's fitted weight (its default with ``steps``).
    step_weight: Callable[[Any], float] | str | None = None

    @property
    def steps(self) -> bool:
        return self.policy == "steps"


@dataclass
class Measured:
    """One policy's figures on one trace."""

    label: str
    energy_j: dict[str, float]
    error_j: dict[str, float | None]
    rel: list[float]  # per request, |attributed - truth| / truth
    mean: float
    p95: float
    within_bound: float | None  # share of requests with |attributed - truth| <= error_j
    #: The policy with exact energies (the simulator's, no sensors): its error against the
    #: truth is the policy's model alone.
    exact_mean: float
    exact_p95: float
    #: Share of requests with |attributed - the same policy on exact energies| <= error_j:
    #: what error_j claims to bound (the measurement part).
    bound_holds: float | None
    imbalance_j: float  # max over GPUs of |measured - requests - idle|
    measured_j: float  # over every GPU, over the settled interval
    #: ``steps`` only: on exact energies, with the GPU's idle power split equally among the
    #: requests in flight and only the power above it by the step weights (what the policy
    #: would give if it knew the idle power), mean and p95; ``None`` for other policies.
    idle_equal: tuple[float, float] | None = None
    #: ``steps`` only: the same, with each step's weights divided by its duration (weights per
    #: second: overlapping steps, of engines sharing a GPU, then combine as power does).
    idle_equal_per_s: tuple[float, float] | None = None


def fitted_weight(device: DeviceModel) -> Callable[[Any], float]:
    """The step weight a user who calibrated this device would supply: its own-energy model,
    without the per-request factor (which no engine knows)."""

    def weight(entry: Any) -> float:
        return device.own_j(int(entry[1]), int(entry[2]), int(entry[3]))

    return weight


def measure(
    trace: Trace,
    policies: Sequence[Policy],
    *,
    delivery_ms: int = 20,
    settle_every_ms: int = 500,
) -> dict[str, Measured]:
    """Feed one meter per policy as a server would, settle, and compare with the truth."""
    clock = _Clock(T0)
    gpus = list(range(trace.node.config.num_gpus))
    meters: dict[str, RequestMeter] = {}
    for p in policies:
        meters[p.label] = RequestMeter(
            p.policy,  # type: ignore[arg-type]
            gpus=gpus,
            clock=clock,
            lag_s=0.3,
            keep=4 * len(trace.requests),
            max_edge_delay_s=3 * delivery_ms / 1000,
            step_weight=p.step_weight,
        )
    # Edges: (delivery time, happened at, order, kind, payload). Each engine's edges go out
    # in batches every ``delivery_ms`` (engines offset), stamped with when they happened
    # (``at_ns``), as an engine's stat logger or the node agent's socket delivers them.
    period = delivery_ms * MS
    edges: list[tuple[int, int, int, int, Any]] = []

    def deliver(t: int, engine: int) -> int:
        offset = engine * period // 3
        return ((t - offset) // period + 1) * period + offset

    for r in trace.requests:
        begin = r.arrival_ns if trace.workload.begin_at == "arrival" else r.scheduled_ns
        edges.append((deliver(begin, r.engine), begin, 0, 0, r))
        edges.append((deliver(r.first_token_ns, r.engine), r.first_token_ns, 1, 1, r))
        edges.append((deliver(r.end_ns, r.engine), r.end_ns, 3, 2, r))
    for s in trace.steps:
        edges.append((deliver(s.end_ns, s.engine), s.end_ns, 2, 3, s))
    edges.sort(key=lambda e: (e[0], e[1], e[2]))
    stepping = [meters[p.label] for p in policies if p.steps]
    every = list(meters.values())
    k = 0
    reading = T0
    next_settle = T0 + settle_every_ms * MS
    last = trace.end_ns + 2 * S
    while reading <= last:
        while k < len(edges) and edges[k][0] < reading:
            when, t, _, kind, x = edges[k]
            clock.now = when
            if kind == 0:
                for m in every:
                    m.begin(x.rid, gpus=x.gpus, at_ns=t)
            elif kind == 1:
                for m in every:
                    m.phase(x.rid, at_ns=t)
            elif kind == 2:
                for m in every:
                    m.end(x.rid, tokens_in=x.prompt, tokens_out=x.output, at_ns=t)
            else:
                for m in stepping:
                    m.step(x.entries, start_ns=x.start_ns, end_ns=x.end_ns, gpus=x.gpus)
            k += 1
        clock.now = reading
        for sample in readings(trace.node, reading):
            for m in every:
                m.add(sample)
        if reading >= next_settle:
            for m in every:
                m.settle()
            next_settle += settle_every_ms * MS
        reading += READ_EVERY_NS
    out: dict[str, Measured] = {}
    truth = trace.truth
    for p in policies:
        m = meters[p.label]
        m.settle_all()
        got = {r.request_id: r for r in m.results()}
        missing = [rid for rid in truth if rid not in got]
        if missing:
            raise RuntimeError(f"{p.label}: {len(missing)} requests not settled")
        energy = {rid: got[rid].energy_j for rid in truth}
        bound: dict[str, float | None] = {rid: getattr(got[rid], "error_j", None) for rid in truth}
        rel = [abs(energy[rid] - truth[rid]) / truth[rid] for rid in truth]
        inside = [abs(energy[rid] - truth[rid]) <= b for rid, b in bound.items() if b is not None]
        # (the same policy: steps with the base power the meter estimated, per GPU)
        bases = {g: m.base_power_w(g) for g in gpus} if p.steps else None
        fit = m.step_weight_fit
        if fit is not None:  # (on exact energies: the weight the meter fitted, at the end)
            p = dataclasses.replace(p, step_weight=fit.weight)
        exact = exact_attribution(trace, p, per_second=True, base_w=bases)
        rel_x = [abs(exact[rid] - truth[rid]) / truth[rid] for rid in truth]
        held = [abs(energy[rid] - exact[rid]) <= b for rid, b in bound.items() if b is not None]
        totals = m.totals
        imbalance = max(
            abs(totals.energy_j[g] - totals.requests_j.get(g, 0.0) - totals.idle_j.get(g, 0.0))
            for g in totals.energy_j
        )
        idle_equal = idle_equal_per_s = None
        if p.steps:
            split = exact_attribution(trace, p, idle_w=IDLE_W)
            rel_i = [abs(split[rid] - truth[rid]) / truth[rid] for rid in truth]
            idle_equal = (statistics.mean(rel_i), _p95(rel_i))
            split = exact_attribution(trace, p, idle_w=IDLE_W, per_second=True)
            rel_i = [abs(split[rid] - truth[rid]) / truth[rid] for rid in truth]
            idle_equal_per_s = (statistics.mean(rel_i), _p95(rel_i))
        out[p.label] = Measured(
            p.label,
            energy,
            bound,
            rel,
            statistics.mean(rel),
            _p95(rel),
            sum(inside) / len(inside) if inside else None,
            statistics.mean(rel_x),
            _p95(rel_x),
            sum(held) / len(held) if held else None,
            imbalance,
            math.fsum(totals.energy_j.values()),
            idle_equal,
            idle_equal_per_s,
        )
    return out


def exact_attribution(
    trace: Trace,
    p: Policy,
    idle_w: float | None = None,
    *,
    per_second: bool = False,
    base_w: dict[int, float] | None = None,
) -> dict[str, float]:
    """What the policy gives each request with the simulator's exact energies (every edge and
    step as the meter gets them): the policy's model without the sensors and estimator.

    ``idle_w``: split only the power above ``idle_w`` by the policy, and ``idle_w`` equally
    among the requests in flight (a variant of the policy that knows the idle power).
    ``per_second``: each step's weights divided by its duration (what ``attribute`` does:
    without it, they are multiplied by it first). ``base_w``: the steps policy's
    ``step_base_w`` per GPU (the meter's own estimate, for the same policy as the meter's)."""
    from zeus_async.inference.attribution import (
        RequestSpan,
        StepEntry,
        StepSpan,
        attribute,
        default_step_weight,
    )

    arrival = trace.workload.begin_at == "arrival"
    spans = [
        RequestSpan(
            r.rid,
            r.gpus,
            r.arrival_ns if arrival else r.scheduled_ns,
            r.end_ns,
            r.first_token_ns,
            tokens_in=r.prompt,
            tokens_out=r.output,
        )
        for r in trace.requests
    ]
    weight = p.step_weight or default_step_weight
    assert callable(weight)
    steps = []
    for s in trace.steps:
        per = 1.0 if per_second else (s.end_ns - s.start_ns) / S
        weights = tuple((e[0], weight(StepEntry(*e)) * per) for e in s.entries)
        steps.append(StepSpan(s.start_ns, s.end_ns, s.gpus, weights))
    gpus = trace.node.gpus
    floor = idle_w or 0.0
    out = attribute(
        spans,
        lambda g, a, b: gpus[g].energy_j(a, b) - floor * (b - a) / S,
        start_ns=T0,
        end_ns=trace.end_ns,
        gpus=list(range(len(gpus))),
        policy=p.policy,  # type: ignore[arg-type]
        steps=steps if p.steps else (),
        step_base_w=base_w or 0.0,
    )
    got = {rid: r.energy_j for rid, r in out.requests.items()}
    if idle_w is not None:
        idle = attribute(
            spans,
            lambda g, a, b: floor * (b - a) / S,
            start_ns=T0,
            end_ns=trace.end_ns,
            gpus=list(range(len(gpus))),
            policy="equal",
        )
        for rid, r in idle.requests.items():
            got[rid] += r.energy_j
    return got


def baseline(trace: Trace, measured_j: float) -> tuple[float, float]:
    """ML.ENERGY-style: the measured energy over the run divided by the number of requests,
    for every request: (mean, p95) relative error against the truth."""
    each = measured_j / len(trace.requests)
    rel = [abs(each - t) / t for t in trace.truth.values()]
    return statistics.mean(rel), _p95(rel)


def _p95(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


class _Clock:
    def __init__(self, t: int) -> None:
        self.now = t

    def __call__(self) -> int:
        return self.now
