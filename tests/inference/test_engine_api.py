"""The engine-side API (issue 38, item 2): edges with explicit timestamps (``at_ns``) that may
come late and out of order within ``max_edge_delay_s``, the engine's clock mapped onto the
meter's (``ClockMap``), engine steps and the ``steps`` policy (with the default weight and a
custom one), and every request's ``error_j``. Fake clocks, readings every 10 ms."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from zeus_async.aggregate.history import DeviceHistory
from zeus_async.events import Event, GpuSample, RequestMeasurement
from zeus_async.inference import (
    ClockMap,
    RequestEnergy,
    RequestMeter,
    StepEntry,
    default_step_weight,
)
from zeus_async.inference.attribution import STEP_CONTEXT_SCALE
from zeus_async.inference.meter import BAD_INPUT_KINDS

MS = 1_000_000
#: The fake clocks' start (ns). Not an epoch time: the estimator's float instants resolve wall
#: ns since 1970 to 256 ns (a 1e-6 difference on a 100 ms window), and these tests compare
#: to 1e-12.
T0 = 1_000_000_000_000


class Clock:
    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def flat(t: int) -> float:
    return 300.0


def stepping(t: int) -> float:
    """Steps every 100 ms between 100 and 600 W (readings see each step)."""
    return 100.0 + 500.0 * (((t - T0) // (100 * MS)) % 2)


class Feed:
    """Readings every 10 ms from T0 - 1 s (power ``power(t)``, held to the next reading, and
    an exact energy counter at every reading) into meters and a reference history. (The
    second before T0 lets the estimator fit the counter's update grid: its estimates near the
    first readings move as more come, whoever settles them.)"""

    def __init__(self, power: Callable[[int], float], *meters: RequestMeter) -> None:
        self.power = power
        self.meters = meters
        self.reference = DeviceHistory("gpu:0")
        self.next = T0 - 1000 * MS
        self.joules = 0.0

    def to(self, t: int) -> None:
        while self.next <= t:
            p = self.power(self.next)
            s = GpuSample("h", self.next, 0, power_w=p, energy_j=self.joules)
            self.joules += p * 0.01
            for m in self.meters:
                m.add(s)
            self.reference.add(s.t_ns, s.power_w, s.energy_j)
            self.next += 10 * MS


def conserved(meter: RequestMeter) -> None:
    t = meter.totals
    for gpu, e in t.energy_j.items():
        assert t.requests_j[gpu] + t.idle_j[gpu] == pytest.approx(e, rel=1e-9, abs=1e-9)


def by_id(results: list[RequestEnergy]) -> dict[str, RequestEnergy]:
    return {r.request_id: r for r in results}


# -- explicit timestamps, late and out of order ---------------------------------------------


Edge = tuple[int, str, str, tuple[Any, ...]]


def workload(seed: int, n: int = 120) -> list[Edge]:
    """(t, kind, id, extra) of requests 20-200 ms long on GPU 0, with a decode mark, from
    T0 + 1 s on (the estimator's counter grid is fitted by then: its first estimates near
    the first readings move as readings come, whoever settles them), and engine steps (5 ms
    every 7 ms over the requests in flight)."""
    rng = random.Random(seed)
    edges: list[Edge] = []
    t = T0 + 1000 * MS
    spans = []
    for i in range(n):
        t += rng.randrange(1, 12) * MS + rng.randrange(1000)
        length = rng.randrange(20, 200) * MS
        rid = f"r{i}"
        spans.append((rid, t, t + length))
        edges.append((t, "begin", rid, ()))
        edges.append((t + length // 4, "phase", rid, ()))
        edges.append((t + length, "end", rid, (rng.randrange(1, 900), rng.randrange(1, 90))))
    s = T0 + 1000 * MS
    last = max(e for _, _, e in spans)
    while s < last:
        batch = [
            (rid, rng.randrange(0, 64) if s < b + (e - b) // 4 else 0, 1, rng.randrange(2000))
            for rid, b, e in spans
            if b <= s and e >= s + 5 * MS
        ]
        if batch:
            edges.append((s, "step", "", (s + 5 * MS, batch)))
        s += 7 * MS
    return edges


def give(meter: RequestMeter, edge: Edge) -> None:
    t, kind, rid, extra = edge
    if kind == "begin":
        meter.begin(rid, at_ns=t)
    elif kind == "phase":
        meter.phase(rid, at_ns=t)
    elif kind == "end":
        meter.end(rid, tokens_in=extra[0], tokens_out=extra[1], at_ns=t)
    else:
        meter.step(extra[1], start_ns=t, end_ns=extra[0])


@pytest.mark.parametrize("policy", ["tokens", "steps"])
def test_edges_out_of_order_within_the_delay_give_the_in_order_attribution(policy: str) -> None:
    edges = workload(1)
    end = max(t for t, *_ in edges) + 600 * MS
    in_order, late = Clock(), Clock()
    a = RequestMeter(policy, gpus=[0], clock=in_order, lag_s=0.1)  # type: ignore[arg-type]
    b = RequestMeter(policy, gpus=[0], clock=late, lag_s=0.1, max_edge_delay_s=0.5)  # type: ignore[arg-type]
    feed = Feed(stepping, a, b)
    # b gets each edge up to 400 ms after it happened, in arrival order: not in time order
    # (a request's own edges stay in their order: a begin, then its phase, then its end).
    rng = random.Random(5)
    arrivals = []
    done: dict[str, int] = {}
    for k, e in enumerate(edges):
        t_arrive = e[0] + rng.randrange(400) * MS
        t_arrive = max(t_arrive, done.get(e[2], 0)) if e[1] != "step" else t_arrive
        if e[1] != "step":
            done[e[2]] = t_arrive
        arrivals.append((t_arrive, k, e))
    arrivals.sort()
    assert [e for _, _, e in arrivals] != sorted(e for _, _, e in arrivals)  # out of order
    queue_a = sorted(edges)
    t = T0
    got_a: list[RequestEnergy] = []
    got_b: list[RequestEnergy] = []
    while t <= end:  # settles every 50 ms, readings up to now, edges as they come
        feed.to(t)
        in_order.now = late.now = t
        while queue_a and queue_a[0][0] <= t:
            give(a, queue_a.pop(0))
        while arrivals and arrivals[0][0] <= t:
            give(b, arrivals.pop(0)[2])
        got_a += a.settle_all()
        got_b += b.settle_all()
        t += 50 * MS
    in_order.now = late.now = end + 1000 * MS  # past the delay: b settles up to the readings
    got_a += a.settle_all()
    got_b += b.settle_all()
    assert a.state.settled_ns == b.state.settled_ns
    ra, rb = by_id(got_a), by_id(got_b)
    assert len(ra) == len(rb) == 120
    assert a.totals.bad_input == {} and b.totals.bad_input == {}
    for rid, x in ra.items():
        y = rb[rid]
        assert (y.begin_ns, y.decode_ns, y.end_ns) == (x.begin_ns, x.decode_ns, x.end_ns)
        assert y.energy_j == pytest.approx(x.energy_j, rel=1e-9)
        assert y.decode_j == pytest.approx(x.decode_j, rel=1e-9, abs=1e-9)
    for m in (a, b):
        conserved(m)
    assert b.totals.energy_j[0] == pytest.approx(a.totals.energy_j[0], rel=1e-12)


def test_bounded_settles_catch_up_on_edges_out_of_order() -> None:
    edges = [e for e in workload(2, n=60) if e[1] != "step"]
    rng = random.Random(9)
    # shuffled, each request's own edges still in their order
    order = sorted(range(len(edges)), key=lambda k: (rng.random(), k))
    by_request: dict[str, list[Edge]] = {}
    for e in edges:
        by_request.setdefault(e[2], []).append(e)
    shuffled = []
    for k in order:
        shuffled.append(by_request[edges[k][2]].pop(0))
    clock = Clock()
    small = RequestMeter(gpus=[0], clock=clock, lag_s=0.1, max_edge_delay_s=0.5, settle_batch=2)
    whole = RequestMeter(gpus=[0], clock=clock, lag_s=0.1, max_edge_delay_s=0.5)
    feed = Feed(stepping, small, whole)
    for e in shuffled:
        give(small, e)
    for e in edges:
        give(whole, e)
    feed.to(T0 + 3000 * MS)
    clock.now = T0 + 5000 * MS
    got, once = by_id(small.settle_all()), by_id(whole.settle_all())
    assert len(got) == len(once) == 60
    for rid, r in once.items():
        assert got[rid].energy_j == pytest.approx(r.energy_j, rel=1e-9)
    assert small.totals.bad_input == {}


def test_the_delay_holds_the_horizon_behind_now() -> None:
    clock = Clock()
    meter = RequestMeter(gpus=[0], clock=clock, lag_s=0.0, max_edge_delay_s=0.3)
    feed = Feed(flat, meter)
    feed.to(T0 + 1000 * MS)
    clock.now = T0 + 1000 * MS
    meter.settle_all()
    assert meter.state.settled_ns == T0 + 700 * MS


def test_a_late_edge_is_clipped_to_the_settled_horizon_and_counted() -> None:
    clock = Clock()
    meter = RequestMeter(gpus=[0], clock=clock, lag_s=0.0)
    feed = Feed(flat, meter)
    feed.to(T0 + 500 * MS)
    clock.now = T0 + 500 * MS
    meter.begin("a", at_ns=T0 + 100 * MS)
    meter.end("a", at_ns=T0 + 200 * MS)
    (a,) = meter.settle_all()
    assert a.energy_j == pytest.approx(30.0, rel=1e-12)
    settled = meter.state.settled_ns
    assert settled == T0 + 500 * MS
    meter.begin("b", at_ns=settled - 50 * MS)  # already settled: clipped
    meter.phase("b", at_ns=settled - 40 * MS)
    meter.end("b", at_ns=settled + 100 * MS)
    feed.to(T0 + 800 * MS)
    clock.now = T0 + 800 * MS
    (b,) = meter.settle_all()
    assert meter.totals.bad_input == {"late": 2}
    assert meter.totals.dropped_edges == 0
    assert (b.begin_ns, b.decode_ns, b.end_ns) == (settled, settled, settled + 100 * MS)
    assert b.energy_j == pytest.approx(30.0, rel=1e-12)
    assert meter.totals.energy_j[0] == pytest.approx(300.0 * 1.8, rel=1e-12)
    conserved(meter)


def test_a_timestamp_that_is_not_a_number_is_taken_as_now_and_counted() -> None:
    clock = Clock()
    meter = RequestMeter(gpus=[0], clock=clock, lag_s=0.0)
    feed = Feed(flat, meter)
    # a float: taken as it is (rounded)
    meter.begin("a", at_ns=float(T0 + 100 * MS))  # type: ignore[arg-type]
    meter.end("a", at_ns="soon")  # type: ignore[arg-type]
    clock.now = T0 + 300 * MS
    feed.to(T0 + 500 * MS)
    (a,) = meter.settle_all()
    assert meter.totals.bad_input == {"late": 1}
    assert (a.begin_ns, a.end_ns) == (T0 + 100 * MS, T0 + 300 * MS)


def test_bad_input_kinds_name_the_new_ones() -> None:
    assert "late" in BAD_INPUT_KINDS and "step" in BAD_INPUT_KINDS


# -- ClockMap ----------------------------------------------------------------------------------


class Clocks:
    """A true time (ns) that each read advances by the next of ``steps``; the wall clock
    reads it plus ``wall_off``, the engine's clock ``true + engine_off`` in ``unit`` units."""

    def __init__(self, steps: list[int], wall_off: int, engine_off: int, unit: float) -> None:
        self.true = 10**12
        self.steps = steps
        self.k = 0
        self.wall_off, self.engine_off, self.unit = wall_off, engine_off, unit

    def _tick(self) -> int:
        self.true += self.steps[self.k % len(self.steps)]
        self.k += 1
        return self.true

    def wall(self) -> int:
        return self._tick() + self.wall_off

    def engine(self) -> float:
        t = self._tick() + self.engine_off
        return t if self.unit == 1e-9 else t * 1e-9 / self.unit


def test_clock_map_keeps_the_tightest_bracket() -> None:
    # Samples (wall, engine, wall): the first three lopsided (1,000 ns before the engine's
    # read, 10 after: the midpoint 495 ns off), the fourth tight and even (20 and 20).
    steps = [7, 1000, 10] * 3 + [7, 20, 20] + [7, 1000, 10] * 3
    c = Clocks(steps, wall_off=T0, engine_off=-5 * 10**11, unit=1e-9)
    cm = ClockMap.of(c.engine, 1e-9, wall=c.wall, samples=7)
    assert cm.bracket_ns == 40
    assert cm.offset_ns == T0 + 5 * 10**11  # exact: the tight sample's midpoint
    assert cm.ns(123_456_789) == T0 + 5 * 10**11 + 123_456_789
    # The wall clock steps by 5 s (NTP): refresh() moves the offset with it.
    c.wall_off += 5_000_000_000
    assert cm.refresh() == 5_000_000_000
    assert cm.ns(0) == T0 + 5 * 10**11 + 5_000_000_000


def test_clock_map_of_seconds() -> None:
    c = Clocks([100, 50, 50], wall_off=T0, engine_off=-(10**12) + 3 * 10**9, unit=1.0)
    cm = ClockMap.of(c.engine, 1.0, wall=c.wall)
    # engine seconds = (true - 1e12 + 3e9) / 1e9: wall = engine * 1e9 + 1e12 - 3e9 + T0
    assert abs(cm.ns(3.5) - (T0 + 10**12 - 3 * 10**9 + 3_500_000_000)) <= 1
    assert cm.bracket_ns == 100


def test_clock_maps_of_the_process_clocks_agree_with_the_wall_clock() -> None:
    import time

    for cm, now in ((ClockMap.monotonic(), time.monotonic), (ClockMap.perf_counter(),
                    time.perf_counter)):  # fmt: skip
        assert abs(cm.ns(now()) - time.time_ns()) < 5 * MS


# -- steps -------------------------------------------------------------------------------------


def steps_meter(**kw: object) -> tuple[RequestMeter, Clock, Feed]:
    clock = Clock()
    meter = RequestMeter("steps", gpus=[0], clock=clock, lag_s=0.0, **kw)  # type: ignore[arg-type]
    return meter, clock, Feed(flat, meter)


def test_the_steps_policy_splits_a_step_by_the_default_weights_exactly() -> None:
    meter, clock, feed = steps_meter(step_base_w=0.0)  # (all of a step's power by weight)
    meter.begin("a", at_ns=T0 + 100 * MS)
    meter.begin("b", at_ns=T0 + 100 * MS)
    meter.step(
        [StepEntry("a", prefill_tokens=300), ("b", 100, 0, 0)],
        start_ns=T0 + 100 * MS,
        end_ns=T0 + 150 * MS,
    )
    meter.phase("a", at_ns=T0 + 150 * MS)
    meter.step(
        [StepEntry("a", decode_tokens=1, context_len=300), StepEntry("b", 0, 1, 100)],
        start_ns=T0 + 200 * MS,
        end_ns=T0 + 300 * MS,
    )
    meter.end("a", at_ns=T0 + 300 * MS)
    meter.end("b", at_ns=T0 + 300 * MS)
    meter.begin("c", at_ns=T0 + 400 * MS)  # alone, no steps: all its time's energy
    meter.end("c", at_ns=T0 + 500 * MS)
    feed.to(T0 + 1000 * MS)
    clock.now = T0 + 1000 * MS
    got = by_id(meter.settle_all())
    s = STEP_CONTEXT_SCALE
    wa1, wb1 = 300 * (1 + 150 / s), 100 * (1 + 50 / s)
    wa2, wb2 = 1 + 300 / s, 1 + 100 / s
    assert default_step_weight(StepEntry("a", 300)) == wa1
    step1, between, step2 = 15.0, 15.0, 30.0  # 300 W over 50, 50 and 100 ms
    a = got["a"]
    assert a.prefill_j == pytest.approx(step1 * wa1 / (wa1 + wb1), rel=1e-12)
    assert a.decode_j == pytest.approx(between / 2 + step2 * wa2 / (wa2 + wb2), rel=1e-12)
    assert got["b"].energy_j == pytest.approx(
        step1 * wb1 / (wa1 + wb1) + between / 2 + step2 * wb2 / (wa2 + wb2), rel=1e-12
    )
    assert got["c"].energy_j == pytest.approx(30.0, rel=1e-12)
    t = meter.totals
    assert t.idle_j[0] == pytest.approx(300.0 * 2 - 90.0, rel=1e-12)  # from T0 - 1 s
    assert t.bad_input == {}
    conserved(meter)
    assert "steps share" in a.method


def test_a_base_power_is_split_equally_in_steps() -> None:
    meter, clock, feed = steps_meter(step_base_w=100.0, step_weight=lambda e: e.prefill_tokens)
    for rid in ("a", "b", "c"):  # c is in flight, in no step
        meter.begin(rid, at_ns=T0 + 100 * MS)
    meter.step([("a", 3, 0, 0), ("b", 1, 0, 0)], start_ns=T0 + 100 * MS, end_ns=T0 + 150 * MS)
    for rid in ("a", "b", "c"):
        meter.end(rid, at_ns=T0 + 150 * MS)
    feed.to(T0 + 300 * MS)
    clock.now = T0 + 300 * MS
    got = by_id(meter.settle_all())
    # 15 J in the step: 100 W x 50 ms = 5 J equally among the step's requests (not c,
    # in flight but in no step), the other 10 J by weight 3:1
    assert got["a"].energy_j == pytest.approx(5 / 2 + 7.5, rel=1e-12)
    assert got["b"].energy_j == pytest.approx(5 / 2 + 2.5, rel=1e-12)
    assert got["c"].energy_j == 0.0
    conserved(meter)


def idle_then_busy(t: int) -> float:
    """100 W before T0 + 2 s (idle), 400 W after."""
    return 100.0 if t < T0 + 2000 * MS else 400.0


def test_the_base_power_is_estimated_from_idle_time_then_split_in_steps() -> None:
    meter, clock, feed = steps_meter(step_weight=lambda e: e.prefill_tokens)
    feed.power = idle_then_busy
    # Before any idle time is settled: the 5th lowest reading (all 100 W).
    feed.to(T0)
    meter.settle_all()
    assert meter.base_power_w(0) == 100.0
    meter.begin("x", at_ns=T0 + 1990 * MS)  # settles the 2.99 s idle before it
    feed.to(T0 + 2000 * MS)
    clock.now = T0 + 2000 * MS
    meter.settle_all()
    assert meter.totals.idle_s[0] == pytest.approx(2.99, rel=1e-9)
    # idle_j / idle_s (the estimator's figures near the first readings: within 0.1 %)
    assert meter.base_power_w(0) == pytest.approx(100.0, rel=1e-3)
    base = meter.base_power_w(0)
    for rid in ("a", "b", "c"):  # c in flight, in no step
        meter.begin(rid, at_ns=T0 + 2100 * MS)
    meter.step([("a", 3, 0, 0), ("b", 1, 0, 0)], start_ns=T0 + 2100 * MS, end_ns=T0 + 2200 * MS)
    for rid in ("a", "b", "c", "x"):
        meter.end(rid, at_ns=T0 + 2200 * MS)
    feed.to(T0 + 2500 * MS)
    clock.now = T0 + 2500 * MS
    got = by_id(meter.settle_all())
    # The step: 40 J; 100 W x 100 ms = 10 J equally between a and b, 30 J by weight 3:1.
    fixed = base * 0.1
    assert got["a"].energy_j == pytest.approx(fixed / 2 + (40 - fixed) * 3 / 4, rel=1e-9)
    assert got["b"].energy_j == pytest.approx(fixed / 2 + (40 - fixed) / 4, rel=1e-9)
    assert got["c"].energy_j == 0.0
    conserved(meter)


def test_a_given_base_power_overrides_per_gpu_and_never_exceeds_the_step() -> None:
    meter, clock, feed = steps_meter(step_weight=lambda e: e.prefill_tokens, step_base_w={0: 1e4})
    assert meter.base_power_w(0) == 1e4 and meter.base_power_w(1) == 0.0
    for rid in ("a", "b"):
        meter.begin(rid, at_ns=T0 + 100 * MS)
    meter.step([("a", 3, 0, 0), ("b", 1, 0, 0)], start_ns=T0 + 100 * MS, end_ns=T0 + 200 * MS)
    for rid in ("a", "b"):
        meter.end(rid, at_ns=T0 + 200 * MS)
    feed.to(T0 + 300 * MS)
    clock.now = T0 + 300 * MS
    got = by_id(meter.settle_all())
    # 10 kW of base > the step's 300 W: all of its 30 J equally, none negative
    assert got["a"].energy_j == pytest.approx(15.0, rel=1e-12)
    assert got["b"].energy_j == pytest.approx(15.0, rel=1e-12)
    conserved(meter)


def test_overlapping_steps_weigh_per_second_of_each_step() -> None:
    # Two engines on GPU 0: a's step lasts 100 ms, b's 50 ms, the same tokens each: per
    # second, b's engine works twice as hard where they overlap.
    meter, clock, feed = steps_meter(step_weight=lambda e: e.prefill_tokens, step_base_w=0.0)
    for rid in ("a", "b"):
        meter.begin(rid, at_ns=T0 + 100 * MS)
    meter.step([("a", 10, 0, 0)], start_ns=T0 + 100 * MS, end_ns=T0 + 200 * MS)
    meter.step([("b", 10, 0, 0)], start_ns=T0 + 100 * MS, end_ns=T0 + 150 * MS)
    for rid in ("a", "b"):
        meter.end(rid, at_ns=T0 + 200 * MS)
    feed.to(T0 + 300 * MS)
    clock.now = T0 + 300 * MS
    got = by_id(meter.settle_all())
    # 15 J over the overlap, 1:2; the 15 J after it all a's
    assert got["a"].energy_j == pytest.approx(5.0 + 15.0, rel=1e-12)
    assert got["b"].energy_j == pytest.approx(10.0, rel=1e-12)
    conserved(meter)


def test_a_custom_weight_function_is_used() -> None:
    seen: list[StepEntry] = []

    def weight(e: StepEntry) -> float:
        seen.append(e)
        return float(e.context_len)

    meter, clock, feed = steps_meter(step_weight=weight, step_base_w=0.0)
    for rid in ("a", "b", "z"):
        meter.begin(rid, at_ns=T0 + 100 * MS)
    meter.step([("a", 0, 1, 3), ("b", 0, 1, 1), ("z", 0, 1, 0)], start_ns=T0 + 100 * MS,
               end_ns=T0 + 200 * MS)  # fmt: skip
    for rid in ("a", "b", "z"):
        meter.end(rid, at_ns=T0 + 200 * MS)
    feed.to(T0 + 300 * MS)
    clock.now = T0 + 300 * MS
    got = by_id(meter.settle_all())
    assert seen == [StepEntry("a", 0, 1, 3), StepEntry("b", 0, 1, 1), StepEntry("z", 0, 1, 0)]
    assert all(type(e) is StepEntry for e in seen)
    assert got["a"].energy_j == pytest.approx(30.0 * 3 / 4, rel=1e-12)
    assert got["b"].energy_j == pytest.approx(30.0 / 4, rel=1e-12)
    assert got["z"].energy_j == 0.0  # weight 0 in the only step, and no time between steps


def test_between_steps_equal_and_a_step_without_usable_entries_is_as_between() -> None:
    meter, clock, feed = steps_meter()
    meter.begin("a", at_ns=T0 + 100 * MS)
    meter.begin("b", at_ns=T0 + 100 * MS)
    # weights 0 (no tokens) and an id never begun: the step is split as between steps
    meter.step([("a", 0, 0, 0), ("ghost", 0, 1, 0)], start_ns=T0 + 120 * MS,
               end_ns=T0 + 140 * MS)  # fmt: skip
    meter.step([("a", 0, 1, 0)], start_ns=T0 + 140 * MS, end_ns=T0 + 160 * MS)
    meter.end("a", at_ns=T0 + 200 * MS)
    meter.end("b", at_ns=T0 + 200 * MS)
    feed.to(T0 + 300 * MS)
    clock.now = T0 + 300 * MS
    got = by_id(meter.settle_all())
    # 100 ms in flight together = 30 J: 20 ms of it a's alone (its step), 80 ms halved.
    assert got["a"].energy_j == pytest.approx(6.0 + 12.0, rel=1e-12)
    assert got["b"].energy_j == pytest.approx(12.0, rel=1e-12)
    assert meter.totals.bad_input == {"unknown_id": 1}


def test_other_policies_ignore_steps() -> None:
    results = []
    for with_steps in (False, True):
        clock = Clock()
        meter = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0)
        feed = Feed(stepping, meter)
        meter.begin("a", at_ns=T0 + 90 * MS)
        meter.begin("b", at_ns=T0 + 120 * MS)
        if with_steps:
            meter.step([("a", 5, 0, 0)], start_ns=T0 + 95 * MS, end_ns=T0 + 130 * MS)
        meter.end("a", tokens_in=10, tokens_out=4, at_ns=T0 + 250 * MS)
        meter.end("b", tokens_in=30, tokens_out=1, at_ns=T0 + 260 * MS)
        feed.to(T0 + 400 * MS)
        clock.now = T0 + 400 * MS
        results.append({r.request_id: r.energy_j for r in meter.settle_all()})
    assert results[0] == results[1]


def random_engine(seed: int, meters: list[RequestMeter], end_ms: int) -> None:
    """Requests with engine steps of 4 ms every 5 ms (the batch: those in flight in it, some
    beginning or ending inside it), on GPUs 0 and 1 (some tensor parallel), given with at_ns
    at once."""
    rng = random.Random(seed)
    spans = []
    t = T0 + 50 * MS
    i = 0
    while t < T0 + (end_ms - 300) * MS:
        t += rng.randrange(2, 20) * MS + rng.randrange(MS)
        gpus = rng.choice([(0,), (1,), (0, 1)])
        spans.append((f"r{i}", gpus, t, t + rng.randrange(10, 250) * MS))
        i += 1
    # (t, order at one t, what, id, gpus, end, batch)
    events: list[tuple[int, int, str, str, tuple[int, ...], int, list[StepEntry]]] = []
    for rid, gpus, b, e in spans:
        events.append((b, 0, "begin", rid, gpus, 0, []))
        events.append((e, 2, "end", rid, gpus, 0, []))
    s = T0 + 52 * MS  # (readings every 10 ms fall 3 ms into every other step)
    while s < T0 + end_ms * MS:
        for gpu in (0, 1):
            batch = [
                StepEntry(rid, rng.randrange(0, 200), 1, rng.randrange(4000))
                for rid, g, b, e in spans
                if gpu in g and b < s + 4 * MS and e > s  # (some begin or end inside it)
            ]
            if batch:
                events.append((s, 1, "step", "", (gpu,), s + 4 * MS, batch))
        s += 5 * MS
    events.sort(key=lambda x: (x[0], x[1]))
    for t, _, what, rid, gpus, end, batch in events:
        for m in meters:
            if what == "begin":
                m.begin(rid, gpus=gpus, at_ns=t)
            elif what == "end":
                m.end(rid, tokens_in=5, tokens_out=5, at_ns=t)
            else:
                m.step(batch, start_ns=t, end_ns=end, gpus=gpus)


@pytest.mark.parametrize("base_w", [0.0, 80.0])
def test_steps_conserve_energy_across_settles_that_cut_steps(base_w: float) -> None:
    clock = Clock()
    sliced, whole = (
        RequestMeter(
            "steps", gpus=[0, 1], clock=clock, lag_s=0.1, max_edge_delay_s=2.0, step_base_w=base_w
        )
        for _ in range(2)
    )
    random_engine(7, [sliced, whole], 2000)
    feeds = [Feed(stepping, sliced, whole)]
    # GPU 1: the same readings, shifted
    joules = 0.0
    settled: list[RequestEnergy] = []
    cuts = 0
    for k in range(-1000, 4001, 1):  # (GPU 1 from T0 - 1 s too: see Feed)
        t = T0 + k * MS
        if k % 10 == 0:
            feeds[0].to(t)
            p = stepping(t + 50 * MS)
            s = GpuSample("h", t, 1, power_w=p, energy_j=joules)
            joules += p * 0.01
            sliced.add(s)
            whole.add(s)
        if k >= 0 and k % 37 == 0:  # settle at odd instants: horizons inside steps
            clock.now = t + 2000 * MS
            settled += sliced.settle_all()
            h = sliced.state.settled_ns
            if h is not None and h > T0 + 52 * MS:
                cuts += 0 < (h - T0 - 52 * MS) % (5 * MS) < 4 * MS
    clock.now = T0 + 6000 * MS
    settled += sliced.settle_all()
    once = by_id(whole.settle_all())
    got = by_id(settled)
    assert cuts > 20  # horizons fell inside steps
    assert got.keys() == once.keys() and len(got) > 100
    for rid, r in got.items():
        assert r.energy_j == pytest.approx(once[rid].energy_j, rel=1e-9, abs=1e-9)
        assert r.gpu_energy_j.keys() == once[rid].gpu_energy_j.keys()
    assert sliced.totals.bad_input == {} and whole.totals.bad_input == {}
    for m in (sliced, whole):
        conserved(m)
    assert sliced.totals.energy_j[0] == pytest.approx(whole.totals.energy_j[0], rel=1e-12)
    assert sliced.totals.idle_j[1] == pytest.approx(whole.totals.idle_j[1], rel=1e-9)
    ref = feeds[0].reference
    assert sliced.totals.energy_j[0] == pytest.approx(
        ref.energy(T0 - 1000 * MS, sliced.state.settled_ns or 0).energy_j, rel=1e-9
    )


def test_bad_step_input_is_counted_never_raised() -> None:
    def weight(e: StepEntry) -> float:
        if e.request_id == "boom":
            raise ValueError("cannot weigh")
        if e.request_id == "nan":
            return math.nan
        if e.request_id == "neg":
            return -1.0
        return default_step_weight(e)

    meters = [steps_meter(step_weight=weight) for _ in range(2)]
    for k, (meter, clock, feed) in enumerate(meters):
        bad = k == 0
        for rid in ("a", "b", "nan", "neg", "boom"):
            meter.begin(rid, at_ns=T0 + 100 * MS)
        good = [("a", 10, 0, 0), ("b", 5, 0, 0)]
        batch = [*good, ("nan", 1, 0, 0), ("neg", 1, 0, 0), ("boom", 1, 0, 0)] if bad else good
        if bad:
            batch += [("ghost", 1, 0, 0), ("a", None, 0, 0), 17]  # type: ignore[list-item]
        meter.step(batch, start_ns=T0 + 100 * MS, end_ns=T0 + 150 * MS)
        if bad:
            meter.step(5, start_ns=T0 + 160 * MS, end_ns=T0 + 170 * MS)  # type: ignore[arg-type]
            meter.step("ab", start_ns=T0 + 160 * MS, end_ns=T0 + 170 * MS)  # type: ignore[arg-type]
            meter.step(good, start_ns=T0 + 170 * MS, end_ns=T0 + 160 * MS)
        # the meter's GPU named wrong: counted, and the meter's GPUs used
        meter.step([("a", 10, 0, 0)], start_ns=T0 + 170 * MS, end_ns=T0 + 180 * MS,
                   gpus=[7] if bad else [0])  # fmt: skip
        for rid in ("a", "b", "nan", "neg", "boom"):
            meter.end(rid, at_ns=T0 + 200 * MS)
        feed.to(T0 + 300 * MS)
        clock.now = T0 + 300 * MS
    results = [by_id(m.settle_all()) for m, _, _ in meters]
    bad_meter = meters[0][0]
    assert bad_meter.totals.bad_input == {
        "step": 3 + 2 + 1 + 2,  # nan, neg, boom; ("a", None): no weight, 17: no entry;
        # 5 and "ab": no batch; end before start
        "unknown_id": 1,  # ghost
        "gpus": 1,  # gpus=[7]: the meter's GPUs used
    }
    assert meters[1][0].totals.bad_input == {}
    for rid in ("a", "b", "nan", "neg", "boom"):
        assert results[0][rid].energy_j == pytest.approx(results[1][rid].energy_j, rel=1e-12)
    assert results[0]["nan"].energy_j < results[0]["b"].energy_j  # nothing in the step
    conserved(bad_meter)


# -- error_j -----------------------------------------------------------------------------------


def test_error_j_is_zero_where_the_readings_are_flat() -> None:
    meter, clock, feed = steps_meter()
    meter.begin("a", at_ns=T0 + 105 * MS)
    meter.step([("a", 5, 0, 0)], start_ns=T0 + 107 * MS, end_ns=T0 + 133 * MS)
    meter.end("a", at_ns=T0 + 195 * MS)
    feed.to(T0 + 300 * MS)
    clock.now = T0 + 300 * MS
    (a,) = meter.settle_all()
    assert a.error_j == 0.0


def test_error_j_bounds_the_edges_as_windows_do() -> None:
    clock = Clock()
    meter = RequestMeter("equal", gpus=[0], clock=clock, lag_s=0.0)
    feed = Feed(stepping, meter)
    meter.begin("alone", at_ns=T0 + 95 * MS)  # in the bracket [90, 100] ms: 100 -> 600 W
    meter.end("alone", at_ns=T0 + 195 * MS)  # in [190, 200] ms: 600 -> 100 W
    meter.begin("x", at_ns=T0 + 295 * MS)
    meter.begin("y", at_ns=T0 + 295 * MS)
    meter.end("x", at_ns=T0 + 305 * MS)
    meter.end("y", at_ns=T0 + 305 * MS)
    meter.begin("flat", at_ns=T0 + 212 * MS)  # in [210, 220]: 100 -> 100 W
    meter.end("flat", at_ns=T0 + 287 * MS)
    feed.to(T0 + 500 * MS)
    clock.now = T0 + 500 * MS
    got = by_id(meter.settle_all())
    ref = feed.reference
    window = ref.energy(T0 + 95 * MS, T0 + 195 * MS)
    assert window.error_j == pytest.approx(500.0 * 0.005 * 2, rel=1e-12)
    assert got["alone"].error_j == pytest.approx(window.error_j, rel=1e-12)
    both = ref.energy(T0 + 295 * MS, T0 + 305 * MS).error_j
    assert both > 0
    assert got["x"].error_j == pytest.approx(both / 2, rel=1e-12)
    assert got["y"].error_j == pytest.approx(both / 2, rel=1e-12)
    assert got["flat"].error_j == 0.0
    assert all(r.error_j >= 0 for r in got.values())


def test_error_j_between_steps_and_across_settles() -> None:
    clock = Clock()
    meter = RequestMeter("steps", gpus=[0], clock=clock, lag_s=0.0)
    feed = Feed(stepping, meter)
    meter.begin("x", at_ns=T0 + 295 * MS)  # no steps: split as between steps
    meter.begin("y", at_ns=T0 + 295 * MS)
    meter.end("x", at_ns=T0 + 305 * MS)
    meter.end("y", at_ns=T0 + 305 * MS)
    meter.begin("long", at_ns=T0 + 395 * MS)  # across a settle at 450 ms (flat readings there)
    feed.to(T0 + 450 * MS)
    clock.now = T0 + 450 * MS
    got = by_id(meter.settle_all())
    # (a request in flight holds no horizon with steps: "long" is settled in part, to 450 ms)
    assert meter.state.settled_ns == T0 + 450 * MS
    meter.end("long", at_ns=T0 + 495 * MS)
    clock.now = T0 + 450 * MS
    got.update(by_id(meter.settle_all()))
    assert meter.state.settled_ns == T0 + 450 * MS
    assert "long" not in got
    feed.to(T0 + 700 * MS)
    clock.now = T0 + 700 * MS
    got.update(by_id(meter.settle_all()))
    ref = feed.reference
    both = ref.energy(T0 + 295 * MS, T0 + 305 * MS).error_j
    assert got["x"].error_j == pytest.approx(both / 2, rel=1e-12)
    assert got["long"].error_j == pytest.approx(5.0, rel=1e-12)  # 2.5 J at each end


def test_error_j_is_published() -> None:
    clock = Clock()
    meter = RequestMeter("equal", gpus=[0], clock=clock, lag_s=0.0)
    events: list[Event] = []
    meter.publish_with(events.append, host="h")
    feed = Feed(stepping, meter)
    meter.begin("a", at_ns=T0 + 95 * MS)
    meter.end("a", at_ns=T0 + 195 * MS)
    feed.to(T0 + 300 * MS)
    clock.now = T0 + 300 * MS
    (a,) = meter.settle_all()
    (event,) = [e for e in events if isinstance(e, RequestMeasurement)]
    assert event.error_j == a.error_j == pytest.approx(5.0, rel=1e-12)


@pytest.mark.parametrize("counter_every", [1, 7])
def test_edge_errors_are_the_window_edge_errors(counter_every: int) -> None:
    """``DeviceHistory.edge_errors`` (many edges in one pass) gives ``_edge_error``'s figure
    at each (what ``energy()`` adds per window edge), before, inside and past the readings,
    with a counter read at every reading or seen only every 7th, and a gap in the readings
    (counter updates seen only through wide brackets: the merged periods' part)."""
    rng = random.Random(3)
    h = DeviceHistory("gpu:0")
    joules = 0.0
    for k in range(300):
        t = T0 + k * 10 * MS + rng.randrange(-2 * MS, 2 * MS)
        p = rng.choice([100.0, 300.0, 300.0, 500.0])
        joules += p * 0.01
        if 100 <= k < 130 and k != 115:  # a gap, one reading inside
            continue
        h.add(t, p, joules if k % counter_every == 0 else None)
    assert any(h._merged(i) is not None for i in range(1, len(h._ct)))
    times = sorted(T0 + rng.randrange(-50 * MS, 3100 * MS) for _ in range(500))
    for method in ("counter+interpolated", "counter+extrapolated", "integrated"):
        begins, ends = h.edge_errors(times, method)
        for t, b, e in zip(times, begins, ends, strict=True):
            assert b == pytest.approx(h._edge_error(t, method, begin=True)[0], rel=1e-12)
            assert e == pytest.approx(h._edge_error(t, method, begin=False)[0], rel=1e-12)
        assert any(begins) and any(ends)
