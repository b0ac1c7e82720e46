"""``zeus-async monitor``: sample every device, show a live view, print the totals at the end.

On a terminal the view is a table per device (and per tracked process) redrawn in place, fitted
to the terminal's width and height at each refresh. Anything else (a log, a pipe) gets one line
per refresh; ``--quiet`` prints the totals only.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import subprocess
import sys
import time
from typing import Any, TextIO

import anyio
from rich.console import RenderableType
from rich.text import Text

from ..aggregate import LiveTotals
from ..devices import is_simulated
from ..events import Event, GpuSample, RaplSample
from . import carbon as _carbon
from . import processes as _processes
from .common import (
    BACKEND_HELP,
    EXIT_OK,
    Command,
    add_power_scope_arg,
    backend_arg,
    exit_status,
    int_list,
    period,
    positive_float,
    refresh,
    sim_config,
    stop_signal,
    until_stopped,
)
from .common import fmt_cell as _fmt
from .curve import add_server_curve_args, server_curve_from_args
from .render import Column, LiveView, fit_table, group, write_table

__all__ = [
    "COMMANDS",
    "DEVICE_COLUMNS",
    "TOTALS_COLUMNS",
    "add_parsers",
    "device_rows",
    "render_line",
    "totals_rows",
]

logger = logging.getLogger(__name__)


def add_parsers(sub: Any) -> None:
    """Add ``monitor`` to the CLI's subparsers."""
    mon = sub.add_parser(
        "monitor",
        help="live per-GPU power/energy table",
        description="Sample every GPU (and RAPL package) and show power, energy, clocks and "
        "the tracked processes live; print each device's energy when stopped (Ctrl-C, "
        "--duration, or the end of `-- COMMAND`). Without an NVIDIA GPU, simulated GPUs.",
    )
    mon.add_argument("--backend", type=backend_arg, default="auto", help=BACKEND_HELP)
    add_power_scope_arg(mon)
    mon.add_argument("--gpus", type=int_list, default=None, help="GPU indices, e.g. 0,1")
    mon.add_argument("--cpus", choices=("auto", "none"), default="auto", help="RAPL packages")
    mon.add_argument("--period", type=period, default=0.01, help="sampling period (s, >= 0.001)")
    mon.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="skip power/energy reads that can only repeat the last value (same integrals); "
        "default: on where the energy counter is expensive to read",
    )
    mon.add_argument("--publish", metavar="ENDPOINT", help="also publish on a ZeroMQ endpoint")
    add_server_curve_args(mon)
    mon.add_argument("--record", metavar="FILE", help="also record every event to FILE")
    mon.add_argument("--force", action="store_true", help="overwrite an existing --record file")
    mon.add_argument("--duration", type=positive_float, default=None, help="stop after S s")
    mon.add_argument(
        "--refresh",
        type=refresh,
        default=0.5,
        help="view refresh (s, >= 0.05); one line per refresh when the output is not a terminal",
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
    _processes.add_prometheus_args(mon, prefix="--prometheus-")
    _processes.add_otlp_args(mon)
    _processes.add_process_args(mon)
    _carbon.add_carbon_args(mon, emissions=True)


# -- what is drawn ------------------------------------------------------------------------------

#: The live table's columns: device, power and energy stay in the narrowest terminal; the
#: method goes last, then utilisation, average power, clocks and temperature, limit and memory.
DEVICE_COLUMNS = (
    Column("device", left=True),
    Column("power W"),
    Column("avg W", keep=4),
    Column("energy J"),
    Column("temp C", keep=3),
    Column("SM MHz", keep=3),
    Column("util %", keep=5),
    Column("mem GiB", keep=1),
    Column("limit W", keep=2),
    Column("method", left=True, keep=6),
)

#: The closing summary's columns.
TOTALS_COLUMNS = (
    Column("device", left=True),
    Column("energy J"),
    Column("time s", keep=3),
    Column("mean W", keep=4),
    Column("method", left=True, keep=5),
)


def device_rows(totals: LiveTotals) -> list[list[str]]:
    """Rows of the live table (:data:`DEVICE_COLUMNS`): one per GPU, then one per RAPL
    domain."""
    rows = []
    for key, t in totals.devices.items():  # a view built on each access, in device order
        last = t.last
        util = last.get("utilization_frac")
        rows.append(
            [
                key,
                _fmt(last.get("power_w")),
                _fmt(last.get("avg_power_w")),
                _fmt(t.energy_j, digits=2),
                _fmt(last.get("temperature_c"), digits=0),
                _fmt(last.get("sm_clock_hz"), 1e6, 0),
                _fmt(None if util is None else float(util) * 100, digits=0),
                _fmt(last.get("memory_used_bytes"), 2**30, 1),
                _fmt(last.get("power_limit_w"), digits=0),
                (t.fault and f"FAULT:{t.fault}") or t.method,
            ]
        )
    return rows


def _gpu_energy(totals: LiveTotals) -> float:
    return sum(
        t.energy_j
        for key, t in totals.devices.items()
        if t.energy_j is not None and key.startswith("gpu:")
    )


def totals_rows(totals: LiveTotals) -> tuple[list[list[str]], list[list[str]]]:
    """Rows of the closing summary (:data:`TOTALS_COLUMNS`): energy, duration and mean power
    per device; and the footer, the energy of all GPUs."""
    rows = []
    for key, t in totals.devices.items():
        energy = t.energy_j
        mean = energy / t.duration_s if energy is not None and t.duration_s > 0 else None
        rows.append([key, _fmt(energy, digits=2), f"{t.duration_s:.2f}", _fmt(mean), t.method])
    return rows, [["all GPUs", f"{_gpu_energy(totals):.2f}", "", "", ""]]


def write_totals(out: TextIO, totals: LiveTotals) -> None:
    """Print the closing summary (``monitor``, ``replay``)."""
    rows, footer = totals_rows(totals)
    write_table(out, TOTALS_COLUMNS, rows, footer=footer)


def render_line(totals: LiveTotals, elapsed_s: float) -> str:
    """One line of the live view, for output that is not a terminal (a log, a pipe): the time
    since the start, then each device's power and energy so far, then the GPUs' energy."""
    cells = [f"{elapsed_s:.1f} s"]
    for key, t in totals.devices.items():
        cells.append(
            f"{key} {_fmt(t.last.get('power_w'), digits=0)} W {_fmt(t.energy_j, digits=1)} J"
            + (f" FAULT:{t.fault}" if t.fault else "")
        )
    cells.append(f"all GPUs {_gpu_energy(totals):.1f} J")
    return "  ".join(cells)


def live_view(
    totals: LiveTotals,
    processes: _processes.ProcessTable,
    elapsed_s: float,
    width: int,
    height: int,
    title: str = "",
    stop_keys: str = "Ctrl-C",
) -> RenderableType:
    """The terminal view at ``width`` x ``height``: a title line, the device table (its rows
    come first), the process table in the rows left, and a status line. Nothing wraps; rows
    that do not fit are counted in a ``… N more`` row."""
    status = Text(
        f"{elapsed_s:.1f} s, all GPUs {_gpu_energy(totals):.1f} J. {stop_keys} to stop.",
        no_wrap=True,
        overflow="ellipsis",
    )
    # Lines: the title, 2 of header per table, 1 blank between tables, 1 status line.
    room = max(height - 2, 1)
    dev_rows = device_rows(totals)
    dev_max = max(room - 2, 1)
    devices = fit_table(DEVICE_COLUMNS, dev_rows, width=width, max_rows=dev_max, more="more")
    used = 2 + min(len(dev_rows), dev_max)
    proc_rows = processes.rows()
    procs = None
    left = room - used - 3  # a blank line and the process table's header
    if proc_rows and left >= 1:
        procs = fit_table(_processes.PROCESS_COLUMNS, proc_rows, width=width, max_rows=left)
    elif proc_rows:
        status.append(f" +{len(proc_rows)} process(es) hidden")
    head = Text(title, no_wrap=True, overflow="ellipsis", style="bold")
    return group(head, devices, Text("") if procs is not None else None, procs, status)


# -- the command ------------------------------------------------------------------------------


def demo_sim_config(backend: str = "sim") -> Any:
    """The simulator setup ``monitor`` uses when none is given: busy, varied GPUs (the
    preset of the vendor a ``sim-<vendor>`` backend names, with noise in proportion)."""
    from ..devices import SIM_VENDORS
    from ..devices.sim_config import sim_preset
    from ..devices.sim_workload import RandomWorkload

    vendor = SIM_VENDORS.get(backend, "nvidia")
    noise = 2.0 if vendor == "nvidia" else sim_preset(vendor).max_w / 350.0
    return sim_preset(
        vendor,
        workload=RandomWorkload(seg_min_s=0.3, seg_max_s=2.0),
        seed=7,
        power_noise_w=noise,
    )


#: Longest wait for the first sample before ``monitor -- CMD`` lets the command run (seconds).
_FIRST_SAMPLE_S = 5.0


async def _quit_on_q(scope: anyio.CancelScope, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    """End the view when ``q`` is typed, as in ``top`` or ``nvitop`` (the terminal in cbreak
    mode meanwhile: keys one by one, no echo; Ctrl-C stays a signal; put back after)."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd, termios.TCSANOW)
    try:
        task_status.started()
        while True:
            await anyio.wait_readable(fd)
            keys = os.read(fd, 64)
            if not keys:  # the terminal went away
                return
            if b"q" in keys.lower():
                scope.cancel()
                return
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _keys_for_quit(out: TextIO) -> bool:
    """``q`` quits when the view is drawn on a terminal that is also our input (a command
    given to ``monitor -- CMD`` keeps the keyboard for itself)."""
    try:
        return sys.stdin.isatty() and _is_terminal(out) and os.name == "posix"
    except (AttributeError, ValueError):
        return False


def _demo_backend(backend: str) -> str:
    """``monitor``'s backend: ``auto`` falls back to the simulator where no NVIDIA driver is
    installed, as the library does, but says so in the banner instead of a log line (a driver
    that fails is its typed error, as everywhere)."""
    from ..devices import auto_backend

    return auto_backend() if backend == "auto" else backend


async def _watch_child(child: subprocess.Popen[bytes], exited: anyio.Event) -> None:
    await anyio.to_thread.run_sync(child.wait, abandon_on_cancel=True)
    exited.set()


def _is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


async def _monitor(args: argparse.Namespace, out: TextIO) -> int:
    from ..runtime import Runtime

    totals = LiveTotals()
    processes = _processes.ProcessTable()
    sampled = anyio.Event()
    carbon = _carbon.carbon_from_args(args)
    running = _running_footprint(carbon)
    charged = [0]  # stream time of the last charge of the running footprint
    gpu_devices: list[Any] = []

    async def consume(stream: anyio.abc.ObjectReceiveStream[Event]) -> None:
        async for event in stream:
            totals.add(event)
            processes.add(event)
            if not sampled.is_set() and isinstance(event, GpuSample | RaplSample):
                sampled.set()
            # The energy since the last charge, at the intensity then (twice a second).
            if (
                running is not None
                and isinstance(event, GpuSample | RaplSample)
                and event.t_ns - charged[0] >= _CHARGE_EVERY_NS
            ):
                charged[0] = event.t_ns
                _charge(running, totals)

    sim = sim_config(args.sim_config)
    if sim is None and not os.environ.get("ZEUS_ASYNC_SIM"):
        sim = demo_sim_config(args.backend)
    publish_curve = server_curve_from_args(args, "--publish", args.publish)
    if args.record is not None:
        from ..store.outputs import claim_output

        claim_output(args.record, overwrite=args.force, what="recording", recording=True)
    command = _processes.command_of(args)
    # The command's process exists now (tracking names its pid) but runs only once sampling
    # has started, so its start-up is measured too.
    held = _processes.start_command(command) if command else None
    child = held.process if held is not None else None
    code = EXIT_OK
    try:
        runtime = Runtime(
            backend=_demo_backend(args.backend),
            gpus=args.gpus,
            cpus="auto" if args.cpus == "auto" else None,
            period_s=args.period,
            adaptive_reads=args.adaptive,
            power_scope=args.power_scope,
            publish=args.publish,
            publish_curve=publish_curve,
            sim_config=sim,
            consumers=[consume],
            record=args.record,
            overwrite=args.force,
            processes=_processes.tracking_from_args(args, child.pid if child else None),
            prometheus_port=args.prometheus_port,
            prometheus_addr=args.prometheus_addr,
            prometheus_names=args.prometheus_names,
            otlp=args.otlp,
            otlp_interval_s=args.otlp_interval,
            carbon=carbon,
        )
        tty = _is_terminal(out)
        async with runtime as rt:
            gpu_devices = [
                i for i in (d.describe() for d in rt.devices) if i.key.startswith("gpu:")
            ]
            where = f", publishing on {rt.publisher.endpoint}" if rt.publisher is not None else ""
            if publish_curve is not None:
                where += " (CURVE)"
            if args.record:
                where += f", recording to {args.record}"
            if rt.prometheus_port is not None:
                where += f", metrics on http://{args.prometheus_addr}:{rt.prometheus_port}/metrics"
            if args.otlp:
                where += f", pushing to {args.otlp}"
            if child is not None:
                where += f", running {' '.join(command)} (pid {child.pid})"
            backend = rt.backend
            if is_simulated(backend):
                why = ": no GPU driver on this machine" if args.backend == "auto" else ""
                backend = f"{backend} (SIMULATED GPUs{why})"
            scopes = sorted(
                {d.describe().power_scope for d in rt.devices if d.describe().power_scope}
            )
            if scopes and scopes != ["gpu"]:  # say it where it is not the usual one
                backend += f", {'/'.join(scopes)} power scope"
                if "module" in scopes:
                    backend += " (GPU + CPU + memory, integrated power)"
            title = (
                f"backend {backend}, {len(rt.devices)} device(s), "
                f"period {args.period * 1e3:g} ms{where}"
            )
            out.write(f"zeus-async monitor: {title}. Ctrl-C to stop.\n")
            out.flush()
            if held is not None:
                if rt.devices:
                    with anyio.move_on_after(_FIRST_SAMPLE_S):
                        await sampled.wait()
                held.release()
            exited = anyio.Event()
            view = LiveView(out) if tty and not args.quiet else None
            stop_keys = "Ctrl-C"
            async with until_stopped(args.duration) as tg:
                if child is not None:
                    tg.start_soon(_watch_child, child, exited)
                elif view is not None and _keys_for_quit(out):
                    await tg.start(_quit_on_q, tg.cancel_scope)
                    stop_keys = "q or Ctrl-C"
                started = time.monotonic()
                if view is not None:
                    view.__enter__()
                try:
                    while True:
                        # Redrawn every --refresh s, and at once when the command exits: the
                        # totals then end with it, not up to one refresh later.
                        with anyio.move_on_after(args.refresh):
                            await exited.wait()
                        elapsed = time.monotonic() - started
                        if view is not None:
                            view.update(
                                functools.partial(
                                    live_view,
                                    totals,
                                    processes,
                                    elapsed,
                                    title=title,
                                    stop_keys=stop_keys,
                                )
                            )
                        elif not args.quiet:
                            # A log or a pipe: one line per interval, not a table redrawn.
                            out.write(render_line(totals, elapsed) + "\n")
                            out.flush()
                        if child is not None and exited.is_set():
                            code = exit_status(child.returncode)
                            break
                finally:
                    if view is not None:
                        view.__exit__(None, None, None)
            signum = stop_signal()
            if child is not None and child.poll() is not None:
                # The command ended (a Ctrl-C reaches it too, and the signal may cancel the
                # loop above just as it notices): its status, whichever came first.
                code = exit_status(child.returncode)
            elif child is not None and signum is not None:
                # Interrupted with the command still running: the status of a shell whose
                # command was killed by that signal (130 for Ctrl-C), not success.
                code = 128 + signum
    finally:
        if held is not None:
            held.close()  # never released (the monitor failed to start): it does not run
        if child is not None and child.poll() is None:
            child.terminate()
            child.wait()
    out.write("\nTotals\n")
    write_totals(out, totals)
    if running is not None:
        _charge(running, totals)
        out.write("\n")
        _carbon.write_footprint(out, "carbon", running.footprint)
        if args.emissions is not None and running.footprint is not None:
            from ..store.emissions_csv import RunEnergy, append_emissions_row, emissions_row

            gpu, cpu, dram = _carbon.carbon_energy(totals)
            duration = max((t.duration_s for t in totals.devices.values()), default=0.0)
            models = [d.name for d in gpu_devices]
            row = emissions_row(
                RunEnergy(duration, gpu, cpu, dram, running.footprint, gpu_model=models),
                project_name="zeus-async monitor",
                zone=carbon.zone if carbon is not None else "",
            )
            path = append_emissions_row(args.emissions, row)
            out.write(f"emissions   appended to {path}\n")
    rows = processes.rows()
    if rows:
        out.write("\n")
        write_table(out, _processes.PROCESS_COLUMNS, rows)
    out.flush()
    return code


#: Stream time between two charges of ``monitor``'s running footprint.
_CHARGE_EVERY_NS = 500_000_000


def _running_footprint(config: Any) -> Any:
    """A :class:`~zeus_async.aggregate.footprints.RunningFootprint` for ``config`` (or None)."""
    from ..aggregate.footprints import Carbon, RunningFootprint

    carbon = Carbon.of(config)
    return None if carbon is None else RunningFootprint(carbon)


def _charge(running: Any, totals: LiveTotals) -> None:
    """Charge the energy of every device since the last charge."""
    firsts = [t.first_t_ns for t in totals.devices.values() if t.first_t_ns is not None]
    lasts = [t.last_t_ns for t in totals.devices.values() if t.last_t_ns is not None]
    if not lasts:
        return
    running.advance(sum(_carbon.carbon_energy(totals)), max(lasts), since_ns=min(firsts))


COMMANDS: dict[str, Command] = {"monitor": _monitor}
