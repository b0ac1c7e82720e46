"""Replaying recordings in tests: a runtime under a fake clock, fed from a file.

:func:`replay_recording` builds a device-less :class:`~zeus_async.runtime.Runtime` on a
``FakeClock(autojump=True)`` that starts at the recording's first timestamp, runs your
consumers plus a :class:`~zeus_async.aggregate.windows.ReplayedWindows`, replays the file at the
requested pace (no real time passes) and returns what came out. ``tests/conftest.py`` exposes it
as the ``replay`` fixture, and ``recordings`` points at the committed files in ``tests/data``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..aggregate.windows import ReplayedWindows
from ..clock import FakeClock
from ..events import Measurement
from ..store.reader import RecordingReader, RecoveryReport
from ..store.replay import Replayer

__all__ = ["ReplayRun", "replay_recording"]

logger = logging.getLogger(__name__)


@dataclass
class ReplayRun:
    """What a replay produced.

    Attributes:
        events: Events replayed into the runtime.
        measurements: Window measurements recomputed from the replayed stream.
        recorded: The measurements the recording holds (computed live).
        clock: The fake clock (its time is where the replay ended).
        report: Recovery report of the recording pass (torn tail, corrupt frames).
    """

    events: int
    measurements: list[Measurement]
    recorded: list[Measurement]
    clock: FakeClock
    report: RecoveryReport
    extra: dict[str, Any] = field(default_factory=dict)


async def replay_recording(
    path: str | os.PathLike[str],
    *,
    speed: float | None = 1.0,
    consumers: Sequence[Callable[[Any], Awaitable[None]]] = (),
    record: str | os.PathLike[str] | None = None,
) -> ReplayRun:
    """Replay ``path`` into a fresh runtime under a fake clock; see the module docstring.

    Args:
        path: The recording.
        speed: Pace (``None``: as fast as possible); paced replays take no real time.
        consumers: Extra runtime consumers (each gets a lossless stream of the replay).
        record: Also record the replayed stream to this file.
    """
    from ..runtime import Runtime

    reader = RecordingReader(path)
    first = next(iter(reader), None)
    clock = FakeClock(wall_start_ns=first.t_ns if first is not None else 0)
    windows = ReplayedWindows(reader.header.devices)
    async with Runtime(
        devices=[],
        clock=clock,
        host=reader.header.host or "replay",
        consumers=[windows.run, *consumers],
        record=record,
    ) as rt:
        n = await Replayer(reader, speed=speed, clock=clock).into_runtime(rt)
    return ReplayRun(
        events=n,
        measurements=windows.results,
        recorded=windows.recorded,
        clock=clock,
        report=reader.report,
    )
