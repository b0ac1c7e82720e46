"""Per-request accuracy per workload (issue 38, item 6), on the simulated inference engine of
``bench/inference/engine_sim.py``: a small, deterministic version of the table that
``bench/inference/bench_requests.py`` prints (fake clocks, a few hundred requests).

Targets: with the engine's steps (``policy="steps"``), at most 10 % mean per-request error on
the batching-like workload, and never worse than ``equal`` on any workload; conservation
(requests + idle == measured, per GPU) on every run; the simulator's own truth conserved.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "inference"))

import engine_sim

#: Requests per workload: enough for a stable mean, small enough for seconds of runtime (one
#: at a time is the slowest: every request runs alone, with idle gaps between).
SIZES = {
    "one_at_a_time": 40,
    "tokens_unrelated": 240,
    "batching": 300,
    "queueing_arrival": 200,
    "queueing_scheduled": 200,
    "tensor_parallel": 200,
    "processes": 200,
}
POLICIES = [
    engine_sim.Policy("equal", "equal"),
    engine_sim.Policy("tokens", "tokens"),
    engine_sim.Policy("steps", "steps"),
]

_cache: dict[str, tuple[engine_sim.Trace, dict[str, engine_sim.Measured]]] = {}


def run(workload: str) -> tuple[engine_sim.Trace, dict[str, engine_sim.Measured]]:
    if workload not in _cache:
        trace = engine_sim.simulate(workload, "memory_bound", SIZES[workload], seed=1)
        _cache[workload] = trace, engine_sim.measure(trace, POLICIES)
    return _cache[workload]


def test_every_workload_is_covered() -> None:
    assert set(SIZES) == set(engine_sim.WORKLOADS)


@pytest.mark.parametrize("workload", list(SIZES))
def test_truth_is_conserved(workload: str) -> None:
    """Per GPU, the requests' truth plus the idle with none running is the simulator's energy:
    the truth splits exactly what the GPU drew."""
    trace, _ = run(workload)
    total = math.fsum(trace.energy_j.values())
    split = math.fsum(trace.truth.values()) + math.fsum(trace.idle_j.values())
    assert split == pytest.approx(total, rel=1e-9)
    assert all(t > 0 for t in trace.truth.values())


def test_one_at_a_time_truth_is_own_plus_idle() -> None:
    """Alone on the GPU, a request's truth is its own load's energy plus all of the idle power
    while it runs."""
    trace, _ = run("one_at_a_time")
    for r in trace.requests:
        idle = engine_sim.IDLE_W * (r.end_ns - r.scheduled_ns) / engine_sim.S
        assert trace.truth[r.rid] == pytest.approx(r.own_j + idle, rel=1e-9)


@pytest.mark.parametrize("workload", list(SIZES))
def test_meter_conserves(workload: str) -> None:
    """Requests + idle == measured, per GPU, for every policy (steps and late edges too)."""
    _, got = run(workload)
    for m in got.values():
        assert m.imbalance_j < 1e-6
        assert math.isfinite(m.mean)


@pytest.mark.parametrize("workload", list(SIZES))
def test_steps_never_worse_than_equal(workload: str) -> None:
    _, got = run(workload)
    assert got["steps"].mean <= got["equal"].mean


def test_steps_on_batching_within_what_was_measured() -> None:
    # Issue 38's target is <= 10 % on batching with the engine's steps. Measured here: with a
    # weight of the device's own cost (what a user who knows the device supplies) it is met;
    # with the default weight (context scale 8192, the same for every device) it is ~12.6 %
    # on this memory-bound device (8.9 % on compute-bound, 1000 requests), above the policy's
    # own floor on exact energies (10.6 %): bench/RESULTS.md, "Inference requests". These
    # bounds keep it from getting worse.
    trace, got = run("batching")
    assert got["steps"].mean <= 0.135
    user = engine_sim.Policy("steps, user weight", "steps", engine_sim.fitted_weight(trace.device))
    assert engine_sim.measure(trace, [user])[user.label].mean <= 0.10
    compute = engine_sim.simulate("batching", "compute_bound", SIZES["batching"], seed=1)
    assert engine_sim.measure(compute, POLICIES[2:])["steps"].mean <= 0.10


def test_one_at_a_time_policies_agree() -> None:
    """With one request at a time every policy gives the request everything: what is left is
    the sensors' and the estimator's error (a few %)."""
    _, got = run("one_at_a_time")
    energies = [m.energy_j for m in got.values()]
    for e in energies[1:]:
        for rid, j in e.items():
            # (equal and steps settle a request in flight in pieces, each estimated once its
            # readings are in, as windows are; tokens settles it whole after its end: the
            # estimate at a cut is revised by later readings by ~1e-6 of the request's energy)
            assert j == pytest.approx(energies[0][rid], rel=1e-5, abs=1e-9)
    assert got["equal"].exact_mean < 1e-9  # exact energies: the policy is exact here
    assert got["equal"].mean < 0.10


def test_queueing_inside_the_request_costs_accuracy() -> None:
    """Beginning at arrival charges queued requests for others' work; at scheduling, not."""
    _, arrival = run("queueing_arrival")
    _, scheduled = run("queueing_scheduled")
    for label in ("equal", "tokens"):
        assert scheduled[label].mean < arrival[label].mean


def test_simulation_is_deterministic() -> None:
    a = engine_sim.simulate("processes", "memory_bound", 40, seed=7)
    b = engine_sim.simulate("processes", "memory_bound", 40, seed=7)
    assert a.truth == b.truth
    assert [(s.start_ns, s.entries) for s in a.steps] == [(s.start_ns, s.entries) for s in b.steps]


def test_tensor_parallel_runs_on_both_gpus() -> None:
    trace, got = run("tensor_parallel")
    assert set(trace.energy_j) == {0, 1}
    assert all(r.gpus == (0, 1) for r in trace.requests)
    # each GPU carries half of every request's own load
    assert trace.energy_j[0] == pytest.approx(trace.energy_j[1], rel=1e-9)
    assert got["steps"].mean < got["equal"].mean


def test_processes_have_disjoint_ids_and_overlapping_steps() -> None:
    trace, _ = run("processes")
    engines: dict[int, Any] = {}
    for r in trace.requests:
        engines.setdefault(r.engine, set()).add(r.rid.split("-")[0])
    assert engines == {0: {"p0"}, 1: {"p1"}}
    by_engine = [[s for s in trace.steps if s.engine == e] for e in (0, 1)]
    overlaps = sum(
        1
        for a in by_engine[0][:200]
        for b in by_engine[1][:200]
        if a.start_ns < b.end_ns and b.start_ns < a.end_ns
    )
    assert overlaps > 0
