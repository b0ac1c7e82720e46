"""Replaying recordings: pacing, destinations, filters, and live == replay equivalence."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from zeus_async.aggregate.windows import ReplayedWindows
from zeus_async.bus import Publisher, Subscriber
from zeus_async.clock import FakeClock
from zeus_async.errors import ConfigError
from zeus_async.events import Event, GpuSample, Measurement
from zeus_async.store import RecordingReader
from zeus_async.store.replay import Replayer
from zeus_async.testing.replay import ReplayRun

pytestmark = pytest.mark.anyio

Replay = Callable[..., Awaitable[ReplayRun]]


def same_figures(a: Measurement, b: Measurement) -> bool:
    """Everything but the finalization stamp ``t_ns``."""
    return (
        a.name,
        a.window_id,
        a.start_ns,
        a.end_ns,
        a.time_s,
        a.gpu_energy_j,
        a.cpu_energy_j,
        a.dram_energy_j,
        a.methods,
        a.lost,
    ) == (
        b.name,
        b.window_id,
        b.start_ns,
        b.end_ns,
        b.time_s,
        b.gpu_energy_j,
        b.cpu_energy_j,
        b.dram_energy_j,
        b.methods,
        b.lost,
    )


def test_committed_recording_is_what_the_tests_expect(recordings: Path) -> None:
    reader = RecordingReader(recordings / "sim_windows.zarc")
    events = list(reader)
    assert reader.report.clean
    assert [d.key for d in reader.header.devices] == ["gpu:0", "gpu:1"]
    measured = [e for e in events if isinstance(e, Measurement)]
    assert [m.name for m in measured] == ["step-0", "step-1", "step-2", "step-3", "eval", "train"]
    assert sum(isinstance(e, GpuSample) for e in events) > 500


def test_offline_windows_equal_the_live_ones_exactly(recordings: Path) -> None:
    reader = RecordingReader(recordings / "sim_windows.zarc")
    windows = ReplayedWindows(reader.header.devices)
    for event in reader:
        windows.add(event)
    results = windows.finish()
    live = {m.window_id: m for m in windows.recorded}
    assert len(results) == len(live) == 6
    for m in results:
        assert same_figures(m, live[m.window_id]), (m, live[m.window_id])


async def test_replay_into_runtime_gives_the_live_measurements(
    recordings: Path, replay: Replay, tmp_path: Path
) -> None:
    path = recordings / "sim_windows.zarc"
    original = list(RecordingReader(path))
    out = tmp_path / "again.zarc"
    run = await replay(path, speed=1.0, record=out)
    assert run.events == len(original)
    # Paced on the fake clock: the replay lasted the recording's span, no real time passed.
    span = max(e.t_ns for e in original) - original[0].t_ns
    assert run.clock.monotonic_ns() >= span
    live = {m.window_id: m for m in run.recorded}
    assert len(run.measurements) == 6
    for m in run.measurements:
        assert same_figures(m, live[m.window_id])
    # Recorded again through the runtime, the stream is unchanged (order and timestamps).
    assert [e for e in RecordingReader(out) if e in original] == original


async def test_replay_of_a_torn_recording(recordings: Path, replay: Replay) -> None:
    run = await replay(recordings / "sim_windows_torn.zarc", speed=None)
    assert run.report.torn_tail_offset is not None and run.report.torn_tail_bytes > 0
    complete = RecordingReader(recordings / "sim_windows_torn.zarc")
    assert run.events == sum(1 for _ in complete)
    live = {m.window_id: m for m in run.recorded}
    for m in run.measurements:
        if m.window_id in live:
            assert same_figures(m, live[m.window_id])


@pytest.mark.parametrize("speed", [1.0, 4.0, 0.5])
async def test_paced_replay_keeps_the_original_spacing(recordings: Path, speed: float) -> None:
    clock = FakeClock(wall_start_ns=0)
    seen: list[tuple[int, Event]] = []

    async def publish(event: Event) -> None:
        seen.append((clock.monotonic_ns(), event))

    replayer = Replayer(recordings / "sim_windows.zarc", speed=speed, clock=clock)
    n = await replayer.run(publish)
    assert n == len(seen) == replayer.events_published
    t0 = seen[0][1].t_ns
    last_due = 0
    for at, event in seen:
        due = max(last_due, round((event.t_ns - t0) / speed))
        assert at == due  # sent when due, never early; late events (measurements) at once
        last_due = due


async def test_unpaced_replay_takes_no_clock_time_and_filters(recordings: Path) -> None:
    clock = FakeClock(wall_start_ns=0)
    seen: list[Event] = []

    async def publish(event: Event) -> None:
        seen.append(event)

    reader = RecordingReader(recordings / "sim_windows.zarc")
    await Replayer(reader, speed=None, clock=clock, kinds=["gpu"], devices=["gpu:1"]).run(publish)
    assert clock.monotonic_ns() == 0
    expected = [e for e in RecordingReader(reader.path) if isinstance(e, GpuSample) and e.gpu == 1]
    assert seen == expected


async def test_replay_progress_reaches_the_end(tmp_path: Path) -> None:
    from zeus_async.store import write_recording
    from zeus_async.testing.fakes import realistic_gpu_samples

    path = tmp_path / "big.zarc"
    write_recording(path, realistic_gpu_samples(200_000, t0_ns=10**18, step_ns=1000))
    calls: list[tuple[int, int]] = []

    async def publish(event: Event) -> None:
        pass

    await Replayer(path, speed=None, progress=lambda d, t: calls.append((d, t))).run(publish)
    size = path.stat().st_size
    assert len(calls) >= 3 and calls[-1] == (size, size)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="speed"):
        Replayer([], speed=0)
    with pytest.raises(ConfigError, match="recording"):
        Replayer([], kinds=["gpu"])


async def test_replay_onto_zeromq(recordings: Path, ipc_endpoint: str) -> None:
    path = recordings / "sim_windows.zarc"
    original = list(RecordingReader(path))
    pub = Publisher(ipc_endpoint, host="replay")
    received: list[Event] = []
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        async with Subscriber(pub.endpoint, topics=["gpu/", "window/", "control/"]) as sub:
            await sub.wait_ready(timeout=10)
            n = await Replayer(path, speed=None).to_publisher(pub)
            wanted = [e for e in original if type(e).__name__ != "StreamInfo"]
            with anyio.fail_after(10):
                async for event in sub:
                    if type(event).__name__ in ("StreamInfo", "Heartbeat"):
                        continue
                    received.append(event)
                    if len(received) == len(wanted):
                        break
            assert sub.stats.frames_lost == 0
        tg.cancel_scope.cancel()
    assert n == len(original)
    # Per topic the order is preserved; across topics the bus batches independently.
    assert sorted(received, key=lambda e: (e.t_ns, repr(e))) == sorted(
        wanted, key=lambda e: (e.t_ns, repr(e))
    )
