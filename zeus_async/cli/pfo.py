"""``zeus-async pfo-server`` and ``zeus-async pfo-plan``: pipeline frequency optimization."""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, TextIO

from .common import (
    CliError,
    Command,
    Interrupted,
    in_thread_until_stopped,
    nonnegative_float,
    positive_float,
    positive_int,
    until_stopped,
)
from .curve import add_server_curve_args
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
            "MAX_JOB_IDLE_TIME, REGISTRATION_TIMEOUT, REGISTRATION_GRACE, MAX_JOBS, "
            "MAX_JOBS_PER_CLIENT, MAX_CLIENT_MIB, MAX_TOTAL_MIB, MAX_QUEUE_MIB, ADMIN_TOKEN, "
            "CURVE_SECRET, CURVE_ALLOW); the options below override them. Each job is opened "
            "only by the token its registration returned. A client is its CURVE key when the "
            "server checks keys, its uid over ipc, else its address (all of loopback is one "
            "client, else an IPv4 /24 or an IPv6 /64)."
        ),
    )
    srv.add_argument(
        "--bind", default=None, metavar="ENDPOINT", help="default tcp://127.0.0.1:7787"
    )
    srv.add_argument(
        "--scheduler",
        default=None,
        help="scheduler name or package.module:Class (FrontierPlanner3D profiles and plans; "
        "PointSolution3D serves a plan file)",
    )
    srv.add_argument("--scheduler-args", default=None, metavar="JSON", help="constructor args")
    srv.add_argument(
        "--dump",
        "--dump-dir",
        dest="dump",
        default=None,
        metavar="DIR",
        help="write each job's state (ranks, schedules, results, the profile and the plan) "
        "under DIR/<job id>/; without it (or ZEUS_PFO_DUMP_DATA/ZEUS_PFO_DUMP_DIR), nothing "
        "is written",
    )
    # Nothing is written unless asked: kept so that scripts that said so still run.
    srv.add_argument("--no-dump", action="store_true", help=argparse.SUPPRESS)
    srv.add_argument("--max-job-idle-time", type=positive_float, default=None, metavar="S")
    srv.add_argument(
        "--registration-timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help="evict a job whose ranks have not all registered within S s (default 600)",
    )
    srv.add_argument(
        "--registration-grace",
        type=positive_float,
        default=None,
        metavar="S",
        help="when the job limits are reached, a new job may take the place of one whose ranks "
        "have not all registered within S s (default 5)",
    )
    srv.add_argument("--max-jobs", type=positive_int, default=None, help="default 1000")
    srv.add_argument(
        "--max-jobs-per-client",
        type=positive_int,
        default=None,
        help="default 64 (a client: its CURVE key, its uid over ipc, else its address)",
    )
    srv.add_argument(
        "--max-client-mib",
        type=positive_float,
        default=None,
        metavar="MIB",
        help="memory one client's jobs may hold: ranks, results, schedules (default 256)",
    )
    srv.add_argument(
        "--max-total-mib",
        type=positive_float,
        default=None,
        metavar="MIB",
        help="memory all jobs may hold together (default 2048)",
    )
    srv.add_argument(
        "--max-queue-mib",
        type=positive_float,
        default=None,
        metavar="MIB",
        help="requests received and not yet handled; past it a request is answered busy "
        "(default 64)",
    )
    add_server_curve_args(srv, what="--bind")
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
    plan.add_argument(
        "--microbatches", type=positive_int, required=True, help="microbatches per iteration"
    )
    plan.add_argument("--pipeline", choices=("1f1b", "gpipe"), default="1f1b")
    goal = plan.add_mutually_exclusive_group()
    goal.add_argument(
        "--target-time",
        type=positive_float,
        default=None,
        metavar="S",
        help="the least-energy plan within this iteration time",
    )
    goal.add_argument(
        "--max-slowdown",
        type=nonnegative_float,
        default=None,
        metavar="FRACTION",
        help="the least-energy plan within (1 + FRACTION) x the fastest plan's time",
    )
    plan.add_argument(
        "--p-block",
        type=nonnegative_float,
        default=None,
        metavar="W",
        help="blocking power: what a pipeline STAGE draws while it waits on another (all its "
        "data- and tensor-parallel GPUs together, as the profile's energies are), charged for "
        "idle time (default: what the server measured while profiling, kept beside the "
        "profile as NAME.p_block.json; else 0)",
    )
    plan.add_argument("--out", default=None, help="write the plan here (.json)")


#: ``pfo-server`` with no scheduler chosen. No scheduler can serve a job without being told
#: something about it: the planner needs the pipeline's microbatches per iteration (each rank's
#: schedule lists its instructions in order), a plan server its plan; a guessed count would
#: hand the ranks schedules that do not match the instructions they run.
_CHOOSE_A_SCHEDULER = (
    "choose what to serve: --scheduler FrontierPlanner3D --scheduler-args "
    "'{\"num_microbatches\": M}' profiles every pipeline stage and serves the least-energy "
    "clocks with no slowdown (M: microbatches per iteration), or --scheduler PointSolution3D "
    '--scheduler-args \'{"solution_path": "plan.json"}\' serves a plan (docs/pfo.md)'
)


async def _pfo_server(args: argparse.Namespace, out: TextIO) -> int:
    from ..optimizer.pipeline import DEFAULT_ENDPOINT, PfoServer, PfoSettings
    from ..optimizer.pipeline.settings import parse_setting

    env = {name.upper() for name in os.environ}
    chosen = {args.scheduler, args.scheduler_args} != {None}
    if not chosen and not env & {"ZEUS_PFO_SCHEDULER", "ZEUS_PFO_SCHEDULER_ARGS"}:
        raise CliError(_CHOOSE_A_SCHEDULER)
    overrides: dict[str, Any] = {
        "scheduler": args.scheduler,
        "dump_dir": args.dump,
        "max_job_idle_time": args.max_job_idle_time,
        "registration_timeout": args.registration_timeout,
        "registration_grace": args.registration_grace,
        "max_jobs": args.max_jobs,
        "max_jobs_per_client": args.max_jobs_per_client,
        "max_client_mib": args.max_client_mib,
        "max_total_mib": args.max_total_mib,
        "max_queue_mib": args.max_queue_mib,
        "log_level": args.log_level,
        "curve_secret": args.curve_secret,
        "curve_allow": args.curve_allow,
    }
    if args.scheduler_args is not None:
        overrides["scheduler_args"] = parse_setting(
            "--scheduler-args", "scheduler_args", args.scheduler_args
        )
    if args.no_dump or (
        args.dump is None and not env & {"ZEUS_PFO_DUMP_DATA", "ZEUS_PFO_DUMP_DIR"}
    ):
        overrides["dump_data"] = False  # the library's default is the seed's (on): not unasked
    elif args.dump is not None:
        overrides["dump_data"] = True
    settings = PfoSettings.from_env(**overrides)
    logging.getLogger("zeus_async.optimizer.pipeline").setLevel(settings.log_level)
    server = PfoServer(settings, args.bind or DEFAULT_ENDPOINT)
    endpoint = server.bind()
    secured = ", CURVE" if settings.curve_secret else ""
    out.write(
        f"zeus-async pfo-server: {endpoint} (scheduler {server.scheduler_cls.__name__}{secured})\n"
    )
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
    from ..optimizer.pipeline.planner import check_p_block
    from ..optimizer.pipeline.schedulers import read_blocking_power

    if args.out:
        _check_output(Path(args.out), Path(args.profile))  # before minutes of planning
    try:
        result = InstructionProfilingResult.from_csv(args.profile)
        profile = InstructionProfile.from_rows(result.rows())
        stages = max((r.pp_rank for r in result.results), default=-1) + 1
        if stages == 0:
            raise ValueError("it holds no rows")
        schedule = PipelineSchedule(args.pipeline, stages, args.microbatches)
        profile.check_covers(schedule)
    except (ValueError, UnicodeDecodeError) as exc:
        # The reader's messages name the file (and line) already; say it once.
        text, name = str(exc), str(Path(args.profile))
        where, _, why = text.partition(": ") if text.startswith(name) else (name, "", text)
        raise CliError(f"{where}: not a usable instruction profile: {why}") from None
    p_block, where = args.p_block, "given"
    if p_block is None:
        found = read_blocking_power(args.profile)  # its own file, named in its errors
        if found is None:
            p_block, where = 0.0, "not measured: give --p-block"
        else:
            p_block, given = found
            where = "given to the server that profiled" if given else "measured while profiling"
    try:
        check_p_block(p_block)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    out.write(
        f"P_block     {p_block:.6g} W per stage ({where}): idle time is charged at this power, "
        "as the server does\n"
    )
    bar = terminal_progress("planning", in_bytes=False)
    stop = threading.Event()

    def plan() -> Any:
        return plan_frontier(
            profile,
            schedule,
            p_block_w=p_block,
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
    try:
        point = frontier.pick(target)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    base_t, base_e = frontier.max_frequency_time_s, frontier.max_frequency_energy_j
    out.write(
        f"frontier    {len(frontier.points)} plans, fastest {frontier.fastest_time_s:.6g} s\n"
    )
    out.write(
        f"baseline    {base_t:.6g} s, {base_e:.6g} J per iteration (every clock at its top)\n"
    )
    out.write(f"chosen      {point.iteration_time_s:.6g} s, {point.energy_j:.6g} J per iteration\n")
    saved = base_e - point.energy_j
    out.write(
        f"saving      {saved:.6g} J per iteration ({100 * saved / base_e:.2f} % of the energy), "
        f"time {100 * (point.iteration_time_s / base_t - 1):+.2f} %\n"
    )
    if args.out:
        write_plan(
            args.out,
            [
                FrequencySchedule(rank=s, frequencies=point.stage_plan(schedule, s))
                for s in range(stages)
            ],
        )
        out.write(f"plan        written to {args.out}\n")
    else:
        out.write(json.dumps([point.stage_plan(schedule, s) for s in range(stages)]) + "\n")
    return 0


def _check_output(out: Path, profile: Path) -> None:
    """Refuse an output that cannot be written, or that is the profile itself."""
    if out.exists() and profile.exists() and out.resolve() == profile.resolve():
        raise CliError(f"--out {out} is the profile being read; write the plan elsewhere")
    if out.is_dir():
        raise CliError(f"--out {out} is a directory; give a file name (.json)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"--out {out}: no directory {parent}")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise CliError(f"--out {out}: not writable")


COMMANDS: dict[str, Command] = {
    "pfo-server": _pfo_server,
    "pfo-plan": _pfo_plan,
}
