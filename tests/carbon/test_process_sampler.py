"""A time-varying intensity integrated against the energy timeline with the default sampler
(in a child process, or a node agent shared by clients of different carbon configurations).

The sampler runs in another process on the real clock, so the windows are real time: a
square wave of power (the simulator's, aligned to a chosen epoch) under a grid that is dirty
exactly while the power is high. The agent splits each window's energy where the client's
intensity changes; spreading the energy evenly over the window instead is about 38 % off, so
a 3 % tolerance (the counter estimator at each step boundary, 10 ms sampling, against
boundaries 400 ms apart) tells the two apart with a wide margin.
"""

from __future__ import annotations

import datetime
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeus_async import Monitor
from zeus_async.aggregate import WindowResult
from zeus_async.carbon import CarbonConfig, footprint_of
from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.devices.sim_workload import SquareWorkload
from zeus_async.testing.procs import sim_env, start_node_agent

S = 1_000_000_000
MS = 1_000_000
KWH = 3.6e6
HALF = 400 * MS  # the square wave's half period, and the intensity's step
DIRTY, CLEAN = 800.0, 50.0
DIRTY_PRICE, CLEAN_PRICE = 0.3, 0.1

# The workload's epoch: whole seconds, a little before the test runs.
EPOCH = (time.time_ns() // S - 5) * S
CONFIG = SimConfig(
    num_gpus=2,
    workload=SquareWorkload(period_s=2 * HALF / S, duty=0.5, high=1.0, low=0.1),
    seed=5,
    epoch_ns=EPOCH,
)


def iso(t_ns: int) -> str:
    moment = datetime.datetime.fromtimestamp(t_ns // S, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{(t_ns % S) // 1000:06d}Z"


def grid_file(path: Path, *, until_s: int = 600) -> tuple[Path, list[tuple[int, float, float]]]:
    """Dirty (and dear) while the square wave is high, clean while it is low."""
    steps = []
    for k in range(until_s * S // HALF):
        high = k % 2 == 0
        steps.append(
            (
                EPOCH + k * HALF,
                DIRTY if high else CLEAN,
                DIRTY_PRICE if high else CLEAN_PRICE,
            )
        )
    lines = ["timestamp,g_per_kwh,price_per_kwh,currency"]
    lines += [f"{iso(t)},{g},{p},EUR" for t, g, p in steps]
    path.write_text("\n".join(lines) + "\n")
    return path, steps


def truth(
    gpus: list[int], t0: int, t1: int, steps: list[tuple[int, float, float]]
) -> tuple[float, float, float]:
    """Joules, grams and cost from the simulator's exact energy of each intensity piece."""
    node = SimNode(CONFIG, shared_state=False)
    joules = grams = cost = 0.0
    for k, (start, g, price) in enumerate(steps):
        a = max(t0, start)
        b = min(t1, steps[k + 1][0] if k + 1 < len(steps) else t1)
        if b <= a:
            continue
        e = sum(node.truth_energy_j(gpu, a, b) for gpu in gpus)
        joules += e
        grams += e / KWH * g
        cost += e / KWH * price
    return joules, grams, cost


def check_integrated(
    r: WindowResult, carbon: CarbonConfig, steps: list[tuple[int, float, float]]
) -> None:
    fp = r.footprint
    assert fp is not None and fp.source == "file:grid.csv"
    joules, grams, cost = truth([0, 1], r.start_ns, r.end_ns, steps)
    assert r.total_energy == pytest.approx(joules, rel=0.03)
    assert fp.energy_j == pytest.approx(r.total_energy, rel=0.03)
    assert fp.co2e_g == pytest.approx(grams, rel=0.03)
    assert fp.cost == pytest.approx(cost, rel=0.03) and fp.currency == "EUR"
    # Spread evenly, the same energy would be charged the time-average intensity: far off.
    even = footprint_of(r.total_energy, r.start_ns, r.end_ns, carbon.open())
    assert abs(even.co2e_g - grams) / grams > 0.25
    assert r.gpu_footprint is not None and r.gpu_footprint.co2e_g == pytest.approx(
        fp.co2e_g, rel=1e-9
    )  # no RAPL: every joule is a GPU's


def test_default_sampler_integrates_a_time_varying_intensity(tmp_path: Path) -> None:
    path, steps = grid_file(tmp_path / "grid.csv")
    carbon = CarbonConfig(source="file", file=str(path))
    with Monitor(
        backend="sim", cpu_indices=[], sim_config=CONFIG, agent=False, carbon=carbon
    ) as mon:
        assert mon._process is not None  # the default: a sampler process
        mon.begin_window("w", sync_execution=False)
        time.sleep(2.5)  # about three periods of the wave, six intensity steps
        r = mon.end_window("w", sync_execution=False)
        r.wait(30)
    check_integrated(r, carbon, steps)
    assert r._pieces is not None and len(r._pieces) >= 6  # split by the agent


@pytest.fixture
def node_agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[str]]:
    monkeypatch.setenv("ZEUS_ASYNC_SIM", CONFIG.to_json())
    proc = start_node_agent(sim_env(CONFIG))
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)


@pytest.mark.slow
def test_clients_of_one_node_agent_each_with_its_own_intensity(
    node_agent: subprocess.Popen[str], tmp_path: Path
) -> None:
    # Two clients of one agent, over the same stretch of time: one with the time series, one
    # with a constant and a PUE, one with none. Each is charged its own.
    path, steps = grid_file(tmp_path / "grid.csv")
    varying = CarbonConfig(source="file", file=str(path))
    constant = CarbonConfig(source="constant", g_per_kwh=300.0, pue=1.5)
    with (
        Monitor(gpu_indices=[0, 1], carbon=varying) as a,
        Monitor(gpu_indices=[0, 1], carbon=constant) as b,
        Monitor(gpu_indices=[0, 1]) as c,
    ):
        for mon in (a, b, c):
            assert mon._process is not None and mon._process.attached
        for mon in (a, b, c):
            mon.begin_window("w", sync_execution=False)
        time.sleep(2.5)
        ra, rb, rc = (mon.end_window("w", sync_execution=False) for mon in (a, b, c))
        for r in (ra, rb, rc):
            r.wait(30)
    check_integrated(ra, varying, steps)
    fb = rb.footprint
    assert fb is not None and fb.source == "constant" and fb.pue == 1.5
    assert fb.co2e_g == pytest.approx(rb.total_energy / KWH * 1.5 * 300.0, rel=1e-12)
    assert rc.footprint is None and rc.co2e_g is None
