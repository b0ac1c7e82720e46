"""A full or read-only private directory: the agent goes on without its power board.

The private directory is a real tmpfs mounted small and filled (``mount`` needs root: the
tests are skipped without it). The simulated node's state (``<private dir>/sim``, the
"driver") gets a tmpfs of its own, not full: on a real node the driver keeps its settings in
the GPU, not on this disk, so the restores are measured and not the simulator's file writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeus_async import Monitor
from zeus_async.agent.journal import lock_held
from zeus_async.aggregate.windows import WindowTracker
from zeus_async.clock import FakeClock
from zeus_async.devices.sim_config import SimConfig
from zeus_async.errors import JournalError
from zeus_async.events import DeviceInfo, GpuSample
from zeus_async.testing import read_sim_node_state

CONFIG = SimConfig(num_gpus=2, seed=7)
DEFAULT_W = CONFIG.power_limit_default_w


def _mount(path: Path, size: str) -> None:
    path.mkdir(mode=0o700, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture
def small_dir(private_dir: Path) -> Iterator[Path]:
    """The private directory as a 4 MiB tmpfs (room for a board), with ``sim`` on its own."""
    _mount(private_dir, "4m")
    sim = private_dir / "sim"
    try:
        _mount(sim, "1m")
    except BaseException:
        _umount(private_dir)
        raise
    yield private_dir
    _umount(sim)
    _umount(private_dir)


def _fill(directory: Path, leave: int = 0) -> None:
    """Write zeros into ``directory`` until its file system has no block left, then give
    back ``leave`` bytes."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    chunk = b"\0" * 65536
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
        assert os.statvfs(directory).f_bavail == 0
        if leave:
            os.ftruncate(fd, os.fstat(fd).st_size - leave)
    finally:
        os.close(fd)


def _boards(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("board-*"))


def _exact_windows(mon: Monitor, seconds: float) -> None:
    """Windows for ``seconds`` of real time; each gets its exact figures for both GPUs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with mon.window("step") as w:
            time.sleep(0.1)
        m = w.result.wait(timeout=10)
        assert sorted(m.gpu_energy_j) == [0, 1]
        assert all(e > 0 for e in m.gpu_energy_j.values())
        # Exact, counter-based figures: not the board's "integrated" ones.
        assert not any(method.startswith("integrated") for method in m.methods.values())


@pytest.mark.slow
def test_agent_starts_and_measures_on_a_full_private_directory(
    small_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    _fill(small_dir)
    mon = Monitor(backend="sim", cpu_indices=[], sim_config=CONFIG)
    try:
        assert mon._process is not None and mon._process._proc is not None
        agent = mon._process._proc
        _exact_windows(mon, 1.0)
        assert mon._process._board is None  # no board: no provisional figures
        # The lease journal cannot be written: the change is refused, not made unjournalled.
        with pytest.raises(JournalError, match=r"left unchanged: .*No space left on device"):
            mon.set_power_limit(250).result(timeout=30)
        assert [g.power_limit_w for g in read_sim_node_state(CONFIG)] == [DEFAULT_W] * 2
        assert agent.poll() is None
    finally:
        mon.close()
    assert agent.wait(timeout=20) == 0
    assert _boards(small_dir) == []


@pytest.mark.slow
def test_agent_warns_when_its_board_does_not_fit(
    small_dir: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    _fill(small_dir, leave=64 * 1024)  # room for the agent's log, not for the board
    with Monitor(backend="sim", cpu_indices=[], sim_config=CONFIG) as mon:
        assert mon._process is not None and mon._process._proc is not None
        agent = mon._process._proc
        _exact_windows(mon, 0.5)
        assert mon._process._board is None
    assert agent.wait(timeout=20) == 0
    # The agent's stderr: inherited, or relayed from its log by the client's logger.
    said = capfd.readouterr().err + caplog.text
    assert "no power board (" in said and "No space left on device): " in said, said
    assert "clients get no provisional window figures, only the exact ones" in said
    assert _boards(small_dir) == []


@pytest.mark.slow
def test_disk_filling_up_while_sampling_stops_nothing_and_restores_happen(
    small_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    mon = Monitor(backend="sim", cpu_indices=[], sim_config=CONFIG)
    try:
        assert mon._process is not None and mon._process._proc is not None
        agent = mon._process._proc
        mon.set_power_limit(250).result(timeout=30)  # journalled while there is room
        assert [g.power_limit_w for g in read_sim_node_state(CONFIG)] == [250.0] * 2
        (board,) = _boards(small_dir)
        _fill(small_dir)
        # Longer than the board's fine ring (2.56 s of readings): every page of it written.
        _exact_windows(mon, 3.0)
        # A new lease needs the journal: refused, and nothing changed.
        with pytest.raises(JournalError, match=r"left unchanged: .*No space left on device"):
            mon.set_sm_clocks(1200).result(timeout=30)
        assert [g.locked_sm_clocks_mhz for g in read_sim_node_state(CONFIG)] == [None] * 2
        assert agent.poll() is None
        assert lock_held(small_dir / board)
    finally:
        mon.close()
    assert agent.wait(timeout=20) == 0
    # Restored, on a full disk.
    assert [g.power_limit_w for g in read_sim_node_state(CONFIG)] == [DEFAULT_W] * 2
    assert _boards(small_dir) == []
    assert "no power board" not in capfd.readouterr().err


@pytest.mark.slow
def test_a_closed_agent_leaves_no_board_and_a_killed_ones_is_swept_at_the_next_start(
    private_dir: Path,
) -> None:
    first = Monitor(backend="sim", cpu_indices=[], sim_config=CONFIG)
    try:
        assert first._process is not None and first._process._proc is not None
        agent = first._process._proc
        (board,) = _boards(private_dir)
        assert board.startswith(f"board-{agent.pid}-")
        assert lock_held(private_dir / board)  # held while the agent lives
        agent.send_signal(signal.SIGKILL)
        # Exited but not reaped: a zombie, whose pid cannot be reused meanwhile.
        os.waitid(os.P_PID, agent.pid, os.WEXITED | os.WNOWAIT)
        assert _boards(private_dir) == [board]  # a SIGKILL leaves it
        with Monitor(backend="sim", cpu_indices=[], sim_config=CONFIG) as second:
            assert second._process is not None and second._process._proc is not None
            (mine,) = _boards(private_dir)  # the stale one swept at the start
            assert mine.startswith(f"board-{second._process._proc.pid}-")
            second_agent = second._process._proc
        assert second_agent.wait(timeout=20) == 0
        assert _boards(private_dir) == []  # removed when the agent closed
    finally:
        with contextlib.suppress(Exception):
            first.close()


MS = 1_000_000


@pytest.mark.parametrize("cause", ["full", "read-only"])
def test_tracker_goes_on_without_a_board_it_cannot_create(
    small_dir: Path, cause: str, caplog: pytest.LogCaptureFixture
) -> None:
    if cause == "full":
        _fill(small_dir)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(small_dir)], check=True)
    path = small_dir / f"board-{os.getpid()}-00"
    clock = FakeClock(wall_start_ns=1_760_000_000_000_000_000)
    devices = [DeviceInfo("gpu:0", "sim", has_energy_counter=True)]
    tracker = WindowTracker(clock, "h", devices, board=str(path))
    assert tracker.board is None
    assert not path.exists()
    strerror = os.strerror(errno.ENOSPC if cause == "full" else errno.EROFS)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"no power board ({path}: {strerror}): clients get no provisional window figures, "
        "only the exact ones; sampling, windows and restores go on"
    ]
    # Windows are measured as before, from the samples.
    t0 = clock.wall_ns()
    for i in range(101):  # 1 s at 100 W
        tracker.add(GpuSample("h", t0 + i * 10 * MS, 0, power_w=100.0, energy_j=1.0 * i))
    tracker.open("w", t_ns=t0 + 100 * MS)
    result = tracker.close("w", t_ns=t0 + 600 * MS)
    clock.set_ns(1 * 10**9)
    tracker.pump()
    assert result.done()
    assert result.gpu_energy == pytest.approx({0: 50.0})
    tracker.close_board()
