"""``zeus-async pfo-server`` and ``zeus-async pfo-plan``: pipeline frequency optimization."""

from __future__ import annotations

import argparse
import json
import logging
import threading
from typing import Any, TextIO

from .common import Command, Interrupted, in_thread_until_stopped, positive_float, until_stopped
from .render import terminal_progress

__all__ = ["COMMANDS", "add_parsers"]

logger = logging.getLogger(__name__)


def add_parsers(sub: Any) -> None:
    """Add ``pfo-server`` and ``pfo-plan`` to the CLI's subparsers."""
    srv = sub.add_parser(
        "pfo-server",
        help="serve per-instruction GPU clock plans to pipeline-parallel jobs",
        description=(
            "The pipeline frequency optimization server. Settings come from ZEUS_PFO_* "
            "environment variables (SCHEDULER, SCHEDULER_ARGS, LOG_LEVEL, DUMP_DATA, DUMP_DIR, "
            "MAX_JOB_IDLE_TIME); the options below override them."
        ),
    )
    srv.add_argument(
        "--bind", default=None, metavar="ENDPOINT", help="default tcp://127.0.0.1:7787"
    )
    srv.add_argument("--scheduler", default=None, help="scheduler name or package.module:Class")
    srv.add_argument("--scheduler-args", default=None, metavar="JSON", help="constructor args")
    srv.add_argument("--dump-dir", default=None, help="where job state is written")
    srv.add_argument("--no-dump", action="store_true", help="do not write job state")
    srv.add_argument("--max-job-idle-time", type=positive_float, default=None, metavar="S")
    srv.add_argument("--log-level", default=None)
    srv.add_argument("--duration", type=positive_float, default=None, help="stop after S s")

    plan = sub.add_parser(
        "pfo-plan",
        help="plan per-instruction clocks from an instruction profile (CSV)",
        description=(
            "Compute the time-energy frontier of a pipeline from an instruction profile and "
            "write the chosen plan as a PointSolution file (one entry per pipeline stage)."
        ),
    )
    plan.add_argument("profile", help="instruction profile CSV (InstructionProfiler output)")
    plan.add_argument("--microbatches", type=int, required=True)
    plan.add_argument("--pipeline", choices=("1f1b", "gpipe"), default="1f1b")
    goal = plan.add_mutually_exclusive_group()
    goal.add_argument("--target-time", type=positive_float, default=None, metavar="S")
    goal.add_argument("--max-slowdown", type=float, default=None, metavar="FRACTION")
    plan.add_argument("--p-block", type=float, default=0.0, metavar="W", help="blocking power")
    plan.add_argument("--out", default=None, help="write the plan here (.json)")


async def _pfo_server(args: argparse.Namespace, out: TextIO) -> int:
    from ..optimizer.pipeline import DEFAULT_ENDPOINT, PfoServer, PfoSettings
    from ..optimizer.pipeline.settings import parse_setting

    overrides: dict[str, Any] = {
        "scheduler": args.scheduler,
        "dump_dir": args.dump_dir,
        "max_job_idle_time": args.max_job_idle_time,
        "log_level": args.log_level,
    }
    if args.scheduler_args is not None:
        overrides["scheduler_args"] = parse_setting(
            "--scheduler-args", "scheduler_args", args.scheduler_args
        )
    if args.no_dump:
        overrides["dump_data"] = False
    settings = PfoSettings.from_env(**overrides)
    logging.getLogger("zeus_async.optimizer.pipeline").setLevel(settings.log_level)
    server = PfoServer(settings, args.bind or DEFAULT_ENDPOINT)
    endpoint = server.bind()
    out.write(f"zeus-async pfo-server: {endpoint} (scheduler {server.scheduler_cls.__name__})\n")
    out.flush()
    async with until_stopped(args.duration):
        await server.serve()
    return 0


async def _pfo_plan(args: argparse.Namespace, out: TextIO) -> int:
    from ..optimizer.pipeline import (
        FrequencySchedule,
        InstructionProfile,
        InstructionProfilingResult,
        PipelineSchedule,
        PlanningStopped,
        plan_frontier,
        write_plan,
    )

    result = InstructionProfilingResult.from_csv(args.profile)
    profile = InstructionProfile.from_rows(result.rows())
    stages = max(r.pp_rank for r in result.results) + 1
    schedule = PipelineSchedule(args.pipeline, stages, args.microbatches)
    bar = terminal_progress("planning", in_bytes=False)
    stop = threading.Event()

    def plan() -> Any:
        return plan_frontier(
            profile,
            schedule,
            p_block_w=args.p_block,
            progress=None if bar is None else (lambda f: bar(round(f * 1000), 1000)),
            stop=stop,
        )

    try:
        frontier = await in_thread_until_stopped(plan, stop)
    except PlanningStopped:
        raise Interrupted("interrupted while planning; no plan written") from None
    target = args.target_time
    if args.max_slowdown is not None:
        target = frontier.fastest_time_s * (1.0 + args.max_slowdown)
    point = frontier.pick(target)
    out.write(f"frontier: {len(frontier.points)} plans, fastest {frontier.fastest_time_s:.6g} s\n")
    out.write(f"chosen:   {point.iteration_time_s:.6g} s, {point.energy_j:.6g} J per iteration\n")
    if args.out:
        write_plan(
            args.out,
            [
                FrequencySchedule(rank=s, frequencies=point.stage_plan(schedule, s))
                for s in range(stages)
            ],
        )
        out.write(f"plan written to {args.out}\n")
    else:
        out.write(json.dumps([point.stage_plan(schedule, s) for s in range(stages)]) + "\n")
    return 0


COMMANDS: dict[str, Command] = {
    "pfo-server": _pfo_server,
    "pfo-plan": _pfo_plan,
}
