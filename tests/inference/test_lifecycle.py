"""The request lifecycle (issue 38, item 1): finish reasons and abort, a maximum age after which
a request never ended is settled as unfinished (the others are no longer held back), bad input
from the app counted and never raised, settling bounded per call and off the event loop,
memory bounded, and the backlog gauges. Fake clock, readings every 10 ms."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from zeus_async.aggregate.history import DeviceHistory
from zeus_async.events import Event, GpuSample, RequestMeasurement
from zeus_async.inference import RequestMeter, RequestSpan, attribute
from zeus_async.inference import meter as meter_module
from zeus_async.inference.asgi import EnergyMiddleware
from zeus_async.inference.metrics import RequestMetrics

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def power_at(t: int) -> float:
    """Steps every 100 ms between 100 and 600 W."""
    return 100.0 + 500.0 * (((t - T0) // (100 * MS)) % 2)


def sample(t: int) -> GpuSample:
    """A reading at ``t`` (a multiple of 10 ms after T0), with an exact energy counter."""
    joules = sum(power_at(T0 + k * 10 * MS) for k in range((t - T0) // (10 * MS))) * 0.01
    return GpuSample("h", t, 0, power_w=power_at(t), energy_j=1000.0 + joules)


class Feed:
    """Readings every 10 ms into a meter and a reference history, up to a time."""

    def __init__(self, *meters: RequestMeter) -> None:
        self.meters = meters
        self.reference = DeviceHistory("gpu:0")
        self.next = T0
        self._joules = 0.0

    def to(self, t: int) -> None:
        while self.next <= t:
            s = GpuSample("h", self.next, 0, power_w=power_at(self.next), energy_j=self._joules)
            self._joules += power_at(self.next) * 0.01
            for m in self.meters:
                m.add(s)
            self.reference.add(s.t_ns, s.power_w, s.energy_j)
            self.next += 10 * MS


def test_a_request_that_never_ends_is_settled_unfinished_and_the_rest_on_time() -> None:
    clock = Clock()
    meter = RequestMeter(gpus=[0], clock=clock, lag_s=0.02, max_age_s=1.0)
    feed = Feed(meter)
    # (readings from a second before: nothing waits for the hung request now, so the first
    # requests settle at once, and the estimator's fit of the counter's update grid needs
    # more than the 190 ms of readings in by then to be within 1e-4)
    feed.next = T0 - 1000 * MS
    feed.to(T0 + 50 * MS)
    clock.now = T0 + 60 * MS
    meter.begin("hang")
    spans = []
    settled_at: dict[str, int] = {}
    t = T0 + 100 * MS
    k = 0
    while t < T0 + 3000 * MS:  # a request every 20 ms, each 10 ms long, for 3 s
        clock.now = t
        meter.begin(f"r{k}")
        clock.now = t + 10 * MS
        meter.end(f"r{k}", tokens_in=5, tokens_out=5)
        spans.append(RequestSpan(f"r{k}", (0,), t, t + 10 * MS, None, 5, 5))
        t += 20 * MS
        k += 1
        if k % 5 == 0:  # settle every 100 ms
            feed.to(clock.now)
            for r in meter.settle():
                settled_at[r.request_id] = clock.now
    clock.now = T0 + 3100 * MS
    feed.to(clock.now)
    for r in meter.settle():
        settled_at[r.request_id] = clock.now
    meter.end("hang", tokens_out=3)  # too late: counted, not raised
    meter.settle()
    assert meter.totals.bad_input == {"ended_after_max_age": 1}

    expire = T0 + 60 * MS + 1000 * MS
    hang = meter.settled("hang")
    assert hang is not None and hang.finish_reason == "unfinished"
    assert (hang.begin_ns, hang.end_ns) == (T0 + 60 * MS, expire)
    assert hang.tokens_out == 0
    assert len(settled_at) == k + 1
    for s in spans:
        # (equal: the hung request in flight holds nothing, not even until its expiry)
        late = settled_at[s.request_id] - s.end_ns
        assert late <= 100 * MS + 20 * MS, s.request_id  # one settle period plus lag_s
    assert [r.finish_reason for r in meter.results()].count("completed") == k
    # Each request's energy: the equal split of the estimator's energy, settled afterwards
    # in one go, with the hung request as if it had ended at its maximum age.
    hang_span = RequestSpan("hang", (0,), T0 + 60 * MS, expire)

    def energy(gpu: int, a: int, b: int) -> float:
        return feed.reference.energy(a, b).energy_j or 0.0

    want = attribute([hang_span, *spans], energy, start_ns=T0, end_ns=T0 + 3080 * MS)
    for rid, r in want.requests.items():
        got = meter.settled(rid)
        assert got is not None
        # (the meter's intervals were estimated as the readings came: 1e-4 apart)
        assert got.energy_j == pytest.approx(r.energy_j, rel=1e-4), rid
    totals = meter.totals
    assert totals.requests_j[0] + totals.idle_j[0] == pytest.approx(totals.energy_j[0], rel=1e-12)
    assert totals.finished == {"completed": k, "unfinished": 1}


def test_abort_gives_the_finish_reason_in_results_and_events() -> None:
    clock = Clock()
    meter = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0)
    events: list[Any] = []
    meter.publish_with(events.append, host="n")
    feed = Feed(meter)
    feed.to(T0 + 50 * MS)
    for i, rid in enumerate(["ok", "gone", "failed", "odd"]):
        clock.now = T0 + (60 + 10 * i) * MS
        meter.begin(rid)
    clock.now = T0 + 200 * MS
    meter.end("ok", tokens_in=10, tokens_out=4)
    meter.abort("gone", "cancelled", tokens_in=10, tokens_out=2)
    meter.abort("failed", "error")
    meter.abort("odd", "timeout")  # not a reason: counted, taken as error
    meter.abort("gone")  # a second abort: counted
    feed.to(T0 + 300 * MS)
    settled = {r.request_id: r for r in meter.settle()}
    reasons = {rid: r.finish_reason for rid, r in settled.items()}
    assert reasons == {"ok": "completed", "gone": "cancelled", "failed": "error", "odd": "error"}
    assert (settled["gone"].tokens_in, settled["gone"].tokens_out) == (10, 2)
    assert meter.totals.bad_input == {"reason": 1, "ended_twice": 1}
    assert meter.totals.finished == {"completed": 1, "cancelled": 1, "error": 2}
    sent = {e.request_id: e.finish_reason for e in events if isinstance(e, RequestMeasurement)}
    assert sent == reasons
    # tokens policy: "failed" and "odd" had no tokens, and share with requests that had some
    assert settled["ok"].energy_j > settled["gone"].energy_j > 0
    assert settled["failed"].energy_j == settled["odd"].energy_j == 0


# (bad input, the kind counted): each done to request "x" (begun at 60 ms unless said).
BAD: list[tuple[str, Callable[[RequestMeter], object], str]] = [
    ("tokens None", lambda m: m.end("x", tokens_in=10, tokens_out=None), "tokens"),  # type: ignore[arg-type]
    ("tokens str", lambda m: m.end("x", tokens_in="12"), "tokens"),  # type: ignore[arg-type]
    ("tokens float", lambda m: m.end("x", tokens_out=1.5), "tokens"),  # type: ignore[arg-type]
    ("tokens negative", lambda m: m.end("x", tokens_out=-3), "tokens"),
    ("tokens bool", lambda m: m.end("x", tokens_out=True), "tokens"),
    ("unknown id", lambda m: (m.end("x"), m.end("nobody")), "unknown_id"),
    ("phase unknown", lambda m: (m.end("x"), m.phase("nobody")), "unknown_id"),
    ("end twice", lambda m: (m.end("x"), m.end("x")), "ended_twice"),
    ("begin twice", lambda m: (m.begin("x"), m.end("x")), "began_twice"),
    ("phase name", lambda m: (m.phase("x", "warmup"), m.end("x")), "phase"),
]


@pytest.mark.parametrize(("what", "bad", "kind"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_counted_never_raised_and_later_requests_are_unaffected(
    what: str, bad: Callable[[RequestMeter], object], kind: str
) -> None:
    clock = Clock()
    meter = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0)
    good = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0)  # the same, input right
    feed = Feed(meter, good)
    feed.to(T0 + 50 * MS)
    clock.now = T0 + 60 * MS
    meter.begin("x")
    good.begin("x")
    clock.now = T0 + 100 * MS
    bad(meter)  # never raises
    good.end("x")
    for i in range(5):  # requests after it
        for m in (meter, good):
            clock.now = T0 + (150 + 40 * i) * MS
            m.begin(f"r{i}")
            clock.now = T0 + (170 + 40 * i) * MS
            m.end(f"r{i}", tokens_in=20, tokens_out=i + 1)
    feed.to(T0 + 500 * MS)
    got = meter.settle()
    want = good.settle()
    assert meter.totals.bad_input == {kind: 1}
    assert [r.request_id for r in got] == [r.request_id for r in want]
    assert all(r.finish_reason == "completed" for r in got)
    for a, b in zip(got, want, strict=True):
        if a.request_id != "x":
            assert a.energy_j == b.energy_j
    assert meter.totals.energy_j == good.totals.energy_j


@pytest.mark.parametrize("gpus", [5, ("x",), (), (-1,), (3,)], ids=repr)
def test_bad_gpus_are_counted_and_the_request_runs_on_the_meters(gpus: Any) -> None:
    clock = Clock()
    meter = RequestMeter(gpus=[0], clock=clock, lag_s=0.0)
    feed = Feed(meter)
    feed.to(T0 + 50 * MS)
    clock.now = T0 + 60 * MS
    meter.begin("x", gpus)
    clock.now = T0 + 100 * MS
    meter.end("x")
    feed.to(T0 + 200 * MS)
    (r,) = meter.settle()
    assert meter.totals.bad_input == {"gpus": 1}
    assert list(r.gpu_energy_j) == [0]
    assert r.energy_j == pytest.approx(feed.reference.energy(T0 + 60 * MS, T0 + 100 * MS).energy_j)


def test_bad_input_is_logged_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    meter = RequestMeter(gpus=[0], clock=Clock(), lag_s=0.0)
    for i in range(50):
        meter.end(f"nobody{i}")
        meter.begin(f"r{i}")
        meter.end(f"r{i}", tokens_out=None)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="zeus_async.inference.meter"):
        meter.settle()
    assert meter.totals.bad_input == {"unknown_id": 50, "tokens": 50}
    assert len(caplog.records) == 2


def test_settle_work_is_bounded_per_call_and_adds_up_to_one_settle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2,000 requests of 50 ms beginning every ms (~50 in flight): settled 100 at a time,
    each call attributes at most 100 requests plus those in flight at its start, and the
    results are those of one unbounded settle."""
    clock = Clock()
    sliced = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0, settle_batch=100)
    whole = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0, settle_batch=10**9)
    feed = Feed(sliced, whole)
    feed.to(T0 + 50 * MS)
    for m in (sliced, whole):
        for i in range(2000):
            clock.now = T0 + (60 + i) * MS
            m.begin(f"r{i}")
        for i in range(2000):
            clock.now = T0 + (110 + i) * MS
            m.end(f"r{i}", tokens_in=i % 7 + 1, tokens_out=i % 5)
    feed.to(T0 + 2300 * MS)
    sizes: list[int] = []
    real = attribute

    def counted(spans: Any, *args: Any, **kwargs: Any) -> Any:
        spans = list(spans)
        sizes.append(len(spans))
        return real(spans, *args, **kwargs)

    monkeypatch.setattr(meter_module, "attribute", counted)
    calls = []
    for _ in range(1000):
        sizes.clear()
        sliced.settle()
        calls.append(sum(sizes))
        state = sliced.state
        if len(sliced.results()) == 2000 and state.unsettled == state.pending == 0:
            break
    monkeypatch.undo()
    assert len(calls) >= 20
    assert max(calls) <= 100 + 51
    want = {r.request_id: r for r in whole.settle()}
    assert len(want) == 2000 == len(sliced.results())
    for r in sliced.results():
        assert r.energy_j == pytest.approx(want[r.request_id].energy_j, rel=1e-9, abs=1e-12)
    t = sliced.totals
    assert t.requests_j[0] + t.idle_j[0] == pytest.approx(t.energy_j[0], rel=1e-12)
    assert t.energy_j[0] == pytest.approx(whole.totals.energy_j[0], rel=1e-12)


def test_memory_is_bounded_whatever_clients_do() -> None:
    clock = Clock()
    # (tokens: requests in flight hold the horizon, so ended ones wait behind them)
    meter = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0, max_open=100, max_pending=500)
    feed = Feed(meter)
    feed.to(T0 + 50 * MS)
    for i in range(400):  # never ended
        clock.now = T0 + (60 + i) * MS
        meter.begin(f"r{i}")
    feed.to(T0 + 600 * MS)
    meter.settle()
    assert meter.in_flight == 100 and meter.totals.bad_input == {"too_many_open": 300}
    # r0..r299 ended when the begin after their 100 came, 100 ms later; those ended by
    # 360 ms (r300, the oldest in flight, began then) are settled, the rest wait for it
    assert meter.totals.finished == {"unfinished": 201}
    assert {r.request_id for r in meter.results()} == {f"r{i}" for i in range(201)}
    assert meter.state.unsettled == 99
    for i in range(1000):  # nobody settles: the queue stops at max_pending
        meter.end(f"nobody{i}")
    # (bounded where readings come in and at each settle, not on the serving thread's calls)
    feed.to(T0 + 610 * MS)
    assert len(meter._edges) == 500
    assert meter.totals.bad_input["overflow"] == 500


def test_consume_settles_off_the_event_loop() -> None:
    clock = Clock()
    meter = RequestMeter(gpus=[0], clock=clock, lag_s=0.0)
    threads: list[threading.Thread] = []
    notified: list[threading.Thread] = []
    real = meter._settle_slice

    def slice_(budget: int | None) -> Any:
        threads.append(threading.current_thread())
        return real(budget)

    meter._settle_slice = slice_  # type: ignore[method-assign,assignment]
    meter.subscribe(lambda out: notified.append(threading.current_thread()))
    clock.now = T0 + 60 * MS
    meter.begin("a")
    clock.now = T0 + 100 * MS
    meter.end("a")

    async def stream() -> AsyncIterator[Event]:
        for k in range(40):
            yield sample(T0 + k * 10 * MS)
            await anyio.sleep(0.002)

    async def main() -> threading.Thread:
        await meter.consume(stream(), every_s=0.01)
        return threading.current_thread()

    loop_thread = anyio.run(main)
    assert threads and all(t is not loop_thread for t in threads)
    assert notified and all(t is loop_thread for t in notified)
    a = meter.settled("a")
    assert a is not None and a.finish_reason == "completed" and a.energy_j > 0


async def _call(app: EnergyMiddleware, state: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    await app({"type": "http", "state": state}, receive, send)
    return sent


def test_middleware_survives_bad_state_and_never_settles_on_the_loop() -> None:
    clock = Clock()
    meter = RequestMeter(gpus=[0], clock=clock, lag_s=0.0)
    feed = Feed(meter)
    feed.to(T0 + 50 * MS)
    settling: list[threading.Thread] = []
    real = meter._settle_slice

    def slice_(budget: int | None) -> Any:
        settling.append(threading.current_thread())
        return real(budget)

    meter._settle_slice = slice_  # type: ignore[method-assign,assignment]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope["state"].update(scope["state"].pop("set", {}))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hi", "more_body": False})

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise ValueError("the app failed")

    plain = EnergyMiddleware(app, meter)
    held = EnergyMiddleware(app, meter, energy_header=True, header_wait_s=2.0, poll_s=0.001)

    async def main() -> threading.Thread:
        clock.now = T0 + 60 * MS
        await _call(plain, {"set": {"tokens": (10, None)}})
        await _call(plain, {"set": {"tokens": 7}, "gpus": 3})
        with pytest.raises(ValueError, match="the app failed"):
            await _call(EnergyMiddleware(broken, meter), {})
        clock.now = T0 + 200 * MS
        feed.to(T0 + 300 * MS)  # readings past it: its figure comes from the meter's thread
        sent = await _call(held, {"set": {"tokens": (3, 4)}})
        headers = dict(sent[0]["headers"])
        assert headers[b"x-energy-joules"] != b"pending"
        return threading.current_thread()

    loop_thread = anyio.run(main)
    assert settling and all(t is not loop_thread for t in settling)
    reasons = sorted(r.finish_reason for r in meter.results())
    assert reasons == ["completed", "completed", "completed", "error"]
    assert meter.totals.bad_input == {"tokens": 3, "gpus": 1}


def test_backlog_gauges() -> None:
    clock = Clock()
    # (tokens: "old" in flight holds "done" back; with equal or steps it would not)
    meter = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0, max_age_s=10.0)
    metrics = RequestMetrics(meter)
    feed = Feed(meter)
    feed.to(T0 + 50 * MS)
    clock.now = T0 + 60 * MS
    meter.begin("old")
    meter.begin("done")
    clock.now = T0 + 100 * MS
    meter.end("done")
    meter.end("nobody")
    feed.to(T0 + 500 * MS)
    clock.now = T0 + 560 * MS
    meter.settle()

    def value(name: str, **labels: str) -> float | None:
        got: float | None = metrics.registry.get_sample_value(name, labels)
        return got

    assert value("zeus_request_in_flight") == 1
    assert value("zeus_request_unsettled") == 1  # "done": ended, held behind "old"
    assert value("zeus_request_oldest_age_seconds") == pytest.approx(0.5)
    assert value("zeus_request_settle_lag_seconds") == pytest.approx(0.5)
    assert value("zeus_request_bad_input_total", kind="unknown_id") == 1
    assert value("zeus_request_bad_input_total", kind="tokens") == 0
    clock.now = T0 + 700 * MS
    meter.end("old", tokens_out=2)
    feed.to(T0 + 800 * MS)
    meter.settle()
    assert value("zeus_request_in_flight") == 0 and value("zeus_request_unsettled") == 0
    assert value("zeus_request_finished_total", reason="completed") == 2
    assert value("zeus_request_finished_total", reason="unfinished") == 0
