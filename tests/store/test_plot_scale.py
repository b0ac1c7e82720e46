"""Plots that read at scale: per-pixel decimation, small multiples, the heatmap, the Figure."""

from __future__ import annotations

import io
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zeus_async.errors import ConfigError
from zeus_async.events import (
    Event,
    GpuSample,
    PowerLimitChange,
    StreamInfo,
    WindowClose,
    WindowOpen,
)
from zeus_async.store import RecordingHeader, write_recording

pytest.importorskip("matplotlib")

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

import zeus_async.store
from zeus_async.cli import main
from zeus_async.store.plot import (
    LAYOUTS,
    MULTIPLES_MAX,
    OVERLAY_MAX,
    _column_stat,
    _decimate,
    _resolve_layout,
    plot_power,
    power_figure,
)

T0 = 1_700_000_000_000_000_000
HEADER = RecordingHeader(host="big", start_wall_ns=T0, pid=1, argv=["test"])
GPUS = 8
HZ = 10
N = 3600 * HZ  # one hour at 10 Hz
SPIKE_GPU, SPIKE_K, SPIKE_W = 5, N // 2, 990.0  # one sample, mid-hour
DIP_GPU, DIP_K, DIP_W = 1, N // 3, 5.0  # one sample
GAP_GPU, GAP_K, GAP_LEN = 3, N // 4, 2 * 60 * HZ  # no readings for 2 min from 15 min on
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _power() -> np.ndarray:
    """GPU x sample power: slow waves (180-420 W) and noise, a spike, a dip."""
    rng = np.random.default_rng(23)
    k = np.arange(N)
    waves = [300 + 120 * np.sin(k / (HZ * 300.0) + g) for g in range(GPUS)]
    watts = np.vstack(waves) + rng.normal(0.0, 10.0, (GPUS, N))
    watts[SPIKE_GPU, SPIKE_K] = SPIKE_W
    watts[DIP_GPU, DIP_K] = DIP_W
    return watts


def big_events() -> list[Event]:
    """8 GPUs x 1 hour at 10 Hz (~288k samples), windows, two power-limit changes."""
    watts = _power().tolist()
    step = 1_000_000_000 // HZ
    events: list[Event] = [StreamInfo(host="big", t_ns=T0, stream_id="s")]
    gap = range(GAP_K, GAP_K + GAP_LEN)
    for k in range(N):
        t = T0 + k * step
        for g in range(GPUS):
            if g == GAP_GPU and k in gap:
                continue
            events.append(GpuSample("big", t, g, power_w=watts[g][k]))
    for e in range(6):  # epochs of 500 s every 600 s
        a = T0 + e * 600 * 10**9
        events += [
            WindowOpen("big", a, f"epoch-{e}", e),
            WindowClose("big", a + 500 * 10**9, f"epoch-{e}", e),
        ]
    events += [
        WindowOpen("big", T0 + 1000 * 10**9, "eval", 99),
        WindowClose("big", T0 + 1300 * 10**9, "eval", 99),
    ]
    events.append(
        PowerLimitChange("big", T0 + 1800 * 10**9, 2, 400.0, previous_w=700.0, source="t")
    )
    events.append(
        PowerLimitChange("big", T0 + 2400 * 10**9, 6, 500.0, previous_w=700.0, source="t")
    )
    return sorted(events, key=lambda e: e.t_ns)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("big") / "hour.zarc"
    write_recording(path, big_events(), header=HEADER)
    return path


def _power_line(ax: Axes) -> Line2D:
    """The power line of an axes: drawn first, solid (the limit lines come after, dashed)."""
    line = ax.lines[0]
    assert line.get_linestyle() == "-"
    return line


def _xy(line: Line2D) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float)


def _columns(ax: Axes) -> int:
    return math.ceil(ax.bbox.width)


def _check_gpu_line(ax: Axes, line: Line2D, gpu: int) -> None:
    """At most ~2 points per pixel column; the spike, the dip and the gap are still there."""
    xs, ys = _xy(line)
    finite = ys[~np.isnan(ys)]
    assert 100 < len(xs) <= 2 * _columns(ax) + 4  # 36,000 samples in, ~2 per column out
    assert list(xs) == sorted(xs)
    assert np.isnan(ys).sum() == (1 if gpu == GAP_GPU else 0)
    if gpu == SPIKE_GPU:
        assert finite.max() == SPIKE_W
    if gpu == DIP_GPU:
        assert finite.min() == DIP_W
    if gpu == GAP_GPU:  # the break sits in the gap, in minutes
        (at,) = xs[np.isnan(ys)]
        assert GAP_K / HZ / 60 < at < (GAP_K + GAP_LEN) / HZ / 60
    if gpu not in (SPIKE_GPU, DIP_GPU):
        assert finite.min() > 100 and finite.max() < 500


def test_auto_draws_small_multiples(big: Path) -> None:
    fig = power_figure(big)
    assert isinstance(fig, Figure)
    assert isinstance(fig.canvas, FigureCanvasAgg)
    assert len(fig.axes) == GPUS + 1  # one small axes per GPU, the window strip
    *power_axes, strip = fig.axes
    assert [ax.get_ylabel() for ax in power_axes] == [f"GPU {g}" for g in range(GPUS)]
    assert strip.get_ylabel() == "windows"
    assert strip.get_xlabel() == "time since first event (min)"
    for ax in power_axes:
        assert ax.get_shared_x_axes().joined(ax, strip)
        assert ax.get_shared_y_axes().joined(ax, power_axes[0])
    for g, ax in enumerate(power_axes):
        _check_gpu_line(ax, _power_line(ax), g)
    # The limit steps are drawn on the GPU's own axes (a step line, then the change markers).
    limits = {g: ax.lines[1:] for g, ax in enumerate(power_axes)}
    assert {g for g, lines in limits.items() if lines} == {2, 6}
    step_x, step_y = _xy(limits[2][0])
    assert limits[2][0].get_linestyle() == "--"
    assert list(step_y) == [700.0, 400.0, 400.0] and step_x[1] == pytest.approx(30.0)
    assert power_axes[0].get_ylim()[1] > SPIKE_W  # shared: the spike fits
    assert "8 GPUs · 60.0 min" in power_axes[0].get_title(loc="left")


def test_overlay_of_eight(big: Path) -> None:
    fig = power_figure(big, layout="overlay", title="eight")
    assert len(fig.axes) == 2
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    for g in range(GPUS):
        _check_gpu_line(ax, lines[f"GPU {g}"], g)
    assert lines["GPU 2 power limit"].get_linestyle() == "--"
    assert fig.get_suptitle() == "eight"


def test_heatmap_is_a_pixel_per_column(big: Path) -> None:
    fig = power_figure(big, layout="heatmap")
    ax = fig.axes[0]
    (image,) = ax.images
    grid = np.ma.filled(image.get_array(), np.nan)
    assert grid.shape[0] == GPUS
    assert abs(grid.shape[1] - ax.bbox.width) <= 1
    columns = grid.shape[1]
    assert grid[SPIKE_GPU].max() == SPIKE_W  # max per column: the one sample shows
    # The gap: columns with no reading (about 2/60 of them), nowhere else.
    empty = np.flatnonzero(np.isnan(grid[GAP_GPU]))
    expected = GAP_LEN / N * columns
    assert expected - 2 <= len(empty) <= expected + 2
    assert empty[0] == pytest.approx(columns / 4, abs=2)
    assert not np.isnan(np.delete(grid, GAP_GPU, axis=0)).any()
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"GPU {g}" for g in range(GPUS)]
    assert any(line.get_label() == "power-limit change" for line in ax.lines)
    assert fig.axes[-1].get_ylabel() == "windows"

    mean = np.ma.filled(
        power_figure(big, layout="heatmap", heatmap_stat="mean").axes[0].images[0].get_array(),
        np.nan,
    )
    assert mean.shape == grid.shape
    assert np.nanmax(mean[SPIKE_GPU]) < SPIKE_W  # averaged with its ~30 neighbours


def test_width_sets_the_buckets(big: Path) -> None:
    fig = power_figure(big, gpus=[SPIKE_GPU, GAP_GPU], layout="multiples", width_px=600, dpi=100)
    assert fig.get_size_inches()[0] == pytest.approx(6.0)
    assert len(fig.axes) == 3
    for ax, g in zip(fig.axes, sorted([SPIKE_GPU, GAP_GPU]), strict=False):
        assert _columns(ax) < 600
        _check_gpu_line(ax, _power_line(ax), g)


def test_plot_power_writes_the_figure(big: Path, tmp_path: Path) -> None:
    out = plot_power(big, tmp_path / "hour", layout="heatmap", dpi=50)
    assert out == tmp_path / "hour.png"
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_power_figure_is_exported() -> None:
    assert zeus_async.store.power_figure is power_figure
    assert "power_figure" in zeus_async.store.__all__


def test_auto_layout_thresholds() -> None:
    assert _resolve_layout("auto", 1) == "overlay"
    assert _resolve_layout("auto", OVERLAY_MAX) == "overlay"
    assert _resolve_layout("auto", OVERLAY_MAX + 1) == "multiples"
    assert _resolve_layout("auto", MULTIPLES_MAX) == "multiples"
    assert _resolve_layout("auto", MULTIPLES_MAX + 1) == "heatmap"
    for layout in LAYOUTS[1:]:
        assert _resolve_layout(layout, 100) == layout


def _small(tmp_path: Path) -> Path:
    path = tmp_path / "small.zarc"
    events = [
        GpuSample("big", T0 + k * 10**8, g, power_w=100.0 + g) for k in range(50) for g in (0, 1)
    ]
    write_recording(path, events, header=HEADER)
    return path


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"layout": "grid"},
            r"unknown layout 'grid' \(use one of auto, overlay, multiples, heatmap\)",
        ),
        ({"heatmap_stat": "median"}, r"unknown heatmap_stat 'median'"),
        ({"width_px": 10}, r"width_px must be at least 200"),
        ({"dpi": 0}, r"dpi must be at least 1"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    rec = _small(tmp_path)
    with pytest.raises(ConfigError, match=message):
        power_figure(rec, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        plot_power(rec, tmp_path / "x.png", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "x.png").exists()


def test_cli_layout(tmp_path: Path) -> None:
    rec = _small(tmp_path)
    out = io.StringIO()
    assert (
        main(["plot", str(rec), "-o", str(tmp_path / "h.png"), "--layout", "heatmap"], out=out) == 0
    )
    assert (tmp_path / "h.png").read_bytes()[:8] == PNG_MAGIC
    assert "wrote" in out.getvalue()


def test_cli_bad_layout_is_refused(tmp_path: Path) -> None:
    rec = _small(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zeus_async",
            "plot",
            str(rec),
            "-o",
            str(tmp_path / "x.png"),
            "--layout",
            "grid",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "argument --layout: invalid choice: 'grid'" in proc.stderr
    assert "auto" in proc.stderr and "heatmap" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x.png").exists()


# -- the pieces ----------------------------------------------------------------------------------


def test_decimate_is_per_pixel_column() -> None:
    n = 1_000_000
    xs = np.arange(n) / 1000.0  # 1000 s at 1 kHz
    ys = 100.0 + 10.0 * np.sin(xs)
    ys[123_457] = 900.0  # one-sample spike
    ys[654_321] = -50.0  # one-sample dip
    ys[500_000:500_100] = np.nan  # a gap of readings
    dx, dy = _decimate(xs, ys, 400, 0.0, 1000.0)
    assert len(dx) <= 2 * 400 + 3 + 100
    assert np.all(np.diff(dx) >= 0)
    assert np.nanmax(dy) == 900.0 and np.nanmin(dy) == -50.0
    assert dx[dy == 900.0][0] == xs[123_457]  # at its own time
    assert np.isnan(dy).sum() == 100  # every break kept ...
    cols = np.floor(dx[~np.isnan(dy)] / 2.5).astype(int)
    assert np.bincount(cols).max() <= 4  # ... and ~2 points per column (4 beside the gap)


def test_decimate_small_series_and_ties() -> None:
    xs, ys = [0.0, 1.0, 2.0], [1.0, 2.0, 3.0]
    dx, dy = _decimate(xs, ys, 10)
    assert list(dx) == xs and list(dy) == ys
    flat_x = np.arange(100.0)
    dx, dy = _decimate(flat_x, np.full(100, 7.0), 5)
    assert list(dx) == [0.0, 20.0, 40.0, 60.0, 80.0]  # a flat column: one point (its first)
    assert list(dy) == [7.0] * 5


def test_column_stat_holds_readings_but_not_across_gaps() -> None:
    xs = np.array([0.0, 1.0, 2.0, 30.0, 31.0])  # a gap from 2 to 30
    ys = np.array([10.0, 20.0, 30.0, 40.0, 50.0])
    out = _column_stat(xs, ys, 32, 0.0, 32.0, "max", hold=1.5)
    assert list(out[:3]) == [10.0, 20.0, 30.0]
    assert np.isnan(out[3:30]).all()  # in the gap: no reading
    assert list(out[30:32]) == [40.0, 50.0]
    dense = _column_stat(np.arange(0.0, 4.0, 0.5), np.arange(8.0), 2, 0.0, 4.0, "mean", 1.0)
    assert list(dense) == [1.5, 5.5]
    sparse = _column_stat(np.array([0.0, 4.0]), np.array([1.0, 2.0]), 8, 0.0, 4.0, "max", 5.0)
    assert list(sparse) == [1.0] * 7 + [2.0]  # held until the next reading


def test_no_pyplot_and_no_backend_switch(tmp_path: Path) -> None:
    rec = _small(tmp_path)
    code = (
        "import sys, matplotlib\n"
        "raw = lambda: dict.__getitem__(matplotlib.rcParams, 'backend')\n"
        "before = raw()\n"
        "from zeus_async.store import power_figure\n"
        f"fig = power_figure({str(rec)!r}, layout='multiples')\n"
        "fig.savefig(sys.argv[1])\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
        "assert raw() == before, (before, raw())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.png")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "m.png").read_bytes()[:8] == PNG_MAGIC
