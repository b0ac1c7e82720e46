"""SIGKILL torture of the format-3 writers: 100 kills at random moments, every file opens with
every complete frame (the pattern of ``test_store``'s kill tests, with real processes)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_store import _kill_once

from zeus_async.store import RecordingReader


@pytest.mark.slow
def test_a_hundred_kills_of_v3_writers_leave_files_that_open(tmp_path: Path) -> None:
    rng = random.Random(39)
    for i in range(100):
        path = tmp_path / f"k{i}.zarc"
        if i % 2:
            # the product's writer: hub -> Recorder, zstd, flush_interval_s = 0.05; a frame
            # every per_frame events or 50 ms, so a kill loses at most what came since
            _kill_once(
                path, per_frame=rng.choice([16, 100, 1000]), min_frames=2, rng=rng, mode="rec"
            )
        else:
            # frames written in three pieces, so kills tear them
            _kill_once(path, per_frame=rng.choice([1, 7, 64, 500]), min_frames=3, rng=rng)
        reader = RecordingReader(path)
        assert reader.format_version == 3
        list(reader)
        assert reader.report.corrupt_frames == []
        path.unlink()
