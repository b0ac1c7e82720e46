"""Regenerate the small simulator recordings under ``tests/data`` (deterministic).

    .venv/bin/python tests/data/make_recordings.py

* ``sim_windows.zarc`` — 2 simulated GPUs (an H100-like one with an energy counter on a square
  wave, a pre-Volta one at constant load), 10 ms sampling, 3 s, nested and overlapping windows
  (``train`` around ``step-0..3``, ``eval`` overlapping the last step), a power-limit change;
  made under a fake clock (the exact sample count can vary by a few between runs: the
  simulator's worker threads race the fake clock).
  Stored in frames of 64 events.
* ``sim_windows_torn.zarc`` — the same file cut in the middle of its last frame, as a killed
  writer leaves it.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from zeus_async.clock import FakeClock
from zeus_async.devices.sim_config import GpuOverride, SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload, SquareWorkload
from zeus_async.events import PowerLimitChange
from zeus_async.runtime import Runtime
from zeus_async.store import RecordingReader, write_recording
from zeus_async.testing import sim_pynvml

HERE = Path(__file__).parent
MS = 1_000_000
WALL0 = 1_763_600_000_000_000_000


async def _record(path: Path) -> None:
    clock = FakeClock(wall_start_ns=WALL0)
    config = SimConfig(
        num_gpus=2,
        workload=SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1),
        gpus=(GpuOverride(), GpuOverride(pre_volta=True, workload=ConstantWorkload(util=0.6))),
        seed=11,
    )
    try:
        async with Runtime(
            backend="sim",
            cpus=None,
            sim_config=config,
            clock=clock,
            windows=True,
            record=path,
            host="sim-node",
        ) as rt:

            async def sleep_ms(ms: int) -> None:
                await clock.sleep_until(clock.monotonic_ns() + ms * MS)

            await sleep_ms(400)
            async with rt.window("train"):
                for i in range(4):
                    if i == 3:
                        rt.tracker.open("eval")  # type: ignore[union-attr]
                    async with rt.window(f"step-{i}"):
                        await sleep_ms(230 + 40 * i)
                    if i == 1:
                        rt.devices[0].set_power_limit_w(450.0)  # type: ignore[attr-defined]
                        await rt.publish(
                            PowerLimitChange(
                                host="sim-node",
                                t_ns=clock.wall_ns(),
                                gpu=0,
                                power_limit_w=450.0,
                                previous_w=700.0,
                                source="make_recordings",
                            )
                        )
                await sleep_ms(120)
                rt.tracker.close("eval")  # type: ignore[union-attr]
            await sleep_ms(600)
    finally:
        sim_pynvml.uninstall()


def main() -> None:
    path = HERE / "sim_windows.zarc"
    anyio.run(_record, path)
    # Re-framed in frames of 64 events (same header, same events), so tests see many frames.
    reader = RecordingReader(path)
    write_recording(path, list(reader), reader.header, events_per_frame=64)
    data = path.read_bytes()
    offsets = [offset for offset, _ in RecordingReader(path).frame_index()]
    torn = HERE / "sim_windows_torn.zarc"
    torn.write_bytes(data[: offsets[-1] + (len(data) - offsets[-1]) // 2])
    print(f"{path.name}: {len(data)} bytes, {len(offsets)} frames; {torn.name} cut")


if __name__ == "__main__":
    main()
