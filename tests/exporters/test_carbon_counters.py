"""Emissions and cost counters beside the energy counters (Prometheus and OTLP).

One GPU's energy counter, sampled every 0.5 s: 100 W for 2 s, then 300 W; a grid at 100 g/kWh
and 0.2 EUR/kWh that turns to 500 g/kWh and 0.5 EUR/kWh at 1.75 s, between two samples. Every
figure below is exact: the joules of each sample interval charged at the intensity in force
(the interval across the change split there), times the PUE.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from test_otlp import Receiver, receiver  # noqa: F401  (the fixture)
from test_prometheus import scrape, types

from zeus_async.carbon import CarbonConfig, ConstantIntensity
from zeus_async.events import GpuSample, Measurement
from zeus_async.exporters import PrometheusExporter
from zeus_async.exporters.carbon_counters import CarbonCounters

H = "node1"
S = 1_000_000_000
MS = 1_000_000
T0 = 1_763_000_000_000_000_000
KWH = 3.6e6
PUE = 1.5
SOURCE = "file:grid.csv"


def grid(tmp_path: Path) -> CarbonConfig:
    def iso(t: int) -> str:
        moment = datetime.datetime.fromtimestamp(t // S, datetime.timezone.utc)
        return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{(t % S) // 1000:06d}Z"

    path = tmp_path / "grid.csv"
    path.write_text(
        "timestamp,g_per_kwh,price_per_kwh,currency\n"
        f"{iso(T0 - 10 * S)},100,0.2,EUR\n"
        f"{iso(T0 + 1750 * MS)},500,0.5,EUR\n"
    )
    return CarbonConfig(source="file", file=str(path), pue=PUE)


def samples(gpu: int = 0) -> list[GpuSample]:
    out, energy = [], 1000.0
    for k in range(9):  # 0 .. 4 s
        t = T0 + k * 500 * MS
        out.append(GpuSample(H, t, gpu, power_w=100.0 if k <= 4 else 300.0, energy_j=energy))
        energy += 50.0 if k < 4 else 150.0  # the interval [k/2, (k+1)/2] s
    return out


# Before 1.75 s: three intervals of 50 J and half of the fourth; after: the other half, and
# four intervals of 150 J.
GRAMS = ((3 * 50 + 25) * 100 + (25 + 4 * 150) * 500) / KWH * PUE
COST = ((3 * 50 + 25) * 0.2 + (25 + 4 * 150) * 0.5) / KWH * PUE
# A window over [1 s, 3 s] of 400 J (its own figure): 75 J before the change (constant power
# there), 325 J after.
WINDOW = Measurement(H, T0 + 3 * S, "step", 1, T0 + 1 * S, T0 + 3 * S, 2.0, {0: 400.0})
WINDOW_GRAMS = (75 * 100 + 325 * 500) / KWH * PUE
WINDOW_COST = (75 * 0.2 + 325 * 0.5) / KWH * PUE


def test_counters_charge_each_joule_at_the_intensity_then(tmp_path: Path) -> None:
    counters = CarbonCounters(grid(tmp_path))
    for e in samples():
        counters.gpu_sample(e.host, e.gpu, e.t_ns, e.energy_j, e.power_w)
    charge = counters.gpus[(H, 0)]
    assert charge.grams == pytest.approx(GRAMS, rel=1e-12)
    assert charge.cost == pytest.approx(COST, rel=1e-12) and charge.currency == "EUR"
    fp = counters.window(WINDOW)
    assert fp is not None and fp.source == SOURCE and fp.energy_j == pytest.approx(400.0)
    assert fp.co2e_g == pytest.approx(WINDOW_GRAMS, rel=1e-12)
    assert fp.cost == pytest.approx(WINDOW_COST, rel=1e-12)


def test_power_only_gpu_is_charged_its_integrated_power() -> None:
    counters = CarbonCounters(ConstantIntensity(200.0))
    for k in range(5):
        counters.gpu_sample(H, 1, T0 + k * S, None, 250.0)
    charge = counters.gpus[(H, 1)]
    assert charge.grams == pytest.approx(4 * 250.0 / KWH * 200.0, rel=1e-12)
    assert charge.cost is None  # no price: no cost series


def test_prometheus_series(tmp_path: Path) -> None:
    exporter = PrometheusExporter(carbon=grid(tmp_path))
    exporter.add([*samples(0), WINDOW, WINDOW])
    got = scrape(exporter)
    gpu = (("gpu", "0"), ("host", H), ("source", SOURCE))
    assert got["zeus_gpu_co2e_grams_total"] == {gpu: pytest.approx(GRAMS, rel=1e-12)}
    assert got["zeus_gpu_energy_cost_total"] == {
        tuple(sorted((*gpu, ("currency", "EUR")))): pytest.approx(COST, rel=1e-12)
    }
    window = (("host", H), ("source", SOURCE), ("window", "step"))
    assert got["zeus_window_co2e_grams_total"] == {window: pytest.approx(2 * WINDOW_GRAMS)}
    assert got["zeus_window_energy_cost_total"] == {
        tuple(sorted((*window, ("currency", "EUR")))): pytest.approx(2 * WINDOW_COST)
    }
    kinds = types(exporter)
    assert kinds["zeus_gpu_co2e_grams_total"] == "counter"
    assert kinds["zeus_window_co2e_grams_total"] == "counter"
    # The energy counters are there as ever, and nothing of carbon without a configuration.
    assert "zeus_gpu_energy_joules_total" in got
    plain = PrometheusExporter()
    plain.add([*samples(0), WINDOW])
    assert not {n for n in scrape(plain) if "co2e" in n or "cost" in n}
    exporter.close()
    plain.close()


def test_window_names_evicted_take_their_carbon_series(tmp_path: Path) -> None:
    exporter = PrometheusExporter(carbon=ConstantIntensity(100.0), max_windows=2)
    exporter.add(samples(0))
    for k in range(3):
        m = Measurement(H, T0 + 4 * S, f"w{k}", k, T0 + S, T0 + 2 * S, 1.0, {0: 36.0})
        exporter.add([m])
    got = scrape(exporter)["zeus_window_co2e_grams_total"]
    assert sorted(dict(k)["window"] for k in got) == ["w1", "w2"]
    assert all(v == pytest.approx(36.0 / KWH * 100.0, rel=1e-12) for v in got.values())
    exporter.close()


def test_otlp_points(tmp_path: Path, receiver: Receiver) -> None:  # noqa: F811
    from zeus_async.exporters.otlp import OtlpExporter

    exporter = OtlpExporter(receiver.url, interval_s=60, carbon=grid(tmp_path))
    exporter.add([*samples(0), WINDOW])
    assert exporter.flush()
    exporter.close()
    last: dict[str, tuple[Any, Any, dict[str, Any]]] = {}
    for _, name, (_kind, metric, point), attributes in receiver.points():
        last[name] = (metric, point, attributes)
    metric, point, attributes = last["zeus.gpu.co2e"]
    assert metric.unit == "g" and metric.sum.is_monotonic
    assert point.as_double == pytest.approx(GRAMS, rel=1e-12)
    assert attributes["zeus.carbon.source"] == SOURCE and attributes["hw.id"] == "gpu:0"
    metric, point, attributes = last["zeus.gpu.energy.cost"]
    assert point.as_double == pytest.approx(COST, rel=1e-12)
    assert attributes["zeus.currency"] == "EUR"
    _, point, attributes = last["zeus.window.co2e"]
    assert point.as_double == pytest.approx(WINDOW_GRAMS, rel=1e-12)
    assert attributes == {"zeus.window": "step", "host.name": H, "zeus.carbon.source": SOURCE}
    _, point, _ = last["zeus.window.energy.cost"]
    assert point.as_double == pytest.approx(WINDOW_COST, rel=1e-12)
