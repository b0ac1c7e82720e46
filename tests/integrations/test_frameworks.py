"""Energy in Hugging Face's and Lightning's own logs, alone and on several ranks (real
processes, torch CPU over gloo), with the power-limit optimizer's callbacks beside them."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from zeus_async.devices.sim import SimConfig
from zeus_async.testing.procs import run_ranks, sim_env

JOB = Path(__file__).with_name("frameworks_job.py")
IDLE_W = 70.0  # each simulated GPU, idle
MODULES = {"hf": "transformers", "lightning": "lightning"}


def _need(framework: str) -> None:
    """``.ci/run`` installs both frameworks and requires them; elsewhere their tests skip."""
    if os.environ.get("ZEUS_ASYNC_REQUIRE_FRAMEWORKS"):
        importlib.import_module(MODULES[framework])
    else:
        pytest.importorskip(MODULES[framework])


def _run(framework: str, *options: str, world_size: int = 1) -> list[dict[str, Any]]:
    _need(framework)
    argv = [sys.executable, str(JOB), framework, *options]
    env = sim_env(SimConfig())
    if world_size == 1:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        outs = [proc.stdout]
    else:
        outs = run_ranks(argv, env, world_size=world_size, timeout=180)
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


#: The single-rank jobs, by the test that reads each one's output.
SINGLE = {
    "test_hf_logs_carry_energy_for_every_integration": ("hf",),
    "test_lightning_logged_metrics_carry_energy": ("lightning",),
    "test_hf_logs_carry_co2e_and_cost_beside_the_energy": ("hf", "carbon"),
    "test_lightning_logged_metrics_carry_co2e_and_cost": ("lightning", "carbon"),
}


@pytest.fixture(scope="module")
def single(request: pytest.FixtureRequest) -> Iterator[Callable[..., dict[str, Any]]]:
    """``single(framework, *options)``: that job's output, run alone (one rank).

    The jobs of every selected test of this module start together when the first is needed:
    each is its own process with its own private directory (``ZEUS_ASYNC_DIR``), so they
    share nothing, and the interpreter starts and framework imports that are most of each
    job's time overlap instead of queueing."""
    selected = {
        item.name
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.module is request.module
    }
    outputs = Path(tempfile.mkdtemp(prefix="zf-"))  # files, not pipes: nobody reads them yet
    jobs: dict[tuple[str, ...], tuple[subprocess.Popen[bytes], str, Path]] = {}
    for name, args in SINGLE.items():
        if name in selected and importlib.util.find_spec(MODULES[args[0]]) is not None:
            private = tempfile.mkdtemp(prefix="za-")
            env = sim_env(SimConfig(), ZEUS_ASYNC_DIR=private)
            base = outputs / "-".join(args)
            with open(f"{base}.out", "wb") as out, open(f"{base}.err", "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, str(JOB), *args], env=env, stdout=out, stderr=err
                )
            jobs[args] = (proc, private, base)

    def output(*args: str) -> dict[str, Any]:
        _need(args[0])
        proc, _, base = jobs[args]
        proc.wait(timeout=120)
        assert proc.returncode == 0, Path(f"{base}.err").read_text()
        return dict(json.loads(Path(f"{base}.out").read_text().strip().splitlines()[-1]))

    yield output
    for proc, private, _ in jobs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(private, ignore_errors=True)
    shutil.rmtree(outputs, ignore_errors=True)


def _energy_logs(history: list[dict[str, Any]]) -> list[dict[str, float]]:
    return [{k: v for k, v in e.items() if "gpu_" in k} for e in history]


def test_hf_logs_carry_energy_for_every_integration(
    single: Callable[..., dict[str, Any]],
) -> None:
    out = single("hf")
    steps = [e for e in out["history"] if "loss" in e]
    assert [e["step"] for e in steps] == [4, 8, 12, 16, 20, 24]
    total = 0.0
    for e in steps:
        # Outside a job the monitor measures every GPU: 4 simulated ones, idle.
        assert e["gpu_power_w"] == pytest.approx(4 * IDLE_W, rel=0.02)
        assert e["gpu_energy_j"] > 0
        total += e["gpu_energy_j"]
        assert e["gpu_energy_total_j"] == pytest.approx(total, rel=0.01)
    final = out["history"][-1]
    assert "train_runtime" in final
    assert final["train_gpu_energy_j"] >= steps[-1]["gpu_energy_total_j"]
    assert final["train_gpu_power_w"] == pytest.approx(4 * IDLE_W, rel=0.02)
    # No carbon configuration: no carbon figures.
    assert not any("co2e" in k or "cost" in k for e in out["history"] for k in e)


def test_lightning_logged_metrics_carry_energy(single: Callable[..., dict[str, Any]]) -> None:
    out = single("lightning")
    logged, final = out["history"]
    assert logged["gpu_power_w"] == pytest.approx(4 * IDLE_W, rel=0.02)
    assert 0 < logged["gpu_energy_j"] < logged["gpu_energy_total_j"]
    assert final["train_gpu_energy_j"] >= logged["gpu_energy_total_j"]
    assert final["train_gpu_power_w"] == pytest.approx(4 * IDLE_W, rel=0.02)


KWH = 3.6e6
G, PRICE, PUE = 300.0, 0.25, 1.5  # frameworks_job.CARBON


def _grams(joules: float) -> float:
    return joules * PUE * G / KWH


def _check_emissions(csv_text: str, train_j: float) -> None:
    import csv
    import io

    from zeus_async.store.emissions_csv import CODECARBON_COLUMNS

    rows = list(csv.reader(io.StringIO(csv_text)))
    assert tuple(rows[0]) == CODECARBON_COLUMNS and len(rows) == 2
    row = dict(zip(rows[0], rows[1], strict=True))
    # The monitor's whole life (CPU and DRAM too where present): at least the training's GPUs,
    # within what the two figures' estimates leave open. These runs last 60-100 ms, under the
    # counter's 100 ms period, and the training window is finalized before the run's (its end
    # extrapolated): the ratio was 0.977-1.009 over runs under load (0.99 failed 1 fresh-clone
    # run of 2, at 0.977, with the framework jobs started together).
    assert float(row["emissions"]) * 1000 >= _grams(train_j) * 0.95  # kg
    assert float(row["emissions_rate"]) > 0


def test_hf_logs_carry_co2e_and_cost_beside_the_energy(
    single: Callable[..., dict[str, Any]],
) -> None:
    """The callback makes its monitor with a carbon configuration (constant 300 g/kWh at
    0.25 EUR/kWh, PUE 1.5): every interval's grams and cost are its GPU energy times them, and
    the run's ``emissions.csv`` (CodeCarbon's columns) is written, as ``report_to="codecarbon"``
    would."""
    out = single("hf", "carbon")
    steps = [e for e in out["history"] if "loss" in e]
    assert len(steps) == 6
    for e in steps:
        assert e["gpu_co2e_g"] == pytest.approx(_grams(e["gpu_energy_j"]), rel=1e-3)
        assert e["gpu_cost"] == pytest.approx(e["gpu_co2e_g"] / G * PRICE, rel=1e-9)
        assert e["gpu_co2e_total_g"] == pytest.approx(_grams(e["gpu_energy_total_j"]), rel=1e-3)
        assert e["gpu_cost_total"] == pytest.approx(e["gpu_co2e_total_g"] / G * PRICE, rel=1e-9)
    final = out["history"][-1]
    assert final["train_gpu_co2e_g"] == pytest.approx(_grams(final["train_gpu_energy_j"]), rel=1e-3)
    assert final["train_gpu_cost"] == pytest.approx(final["train_gpu_co2e_g"] / G * PRICE, rel=1e-9)
    _check_emissions(out["emissions"], final["train_gpu_energy_j"])


def test_lightning_logged_metrics_carry_co2e_and_cost(
    single: Callable[..., dict[str, Any]],
) -> None:
    out = single("lightning", "carbon")
    logged, final = out["history"]
    assert logged["gpu_co2e_g"] == pytest.approx(_grams(logged["gpu_energy_j"]), rel=1e-3)
    assert logged["gpu_co2e_total_g"] == pytest.approx(
        _grams(logged["gpu_energy_total_j"]), rel=1e-3
    )
    assert logged["gpu_cost"] == pytest.approx(logged["gpu_co2e_g"] / G * PRICE, rel=1e-6)
    assert final["train_gpu_co2e_g"] == pytest.approx(_grams(final["train_gpu_energy_j"]), rel=1e-3)
    assert final["train_gpu_cost"] == pytest.approx(final["train_gpu_co2e_g"] / G * PRICE, rel=1e-6)
    _check_emissions(out["emissions"], final["train_gpu_energy_j"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("framework", "world_size", "order"),
    [("hf", 4, "early"), ("hf", 2, "late"), ("lightning", 2, "early")],
)
def test_ranks_log_the_jobs_figures_and_decide_alike(
    framework: str, world_size: int, order: str
) -> None:
    outs = _run(framework, "optimizer", order, world_size=world_size)
    assert [o["rank"] for o in outs] == list(range(world_size))
    # The callbacks were built before the process group existed, or after.
    assert all(o["group_at_build"] == (order == "late") for o in outs)
    first = outs[0]
    logs = _energy_logs(first["history"])
    assert any(logs)
    # Each rank measures its own GPU; every rank logs the job's figure: all GPUs together.
    for entry in logs:
        if "gpu_power_w" in entry:
            assert entry["gpu_power_w"] == pytest.approx(world_size * IDLE_W, rel=0.02)
    for other in outs[1:]:
        assert _energy_logs(other["history"]) == logs
        assert other["measurements"] == first["measurements"]
        assert other["optimal"] == first["optimal"]
    assert [m["power_limit"] for m in first["measurements"]] == [700, 450, 200]
    # The choice is in the framework's own logs, beside the loss (Zeus only printed it).
    limits = [e for e in first["history"] if "power_limit_w" in e]
    assert limits and {e["power_limit_w"] for e in limits} <= {700.0, 450.0, 200.0}
    chosen = [e["optimal_power_limit_w"] for e in first["history"] if "optimal_power_limit_w" in e]
    assert chosen and set(chosen) == {float(first["optimal"])}, first["history"]
