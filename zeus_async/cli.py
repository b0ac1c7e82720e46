"""Command-line interface: ``zeus-async <command>`` (also ``python -m zeus_async``).

Commands:
    monitor    sample GPUs (and RAPL) and show a live per-device table; totals at the end
    subscribe  print events from a publisher (``--json`` for one JSON object per line)
    proxy      forward the streams of many publishers to one endpoint (XSUB/XPUB)
    inspect    summary of a recording (devices, duration, energy, windows, damage)
    export     convert a recording to CSV or JSON lines
    replay     replay a recording into the pipeline (and onto ZeroMQ), at any pace
    record     record a remote stream (a publisher or a proxy) to a file
    plot       draw per-GPU power over time with the windows shaded
    exporter   serve GPU, RAPL, process and window metrics to Prometheus

``monitor`` and ``exporter`` track processes with ``--pid PID`` or by running a command
(``zeus-async monitor -- python train.py``): CPU, memory and attributed CPU/DRAM/GPU power.

Errors in arguments or endpoints print one line to stderr and exit non-zero; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import anyio
import msgspec

from . import __version__, _cli_pfo, _cli_processes, _cli_store
from ._cli_common import (
    Interrupted,
    positive_int,
    report_streams,
    run_command,
    stop_signal,
    stop_when_streams_end,
    streams_ended,
    until_stopped,
    wait_for_publisher,
)
from ._cli_common import fmt_cell as _fmt
from .aggregate import LiveTotals
from .errors import ZeusAsyncError, sole_exception
from .events import Event, GpuSample, RaplSample, event_to_dict

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """An error to report as one line on stderr."""


# -- argument helpers ---------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 0,1 — got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one index, like 0 or 0,1")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"indices must be >= 0, got {text!r}")
    return values


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _seconds_at_least(what: str, minimum: float, shown: str) -> Callable[[str], float]:
    """argparse type: a positive number of seconds, at least ``minimum`` (``shown`` in the
    message: ``1 ms``, ``0.05 s``)."""

    def parse(text: str) -> float:
        value = _positive_float(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"a {what} of {text} s is below the {shown} minimum")
        return value

    return parse


#: The shortest sampling period the CLI accepts (s): one NVML read takes tens of µs, and
#: the driver refreshes power every few ms at best.
MIN_PERIOD_S = 0.001
_period = _seconds_at_least("sampling period", MIN_PERIOD_S, "1 ms")

#: The fastest table refresh the CLI accepts (s): faster flickers, and costs CPU for nothing.
MIN_REFRESH_S = 0.05
_refresh = _seconds_at_least("refresh", MIN_REFRESH_S, "0.05 s")


def _sim_config(text: str | None) -> Any:
    if text is None:
        return None
    from .devices.sim import SimConfig

    raw = Path(text).read_bytes() if not text.lstrip().startswith("{") else text.encode()
    try:
        return msgspec.json.decode(raw, type=SimConfig)
    except msgspec.DecodeError as exc:
        raise CliError(f"invalid --sim-config: {exc}") from None


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeus-async",
        description="Measure and optimize the energy of GPU work.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    parser.add_argument("--version", action="version", version=f"zeus-async {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    mon = sub.add_parser("monitor", help="live per-GPU power/energy table")
    mon.add_argument("--backend", choices=("auto", "nvml", "sim"), default="auto")
    mon.add_argument("--gpus", type=_int_list, default=None, help="GPU indices, e.g. 0,1")
    mon.add_argument("--cpus", choices=("auto", "none"), default="auto", help="RAPL packages")
    mon.add_argument("--period", type=_period, default=0.01, help="sampling period (s, >= 0.001)")
    mon.add_argument(
        "--adaptive",
        action="store_true",
        help="skip power/energy reads that can only repeat the last value (same integrals)",
    )
    mon.add_argument("--publish", metavar="ENDPOINT", help="also publish on a ZeroMQ endpoint")
    mon.add_argument("--record", metavar="FILE", help="also record every event to FILE")
    mon.add_argument("--force", action="store_true", help="overwrite an existing --record file")
    mon.add_argument("--duration", type=_positive_float, default=None, help="stop after S s")
    mon.add_argument(
        "--refresh",
        type=_refresh,
        default=0.5,
        help="table refresh (s, >= 0.05); one line per refresh when the output is not a terminal",
    )
    mon.add_argument(
        "-q", "--quiet", action="store_true", help="no live view: the totals at the end only"
    )
    mon.add_argument("--sim-config", default=None, help="simulator config: JSON text or file")
    mon.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        help="also serve metrics to Prometheus on this port (0: any free one)",
    )
    _cli_processes.add_prometheus_args(mon, prefix="--prometheus-")
    _cli_processes.add_otlp_args(mon, _positive_float)
    _cli_processes.add_process_args(mon)

    sbs = sub.add_parser("subscribe", help="print events from a publisher")
    sbs.add_argument("endpoints", nargs="+", metavar="ENDPOINT")
    sbs.add_argument("--topic", action="append", default=None, help="topic prefix (repeatable)")
    sbs.add_argument("--json", action="store_true", help="one JSON object per line")
    sbs.add_argument("--count", type=positive_int, default=None, help="stop after N events")
    sbs.add_argument("--duration", type=_positive_float, default=None, help="stop after S s")
    sbs.add_argument(
        "--until-end",
        action="store_true",
        help="stop once every stream seen has ended (or gone silent for 3 s: tail unknown)",
    )
    sbs.add_argument(
        "--wait", type=_positive_float, default=10.0, help="give up if no publisher answers (s)"
    )

    prx = sub.add_parser("proxy", help="aggregate many publishers onto one endpoint")
    prx.add_argument("--in", dest="inputs", nargs="+", required=True, metavar="ENDPOINT")
    prx.add_argument("--out", dest="output", required=True, metavar="ENDPOINT")
    prx.add_argument("--duration", type=_positive_float, default=None, help="stop after S s")
    agt = sub.add_parser(
        "agent",
        help="run the node agent (one sampler for every client; restores settings)",
        description="Run the node agent: it samples every GPU once and serves the Monitors, "
        "optimizers and PFO clients of this user on this node, and puts back every power limit "
        "and clock lock a client changed when the client releases it, exits or dies, and when "
        "the agent stops. Its first act is to restore what dead processes left changed.",
    )
    agt.add_argument(
        "--restore",
        action="store_true",
        help="only restore the settings dead processes left changed, then exit",
    )
    agt.add_argument("--backend", choices=("auto", "nvml", "sim"), default="auto")
    agt.add_argument("--period", type=_period, default=0.01, help="sampling period (s, >= 0.001)")
    agt.add_argument("--adaptive", action="store_true", help="adaptive reads (see monitor)")
    agt.add_argument("--publish", metavar="ENDPOINT", help="also publish on a ZeroMQ endpoint")
    agt.add_argument("--record", metavar="FILE", help="also record every event to FILE")
    agt.add_argument("--force", action="store_true", help="overwrite an existing --record file")
    agt.add_argument(
        "--exit-when-idle",
        type=_positive_float,
        default=None,
        metavar="S",
        help="stop S seconds after the last client left",
    )
    _cli_store.add_parsers(sub, _positive_float)
    _cli_processes.add_exporter_parser(sub, _positive_float, _int_list)
    _cli_pfo.add_parsers(sub, _positive_float)
    helps = {action.dest: action.help for action in sub._choices_actions}
    for name, command in sub.choices.items():
        # -v after the command too (`zeus-async monitor -v`), counted with one before it.
        command.add_argument(
            "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging"
        )
        if command.description is None and helps.get(name):
            command.description = f"{str(helps[name])[0].upper()}{str(helps[name])[1:]}."
    return parser


# -- monitor ------------------------------------------------------------------------------------


def render_line(totals: LiveTotals, elapsed_s: float) -> str:
    """One line of the live view, for output that is not a terminal (a log, a pipe): the time
    since the start, then each device's power and energy so far, then the GPUs' energy."""
    cells = [f"{elapsed_s:.1f} s"]
    total_gpu = 0.0
    for key, t in totals.devices.items():
        energy = t.energy_j
        if energy is not None and key.startswith("gpu:"):
            total_gpu += energy
        cells.append(
            f"{key} {_fmt(t.last.get('power_w'), digits=0)} W {_fmt(energy, digits=1)} J"
            + (f" FAULT:{t.fault}" if t.fault else "")
        )
    cells.append(f"all GPUs {total_gpu:.1f} J")
    return "  ".join(cells)


def render_table(totals: LiveTotals) -> list[str]:
    """Lines of the live table (one row per GPU, then one per RAPL domain)."""
    header = (
        f"{'device':<16}{'power W':>9}{'avg W':>9}{'energy J':>12}{'temp C':>8}"
        f"{'SM MHz':>8}{'util %':>8}{'mem GiB':>9}{'limit W':>9}  method"
    )
    lines = [header, "-" * len(header)]
    for key, t in totals.devices.items():  # a view built on each access, in device order
        last = t.last
        status = (t.fault and f"FAULT:{t.fault}") or t.method
        util = last.get("utilization_frac")
        lines.append(
            f"{key:<16}{_fmt(last.get('power_w')):>9}{_fmt(last.get('avg_power_w')):>9}"
            f"{_fmt(t.energy_j, digits=2):>12}{_fmt(last.get('temperature_c'), digits=0):>8}"
            f"{_fmt(last.get('sm_clock_hz'), 1e6, 0):>8}"
            f"{_fmt(None if util is None else float(util) * 100, digits=0):>8}"
            f"{_fmt(last.get('memory_used_bytes'), 2**30, 1):>9}"
            f"{_fmt(last.get('power_limit_w'), digits=0):>9}  {status}"
        )
    return lines


def render_totals(totals: LiveTotals) -> list[str]:
    """Lines of the closing summary: energy, duration and mean power per device."""
    lines = [f"{'device':<16}{'energy J':>12}{'time s':>9}{'mean W':>9}  method"]
    total_gpu = 0.0
    for key, t in totals.devices.items():  # a view built on each access, in device order
        energy = t.energy_j
        mean = energy / t.duration_s if energy is not None and t.duration_s > 0 else None
        if energy is not None and key.startswith("gpu:"):
            total_gpu += energy
        lines.append(
            f"{key:<16}{_fmt(energy, digits=2):>12}{t.duration_s:>9.2f}{_fmt(mean):>9}  {t.method}"
        )
    lines.append(f"{'all GPUs':<16}{total_gpu:>12.2f}")
    return lines


def demo_sim_config() -> Any:
    """The simulator setup ``monitor`` uses when none is given: busy, varied GPUs."""
    from .devices.sim import SimConfig
    from .devices.sim_workload import RandomWorkload

    return SimConfig(
        workload=RandomWorkload(seg_min_s=0.3, seg_max_s=2.0), seed=7, power_noise_w=2.0
    )


def describe_error(exc: BaseException) -> str:
    """One line for the user: ``path: reason`` for a file error, else the message."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


async def _monitor(args: argparse.Namespace, out: TextIO) -> int:
    from .runtime import Runtime

    totals = LiveTotals()
    processes = _cli_processes.ProcessTable()
    sampled = anyio.Event()

    async def consume(stream: anyio.abc.ObjectReceiveStream[Event]) -> None:
        async for event in stream:
            totals.add(event)
            processes.add(event)
            if not sampled.is_set() and isinstance(event, GpuSample | RaplSample):
                sampled.set()

    sim_config = _sim_config(args.sim_config)
    if sim_config is None and not os.environ.get("ZEUS_ASYNC_SIM"):
        sim_config = demo_sim_config()
    if args.record is not None:
        from .store.outputs import claim_output

        claim_output(args.record, overwrite=args.force, what="recording", recording=True)
    command = _cli_processes.command_of(args)
    # The command's process exists now (tracking names its pid) but runs only once sampling
    # has started, so its start-up is measured too.
    held = _cli_processes.start_command(command) if command else None
    child = held.process if held is not None else None
    code = EXIT_OK
    try:
        runtime = Runtime(
            backend=args.backend,
            gpus=args.gpus,
            cpus="auto" if args.cpus == "auto" else None,
            period_s=args.period,
            adaptive_reads=args.adaptive,
            publish=args.publish,
            sim_config=sim_config,
            consumers=[consume],
            record=args.record,
            overwrite=args.force,
            processes=_cli_processes.tracking_from_args(args, child.pid if child else None),
            prometheus_port=args.prometheus_port,
            prometheus_addr=args.prometheus_addr,
            prometheus_names=args.prometheus_names,
            otlp=args.otlp,
            otlp_interval_s=args.otlp_interval,
        )
        tty = out.isatty()
        async with runtime as rt:
            where = f", publishing on {rt.publisher.endpoint}" if rt.publisher is not None else ""
            if args.record:
                where += f", recording to {args.record}"
            if rt.prometheus_port is not None:
                where += f", metrics on http://{args.prometheus_addr}:{rt.prometheus_port}/metrics"
            if args.otlp:
                where += f", pushing to {args.otlp}"
            if child is not None:
                where += f", running {' '.join(command)} (pid {child.pid})"
            out.write(
                f"zeus-async monitor: backend {rt.backend}, {len(rt.devices)} device(s), "
                f"period {args.period * 1e3:g} ms{where}. Ctrl-C to stop.\n"
            )
            out.flush()
            if held is not None:
                if rt.devices:
                    with anyio.move_on_after(_FIRST_SAMPLE_S):
                        await sampled.wait()
                held.release()
            drawn = 0
            exited = anyio.Event()
            async with until_stopped(args.duration) as tg:
                if child is not None:
                    tg.start_soon(_watch_child, child, exited)
                started = time.monotonic()
                while True:
                    # The table is redrawn every --refresh s, and at once when the command exits:
                    # the totals then end with it, not up to one refresh later.
                    with anyio.move_on_after(args.refresh):
                        await exited.wait()
                    if args.quiet:
                        pass
                    elif not tty:
                        # A log or a pipe: one line per interval, not a table redrawn.
                        elapsed = time.monotonic() - started
                        out.write(render_line(totals, elapsed) + "\n")
                        out.flush()
                    else:
                        lines = render_table(totals)
                        table = processes.lines()
                        if table:
                            lines += ["", *table]
                        if drawn:
                            out.write(f"\x1b[{drawn}F\x1b[J")
                        out.write("\n".join(lines) + "\n")
                        out.flush()
                        drawn = len(lines)
                    if child is not None and exited.is_set():
                        code = child.returncode
                        break
            signum = stop_signal()
            if child is not None and not exited.is_set() and signum is not None:
                # Interrupted with the command still running: the status of a shell whose
                # command was killed by that signal (130 for Ctrl-C), not success.
                code = 128 + signum
    finally:
        if held is not None:
            held.close()  # never released (the monitor failed to start): it does not run
        if child is not None and child.poll() is None:
            child.terminate()
            child.wait()
    out.write("\nTotals\n" + "\n".join(render_totals(totals)) + "\n")
    table = processes.lines()
    if table:
        out.write("\n".join(table) + "\n")
    out.flush()
    return code


#: Longest wait for the first sample before ``monitor -- CMD`` lets the command run (seconds).
_FIRST_SAMPLE_S = 5.0


async def _watch_child(child: subprocess.Popen[bytes], exited: anyio.Event) -> None:
    await anyio.to_thread.run_sync(child.wait, abandon_on_cancel=True)
    exited.set()


async def _exporter(args: argparse.Namespace, out: TextIO) -> int:
    return await _cli_processes.run_exporter(args, out, _sim_config(args.sim_config))


# -- subscribe ----------------------------------------------------------------------------------


def format_event(event: Event) -> str:
    """A compact human line for one event: ``kind host key=value ...``."""
    data = event_to_dict(event)
    kind = data.pop("kind")
    host = data.pop("host", "")
    data.pop("t_ns", None)
    if kind == "stream":
        devices = data.pop("devices", [])
        data["devices"] = ",".join(str(d.get("key")) for d in devices) or "none"
        data.pop("argv", None)
    # Floats as their shortest exact text: counters such as energy_j (~1e7 J) keep their mJ.
    parts = [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in data.items()]
    return f"{kind:<12}{host} " + " ".join(p for p in parts if not p.endswith("=None"))


def json_line(event: Event, *, frame: dict[str, Any]) -> str:
    """A ``subscribe --json`` line: the event's JSON object (:func:`event_to_dict`, the line of
    ``export --format jsonl``) with the frame that carried it under ``"frame"``: its stream
    id, stream seq, topic and topic seq (``docs/wire-format.md`` §6)."""
    data = event_to_dict(event)
    data["frame"] = frame
    return msgspec.json.encode(data).decode()


async def _subscribe(args: argparse.Namespace, out: TextIO) -> int:
    from .bus import Subscriber

    topics = args.topic or [""]
    count = 0
    async with Subscriber(args.endpoints, topics=topics) as sub:
        await wait_for_publisher(sub, args.endpoints, args.wait)
        async with until_stopped(args.duration) as tg:
            if args.until_end:
                tg.start_soon(stop_when_streams_end, sub.stats, tg.cancel_scope)
            async for frame in sub.frames():
                header = frame.header
                where = {
                    "stream_id": header.stream_id,
                    "seq": header.seq,
                    "topic": frame.topic,
                    "topic_seq": header.topic_seq,
                }
                for event in frame.events:
                    if args.json:
                        out.write(json_line(event, frame=where) + "\n")
                    else:
                        out.write(format_event(event) + "\n")
                    count += 1
                    if args.count is not None and count >= args.count:
                        break
                out.flush()
                if args.count is not None and count >= args.count:
                    break
                if args.until_end and streams_ended(sub.stats):
                    break
        stats = sub.stats
    logger.info("received %d event(s); %d frame(s) lost", count, stats.frames_lost)
    report_streams(stats)
    return EXIT_OK


# -- proxy --------------------------------------------------------------------------------------


async def _proxy(args: argparse.Namespace, out: TextIO) -> int:
    from .bus import run_proxy

    async with until_stopped(args.duration) as tg:
        await tg.start(run_proxy, args.inputs, args.output)
        out.write(f"zeus-async proxy: {' '.join(args.inputs)} -> {args.output}\n")
        out.flush()
        await anyio.sleep_forever()
    return EXIT_OK


def _agent(args: argparse.Namespace, out: TextIO) -> int:
    """``zeus-async agent``: its own event loop and signal handling (restores come first)."""
    from .agent.client import node_agent_config
    from .agent.leases import recover_orphans
    from .agent.server import EXIT_AGENT_RUNNING, serve

    try:
        if args.restore:
            restored = recover_orphans()
            for r in restored:
                what = "power limit" if r.entry.setting == "power_limit" else "locked clocks"
                status = f"failed: {r.error}" if r.error else "restored"
                out.write(f"{r.entry.uuid} {what} (left by pid {r.entry.pid}): {status}\n")
            out.write(f"{len(restored)} setting(s) found to restore\n")
            return EXIT_ERROR if any(r.error for r in restored) else EXIT_OK
        cfg = node_agent_config(
            backend=args.backend,
            period_s=args.period,
            adaptive_reads=args.adaptive,
            publish=args.publish,
            record=args.record,
            overwrite=args.force,
            exit_when_idle_s=args.exit_when_idle,
        )
        if args.record is not None:
            from .store.outputs import claim_output

            claim_output(args.record, overwrite=args.force, what="recording", recording=True)
    except (ZeusAsyncError, OSError) as exc:
        sys.stderr.write(f"zeus-async agent: {describe_error(exc)}\n")
        return EXIT_ERROR
    code = serve(cfg, ready_line=True)
    if code == EXIT_AGENT_RUNNING:
        sys.stderr.write("zeus-async agent: another agent is already running on this node\n")
        return EXIT_ERROR
    return EXIT_OK if code == 0 else EXIT_ERROR


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
    parser = _build_parser()
    args = parser.parse_args(argv)
    stream = out or sys.stdout
    level = logging.WARNING - 10 * args.verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s"
    )
    commands = {
        "monitor": _monitor,
        "subscribe": _subscribe,
        "proxy": _proxy,
        "exporter": _exporter,
    }
    commands.update(_cli_store.COMMANDS)
    commands.update(_cli_pfo.COMMANDS)
    if args.command is None:
        parser.print_help(stream)
        return EXIT_USAGE
    if args.command == "agent":
        return _agent(args, stream)
    try:
        return anyio.run(run_command, commands[args.command], args, stream, backend="asyncio")
    except KeyboardInterrupt:
        return 130
    except Exception as caught:  # one line, no traceback (a task group's group of one unwrapped)
        exc = sole_exception(caught)
        if isinstance(exc, BrokenPipeError):
            # The reader of our output went away (`... | head`): stop quietly, as a process
            # killed by SIGPIPE would, and keep the interpreter from failing on flush at exit.
            _quiet_stdout()
            return EXIT_BROKEN_PIPE
        if isinstance(exc, Interrupted):
            sys.stderr.write(f"zeus-async {args.command}: {exc}\n")
            return 130
        if isinstance(exc, (CliError, ZeusAsyncError, OSError)):
            sys.stderr.write(f"zeus-async {args.command}: {describe_error(exc)}\n")
            return EXIT_ERROR
        if os.environ.get("ZEUS_ASYNC_DEBUG"):
            raise
        name = type(exc).__name__  # zmq errors and the like
        sys.stderr.write(f"zeus-async {args.command}: {name}: {exc}\n")
        return EXIT_ERROR


__all__ = ["format_event", "main", "render_table", "render_totals"]
