"""The request meter: edges from serving threads, readings from the runtime, settled
attribution that conserves each GPU's measured energy, on a fake clock and on the simulator."""

from __future__ import annotations

import itertools
import random
import threading

import pytest

from zeus_async.aggregate.history import DeviceHistory
from zeus_async.errors import ConfigError
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
    """A GPU whose power steps every 100 ms between 100 and 600 W."""
    return 100.0 + 500.0 * (((t - T0) // (100 * MS)) % 2)


def feed(meter: RequestMeter, history: DeviceHistory, t_from: int, t_to: int) -> None:
    """Readings every 10 ms, with an exact energy counter updated every 20 ms."""
    t = t_from
    while t <= t_to:
        counter_t = t - (t - T0) % (20 * MS)
        counter = sum(power_at(T0 + k * MS) for k in range((counter_t - T0) // MS)) * 1e-3
        sample = GpuSample("h", t, 0, power_w=power_at(t), energy_j=1000.0 + counter)
        meter.add(sample)
        history.add(sample.t_ns, sample.power_w, sample.energy_j)
        t += 10 * MS


def test_settled_requests_and_idle_add_up_to_the_measured_energy() -> None:
    clock = Clock()
    meter = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.05)
    reference = DeviceHistory("gpu:0")
    feed(meter, reference, T0, T0 + 100 * MS)
    rng = random.Random(3)
    t = T0 + 100 * MS
    open_ids: list[str] = []
    settled = []
    for i in range(200):
        t += rng.randrange(1, 15) * MS
        clock.now = t
        if open_ids and rng.random() < 0.5:
            rid = open_ids.pop(rng.randrange(len(open_ids)))
            meter.end(rid, tokens_in=rng.randrange(10, 500), tokens_out=rng.randrange(0, 50))
        else:
            rid = f"r{i}"
            meter.begin(rid, gpus=(0,))
            if rng.random() < 0.8:
                clock.now = t + MS
                meter.phase(rid)
            open_ids.append(rid)
        feed(meter, reference, t - 14 * MS + 10 * MS, t)
        if i % 20 == 0:
            settled += meter.settle()
    clock.now = t + 5 * MS
    for rid in open_ids:
        meter.end(rid, tokens_in=100, tokens_out=10)
    feed(meter, reference, t, t + 500 * MS)
    settled += meter.settle()
    totals = meter.totals
    assert totals.requests == len(settled)
    assert len({r.request_id for r in settled}) == len(settled)
    # Conservation: everything settled, requests plus idle, is the GPU's measured energy.
    assert totals.requests_j[0] + totals.idle_j[0] == pytest.approx(totals.energy_j[0], abs=1e-6)
    # ... and that measured energy is the estimator's over the settled span, each interval
    # estimated when it was settled (with readings up to ``lag_s`` past it, as a window is
    # finalized), so within a few hundredths of a percent of the estimate made afterwards.
    first = reference.first_t_ns
    assert first is not None
    horizon = meter.horizon_ns()
    assert horizon is not None
    assert totals.energy_j[0] == pytest.approx(reference.energy(first, horizon).energy_j, rel=1e-3)
    assert sum(r.energy_j for r in settled) == pytest.approx(totals.requests_j[0], abs=1e-6)
    assert all(r.energy_j >= 0 and r.method.startswith("tokens share of counter") for r in settled)


def test_a_request_in_flight_holds_the_horizon() -> None:
    """With ``tokens`` (equal and steps settle past it: test_open_requests.py)."""
    clock = Clock()
    meter = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0)
    reference = DeviceHistory("gpu:0")
    feed(meter, reference, T0, T0 + 50 * MS)
    clock.now = T0 + 60 * MS
    meter.begin("long")
    feed(meter, reference, T0 + 60 * MS, T0 + 400 * MS)
    assert meter.settle() == []  # nothing complete yet, only idle before the request
    assert meter.horizon_ns() == T0 + 60 * MS
    assert meter.totals.idle_j[0] > 0 and meter.in_flight == 1
    clock.now = T0 + 300 * MS
    meter.end("long", tokens_out=12)
    (r,) = meter.settle()
    assert r.request_id == "long" and r.time_s == pytest.approx(0.24)
    assert r.energy_j == pytest.approx(reference.energy(T0 + 60 * MS, T0 + 300 * MS).energy_j)
    assert r.j_per_output_token == pytest.approx(r.energy_j / 12)


def test_bad_edges_are_counted_not_fatal() -> None:
    clock = Clock()
    meter = RequestMeter(gpus=[0], clock=clock, lag_s=0.0)
    meter.end("never-began")
    meter.begin("a")
    meter.begin("a")
    meter.settle()
    assert meter.totals.dropped_edges == 2
    meter.phase("a", "warmup")  # counted, not raised (the serving thread never sees one)
    meter.settle()
    assert meter.totals.dropped_edges == 3 and meter.totals.bad_input["phase"] == 1
    with pytest.raises(ConfigError, match="policy must be"):
        RequestMeter("fair")  # type: ignore[arg-type]


def test_many_serving_threads_at_once() -> None:
    meter = RequestMeter(gpus=[0], lag_s=0.0)

    def serve(k: int) -> None:
        for i in range(2000):
            rid = f"{k}-{i}"
            meter.begin(rid)
            meter.phase(rid)
            meter.end(rid, tokens_in=5, tokens_out=5)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    meter._drain_edges()
    assert meter.totals.dropped_edges == 0 and meter.in_flight == 0
    assert len(meter._done) == 16_000


@pytest.mark.parametrize("end_ms", [400, 385])  # counter covers the range / stops before it
def test_cumulative_energy_is_the_estimator_in_one_pass(end_ms: int) -> None:
    history = DeviceHistory("gpu:0")
    feed(RequestMeter(gpus=[0]), history, T0, T0 + 390 * MS)
    times = [T0 + t * MS for t in (13, 40, 41, 77, 150, 222, 300, end_ms)]
    got = history.cumulative(times)
    assert got is not None
    values, method = got
    whole = history.energy(times[0], times[-1])
    assert values[0] == 0.0 and values[-1] == pytest.approx(whole.energy_j, rel=1e-12)
    assert method == whole.method
    for (a, b), (va, vb) in zip(itertools.pairwise(times), itertools.pairwise(values), strict=True):
        assert vb - va == pytest.approx(history.energy(a, b).energy_j, rel=1e-9, abs=1e-9)


def test_a_request_that_ended_past_the_horizon_is_settled_in_pieces_and_reported_whole() -> None:
    clock = Clock()
    meter = RequestMeter(gpus=[0], clock=clock, lag_s=0.05)
    reference = DeviceHistory("gpu:0")
    feed(meter, reference, T0, T0 + 50 * MS)
    clock.now = T0 + 60 * MS
    meter.begin("r")
    clock.now = T0 + 300 * MS
    meter.end("r")
    feed(meter, reference, T0 + 60 * MS, T0 + 310 * MS)  # readings cover 260 ms after the lag
    assert meter.settle() == []  # its head is attributed, and kept until the rest is
    assert meter.horizon_ns() == T0 + 260 * MS
    feed(meter, reference, T0 + 320 * MS, T0 + 500 * MS)
    (r,) = meter.settle()
    assert r.time_s == pytest.approx(0.24)
    assert r.energy_j == pytest.approx(reference.energy(T0 + 60 * MS, T0 + 300 * MS).energy_j)


def test_settled_requests_are_published_as_events() -> None:
    from zeus_async.events import RequestIdle, RequestMeasurement, event_topic

    clock = Clock()
    meter = RequestMeter("tokens", gpus=[0], clock=clock, lag_s=0.0)
    events: list[object] = []
    meter.publish_with(events.append, host="node1")
    reference = DeviceHistory("gpu:0")
    feed(meter, reference, T0, T0 + 50 * MS)
    for i, a in enumerate([60, 100]):
        clock.now = T0 + a * MS
        meter.begin(f"r{i}")
        clock.now = T0 + (a + 20) * MS
        meter.phase(f"r{i}")
    for i, b in enumerate([200, 260]):
        clock.now = T0 + b * MS
        meter.end(f"r{i}", tokens_in=50, tokens_out=10)
    feed(meter, reference, T0 + 60 * MS, T0 + 400 * MS)
    settled = meter.settle()
    requests = [e for e in events if isinstance(e, RequestMeasurement)]
    (idle,) = [e for e in events if isinstance(e, RequestIdle)]
    assert [e.request_id for e in requests] == [r.request_id for r in settled] == ["r0", "r1"]
    for e, r in zip(requests, settled, strict=True):
        assert e.gpu_energy_j == r.gpu_energy_j and e.decode_j == r.decode_j
        assert (e.begin_ns, e.decode_ns, e.end_ns) == (r.begin_ns, r.decode_ns, r.end_ns)
        assert e.policy == "tokens" and event_topic(e) == f"request/node1/{e.request_id}"
    assert idle.gpu_energy_j[0] == pytest.approx(
        sum(e.gpu_energy_j[0] for e in requests) + idle.gpu_idle_j[0], abs=1e-9
    )
