"""Attribution of a GPU's energy to the inference requests it served, with conservation.

Between two consecutive request edges (a request beginning, switching from prefill to decode,
or ending) on a GPU, the set of requests in flight there is fixed: a *segment*. Its energy
(from the same estimator as every other figure, :mod:`zeus_async.aggregate.history`) goes
whole to the requests in flight in it, or, when none is, to *idle*. So, per GPU and exactly
(up to floating-point rounding), the requests' energies plus idle add up to the energy the GPU
drew over the interval.

How a segment's energy is split is the *policy*:

* ``"equal"``: in equal shares; a request's energy is then its equal share of every moment it
  was in flight, whatever it did.
* ``"steps"``: by what the engine computed. Inside an engine step (:class:`StepSpan`: a
  forward pass, with its batch), the GPU's energy goes to the step's requests in flight there,
  in proportion to each one's weight in the step (``step_weight(entry)``,
  :func:`default_step_weight` unless the meter is given another) divided by the step's
  duration (a rate: where steps overlap on one GPU, engines sharing it, a long step's weights
  do not outweigh a short one's for the same work per second); between steps, equally
  among the requests in flight; with none in flight, to idle. A step whose entries all weigh
  nothing (or name no request in flight) is split as between steps. Without steps it is
  ``"equal"``. With ``step_base_w`` (the GPU's idle power), that much of a step's power
  (never more than the step's own) is split equally among the requests in the step (it is
  no request's work, but those requests hold the GPU), only the rest by weight.
* ``"tokens"``: in proportion to each request's token rate in its current phase: input tokens
  per second of prefill, output tokens per second of decode (a request without a decode mark
  is one phase, its input and output tokens over its duration). A batch mixing a long prompt
  in prefill with a few requests decoding gives the prompt most of the energy, as its
  compute does. A segment whose requests all have zero tokens is split equally.

Assumptions (stated in ``docs/requests.md``): the GPU's energy in a segment is caused by the
requests in flight on it then (work of a request queued but not begun is idle); phases and
token counts are what the server reports; a request on several GPUs (tensor parallel) is
split on each of them separately.

The split uses cumulative shares, so a request costs O(1) beyond the sort of the edges: per
GPU and per phase class, ``share(t)`` is the running sum over segments of ``energy / weight of
the segment``, and a request's energy in a phase is its weight times the difference of
``share`` across the phase.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal, NamedTuple

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..carbon import Footprint

__all__ = [
    "POLICIES",
    "STEP_CONTEXT_SCALE",
    "Attribution",
    "GpuAttribution",
    "RequestEnergy",
    "RequestSpan",
    "StepEntry",
    "StepSpan",
    "attribute",
    "default_step_weight",
]

logger = logging.getLogger(__name__)

Policy = Literal["equal", "tokens", "steps"]

#: The split policies (see the module docstring).
POLICIES: Final = ("equal", "tokens", "steps")

#: ``energy(gpu, t0_ns, t1_ns)``: joules GPU ``gpu`` drew over ``[t0_ns, t1_ns]``.
EnergyFn = Callable[[int, int, int], float]

#: ``cumulative(gpu, times)``: joules GPU ``gpu`` drew from ``times[0]`` to each of ``times``
#: (sorted); the faster form, one pass per GPU (``DeviceHistory.cumulative``).
CumulativeFn = Callable[[int, Sequence[int]], Sequence[float]]

#: ``errors(gpu, times)``: per time of ``times`` (sorted), the uncertainty (J) of an interval
#: starting there and of one ending there (``DeviceHistory.edge_errors``); ``None``: unknown.
ErrorFn = Callable[[int, Sequence[int]], "tuple[Sequence[float], Sequence[float]] | None"]

#: Context length (tokens) at which a token's attention over the KV cache costs as much as
#: the rest of its work in :func:`default_step_weight`.
STEP_CONTEXT_SCALE: Final = 8192


class StepEntry(NamedTuple):
    """One request's part in an engine step (``RequestMeter.step``).

    Attributes:
        request_id: The request.
        prefill_tokens: Prompt tokens it processed in the step (a prefill chunk).
        decode_tokens: Tokens it generated in the step (1 per decode step, more when
            speculating).
        context_len: Tokens already in its KV cache before the step.
    """

    request_id: str
    prefill_tokens: int = 0
    decode_tokens: int = 0
    context_len: int = 0


def default_step_weight(entry: StepEntry) -> float:
    """The ``steps`` policy's default weight of a request in a step: its tokens, each
    weighted by ``1 + context / STEP_CONTEXT_SCALE``.

    Why: a token's work in a forward pass is the weights' part (about the same for every token
    of the batch: the matrix products, or in memory-bound decode the weights read once and
    shared) plus its attention over the KV cache, which grows linearly with the context it
    attends to (the keys and values read, and the products with them). The first part makes
    the weight proportional to tokens; the second adds ``context / STEP_CONTEXT_SCALE`` per
    token, where ``STEP_CONTEXT_SCALE`` (8,192) is the context at which attention costs about
    as much as the rest (for a 7-13B model with grouped-query attention; a coarse, stated
    choice: pass your own ``step_weight`` for your model). A prefill chunk's tokens attend to
    the cached context plus, on average, half the chunk (causal attention).
    """
    prefill = entry.prefill_tokens
    decode = entry.decode_tokens
    ctx = entry.context_len
    return prefill * (1.0 + (ctx + prefill / 2) / STEP_CONTEXT_SCALE) + decode * (
        1.0 + ctx / STEP_CONTEXT_SCALE
    )


@dataclass(frozen=True)
class StepSpan:
    """One engine step as attributed: its interval, GPUs and each request's weight in it.

    Attributes:
        start_ns, end_ns: The step (wall-clock ns).
        gpus: The GPUs that ran it; ``None``: those of its requests.
        weights: ``(request_id, weight)`` per request in the batch (weights >= 0).
        duration_ns: The whole step's duration, when this is a piece of it (a step cut at a
            settle's horizon); 0: ``end_ns - start_ns``. The weights are divided by it.
    """

    start_ns: int
    end_ns: int
    gpus: tuple[int, ...] | None
    weights: tuple[tuple[str, float], ...]
    duration_ns: int = 0

    @property
    def whole_ns(self) -> int:
        """The whole step's duration (what its weights are divided by)."""
        return self.duration_ns or self.end_ns - self.start_ns


@dataclass(frozen=True)
class RequestSpan:
    """One request's timeline, as the server reported it.

    Attributes:
        request_id: The server's id for it.
        gpus: The GPUs that served it.
        begin_ns: When it began (wall-clock ns, the monitor's clock).
        end_ns: When it ended.
        decode_ns: When prefill turned into decode; ``None`` when phases were not marked.
        tokens_in: Input (prompt) tokens.
        tokens_out: Output (generated) tokens.
    """

    request_id: str
    gpus: tuple[int, ...]
    begin_ns: int
    end_ns: int
    decode_ns: int | None = None
    tokens_in: float = 0
    tokens_out: float = 0

    def __post_init__(self) -> None:
        if self.end_ns < self.begin_ns:
            raise ConfigError(f"request {self.request_id!r} ends before it begins")
        if self.decode_ns is not None and not self.begin_ns <= self.decode_ns <= self.end_ns:
            raise ConfigError(f"request {self.request_id!r}: its decode mark is outside it")
        if self.tokens_in < 0 or self.tokens_out < 0:
            raise ConfigError(f"request {self.request_id!r}: negative token count")
        if not self.gpus:
            raise ConfigError(f"request {self.request_id!r} names no GPU")

    def phases(self) -> list[tuple[str, int, int, float]]:
        """``(phase, start_ns, end_ns, tokens)`` of its phases (empty phases left out)."""
        if self.decode_ns is None:
            whole = ("request", self.begin_ns, self.end_ns, float(self.tokens_in + self.tokens_out))
            candidates = [whole]
        else:
            candidates = [
                ("prefill", self.begin_ns, self.decode_ns, float(self.tokens_in)),
                ("decode", self.decode_ns, self.end_ns, float(self.tokens_out)),
            ]
        return [p for p in candidates if p[2] > p[1]]  # an empty phase draws nothing


@dataclass
class RequestEnergy:
    """What one request was attributed.

    Attributes:
        request_id: The request.
        energy_j: Its energy over every GPU that served it.
        gpu_energy_j: Per GPU.
        prefill_j: Of which in prefill (``None`` when phases were not marked).
        decode_j: Of which in decode (``None`` likewise).
        tokens_in, tokens_out: As reported.
        time_s: Its duration.
        method: How it was obtained: the policy, and the energy estimator's method.
        begin_ns, end_ns, decode_ns: Its edges (wall-clock ns).
        footprint: Its emissions and cost, when the meter has a carbon configuration
            (``RequestMeter(carbon=...)``): the intensity in force at each instant weighted by
            the energy attributed to the request then; ``None`` otherwise.
        route, model: Labels the server gave at its end (``RequestMeter.end``), ``""`` if none.
        finish_reason: ``completed``, ``cancelled``, ``error`` or ``unfinished``
            (``RequestMeter.abort``, ``max_age_s``); ``completed`` outside a meter.
        error_j: A bound on the measurement part of ``energy_j`` (how far it can be from
            the same policy on exact energies): at each boundary of the segments it was
            split over, the uncertainty of the cumulative energy there (the larger of
            ``DeviceHistory.edge_errors``'s and ``bracket_errors``'s) times how much the
            request's share per joule changes there (summation by parts: only where its
            share changes). Not the policy's model (how well a share follows what the
            request drew).
    """

    request_id: str
    energy_j: float
    gpu_energy_j: dict[int, float]
    prefill_j: float | None
    decode_j: float | None
    tokens_in: float
    tokens_out: float
    time_s: float
    method: str
    begin_ns: int = 0
    end_ns: int = 0
    decode_ns: int | None = None
    footprint: Footprint | None = None
    route: str = ""
    model: str = ""
    finish_reason: str = "completed"
    error_j: float = 0.0

    @property
    def j_per_output_token(self) -> float | None:
        """Energy per generated token (``None`` without output tokens)."""
        return self.energy_j / self.tokens_out if self.tokens_out else None

    @property
    def co2e_g(self) -> float | None:
        """Grams CO2e of its energy (``None`` without a carbon configuration)."""
        return None if self.footprint is None else self.footprint.co2e_g

    @property
    def cost(self) -> float | None:
        """What its energy cost, in ``footprint.currency`` (``None`` without a price)."""
        return None if self.footprint is None else self.footprint.cost


@dataclass
class GpuAttribution:
    """One GPU over the interval: its measured energy, and where it went."""

    gpu: int
    energy_j: float
    requests_j: float
    idle_j: float
    busy_s: float
    idle_s: float

    @property
    def imbalance_j(self) -> float:
        """``energy_j - requests_j - idle_j``: zero up to rounding (conservation)."""
        return self.energy_j - self.requests_j - self.idle_j


@dataclass
class Attribution:
    """The result of :func:`attribute`."""

    start_ns: int
    end_ns: int
    policy: str
    requests: dict[str, RequestEnergy] = field(default_factory=dict)
    gpus: dict[int, GpuAttribution] = field(default_factory=dict)
    #: Step input that could not be used, by kind (``unknown_id``: a step entry for a request
    #: absent from the interval or on none of the step's GPUs; its weight dropped).
    bad_input: dict[str, int] = field(default_factory=dict)


def attribute(
    spans: Iterable[RequestSpan],
    energy: EnergyFn | None = None,
    *,
    cumulative: CumulativeFn | None = None,
    start_ns: int | None = None,
    end_ns: int | None = None,
    gpus: Sequence[int] | None = None,
    policy: Policy = "equal",
    method: str | Mapping[int, str] = "",
    steps: Iterable[StepSpan] = (),
    errors: ErrorFn | None = None,
    step_base_w: float | Mapping[int, float] = 0.0,
) -> Attribution:
    """Split each GPU's energy over ``[start_ns, end_ns]`` among the requests in flight on it
    (see the module docstring); the rest is idle.

    Args:
        spans: The requests; each must lie within the interval.
        energy: ``energy(gpu, t0_ns, t1_ns)`` in J, additive over adjacent intervals; or
        cumulative: ``cumulative(gpu, times)`` (:data:`CumulativeFn`), one call per GPU.
        start_ns, end_ns: The interval (default: from the first request's begin to the last
            one's end).
        gpus: The GPUs to account for (default: every GPU a request names).
        policy: ``"equal"``, ``"tokens"`` or ``"steps"``.
        method: The energy estimator's method (per GPU, or one for all), for the requests'
            ``method``.
        steps: The engine's steps (policy ``"steps"``; ignored by the others), each within
            the interval.
        errors: Edge uncertainties (:data:`ErrorFn`) for the requests' ``error_j``
            (default: 0).
        step_base_w: Policy ``"steps"``: the GPU's power that no step's work causes (its
            idle power, W; one for all GPUs, or per GPU, 0 for a GPU not named): in a step,
            that much of its energy (all of it, when less) is split equally among the
            step's requests, the rest by the weights. 0: all by them.

    Raises:
        ConfigError: An unknown policy, a request or step outside the interval, or two
            requests with one id.
    """
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    bases = step_base_w if isinstance(step_base_w, Mapping) else None
    given = list(bases.values()) if bases is not None else [float(step_base_w)]  # type: ignore[arg-type]
    if not all(w >= 0 for w in given):
        raise ConfigError("step_base_w must be >= 0")
    if (energy is None) == (cumulative is None):
        raise ConfigError("give energy or cumulative (one of them)")
    if cumulative is None:
        assert energy is not None
        cumulative = _cumulative_of(energy)
    spans = list(spans)
    ids = [s.request_id for s in spans]
    if len(set(ids)) != len(ids):
        raise ConfigError("two requests share an id")
    if start_ns is None:
        start_ns = min((s.begin_ns for s in spans), default=0)
    if end_ns is None:
        end_ns = max((s.end_ns for s in spans), default=start_ns)
    if end_ns < start_ns:
        raise ConfigError("the interval ends before it starts")
    for s in spans:
        if s.begin_ns < start_ns or s.end_ns > end_ns:
            raise ConfigError(f"request {s.request_id!r} lies outside the interval")
    all_gpus = sorted(set(gpus if gpus is not None else ()) | {g for s in spans for g in s.gpus})
    result = Attribution(start_ns, end_ns, policy)
    pieces: dict[int, dict[str, list[tuple[str, int, int, float]]]] = {}
    if policy == "steps":
        pieces = _step_pieces(spans, steps, start_ns, end_ns, result.bad_input)
    requests = result.requests
    by_gpu: dict[int, list[RequestSpan]] = {gpu: [] for gpu in all_gpus}
    for s in spans:
        phased = s.decode_ns is not None
        requests[s.request_id] = RequestEnergy(
            s.request_id,
            0.0,
            {},
            0.0 if phased else None,
            0.0 if phased else None,
            s.tokens_in,
            s.tokens_out,
            (s.end_ns - s.begin_ns) / 1e9,
            "",
            s.begin_ns,
            s.end_ns,
            s.decode_ns,
        )
        for g in s.gpus:
            by_gpu[g].append(s)
    for gpu in all_gpus:
        on_gpu = by_gpu[gpu]
        result.gpus[gpu] = _attribute_gpu(
            gpu,
            on_gpu,
            cumulative,
            start_ns,
            end_ns,
            policy,
            result.requests,
            pieces.get(gpu, {}),
            errors,
            0.0 if policy != "steps" else bases.get(gpu, 0.0) if bases is not None else given[0],
        )
        # (read after the GPU's energy was asked for: a caller may learn it from that)
        gpu_method = method if isinstance(method, str) else method.get(gpu, "")
        label = f"{policy} share of {gpu_method}" if gpu_method else f"{policy} share"
        for s in on_gpu:
            requests[s.request_id].method = label
    for r in result.requests.values():
        r.energy_j = math.fsum(r.gpu_energy_j.values())
        if r.error_j < 0.0:  # (a difference of running sums, rounded)
            r.error_j = 0.0
    return result


def _weights(
    spans: Sequence[RequestSpan],
    policy: Policy,
    pieces: Mapping[str, list[tuple[str, int, int, float]]],
) -> list[list[tuple[str, int, int, float]]]:
    """Per request, its phases with their weight (token rate, or 1; with steps, 0: an equal
    share where no step weighs, plus its weighted pieces in steps)."""
    out = []
    for s in spans:
        phases = []
        for name, a, b, tokens in s.phases():
            if policy == "equal":
                w = 1.0
            elif policy == "tokens":
                w = tokens / ((b - a) / 1e9)
            else:
                w = 0.0
            phases.append((name, a, b, w))
        if pieces:
            phases += pieces.get(s.request_id, ())
        out.append(phases)
    return out


def _step_pieces(
    spans: Sequence[RequestSpan],
    steps: Iterable[StepSpan],
    start_ns: int,
    end_ns: int,
    bad: dict[str, int],
) -> dict[int, dict[str, list[tuple[str, int, int, float]]]]:
    """Per GPU and request, its weighted pieces in steps: ``(phase, start, end, weight)``,
    the step's overlap with the request (cut at its decode mark)."""
    by_id = {s.request_id: s for s in spans}
    out: dict[int, dict[str, list[tuple[str, int, int, float]]]] = {}
    for step in steps:
        s0, s1 = step.start_ns, step.end_ns
        if s0 < start_ns or s1 > end_ns or s1 < s0:
            raise ConfigError("a step lies outside the interval")
        if s1 == s0:
            continue
        per_s = step.whole_ns / 1e9  # weights as rates: per second of the step
        gpus = step.gpus
        if gpus is None:
            gpus = tuple({g for rid, _ in step.weights if rid in by_id for g in by_id[rid].gpus})
        for rid, w in step.weights:
            span = by_id.get(rid)
            a = b = 0
            on: list[int] = []
            if span is not None:
                a, b = max(s0, span.begin_ns), min(s1, span.end_ns)
                on = [g for g in gpus if g in span.gpus]
            if span is None or not on:
                bad["unknown_id"] = bad.get("unknown_id", 0) + 1
                continue
            if b <= a or not w > 0:
                # (a request listed in a step it does not overlap: the engine's edges and
                # its step stamps a little apart, not an unknown request; nothing to weigh)
                continue
            d = span.decode_ns
            if d is None:
                parts = [("request", a, b)]
            elif d <= a:
                parts = [("decode", a, b)]
            elif d >= b:
                parts = [("prefill", a, b)]
            else:
                parts = [("prefill", a, d), ("decode", d, b)]
            for g in on:
                mine = out.setdefault(g, {}).setdefault(rid, [])
                mine += [(name, p, q, w / per_s) for name, p, q in parts]
    return out


def _cumulative_of(energy: EnergyFn) -> CumulativeFn:
    def cumulative(gpu: int, times: Sequence[int]) -> list[float]:
        out, acc = [0.0], 0.0
        for a, b in itertools.pairwise(times):
            acc += energy(gpu, a, b)
            out.append(acc)
        return out

    return cumulative


def _attribute_gpu(
    gpu: int,
    spans: Sequence[RequestSpan],
    cumulative: CumulativeFn,
    start_ns: int,
    end_ns: int,
    policy: Policy,
    requests: dict[str, RequestEnergy],
    pieces: Mapping[str, list[tuple[str, int, int, float]]],
    errors: ErrorFn | None,
    base_w: float = 0.0,
) -> GpuAttribution:
    phases = _weights(spans, policy, pieces)
    # At each phase boundary, the phases entering and leaving. The weight of a segment is the
    # exact sum (fsum) of the weights in flight, not a running sum: token rates span orders
    # of magnitude, and a running sum's rounding residue would skew the segments after.
    changes: dict[int, list[tuple[int, float]]] = {}  # t -> [(+key or -key-1, weight)]
    key = 0
    for per_request in phases:
        for _, a, b, w in per_request:
            changes.setdefault(a, []).append((key, w))
            changes.setdefault(b, []).append((-key - 1, w))
            key += 1
    times = sorted({start_ns, end_ns, *changes})
    n = len(times)
    active: dict[int, float] = {}
    weight = 0.0
    count = positive = 0  # phases in flight, and those of them that weigh more than 0
    # Running sums, compensated (Neumaier): a long busy stretch makes them large, and a
    # request's share is a difference of two of them. ``run``: energy / weight; ``run_eq``:
    # energy / count over the segments that weigh nothing. Indexed by the position in times.
    run = run_c = run_eq = run_eq_c = 0.0
    share = [0.0] * n
    share_c = [0.0] * n
    share_eq = [0.0] * n
    share_eq_c = [0.0] * n
    # ``run_st``: the base power's energy / the step pieces in flight (``base_w`` only).
    run_st = run_st_c = 0.0
    share_st = [0.0] * n if base_w else share
    share_st_c = [0.0] * n if base_w else share
    idle_parts: list[float] = []
    idle_s = busy_s = 0.0
    values = cumulative(gpu, times)
    fsum = math.fsum
    # The edges' uncertainty: ``delta[i]``, how far the cumulative energy at times[i] may be
    # off. A request's energy is sum_k s_k (E(t_k+1) - E(t_k)) over the segments k, with
    # s_k its share per joule of segment k; by parts, its error is sum_k delta_k |s_k -
    # s_k-1| (s = 0 outside it): only where its share changes. Per joule of a segment, a
    # weighted piece gets w * sens_w (1 / weight), a step piece sens_b more of the base
    # power (1 / positive where the segment's energy is all base power), an equal piece
    # sens_e (1 / count, where no piece weighs); running sums of delta * |change| of each.
    got_errors = None if errors is None else errors(gpu, times)
    delta: list[float] | None = None
    if got_errors is not None and (any(got_errors[0]) or any(got_errors[1])):
        delta = [a if a > b else b for a, b in zip(*got_errors, strict=True)]
    sens_w: list[float] = []
    sens_b: list[float] = []
    sens_e: list[float] = []
    for i, t in enumerate(times):
        step = changes.get(t)
        if step is not None:
            exact = False
            for k, w in step:
                if k >= 0:
                    active[k] = w
                    positive += w > 0
                    weight += w
                else:
                    del active[-k - 1]
                    positive -= w > 0
                    weight -= w
                    # A weight far above what stays would leave its rounding behind: the
                    # exact sum then (token rates span orders of magnitude).
                    exact = exact or w > 1e3 * abs(weight)
            count = len(active)
            if not positive:
                weight = 0.0
            elif exact:
                weight = fsum(active.values())
        share[i], share_c[i], share_eq[i], share_eq_c[i] = run, run_c, run_eq, run_eq_c
        if base_w:
            share_st[i], share_st_c[i] = run_st, run_st_c
        if i + 1 == n:
            break
        e = values[i + 1] - values[i]
        dt = (times[i + 1] - t) / 1e9
        if count == 0:
            idle_parts.append(e)
            idle_s += dt
            if delta is not None:
                sens_w.append(0.0)
                sens_b.append(0.0)
                sens_e.append(0.0)
            continue
        busy_s += dt
        fixed = 0.0
        if positive and base_w:
            # The GPU's base power in a step: equally among the step pieces in flight (the
            # requests in the steps there), never more than the segment's energy.
            fixed = min(e, base_w * dt) if e > 0 else 0.0
            x = fixed / positive
            total = run_st + x
            run_st_c += (run_st - total) + x if abs(run_st) >= abs(x) else (x - total) + run_st
            run_st = total
            e -= fixed
        if delta is not None:
            if positive:
                sens_w.append(1.0 / weight)
                sens_b.append(1.0 / positive if fixed and e <= 0.0 else 0.0)
                sens_e.append(0.0)
            else:
                sens_w.append(0.0)
                sens_b.append(0.0)
                sens_e.append(1.0 / count)
        if positive:
            x = e / weight
            total = run + x
            run_c += (run - total) + x if abs(run) >= abs(x) else (x - total) + run
            run = total
        else:
            x = e / count
            total = run_eq + x
            run_eq_c += (run_eq - total) + x if abs(run_eq) >= abs(x) else (x - total) + run_eq
            run_eq = total
    pos = {t: i for i, t in enumerate(times)}
    var_w = var_e = share
    var_b: list[float] | None = None
    # With steps, a request's share per joule changes at every step's edges, its pieces'
    # changes cancelling (a request alone: its step piece's share ends where its equal one
    # resumes): its own share is walked segment by segment (as many as its pieces, in all).
    walk = delta is not None and bool(pieces)
    if delta is not None and not walk:
        var_w, var_e = _variation(delta, sens_w), _variation(delta, sens_e)
        if base_w:
            var_b = _variation(delta, sens_b)
    attributed: list[float] = []
    for s, per_request in zip(spans, phases, strict=True):
        r = requests[s.request_id]
        got: list[float] = []
        if walk:
            assert delta is not None
            r.error_j += _walked_error(per_request, pos, delta, sens_w, sens_b, sens_e)
        for name, a, b, w in per_request:
            ia, ib = pos[a], pos[b]
            if w > 0:
                part = w * ((share[ib] - share[ia]) + (share_c[ib] - share_c[ia]))
                if base_w:
                    part += (share_st[ib] - share_st[ia]) + (share_st_c[ib] - share_st_c[ia])
                if delta is not None and not walk:
                    r.error_j += w * (
                        sens_w[ia] * delta[ia] + sens_w[ib - 1] * delta[ib]
                        + var_w[ib - 1] - var_w[ia]
                    )  # fmt: skip
                    if var_b is not None:
                        r.error_j += (
                            sens_b[ia] * delta[ia] + sens_b[ib - 1] * delta[ib]
                            + var_b[ib - 1] - var_b[ia]
                        )  # fmt: skip
            else:
                part = (share_eq[ib] - share_eq[ia]) + (share_eq_c[ib] - share_eq_c[ia])
                if delta is not None and not walk:
                    r.error_j += (
                        sens_e[ia] * delta[ia] + sens_e[ib - 1] * delta[ib]
                        + var_e[ib - 1] - var_e[ia]
                    )  # fmt: skip
            got.append(part)
            if name == "prefill":
                r.prefill_j = (r.prefill_j or 0.0) + part
            elif name == "decode":
                r.decode_j = (r.decode_j or 0.0) + part
        # (of one or two parts, the plain sum is fsum's correctly rounded one, faster)
        mine = got[0] + got[1] if len(got) == 2 else fsum(got)
        r.gpu_energy_j[gpu] = mine
        attributed.append(mine)
    parts = [values[i + 1] - values[i] for i in range(n - 1)]
    return GpuAttribution(
        gpu=gpu,
        energy_j=math.fsum(parts),
        requests_j=math.fsum(attributed),
        idle_j=math.fsum(idle_parts),
        busy_s=busy_s,
        idle_s=idle_s,
    )


def _walked_error(
    phases: Sequence[tuple[str, int, int, float]],
    pos: Mapping[int, int],
    delta: Sequence[float],
    sens_w: Sequence[float],
    sens_b: Sequence[float],
    sens_e: Sequence[float],
) -> float:
    """One request's ``sum_k delta_k |s_k - s_k-1|`` over its segments, its share per joule
    ``s_k`` summed over its pieces there (0 outside it)."""
    spans = [(pos[a], pos[b], w) for _, a, b, w in phases]
    lo = min(ia for ia, _, _ in spans)
    hi = max(ib for _, ib, _ in spans)
    m = hi - lo
    weight = [0.0] * m
    steps = [0] * m
    equal = [0] * m
    for ia, ib, w in spans:
        if w > 0:
            for k in range(ia - lo, ib - lo):
                weight[k] += w
                steps[k] += 1
        else:
            for k in range(ia - lo, ib - lo):
                equal[k] += 1
    error = 0.0
    prev = 0.0
    for k in range(m):
        i = lo + k
        cur = weight[k] * sens_w[i] + steps[k] * sens_b[i] + equal[k] * sens_e[i]
        if cur != prev:
            error += delta[i] * abs(cur - prev)
            prev = cur
    return error + delta[hi] * abs(prev)


def _variation(delta: Sequence[float], sens: Sequence[float]) -> list[float]:
    """``out[k]``: the sum over ``1 <= j <= k`` of ``delta[j] * |sens[j] - sens[j - 1]|``."""
    out = [0.0] * len(sens)
    acc = 0.0
    prev = sens[0] if sens else 0.0
    for j in range(1, len(sens)):
        cur = sens[j]
        if cur != prev:
            acc += delta[j] * abs(cur - prev)
            prev = cur
        out[j] = acc
    return out


def requests_total(result: Attribution, gpu: int) -> float:
    """The energy attributed to requests on ``gpu`` (for checks)."""
    return math.fsum(r.gpu_energy_j.get(gpu, 0.0) for r in result.requests.values())
