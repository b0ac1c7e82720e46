"""``zeus-async job start|end`` (what a Slurm prolog and epilog run) and ``zeus-async jobs``
(energy per job, pod container and user: live from the node agent, or from a recording)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import anyio

from ..agent.protocol import Control, JobReport, JobSpec
from .common import CliError, Command

__all__ = ["COMMANDS", "add_parsers"]

logger = logging.getLogger(__name__)


def add_parsers(sub: Any) -> None:
    """Add ``job`` and ``jobs`` to the CLI's subparsers."""
    job = sub.add_parser(
        "job",
        help="announce a Slurm job to the node agent, or end it (prolog, epilog)",
        description="Announce a job to the node agent before it runs (a Slurm prolog: `job "
        "start`), so its GPUs' energy is counted as its own from the first sample, or end it "
        "(an epilog: `job end`), which prints the energy its GPUs drew while it held them.",
    )
    actions = job.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = actions.add_parser("start", help="announce a job and the GPUs allocated to it")
    start.add_argument("--job", required=True, metavar="ID", help="the Slurm job id")
    start.add_argument(
        "--gpus",
        default="",
        metavar="LIST",
        help="its GPUs: NVML indices or GPU UUIDs, comma-separated ($SLURM_JOB_GPUS)",
    )
    start.add_argument("--user", default=None, help="the job's user name")
    start.add_argument("--uid", type=int, default=None, help="the job's uid")
    start.add_argument("--partition", default=None, help="the job's partition")
    start.add_argument("--name", default=None, help="the job's name")
    end = actions.add_parser("end", help="end a job; print the energy its GPUs drew")
    end.add_argument("--job", required=True, metavar="ID", help="the Slurm job id")
    end.add_argument("--json", action="store_true", help="one JSON object")
    for p in (start, end):
        _agent_arg(p)
    jobs = sub.add_parser(
        "jobs",
        help="energy per job, pod container and user (live, or from a recording)",
        description="List every workload (Slurm job, pod container, a user's processes) that "
        "held a GPU, with the energy its GPUs drew while it held them: live from the node "
        "agent, or from a recording the agent wrote (--record).",
    )
    jobs.add_argument("recording", nargs="?", help="a recording (default: ask the agent)")
    jobs.add_argument("--json", action="store_true", help="JSON lines, one per workload")
    _agent_arg(jobs)


def _agent_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--agent",
        metavar="ENDPOINT",
        default=None,
        help="the agent (ipc://PATH or a socket path; default: the system agent, else this "
        "user's node agent)",
    )


def _endpoint(given: str | None) -> str:
    """The agent to ask: ``given``, else the system agent, else this user's node agent.

    Raises:
        CliError: No agent runs.
    """
    from ..agent.client import node_agent_endpoint, system_agent_endpoint

    if given:
        return given if "://" in given else f"ipc://{Path(given).absolute()}"
    found = system_agent_endpoint() or node_agent_endpoint()
    if found is None:
        raise CliError(
            "no agent runs on this node (start one: zeus-async agent; or name it: --agent)"
        )
    return found


async def _request(args: argparse.Namespace, control: Control) -> list[JobReport]:
    from ..agent.client import agent_request

    endpoint = _endpoint(args.agent)
    reply = await anyio.to_thread.run_sync(
        lambda: agent_request(endpoint, control, name=f"zeus-async {args.command}")
    )
    return reply.jobs


async def _job(args: argparse.Namespace, out: TextIO) -> int:
    if args.action == "start":
        gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
        spec = JobSpec(
            job_id=args.job,
            gpus=gpus,
            user=args.user,
            uid=args.uid,
            partition=args.partition,
            name=args.name,
        )
        await _request(args, Control(seq=1, op="job_start", job=spec))
        return 0
    reports = await _request(args, Control(seq=1, op="job_end", job=JobSpec(job_id=args.job)))
    report = reports[0] if reports else None
    if args.json:
        out.write(json.dumps(_as_json(report, args.job)) + "\n")
    elif report is None:
        out.write(f"job {args.job}: no GPU energy counted\n")
    else:
        per = ", ".join(f"GPU {g}: {j:.1f} J" for g, j in report.energy_j.items())
        out.write(f"job {args.job}: {report.total_j:.1f} J ({per or 'no GPU'})\n")
    return 0


def _as_json(report: JobReport | None, job_id: str) -> dict[str, Any]:
    if report is None:
        return {"job_id": job_id, "energy_j": 0.0, "gpus": {}}
    return {
        "job_id": report.job_id or job_id,
        "key": report.key,
        "user": report.user,
        "energy_j": report.total_j,
        "gpus": {str(g): j for g, j in report.energy_j.items()},
        "start_ns": report.started_ns,
        "end_ns": report.ended_ns,
        "host": os.uname().nodename,
    }


async def _jobs(args: argparse.Namespace, out: TextIO) -> int:
    if args.recording is not None:
        if args.agent is not None:
            raise CliError("--agent and a recording: one or the other")
        reports = await anyio.to_thread.run_sync(jobs_from_recording, args.recording)
    else:
        reports = await _request(args, Control(seq=1, op="jobs"))
    if args.json:
        for r in reports:
            out.write(json.dumps({**_as_json(r, r.job_id or ""), "kind": r.kind}) + "\n")
        return 0
    out.write(render_jobs(reports))
    return 0


def jobs_from_recording(path: str | os.PathLike[str]) -> list[JobReport]:
    """The workloads a recording's agent announced, with the last energy it recorded for
    each (its counters never go down, so the last is the total)."""
    from ..events import WorkloadChange, WorkloadEnergy
    from ..store.reader import RecordingReader

    reports: dict[str, JobReport] = {}
    for e in RecordingReader(path):
        if type(e) is WorkloadChange:
            if e.state == "expired":
                continue
            r = reports.get(e.key)
            if r is None:
                r = reports[e.key] = JobReport(
                    key=e.key,
                    kind=e.kind,
                    job_id=e.job_id or None,
                    user=e.user or None,
                    uid=e.uid if e.uid >= 0 else None,
                    partition=e.partition or None,
                    namespace=e.namespace or None,
                    pod=e.pod or None,
                    container=e.container or None,
                    started_ns=e.t_ns,
                )
            if e.gpus:
                r.gpus = sorted(set(r.gpus) | set(e.gpus))
            if e.state == "ended":
                r.ended_ns = e.t_ns
        elif type(e) is WorkloadEnergy:
            r = reports.get(e.key)
            if r is None:
                r = reports[e.key] = JobReport(key=e.key, kind=e.key.split(":", 1)[0])
            r.energy_j = dict(sorted(e.gpu_energy_j.items()))
    return list(reports.values())


def render_jobs(reports: Sequence[JobReport]) -> str:
    """The ``jobs`` table: one line per workload, the largest energy first."""
    if not reports:
        return "no workload held a GPU\n"
    rows = [("WORKLOAD", "USER", "GPUS", "ENERGY", "KWH", "STATE")]
    for r in sorted(reports, key=lambda r: -r.total_j):
        rows.append(
            (
                r.key,
                r.user or "-",
                ",".join(map(str, r.gpus)) or "-",
                f"{r.total_j:.1f} J",
                f"{r.total_j / 3.6e6:.6f}",
                "ended" if r.ended_ns is not None else "running",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n"
        for row in rows
    )


COMMANDS: dict[str, Command] = {"job": _job, "jobs": _jobs}
