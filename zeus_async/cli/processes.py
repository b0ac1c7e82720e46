"""Per-process metrics and metrics export in the CLI: the process options shared by ``monitor``
and ``exporter``, the live process table, and the ``exporter`` command."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
from collections.abc import Sequence
from typing import Any, TextIO

import anyio

from ..events import Event, ProcessSample
from ..exporters.names import DEFAULT_PORT, NAME_SETS
from .common import (
    BACKEND_HELP,
    CliError,
    Command,
    add_power_scope_arg,
    backend_arg,
    exit_status,
    int_list,
    positive_float,
    service_backend,
    sim_config,
    until_stopped,
    wait_for_publisher,
)
from .common import fmt_cell as _fmt
from .curve import add_client_curve_args, client_curve_from_args
from .render import Column

__all__ = ["COMMANDS", "PROCESS_COLUMNS", "ProcessTable", "add_parsers"]

logger = logging.getLogger(__name__)


def _pid(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a process id, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"process ids are positive, got {text!r}")
    import psutil

    if not psutil.pid_exists(value):
        raise argparse.ArgumentTypeError(f"no process {value} is running")
    return value


def add_process_args(parser: argparse.ArgumentParser) -> None:
    """``--pid``, ``--gpu-processes``, ``--process-period`` and a trailing ``-- COMMAND``."""
    parser.add_argument(
        "--pid",
        dest="pids",
        type=_pid,
        action="append",
        default=None,
        help="track this process and its descendants (repeatable)",
    )
    parser.add_argument(
        "--gpu-processes",
        action="store_true",
        help="track every process found on the sampled GPUs",
    )
    parser.add_argument(
        "--process-period",
        type=float,
        default=1.0,
        help="process metrics period in seconds (default 1)",
    )
    parser.add_argument(
        "run",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="-- COMMAND [ARGS]: run COMMAND, track its processes, stop when it exits",
    )


def command_of(args: argparse.Namespace) -> list[str]:
    """The trailing command (without the ``--`` separator), or ``[]``."""
    command = list(args.run or [])
    if command and command[0] == "--":
        command = command[1:]
    return command


def tracking_from_args(args: argparse.Namespace, command_pid: int | None) -> Any:
    """The :class:`~zeus_async.runtime.ProcessTracking` the options ask for, or ``None``."""
    from ..errors import ConfigError
    from ..runtime import ProcessTracking

    if not args.process_period > 0:
        raise ConfigError(f"--process-period must be positive, got {args.process_period}")
    roots = list(args.pids or [])
    if command_pid is not None:
        roots.append(command_pid)
    if not roots and not args.gpu_processes:
        return None
    if len(roots) == 1:
        return ProcessTracking(
            root=roots[0], gpu_all=args.gpu_processes, period_s=args.process_period
        )
    # Several roots: explicit pids (their descendants are not followed), or GPU processes only.
    return ProcessTracking(
        pids=tuple(roots) if roots else (),
        gpu_all=args.gpu_processes,
        period_s=args.process_period,
        exclude=(os.getpid(),),
    )


#: Runs in the command's process until it is released: waits for one byte on the inherited
#: pipe (none: the monitor failed to start, so the command does not run), then becomes the
#: command (``exec``: same pid, so it is tracked from its first instruction).
_HELD = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "go = os.read(fd, 1)\n"
    "os.close(fd)\n"
    "if not go:\n"
    "    sys.exit(125)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    sys.stderr.write(f'zeus-async: cannot run {sys.argv[2]!r}: {exc}\\n')\n"
    "    sys.exit(127)\n"
)


class HeldCommand:
    """The tracked command, started held: its process (and pid) exists at once, so process
    tracking can name it before sampling starts, but it runs the command only when
    :meth:`release` says so, after sampling has started (its start-up, imports and model
    load included, is then measured).

    Raises:
        ConfigError: The command cannot be found or run.
    """

    def __init__(self, command: Sequence[str]) -> None:
        import shutil
        import sys

        from ..errors import ConfigError

        program = command[0]
        if shutil.which(program) is None:
            raise ConfigError(f"cannot run {program!r}: command not found or not executable")
        read_fd, self._write_fd = os.pipe()
        try:
            self.process: subprocess.Popen[bytes] = subprocess.Popen(
                [sys.executable, "-c", _HELD, str(read_fd), *command], pass_fds=(read_fd,)
            )
        except OSError as exc:
            os.close(self._write_fd)
            raise ConfigError(f"cannot run {program!r}: {exc}") from None
        finally:
            os.close(read_fd)
        self.pid = self.process.pid

    def release(self) -> None:
        """Let the command run (once)."""
        if self._write_fd >= 0:
            try:
                os.write(self._write_fd, b"\1")
            except OSError:
                pass  # it is gone already
            self.close()

    def close(self) -> None:
        """Without :meth:`release` first: the command never runs (its process exits 125)."""
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1


def start_command(command: Sequence[str]) -> HeldCommand:
    """Start the tracked command held (see :class:`HeldCommand`); its output goes to this
    terminal."""
    return HeldCommand(command)


class ProcessTable:
    """Latest per-process figures from :class:`~zeus_async.events.ProcessSample` events.

    CPU use is shown as ``top`` shows it, ``%CPU``: percent of *one* core, so a process keeping
    one core busy reads 100 and one keeping four busy 400. The samples carry it as a share of
    the whole machine (``cpu_frac``: CPU time / (wall time * logical CPUs)), which on a 64-core
    machine makes a busy single-threaded process read 1.6 %; the table multiplies it back by
    the logical CPUs of the machine sampled (``cpu_count``: this one, where ``monitor`` runs
    the sampler).

    Each row names its process as ``top`` does, by pid and command (``pid 4242 python3``),
    looked up on this machine (where ``monitor`` samples) when the pid's first sample comes; a
    pid gone before that shows its pid alone.

    Args:
        cpu_count: Logical CPUs of the machine the samples come from (default: this one's, as
            the process sampler counts them).
        local: Whether the samples come from this machine (command names are looked up here).
    """

    def __init__(self, cpu_count: int | None = None, *, local: bool = True) -> None:
        if cpu_count is None:
            import psutil

            cpu_count = psutil.cpu_count() or 1
        self.cpu_count = cpu_count
        self.local = local
        self._names: dict[int, str] = {}
        self.host_side: dict[int, ProcessSample] = {}
        self.on_gpu: dict[tuple[int, int], ProcessSample] = {}

    def command(self, pid: int) -> str:
        """The process's command name (``python3``) now, or the last one seen once it has
        exited (a process may exec another program: ``monitor -- CMD`` starts CMD through a
        held stub); ``""`` when never seen."""
        if self.local:
            import psutil

            try:
                self._names[pid] = psutil.Process(pid).name()
            except psutil.Error:
                pass
        return self._names.get(pid, "")

    def add(self, event: Event) -> None:
        if not isinstance(event, ProcessSample):
            return
        if event.gpu is None:  # once per pid per period: the name it runs under now
            self.command(event.pid)
        if event.gpu is None:
            self.host_side[event.pid] = event
        else:
            self.on_gpu[(event.pid, event.gpu)] = event

    def rows(self) -> list[list[str]]:
        """One row per process (:data:`PROCESS_COLUMNS`): pid, %CPU (of one core), PSS, CPU
        and DRAM W, GPU SM %, GPU W (attributed), energy so far."""
        pids = sorted(set(self.host_side) | {pid for pid, _ in self.on_gpu})
        rows = []
        for pid in pids:
            host = self.host_side.get(pid)
            gpus = [s for (p, _), s in self.on_gpu.items() if p == pid]
            cpu = (
                None
                if host is None or host.cpu_frac is None
                else host.cpu_frac * self.cpu_count * 100
            )
            pss = None if host is None else (host.memory_pss_bytes or host.memory_rss_bytes)
            sm = sum(s.gpu_sm_frac or 0.0 for s in gpus) * 100 if gpus else None
            gpu_w = (
                sum(s.attributed_power_w or 0.0 for s in gpus)
                if any(s.attributed_power_w is not None for s in gpus)
                else None
            )
            parts = [s.attributed_energy_j for s in gpus]
            if host is not None:
                parts += [host.cpu_energy_j, host.dram_energy_j]
            known = [p for p in parts if p is not None]
            energy = sum(known) if known else None
            rows.append(
                [
                    f"pid {pid} {self.command(pid)}".rstrip(),
                    _fmt(cpu),
                    _fmt(pss, 2**20, 0),
                    _fmt(None if host is None else host.cpu_power_w),
                    _fmt(None if host is None else host.dram_power_w),
                    _fmt(sm),
                    _fmt(gpu_w),
                    _fmt(energy, digits=2),
                ]
            )
        return rows


#: The process table's columns (the first and the last stay in the narrowest terminal).
#: ``%CPU (core)``: as ``top``'s ``%CPU``, percent of one core (100 = one core busy).
PROCESS_COLUMNS = (
    Column("process", left=True),
    Column("%CPU (core)", keep=4),
    Column("PSS MiB", keep=2),
    Column("CPU W", keep=3),
    Column("DRAM W", keep=1),
    Column("GPU SM %", keep=3),
    Column("GPU W", keep=5),
    Column("energy J"),
)


# -- exporter -----------------------------------------------------------------------------------


def add_prometheus_args(parser: Any, *, prefix: str) -> None:
    """The bind address and the name set of a Prometheus endpoint (``--addr``/``--names``,
    or ``--prometheus-addr``/``--prometheus-names`` beside other options)."""
    parser.add_argument(
        f"{prefix}addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="bind address of the metrics endpoint (default 127.0.0.1; 0.0.0.0: every interface)",
    )
    parser.add_argument(
        f"{prefix}names",
        choices=NAME_SETS,
        default="native",
        help="metric names: native (zeus_...), dcgm (dcgm-exporter's) or amd (AMD Device "
        "Metrics Exporter's), for their dashboards",
    )


def add_otlp_args(parser: Any) -> None:
    """``--otlp URL`` and ``--otlp-interval S``: push to an OpenTelemetry collector."""
    parser.add_argument(
        "--otlp",
        default=None,
        metavar="URL",
        help="also push metrics to this OpenTelemetry OTLP/HTTP endpoint "
        "(http://collector:4318; needs the otel extra)",
    )
    parser.add_argument(
        "--otlp-interval",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="seconds between OTLP exports (default 10)",
    )


def add_parsers(sub: Any) -> None:
    """Add ``exporter`` to the CLI's subparsers."""
    exp = sub.add_parser(
        "exporter",
        help="serve GPU, RAPL, process and window metrics to Prometheus",
        description=(
            "Serve metrics on http://ADDR:PORT/metrics. Samples this machine's devices, or, "
            "with --connect, exports the streams of running publishers (monitors, proxies)."
        ),
    )
    exp.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"HTTP port (default {DEFAULT_PORT}; dcgm-exporter's is 9400)",
    )
    add_prometheus_args(exp, prefix="--")
    add_otlp_args(exp)
    exp.add_argument(
        "--connect",
        nargs="+",
        metavar="ENDPOINT",
        default=None,
        help="export these ZeroMQ streams instead of sampling here",
    )
    add_client_curve_args(exp, what="the --connect endpoints")
    exp.add_argument("--backend", type=backend_arg, default="auto", help=BACKEND_HELP)
    add_power_scope_arg(exp)
    exp.add_argument("--gpus", type=int_list, default=None, help="GPU indices, e.g. 0,1")
    exp.add_argument("--cpus", choices=("auto", "none"), default="auto", help="RAPL packages")
    exp.add_argument("--period", type=positive_float, default=0.1, help="sampling period (s)")
    exp.add_argument("--duration", type=positive_float, default=None, help="stop after S s")
    exp.add_argument("--sim-config", default=None, help="simulator config: JSON text or file")
    exp.add_argument(
        "--wait", type=positive_float, default=10.0, help="--connect: give up after S s"
    )
    add_process_args(exp)


async def _exporter(args: argparse.Namespace, out: TextIO) -> int:
    """``zeus-async exporter``: sample (or subscribe) and serve until stopped."""
    if args.connect:
        return await _export_streams(args, out)
    if args.curve_secret is not None or args.curve_server is not None:
        raise CliError("the CURVE options are for --connect (the metrics endpoint is HTTP)")
    from ..runtime import Runtime

    command = command_of(args)
    held = start_command(command) if command else None
    child = held.process if held is not None else None
    try:
        tracking = tracking_from_args(args, child.pid if child else None)
        async with Runtime(
            backend=service_backend(args.backend, "zeus-async exporter"),
            gpus=args.gpus,
            cpus="auto" if args.cpus == "auto" else None,
            period_s=args.period,
            sim_config=sim_config(args.sim_config),
            power_scope=args.power_scope,
            processes=tracking,
            prometheus_port=args.port,
            prometheus_addr=args.addr,
            prometheus_names=args.names,
            otlp=args.otlp,
            otlp_interval_s=args.otlp_interval,
        ) as rt:
            out.write(
                f"zeus-async exporter: http://{args.addr}:{rt.prometheus_port}/metrics "
                f"(backend {rt.backend}, {len(rt.devices)} device(s)"
                f"{', tracking processes' if tracking else ''}). Ctrl-C to stop.\n"
            )
            out.flush()
            if held is not None:
                held.release()  # sampling runs: now the command
            return await _serve_until_done(args, child)
    finally:
        if held is not None:
            held.close()
        if child is not None and child.poll() is None:
            child.terminate()
            child.wait()


async def _serve_until_done(args: argparse.Namespace, child: subprocess.Popen[bytes] | None) -> int:
    code = 0
    async with until_stopped(args.duration):
        while True:
            await anyio.sleep(0.2)
            if child is not None and child.poll() is not None:
                code = exit_status(child.returncode)
                break
    return code


async def _export_streams(args: argparse.Namespace, out: TextIO) -> int:
    from ..bus import Subscriber
    from ..exporters.prometheus import PrometheusExporter

    otlp = None
    if args.otlp:
        from ..exporters.otlp import OtlpExporter

        otlp = OtlpExporter(args.otlp, interval_s=args.otlp_interval)
    with PrometheusExporter(names=args.names) as exporter, contextlib.ExitStack() as stack:
        if otlp is not None:
            stack.callback(otlp.close)
        port = exporter.serve(args.port, args.addr)
        curve = client_curve_from_args(args)
        async with Subscriber(args.connect, topics=[""], curve=curve) as sub:
            await wait_for_publisher(sub, args.connect, args.wait)
            out.write(
                f"zeus-async exporter: http://{args.addr}:{port}/metrics, exporting "
                f"{' '.join(args.connect)}. Ctrl-C to stop.\n"
            )
            out.flush()
            async with until_stopped(args.duration):
                async for event in sub:
                    exporter.add((event,))
                    if otlp is not None:
                        otlp.add((event,))
    return 0


COMMANDS: dict[str, Command] = {"exporter": _exporter}
