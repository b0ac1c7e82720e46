"""SIGKILL torture of the format-3 writers: 100 kills at random moments, every file opens with
every complete frame (the pattern of ``test_store``'s kill tests, with real processes).

Each writer is its own process, SIGKILLed while it writes; they are forked from a
``multiprocessing`` forkserver that has already imported the writer, so each of the 100 costs
a fork rather than an interpreter start and its imports (``test_store``'s kill tests start
``writer_proc.py`` itself)."""

from __future__ import annotations

import multiprocessing
import random
from pathlib import Path

import pytest
import writer_proc
from test_store import _check_killed

from zeus_async.store import RecordingReader

KILLS = 100
PRELOAD = ["anyio", "zeus_async.events", "zeus_async.runtime.hub", "zeus_async.store"]


def _kill_forked(
    ctx: multiprocessing.context.ForkServerContext,
    path: Path,
    per_frame: int,
    min_frames: int,
    rng: random.Random,
    mode: str = "raw",
) -> None:
    """``test_store._kill_once`` with the writer forked: the same reports, kill and checks."""
    reports, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=writer_proc.write, args=(str(path), per_frame, mode, sender))
    proc.start()
    sender.close()  # the writer's end is the writer's alone: its death ends the reports
    try:
        reported = 0
        while reported < min_frames:
            try:
                reported = reports.recv()
            except EOFError:
                raise AssertionError("writer exited early") from None
        # Read a random number of further reports so the kill lands at a random point.
        for _ in range(rng.randrange(0, 50)):
            reported = reports.recv()
        proc.kill()
    finally:
        proc.join(timeout=60)
        reports.close()
    assert proc.exitcode == -9, proc.exitcode  # SIGKILLed while writing, not ended otherwise
    proc.close()
    _check_killed(path, per_frame, mode, reported)


@pytest.mark.slow
def test_a_hundred_kills_of_v3_writers_leave_files_that_open(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("forkserver")
    # What the writer imports, imported once in the server (its sys.path is the default one,
    # without this directory); "__main__": pytest's script, were it started as one.
    ctx.set_forkserver_preload(["__main__", *PRELOAD])
    rng = random.Random(39)
    for i in range(KILLS):
        path = tmp_path / f"k{i}.zarc"
        if i % 2:
            # the product's writer: hub -> Recorder, zstd, flush_interval_s = 0.05; a frame
            # every per_frame events or 50 ms, so a kill loses at most what came since
            _kill_forked(
                ctx, path, per_frame=rng.choice([16, 100, 1000]), min_frames=2, rng=rng, mode="rec"
            )
        else:
            # frames written in three pieces, so kills tear them
            _kill_forked(ctx, path, per_frame=rng.choice([1, 7, 64, 500]), min_frames=3, rng=rng)
        reader = RecordingReader(path)
        assert reader.format_version == 3
        list(reader)
        assert reader.report.corrupt_frames == []
        path.unlink()
