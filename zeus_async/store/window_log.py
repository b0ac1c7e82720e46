"""The window log: every finished window appended to a CSV or JSON-lines file, one line each.

``Monitor(log_file=...)`` and the node agent (``--log-file``) both write it, so it lives here,
below both (the agent must not import the monitor that attaches to it).
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import aiofiles
import anyio
import msgspec
from anyio.abc import ObjectReceiveStream

from .._threads import DaemonExecutor
from ..events import DeviceInfo, Event, Measurement, StreamInfo, event_to_dict
from ..runtime.runtime import output_stall_s

__all__ = ["window_log_consumer"]

logger = logging.getLogger(__name__)


def _simulated(d: DeviceInfo) -> bool:
    return d.name.endswith("(simulated)")


def _gpu_identities(m: Measurement, devices: Mapping[str, DeviceInfo]) -> dict[str, str]:
    """Each measured GPU as the tools beside us name it: UUID and the driver's index
    (``nvidia-smi``'s, which ``CUDA_VISIBLE_DEVICES`` may have renumbered), and
    ``simulated`` for a simulated one, so no line passes simulated figures as a real GPU's."""
    out = {}
    for gpu in sorted(m.gpu_energy_j):
        d = devices.get(f"gpu:{gpu}")
        if d is not None and d.uuid:
            notes = [] if d.index is None else [f"index {d.index}"]
            if _simulated(d):
                notes.append("simulated")
            out[f"gpu:{gpu}"] = d.uuid + (f" ({', '.join(notes)})" if notes else "")
    return out


def _csv_line(
    m: Measurement,
    *,
    header: bool,
    rank: str = "",
    devices: Mapping[str, DeviceInfo] = {},
    workload: str = "",
) -> str:
    row = {
        "name": m.name,
        "host": m.host,
        "rank": rank,
        "start_ns": m.start_ns,
        "end_ns": m.end_ns,
        "time_s": m.time_s,
        **{f"gpu{i}_energy_j": e for i, e in sorted(m.gpu_energy_j.items())},
        **{f"cpu{i}_energy_j": e for i, e in sorted((m.cpu_energy_j or {}).items())},
        **{f"dram{i}_energy_j": e for i, e in sorted((m.dram_energy_j or {}).items())},
        "methods": ";".join(f"{k}={v}" for k, v in sorted(m.methods.items())),
        "gpus": ";".join(f"{k}={v}" for k, v in _gpu_identities(m, devices).items()),
        "workload": workload,
    }
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(row))
    if header:
        writer.writeheader()
    writer.writerow(row)
    return buf.getvalue()


def window_log_consumer(
    path: str | Path,
    *,
    rank: int | None = None,
    devices: Sequence[DeviceInfo] = (),
    workload: str = "",
) -> Callable[[ObjectReceiveStream[Event]], Awaitable[None]]:
    """A runtime consumer appending every finished window to ``path`` (CSV or JSON lines).

    Each line names the window's host and, in a job of several ranks, the ``rank`` that
    measured it (CSV columns ``host`` and ``rank``; a ``rank`` key in JSON lines), and each
    GPU's UUID and driver index (``nvidia-smi``'s: CSV column ``gpus``,
    ``gpu:0=GPU-… (index 3);…``; a ``gpus`` object in JSON lines), so that a line matches
    ``nvidia-smi`` and dcgm-exporter whatever ``CUDA_VISIBLE_DEVICES`` renumbered. A
    simulated GPU says so there (``(index 0, simulated)``), and a JSON line measured on one
    has ``"simulated": true``. ``workload`` names the job, pod container or user whose
    windows these are (``slurm:4711``; CSV column ``workload``, a ``workload`` key in JSON
    lines), so a log lines up with the cluster's per-job figures. The
    devices come from ``devices`` and from the stream's :class:`StreamInfo`.
    """
    path = Path(path)
    rank_text = "" if rank is None else str(rank)
    known = {d.key: d for d in devices}

    async def consume(stream: ObjectReceiveStream[Event]) -> None:
        header_needed = path.suffix == ".csv" and (not path.exists() or path.stat().st_size == 0)
        stall_s = output_stall_s()
        # Its own daemon thread: a write hung in the kernel holds up neither the event loop's
        # shutdown nor the interpreter's exit; it is given up after stall_s.
        executor = DaemonExecutor(f"zeus-async-write {path.name}")
        f = await aiofiles.open(path, "a", newline="", executor=executor)
        hung = False
        try:
            async for event in stream:
                if isinstance(event, StreamInfo):
                    known.update((d.key, d) for d in event.devices)
                if not isinstance(event, Measurement):
                    continue
                try:
                    if path.suffix == ".csv":
                        text = _csv_line(
                            event,
                            header=header_needed,
                            rank=rank_text,
                            devices=known,
                            workload=workload,
                        )
                        header_needed = False
                    else:
                        data = event_to_dict(event)
                        if rank is not None:
                            data["rank"] = rank
                        if workload:
                            data["workload"] = workload
                        data["gpus"] = _gpu_identities(event, known)
                        if any(
                            (d := known.get(f"gpu:{g}")) is not None and _simulated(d)
                            for g in event.gpu_energy_j
                        ):
                            data["simulated"] = True
                        text = msgspec.json.encode(data).decode() + "\n"
                    with anyio.fail_after(stall_s):
                        await f.write(text)
                        await f.flush()
                except OSError:
                    logger.exception("could not log window %r to %s", event.name, path)
                except TimeoutError:
                    hung = True
                    raise TimeoutError(
                        f"writing {path} made no progress for {stall_s:g} s (a hung file "
                        "system, or a pipe nobody reads?); the window log was given up"
                    ) from None
        finally:
            if not hung:  # closing would wait for a hung write too
                with anyio.CancelScope(shield=True):
                    await f.close()
            executor.shutdown(wait=False)

    return consume
