"""The live view fits the terminal: columns are dropped (never wrapped) when it is narrow, rows
are folded into "… N more" when it is short, and a redraw never scrolls or repeats the table.

The view itself is checked as text at given sizes; then ``monitor`` runs in real terminals
(tmux) of 80x24 and 140x40, one resized while it runs, and is read back with capture-pane.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeus_async.aggregate import LiveTotals
from zeus_async.cli.monitor import DEVICE_COLUMNS, live_view, write_totals
from zeus_async.cli.processes import ProcessTable
from zeus_async.cli.render import Column, fit_table, fitted_columns, plain_text, write_table
from zeus_async.events import GpuSample, ProcessSample

ROOT = Path(__file__).resolve().parents[2]


def _totals(gpus: int) -> LiveTotals:
    totals = LiveTotals()
    for t in (0, 10**9):
        for g in range(gpus):
            totals.add(
                GpuSample(
                    "h",
                    t,
                    g,
                    power_w=301.25 + g,
                    energy_j=1e6 + t / 1e9 * 300,
                    temperature_c=61,
                    sm_clock_hz=1.98e9,
                    utilization_frac=0.97,
                    memory_used_bytes=70 * 2**30,
                    power_limit_w=700,
                    avg_power_w=300.0,
                )
            )
    return totals


def _processes(n: int) -> ProcessTable:
    table = ProcessTable()
    for pid in range(100, 100 + n):
        table.add(ProcessSample("h", 0, pid, cpu_frac=0.5, memory_rss_bytes=2**30))
    return table


def _lines(gpus: int, procs: int, width: int, height: int) -> list[str]:
    view = live_view(_totals(gpus), _processes(procs), 12.3, width, height, title="title")
    return plain_text(view, width).splitlines()[1:]


@pytest.mark.parametrize(("width", "height"), [(80, 24), (140, 40), (60, 12), (40, 8)])
def test_the_view_fits_any_terminal(width: int, height: int) -> None:
    lines = _lines(8, 3, width, height)
    assert all(len(line) <= width for line in lines), lines
    assert len(lines) <= height - 1  # and the title
    assert lines[0].split()[:1] == ["device"]
    assert lines[-1].startswith("12.3 s, all GPUs")


def test_columns_are_dropped_by_importance_not_wrapped() -> None:
    wide = _lines(4, 0, 140, 40)[0].split("  ")
    headers = [h.strip() for h in wide if h.strip()]
    assert headers == [c.header for c in DEVICE_COLUMNS]  # everything at 140 columns
    narrow = _lines(4, 0, 80, 24)
    header = narrow[0]
    for kept in ("device", "power W", "energy J", "method"):
        assert kept in header
    for dropped in ("mem GiB", "limit W"):  # the least important go first
        assert dropped not in header
    row = next(line for line in narrow if line.startswith("gpu:2"))
    assert "301.2" in row.split()[1] or "303.2" in row  # power stays beside the name
    tiny = _lines(4, 0, 30, 24)[0]
    assert tiny.split() == ["device", "power", "W", "energy", "J"]  # only the essential ones


def test_rows_that_do_not_fit_are_counted() -> None:
    lines = _lines(8, 5, 80, 11)
    gpu_rows = [line for line in lines if line.startswith("gpu:")]
    assert len(gpu_rows) < 8
    more = next(line for line in lines if line.startswith("…"))
    assert more.split()[1] == str(8 - len(gpu_rows))
    assert "process" not in " ".join(lines[:-1])  # no room left for the process table
    assert lines[-1].endswith("+5 process(es) hidden")
    roomy = _lines(8, 5, 80, 24)
    assert sum(line.startswith("pid ") for line in roomy) == 5
    assert not any(line.startswith("…") for line in roomy)


def test_fitted_columns_keep_the_essential_ones_even_when_too_wide() -> None:
    columns = [Column("name", left=True), Column("a", keep=1), Column("b", keep=2), Column("z")]
    rows = [["x" * 20, "1", "2", "3"]]
    assert fitted_columns(columns, rows, 100) == [0, 1, 2, 3]
    assert fitted_columns(columns, rows, 32) == [0, 1, 2, 3]  # 20 + 1 + 1 + 1 + 3 gaps of 3
    full = plain_text(fit_table(columns, rows, width=32), 32).splitlines()
    assert max(map(len, full)) == 32 and full[2].split() == rows[0]  # rich agrees
    assert fitted_columns(columns, rows, 31) == [0, 2, 3]  # "a" (keep 1) goes first
    assert fitted_columns(columns, rows, 28) == [0, 2, 3]
    assert fitted_columns(columns, rows, 27) == [0, 3]
    assert fitted_columns(columns, rows, 5) == [0, 3]
    table = plain_text(fit_table(columns, rows, width=5, max_rows=None), 10)
    assert all(len(line) <= 10 for line in table.splitlines())  # names cut with an ellipsis


def test_output_that_is_not_a_terminal_gets_every_column_unwrapped() -> None:
    buffer = io.StringIO()
    long_name = "a-window-name-much-longer-than-any-terminal-column-" * 3
    write_table(buffer, [Column("window", left=True), Column("J")], [[long_name, "1.00"]])
    lines = buffer.getvalue().splitlines()
    assert lines[2] == f"{long_name}   1.00"
    assert "\x1b" not in buffer.getvalue()
    totals = io.StringIO()
    live = _totals(2)
    write_totals(totals, live)
    rows = totals.getvalue().splitlines()
    assert rows[0].split() == ["device", "energy", "J", "time", "s", "mean", "W", "method"]
    energies = [t.energy_j for t in live.devices.values()]
    assert [row.split()[1] for row in rows[2:4]] == [f"{e:.2f}" for e in energies]
    assert rows[-1].split() == ["all", "GPUs", f"{sum(energies):.2f}"]


# -- in real terminals --------------------------------------------------------------------------

TMUX = shutil.which("tmux")
if TMUX is None and os.environ.get("ZEUS_ASYNC_REQUIRE_TMUX"):
    raise RuntimeError("ZEUS_ASYNC_REQUIRE_TMUX is set but tmux is not installed")
needs_tmux = pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install tmux)")


class Terminal:
    """A tmux session of its own (own server socket) running one command."""

    def __init__(self, tmp: Path, width: int, height: int, command: str) -> None:
        self.socket = str(tmp / "tmux.sock")
        env = {k: v for k, v in os.environ.items() if k not in ("TMUX", "ZEUS_ASYNC_SIM")}
        env["ZEUS_ASYNC_DIR"] = str(tmp / "state")
        self.env = env
        self._tmux(
            "new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height),
            f"cd {ROOT} && {command}; echo EXIT=$?; sleep 60",
        )  # fmt: skip

    def _tmux(self, *args: str) -> str:
        assert TMUX is not None
        return subprocess.run(
            [TMUX, "-S", self.socket, *args],
            capture_output=True,
            text=True,
            check=True,
            env=self.env,
        ).stdout

    def screen(self) -> list[str]:
        return self._tmux("capture-pane", "-p", "-t", "t").rstrip("\n").splitlines()

    def wait_for(self, text: str, timeout: float = 30.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.screen()
            if any(text in line for line in lines):
                return lines
            time.sleep(0.1)
        raise AssertionError(f"{text!r} never appeared:\n" + "\n".join(self.screen()))

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def resize(self, width: int, height: int) -> None:
        self._tmux("resize-window", "-t", "t", "-x", str(width), "-y", str(height))

    def close(self) -> None:
        subprocess.run([TMUX or "tmux", "-S", self.socket, "kill-server"], check=False)


def _monitor(gpus: int, extra: str = "") -> str:
    sim = f'{{"num_gpus":{gpus}}}'
    return (
        f"{sys.executable} -m zeus_async monitor --backend sim --sim-config '{sim}' "
        f"--refresh 0.1 {extra}"
    )


def _check_view(lines: list[str], width: int, gpus: int) -> None:
    """One table on screen (no scrolled or interleaved copies), rows within the width."""
    assert sum(line.startswith("device ") for line in lines) == 1, "\n".join(lines)
    assert all(len(line) <= width for line in lines)
    for g in range(gpus):
        assert sum(line.startswith(f"gpu:{g} ") for line in lines) == 1, "\n".join(lines)


@needs_tmux
@pytest.mark.parametrize(("width", "height", "dropped"), [(80, 24, "limit W"), (140, 40, None)])
def test_monitor_in_a_real_terminal(
    tmp_path: Path, width: int, height: int, dropped: str | None
) -> None:
    term = Terminal(tmp_path, width, height, _monitor(4, "-- sleep 60"))
    try:
        term.wait_for("s, all GPUs")
        time.sleep(1.0)  # ten redraws
        lines = term.screen()
        _check_view(lines, width, 4)
        header = next(line for line in lines if line.startswith("device "))
        assert "energy J" in header and "method" in header
        assert (dropped is None) == ("limit W" in header)
        processes = [line for line in lines if line.startswith("pid ")]
        assert len(processes) == 1
        term.keys("C-c")
        lines = term.wait_for("EXIT=")
        assert "EXIT=130" in lines, "\n".join(lines)  # interrupted: the shell status
        after = lines[lines.index("Totals") :]
        assert sum(line.startswith("gpu:") for line in after) == 4
        assert any(line.startswith("all GPUs") for line in after)
    finally:
        term.close()


@needs_tmux
def test_monitor_follows_a_resized_and_short_terminal(tmp_path: Path) -> None:
    term = Terminal(tmp_path, 140, 40, _monitor(8))
    try:
        term.wait_for("s, all GPUs")
        term.resize(60, 10)
        time.sleep(1.0)
        lines = term.screen()
        view = lines[lines.index(next(x for x in lines if x.startswith("device "))) :]
        assert all(len(line) <= 60 for line in lines)
        assert sum(line.startswith("device ") for line in lines) == 1, "\n".join(lines)
        assert any(line.startswith("… ") and "more" in line for line in view), "\n".join(lines)
        term.resize(80, 24)
        time.sleep(1.0)
        _check_view(term.screen(), 80, 8)
        term.keys("C-c")
        lines = term.wait_for("EXIT=")
        assert "EXIT=130" in lines, "\n".join(lines)
    finally:
        term.close()


@needs_tmux
def test_q_quits_the_live_view_and_gives_the_terminal_back(tmp_path: Path) -> None:
    term = Terminal(tmp_path, 100, 30, _monitor(2))
    try:
        lines = term.wait_for("s, all GPUs")
        assert any("q or Ctrl-C to stop" in line for line in lines), "\n".join(lines)
        term.keys("q")
        lines = term.wait_for("EXIT=")
        assert "EXIT=0" in lines, "\n".join(lines)  # asked to quit: not an interruption
        after = lines[lines.index("Totals") :]
        assert sum(line.startswith("gpu:") for line in after) == 2
        # The terminal is back in its usual mode: what is typed is echoed again.
        term.keys("typed-after")
        term.wait_for("typed-after")
    finally:
        term.close()


@needs_tmux
def test_long_operations_draw_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    data = ROOT / "tests" / "data" / "sim_windows.zarc"
    py = f"{sys.executable} -m zeus_async"
    command = (
        f"{py} export {data} --format csv -o {tmp_path / 'x.csv'} && "
        f"{py} inspect {data} > {tmp_path / 'inspect.txt'} && "
        f"{py} replay {data} --speed max > /dev/null"
    )
    term = Terminal(tmp_path, 100, 20, command)
    try:
        lines = term.wait_for("EXIT=")
        assert "EXIT=0" in lines, "\n".join(lines)
        bars = [line for line in lines if "━" in line]
        assert [bar.split()[0] for bar in bars] == ["exporting", "reading", "replaying"]
        assert all("100%" in bar and "8.6/8.6 kB" in bar for bar in bars), bars
        # The bar goes to the terminal (stderr), never into redirected output.
        assert "━" not in (tmp_path / "inspect.txt").read_text()
    finally:
        term.close()


@needs_tmux
def test_an_interrupted_bar_ends_before_the_message(tmp_path: Path) -> None:
    # Ctrl-C during pfo-plan: the bar stops where it was, and the one-line message comes after
    # it on a line of its own (it used to be drawn over by the bar's last redraw at exit).
    sys.path.insert(0, str(ROOT / "tests" / "cli"))
    from test_cli_pfo import _large_profile

    csv = tmp_path / "profile.csv"
    _large_profile(csv)
    command = (
        f"{sys.executable} -m zeus_async pfo-plan {csv} --microbatches 48 "
        f"--out {tmp_path / 'plan.json'}"
    )
    term = Terminal(tmp_path, 100, 20, command)
    try:
        term.wait_for("planning ")
        term.keys("C-c")
        lines = [line for line in term.wait_for("EXIT=") if line.strip()]
        message = "zeus-async pfo-plan: interrupted while planning; no plan written"
        at = lines.index(message)
        assert lines[at - 1].startswith("planning ") and "━" in lines[at - 1], lines
        assert lines[at + 1] == "EXIT=130", lines
        assert not (tmp_path / "plan.json").exists()
    finally:
        term.close()
