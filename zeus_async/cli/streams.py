"""The live-stream commands of the CLI: ``subscribe`` (print a publisher's events) and
``proxy`` (forward many publishers onto one endpoint)."""

from __future__ import annotations

import argparse
import functools
import logging
from typing import Any, TextIO

import anyio
import msgspec

from ..events import Event, event_to_dict
from .common import (
    EXIT_OK,
    Command,
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

__all__ = ["COMMANDS", "add_parsers", "format_event", "json_line"]

logger = logging.getLogger(__name__)


def add_parsers(sub: Any) -> None:
    """Add ``subscribe`` and ``proxy`` to the CLI's subparsers."""
    sbs = sub.add_parser(
        "subscribe",
        help="print events from a publisher",
        description="Print the events of one or more publishers (monitors, agents, proxies), "
        "one line each; --json for one JSON object per line with the frame that carried it. "
        "Lost frames and streams whose end was not seen are reported on stderr.",
    )
    sbs.add_argument("endpoints", nargs="+", metavar="ENDPOINT")
    sbs.add_argument("--topic", action="append", default=None, help="topic prefix (repeatable)")
    sbs.add_argument("--json", action="store_true", help="one JSON object per line")
    sbs.add_argument("--count", type=positive_int, default=None, help="stop after N events")
    sbs.add_argument("--duration", type=positive_float, default=None, help="stop after S s")
    sbs.add_argument(
        "--until-end",
        action="store_true",
        help="stop once every stream seen has ended (or gone silent for 3 s: tail unknown)",
    )
    sbs.add_argument(
        "--wait", type=positive_float, default=10.0, help="give up if no publisher answers (s)"
    )
    add_client_curve_args(sbs)

    prx = sub.add_parser(
        "proxy",
        help="aggregate many publishers onto one endpoint",
        description="Forward the streams of many publishers (one per node) to subscribers on "
        "one endpoint, frames unchanged (XSUB/XPUB).",
    )
    prx.add_argument("--in", dest="inputs", nargs="+", required=True, metavar="ENDPOINT")
    prx.add_argument("--out", dest="output", required=True, metavar="ENDPOINT")
    prx.add_argument("--duration", type=positive_float, default=None, help="stop after S s")
    add_server_curve_args(prx, what="--out")
    add_client_curve_args(prx, prefix="--in-", what="the --in publishers")


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
    from ..bus import Subscriber

    topics = args.topic or [""]
    count = 0
    curve = client_curve_from_args(args)
    async with Subscriber(args.endpoints, topics=topics, curve=curve) as sub:
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
    from ..bus import run_proxy

    curve = server_curve_from_args(args, "--out", args.output)
    upstream = client_curve_from_args(args, prefix="in_")
    async with until_stopped(args.duration) as tg:
        await tg.start(
            functools.partial(run_proxy, curve=curve, upstream_curve=upstream),
            args.inputs,
            args.output,
        )
        secured = " (CURVE)" if curve is not None else ""
        out.write(f"zeus-async proxy: {' '.join(args.inputs)} -> {args.output}{secured}\n")
        out.flush()
        await anyio.sleep_forever()
    return EXIT_OK


COMMANDS: dict[str, Command] = {"subscribe": _subscribe, "proxy": _proxy}
