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
from typing import TYPE_CHECKING, Final, Literal

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..carbon import Footprint

__all__ = [
    "POLICIES",
    "Attribution",
    "GpuAttribution",
    "RequestEnergy",
    "RequestSpan",
    "attribute",
]

logger = logging.getLogger(__name__)

Policy = Literal["equal", "tokens"]

#: The split policies (see the module docstring).
POLICIES: Final = ("equal", "tokens")

#: ``energy(gpu, t0_ns, t1_ns)``: joules GPU ``gpu`` drew over ``[t0_ns, t1_ns]``.
EnergyFn = Callable[[int, int, int], float]

#: ``cumulative(gpu, times)``: joules GPU ``gpu`` drew from ``times[0]`` to each of ``times``
#: (sorted); the faster form, one pass per GPU (``DeviceHistory.cumulative``).
CumulativeFn = Callable[[int, Sequence[int]], Sequence[float]]


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
        policy: ``"equal"`` or ``"tokens"``.
        method: The energy estimator's method (per GPU, or one for all), for the requests'
            ``method``.

    Raises:
        ConfigError: An unknown policy, a request outside the interval, or two requests with
            one id.
    """
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
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
    for s in spans:
        phased = s.decode_ns is not None
        result.requests[s.request_id] = RequestEnergy(
            request_id=s.request_id,
            energy_j=0.0,
            gpu_energy_j={},
            prefill_j=0.0 if phased else None,
            decode_j=0.0 if phased else None,
            tokens_in=s.tokens_in,
            tokens_out=s.tokens_out,
            time_s=(s.end_ns - s.begin_ns) / 1e9,
            method="",
            begin_ns=s.begin_ns,
            end_ns=s.end_ns,
            decode_ns=s.decode_ns,
        )
    for gpu in all_gpus:
        on_gpu = [s for s in spans if gpu in s.gpus]
        result.gpus[gpu] = _attribute_gpu(
            gpu, on_gpu, cumulative, start_ns, end_ns, policy, result.requests
        )
        # (read after the GPU's energy was asked for: a caller may learn it from that)
        gpu_method = method if isinstance(method, str) else method.get(gpu, "")
        for s in on_gpu:
            r = result.requests[s.request_id]
            r.method = f"{policy} share of {gpu_method}" if gpu_method else f"{policy} share"
    for r in result.requests.values():
        r.energy_j = math.fsum(r.gpu_energy_j.values())
    return result


def _weights(
    spans: Sequence[RequestSpan], policy: Policy
) -> list[list[tuple[str, int, int, float]]]:
    """Per request, its phases with their weight (token rate, or 1)."""
    out = []
    for s in spans:
        phases = []
        for name, a, b, tokens in s.phases():
            w = 1.0 if policy == "equal" else tokens / ((b - a) / 1e9)
            phases.append((name, a, b, w))
        out.append(phases)
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
) -> GpuAttribution:
    phases = _weights(spans, policy)
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
    idle_parts: list[float] = []
    idle_s = busy_s = 0.0
    values = cumulative(gpu, times)
    fsum = math.fsum
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
        if i + 1 == n:
            break
        e = values[i + 1] - values[i]
        dt = (times[i + 1] - t) / 1e9
        if count == 0:
            idle_parts.append(e)
            idle_s += dt
            continue
        busy_s += dt
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
    attributed: list[float] = []
    for s, per_request in zip(spans, phases, strict=True):
        r = requests[s.request_id]
        got: list[float] = []
        for name, a, b, w in per_request:
            ia, ib = pos[a], pos[b]
            if w > 0:
                part = w * ((share[ib] - share[ia]) + (share_c[ib] - share_c[ia]))
            else:
                part = (share_eq[ib] - share_eq[ia]) + (share_eq_c[ib] - share_eq_c[ia])
            got.append(part)
            if name == "prefill":
                r.prefill_j = (r.prefill_j or 0.0) + part
            elif name == "decode":
                r.decode_j = (r.decode_j or 0.0) + part
        r.gpu_energy_j[gpu] = fsum(got)
        attributed.append(r.gpu_energy_j[gpu])
    parts = [values[i + 1] - values[i] for i in range(n - 1)]
    return GpuAttribution(
        gpu=gpu,
        energy_j=math.fsum(parts),
        requests_j=math.fsum(attributed),
        idle_j=math.fsum(idle_parts),
        busy_s=busy_s,
        idle_s=idle_s,
    )


def requests_total(result: Attribution, gpu: int) -> float:
    """The energy attributed to requests on ``gpu`` (for checks)."""
    return math.fsum(r.gpu_energy_j.get(gpu, 0.0) for r in result.requests.values())
