"""From a recording to what a figure draws, whatever its layout.

:func:`_read` takes the GPU power readings, windows and power-limit changes from one pass
over a recording; :func:`_prepare` selects the GPUs and turns them into lines and window
spans on the time axis (:class:`_Plot`), with the title and the recovery note.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import ConfigError
from ...events import GpuSample, Measurement, PowerLimitChange, WindowClose, WindowOpen
from ..progress import Progress, ProgressTicker
from ..reader import RecordingReader, RecoveryReport
from .reduce import _gap_limit, _with_gaps
from .windows import _MAX_FAMILIES, _OTHER_COLOUR, _WINDOW_COLOURS, _assign_lanes, _families, _Span

if TYPE_CHECKING:
    from .reduce import _Floats

logger = logging.getLogger(__name__)


@dataclass
class _Series:
    t_ns: list[int] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    avg_t_ns: list[int] = field(default_factory=list)
    avg_power_w: list[float] = field(default_factory=list)


@dataclass
class _Window:
    name: str
    start_ns: int
    end_ns: int | None = None
    cancelled: bool = False
    exact: bool = False  # start/end from a Measurement


@dataclass
class _Data:
    gpus: dict[int, _Series] = field(default_factory=dict)
    windows: dict[tuple[str, int], _Window] = field(default_factory=dict)
    limits: dict[int, list[PowerLimitChange]] = field(default_factory=dict)
    first_ns: int | None = None
    last_ns: int | None = None
    report: RecoveryReport = field(default_factory=RecoveryReport)


def _read(reader: RecordingReader, progress: Progress | None = None) -> _Data:
    data = _Data()
    ticker = ProgressTicker(reader, progress)
    first: int | None = None
    last: int | None = None
    for event in reader:
        t = event.t_ns
        if first is None or t < first:
            first = t
        if last is None or t > last:
            last = t
        if isinstance(event, GpuSample):
            series = data.gpus.setdefault(event.gpu, _Series())
            if event.power_w is not None:
                series.t_ns.append(t)
                series.power_w.append(event.power_w)
            if event.avg_power_w is not None:
                series.avg_t_ns.append(t)
                series.avg_power_w.append(event.avg_power_w)
        elif isinstance(event, WindowOpen):
            key = (event.host, event.window_id)
            win = data.windows.get(key)
            if win is None:
                data.windows[key] = _Window(event.name, t)
            elif not win.exact:
                win.start_ns = t
        elif isinstance(event, WindowClose):
            key = (event.host, event.window_id)
            win = data.windows.setdefault(key, _Window(event.name, t))
            win.cancelled = win.cancelled or event.cancelled
            if not win.exact:
                win.end_ns = t
        elif isinstance(event, Measurement):
            key = (event.host, event.window_id)
            win = data.windows.setdefault(key, _Window(event.name, event.start_ns))
            win.start_ns, win.end_ns, win.exact = event.start_ns, event.end_ns, True
            first = event.start_ns if first is None else min(first, event.start_ns)
        elif isinstance(event, PowerLimitChange):
            data.limits.setdefault(event.gpu, []).append(event)
        ticker.tick()
    ticker.finish()
    data.first_ns, data.last_ns = first, last
    data.report = reader.report
    return data


def _time_unit(duration_s: float) -> tuple[float, str]:
    """Seconds per unit of the time axis, and its name: s up to 20 min, min up to 10 h, h."""
    if duration_s <= 1200.0:
        return 1.0, "s"
    if duration_s <= 36000.0:
        return 60.0, "min"
    return 3600.0, "h"


def _default_title(reader: RecordingReader) -> str:
    header = reader.header
    simulated = header.meta.get("simulated") == "true"
    parts = ["GPU power (SIMULATED GPUs)" if simulated else "GPU power"]
    parts.append(header.host or reader.path.name)
    if header.start_wall_ns:
        start = dt.datetime.fromtimestamp(header.start_wall_ns / 1e9, tz=dt.timezone.utc)
        parts.append(start.strftime("%Y-%m-%d %H:%M:%S UTC"))
    return " — ".join(parts)


def _recovery_note(report: RecoveryReport) -> str | None:
    if report.clean:
        return None
    bits = []
    if report.corrupt_frames:
        n = len(report.corrupt_frames)
        bits.append(f"{n} corrupt frame{'s' if n != 1 else ''} skipped")
    if report.torn_tail_offset is not None:
        bits.append(f"torn tail of {report.torn_tail_bytes} B dropped")
    return "recovered from a damaged file: " + ", ".join(bits)


@dataclass
class _Line:
    """One GPU's power, ready to draw; times in units of the time axis."""

    gpu: int
    label: str
    x: _Floats  # sorted, with a NaN break in each gap
    y: _Floats
    readings_x: _Floats  # the readings alone, without NaN (the heatmap's)
    readings_y: _Floats
    hold: float  # the longest step between readings that is not a gap
    limit_x: list[float] = field(default_factory=list)  # power-limit steps
    limit_y: list[float] = field(default_factory=list)
    changes: list[tuple[float, float]] = field(default_factory=list)  # (time, new limit W)


@dataclass
class _Plot:
    """What a figure draws, whatever its layout; times in units of the time axis."""

    lines: list[_Line]
    spans: list[_Span]
    by_family: dict[str, list[_Span]]
    order: list[str]  # families, by first start
    colours: dict[str, str]
    lanes: int
    duration: float
    unit: str
    top_w: float  # the highest power or limit drawn
    samples: int
    title: str
    note: str | None
    path: Path


def _prepare(
    reader: RecordingReader, data: _Data, gpus: Collection[int] | None, title: str | None
) -> _Plot:
    """Select the GPUs, turn readings into arrays on the time axis, windows into spans."""
    import numpy as np

    available = sorted(data.gpus)
    if gpus is not None:
        missing = sorted(set(gpus) - set(available))
        if missing:
            raise ConfigError(
                f"GPU(s) {missing} not in recording {reader.path}; it has GPUs {available}"
            )
        selected = sorted(set(gpus))
    else:
        selected = available
    plotted = [g for g in selected if data.gpus[g].t_ns or data.gpus[g].avg_t_ns]
    if not plotted or data.first_ns is None or data.last_ns is None:
        raise ConfigError(
            f"recording {reader.path} has no GPU power samples"
            + (f" for GPU(s) {selected}" if gpus is not None and available else "")
            + "; nothing to plot"
        )
    t0, t_end = data.first_ns, data.last_ns
    unit_s, unit = _time_unit((t_end - t0) / 1e9)

    def at(t_ns: int) -> float:
        return (t_ns - t0) / 1e9 / unit_s

    lines: list[_Line] = []
    samples = 0
    top = 0.0
    for g in plotted:
        series = data.gpus[g]
        if series.t_ns:
            t_ns, watts, label = series.t_ns, series.power_w, f"GPU {g}"
        else:
            t_ns, watts, label = series.avg_t_ns, series.avg_power_w, f"GPU {g} (avg)"
            logger.info("GPU %d has no instant power in %s; plotting avg_power_w", g, reader.path)
        samples += len(t_ns)
        t = np.asarray(t_ns, dtype=np.int64)
        w = np.asarray(watts, dtype=np.float64)
        if len(t) > 1 and bool(np.any(t[1:] < t[:-1])):  # frames written out of order
            by_time = np.argsort(t, kind="stable")
            t, w = t[by_time], w[by_time]
        secs = (t - t0) / 1e9
        valid = ~np.isnan(w)
        if valid.any():
            top = max(top, float(np.max(w[valid])))
        limit_s = _gap_limit(secs[valid])
        xs, ys = _with_gaps(secs, w, limit_s)
        line = _Line(g, label, xs / unit_s, ys, secs[valid] / unit_s, w[valid], limit_s / unit_s)
        changes = sorted(data.limits.get(g, []), key=lambda c: c.t_ns)
        if changes:
            if changes[0].previous_w is not None:
                line.limit_x.append(0.0)
                line.limit_y.append(changes[0].previous_w)
            for c in changes:
                line.limit_x.append(at(c.t_ns))
                line.limit_y.append(c.power_limit_w)
                line.changes.append((at(c.t_ns), c.power_limit_w))
            line.limit_x.append(at(t_end))
            line.limit_y.append(line.limit_y[-1])
            top = max(top, *line.limit_y)
        lines.append(line)

    # Windows -> spans on the time axis, grouped into families.
    spans: list[_Span] = []
    kept = [w for w in data.windows.values() if not w.cancelled]
    families = _families(sorted({w.name for w in kept}))
    for win in kept:
        end = win.end_ns if win.end_ns is not None else t_end
        spans.append(
            _Span(
                win.name,
                families[win.name],
                at(win.start_ns),
                at(max(end, win.start_ns)),
                win.end_ns is None,
            )
        )
    by_family: dict[str, list[_Span]] = {}
    for span in spans:
        by_family.setdefault(span.family, []).append(span)
    lanes = _assign_lanes(by_family)
    order = sorted(by_family, key=lambda f: min(s.start_s for s in by_family[f]))
    colours: dict[str, str] = {}
    for i, fam in enumerate(order):
        colours[fam] = _WINDOW_COLOURS[i] if i < _MAX_FAMILIES else _OTHER_COLOUR
    return _Plot(
        lines=lines,
        spans=spans,
        by_family=by_family,
        order=order,
        colours=colours,
        lanes=lanes,
        duration=at(t_end),
        unit=unit,
        top_w=top if math.isfinite(top) and top > 0 else 1.0,
        samples=samples,
        title=title if title is not None else _default_title(reader),
        note=_recovery_note(data.report),
        path=reader.path,
    )
