"""The pipeline time-energy frontier planner: schedules, the DAG's exact time and energy, the
frontier against brute force (every plan of small pipelines), pick semantics and validation."""

from __future__ import annotations

import csv
import io
import itertools
import math
import random
from collections.abc import Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeus_async.optimizer.pipeline.planner import (
    INSTRUCTIONS,
    Frontier,
    InstructionProfile,
    PipelineSchedule,
    evaluate,
    plan_frontier,
)

OpKey = tuple[int, int, str]
Table = dict[tuple[int, str], dict[int, tuple[float, float]]]

F, B = "forward", "backward"


def fb(spec: str) -> list[tuple[str, int]]:
    """``"F0 F1 B0"`` -> ``[("forward", 0), ("forward", 1), ("backward", 0)]``."""
    return [({"F": F, "B": B}[tok[0]], int(tok[1:])) for tok in spec.split()]


# ---------------------------------------------------------------------------------------------
# Schedules


@pytest.mark.parametrize(
    ("stages", "microbatches", "expected"),
    [
        (1, 3, ["F0 B0 F1 B1 F2 B2"]),
        (
            4,
            8,
            [
                "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
                "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
            ],
        ),
        # Fewer microbatches than stages: the warm-up is capped at M.
        (3, 2, ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]),
        (4, 1, ["F0 B0", "F0 B0", "F0 B0", "F0 B0"]),
    ],
)
def test_1f1b_stage_orders(stages: int, microbatches: int, expected: list[str]) -> None:
    schedule = PipelineSchedule("1f1b", stages, microbatches)
    assert [schedule.stage_order(s) for s in range(stages)] == [fb(x) for x in expected]


def _deepspeed_1f1b(stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """DeepSpeed's ``TrainSchedule`` step mapping (also lowtime's ``Synchronous1F1B``),
    written independently of the planner: step ``k`` of ``2 (M + S - 1)`` runs a forward when
    ``k`` and the stage have the same parity."""
    out = []
    for step in range(2 * (microbatches + stages - 1)):
        if step % 2 == stage % 2:
            mb, instr = step // 2 - stage // 2, F
        elif step % 2 == 0:
            mb, instr = step // 2 - stages + (stage + 1) // 2, B
        else:
            mb, instr = (step - 1) // 2 - stages + 1 + stage // 2, B
        if 0 <= mb < microbatches:
            out.append((instr, mb))
    return out


def test_1f1b_matches_deepspeed_and_lowtime_order() -> None:
    for stages in range(1, 9):
        for microbatches in range(1, 12):
            schedule = PipelineSchedule("1f1b", stages, microbatches)
            for s in range(stages):
                assert schedule.stage_order(s) == _deepspeed_1f1b(stages, microbatches, s)


def test_gpipe_stage_order() -> None:
    schedule = PipelineSchedule("gpipe", 3, 3)
    for s in range(3):
        assert schedule.stage_order(s) == fb("F0 F1 F2 B0 B1 B2")
    assert schedule.num_instructions == 18


@pytest.mark.parametrize(
    ("kind", "stages", "microbatches"),
    [("interleaved", 2, 2), ("1f1b", 0, 2), ("gpipe", 2, 0), ("1f1b", True, 2), ("1f1b", 2.0, 2)],
)
def test_schedule_validation(kind: str, stages: object, microbatches: object) -> None:
    with pytest.raises(ValueError):
        PipelineSchedule(kind, stages, microbatches)  # type: ignore[arg-type]


def test_stage_order_out_of_range() -> None:
    schedule = PipelineSchedule("1f1b", 2, 2)
    for stage in (-1, 2):
        with pytest.raises(ValueError, match="out of range"):
            schedule.stage_order(stage)


# ---------------------------------------------------------------------------------------------
# Exact time and energy of a plan


def uniform_plan(
    schedule: PipelineSchedule, freq: int | Mapping[tuple[int, str], int]
) -> dict[OpKey, int]:
    return {
        (s, m, i): freq if isinstance(freq, int) else freq[(s, i)]
        for s in range(schedule.num_stages)
        for i in INSTRUCTIONS
        for m in range(schedule.num_microbatches)
    }


# Two stages, two clocks. At 1000 MHz: stage 0 forward 1 s / 4 J, backward 2 s / 8 J; stage 1
# forward 2 s / 6 J, backward 3 s / 9 J. At 2000 MHz stage 1's backward takes 2 s and 12 J.
HAND = InstructionProfile(
    {
        (0, F): {1000: (1.0, 4.0)},
        (0, B): {1000: (2.0, 8.0)},
        (1, F): {1000: (2.0, 6.0)},
        (1, B): {1000: (3.0, 9.0), 2000: (2.0, 12.0)},
    }
)


def test_evaluate_hand_computed_1f1b() -> None:
    # stage 0: F0 F1 B0 B1, stage 1: F0 B0 F1 B1.
    # s0F0 [0,1] s0F1 [1,2] s1F0 [1,3] s1B0 [3,6] s1F1 [6,8] s0B0 [6,8] s1B1 [8,11] s0B1 [11,13]
    schedule = PipelineSchedule("1f1b", 2, 2)
    plan = uniform_plan(schedule, 1000)
    assert evaluate(HAND, schedule, plan) == (13.0, 54.0)
    # Idle: stage 0 busy 6 s, stage 1 busy 10 s -> (13 - 6) + (13 - 10) = 10 s at 2.5 W.
    assert evaluate(HAND, schedule, plan, p_block_w=2.5) == (13.0, 79.0)
    # Stage 1 backwards at 2000 MHz: s1B0 [3,5] s1F1 [5,7] s0B0 [5,7] s1B1 [7,9] s0B1 [9,11].
    for m in range(2):
        plan[(1, m, B)] = 2000
    # Energy 54 + 2 * 3 J; idle (11 - 6) + (11 - 8) = 8 s.
    assert evaluate(HAND, schedule, plan) == (11.0, 60.0)
    assert evaluate(HAND, schedule, plan, p_block_w=0.5) == (11.0, 64.0)
    # Only microbatch 1's: s1B0 [3,6] s1F1 [6,8] s0B0 [6,8] s1B1 [8,10] s0B1 [10,12].
    plan[(1, 0, B)] = 1000
    assert evaluate(HAND, schedule, plan) == (12.0, 57.0)


def test_evaluate_hand_computed_gpipe() -> None:
    # stage 0: F0 F1 B0 B1, stage 1: F0 F1 B0 B1.
    # s0F0 [0,1] s0F1 [1,2] s1F0 [1,3] s1F1 [3,5] s1B0 [5,8] s1B1 [8,11] s0B0 [8,10] s0B1 [11,13]
    schedule = PipelineSchedule("gpipe", 2, 2)
    assert evaluate(HAND, schedule, uniform_plan(schedule, 1000), p_block_w=1.0) == (13.0, 64.0)
    # One stage: a chain, no idle time.
    one = InstructionProfile({(0, F): {1: (0.25, 1.0)}, (0, B): {1: (0.5, 2.0)}})
    chain = PipelineSchedule("gpipe", 1, 3)
    assert evaluate(one, chain, uniform_plan(chain, 1), p_block_w=100.0) == (2.25, 9.0)


def test_evaluate_validation() -> None:
    schedule = PipelineSchedule("1f1b", 2, 2)
    plan = uniform_plan(schedule, 1000)
    with pytest.raises(ValueError, match="no frequency"):
        evaluate(HAND, schedule, {k: v for k, v in plan.items() if k != (1, 1, B)})
    with pytest.raises(ValueError, match="not in the schedule"):
        evaluate(HAND, schedule, {**plan, (0, 2, F): 1000})
    with pytest.raises(ValueError, match="not profiled"):
        evaluate(HAND, schedule, {**plan, (0, 0, F): 2000})
    with pytest.raises(ValueError, match="p_block_w"):
        evaluate(HAND, schedule, plan, p_block_w=-1.0)
    with pytest.raises(ValueError, match="missing instruction profiles: stage 2 forward"):
        evaluate(HAND, PipelineSchedule("1f1b", 3, 2), plan)


# ---------------------------------------------------------------------------------------------
# Profiles


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({}, "empty instruction profile"),
        ({(0, F): {}}, "empty profile for stage 0 forward"),
        ({(0, "recompute"): {1: (1.0, 1.0)}}, "unknown instruction"),
        ({(-1, F): {1: (1.0, 1.0)}}, "stage"),
        ({(0, F): {0: (1.0, 1.0)}}, "frequency"),
        ({(0, F): {1: (0.0, 1.0)}}, "time must be above 0"),
        ({(0, F): {1: (-1.0, 1.0)}}, "time must be above 0"),
        ({(0, F): {1: (math.inf, 1.0)}}, "time must be above 0"),
        ({(0, F): {1: (1e308, 1.0)}}, "at most 86400 s"),  # sums over a pipeline: no overflow
        ({(0, F): {1: (1.0, -0.5)}}, "energy must be within 0..1e"),
        ({(0, F): {1: (1.0, math.nan)}}, "energy must be within 0..1e"),
        ({(0, F): {1: (1.0, 1e300)}}, "energy must be within 0..1e"),
    ],
)
def test_profile_validation(table: Table, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        InstructionProfile(table)


def test_profile_must_cover_the_schedule() -> None:
    partial = InstructionProfile(
        {(0, F): {1: (1.0, 1.0)}, (0, B): {1: (1.0, 1.0)}, (1, F): {1: (1.0, 1.0)}}
    )
    with pytest.raises(ValueError, match="missing instruction profiles: stage 1 backward"):
        plan_frontier(partial, PipelineSchedule("1f1b", 2, 2))
    with pytest.raises(ValueError, match=r"stages \[1\] beyond"):
        plan_frontier(partial, PipelineSchedule("1f1b", 1, 2))


def test_profile_from_rows() -> None:
    text = (
        "rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy\n"
        "0,0,0,0,0,forward,1980,0.010,3.0\n"
        "1,0,0,1,0,forward,1980,0.012,5.0\n"  # a tensor-parallel peer: averaged
        "0,0,0,0,0,backward,1980,0.020,6.0\n"
        "2,0,1,0,1,forward,1500,0.011,2.0\n"
        "2,0,1,0,1,backward,1500,0.021,4.0\n"
    )
    from_dicts = InstructionProfile.from_rows(csv.DictReader(io.StringIO(text)))
    tuples = [
        (
            int(r[0]),
            int(r[1]),
            int(r[2]),
            int(r[3]),
            int(r[4]),
            r[5],
            int(r[6]),
            float(r[7]),
            float(r[8]),
        )
        for r in list(csv.reader(io.StringIO(text)))[1:]
    ]
    from_tuples = InstructionProfile.from_rows(tuples)
    from_short = InstructionProfile.from_rows([t[4:] for t in tuples])
    for profile in (from_dicts, from_tuples, from_short):
        assert profile.stages == [0, 1]
        assert profile.measurements(0, F) == {1980: (0.011, 4.0)}
        assert profile.measurements(1, B) == {1500: (0.021, 4.0)}
    with pytest.raises(ValueError, match="row 0"):
        InstructionProfile.from_rows([(0, F, 1980, 0.1)])
    with pytest.raises(ValueError, match="row 1"):
        InstructionProfile.from_rows([(0, F, 1980, 0.1, 1.0), (0, F, "x", 0.1, 1.0)])
    with pytest.raises(ValueError, match="frequency must be an integer"):
        InstructionProfile.from_rows([(0, F, 1980.5, 0.1, 1.0)])
    with pytest.raises(ValueError, match="unknown instruction"):
        InstructionProfile.from_rows([(0, "sideways", 1980, 0.1, 1.0)])


def test_dominated_clocks() -> None:
    profile = InstructionProfile(
        {
            (0, F): {
                1500: (2.0, 5.0),
                1400: (2.5, 6.0),  # slower and more energy than 1500
                1300: (2.0, 5.0),  # ties 1500: the higher clock is kept
                1200: (3.0, 4.0),
                1980: (1.0, 9.0),
            },
        }
    )
    assert profile.frontier(0, F) == [(1980, 1.0, 9.0), (1500, 2.0, 5.0), (1200, 3.0, 4.0)]
    # Idle power makes a slower clock worth it: 1400 costs 6 - 2.5 * 3 = -1.5 effective joules,
    # less than 1500's 5 - 2 * 3 = -1 (and 1200's 4 - 3 * 3 = -5 beats both).
    assert [f for f, _, _ in profile.frontier(0, F, p_block_w=3.0)] == [1980, 1500, 1400, 1200]
    # Idle power only ever adds clocks: a faster one always costs more effective energy.
    assert [f for f, _, _ in profile.frontier(0, F, p_block_w=100.0)] == [1980, 1500, 1400, 1200]


def test_idle_power_keeps_a_slower_costlier_clock() -> None:
    """With ``p_block_w`` a clock that is slower and costs more energy (dominated in time and
    energy) can still win on an instruction with slack: it spends less than running fast and
    then idling. The frontier must find such plans."""
    profile = InstructionProfile(
        {
            (0, F): {2000: (1.0, 10.0), 1000: (2.0, 11.0)},
            (0, B): {2000: (1.0, 10.0)},
            (1, F): {2000: (5.0, 10.0)},
            (1, B): {2000: (5.0, 10.0)},
        }
    )
    schedule = PipelineSchedule("1f1b", 2, 2)
    frontier = plan_frontier(profile, schedule, p_block_w=5.0)
    best = frontier.pick()
    assert best.frequencies[(0, 1, F)] == 1000  # stage 0's second forward has 3 s of slack
    fast = uniform_plan(schedule, 2000)
    t_fast, e_fast = evaluate(profile, schedule, fast, p_block_w=5.0)
    assert best.iteration_time_s == t_fast
    assert best.energy_j == e_fast - 4.0  # 1 J more energy, 1 s less idling at 5 W


# ---------------------------------------------------------------------------------------------
# Brute force


def brute_force(
    profile: InstructionProfile, schedule: PipelineSchedule, p_block_w: float
) -> list[tuple[float, float]]:
    """Pareto set of every plan, every profiled clock included (dominated ones too)."""
    keys = [
        (s, m, i)
        for s in range(schedule.num_stages)
        for i in INSTRUCTIONS
        for m in range(schedule.num_microbatches)
    ]
    clocks = [sorted(profile.measurements(s, i)) for s, _, i in keys]
    results = sorted(
        evaluate(profile, schedule, dict(zip(keys, combo, strict=True)), p_block_w=p_block_w)
        for combo in itertools.product(*clocks)
    )
    pareto: list[tuple[float, float]] = []
    for t, e in results:
        if not pareto or e < pareto[-1][1]:
            pareto.append((t, e))
    return pareto


def random_profile(rng: random.Random, stages: int, clocks: int) -> InstructionProfile:
    """Arbitrary (non-convex, unordered) times and energies."""
    return InstructionProfile(
        {
            (s, i): {
                1000 + 100 * k: (rng.uniform(0.5, 3.0), rng.uniform(1.0, 10.0))
                for k in range(clocks)
            }
            for s in range(stages)
            for i in INSTRUCTIONS
        }
    )


def gpu_profile(rng: random.Random, stages: int, clocks: list[int]) -> InstructionProfile:
    """GPU-like curves: time ~ a memory-bound part plus a part in 1/f, power rising
    superlinearly with f, backward about twice forward, a little measurement noise."""
    table: Table = {}
    top = max(clocks)
    for s in range(stages):
        mem, p_static, p_dyn = rng.uniform(0.1, 0.3), rng.uniform(70, 100), rng.uniform(250, 330)
        for i in INSTRUCTIONS:
            t0 = 0.03 * rng.uniform(0.85, 1.15) * (2.0 if i == B else 1.0)
            table[(s, i)] = {}
            for f in clocks:
                x = f / top
                t = t0 * (mem + (1 - mem) / x) * rng.uniform(0.99, 1.01)
                table[(s, i)][f] = (t, (p_static + p_dyn * x**2.5) * rng.uniform(0.99, 1.01) * t)
    return InstructionProfile(table)


def check_frontier(
    frontier: Frontier, profile: InstructionProfile, schedule: PipelineSchedule, p_block_w: float
) -> None:
    """Sorted, Pareto, and every point exactly what evaluate says of its clocks."""
    points = frontier.points
    assert points
    for a, b in itertools.pairwise(points):
        assert a.iteration_time_s < b.iteration_time_s
        assert a.energy_j > b.energy_j
    for p in points:
        assert evaluate(profile, schedule, p.frequencies, p_block_w=p_block_w) == (
            p.iteration_time_s,
            p.energy_j,
        )
    fastest = {
        k: min(profile.measurements(k[0], k[2]).items(), key=lambda kv: kv[1][0])[0]
        for k in points[0].frequencies
    }
    assert points[0].iteration_time_s == evaluate(profile, schedule, fastest)[0]


SMALL_CASES = [
    (kind, stages, microbatches, clocks, p_block_w, seed)
    for seed, (kind, stages, microbatches, clocks, p_block_w) in enumerate(
        [
            ("1f1b", 2, 2, 3, 0.0),
            ("1f1b", 2, 2, 3, 2.0),
            ("gpipe", 2, 2, 3, 0.0),
            ("gpipe", 2, 2, 3, 1.5),
            ("1f1b", 2, 3, 2, 0.0),
            ("1f1b", 3, 2, 2, 3.0),
            ("gpipe", 3, 2, 2, 0.5),
            ("1f1b", 1, 3, 4, 0.0),
        ]
    )
]


@pytest.mark.parametrize(
    ("kind", "stages", "microbatches", "clocks", "p_block_w", "seed"), SMALL_CASES
)
def test_exhaustive_frontier_equals_brute_force(
    kind: str, stages: int, microbatches: int, clocks: int, p_block_w: float, seed: int
) -> None:
    """Small problems are enumerated: the frontier is exactly the brute-force Pareto set, even
    though brute force also tries every dominated clock."""
    rng = random.Random(seed)
    profile = random_profile(rng, stages, clocks)
    schedule = PipelineSchedule(kind, stages, microbatches)  # type: ignore[arg-type]
    frontier = plan_frontier(profile, schedule, p_block_w=p_block_w)
    check_frontier(frontier, profile, schedule, p_block_w)
    exact = brute_force(profile, schedule, p_block_w)
    assert [(p.iteration_time_s, p.energy_j) for p in frontier.points] == exact


#: Without enumeration the planner rounds the convex relaxation's optimum to real clocks: with
#: 2-4 clocks ~330 MHz apart (far coarser than real profiles) its plan at a deadline can miss
#: the discrete optimum by a clock step on a few instructions. Over these cases the worst miss is
#: 3.2 % (a one-stage chain, i.e. a knapsack) and the worst mean over a case's deadlines 0.9 %;
#: the same walk without its grid of intermediate states misses by up to 4.7 %.
HEURISTIC_MAX, HEURISTIC_MEAN = 1.04, 1.01


@pytest.mark.parametrize(
    ("kind", "stages", "microbatches", "clocks", "p_block_w", "seed"), SMALL_CASES
)
def test_relaxation_walk_against_brute_force(
    kind: str, stages: int, microbatches: int, clocks: int, p_block_w: float, seed: int
) -> None:
    rng = random.Random(seed)
    profile = gpu_profile(rng, stages, [1980, 1650, 1320, 990][:clocks])
    schedule = PipelineSchedule(kind, stages, microbatches)  # type: ignore[arg-type]
    p_block = 80.0 * p_block_w
    frontier = plan_frontier(profile, schedule, p_block_w=p_block, exhaustive_limit=0)
    check_frontier(frontier, profile, schedule, p_block)
    exact = brute_force(profile, schedule, p_block)
    assert frontier.fastest_time_s == exact[0][0]
    ratios = []
    for deadline, energy in exact:
        got = frontier.pick(deadline)
        assert got.iteration_time_s <= deadline
        assert got.energy_j >= energy * (1 - 1e-12)  # nothing beats the optimum
        ratios.append(got.energy_j / energy)
    assert max(ratios) <= HEURISTIC_MAX
    assert sum(ratios) / len(ratios) <= HEURISTIC_MEAN


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["1f1b", "gpipe"]),
    shape=st.sampled_from([(1, 2), (2, 1), (2, 2), (1, 3)]),
    seed=st.integers(0, 2**32 - 1),
    clocks=st.integers(1, 3),
    p_block_w=st.sampled_from([0.0, 0.7, 4.0]),
)
def test_frontier_properties(
    kind: str, shape: tuple[int, int], seed: int, clocks: int, p_block_w: float
) -> None:
    """Arbitrary (non-convex) profiles: enumeration is optimal; the walk's frontier is valid,
    meets every deadline, never beats the optimum and is never slower than possible."""
    rng = random.Random(seed)
    stages, microbatches = shape
    profile = random_profile(rng, stages, clocks)
    schedule = PipelineSchedule(kind, stages, microbatches)  # type: ignore[arg-type]
    exact = brute_force(profile, schedule, p_block_w)
    enumerated = plan_frontier(profile, schedule, p_block_w=p_block_w)
    assert [(p.iteration_time_s, p.energy_j) for p in enumerated.points] == exact
    walked = plan_frontier(profile, schedule, p_block_w=p_block_w, exhaustive_limit=0)
    check_frontier(walked, profile, schedule, p_block_w)
    assert walked.fastest_time_s == exact[0][0]
    for deadline, energy in exact:
        got = walked.pick(deadline)
        assert got.iteration_time_s <= deadline
        assert got.energy_j >= energy * (1 - 1e-12)


# ---------------------------------------------------------------------------------------------
# A realistic size, pick and stage plans


@pytest.fixture(scope="module")
def realistic() -> tuple[InstructionProfile, PipelineSchedule, Frontier]:
    profile = gpu_profile(random.Random(7), 4, list(range(1980, 1004, -75)))
    schedule = PipelineSchedule("1f1b", 4, 8)
    return profile, schedule, plan_frontier(profile, schedule, p_block_w=80.0)


def test_realistic_frontier(
    realistic: tuple[InstructionProfile, PipelineSchedule, Frontier],
) -> None:
    profile, schedule, frontier = realistic
    check_frontier(frontier, profile, schedule, 80.0)
    assert len(frontier.points) > 50
    top = uniform_plan(schedule, 1980)
    t_top, e_top = evaluate(profile, schedule, top, p_block_w=80.0)
    assert frontier.max_frequency_time_s == t_top
    no_slowdown = frontier.pick()
    assert no_slowdown.iteration_time_s <= t_top
    # 1F1B bubbles leave non-critical instructions slack: slowing them saves energy for free.
    assert no_slowdown.energy_j < 0.97 * e_top
    # Trading time for energy: 10 % slower saves more.
    assert frontier.pick(1.1 * t_top).energy_j < 0.95 * no_slowdown.energy_j


def test_pick(realistic: tuple[InstructionProfile, PipelineSchedule, Frontier]) -> None:
    _, _, frontier = realistic
    points = frontier.points
    assert frontier.pick(points[0].iteration_time_s) is points[0]
    assert frontier.pick(math.inf) is points[-1]
    for i in (1, len(points) // 2, len(points) - 2):
        lo, hi = points[i].iteration_time_s, points[i + 1].iteration_time_s
        assert frontier.pick(lo) is points[i]
        assert frontier.pick((lo + hi) / 2) is points[i]
        assert frontier.pick(math.nextafter(hi, 0.0)) is points[i]
        assert frontier.pick(hi) is points[i + 1]
    with pytest.raises(ValueError, match="below the fastest"):
        frontier.pick(math.nextafter(points[0].iteration_time_s, 0.0))
    with pytest.raises(ValueError, match="below the fastest"):
        frontier.pick(0.0)
    with pytest.raises(ValueError, match="NaN"):
        frontier.pick(math.nan)
    best = frontier.pick()
    assert best.iteration_time_s <= frontier.max_frequency_time_s
    assert all(
        p.energy_j >= best.energy_j
        for p in points
        if p.iteration_time_s <= frontier.max_frequency_time_s
    )


def test_stage_plan(realistic: tuple[InstructionProfile, PipelineSchedule, Frontier]) -> None:
    _, schedule, frontier = realistic
    point = frontier.pick(1.05 * frontier.max_frequency_time_s)
    for s in range(schedule.num_stages):
        plan = point.stage_plan(schedule, s)
        assert [name for name, _ in plan] == [name for name, _ in schedule.stage_order(s)]
        assert plan == [(i, point.frequencies[(s, m, i)]) for i, m in schedule.stage_order(s)]
    clocks = {f for _, f in point.stage_plan(schedule, 0)}
    assert len(clocks) > 1  # not one clock for the whole stage


def test_single_clock_and_time_limit() -> None:
    one = InstructionProfile(
        {(s, i): {1410: (0.01 * (s + 1), 1.0)} for s in range(3) for i in INSTRUCTIONS}
    )
    schedule = PipelineSchedule("gpipe", 3, 4)
    frontier = plan_frontier(one, schedule, p_block_w=10.0, exhaustive_limit=0)
    assert len(frontier.points) == 1
    assert frontier.pick() is frontier.points[0]
    # A walk cut short still holds the fastest plan (with its slack handed back).
    profile = gpu_profile(random.Random(3), 3, [1980, 1800, 1600, 1400])
    cut = plan_frontier(profile, schedule, exhaustive_limit=0, time_limit_s=0.0)
    check_frontier(cut, profile, schedule, 0.0)
    full = plan_frontier(profile, schedule, exhaustive_limit=0)
    assert cut.fastest_time_s == full.fastest_time_s
    assert len(cut.points) < len(full.points)


def test_progress_rises_to_one_and_a_stop_is_honoured() -> None:
    import threading

    from zeus_async.optimizer.pipeline import PlanningStopped

    rng = random.Random(5)
    clocks = [990 + 30 * k for k in range(30)]
    profile = gpu_profile(rng, 4, clocks)
    schedule = PipelineSchedule("1f1b", 4, 16)
    seen: list[float] = []
    frontier = plan_frontier(profile, schedule, exhaustive_limit=0, progress=seen.append)
    assert seen[-1] == 1.0 and seen == sorted(seen) and all(0.0 <= f <= 1.0 for f in seen)
    assert frontier == plan_frontier(profile, schedule, exhaustive_limit=0)  # same plans
    stop = threading.Event()
    stop.set()
    with pytest.raises(PlanningStopped):
        plan_frontier(profile, schedule, exhaustive_limit=0, stop=stop)
