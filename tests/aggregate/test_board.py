"""The power board: provisional window figures from readings in shared memory."""

from __future__ import annotations

import fcntl
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeus_async.agent.journal import lock_held
from zeus_async.aggregate import WindowResult
from zeus_async.aggregate.board import (
    _COARSE,
    _ENTRY,
    _FINE,
    _HEAD,
    BoardReader,
    PowerBoard,
    _layout,
    provisional_measurement,
    sweep_stale_boards,
)

MS = 1_000_000
T0 = 1_760_000_000_000_000_000


def _trapezoid(points: list[tuple[int, float]], t0: int, t1: int) -> float:
    """Exact integral of the piecewise-linear power through ``points`` over [t0, t1]."""
    total = 0.0
    for (ta, pa), (tb, pb) in itertools.pairwise(points):
        lo, hi = max(ta, t0), min(tb, t1)
        if hi <= lo:
            continue

        def p(t: float, ta: int = ta, pa: float = pa, tb: int = tb, pb: float = pb) -> float:
            return pa + (pb - pa) * (t - ta) / (tb - ta)

        total += (p(lo) + p(hi)) / 2 * (hi - lo) / 1e9
    return total


def test_interpolated_and_extrapolated_figures() -> None:
    board = PowerBoard(["gpu:0"])
    reader = board.reader()
    points = [(T0 + k * 10 * MS, 100.0 + 10 * k) for k in range(20)]
    for t, p in points:
        board.add("gpu:0", t, p)
    # Between readings: the trapezoid's share, exactly.
    a = reader.cumulative("gpu:0", T0 + 33 * MS)
    b = reader.cumulative("gpu:0", T0 + 127 * MS)
    assert a is not None and b is not None
    assert b[0] - a[0] == pytest.approx(_trapezoid(points, T0 + 33 * MS, T0 + 127 * MS))
    assert not a[2] and not b[2] and not a[3] and not b[3]
    # |Δp| times the nearer reading's distance: 10 W over 3 ms.
    assert a[1] == pytest.approx(10 * 0.003)
    # Past the last reading (190 ms at 290 W): held at its power, and the stake said.
    last = reader.cumulative("gpu:0", T0 + 196 * MS)
    at_last = reader.cumulative("gpu:0", T0 + 190 * MS)
    assert last is not None and at_last is not None
    assert last[0] - at_last[0] == pytest.approx(290 * 0.006)
    assert last[1] == pytest.approx(290 * 0.006) and last[2] and not last[3]
    # Far past it (more than 3 typical intervals): late.
    far = reader.cumulative("gpu:0", T0 + 250 * MS)
    assert far is not None and far[3]


def test_the_window_figure_names_its_method_and_bound() -> None:
    board = PowerBoard(["gpu:0", "gpu:1", "cpu:0/package", "cpu:0/dram"])
    for k in range(30):
        t = T0 + k * 10 * MS
        board.add("gpu:0", t, 300.0)
        board.add("gpu:1", t, 70.0)
        board.add("cpu:0/package", t, None, 1000.0 + 0.5 * k)  # 50 W from the counter
    keys = {"gpu:0": "gpu:0", "gpu:1": "gpu:1", "cpu:0/package": "cpu:0/package"}
    window = WindowResult("w", 1, T0 + 105 * MS, T0 + 205 * MS)
    m = provisional_measurement(board.reader(), window, keys, host="h", now_ns=T0 + 206 * MS)
    assert m is not None
    assert m.gpu_energy_j == pytest.approx({0: 30.0, 1: 7.0})
    assert m.cpu_energy_j == pytest.approx({0: 5.0})
    assert m.dram_energy_j is None
    assert m.methods == {k: "integrated" for k in keys}
    assert m.error_j == pytest.approx(dict.fromkeys(keys, 0.0))
    # No reading of a device: no figure for it; none at all: no measurement.
    empty = PowerBoard(["gpu:0"])
    keys = {"gpu:0": "gpu:0"}
    assert provisional_measurement(empty.reader(), window, keys, host="h", now_ns=T0) is None


def test_old_edges_come_from_the_coarse_ring_and_beyond_it_are_late() -> None:
    board = PowerBoard(["gpu:0"])
    reader = board.reader()
    n = _FINE * 4  # 10.24 s at 10 ms: the fine ring holds the last 2.5 s
    for k in range(n):
        board.add("gpu:0", T0 + k * 10 * MS, 200.0)
    end = T0 + (n - 1) * 10 * MS
    for start in (T0 + 500 * MS, T0 + 3_333 * MS, end - 1_000 * MS):
        a, b = reader.cumulative("gpu:0", start), reader.cumulative("gpu:0", end)
        assert a is not None and b is not None
        assert b[0] - a[0] == pytest.approx(200 * (end - start) / 1e9, rel=1e-9)
        assert not a[3]
    before = reader.cumulative("gpu:0", T0 - 2_000 * MS)  # before the first reading
    assert before is not None and before[2] and before[3]
    assert before[1] == pytest.approx(200 * 2.0)


def test_a_torn_entry_is_never_used() -> None:
    board = PowerBoard(["gpu:0"])
    for k in range(10):
        board.add("gpu:0", T0 + k * 10 * MS, 100.0)
    reader = board.reader()
    base = reader.slots["gpu:0"]
    # The writer has stored the new entry's first sequence number and nothing else yet.
    entry = base + _HEAD.size + 9 * _ENTRY.size
    seq, t, cum, _watts, _ = _ENTRY.unpack_from(board._map, entry)
    _ENTRY.pack_into(board._map, entry, seq, t + 5 * MS, cum + 99.0, 999.0, seq - 1)
    got = reader.cumulative("gpu:0", T0 + 95 * MS)
    assert got is None  # retried, never torn data
    assert reader.latest("gpu:0") is None


def test_another_process_reads_the_board_file(tmp_path: Path) -> None:
    path = tmp_path / "board"
    board = PowerBoard(["gpu:3"], path)
    for k in range(50):
        board.add("gpu:3", T0 + k * 10 * MS, 250.0)
    code = (
        "import sys; from zeus_async.aggregate.board import BoardReader\n"
        f"r = BoardReader({str(path)!r})\n"
        f"a = r.cumulative('gpu:3', {T0 + 100 * MS}); b = r.cumulative('gpu:3', {T0 + 300 * MS})\n"
        "print(round(b[0] - a[0], 9))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) == pytest.approx(50.0)
    board.close()
    assert not path.exists()
    with pytest.raises(ValueError, match="not a zeus_async power board"):
        (tmp_path / "junk").write_bytes(b"\0" * 4096)
        BoardReader(tmp_path / "junk")


def test_irregular_readings_are_found_wherever_the_edge_falls() -> None:
    """Readings come late and early (a stalled sampler): the search that starts where regular
    readings would be finds the same pair as a full scan, for edges anywhere in the ring."""
    import random

    rng = random.Random(5)
    board = PowerBoard(["gpu:0"])
    reader = board.reader()
    points: list[tuple[int, float]] = []
    t = T0
    for _ in range(600):
        t += int(rng.choice([10, 10, 10, 3, 60, 140]) * MS * rng.uniform(0.8, 1.2))
        points.append((t, rng.uniform(70, 700)))
        board.add("gpu:0", *points[-1])
    kept = points[-(_FINE - 4) :]  # the fine ring's readable part
    base = kept[0][0]
    for _ in range(300):
        a = rng.randrange(base, kept[-1][0])
        b = rng.randrange(a, kept[-1][0] + 1)
        got_a, got_b = reader.cumulative("gpu:0", a), reader.cumulative("gpu:0", b)
        assert got_a is not None and got_b is not None
        assert got_b[0] - got_a[0] == pytest.approx(_trapezoid(kept, a, b), rel=1e-9, abs=1e-9)


def test_a_board_file_is_allocated_up_front_and_locked_while_it_lives(tmp_path: Path) -> None:
    # Sparse, its pages would be allocated when first written: on a full file system, a
    # SIGBUS in the sampler.
    path = tmp_path / f"board-{os.getpid()}-ab"
    board = PowerBoard(["gpu:0", "gpu:1"], path)
    st = os.stat(path)
    assert st.st_size == _layout(2, _FINE, _COARSE)[2]
    assert st.st_blocks * 512 >= st.st_size
    assert lock_held(path)
    board.close()
    assert not path.exists()
    board.close()  # idempotent


def test_boards_of_dead_writers_are_swept_by_the_next_board(tmp_path: Path) -> None:
    reaped = subprocess.Popen([sys.executable, "-c", ""])
    reaped.wait()
    zombie = subprocess.Popen([sys.executable, "-c", ""])
    # Exited, not reaped: a zombie (its pid cannot be reused meanwhile).
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)
    try:
        names = {
            "reaped": f"board-{reaped.pid}-0a",
            "zombie": f"board-{zombie.pid}-0b",
            "live pid": f"board-{os.getpid()}-0c",  # this process: alive, lock or not
            "locked": f"board-{zombie.pid}-0d",  # a writer in another pid namespace
            "other": "board-notes",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"\0" * 64)
        fd = os.open(tmp_path / names["locked"], os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            board = PowerBoard(["gpu:0"], tmp_path / f"board-{os.getpid()}-0e")
            left = sorted(p.name for p in tmp_path.iterdir())
            kept = [names["live pid"], names["locked"], names["other"], f"board-{os.getpid()}-0e"]
            assert left == sorted(kept)
            board.close()
        finally:
            os.close(fd)
        # The lock let go: swept by the next one.
        assert sweep_stale_boards(tmp_path) == [tmp_path / names["locked"]]
    finally:
        zombie.wait()
