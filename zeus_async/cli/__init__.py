"""Command-line interface: ``zeus-async <command>`` (also ``python -m zeus_async``).

Commands (one module of this package per group):
    monitor     sample GPUs (and RAPL), show a live per-device view; totals at the end
                (:mod:`.monitor`)
    agent       run the node agent, or only restore what dead processes left (:mod:`.agent`)
    job         announce a Slurm job to the agent, or end it (prolog, epilog; :mod:`.jobs`)
    jobs        energy per job, pod container and user: live, or from a recording
    subscribe   print events from a publisher (``--json``: one JSON object per line)
    proxy       forward the streams of many publishers to one endpoint (:mod:`.streams`)
    inspect     summary of a recording (devices, duration, energy, windows, damage)
    export      convert a recording to CSV or JSON lines
    replay      replay a recording into the pipeline (and onto ZeroMQ), at any pace
    record      record a remote stream (a publisher or a proxy) to a file
    plot        draw per-GPU power over time with the windows shaded (:mod:`.recordings`)
    exporter    serve GPU, RAPL, process and window metrics to Prometheus (:mod:`.processes`)
    pfo-server  serve per-instruction clock plans; ``pfo-plan`` plans them (:mod:`.pfo`)
    curve-keys  make a CURVE key pair for encrypted streams (:mod:`.curve`)

``monitor`` and ``exporter`` track processes with ``--pid PID`` or by running a command
(``zeus-async monitor -- python train.py``): CPU, memory and attributed CPU/DRAM/GPU power.

Errors in arguments or endpoints print one line to stderr and exit non-zero; no traceback.
The command modules import :mod:`.common` and :mod:`.render` (and each other's pieces, never
this package), so there is no import circle.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TextIO

import anyio

from .. import __version__
from ..errors import ZeusAsyncError, sole_exception
from . import agent, curve, jobs, monitor, pfo, processes, recordings, streams
from .common import (
    EXIT_ERROR,
    EXIT_USAGE,
    CliError,
    Command,
    Interrupted,
    describe_error,
    run_command,
)
from .render import stop_progress_bars
from .streams import format_event

__all__ = ["build_parser", "format_event", "main"]

logger = logging.getLogger(__name__)

#: The command modules, in the order of ``--help``.
_MODULES = (monitor, agent, jobs, streams, recordings, processes, pfo, curve)


def build_parser() -> argparse.ArgumentParser:
    """The whole CLI's argument parser."""
    parser = argparse.ArgumentParser(
        prog="zeus-async",
        description="Measure and optimize the energy of GPU work.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    parser.add_argument("--version", action="version", version=f"zeus-async {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _MODULES:
        module.add_parsers(sub)
    helps = {action.dest: action.help for action in sub._choices_actions}
    for name, command in sub.choices.items():
        # -v after the command too (`zeus-async monitor -v`), counted with one before it.
        command.add_argument(
            "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging"
        )
        if command.description is None and helps.get(name):
            command.description = f"{str(helps[name])[0].upper()}{str(helps[name])[1:]}."
    return parser


def _commands() -> dict[str, Command]:
    commands: dict[str, Command] = {}
    for module in _MODULES:
        commands.update(getattr(module, "COMMANDS", {}))
    return commands


# -- entry point --------------------------------------------------------------------------------


#: Exit status after the output pipe closed (128 + SIGPIPE, what a shell shows for `head`).
EXIT_BROKEN_PIPE = 141


def _quiet_stdout() -> None:
    """Point standard output at /dev/null (its pipe is closed)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (a test's StringIO)
        pass


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the CLI; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    stream = out or sys.stdout
    level = logging.WARNING - 10 * args.verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s"
    )
    if args.command is None:
        parser.print_help(stream)
        return EXIT_USAGE
    if args.command in agent.SYNC_COMMANDS:
        return agent.SYNC_COMMANDS[args.command](args, stream)
    try:
        code = anyio.run(run_command, _commands()[args.command], args, stream, backend="asyncio")
        stop_progress_bars()
        return code
    except KeyboardInterrupt:
        stop_progress_bars()
        return 130
    except Exception as caught:  # one line, no traceback (a task group's group of one unwrapped)
        stop_progress_bars()
        exc = sole_exception(caught)
        if isinstance(exc, BrokenPipeError):
            # The reader of our output went away (`... | head`): stop quietly, as a process
            # killed by SIGPIPE would, and keep the interpreter from failing on flush at exit.
            _quiet_stdout()
            return EXIT_BROKEN_PIPE
        if isinstance(exc, Interrupted):
            sys.stderr.write(f"zeus-async {args.command}: {exc}\n")
            return exc.status
        if isinstance(exc, (CliError, ZeusAsyncError, OSError)):
            sys.stderr.write(f"zeus-async {args.command}: {describe_error(exc)}\n")
            return EXIT_ERROR
        if os.environ.get("ZEUS_ASYNC_DEBUG"):
            raise
        name = type(exc).__name__  # zmq errors and the like
        sys.stderr.write(f"zeus-async {args.command}: {name}: {exc}\n")
        return EXIT_ERROR
