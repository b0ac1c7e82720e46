"""Requests in flight settled in pieces (issue 38: a request that never ends holds nothing
back): with the ``equal`` and ``steps`` policies a request's weights do not depend on its
end, so each settle attributes a request in flight up to its horizon and the others settle
on time; the request's result, returned once when it ends (or expires), is what one settle
after its end gives. With ``tokens`` it still holds the horizon at its begin. Fake clocks,
readings with an exact counter, all in before the first settle (the horizon follows the
clock, ``max_edge_delay_s`` behind it): the energy estimator's revisions as readings come
(~1e-5, :mod:`zeus_async.aggregate.history`) are not this file's subject, the pieces are."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from zeus_async.events import GpuSample
from zeus_async.inference import RequestMeter

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def power_at(t: int) -> float:
    """Steps every 100 ms between 150 and 600 W (never below the steps' base power)."""
    return 150.0 + 450.0 * (((t - T0) // (100 * MS)) % 2)


class Feed:
    """Readings every 10 ms from a second before T0 (the power constant between two), with
    an exact energy counter, into several meters."""

    def __init__(self, *meters: RequestMeter) -> None:
        self.meters = meters
        self.next = T0 - 1000 * MS
        self.joules = 0.0

    def to(self, t: int) -> None:
        while self.next <= t:
            p = power_at(self.next)
            s = GpuSample("h", self.next, 0, power_w=p, energy_j=self.joules)
            self.joules += p * 0.01
            for m in self.meters:
                m.add(s)
            self.next += 10 * MS


@dataclass
class Run:
    live: RequestMeter  # settled every 100 ms
    once: RequestMeter  # settled once, at the end
    settled_at: dict[str, int] = field(default_factory=dict)
    ends: dict[str, int] = field(default_factory=dict)
    short: int = 0


def run(
    policy: str, *, long_ends_at: int | None, decode_at: int | None, max_age_s: float = 600.0
) -> Run:
    """ "long" begins at 60 ms (its decode mark at ``decode_at``, its end at ``long_ends_at``,
    ``None``: never); a 10 ms request every 20 ms from 100 ms to 3 s; with ``steps``, a step
    every 10 ms over the requests in flight (long's weight 3, the other's 1). The same edges
    into a meter settled every 100 ms and one settled only at the end."""
    clock = Clock()
    kw = {
        "gpus": [0],
        "clock": clock,
        "lag_s": 0.02,
        "max_edge_delay_s": 0.02,
        "max_age_s": max_age_s,
    }
    live = RequestMeter(policy, step_base_w=50.0, **kw)  # type: ignore[arg-type]
    once = RequestMeter(policy, step_base_w=50.0, **kw)  # type: ignore[arg-type]
    out = Run(live, once)
    Feed(live, once).to(T0 + 3300 * MS)
    clock.now = T0 + 60 * MS
    both = (live, once)
    for m in both:
        m.begin("long", at_ns=T0 + 60 * MS)
    long_open = True
    t = T0 + 100 * MS
    while t < T0 + 3000 * MS:
        rid = f"r{out.short}"
        out.short += 1
        for m in both:
            m.begin(rid, at_ns=t)
            if decode_at is not None and t <= decode_at < t + 20 * MS:
                m.phase("long", at_ns=decode_at)
            if long_ends_at is not None and t <= long_ends_at < t + 20 * MS:
                m.end("long", tokens_out=7, at_ns=long_ends_at)
                long_open = False
            if policy == "steps":
                for a in (t, t + 10 * MS):
                    batch = [(rid, 0, 1, 10)] if a == t else []
                    if long_open:
                        batch.append(("long", 0, 3, 10))
                    m.step(batch, start_ns=a, end_ns=a + 10 * MS, gpus=(0,))
            m.end(rid, tokens_in=5, tokens_out=5, at_ns=t + 10 * MS)
        out.ends[rid] = t + 10 * MS
        t += 20 * MS
        clock.now = t
        if out.short % 5 == 0:  # every 100 ms
            for r in live.settle():
                out.settled_at[r.request_id] = t
    clock.now = T0 + 3200 * MS
    for r in live.settle_all():
        out.settled_at[r.request_id] = clock.now
    once.settle_all()
    return out


def same(a: RequestMeter, b: RequestMeter) -> None:
    """Every request's figures in ``a`` are ``b``'s (to 1e-9), and both conserve."""
    got = {r.request_id: r for r in a.results()}
    want = {r.request_id: r for r in b.results()}
    assert got.keys() == want.keys()
    for rid, r in want.items():
        g = got[rid]
        assert g.energy_j == pytest.approx(r.energy_j, rel=1e-9, abs=1e-9), rid
        for x, y in ((g.prefill_j, r.prefill_j), (g.decode_j, r.decode_j)):
            assert (x is None) == (y is None), rid
            if x is not None:
                assert x == pytest.approx(y, rel=1e-9, abs=1e-9), rid
        assert (g.begin_ns, g.end_ns, g.decode_ns, g.finish_reason) == (
            r.begin_ns,
            r.end_ns,
            r.decode_ns,
            r.finish_reason,
        )
    for m in (a, b):
        t = m.totals
        assert t.requests_j[0] + t.idle_j[0] == pytest.approx(t.energy_j[0], rel=1e-12)
    assert a.totals.energy_j[0] == pytest.approx(b.totals.energy_j[0], rel=1e-12)


@pytest.mark.parametrize("policy", ["equal", "steps"])
def test_a_long_request_in_flight_delays_no_other(policy: str) -> None:
    out = run(policy, long_ends_at=T0 + 2505 * MS, decode_at=T0 + 777 * MS)
    live = out.live
    assert live.totals.bad_input == {}
    for rid, end in out.ends.items():
        # one settle period (100 ms) plus the delay (20 ms), whatever "long" does
        assert out.settled_at[rid] - end <= 120 * MS or end > T0 + 2900 * MS, rid
    assert T0 + 2505 * MS <= out.settled_at["long"] <= T0 + 2505 * MS + 120 * MS
    (long,) = [r for r in live.results() if r.request_id == "long"]
    assert long.finish_reason == "completed" and long.tokens_out == 7
    assert long.prefill_j is not None and long.decode_j is not None
    assert long.prefill_j > 0 and long.decode_j > 0
    assert long.prefill_j + long.decode_j == pytest.approx(long.energy_j, rel=1e-12)
    # Returned once, whole: what one settle after its end gives (and the others likewise).
    assert sum(r.request_id == "long" for r in live.results()) == 1
    same(live, out.once)


@pytest.mark.parametrize("policy", ["equal", "steps"])
def test_a_request_in_flight_without_a_decode_mark_has_no_phases(policy: str) -> None:
    out = run(policy, long_ends_at=T0 + 1505 * MS, decode_at=None)
    long = out.live.settled("long")
    assert long is not None and long.decode_ns is None
    assert long.prefill_j is None and long.decode_j is None
    same(out.live, out.once)


@pytest.mark.parametrize("policy", ["equal", "steps"])
def test_a_request_never_ended_expires_unfinished_with_the_same_energy(policy: str) -> None:
    out = run(policy, long_ends_at=None, decode_at=T0 + 300 * MS, max_age_s=2.0)
    live = out.live
    for rid, end in out.ends.items():
        # not held until its expiry
        assert out.settled_at[rid] - end <= 120 * MS or end > T0 + 2900 * MS, rid
    long = live.settled("long")
    assert long is not None and long.finish_reason == "unfinished"
    assert (long.begin_ns, long.end_ns) == (T0 + 60 * MS, T0 + 2060 * MS)
    # settled at the first settle after it expired (the clock past 2.06 s), not before
    assert T0 + 2060 * MS <= out.settled_at["long"] <= T0 + 2060 * MS + 100 * MS
    assert live.totals.finished == {"completed": out.short, "unfinished": 1}
    same(live, out.once)


def test_with_tokens_a_request_in_flight_still_holds_the_others() -> None:
    out = run("tokens", long_ends_at=T0 + 2505 * MS, decode_at=T0 + 777 * MS)
    # Every request that ended after long began waited for long's end.
    for rid in out.ends:
        assert out.settled_at[rid] >= T0 + 2505 * MS, rid
    assert out.live.state.in_flight == 0
    long = out.live.settled("long")
    assert long is not None and long.finish_reason == "completed"


def test_discarding_a_request_settled_in_part_keeps_its_energy_not_its_result() -> None:
    clock = Clock()
    meter = RequestMeter("equal", gpus=[0], clock=clock, lag_s=0.0)
    feed = Feed(meter)
    feed.to(T0)
    meter.begin("gone", at_ns=T0 + 10 * MS)
    clock.now = T0 + 500 * MS
    feed.to(clock.now)
    assert meter.settle() == []
    assert meter.state.settled_ns == T0 + 500 * MS  # settled past it: it holds nothing
    meter.discard("gone")
    clock.now = T0 + 800 * MS
    feed.to(clock.now)
    assert meter.settle() == [] and meter.settled("gone") is None
    t = meter.totals
    assert t.requests == 0 and t.requests_j[0] > 0  # its pieces' energy stays settled
    assert t.requests_j[0] + t.idle_j[0] == pytest.approx(t.energy_j[0], rel=1e-12)
    assert meter._partial == {}


def test_the_agent_flags_reach_the_node_attributors_meter() -> None:
    """``--requests-edge-delay`` and ``--requests-step-base`` set ``AgentConfig``'s fields,
    which the node's request attributor passes to its meter."""
    from types import SimpleNamespace
    from typing import Any

    from zeus_async.agent.protocol import AgentConfig
    from zeus_async.agent.requests import NodeRequests
    from zeus_async.cli import build_parser

    args = build_parser().parse_args(
        ["agent", "--requests-policy", "steps", "--requests-edge-delay", "0.3",
         "--requests-step-base", "42.5"]
    )  # fmt: skip
    assert (args.requests_edge_delay, args.requests_step_base) == (0.3, 42.5)
    default = build_parser().parse_args(["agent"])
    assert (default.requests_edge_delay, default.requests_step_base) == (1.0, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["agent", "--requests-step-base", "-1"])

    started: list[Any] = []
    rt: Any = SimpleNamespace(
        tracker=None, host="h", start_consumer=lambda *a, **k: started.append(a)
    )
    cfg = AgentConfig(
        "ipc:///nowhere",
        requests_policy="steps",
        requests_edge_delay_s=0.3,
        requests_step_base_w=42.5,
    )
    meter = NodeRequests(cfg, rt, lambda ident, reply: None, {})._ensure()
    assert meter.policy == "steps" and meter._delay_ns == 300_000_000
    assert meter.base_power_w(0) == meter.base_power_w(3) == 42.5 and started
    estimated = NodeRequests(
        AgentConfig("ipc:///nowhere", requests_policy="steps"), rt, lambda i, r: None, {}
    )
    assert estimated._ensure()._base_given is None
