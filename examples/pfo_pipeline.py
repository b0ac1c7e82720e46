"""Pipeline frequency optimization in a (toy) pipeline-parallel training job.

Start a PFO server, then the job (4 ranks: pipeline 2 x data parallel 2)::

    zeus-async pfo-server --scheduler FrontierPlanner3D \\
        --scheduler-args '{"num_microbatches": 3, "frequency_step": 2, "minimum_frequency": 990}' &
    torchrun --nproc-per-node 4 examples/pfo_pipeline.py --server tcp://127.0.0.1:7787

Every rank runs a 1F1B schedule over real ``torch.distributed`` point-to-point messages (gloo,
CPU): activations go forward, gradients backward, and the stage replicas all-reduce at the end
of each iteration. The server first profiles each stage's forward and backward at decreasing
GPU clocks, then plans the clocks of every instruction (the time-energy frontier) and serves
the plan; each rank applies it through :class:`PipelineFrequencyOptimizer`.

GPUs are simulated here (no NVIDIA driver needed): "computing" a forward or backward means
running a fixed amount of work at the speed the simulated GPU has at its current SM clock, so
time and energy respond to the plan the way real GPUs do. The simulated GPU is busy only while
an instruction computes; while its rank waits on another stage it idles, and its power drops
to the idle (blocking) power, as a real GPU's does.

Clock changes take ``--set-latency-ms`` on the simulated GPUs (2 ms by default, an assumed
NVML set latency), so a clock set late would show: each instruction records every clock the
GPU ran at while it computed.

At the end, rank 0 prints the outcome: the job's iteration time and GPU energy with the final
plan, and without it: after the optimizer closes (every clock back to its default, the top),
the same loop runs ``--baseline-iters`` more iterations with no optimizer hooks at all.
``--report DIR`` writes what each rank saw (schedules, the clocks during each instruction,
clocks after closing, the outcome), which the project's end-to-end test checks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from zeus_async import Monitor
from zeus_async.devices.sim_config import SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload
from zeus_async.optimizer.pipeline import PipelineFrequencyOptimizer, PipelineSchedule
from zeus_async.testing import sim_pynvml

logger = logging.getLogger("pfo_pipeline")

#: Simulated GPUs: energy counter and power readings every 5 ms, so millisecond instructions
#: are measured well; 165 MHz clock steps.
SIM = SimConfig(
    num_gpus=4,
    idle_w=150.0,
    max_w=700.0,
    sm_clock_step_mhz=165,
    memory_bound_frac=0.3,
    counter_period_s=0.005,
    instant_period_s=0.005,
    instant_window_s=0.005,
    workload=ConstantWorkload(util=0.0),
)


def compute(gpu: int, work_s: float) -> list[int | None]:
    """Run ``work_s`` seconds of full-speed work on simulated GPU ``gpu`` at its current speed;
    returns every locked SM clock (MHz, ``None``: unlocked) it ran at, in order.

    The work advances with the time that really passes (at the speed in force when each short
    step began), as a GPU kernel keeps running while its host thread oversleeps: a descheduled
    host adds at most one step's lateness to the instruction, not one per step.
    """
    node = sim_pynvml.current_node()
    assert node is not None
    sim_gpu = node.gpus[gpu]
    sim_gpu.set_load(1.0)  # kernels running
    clocks: list[int | None] = []
    remaining = work_s
    while remaining > 0:
        locked = sim_gpu.locked_sm_clocks_mhz
        clock = None if locked is None else locked[1]
        if not clocks or clocks[-1] != clock:
            clocks.append(clock)
        speed = sim_gpu.throughput(node.now_ns())
        t0 = time.perf_counter()
        time.sleep(min(remaining, 0.002) / speed)
        remaining -= (time.perf_counter() - t0) * speed
    locked = sim_gpu.locked_sm_clocks_mhz
    if clocks[-1] != (None if locked is None else locked[1]):
        clocks.append(None if locked is None else locked[1])
    sim_gpu.set_load(0.0)  # done: idle until the next instruction
    return clocks


def _outcome(measured: list[tuple[int, Any]], gpu: int, last_round: int) -> dict[str, Any]:
    """The job's iteration time (the slowest rank's) and GPU energy (every rank's), medians
    over the iterations run without the optimizer (round -1) and of the final round."""

    def medians(windows: list[Any]) -> list[float]:
        if not windows:
            return [float("nan"), float("nan")]
        times = sorted(w.wait().time_s for w in windows)
        energies = sorted(w.wait().gpu_energy_j[gpu] for w in windows)
        return [times[len(times) // 2], energies[len(energies) // 2]]

    before = medians([w for r, w in measured if r == -1])
    planned = medians([w for r, w in measured if r == last_round])
    figures = torch.tensor([before[0], planned[0]], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the iteration is the slowest rank's
    energy = torch.tensor([before[1], planned[1]], dtype=torch.float64)
    dist.all_reduce(energy)  # the job's energy is every GPU's
    return {
        "before": {"time_s": figures[0].item(), "energy_j": energy[0].item()},
        "planned": {"time_s": figures[1].item(), "energy_j": energy[1].item()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--server", default=os.environ.get("ZEUS_PFO_SERVER", "tcp://127.0.0.1:7787")
    )
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--forward-ms", type=float, default=6.0, help="stage 0's forward work")
    parser.add_argument("--until-round", type=int, default=5, help="run until this schedule")
    parser.add_argument("--tail-iters", type=int, default=4, help="iterations after that")
    parser.add_argument(
        "--baseline-iters", type=int, default=4, help="iterations without the optimizer, last"
    )
    parser.add_argument(
        "--set-latency-ms", type=float, default=2.0, help="how long a clock change takes"
    )
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--report", default=None, help="write per-rank reports to this folder")
    args = parser.parse_args()
    rank_tag = os.environ.get("RANK", "?")
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{rank_tag}: %(message)s")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    pp = args.pp
    dp = world // pp
    pp_rank, dp_rank = rank % pp, rank // pp
    replicas = [dist.new_group([d * pp + s for d in range(dp)]) for s in range(pp)]
    schedule = PipelineSchedule("1f1b", pp, args.microbatches)
    order = schedule.stage_order(pp_rank)
    # Stage 0 does twice the work of the later stages: they have slack to slow down in.
    fwd_s = args.forward_ms / 1000 * (2.0 if pp_rank == 0 else 1.0)

    monitor = Monitor(
        gpu_indices=[local],
        backend="sim",
        sampler="thread",
        sample_period=0.005,
        sync_execution_with=None,
        sim_config=msgspec.structs.replace(SIM, set_clock_latency_s=args.set_latency_ms / 1000),
    )
    pfo = PipelineFrequencyOptimizer(
        rank=rank,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        tp_rank=0,
        device_id=local,
        dp_degree=dp,
        pp_degree=pp,
        tp_degree=1,
        world_size=world,
        server_url=args.server,
        job_metadata="example",
        monitor=monitor,
        warmup_iters=1,
        profile_iters=2,
    )
    node = sim_pynvml.current_node()
    assert node is not None
    node.gpus[local].set_load(0.0)
    prev_rank, next_rank = rank - 1, rank + 1  # neighbours in this pipeline
    measured: list[tuple[int, Any]] = []  # (schedule round, window of the iteration)
    act = torch.zeros(16)
    seen: list[dict[str, Any]] = []
    started = time.monotonic()
    tail = -1
    iteration = 0

    def iterate(hooks: PipelineFrequencyOptimizer | None) -> tuple[list[Any], Any]:
        """One 1F1B iteration (with the optimizer's hooks, or none): the clocks each
        instruction ran at, and the iteration's measurement window."""
        monitor.begin_window("example:iteration", sync_execution=False)
        clocks: list[Any] = []
        pending: list[Any] = []
        for name, mb in order:
            if name == "forward" and pp_rank > 0:
                dist.recv(act, prev_rank)
            if name == "backward" and pp_rank < pp - 1:
                dist.recv(act, next_rank)
            if hooks is not None:
                hooks.on_instruction_begin(name)
            ran_at = compute(local, fwd_s if name == "forward" else 2 * fwd_s)
            clocks.append([name, ran_at[0] if len(ran_at) == 1 else ran_at])
            if hooks is not None:
                hooks.on_instruction_end(name)
            act.fill_(float(mb))
            if name == "forward" and pp_rank < pp - 1:
                pending.append(dist.isend(act.clone(), next_rank))
            if name == "backward" and pp_rank > 0:
                pending.append(dist.isend(act.clone(), prev_rank))
        for work in pending:
            work.wait()
        grad = torch.ones(4)
        dist.all_reduce(grad, group=replicas[pp_rank])
        return clocks, monitor.end_window("example:iteration", sync_execution=False)

    while True:
        pfo.on_step_begin()
        clocks, window = iterate(pfo)
        measured.append((pfo.round, window))
        pfo.on_step_end()
        iteration += 1
        seen.append({"round": pfo.round, "schedule": pfo.schedule.frequencies, "clocks": clocks})
        # Every rank stops at the same iteration (point-to-point sends must pair up).
        flag = torch.tensor([1 if pfo.round >= args.until_round else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if tail < 0 and flag.item() == 1:
            tail = args.tail_iters
        if tail >= 0:
            tail -= 1
            if tail < 0:
                break
        if time.monotonic() - started > args.max_seconds:
            raise SystemExit(f"rank {rank}: round {args.until_round} not reached in time")
    last_round = pfo.round
    clocks_applied = pfo.clock_stats
    pfo.close()
    after = node.gpus[local].locked_sm_clocks_mhz
    # The baseline: the same loop with no optimizer (clocks at their default, the top), after
    # one iteration that lets the reset land.
    iterate(None)
    for _ in range(args.baseline_iters):
        measured.append((-1, iterate(None)[1]))
    outcome = _outcome(measured, local, last_round)
    monitor.close()
    logger.info(
        "%d iterations; last schedule round %d; clocks: %d of %d instructions on time, %.1f ms "
        "waited for them per iteration",
        iteration,
        pfo.round,
        clocks_applied.on_time,
        clocks_applied.instructions,
        1e3 * clocks_applied.waited_s / max(iteration, 1),
    )
    if rank == 0:
        before, planned = outcome["before"], outcome["planned"]
        logger.info(
            "outcome: without the optimizer (every clock at its top) %.4f s and %.2f J per "
            "iteration; with the plan %.4f s (%+.1f %%) and %.2f J (%+.1f %%)",
            before["time_s"],
            before["energy_j"],
            planned["time_s"],
            100 * (planned["time_s"] / before["time_s"] - 1),
            planned["energy_j"],
            100 * (planned["energy_j"] / before["energy_j"] - 1),
        )
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        report = {
            "rank": rank,
            "pp_rank": pp_rank,
            "job_id": pfo.job_id,
            "iterations": seen,
            "locked_after_close": after,
            "outcome": outcome,
            "clocks": {
                "instructions": clocks_applied.instructions,
                "on_time": clocks_applied.on_time,
                "late": clocks_applied.late,
                "missed": clocks_applied.missed,
                "waited_s": clocks_applied.waited_s,
            },
        }
        Path(args.report, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
