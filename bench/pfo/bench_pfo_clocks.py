"""PFO plans applied on time: the share of instructions that start at their planned clock.

A rank runs one pipeline stage's plan (1F1B, 4 stages x 8 microbatches, stage 1, planned by
``plan_frontier`` on ``bench_planner``'s synthetic profile with no slowdown) through
:class:`PipelineFrequencyOptimizer` on a simulated GPU whose clock changes take
``set_clock_latency_s`` (the NVML set latency assumed). Forward instructions take 20 ms and
backward 40 ms (sleeps standing for GPU work), with ``gap`` ms of pipeline communication between
instructions. The truth is the simulated GPU's locked clock, read as each instruction starts
("at start") and every millisecond of its work until it ends ("throughout": a change landing
mid-instruction counts against it).

For each latency and gap: ``clock_wait_s=0`` (clocks set ahead, never waited for) beside the
default (set ahead, and waited for up to 50 ms at the instruction's start): the share on time,
the optimizer's own count, and the time the training thread waited per iteration.

Run: ``.venv/bin/python bench/pfo/bench_pfo_clocks.py [--iters 5] [--latencies 2,10,30]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "optimizer" / "pipeline"))

from bench_planner import synthetic_profile
from pfo_helpers import running_server

from zeus_async import Monitor
from zeus_async.devices.sim import SimConfig
from zeus_async.optimizer.pipeline import PipelineFrequencyOptimizer
from zeus_async.optimizer.pipeline.planner import PipelineSchedule, plan_frontier
from zeus_async.testing import sim_pynvml


def stage_plan() -> list[tuple[str, int]]:
    schedule = PipelineSchedule("1f1b", 4, 8)
    point = plan_frontier(synthetic_profile(4, 1), schedule).pick(None)
    return [(name, int(mhz)) for name, mhz in point.stage_plan(schedule, 1)]


def run(
    plan: list[tuple[str, int]],
    latency_s: float,
    gap_s: float,
    wait_s: float,
    iters: int,
    lower: bool = True,
) -> tuple[float, float, float, float]:
    tmp = Path(tempfile.mkdtemp(prefix="pfo-clocks-"))
    path = tmp / "plan.json"
    path.write_text(json.dumps([plan]))
    args = {"solution_path": str(path)}
    with running_server(tmp, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        monitor = Monitor(
            backend="sim",
            sampler="thread",
            gpu_indices=[0],
            sync_execution_with=None,
            sim_config=SimConfig(num_gpus=1, set_clock_latency_s=latency_s),
        )
        node = sim_pynvml.current_node()
        assert node is not None
        gpu = node.gpus[0]
        pfo = PipelineFrequencyOptimizer(
            rank=0, dp_rank=0, pp_rank=0, tp_rank=0, device_id=0, dp_degree=1, pp_degree=1,
            tp_degree=1, world_size=1, server_url=ep, monitor=monitor, warmup_iters=10**6,
            restore_on_signals=False, clock_wait_s=wait_s, wait_for_lower_clocks=lower,
        )  # fmt: skip
        at_start: list[bool] = []
        throughout: list[bool] = []
        pause = threading.Event()
        for _ in range(iters):
            pfo.on_step_begin()
            for name, mhz in plan:
                pfo.on_instruction_begin(name)
                seen = {gpu.locked_sm_clocks_mhz}
                at_start.append(seen == {(mhz, mhz)})
                for _ in range(20 if name == "forward" else 40):  # its GPU work, 1 ms steps
                    pause.wait(0.001)
                    seen.add(gpu.locked_sm_clocks_mhz)
                throughout.append(seen == {(mhz, mhz)})
                pfo.on_instruction_end(name)
                if gap_s:
                    pause.wait(gap_s)
            pfo.on_step_end()
        stats = pfo.clock_stats
        pfo.close()
        monitor.close()
    n = len(at_start)
    return sum(at_start) / n, sum(throughout) / n, stats.on_time_frac, stats.waited_s / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--latencies", default="2,10,30", help="set latencies to assume, ms")
    parser.add_argument("--gaps", default="0,5", help="communication between instructions, ms")
    args = parser.parse_args()
    plan = stage_plan()
    changes = sum(1 for a, b in zip(plan, plan[1:] + plan[:1], strict=True) if a[1] != b[1])
    busy = sum(0.02 if n == "forward" else 0.04 for n, _ in plan)
    print(
        f"stage 1 of 1F1B 4x8: {len(plan)} instructions, {changes} clock changes per "
        f"iteration, {busy * 1e3:.0f} ms of GPU work; {args.iters} iterations per run"
    )
    print(
        f"{'latency ms':>10}{'gap ms':>8}  {'policy':<26}{'GPU at start':>13}"
        f"{'throughout':>11}{'counted':>9}{'waited ms/iter':>16}{'overhead':>10}"
    )
    for latency in (float(x) for x in args.latencies.split(",")):
        for gap in (float(x) for x in args.gaps.split(",")):
            policies = (
                ("set ahead, no wait", 0.0, True),
                ("+ wait for higher", 0.05, False),
                ("+ wait for all (default)", 0.05, True),
            )
            for label, wait, lower in policies:
                start, whole, counted, waited = run(
                    plan, latency / 1e3, gap / 1e3, wait, args.iters, lower
                )
                base = busy + gap / 1e3 * len(plan)
                print(
                    f"{latency:>10g}{gap:>8g}  {label:<26}{start:>13.1%}{whole:>11.1%}"
                    f"{counted:>9.1%}"
                    f"{waited * 1e3:>16.1f}{waited / base:>10.1%}"
                )
    time.sleep(0)


if __name__ == "__main__":
    main()
