"""Pipeline frequency planner: our time-energy frontier vs lowtime 0.3.0 (Perseus), same DAGs.

Both plan the same iteration DAG from the same synthetic GPU-like instruction profiles (time a
memory-bound floor plus a 1/f part, power rising superlinearly with the clock, backward about
2x forward, per-stage variation and 1 % measurement noise; 17 clocks 1980..1020 MHz) with the
same objective: energy = sum of instruction energies + P_block x idle time of every stage.

lowtime is driven as Perseus drives it (lowtime's ``examples/perseus.py``): per stage and
instruction, ``CandidateExecutionOptions`` (Pareto filter, time quantized to ``--unit-time``),
costs made effective energy (``cost -= P_block x quant_time x unit_time``), an
``ExponentialModel`` fit, then ``PhillipsDessouky(dag).run()``; each iteration's plan is every
instruction's ``assigned_knob`` (the slowest clock meeting its quantized duration). The DAG has
the same nodes and edges as ours (the stage order is checked against lowtime's
``Synchronous1F1B`` for 1F1B). lowtime's time covers option building, model fitting, DAG
construction and the solver, collecting the plan of every iteration; ours is one
``plan_frontier`` call, run in the same process just before.

Every lowtime plan is then evaluated exactly (our ``evaluate``, real measured times and
energies, not lowtime's quantized/fitted ones), its time is used as a deadline, and our
``Frontier.pick(deadline)`` must meet it with at most 1.01x the energy of lowtime's plan.
Exits 1 if a deadline is missed, a ratio exceeds 1.01, a frontier point is not exact, or ours
is slower.

Run: ``bench/.venv/bin/python bench/pfo/bench_planner.py [--quick] [--json PATH]``
(``bench/.venv`` has ``lowtime==0.3.0``: ``bench/.venv/bin/pip install lowtime==0.3.0``).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zeus_async.optimizer.pipeline.planner import (
    INSTRUCTIONS,
    Frontier,
    InstructionProfile,
    PipelineSchedule,
    evaluate,
    plan_frontier,
)

#: Clocks 1980..1005 MHz by 15 (an A100/H100-like range), every 4th: 17 clocks.
CLOCKS = list(range(1980, 1004, -15))[::4]
TARGET_RATIO = 1.01
FULL_CASES = [("1f1b", 4, 8), ("gpipe", 4, 8), ("1f1b", 8, 16)]
QUICK_CASES = [("1f1b", 4, 4), ("gpipe", 2, 4)]

OpKey = tuple[int, int, str]


def synthetic_profile(stages: int, seed: int, forward_ms: float = 30.0) -> InstructionProfile:
    """GPU-like per-stage instruction profiles (deterministic for a seed)."""
    rng = random.Random(seed)
    rows: list[tuple[int, str, int, float, float]] = []
    top = max(CLOCKS)
    for s in range(stages):
        scale = rng.uniform(0.85, 1.15)  # uneven stage partitioning
        mem = rng.uniform(0.1, 0.3)  # memory-bound share of the time at the top clock
        p_static, p_dyn = rng.uniform(70, 100), rng.uniform(250, 330)
        exponent = rng.uniform(2.0, 3.0)
        for instr in INSTRUCTIONS:
            t0 = forward_ms / 1000 * scale * (2.0 if instr == "backward" else 1.0)
            t0 *= rng.uniform(0.95, 1.05)
            for f in CLOCKS:
                x = f / top
                t = t0 * (mem + (1 - mem) / x) * (1 + rng.gauss(0, 0.01))
                power = (p_static + p_dyn * x**exponent) * (1 + rng.gauss(0, 0.01))
                rows.append((s, instr, f, t, power * t))
    return InstructionProfile.from_rows(rows)


def run_lowtime(
    profile: InstructionProfile,
    schedule: PipelineSchedule,
    p_block: float,
    unit_time: float,
    on_plan: Callable[[int, float, dict[OpKey, int]], None] | None = None,
) -> tuple[list[dict[OpKey, int]], float, float]:
    """lowtime's frontier as Perseus computes it: (plans, setup seconds, solver seconds).

    ``on_plan(index, solver_seconds_so_far, plan)`` sees each plan as lowtime produces it (a
    long run leaves a checked prefix behind); its own time is not counted as lowtime's.
    """
    import networkx as nx
    from lowtime.cost_model import ExponentialModel
    from lowtime.graph_utils import add_sink_node, add_source_node
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
    from lowtime.perseus.instruction import Backward, Forward, Instruction
    from lowtime.perseus.schedule import Synchronous1F1B
    from lowtime.solver import PhillipsDessouky

    classes = {"forward": Forward, "backward": Backward}
    started = time.perf_counter()
    specs: dict[tuple[int, str], OperationSpec[int]] = {}
    for s in range(schedule.num_stages):
        for instr in INSTRUCTIONS:
            options = [
                ExecutionOption[int](real_time=t, unit_time=unit_time, cost=e, knob=f)
                for f, (t, e) in profile.measurements(s, instr).items()
            ]
            candidates = CandidateExecutionOptions[int](options=options)
            for option in candidates.options:
                option.cost -= p_block * option.quant_time * option.unit_time
            specs[(s, instr)] = OperationSpec[int](
                options=candidates, cost_model=ExponentialModel(candidates)
            )
    dag = nx.DiGraph()
    node: dict[OpKey, int] = {}
    insts: dict[OpKey, Instruction] = {}
    next_id = 2  # 0: source, 1: sink
    for s in range(schedule.num_stages):
        order = schedule.stage_order(s)
        if schedule.kind == "1f1b":
            reference = Synchronous1F1B(
                num_stages=schedule.num_stages,
                num_micro_batches=schedule.num_microbatches,
                stage_id=s,
                operation_spec_map={classes[i]: specs[(s, i)] for i in INSTRUCTIONS},
            )
            theirs = [(type(i).__name__.lower(), i.micro_batch_id) for i in reference]
            assert theirs == order, f"stage {s}: lowtime's 1F1B order differs from ours"
        previous = None
        for instr, mb in order:
            inst = classes[instr](spec=specs[(s, instr)], stage_id=s, micro_batch_id=mb)
            dag.add_node(next_id, op=inst)
            node[(s, mb, instr)], insts[(s, mb, instr)] = next_id, inst
            if previous is not None:
                dag.add_edge(previous, next_id)
            previous = next_id
            next_id += 1
    for s in range(schedule.num_stages - 1):
        for mb in range(schedule.num_microbatches):
            dag.add_edge(node[(s, mb, "forward")], node[(s + 1, mb, "forward")])
            dag.add_edge(node[(s + 1, mb, "backward")], node[(s, mb, "backward")])
    # forward -> backward of a microbatch on the last stage is implied by its stage order.
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"], dag.graph["sink_node"] = 0, 1
    setup_s = time.perf_counter() - started

    started = time.perf_counter()
    solver = PhillipsDessouky(dag)
    plans = [{k: i.assigned_knob for k, i in insts.items()}]  # the slowest plan it starts from
    paused = 0.0
    if on_plan is not None:
        mark = time.perf_counter()
        on_plan(0, mark - started, plans[0])
        paused += time.perf_counter() - mark
    for _ in solver.run():
        plans.append({k: i.assigned_knob for k, i in insts.items()})
        if on_plan is not None:
            mark = time.perf_counter()
            on_plan(len(plans) - 1, mark - started - paused, plans[-1])
            paused += time.perf_counter() - mark
    return plans, setup_s, time.perf_counter() - started - paused


def run_case(kind: str, stages: int, microbatches: int, args: argparse.Namespace) -> dict[str, Any]:
    schedule = PipelineSchedule(kind, stages, microbatches)  # type: ignore[arg-type]
    profile = synthetic_profile(stages, args.seed)
    gc.collect()
    started = time.perf_counter()
    frontier: Frontier = plan_frontier(profile, schedule, p_block_w=args.p_block)
    ours_s = time.perf_counter() - started
    print(
        f"  {kind} {stages}x{microbatches}: ours {ours_s:.3f} s, {len(frontier.points)} points; "
        "running lowtime...",
        file=sys.stderr,
    )
    gc.collect()
    on_plan: Callable[[int, float, dict[OpKey, int]], None] | None = None
    if args.progress is not None:
        progress = args.progress.open("a", buffering=1)

        def record(index: int, solve_s: float, plan: dict[OpKey, int]) -> None:
            deadline, energy = evaluate(profile, schedule, plan, p_block_w=args.p_block)
            ours = frontier.pick(deadline)
            row = {
                "case": f"{kind} {stages}x{microbatches}",
                "plan": index,
                "lowtime_solve_s": round(solve_s, 3),
                "deadline_s": deadline,
                "lowtime_j": energy,
                "ours_j": ours.energy_j,
                "ratio": ours.energy_j / energy,
                "missed": ours.iteration_time_s > deadline,
            }
            progress.write(json.dumps(row) + "\n")

        on_plan = record
    plans, setup_s, solve_s = run_lowtime(profile, schedule, args.p_block, args.unit_time, on_plan)
    lowtime_s = setup_s + solve_s

    inexact = sum(
        evaluate(profile, schedule, p.frequencies, p_block_w=args.p_block)
        != (p.iteration_time_s, p.energy_j)
        for p in frontier.points
    )
    ratios: list[float] = []
    misses = 0
    for plan in plans:
        deadline, energy = evaluate(profile, schedule, plan, p_block_w=args.p_block)
        ours = frontier.pick(deadline)  # lowtime's times are never below ours: raises if so
        misses += ours.iteration_time_s > deadline
        ratios.append(ours.energy_j / energy)
    # "No slowdown": the least energy no slower than every instruction at the top clock.
    top = {k: max(CLOCKS) for k in frontier.points[0].frequencies}
    top_time, top_energy = evaluate(profile, schedule, top, p_block_w=args.p_block)
    lowtime_points = [evaluate(profile, schedule, p, p_block_w=args.p_block) for p in plans]
    lowtime_fast = min((e for t, e in lowtime_points if t <= top_time), default=None)
    return {
        "case": f"{kind} {stages}x{microbatches}",
        "ops": schedule.num_instructions,
        "lowtime_plans": len(plans),
        "lowtime_setup_s": setup_s,
        "lowtime_solve_s": solve_s,
        "lowtime_s": lowtime_s,
        "ours_s": ours_s,
        "ours_points": len(frontier.points),
        "speedup": lowtime_s / ours_s,
        "compared": len(ratios),
        "max_ratio": max(ratios),
        "mean_ratio": statistics.fmean(ratios),
        "ours_better": sum(r < 1.0 for r in ratios),
        "misses": misses,
        "inexact": inexact,
        "top_clock_time_s": top_time,
        "top_clock_energy_j": top_energy,
        "ours_fastest_s": frontier.fastest_time_s,
        "ours_no_slowdown_j": frontier.pick().energy_j,
        "lowtime_fastest_s": min(t for t, _ in lowtime_points),
        "lowtime_no_slowdown_j": lowtime_fast,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small cases only (smoke run)")
    parser.add_argument("--seed", type=int, default=1, help="profile generator seed")
    parser.add_argument("--p-block", type=float, default=80.0, help="blocking power, W")
    parser.add_argument(
        "--unit-time", type=float, default=0.001, help="lowtime's time quantum, s (Perseus: 1 ms)"
    )
    parser.add_argument(
        "--cases",
        default="",
        help="e.g. 1f1b:8x32,gpipe:4x8 (default: 1F1B 4x8, GPipe 4x8, 1F1B 8x16)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--progress",
        type=Path,
        default=None,
        help="append one JSON line per lowtime plan as it is found (deadline, energies, ratio)",
    )
    args = parser.parse_args()

    import lowtime

    cases = QUICK_CASES if args.quick else FULL_CASES
    if args.cases:
        cases = []
        for spec in args.cases.split(","):
            kind, shape = spec.split(":")
            stages, microbatches = shape.split("x")
            cases.append((kind, int(stages), int(microbatches)))
    results = [run_case(kind, s, m, args) for kind, s, m in cases]

    print(
        f"\n### Pipeline frequency planning vs lowtime {lowtime.__version__} (Perseus), "
        f"{len(CLOCKS)} clocks {max(CLOCKS)}..{min(CLOCKS)} MHz, P_block {args.p_block:g} W, "
        f"lowtime unit time {args.unit_time * 1e3:g} ms, seed {args.seed}, "
        f"Python {platform.python_version()}\n"
    )
    print(
        "| case | ops | lowtime plans | lowtime s (setup + solve) | ours s | speedup "
        "| ours points | deadlines compared | max energy ours/lowtime | mean | ours lower at "
        "| deadlines missed |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['case']} | {r['ops']} | {r['lowtime_plans']} "
            f"| {r['lowtime_s']:.2f} ({r['lowtime_setup_s']:.2f} + {r['lowtime_solve_s']:.2f}) "
            f"| {r['ours_s']:.3f} | {r['speedup']:.1f}x | {r['ours_points']} | {r['compared']} "
            f"| {r['max_ratio']:.4f} | {r['mean_ratio']:.4f} | {r['ours_better']} "
            f"| {r['misses']} |"
        )
    print(
        "\n| case | top clock for all: time s, energy J | fastest plan, time / top-clock time: "
        "lowtime, ours | least energy no slower than top clock: lowtime J, ours J (saving) |"
    )
    print("|---|---:|---:|---:|")
    for r in results:
        low = r["lowtime_no_slowdown_j"]
        print(
            f"| {r['case']} | {r['top_clock_time_s']:.4f} s, {r['top_clock_energy_j']:.1f} J "
            f"| {r['lowtime_fastest_s'] / r['top_clock_time_s']:.4f}, "
            f"{r['ours_fastest_s'] / r['top_clock_time_s']:.4f} "
            f"| {'no plan' if low is None else f'{low:.1f}'}, {r['ours_no_slowdown_j']:.1f} "
            f"({1 - r['ours_no_slowdown_j'] / r['top_clock_energy_j']:.1%}) |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))

    failed = False
    for r in results:
        problems = []
        if r["max_ratio"] > TARGET_RATIO:
            problems.append(f"energy ratio {r['max_ratio']:.4f} > {TARGET_RATIO}")
        if r["misses"]:
            problems.append(f"{r['misses']} deadlines missed")
        if r["inexact"]:
            problems.append(f"{r['inexact']} frontier points differ from evaluate()")
        if r["ours_s"] >= r["lowtime_s"]:
            problems.append(f"slower than lowtime ({r['ours_s']:.2f} s >= {r['lowtime_s']:.2f} s)")
        if problems:
            failed = True
            print(f"FAIL {r['case']}: " + "; ".join(problems), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
