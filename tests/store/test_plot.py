from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from zeus_async.errors import ConfigError
from zeus_async.events import (
    Event,
    GpuSample,
    Measurement,
    PowerLimitChange,
    StreamInfo,
    WindowClose,
    WindowOpen,
)
from zeus_async.store import RecordingHeader, write_recording

pytest.importorskip("matplotlib")

from matplotlib.image import imread

from zeus_async.store.plot import (
    _assign_lanes,
    _decimate,
    _families,
    _innermost,
    _Span,
    plot_power,
)

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADER = RecordingHeader(host="node7", start_wall_ns=T0, pid=1, argv=["test"])


def _ns(seconds: float) -> int:
    return T0 + round(seconds * 1e9)


def make_events(*, avg_only_gpu: int | None = None) -> list[Event]:
    """2 GPUs sampled every 20 ms for 4 s, windows (nested, overlapping, repeated), a cap."""
    events: list[Event] = [StreamInfo(host="node7", t_ns=T0, stream_id="s")]
    for k in range(200):
        t = k * 0.02
        for gpu in (0, 1):
            watts = 100.0 + 250.0 * (1 + math.sin(t * 3 + gpu)) * (0.6 if t > 2.0 else 1.0)
            if gpu == avg_only_gpu:
                events.append(GpuSample("node7", _ns(t), gpu, power_w=None, avg_power_w=watts))
            else:
                events.append(GpuSample("node7", _ns(t), gpu, power_w=watts, energy_j=k * 7.0))
    wid = 0

    def window(name: str, a: float, b: float | None, *, measured: bool = False) -> None:
        nonlocal wid
        wid += 1
        events.append(WindowOpen("node7", _ns(a), name, wid))
        if b is None:
            return
        events.append(WindowClose("node7", _ns(b), name, wid))
        if measured:
            events.append(
                Measurement("node7", _ns(b) + MS, name, wid, _ns(a), _ns(b), b - a, {0: 1.0})
            )

    window("training", 0.2, 3.8, measured=True)
    for i in range(12):  # a window per step: one legend entry for all of them
        window(f"step-{i}", 0.3 + i * 0.12, 0.3 + i * 0.12 + 0.1)
    window("eval", 1.6, 2.4, measured=True)  # overlaps steps and training
    window("eval", 3.0, 3.3)  # a repeated name
    wid += 1  # a cancelled window: not drawn
    events.append(WindowOpen("node7", _ns(2.5), "discarded", wid))
    events.append(WindowClose("node7", _ns(2.7), "discarded", wid, cancelled=True))
    window("checkpoint", 3.5, None)  # still open at the end of the recording
    events.append(PowerLimitChange("node7", _ns(2.0), 0, 400.0, previous_w=700.0, source="t"))
    events.append(PowerLimitChange("node7", _ns(3.0), 1, 450.0, source="t"))
    return sorted(events, key=lambda e: e.t_ns)


def _check_png(path: Path, dpi: int = 120) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = imread(path)
    height, width = image.shape[:2]
    assert width >= 10 * dpi  # 11 in wide
    assert height >= 5 * dpi
    assert image[..., :3].std() > 0.05  # not a blank canvas


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    path = tmp_path / "run.zarc"
    write_recording(path, make_events(), header=HEADER, events_per_frame=64)
    return path


def test_plot_writes_a_png(recording: Path, tmp_path: Path) -> None:
    out = plot_power(recording, tmp_path / "power.png")
    assert out == tmp_path / "power.png"
    _check_png(out)


def test_plot_options_avg_fallback_and_recovery(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "avg.zarc"
    events = make_events(avg_only_gpu=1)[::-1]  # out of order: samples and window edges
    write_recording(path, events, header=HEADER, events_per_frame=64)
    torn = tmp_path / "torn.zarc"
    torn.write_bytes(path.read_bytes()[:-40])  # a writer killed mid-frame
    with caplog.at_level("INFO", logger="zeus_async.store.plot"):
        out = plot_power(str(torn), str(tmp_path / "one.png"), title="custom", gpus=[1], dpi=60)
    _check_png(out, dpi=60)
    assert "torn tail" in caplog.text
    assert "GPU 1 has no instant power" in caplog.text


def test_no_gpu_samples_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.zarc"
    events = [e for e in make_events() if not isinstance(e, GpuSample)]
    write_recording(path, events, header=HEADER)
    with pytest.raises(ConfigError, match="no GPU power samples"):
        plot_power(path, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_samples_without_power_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "nopower.zarc"
    write_recording(path, [GpuSample("node7", _ns(0), 0, energy_j=1.0)], header=HEADER)
    with pytest.raises(ConfigError, match="no GPU power samples"):
        plot_power(path, tmp_path / "x.png")


def test_unknown_gpu_is_an_error(recording: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"GPU\(s\) \[5\] not in recording"):
        plot_power(recording, tmp_path / "x.png", gpus=[5])


def test_missing_matplotlib(
    recording: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install 'zeus_async\[plot\]'"):
        plot_power(recording, tmp_path / "x.png")


def test_families_group_numbered_names() -> None:
    names = ["step-1", "step-2", "step-3", "epoch", "gpt2", "layer_1", "layer_2"]
    fam = _families(names)
    assert fam["step-1"] == fam["step-3"] == "step-*"
    assert fam["epoch"] == "epoch"
    assert fam["gpt2"] == "gpt2"  # a lone numbered name stays itself
    assert fam["layer_1"] == "layer_1"  # two are not a family yet


def test_innermost_window_wins_the_shading() -> None:
    spans = [
        _Span("training", "training", 0.0, 10.0, False),
        _Span("step-0", "step-*", 1.0, 2.0, False),
        _Span("step-1", "step-*", 2.0, 3.0, False),
        _Span("eval", "eval", 2.5, 6.0, False),
    ]
    assert _innermost(spans) == [
        (0.0, 1.0, "training"),
        (1.0, 3.0, "step-*"),  # adjacent steps merge
        (3.0, 6.0, "eval"),
        (6.0, 10.0, "training"),
    ]


def test_lanes_keep_each_family_in_one_row() -> None:
    spans = [_Span(f"phase {i}", f"phase {i}", i * 4.0, i * 4.0 + 6.0, False) for i in range(4)]
    steps = [_Span(f"step-{i}", "step-*", i * 0.5, i * 0.5 + 0.4, False) for i in range(30)]
    by_family: dict[str, list[_Span]] = {}
    for span in spans + steps:
        by_family.setdefault(span.family, []).append(span)
    assert _assign_lanes(by_family) == 3
    assert [s.lane for s in spans] == [0, 1, 0, 1]  # overlapping phases alternate
    assert {s.lane for s in steps} == {2}  # every step below them, none in their gaps


def test_decimate_keeps_the_envelope_and_gaps() -> None:
    xs = [i / 100 for i in range(10_000)]
    ys = [float(i % 7) for i in range(10_000)]
    ys[5000] = math.nan
    dx, dy = _decimate(xs, ys, buckets=100)
    assert len(dx) <= 2 * 100 + 10
    finite = [y for y in dy if not math.isnan(y)]
    assert min(finite) == 0.0 and max(finite) == 6.0
    assert sum(math.isnan(y) for y in dy) == 1
    assert list(dx) == sorted(dx)
