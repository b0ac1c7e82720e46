"""Requests' grams CO2e and cost: the meter integrates the intensity against the energy it
attributes to each request, piece by piece between the intensity's steps, on a simulated GPU
read on a fake clock (readings every 10 ms, as NVML reports them)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from zeus_async.aggregate.history import DeviceHistory
from zeus_async.carbon import CarbonConfig
from zeus_async.clock import FakeClock
from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.devices.sim_workload import SquareWorkload
from zeus_async.events import GpuSample
from zeus_async.inference import RequestMeter
from zeus_async.inference.metrics import RequestMetrics

S = 1_000_000_000
MS = 1_000_000
KWH = 3.6e6
T0 = 1_700_000_000 * S
HALF = 200 * MS  # the square wave's half period, and the file's step
DIRTY, CLEAN = 700.0, 40.0
DIRTY_PRICE, CLEAN_PRICE = 0.4, 0.05


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def node() -> SimNode:
    config = SimConfig(
        num_gpus=1,
        workload=SquareWorkload(period_s=2 * HALF / S, duty=0.5, high=1.0, low=0.1),
        epoch_ns=T0,
        counter_origin_ns=0,
        counter_period_s=0.01,  # updated at every reading: each figure final once read
    )
    return SimNode(config, FakeClock(T0), shared_state=False)


def run(
    meter: RequestMeter,
    requests: list[tuple[str, int, int]],
    until: int,
    *,
    settle_every: int = 1,
) -> tuple[list, DeviceHistory]:  # type: ignore[type-arg]
    """Drive ``meter`` with the simulated GPU's readings every 10 ms and the requests' edges
    (``(id, begin, end)``), settling every ``settle_every`` readings; a reference history gets
    the same readings."""
    gpu = node().gpus[0]
    clock = meter._clock
    assert isinstance(clock, Clock)
    reference = DeviceHistory("gpu:0")
    marks = sorted(
        [(b, 0, rid) for rid, b, _ in requests] + [(e, 1, rid) for rid, _, e in requests]
    )
    settled = []
    k = 0
    for n, t in enumerate(range(T0, until + 1, 10 * MS)):
        while k < len(marks) and marks[k][0] < t:
            at, kind, rid = marks[k]
            clock.now = at
            if kind == 0:
                meter.begin(rid, gpus=(0,))
            else:
                meter.end(rid, tokens_in=10, tokens_out=20, route="/v1/generate", model="m")
            k += 1
        clock.now = t
        sample = GpuSample(
            "sim",
            t,
            0,
            power_w=gpu.instant_power_mw(t) / 1000,
            energy_j=gpu.energy_counter_mj(t) / 1000,
        )
        meter.add(sample)
        reference.add(sample.t_ns, sample.power_w, sample.energy_j)
        if n % settle_every == 0:
            settled += meter.settle()
    settled += meter.settle()
    return settled, reference


def grid_file(path: Path) -> Path:
    """Dirty (and dear) while the square wave is high, clean (and cheap) while it is low."""
    lines = ["timestamp,g_per_kwh,price_per_kwh,currency"]
    for k in range(40):
        high = k % 2 == 0
        lines.append(
            f"{(T0 + k * HALF) / S:.1f},{DIRTY if high else CLEAN},"
            f"{DIRTY_PRICE if high else CLEAN_PRICE},EUR"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def intensity_at(t: int) -> tuple[float, float]:
    high = ((t - T0) // HALF) % 2 == 0
    return (DIRTY, DIRTY_PRICE) if high else (CLEAN, CLEAN_PRICE)


def test_constant_intensity_is_each_requests_energy_times_it() -> None:
    config = CarbonConfig(
        source="constant",
        g_per_kwh=400.0,
        price_per_kwh=0.2,
        currency="EUR",
        pue=1.25,
        overhead=0.1,
    )
    meter = RequestMeter("tokens", gpus=[0], clock=Clock(), lag_s=0.05, carbon=config)
    # Overlapping requests, some across the settles' horizons.
    requests = [
        (f"r{i}", T0 + 100 * MS + i * 37 * MS, T0 + 250 * MS + i * 53 * MS) for i in range(12)
    ]
    settled, _ = run(meter, requests, T0 + 2 * S, settle_every=3)
    assert sorted(r.request_id for r in settled) == sorted(rid for rid, _, _ in requests)
    scale = 1.25 * 1.1
    for r in settled:
        fp = r.footprint
        assert fp is not None and r.energy_j > 0
        assert fp.energy_j == pytest.approx(r.energy_j, rel=1e-12)
        assert fp.kwh == pytest.approx(r.energy_j / KWH * scale, rel=1e-12)
        assert r.co2e_g == pytest.approx(r.energy_j * 400.0 / KWH * scale, rel=1e-12)
        assert r.cost == pytest.approx(r.energy_j * 0.2 / KWH * scale, rel=1e-12)
        assert (fp.currency, fp.source, fp.pue, fp.overhead) == ("EUR", "constant", 1.25, 0.1)
        assert fp.g_per_kwh == pytest.approx(400.0, rel=1e-12)
        assert (r.route, r.model) == ("/v1/generate", "m")


def test_without_carbon_no_footprint_and_the_same_energies() -> None:
    requests = [
        (f"r{i}", T0 + 100 * MS + i * 37 * MS, T0 + 250 * MS + i * 53 * MS) for i in range(8)
    ]
    plain, _ = run(RequestMeter("equal", gpus=[0], clock=Clock(), lag_s=0.05), requests, T0 + S)
    config = CarbonConfig(source="constant", g_per_kwh=1.0)
    with_carbon, _ = run(
        RequestMeter("equal", gpus=[0], clock=Clock(), lag_s=0.05, carbon=config), requests, T0 + S
    )
    assert all(r.footprint is None and r.co2e_g is None and r.cost is None for r in plain)
    got = {r.request_id: r.energy_j for r in with_carbon}
    for r in plain:  # one step: the attribution is the very same
        assert got[r.request_id] == r.energy_j


@pytest.mark.parametrize("settle_every", [1, 7, 1000])
def test_time_varying_intensity_is_integrated_per_piece(tmp_path: Path, settle_every: int) -> None:
    """Requests alone on the GPU (and one pair together, equal shares) across many steps of a
    file's intensity, which is dirty exactly while the GPU draws most: each request's grams
    are its attributed energy in each piece between two steps times that step's intensity."""
    config = CarbonConfig(source="file", file=str(grid_file(tmp_path / "grid.csv")), pue=1.1)
    # lag_s past the counter's 100 ms update period: every figure is final when settled.
    meter = RequestMeter("equal", gpus=[0], clock=Clock(), lag_s=0.3, carbon=config)
    requests = [
        ("a", T0 + 50 * MS, T0 + 930 * MS),  # across 5 steps
        ("b", T0 + 1010 * MS, T0 + 1390 * MS),
        ("c1", T0 + 1500 * MS, T0 + 2270 * MS),  # c1 and c2 together: half each
        ("c2", T0 + 1500 * MS, T0 + 2270 * MS),
        ("d", T0 + 2400 * MS, T0 + 2410 * MS),  # inside one step
    ]
    settled, reference = run(meter, requests, T0 + 3 * S, settle_every=settle_every)
    by_id = {r.request_id: r for r in settled}
    assert sorted(by_id) == sorted(rid for rid, _, _ in requests)
    for rid, b, e in requests:
        r = by_id[rid]
        share = 0.5 if rid.startswith("c") else 1.0
        bounds = [b, *(T0 + k * HALF for k in range(40) if b < T0 + k * HALF < e), e]
        energies = []
        for x, y in itertools.pairwise(bounds):
            joules = reference.energy(x, y).energy_j
            assert joules is not None
            energies.append(share * joules)
        rates = [intensity_at(x) for x in bounds[:-1]]
        co2e = sum(j * g for j, (g, _) in zip(energies, rates, strict=True)) / KWH * 1.1
        cost = sum(j * p for j, (_, p) in zip(energies, rates, strict=True)) / KWH * 1.1
        # Settled once at the end, every figure is the reference's to rounding; settled as the
        # readings come, a piece's energy is the estimator's figure then, which the readings
        # after it move by a few parts in 10^7 (a spread over the request is ~30 % off).
        rel = 1e-9 if settle_every == 1000 else 1e-6
        assert r.energy_j == pytest.approx(sum(energies), rel=rel)
        assert r.co2e_g == pytest.approx(co2e, rel=rel)
        assert r.cost == pytest.approx(cost, rel=rel)
        assert r.footprint is not None and r.footprint.currency == "EUR"
        assert r.footprint.source == "file:grid.csv"
        if len(bounds) > 3:
            # The energy-weighted intensity, well above the time average over the request.
            spread = sum(
                (y - x) * g
                for (x, y), (g, _) in zip(itertools.pairwise(bounds), rates, strict=True)
            ) / (e - b)
            assert r.footprint.g_per_kwh > spread + 50


def test_conservation_holds_with_the_pieces(tmp_path: Path) -> None:
    config = CarbonConfig(source="file", file=str(grid_file(tmp_path / "grid.csv")))
    meter = RequestMeter("tokens", gpus=[0], clock=Clock(), lag_s=0.05, carbon=config)
    requests = [
        (f"r{i}", T0 + 60 * MS + i * 41 * MS, T0 + 300 * MS + i * 67 * MS) for i in range(20)
    ]
    run(meter, requests, T0 + 3 * S, settle_every=4)
    totals = meter.totals
    assert totals.requests == 20
    assert totals.requests_j[0] + totals.idle_j[0] == pytest.approx(totals.energy_j[0], abs=1e-6)


def test_metrics_count_co2e_by_route_and_model_bounded() -> None:
    config = CarbonConfig(source="constant", g_per_kwh=500.0, price_per_kwh=0.3, currency="USD")
    meter = RequestMeter("equal", gpus=[0], clock=Clock(), lag_s=0.0, carbon=config)
    metrics = RequestMetrics(meter, max_label_values=2)
    clock = meter._clock
    assert isinstance(clock, Clock)
    routes = ["/a", "/b", "/c", "/d", "/a"]
    for i, route in enumerate(routes):
        t = T0 + i * 100 * MS
        clock.now = t + 10 * MS
        meter.begin(f"r{i}", gpus=(0,))
        clock.now = t + 60 * MS
        meter.end(f"r{i}", route=route, model="llama")
    for t in range(T0, T0 + 700 * MS, 10 * MS):  # 300 W, exact counter
        meter.add(GpuSample("h", t, 0, power_w=300.0, energy_j=300.0 * (t - T0) / S))
    settled = {r.request_id: r for r in meter.settle()}
    assert len(settled) == 5
    sample = metrics.registry.get_sample_value

    def grams(*ids: str) -> float:
        return sum(settled[i].energy_j for i in ids) * 500.0 / KWH

    labels = {"model": "llama", "source": "constant"}
    assert sample("zeus_request_co2e_grams_total", {"route": "/a", **labels}) == pytest.approx(
        grams("r0", "r4"), rel=1e-12
    )
    assert sample("zeus_request_co2e_grams_total", {"route": "/b", **labels}) == pytest.approx(
        grams("r1"), rel=1e-12
    )
    assert sample("zeus_request_co2e_grams_total", {"route": "other", **labels}) == pytest.approx(
        grams("r2", "r3"), rel=1e-12
    )
    assert sample("zeus_request_co2e_grams_total", {"route": "/c", **labels}) is None
    assert sample(
        "zeus_request_energy_cost_total", {"route": "/a", "currency": "USD", **labels}
    ) == pytest.approx(grams("r0", "r4") / 500.0 * 0.3, rel=1e-12)
    assert grams("r0") == pytest.approx(300.0 * 0.05 * 500.0 / KWH, rel=1e-5)


def test_metrics_without_carbon_have_no_co2e_series() -> None:
    meter = RequestMeter("equal", gpus=[0], clock=Clock(), lag_s=0.0)
    metrics = RequestMetrics(meter)
    meter.begin("r", gpus=(0,))
    meter._clock.now = T0 + 50 * MS  # type: ignore[attr-defined]
    meter.end("r", route="/a")
    for t in range(T0, T0 + 200 * MS, 10 * MS):
        meter.add(GpuSample("h", t, 0, power_w=300.0, energy_j=300.0 * (t - T0) / S))
    assert len(meter.settle()) == 1
    names = {s.name for m in metrics.registry.collect() for s in m.samples}
    assert not any("co2e" in n or "cost" in n for n in names)


def test_middleware_header_and_route_labels() -> None:
    """The ASGI middleware puts the request's grams in ``x-energy-co2e-grams`` beside its
    joules, and labels it with the matched route's template (never the raw path) and model."""
    import types

    import anyio

    from zeus_async.inference.asgi import EnergyMiddleware

    config = CarbonConfig(source="constant", g_per_kwh=250.0)
    clock = Clock()
    meter = RequestMeter("equal", gpus=[0], clock=clock, lag_s=0.0, carbon=config)
    metrics = RequestMetrics(meter)

    def readings(until: int) -> None:
        for t in range(T0, until + 1, 10 * MS):
            meter.add(GpuSample("h", t, 0, power_w=200.0, energy_j=200.0 * (t - T0) / S))

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        scope["route"] = types.SimpleNamespace(path="/items/{item}")  # as FastAPI sets it
        scope["state"]["model"] = "small"
        scope["state"]["tokens"] = (3, 4)
        clock.now = T0 + 80 * MS  # the request ran 50 ms
        readings(T0 + 200 * MS)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict] = []  # type: ignore[type-arg]

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    async def receive():  # type: ignore[no-untyped-def]
        return {"type": "http.request", "body": b""}

    wrapped = EnergyMiddleware(app, meter, energy_header=True, header_wait_s=5.0)
    clock.now = T0 + 30 * MS
    scope = {"type": "http", "path": "/items/12345", "state": {}}
    anyio.run(wrapped, scope, receive, send)
    headers = dict(sent[0]["headers"])
    joules = float(headers[b"x-energy-joules"])
    assert joules == pytest.approx(200.0 * 0.05, rel=1e-5)
    grams = float(headers[b"x-energy-co2e-grams"])
    assert grams == pytest.approx(joules * 250.0 / KWH, rel=1e-5)  # the header's 6 digits
    r = meter.settled(headers[b"x-energy-request-id"].decode())
    assert r is not None and (r.route, r.model) == ("/items/{item}", "small")
    value = metrics.registry.get_sample_value(
        "zeus_request_co2e_grams_total",
        {"route": "/items/{item}", "model": "small", "source": "constant"},
    )
    assert value == pytest.approx(r.co2e_g, rel=1e-12)
