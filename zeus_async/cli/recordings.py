"""The recording commands of the CLI: ``inspect``, ``export``, ``replay``, ``record``, ``plot``,
``convert``.

Long passes draw a progress bar (rich) on stderr when it is a terminal; ``record`` a status
line with the events and bytes recorded so far.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import anyio
import msgspec

from ..errors import ConfigError
from ..events import Event, StreamInfo
from .common import (
    Command,
    nonnegative_int,
    positive_float,
    positive_int,
    report_streams,
    stop_when_streams_end,
    streams_ended,
    until_stopped,
    wait_for_publisher,
)
from .curve import (
    add_client_curve_args,
    add_server_curve_args,
    client_curve_from_args,
    server_curve_from_args,
)
from .monitor import TOTALS_COLUMNS, write_totals
from .render import Column, counting_status, stop_progress_bars, terminal_progress, write_table

__all__ = ["COMMANDS", "add_parsers"]

logger = logging.getLogger(__name__)


def _speed(text: str) -> float | None:
    if text == "max":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a factor like 2 or 'max', got {text!r}"
        ) from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive factor or 'max', got {text!r}")
    if value < MIN_SPEED:
        raise argparse.ArgumentTypeError(
            f"a pace of {text}x is below the {MIN_SPEED:g}x minimum (1 s of the recording "
            f"would take {1 / value:.3g} s)"
        )
    return value


#: The smallest rotation size (MB): the recorder's 4096-byte minimum.
MIN_ROTATE_MB = 4096 / 1e6


def _rotate_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in MB, got {text!r}") from None
    if not value >= MIN_ROTATE_MB or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"a part of {text} MB is below the {MIN_ROTATE_MB:g} MB (4096-byte) minimum"
        )
    return value


#: The slowest replay pace the CLI accepts: 1 s of the recording in 1,000 s.
MIN_SPEED = 0.001


def add_parsers(sub: Any) -> None:
    """Add the recording commands to the CLI's subparsers."""
    ins = sub.add_parser("inspect", help="summary of a recording")
    ins.add_argument("file")
    ins.add_argument(
        "--windows", type=nonnegative_int, default=20, help="windows to list (default 20)"
    )
    from .carbon import add_carbon_args

    add_carbon_args(ins)

    exp = sub.add_parser("export", help="convert a recording to CSV, JSON lines or Parquet")
    exp.add_argument("file")
    exp.add_argument("--format", choices=("csv", "jsonl", "parquet"), required=True)
    exp.add_argument(
        "-o",
        "--output",
        default="-",
        help="output file (default: stdout); parquet: a directory of <kind>.parquet files, or "
        "one .parquet file with a single --kind",
    )
    exp.add_argument("--kind", action="append", default=None, help="event kind (repeatable)")
    exp.add_argument("--force", action="store_true", help="overwrite an existing output file")

    rep = sub.add_parser("replay", help="replay a recording into the pipeline")
    rep.add_argument("file")
    rep.add_argument(
        "--speed", type=_speed, default=1.0, help="pace factor, or 'max' (default: 1, real time)"
    )
    rep.add_argument("--publish", metavar="ENDPOINT", help="publish the replay on ZeroMQ")
    add_server_curve_args(rep)
    rep.add_argument(
        "--wait-subscriber",
        type=positive_float,
        default=None,
        metavar="S",
        help="with --publish: wait up to S s for a subscriber before starting",
    )
    rep.add_argument("--record", metavar="FILE", help="record the replayed stream to FILE")
    rep.add_argument("--force", action="store_true", help="overwrite an existing --record file")

    rec = sub.add_parser("record", help="record a remote stream to a file")
    rec.add_argument("endpoints", nargs="+", metavar="ENDPOINT")
    rec.add_argument("-o", "--output", required=True, metavar="FILE")
    rec.add_argument("--topic", action="append", default=None, help="topic prefix (repeatable)")
    rec.add_argument("--duration", type=positive_float, default=None, help="stop after S s")
    rec.add_argument("--count", type=positive_int, default=None, help="stop after N events")
    rec.add_argument(
        "--rotate-mb",
        type=_rotate_mb,
        default=None,
        help="start a new part at this size (MB, >= 0.004096)",
    )
    rec.add_argument(
        "--wait", type=positive_float, default=10.0, help="give up if no publisher answers (s)"
    )
    rec.add_argument("--force", action="store_true", help="overwrite an existing recording")
    add_client_curve_args(rec)
    rec.add_argument(
        "--until-end",
        action="store_true",
        help="stop once every stream seen has ended (or gone silent for 3 s: tail unknown)",
    )

    con = sub.add_parser(
        "convert", help="rewrite a recording in another format version (default: columns, v3)"
    )
    con.add_argument("file", help="the recording to read (never written)")
    con.add_argument("output", help="the new recording")
    con.add_argument(
        "--format-version", type=int, choices=(2, 3), default=3, help="format to write (3)"
    )
    con.add_argument("--force", action="store_true", help="overwrite an existing output")

    plo = sub.add_parser("plot", help="draw per-GPU power over time, windows shaded (PNG)")
    plo.add_argument("file")
    plo.add_argument("-o", "--output", required=True, help="image file (.png, .svg, .pdf)")
    plo.add_argument("--title", default=None)
    plo.add_argument(
        "--layout",
        # zeus_async.store.plot.LAYOUTS, not imported here: it would load numpy at every start
        choices=("auto", "overlay", "multiples", "heatmap"),
        default="auto",
        help="the GPUs on one axes (overlay), on one small axes each (multiples) or as rows of "
        "a heatmap; auto: overlay up to 4 GPUs, multiples up to 16, heatmap above (default)",
    )
    plo.add_argument("--force", action="store_true", help="overwrite an existing image")


def _when(t_ns: int) -> str:
    return (
        datetime.datetime.fromtimestamp(t_ns / 1e9, tz=datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S.%f UTC"
        )[:-7]
        + " UTC"
    )


#: ``inspect``'s process energy table.
_PROCESS_TOTALS = (
    Column("process", left=True),
    Column("CPU J", keep=2),
    Column("DRAM J", keep=1),
    Column("GPU J", keep=3),
    Column("total J"),
    Column("time s", keep=4),
)

#: ``inspect``'s split of each GPU's energy by the request meter.
_REQUEST_TOTALS = (
    Column("device", left=True),
    Column("measured J"),
    Column("requests J"),
    Column("idle J"),
)

#: The window tables of ``inspect`` and ``replay`` (``replay`` adds "same as recorded").
_WINDOWS = (
    Column("window", left=True),
    Column("time s"),
    Column("GPU energy J"),
)


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _window_rows(windows: Any) -> list[list[str]]:
    return [[m.name, f"{m.time_s:.3f}", f"{sum(m.gpu_energy_j.values()):.2f}"] for m in windows]


async def _inspect(args: argparse.Namespace, out: TextIO) -> int:
    from ..store import RecordingReader
    from ..store.analysis import Recording
    from .carbon import carbon_from_args, write_footprint

    carbon = carbon_from_args(args)
    reader = RecordingReader(args.file)
    rec = await anyio.to_thread.run_sync(
        lambda: Recording(args.file, progress=terminal_progress("reading"))
    )
    h = reader.header
    w = out.write
    w(f"recording   {args.file} ({reader.size_bytes / 1e6:.2f} MB)\n")
    parts = reader.parts
    if len(parts) > 1:
        w(f"parts       {len(parts)}, read in order: {', '.join(p.name for p in parts)}\n")
    if reader.part_of is not None:
        w(f"part        {str(reader.part_of).removeprefix('part ')}\n")
    w(f"format      v{reader.format_version}, schema v{reader.schema_version}, ")
    w(f"compression {h.compression}\n")
    first = " (the first stream's)" if len(rec.hosts) > 1 else ""
    w(f"host        {h.host}  pid {h.pid}  started {_when(h.start_wall_ns)}{first}\n")
    if h.argv:
        w(f"command     {' '.join(h.argv)}\n")
    if len(rec.hosts) > 1:
        w(f"hosts       {', '.join(rec.hosts)} ({len(rec.streams)} stream(s))\n")
    for name, d in rec.device_info().items():
        counter = "energy counter" if d.has_energy_counter else "no energy counter"
        limits = (
            f", limit {d.power_limit_min_w:g}-{d.power_limit_max_w:g} W"
            if d.power_limit_min_w is not None and d.power_limit_max_w is not None
            else ""
        )
        w(f"device      {name}: {d.name} ({d.arch}, {counter}{limits})\n")
    if h.meta.get("simulated") == "true":
        w("SIMULATED   every GPU figure here comes from the simulator, not from hardware\n")
    report = rec.report
    state = "complete" if report.clean else "DAMAGED"
    if reader.part_of is not None:
        state = f"this part {state}"
    w(f"frames      {report.frames_ok}, events {report.events_ok} ({state})\n")
    if report.header_damage:
        w(f"header      {report.header_damage} (host, devices and metadata unknown)\n")
    if report.torn_tail_offset is not None:
        w(
            f"torn tail   {report.torn_tail_bytes} bytes at offset {report.torn_tail_offset}"
            + (
                f" of {Path(report.torn_tail_part).name}"
                if len(parts) > 1 and report.torn_tail_part
                else ""
            )
            + " "
            "(writer stopped mid-frame; every complete frame was read)\n"
        )
    for offset, reason in report.corrupt_frames:
        w(f"corrupt     frame at offset {offset}: {reason} (skipped)\n")
    w(f"duration    {rec.duration_s:.3f} s  ({_when(rec.start_ns)} .. {_when(rec.end_ns)})\n")
    w("events      " + ", ".join(f"{k} {n}" for k, n in rec.event_counts().items()) + "\n")
    w("metrics     " + (", ".join(rec.metrics()) or "none") + "\n")
    totals = rec.totals()
    if totals.devices:
        w("\n")
        rows = [
            [key, _cell(t.energy_j, 2), f"{t.duration_s:.2f}", _cell(t.mean_power_w, 1), t.method]
            for key, t in totals.devices.items()
        ]
        footer = [["all GPUs", f"{totals.gpu_energy_j:.2f}", "", "", ""]]
        write_table(out, TOTALS_COLUMNS, rows, footer=footer)
        if carbon is not None:
            # Integrated against each device's recorded energy timeline.
            emissions = rec.emissions(carbon)
            w("\n")
            write_footprint(out, "carbon", emissions.total)
            for key, fp in emissions.devices.items():
                write_footprint(out, f"  {key}", fp)
    if totals.processes:
        w("\n")
        rows = []
        for pid, p in totals.processes.items():
            cells = [p.cpu_energy_j, p.dram_energy_j, sum(p.gpu_energy_j.values())]
            rows.append(
                [
                    f"pid {pid}",
                    *(_cell(c, 2) for c in cells),
                    f"{p.total_energy_j:.2f}",
                    f"{p.duration_s:.2f}",
                ]
            )
        write_table(out, _PROCESS_TOTALS, rows)
    requests = rec.requests()
    if requests:
        counts = rec.request_totals()
        energy_of = {r.request_id: sum(r.gpu_energy_j.values()) for r in requests}
        per_token = sorted(energy_of[r.request_id] / r.tokens_out for r in requests if r.tokens_out)
        energies = sorted(energy_of.values())
        w(f"\n{len(requests)} inference request(s) ({requests[0].policy} shares): median ")
        w(f"{energies[len(energies) // 2]:.3f} J")
        if per_token:
            w(f", {per_token[len(per_token) // 2]:.4f} J per output token")
        w("\n")
        rows = [
            [f"gpu:{gpu}", f"{m:.2f}", f"{req:.2f}", f"{idle:.2f}"]
            for gpu, (m, req, idle) in counts.items()
        ]
        write_table(out, _REQUEST_TOTALS, rows)
    windows = rec.windows()
    if windows:
        shown = windows[: max(args.windows, 0)]
        w(f"\n{len(windows)} measured window(s)")
        w(f" (first {len(shown)}):\n" if len(shown) < len(windows) else ":\n")
        if shown:
            write_table(out, _WINDOWS, _window_rows(shown))
    return 0


async def _export(args: argparse.Namespace, out: TextIO) -> int:
    from ..store.analysis import export_csv, export_jsonl
    from ..store.outputs import claim_output

    if args.format == "parquet":
        return await _export_parquet(args, out)
    fn = export_csv if args.format == "csv" else export_jsonl
    if args.output != "-":
        claim_output(args.output, inputs=[args.file], overwrite=args.force, what="export")
    progress = terminal_progress(f"exporting {args.format}") if args.output != "-" else None
    n = await anyio.to_thread.run_sync(
        lambda: fn(args.file, args.output, kinds=args.kind, progress=progress)
    )
    if args.output != "-":
        out.write(f"exported {n} events to {args.output}\n")
    return 0


async def _export_parquet(args: argparse.Namespace, out: TextIO) -> int:
    from ..store.columns import export_parquet

    if args.output == "-":
        raise ConfigError("export --format parquet needs -o/--output (a directory or a .parquet)")
    progress = terminal_progress("exporting parquet")
    written = await anyio.to_thread.run_sync(
        lambda: export_parquet(
            args.file, args.output, kinds=args.kind, progress=progress, overwrite=args.force
        )
    )
    rows = ", ".join(f"{kind} {n}" for kind, n in written.items())
    out.write(f"exported {sum(written.values())} events to {args.output} ({rows})\n")
    return 0


async def _replay(args: argparse.Namespace, out: TextIO) -> int:
    from ..aggregate import LiveTotals
    from ..aggregate.windows import ReplayedWindows
    from ..runtime import Runtime
    from ..store import RecordingReader
    from ..store.outputs import claim_output
    from ..store.replay import Replayer

    if args.record is not None:
        claim_output(
            args.record, inputs=[args.file], overwrite=args.force, what="recording", recording=True
        )
    reader = RecordingReader(args.file)
    totals = LiveTotals()
    windows = ReplayedWindows(reader.header.devices)

    async def consume(stream: anyio.abc.ObjectReceiveStream[Event]) -> None:
        async for event in stream:
            totals.add(event)
            windows.add(event)
        windows.finish()

    runtime = Runtime(
        devices=[],
        host=reader.header.host or "replay",
        publish=args.publish,
        publish_curve=server_curve_from_args(args, "--publish", args.publish),
        record=args.record,
        overwrite=args.force,
        consumers=[consume],
    )
    pace = "as fast as possible" if args.speed is None else f"at {args.speed:g}x"
    async with runtime as rt:
        where = f", publishing on {rt.publisher.endpoint}" if rt.publisher is not None else ""
        out.write(f"zeus-async replay: {args.file} {pace}{where}\n")
        out.flush()
        if rt.publisher is not None and args.wait_subscriber is not None:
            with anyio.move_on_after(args.wait_subscriber):
                while rt.publisher.stats.subscriptions == 0:
                    await anyio.sleep(0.01)
        replayer = Replayer(reader, speed=args.speed, progress=terminal_progress("replaying"))
        async with until_stopped():
            await replayer.into_runtime(rt)
    stop_progress_bars()  # stopped short by Ctrl-C: the bar ends where it was
    out.write(f"replayed {replayer.events_published} events\n")
    out.write("\nTotals\n")
    write_totals(out, totals)
    if windows.results:
        live = {m.window_id: m for m in windows.recorded}
        out.write(f"\n{len(windows.results)} window(s) measured again from the replay:\n")
        rows = _window_rows(windows.results[:20])
        for row, m in zip(rows, windows.results, strict=False):
            rec = live.get(m.window_id)
            row.append(
                "-" if rec is None else ("yes" if rec.gpu_energy_j == m.gpu_energy_j else "NO")
            )
        write_table(out, (*_WINDOWS, Column("= recorded", keep=5)), rows)
    return 0


def _restamped(info: StreamInfo, start_ns: int) -> StreamInfo:
    """A stream that was running before the recording began keeps its description in the
    file, stamped no earlier than the recording's start: the file spans what it holds
    (inspect's duration, replay's pacing), not the publisher's whole life."""
    return msgspec.structs.replace(info, t_ns=max(info.t_ns, start_ns))


async def _record(args: argparse.Namespace, out: TextIO) -> int:
    from ..bus import Subscriber
    from ..runtime.hub import EventBatches
    from ..store import Recorder, RecordingHeader
    from ..store.outputs import claim_output

    topics = args.topic or [""]
    count = 0
    folder = Path(args.output).absolute().parent
    if not folder.is_dir():
        # Said now, not after waiting for a publisher and its first events.
        raise ConfigError(f"cannot write {args.output}: no directory {folder}")
    claim_output(args.output, overwrite=args.force, what="recording", recording=True)
    start_ns = time.time_ns()
    curve = client_curve_from_args(args)
    async with Subscriber(args.endpoints, topics=topics, curve=curve) as sub:
        await wait_for_publisher(sub, args.endpoints, args.wait)
        infos = [_restamped(info, start_ns) for info in sub.ready_streams.values()]
        first = infos[0]
        header = RecordingHeader(
            host=first.host,
            start_wall_ns=start_ns,
            pid=first.pid,
            argv=list(first.argv),
            devices=[d for info in infos for d in info.devices],
            meta={
                "recorded_from": ",".join(args.endpoints),
                "recorder_argv": " ".join(sys.argv),
                # Every stream's host at the start; streams that join later are in the file as
                # their StreamInfo events (the header is written once).
                "hosts": ",".join(dict.fromkeys(info.host for info in infos)),
            },
            compression="zstd",
        )
        rotate = None if args.rotate_mb is None else round(args.rotate_mb * 1e6)
        recorder = Recorder(args.output, header=header, rotate_bytes=rotate, overwrite=args.force)
        batches = EventBatches(65536)
        out.write(f"zeus-async record: {', '.join(args.endpoints)} -> {args.output}\n")
        out.flush()
        async with anyio.create_task_group() as tg:
            tg.start_soon(recorder.run, batches)
            with counting_status("recording") as status:
                async with until_stopped(args.duration) as stop:
                    if args.until_end:
                        stop.start_soon(stop_when_streams_end, sub.stats, stop.cancel_scope)
                    for info in infos:  # the handshake consumed them; keep them in the file
                        await batches.send(info)
                        count += 1
                    described = {info.stream_id for info in infos}
                    async for event in sub:
                        if isinstance(event, StreamInfo):
                            # Re-sent on each new subscription: one per stream in the file.
                            if event.stream_id in described:
                                continue
                            described.add(event.stream_id)
                            event = _restamped(event, start_ns)
                        await batches.send(event)
                        count += 1
                        if count % 1024 == 0:
                            status(f"{count} events, {sub.stats.frames_lost} frame(s) lost")
                        if args.count is not None and count >= args.count:
                            break
                        if args.until_end and streams_ended(sub.stats):
                            break
            batches.close()
        stats = sub.stats
    out.write(
        f"recorded {recorder.events_written} events in {recorder.frames_written} frames "
        f"to {', '.join(map(str, recorder.paths))}; {stats.frames_lost} frame(s) lost on the bus\n"
    )
    report_streams(stats)
    return 0


async def _convert(args: argparse.Namespace, out: TextIO) -> int:
    from ..store.convert import convert_recording

    result = await anyio.to_thread.run_sync(
        lambda: convert_recording(
            args.file,
            args.output,
            format_version=args.format_version,
            overwrite=args.force,
            progress=terminal_progress("converting"),
        )
    )
    out.write(
        f"converted {result.events} events (format v{result.format_from}) to {args.output} "
        f"(format v{result.format_to}, {result.frames} frame(s))\n"
    )
    if not result.report.clean:
        out.write(f"input damaged: {result.report.summary()}; every complete frame converted\n")
    return 0


async def _plot(args: argparse.Namespace, out: TextIO) -> int:
    from ..store.plot import plot_power

    path = await anyio.to_thread.run_sync(
        lambda: plot_power(
            args.file,
            args.output,
            title=args.title,
            layout=args.layout,
            overwrite=args.force,
            progress=terminal_progress("reading"),
        )
    )
    out.write(f"wrote {path}\n")
    return 0


COMMANDS: dict[str, Command] = {
    "inspect": _inspect,
    "export": _export,
    "replay": _replay,
    "record": _record,
    "plot": _plot,
    "convert": _convert,
}
