"""RequestMeter.discard (a request forgotten: no result, its time to the others or idle) and
consume()'s lowering of the GIL switch interval while it runs. Fake clock, readings every
10 ms."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import anyio
import pytest

from zeus_async.events import Event, GpuSample
from zeus_async.inference import RequestMeter

MS = 1_000_000
T0 = 1_000_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def feed(meters: list[RequestMeter], until: int) -> None:
    """300 W readings every 10 ms from T0 - 1 s, with an exact energy counter."""
    joules = 0.0
    t = T0 - 1000 * MS
    while t <= until:
        s = GpuSample("h", t, 0, power_w=300.0, energy_j=joules)
        joules += 3.0
        for m in meters:
            m.add(s)
        t += 10 * MS


def test_a_discarded_request_leaves_no_trace_and_its_time_goes_to_the_others() -> None:
    clock = Clock()
    meter, without = (RequestMeter(gpus=[0], clock=clock, lag_s=0.0) for _ in range(2))
    for m, ids in ((meter, ("a", "b", "c")), (without, ("a", "c"))):
        for rid in ids:
            m.begin(rid, at_ns=T0 + 100 * MS)
        m.begin("x", at_ns=T0 + 300 * MS)
        m.end("x", at_ns=T0 + 350 * MS)
        m.end("a", at_ns=T0 + 200 * MS)
        m.end("c", at_ns=T0 + 200 * MS)
    meter.discard("b")  # in flight
    meter.discard("x")  # ended, not settled
    meter.discard("b")  # again: unknown now
    meter.discard("nope")
    meter.end("b", at_ns=T0 + 200 * MS)  # an end after the discard: unknown
    feed([meter, without], T0 + 500 * MS)
    clock.now = T0 + 500 * MS
    got = {r.request_id: r for r in meter.settle_all()}
    ref = {r.request_id: r for r in without.settle_all()}
    assert got.keys() == {"a", "c"} and ref.keys() == {"a", "c", "x"}
    assert got["a"].energy_j == pytest.approx(15.0, rel=1e-9)  # half of 100 ms at 300 W
    assert got["a"].energy_j == ref["a"].energy_j
    t = meter.totals
    assert t.requests == 2 and t.finished == {"completed": 2}
    assert t.bad_input == {"unknown_id": 3}
    assert t.idle_j[0] == pytest.approx(without.totals.idle_j[0] + 15.0, rel=1e-9)  # x's
    assert t.requests_j[0] + t.idle_j[0] == pytest.approx(t.energy_j[0], rel=1e-12)
    assert meter.state.in_flight == 0 and meter.state.unsettled == 0


def test_a_discarded_request_in_steps_is_not_an_unknown_step_entry() -> None:
    clock = Clock()
    meter = RequestMeter("steps", gpus=[0], clock=clock, lag_s=0.0, step_base_w=0.0)
    for rid in ("a", "b"):
        meter.begin(rid, at_ns=T0 + 100 * MS)
    meter.step([("a", 1, 0, 0), ("b", 3, 0, 0)], start_ns=T0 + 100 * MS, end_ns=T0 + 200 * MS)
    meter.end("a", at_ns=T0 + 200 * MS)
    meter.discard("b")
    feed([meter], T0 + 300 * MS)
    clock.now = T0 + 300 * MS
    got = {r.request_id: r for r in meter.settle_all()}
    assert got.keys() == {"a"}
    assert got["a"].energy_j == pytest.approx(30.0, rel=1e-9)  # alone in the step now
    assert meter.totals.bad_input == {}


async def _readings(seen: list[float], n: int) -> AsyncIterator[Event]:
    for k in range(n):
        seen.append(sys.getswitchinterval())
        yield GpuSample("h", T0 + k * 10 * MS, 0, power_w=100.0, energy_j=k * 1.0)
        await anyio.sleep(0)


@pytest.fixture
def switch_interval() -> float:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005  # type: ignore[misc]
    sys.setswitchinterval(before)


def test_consume_lowers_the_switch_interval_while_it_runs(switch_interval: float) -> None:
    meter = RequestMeter(gpus=[0], clock=Clock())
    seen: list[float] = []
    anyio.run(meter.consume, _readings(seen, 5))
    assert seen and all(s == pytest.approx(0.001) for s in seen)
    assert sys.getswitchinterval() == switch_interval
    # None: left alone; a smaller one already in force: left alone too
    seen.clear()
    anyio.run(lambda: meter.consume(_readings(seen, 3), switch_interval_s=None))
    assert all(s == switch_interval for s in seen)
    sys.setswitchinterval(0.0005)
    seen.clear()
    anyio.run(meter.consume, _readings(seen, 3))
    assert all(s == pytest.approx(0.0005) for s in seen)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_consume_restores_after_the_last_consumer_unless_changed(switch_interval: float) -> None:
    a, b = (RequestMeter(gpus=[0], clock=Clock()) for _ in range(2))
    seen_a: list[float] = []
    seen_b: list[float] = []

    async def both() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.consume, _readings(seen_a, 3))  # ends first
            tg.start_soon(b.consume, _readings(seen_b, 10))

    anyio.run(both)
    assert all(s == pytest.approx(0.001) for s in seen_a + seen_b)  # b kept it low
    assert sys.getswitchinterval() == switch_interval

    async def changed() -> AsyncIterator[Event]:
        yield GpuSample("h", T0, 0, power_w=100.0, energy_j=0.0)
        sys.setswitchinterval(0.002)  # someone else's choice: kept

    anyio.run(a.consume, changed())
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_bracket_errors_cover_a_burst_the_power_readings_miss() -> None:
    from zeus_async.aggregate.history import DeviceHistory

    h = DeviceHistory("gpu:0")
    # Readings every 10 ms at 100 W; the counter updates every 100 ms, and the bracket from
    # 1.0 to 1.1 s holds 5 J more than 100 W (a burst between the power field's windows).
    joules = 0.0
    for k in range(300):
        t = T0 + k * 10 * MS
        if k % 10 == 0 and k:
            joules += 10.0 + (5.0 if k == 110 else 0.0)
        h.add(t, 100.0, joules)
    times = [T0 + 505 * MS, T0 + 1050 * MS, T0 + 2005 * MS]
    flat, burst, later = h.bracket_errors(times)
    assert flat == 0.0 and later == 0.0
    assert burst == pytest.approx(5.0, rel=1e-6)  # could lie anywhere in the bracket
    # the window edge's own figure misses it (flat readings)
    begins, ends = h.edge_errors(times, "counter+interpolated")
    assert begins[1] == 0.0 and ends[1] == 0.0
