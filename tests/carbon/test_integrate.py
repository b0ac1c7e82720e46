"""Integration of a time-varying intensity against energy: exact values, energy-weighted."""

from __future__ import annotations

import itertools
import math

import pytest

from zeus_async.carbon import (
    ConstantIntensity,
    Footprint,
    Intensity,
    footprint,
    footprint_of,
)
from zeus_async.devices.sim import SimNode
from zeus_async.devices.sim_config import SimConfig
from zeus_async.devices.sim_workload import SquareWorkload
from zeus_async.errors import ConfigError

S = 1_000_000_000
T0 = 1_700_000_000 * S


class Steps:
    """A source from a fixed list of steps."""

    def __init__(self, steps: list[Intensity], name: str = "steps") -> None:
        self._steps = steps
        self.name = name
        self.calls: list[tuple[int, int]] = []

    def steps(self, t0_ns: int, t1_ns: int) -> list[Intensity]:
        self.calls.append((t0_ns, t1_ns))
        return list(self._steps)


def piecewise_power(points: list[tuple[int, float]]):
    """energy_between for a power that is ``w`` watts from each ``t`` to the next point."""

    def between(a: int, b: int) -> float:
        total = 0.0
        for i, (t, w) in enumerate(points):
            end = points[i + 1][0] if i + 1 < len(points) else math.inf
            lo, hi = max(a, t), min(b, end)
            if hi > lo:
                total += w * (hi - lo) / S
        return total

    return between


def test_energy_weighted_not_time_weighted() -> None:
    # 100 s at 900 W under 500 g/kWh, then 200 s at 100 W under 50 g/kWh.
    power = piecewise_power([(T0, 900.0), (T0 + 100 * S, 100.0)])
    source = Steps([Intensity(T0 - 10 * S, 500.0), Intensity(T0 + 100 * S, 50.0)])
    fp = footprint(power, T0, T0 + 300 * S, source)
    e1, e2 = 900.0 * 100, 100.0 * 200  # 90 kJ, 20 kJ
    assert fp.energy_j == e1 + e2
    assert fp.kwh == pytest.approx((e1 + e2) / 3.6e6, rel=1e-15)
    assert fp.co2e_g == pytest.approx((e1 * 500 + e2 * 50) / 3.6e6, rel=1e-15)
    assert fp.g_per_kwh == pytest.approx((e1 * 500 + e2 * 50) / (e1 + e2), rel=1e-15)
    assert fp.g_per_kwh == pytest.approx(418.1818181818, rel=1e-9)
    assert fp.source == "steps" and fp.pue == 1.0 and fp.overhead == 0.0
    assert fp.cost is None and fp.currency == ""
    assert source.calls == [(T0, T0 + 300 * S)]
    # The same energy spread uniformly in time gives the time-weighted figure instead.
    uniform = footprint_of(e1 + e2, T0, T0 + 300 * S, source)
    assert uniform.g_per_kwh == pytest.approx((500 * 100 + 50 * 200) / 300, rel=1e-12)
    assert uniform.co2e_g < fp.co2e_g / 2


def test_pieces_cut_at_step_boundaries_inside_the_interval() -> None:
    cuts: list[tuple[int, int]] = []
    power = piecewise_power([(T0, 300.0)])

    def between(a: int, b: int) -> float:
        cuts.append((a, b))
        return power(a, b)

    source = Steps(
        [
            Intensity(T0 - 3600 * S, 100.0),
            Intensity(T0 + 10 * S, 200.0),
            Intensity(T0 + 20 * S, 300.0),
            Intensity(T0 + 60 * S, 400.0),  # after the interval: not used
        ]
    )
    fp = footprint(between, T0 + 5 * S, T0 + 30 * S, source)
    assert cuts == [
        (T0 + 5 * S, T0 + 10 * S),
        (T0 + 10 * S, T0 + 20 * S),
        (T0 + 20 * S, T0 + 30 * S),
    ]
    assert fp.energy_j == 300.0 * 25
    assert fp.co2e_g == pytest.approx(300.0 * (5 * 100 + 10 * 200 + 10 * 300) / 3.6e6, rel=1e-15)


def test_pue_and_overhead_applied_and_stated() -> None:
    source = ConstantIntensity(400.0, 0.25, "eur")
    fp = footprint_of(3.6e6, T0, T0 + 3600 * S, source, pue=1.5, overhead=0.1)
    assert fp == Footprint(
        energy_j=3.6e6,
        kwh=1.5 * 1.1,
        co2e_g=1.5 * 1.1 * 400.0,
        cost=1.5 * 1.1 * 0.25,
        currency="EUR",
        g_per_kwh=400.0,
        source="constant",
        pue=1.5,
        overhead=0.1,
    )
    for bad in ({"pue": 0.9}, {"pue": math.nan}, {"overhead": -0.1}, {"overhead": math.inf}):
        with pytest.raises(ConfigError, match=r"pue|overhead"):
            footprint_of(1.0, T0, T0 + S, source, **bad)


def test_cost_from_time_varying_price() -> None:
    power = piecewise_power([(T0, 1000.0)])
    source = Steps(
        [Intensity(T0, 100.0, 0.10, "EUR"), Intensity(T0 + 1800 * S, 300.0, 0.40, "EUR")]
    )
    fp = footprint(power, T0, T0 + 3600 * S, source)
    assert fp.kwh == pytest.approx(1.0, rel=1e-15)
    assert fp.cost == pytest.approx(0.5 * 0.10 + 0.5 * 0.40, rel=1e-15)
    assert fp.currency == "EUR"
    assert fp.co2e_g == pytest.approx(200.0, rel=1e-15)


def test_cost_unknown_when_a_used_step_has_no_price() -> None:
    power = piecewise_power([(T0, 1000.0)])
    source = Steps([Intensity(T0, 100.0, 0.10, "EUR"), Intensity(T0 + 10 * S, 100.0)])
    fp = footprint(power, T0, T0 + 20 * S, source)
    assert fp.cost is None and fp.currency == ""
    # ... but a step without a price under which nothing was drawn does not matter
    idle = piecewise_power([(T0, 1000.0), (T0 + 10 * S, 0.0)])
    fp = footprint(idle, T0, T0 + 20 * S, source)
    assert fp.cost == pytest.approx(1000 * 10 / 3.6e6 * 0.10, rel=1e-15) and fp.currency == "EUR"


def test_mixed_currencies_refused() -> None:
    power = piecewise_power([(T0, 1.0)])
    source = Steps([Intensity(T0, 1.0, 1.0, "EUR"), Intensity(T0 + S, 1.0, 1.0, "USD")])
    with pytest.raises(ConfigError, match="EUR and USD"):
        footprint(power, T0, T0 + 2 * S, source)


def test_no_energy_and_empty_interval() -> None:
    source = Steps([Intensity(T0 - S, 250.0, 0.2, "GBP")])
    fp = footprint(lambda a, b: 0.0, T0, T0 + S, source)
    assert (fp.energy_j, fp.kwh, fp.co2e_g, fp.cost, fp.currency, fp.g_per_kwh) == (
        0.0,
        0.0,
        0.0,
        0.0,
        "GBP",
        250.0,
    )
    fp = footprint_of(7.2e6, T0, T0, source)  # all of it at the intensity in force at T0
    assert (fp.kwh, fp.co2e_g, fp.cost) == (2.0, 500.0, 0.4)
    with pytest.raises(ConfigError, match="before it starts"):
        footprint(lambda a, b: 0.0, T0, T0 - 1, source)


def test_source_that_starts_late_is_refused() -> None:
    with pytest.raises(ConfigError, match="after the interval's start"):
        footprint(lambda a, b: 1.0, T0, T0 + S, Steps([Intensity(T0 + 1, 1.0)]))


def test_exact_on_the_simulator() -> None:
    """A square workload (2 s at full power, 2 s idle) under an intensity that is 600 g/kWh
    during the busy halves and 60 during the idle ones: the footprint is the simulator's exact
    energy of each half times its own intensity."""
    period = 4.0
    config = SimConfig(
        num_gpus=1,
        workload=SquareWorkload(period_s=period, duty=0.5, high=1.0, low=0.0),
        epoch_ns=T0,
    )
    node = SimNode(config, shared_state=False)
    steps = [
        Intensity(T0 + k * 2 * S, 600.0 if k % 2 == 0 else 60.0, 0.3 if k % 2 == 0 else 0.1, "EUR")
        for k in range(10)
    ]
    source = Steps(steps, "sim-steps")
    t0, t1 = T0 + S // 2, T0 + 17 * S + S // 4  # not on boundaries
    fp = footprint(lambda a, b: node.truth_energy_j(0, a, b), t0, t1, source, pue=1.2)

    bounds = [t0, *(s.start_ns for s in steps if t0 < s.start_ns < t1), t1]
    energies = [node.truth_energy_j(0, a, b) for a, b in itertools.pairwise(bounds)]
    gs = [600.0 if ((a - T0) // (2 * S)) % 2 == 0 else 60.0 for a in bounds[:-1]]
    prices = [0.3 if g == 600.0 else 0.1 for g in gs]
    total = node.truth_energy_j(0, t0, t1)
    assert fp.energy_j == pytest.approx(total, rel=1e-12)
    assert fp.kwh == pytest.approx(total / 3.6e6 * 1.2, rel=1e-12)
    assert fp.co2e_g == pytest.approx(
        sum(e * g for e, g in zip(energies, gs, strict=True)) / 3.6e6 * 1.2, rel=1e-12
    )
    assert fp.cost == pytest.approx(
        sum(e * p for e, p in zip(energies, prices, strict=True)) / 3.6e6 * 1.2, rel=1e-12
    )
    busy = sum(e for e, g in zip(energies, gs, strict=True) if g == 600.0)
    idle = total - busy
    assert busy > 2 * idle  # the busy halves draw most of the energy ...
    # ... so the energy-weighted intensity is well above the time-weighted one.
    uniform = footprint_of(total, t0, t1, source, pue=1.2)
    assert fp.g_per_kwh > uniform.g_per_kwh + 100
