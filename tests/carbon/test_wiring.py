"""Carbon figures wired into windows, job sums and recordings (simulator, fake clock)."""

from __future__ import annotations

import datetime
import itertools
from pathlib import Path
from typing import Any

import pytest

from zeus_async.aggregate import WindowResult
from zeus_async.carbon import CarbonConfig, ConstantIntensity, footprint_of
from zeus_async.clock import FakeClock
from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.devices.sim_config import GpuOverride
from zeus_async.devices.sim_workload import ConstantWorkload, SquareWorkload
from zeus_async.ranks import job_footprint
from zeus_async.runtime import Runtime
from zeus_async.store.analysis import Recording
from zeus_async.testing import sim_pynvml

pytestmark = pytest.mark.anyio

MS = 1_000_000
S = 1_000_000_000
START = 1_760_000_000_000_000_000 + 3 * MS
KWH = 3.6e6


def iso(t_ns: int) -> str:
    moment = datetime.datetime.fromtimestamp(t_ns // S, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{(t_ns % S) // 1000:06d}Z"


def intensity_file(path: Path, rows: list[tuple[int, float, float]]) -> Path:
    """A FileIntensity CSV: (offset ns from START, g/kWh, price EUR/kWh) per row."""
    lines = ["timestamp,g_per_kwh,price_per_kwh,currency"]
    lines += [f"{iso(START + off)},{g},{p},EUR" for off, g, p in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


async def measure(
    config: SimConfig,
    spans: list[tuple[int, int]],
    carbon: Any,
    *,
    record: Path | None = None,
    end_ns: int | None = None,
) -> list[WindowResult]:
    """Windows at exact (start, end) offsets from START, on a fake clock."""
    clock = FakeClock(wall_start_ns=START)
    results: list[WindowResult] = []
    try:
        async with Runtime(
            backend="sim",
            cpus=None,
            sim_config=config,
            clock=clock,
            windows=True,
            carbon=carbon,
            record=record,
        ) as rt:
            tracker = rt.tracker
            assert tracker is not None
            for k, (a, b) in enumerate(spans):
                await clock.sleep_until(a - (clock.wall_ns() - clock.monotonic_ns()))
                tracker.open(f"w{k}", t_ns=START + a)
                await clock.sleep_until(b - (clock.wall_ns() - clock.monotonic_ns()))
                results.append(tracker.close(f"w{k}", t_ns=START + b))
            for r in results:
                await r.wait_async()
            if end_ns is not None:
                await clock.sleep_until(end_ns - (clock.wall_ns() - clock.monotonic_ns()))
    finally:
        sim_pynvml.uninstall()
    return results


def truth_footprint(
    node: SimNode, gpus: list[int], t0: int, t1: int, steps: list[tuple[int, float, float]]
) -> tuple[float, float]:
    """Grams and cost from the simulator's exact energy of each intensity piece."""
    bounds = [START + off for off, _, _ in steps]
    grams = cost = 0.0
    for k, (off, g, price) in enumerate(steps):
        a = max(t0, START + off)
        b = min(t1, bounds[k + 1] if k + 1 < len(bounds) else t1)
        if b <= a:
            continue
        joules = sum(node.truth_energy_j(gpu, a, b) for gpu in gpus)
        grams += joules / KWH * g
        cost += joules / KWH * price
    return grams, cost


async def test_constant_source_on_every_window() -> None:
    config = SimConfig(num_gpus=2, workload=ConstantWorkload(util=0.7), seed=3)
    carbon = CarbonConfig(
        source="constant",
        g_per_kwh=400.0,
        price_per_kwh=0.25,
        currency="EUR",
        pue=1.2,
        overhead=0.1,
    )
    results = await measure(config, [(500 * MS, 1500 * MS), (1600 * MS, 1900 * MS)], carbon)
    node = SimNode(config, shared_state=False)
    for r in results:
        fp = r.footprint
        assert fp is not None
        assert fp.source == "constant" and fp.pue == 1.2 and fp.overhead == 0.1
        assert fp.energy_j == r.total_energy
        assert fp.kwh == pytest.approx(r.total_energy / KWH * 1.2 * 1.1, rel=1e-12)
        assert r.co2e_g == fp.co2e_g == pytest.approx(fp.kwh * 400.0, rel=1e-12)
        assert r.cost == pytest.approx(fp.kwh * 0.25, rel=1e-12) and fp.currency == "EUR"
        truth = sum(node.truth_energy_j(g, r.start_ns, r.end_ns) for g in (0, 1))
        assert fp.co2e_g == pytest.approx(truth / KWH * 1.32 * 400.0, rel=1e-3)
        assert r.gpu_footprint == fp  # no RAPL here: every joule is a GPU's


async def test_no_carbon_config_no_figures() -> None:
    config = SimConfig(num_gpus=1, workload=ConstantWorkload(util=0.5), seed=3)
    (r,) = await measure(config, [(300 * MS, 600 * MS)], None)
    assert r.total_energy > 0
    assert r.footprint is None and r.co2e_g is None and r.cost is None


async def test_time_varying_intensity_exact_on_integrated_power(tmp_path: Path) -> None:
    # Pre-Volta GPUs at constant power: the window's energy is integrated power, exact, so
    # each intensity piece's joules are the simulator's to 1e-6.
    steps = [(0, 120.0, 0.1), (900 * MS, 650.0, 0.4), (1300 * MS, 30.0, 0.05)]
    path = intensity_file(tmp_path / "grid.csv", steps)
    config = SimConfig(
        num_gpus=2,
        workload=ConstantWorkload(util=0.6),
        gpus=(GpuOverride(pre_volta=True), GpuOverride(pre_volta=True)),
        seed=5,
    )
    (r,) = await measure(
        config, [(500 * MS, 2100 * MS)], CarbonConfig(source="file", file=str(path))
    )
    node = SimNode(config, shared_state=False)
    fp = r.footprint
    assert fp is not None and fp.source == "file:grid.csv"
    grams, cost = truth_footprint(node, [0, 1], r.start_ns, r.end_ns, steps)
    assert fp.co2e_g == pytest.approx(grams, rel=1e-6)
    assert fp.cost == pytest.approx(cost, rel=1e-6)
    assert fp.g_per_kwh == pytest.approx(grams / (fp.kwh), rel=1e-9)


async def test_time_varying_intensity_follows_the_power_not_the_clock(tmp_path: Path) -> None:
    # A square wave (700 W high, ~130 W low, 0.4 s each) and a grid dirty exactly while the
    # power is high: weighting by time (energy spread evenly) would be 38 % off.
    steps = [
        (0, 800.0, 0.3),
        (1200 * MS, 50.0, 0.1),
        (1600 * MS, 800.0, 0.3),
        (2000 * MS, 50.0, 0.1),
    ]
    path = intensity_file(tmp_path / "grid.csv", steps)
    config = SimConfig(
        num_gpus=2,
        workload=SquareWorkload(period_s=0.8, duty=0.5, high=1.0, low=0.1),
        seed=5,
        epoch_ns=START,
    )
    (r,) = await measure(
        config, [(800 * MS, 2400 * MS)], CarbonConfig(source="file", file=str(path))
    )
    node = SimNode(config, shared_state=False)
    fp = r.footprint
    assert fp is not None
    grams, cost = truth_footprint(node, [0, 1], r.start_ns, r.end_ns, steps)
    assert fp.co2e_g == pytest.approx(grams, rel=0.02)
    assert fp.cost == pytest.approx(cost, rel=0.02)
    even = footprint_of(
        r.total_energy, r.start_ns, r.end_ns, CarbonConfig(source="file", file=str(path)).open()
    )
    assert abs(even.co2e_g - grams) / grams > 0.25


async def test_job_footprint_single_process() -> None:
    config = SimConfig(num_gpus=1, workload=ConstantWorkload(util=0.5), seed=3)
    (r,) = await measure(config, [(300 * MS, 900 * MS)], ConstantIntensity(100.0))
    fp = job_footprint(r)
    assert fp is not None and fp == r.gpu_footprint
    assert fp.co2e_g == pytest.approx(sum(r.gpu_energy.values()) / KWH * 100.0, rel=1e-12)


async def test_recording_emissions_equal_the_sum_of_its_windows(tmp_path: Path) -> None:
    steps = [(0, 200.0, 0.2), (1100 * MS, 700.0, 0.5), (1900 * MS, 90.0, 0.1)]
    carbon = CarbonConfig(
        source="file", file=str(intensity_file(tmp_path / "grid.csv", steps)), pue=1.1
    )
    config = SimConfig(
        num_gpus=2, workload=SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1), seed=5
    )
    edges = [500, 800, 1300, 1700, 2600]
    spans = [(a * MS, b * MS) for a, b in itertools.pairwise(edges)]
    path = tmp_path / "run.zarc"
    results = await measure(config, spans, carbon, record=path, end_ns=3200 * MS)
    rec = Recording(path)
    em = rec.emissions(carbon, START + edges[0] * MS, START + edges[-1] * MS)
    assert em.total is not None and em.gpu is not None and em.cpu is None
    assert set(em.devices) == {"gpu:0", "gpu:1"}
    # The recording's windows, each measured from the recording: they add up, to rounding.
    parts = [rec.emissions(carbon, m.start_ns, m.end_ns).total for m in rec.windows()]
    assert [m.name for m in rec.windows()] == ["w0", "w1", "w2", "w3"]
    assert em.total.co2e_g == pytest.approx(sum(p.co2e_g for p in parts if p), rel=1e-9)
    assert em.total.cost == pytest.approx(sum(p.cost or 0 for p in parts if p), rel=1e-9)
    assert em.total.kwh == pytest.approx(sum(p.kwh for p in parts if p), rel=1e-9)
    assert em.total.pue == 1.1 and em.total.source == "file:grid.csv"
    # And the live windows' footprints agree with them as their energies do (the live
    # tracker saw the data up to each window's end only: within the counter split).
    for r, p in zip(results, parts, strict=True):
        assert r.footprint is not None and p is not None
        assert r.footprint.energy_j == pytest.approx(p.energy_j, rel=0.06)
        assert r.footprint.co2e_g / r.total_energy == pytest.approx(p.co2e_g / p.energy_j, rel=0.02)
    # The whole recording: every device over its own samples.
    whole = rec.emissions(carbon)
    assert whole.total is not None and whole.total.energy_j == pytest.approx(
        rec.totals().total_energy_j, rel=1e-9
    )
