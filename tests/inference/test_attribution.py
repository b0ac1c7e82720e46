"""Attribution of GPU energy to requests: each policy against hand-computed cases, conservation
under random overlapping requests (hypothesis), and against a simulated ground truth where
each request's own power is known."""

from __future__ import annotations

import bisect
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeus_async.errors import ConfigError
from zeus_async.inference import RequestSpan, attribute

S = 1_000_000_000  # ns per second


def constant(power_w: dict[int, float]):  # type: ignore[no-untyped-def]
    """``energy(gpu, t0, t1)`` of GPUs drawing constant power."""
    return lambda gpu, a, b: power_w[gpu] * (b - a) / S


def piecewise(levels: list[tuple[int, float]]):  # type: ignore[no-untyped-def]
    """``energy`` of GPU 0 drawing ``levels[i][1]`` W from ``levels[i][0]`` ns on (0 before):
    the difference of an exact cumulative integral, as a counter gives."""
    starts = [t for t, _ in levels]
    cum = [0.0]
    for i in range(len(levels) - 1):
        cum.append(cum[-1] + levels[i][1] * (levels[i + 1][0] - levels[i][0]) / S)

    def at(t: int) -> float:
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            return 0.0
        return cum[i] + levels[i][1] * (t - starts[i]) / S

    return lambda gpu, a, b: at(b) - at(a)


def test_equal_shares_by_hand() -> None:
    # GPU 0 at 100 W. A: 0-2 s; B: 1-3 s; idle 3-4 s.
    # 0-1 s: A alone, 100 J. 1-2 s: A and B, 50 J each. 2-3 s: B alone, 100 J. 3-4 s: idle.
    spans = [RequestSpan("A", (0,), 0, 2 * S), RequestSpan("B", (0,), 1 * S, 3 * S)]
    out = attribute(spans, constant({0: 100.0}), start_ns=0, end_ns=4 * S)
    assert out.requests["A"].energy_j == pytest.approx(150.0)
    assert out.requests["B"].energy_j == pytest.approx(150.0)
    g = out.gpus[0]
    assert (g.energy_j, g.idle_j) == (pytest.approx(400.0), pytest.approx(100.0))
    assert g.requests_j == pytest.approx(300.0) and g.busy_s == 3.0 and g.idle_s == 1.0
    assert out.requests["A"].method == "equal share"


def test_token_weighted_shares_within_phases_by_hand() -> None:
    # GPU 0 at 200 W over 0-4 s.
    # A: prefill 0-1 s (100 prompt tokens: 100 tok/s), decode 1-4 s (30 tokens: 10 tok/s).
    # B: prefill 2-3 s (400 tokens: 400 tok/s), decode 3-4 s (10 tokens: 10 tok/s).
    spans = [
        RequestSpan("A", (0,), 0, 4 * S, decode_ns=1 * S, tokens_in=100, tokens_out=30),
        RequestSpan("B", (0,), 2 * S, 4 * S, decode_ns=3 * S, tokens_in=400, tokens_out=10),
    ]
    out = attribute(spans, constant({0: 200.0}), policy="tokens")
    a, b = out.requests["A"], out.requests["B"]
    # 0-1: A prefill alone, 200 J to A. 1-2: A decode alone, 200 J to A.
    # 2-3: A decode (10) + B prefill (400): A 200*10/410, B 200*400/410.
    # 3-4: both decode at 10 tok/s: 100 J each.
    assert a.prefill_j == pytest.approx(200.0)
    assert a.decode_j == pytest.approx(200.0 + 200 * 10 / 410 + 100.0)
    assert b.prefill_j == pytest.approx(200 * 400 / 410)
    assert b.decode_j == pytest.approx(100.0)
    assert a.energy_j + b.energy_j == pytest.approx(800.0)
    assert a.j_per_output_token == pytest.approx(a.energy_j / 30)
    # The same requests in equal shares: 2-3 s is split half and half.
    eq = attribute(spans, constant({0: 200.0}), policy="equal")
    assert eq.requests["B"].prefill_j == pytest.approx(100.0)


def test_requests_without_tokens_share_equally_and_gpus_are_separate() -> None:
    spans = [
        RequestSpan("A", (0, 1), 0, 2 * S),  # tensor parallel on two GPUs
        RequestSpan("B", (1,), 0, 2 * S),
    ]
    out = attribute(spans, constant({0: 100.0, 1: 300.0}), policy="tokens")
    assert out.requests["A"].gpu_energy_j == {0: pytest.approx(200.0), 1: pytest.approx(300.0)}
    assert out.requests["B"].gpu_energy_j == {1: pytest.approx(300.0)}
    assert out.requests["A"].energy_j == pytest.approx(500.0)
    assert out.requests["A"].prefill_j is None  # phases were not marked


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="ends before it begins"):
        RequestSpan("A", (0,), 5, 4)
    with pytest.raises(ConfigError, match="decode mark is outside"):
        RequestSpan("A", (0,), 0, 4, decode_ns=9)
    with pytest.raises(ConfigError, match="names no GPU"):
        RequestSpan("A", (), 0, 4)
    spans = [RequestSpan("A", (0,), 0, S), RequestSpan("A", (0,), 0, S)]
    with pytest.raises(ConfigError, match="share an id"):
        attribute(spans, constant({0: 1.0}))
    with pytest.raises(ConfigError, match="policy must be one of equal, tokens"):
        attribute([], constant({0: 1.0}), policy="fair")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="outside the interval"):
        attribute([RequestSpan("A", (0,), 0, 2 * S)], constant({0: 1.0}), end_ns=S)


request = st.builds(
    lambda gpu, begin, length, split, tin, tout: (gpu, begin, length, split, tin, tout),
    st.integers(0, 2),
    st.integers(0, 10 * S),
    st.integers(0, 3 * S),
    st.one_of(st.none(), st.floats(0.0, 1.0)),
    st.integers(0, 2000),
    st.integers(0, 500),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(request, max_size=40), st.sampled_from(["equal", "tokens"]))
def test_conservation_to_the_joule(
    raw: list[tuple[int, int, int, float | None, int, int]], policy: str
) -> None:
    """Every joule of every GPU goes to a request or to idle, whatever the overlap."""
    spans = []
    for i, (gpu, begin, length, split, tin, tout) in enumerate(raw):
        decode = None if split is None else begin + round(length * split)
        spans.append(RequestSpan(f"r{i}", (gpu,), begin, begin + length, decode, tin, tout))
    levels = [(k * S // 3, 70.0 + (k * 137) % 630) for k in range(0, 60)]
    energy = piecewise(levels)
    out = attribute(
        spans,
        lambda g, a, b: energy(0, a, b) * (1 + g),
        start_ns=0,
        end_ns=14 * S,
        gpus=[0, 1, 2],
        policy=policy,  # type: ignore[arg-type]
    )
    for gpu, g in out.gpus.items():
        measured = energy(0, 0, 14 * S) * (1 + gpu)
        assert g.energy_j == pytest.approx(measured, rel=1e-12)
        # requests + idle = measured: to a nanojoule per joule (the rounding of the shares)
        assert abs(g.imbalance_j) <= 1e-9 * g.energy_j + 1e-9, g
        per_request = math.fsum(r.gpu_energy_j.get(gpu, 0.0) for r in out.requests.values())
        assert per_request == pytest.approx(g.requests_j, rel=1e-9, abs=1e-9)
    for r in out.requests.values():
        assert r.energy_j >= -1e-9
        if r.prefill_j is not None and r.decode_j is not None:
            assert r.prefill_j + r.decode_j == pytest.approx(r.energy_j, abs=1e-6)


def test_against_a_ground_truth_where_each_request_power_is_known() -> None:
    """A GPU draws each request's own (known, different) power while it is in flight, and its
    idle power only when none is. The token policy, fed token rates proportional to those
    powers, recovers each request's own energy; equal shares are off by the imbalance."""
    idle_w = 70.0
    reqs = [  # (begin s, end s, own W)
        (0.0, 4.0, 300.0),
        (1.0, 2.5, 100.0),
        (2.0, 6.0, 200.0),
        (5.0, 7.0, 50.0),
    ]
    spans = [
        RequestSpan(f"r{i}", (0,), round(a * S), round(b * S), tokens_in=0, tokens_out=0)
        for i, (a, b, _) in enumerate(reqs)
    ]

    def energy(gpu: int, t0: int, t1: int) -> float:
        total = 0.0
        for a, b, w in reqs:
            lo, hi = max(t0, round(a * S)), min(t1, round(b * S))
            if hi > lo:
                total += w * (hi - lo) / S
        lo, hi = max(t0, 7 * S), min(t1, 8 * S)  # nothing in flight from 7 s on
        return total + idle_w * max(hi - lo, 0) / S

    # Token rate proportional to the request's own power: tokens = W x duration.
    weighted = [
        RequestSpan(s.request_id, s.gpus, s.begin_ns, s.end_ns, tokens_in=round(w * (b - a)))
        for s, (a, b, w) in zip(spans, reqs, strict=True)
    ]
    tokens = attribute(weighted, energy, start_ns=0, end_ns=8 * S, policy="tokens")
    equal = attribute(spans, energy, start_ns=0, end_ns=8 * S, policy="equal")
    errors: dict[str, list[float]] = {"tokens": [], "equal": []}
    for i, (a, b, w) in enumerate(reqs):
        own = w * (b - a)
        errors["tokens"].append(abs(tokens.requests[f"r{i}"].energy_j - own))
        errors["equal"].append(abs(equal.requests[f"r{i}"].energy_j - own))
    assert max(errors["tokens"]) < 1e-6
    assert sum(errors["equal"]) > 100.0  # the 300 W request is undercharged, the 50 W one over
    for out in (tokens, equal):
        assert out.gpus[0].idle_j == pytest.approx(idle_w * 1.0)  # 7-8 s
