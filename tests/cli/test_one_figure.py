"""One figure per question: ``monitor``, ``replay``, ``inspect`` and ``Recording`` give the same
totals for the same samples (real processes; see tests/aggregate/test_one_estimator.py)."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import run_cli

from zeus_async.aggregate import LiveTotals
from zeus_async.store import RecordingReader
from zeus_async.store.analysis import Recording


def _table(text: str, title: str) -> dict[str, tuple[str, str]]:
    """``device -> (energy, method)`` of the device table after the line ``title``."""
    lines = text.split(f"\n{title}\n", 1)[1].splitlines() if title else text.splitlines()
    start = next(i for i, line in enumerate(lines) if "energy J" in line)
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start + 2 :]:  # after the header and its rule
        cells = line.split()
        if not cells or not cells[0].startswith(("gpu:", "cpu:")):
            break
        rows[cells[0]] = (cells[1], cells[-1])
    return rows


def test_monitor_replay_inspect_and_recording_give_one_figure(tmp_path: Path) -> None:
    path = tmp_path / "run.zarc"
    monitor = run_cli(
        "monitor", "--backend", "sim", "--duration", "2.5", "--refresh", "5", "--record", str(path)
    )
    assert monitor.returncode == 0, monitor.stderr
    inspect = run_cli("inspect", str(path))
    assert inspect.returncode == 0, inspect.stderr
    replay = run_cli("replay", str(path))
    assert replay.returncode == 0, replay.stderr

    live = _table(monitor.stdout, "Totals")
    assert set(live) == {"gpu:0", "gpu:1", "gpu:2", "gpu:3"}
    assert _table(replay.stdout, "Totals") == live
    assert _table(inspect.stdout, "") == live

    # To the last bit: the running totals of the recording's events and Recording.totals().
    totals = LiveTotals()
    for event in RecordingReader(path):
        totals.add(event)
    rec = Recording(path).totals()
    assert set(rec.devices) == set(totals.devices)
    for key, device in rec.devices.items():
        running = totals.devices[key]
        assert (device.energy_j, device.method) == (running.energy_j, running.method), key
        assert (device.start_ns, device.end_ns) == (running.first_t_ns, running.last_t_ns)
        assert Recording(path).energy(key).energy_j == device.energy_j
