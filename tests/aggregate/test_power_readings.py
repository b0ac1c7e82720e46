"""What the power readings describe, judged online, and short windows on every kind of reading.

Simulated GPUs read through the NVML backend on a fake clock: an H100 (its instant field
averages the head of each 100 ms period and shows it once the period has ended), A100s (GA100:
``nvmlDeviceGetPowerUsage`` is the instant sensor where the driver lacks the instant field),
a sensor refreshed every 10 ms, and readings that are all the 1 s average (issue 34: such
readings split counter periods, and the 50 ms window's exact figure was off by twice as much
as without them).
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

from zeus_async.aggregate.history import DeviceHistory, add_sample
from zeus_async.clock import FakeClock
from zeus_async.devices.nvml import open_nvml_gpus
from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.devices.sim_workload import RandomWorkload, SquareWorkload, TraceWorkload
from zeus_async.runtime import Runtime
from zeus_async.testing import sim_pynvml

MS = 1_000_000
T0 = 1_760_000_000_000_000_000 + 3 * MS
WORKLOAD = RandomWorkload(seg_min_s=0.05, seg_max_s=1.0)  # levels held 50 ms to 1 s
A100 = {"name": "NVIDIA A100-SXM4-80GB", "arch": "ampere", "max_w": 400.0, "idle_w": 50.0}
OLD_DRIVER = {"driver_version": "525.147.05"}
#: Device models, and what their power_w readings are.
DEVICES: dict[str, tuple[dict[str, Any], str | None, str]] = {
    "H100: instant field, 25 ms head of the last period": (
        {},
        "NVML_FI_DEV_POWER_INSTANT",
        "lagging",
    ),
    "A100, driver 550: instant field, same sensor": (
        {**A100, "power_reading": "instant"},
        "NVML_FI_DEV_POWER_INSTANT",
        "lagging",
    ),
    "A100, driver 525: nvmlDeviceGetPowerUsage, same sensor": (
        {**A100, **OLD_DRIVER, "power_reading": "instant"},
        "nvmlDeviceGetPowerUsage",
        "lagging",
    ),
    "a sensor refreshed every 10 ms": (
        {"power_reading": "instant", "instant_window_s": 0.01, "instant_period_s": 0.01},
        "NVML_FI_DEV_POWER_INSTANT",
        "instant",
    ),
    "1 s average in the instant field": (
        {"power_reading": "average_only"},
        "NVML_FI_DEV_POWER_INSTANT",
        "averaged",
    ),
    "A100, driver 525, nvmlDeviceGetPowerUsage averaged after all": (
        {**A100, **OLD_DRIVER},
        "nvmlDeviceGetPowerUsage",
        "averaged",
    ),
}


def _config(overrides: dict[str, Any], num_gpus: int = 1) -> SimConfig:
    return SimConfig(num_gpus=num_gpus, seed=11, workload=WORKLOAD, **overrides)


def _history_through_nvml(overrides: dict[str, Any], seconds: float) -> tuple[DeviceHistory, Any]:
    """A device's history from reads every 10 ms (+-20 %) through the NVML backend."""
    clock = FakeClock(wall_start_ns=T0)
    node = SimNode(_config(overrides), clock, shared_state=False)
    history = DeviceHistory("gpu:0")
    rng = random.Random(5)
    with sim_pynvml.patched_pynvml(node):
        gpu = open_nvml_gpus([0], pynvml_module=sim_pynvml, env={})[0]
        source = gpu.power_source
        t = T0
        while t < T0 + round(seconds * 1e9):
            clock.set_ns(clock.monotonic_ns() + (t - clock.wall_ns()))
            for event in gpu.read(("power_w", "energy_j"), "h", t):
                add_sample(history, event)  # type: ignore[arg-type]
            t += round(10 * MS * rng.uniform(0.8, 1.2))
        gpu.close()
    return history, source


@pytest.mark.parametrize("device", list(DEVICES))
def test_the_readings_are_judged_by_what_they_describe(device: str) -> None:
    overrides, source, verdict = DEVICES[device]
    history, power_source = _history_through_nvml(overrides, 10.0)
    assert power_source == source
    assert history.power_readings == verdict
    split = {"lagging": "head", "instant": "power", "averaged": "time"}[verdict]
    assert history._split() == split
    assert history._head_model_active() == (verdict == "lagging")
    ct, ce = history._ct, history._ce
    last_period_w = (ce[-1] - ce[-2]) / (
        history._refined(len(ct) - 1) - history._refined(len(ct) - 2)
    )
    reading = history._pw[-1]
    fresh = history.fresh_power(reading)
    if verdict == "instant":
        assert fresh == reading
    else:
        # Readings that describe the past give way to the last counter period's mean power.
        assert fresh == pytest.approx(last_period_w * 1e9)


def test_a_power_that_never_moves_tells_nothing() -> None:
    """Constant power: no swing, no verdict. The readings (power_w: instant readings, by the
    backend's contract) share a period out, which here is what time would give too; a 1 s
    average of a power whose period means do not move is as level as they are."""
    h = DeviceHistory("gpu:0")
    for i in range(600):
        t = i * 10 * MS + 3 * MS
        h.add(t, 300.0, 30.0 * (t // (100 * MS)))
    assert h.power_readings == "unknown"
    assert h._split() == "power" and not h._head_model_active()
    assert h.energy(1_234 * MS, 1_284 * MS).energy_j == pytest.approx(15.0)


# -- short windows, exact and provisional, through the runtime ------------------------------

LENGTHS_MS = (20, 50, 200)


async def _windows(
    overrides: dict[str, Any], per_length: int, workload: Any = WORKLOAD
) -> dict[int, tuple[float, float]]:
    """MAPE of (exact, provisional) figures per window length: windows at random phases on
    two GPUs after a 5 s warm-up, the provisional figure read as soon as the window closes."""
    clock = FakeClock(wall_start_ns=T0)
    rng = random.Random(3)
    rows = []
    config = msgspec.structs.replace(_config(overrides, 2), workload=workload)
    try:
        async with Runtime(
            backend="sim", cpus=None, sim_config=config, clock=clock, windows=True
        ) as rt:
            tracker = rt.tracker
            assert tracker is not None
            node = sim_pynvml.current_node()
            assert node is not None
            await clock.sleep_until(clock.monotonic_ns() + 5_000 * MS)
            for length in LENGTHS_MS:
                for i in range(per_length):
                    await clock.sleep_until(clock.monotonic_ns() + rng.randrange(100) * MS)
                    tracker.open(f"w{length}-{i}")
                    await clock.sleep_until(clock.monotonic_ns() + length * MS)
                    result = tracker.close(f"w{length}-{i}")
                    assert result.provisional
                    rows.append((length, result, dict(result.gpu_energy)))
            for _, result, _ in rows:
                await result.wait_async()
    finally:
        sim_pynvml.uninstall()
    errors: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in LENGTHS_MS}
    for length, result, provisional in rows:
        m = result.wait(0)
        for gpu in (0, 1):
            truth = node.truth_energy_j(gpu, m.start_ns, m.end_ns)
            errors[length][0].append(abs(m.gpu_energy_j[gpu] - truth) / truth)
            errors[length][1].append(abs(provisional[gpu] - truth) / truth)
    return {n: (statistics.fmean(e), statistics.fmean(p)) for n, (e, p) in errors.items()}


#: MAPE bounds (exact, provisional) per window length: what was measured (in the comments:
#: exact / provisional, 30 windows of each length on 2 GPUs) with a margin. A provisional
#: figure where the readings describe the past is the last counter period's mean power, about
#: 100 ms old: it cannot follow a level held 50 ms. (Zeus 0.16's immediate reading errs
#: 76-212 % on 20-50 ms windows of this load, bench/windows/bench_short_windows.py.)
BOUNDS: dict[str, dict[int, tuple[float, float]]] = {
    # 8.7 / 44.6, 3.2 / 35.0, 2.3 / 11.6 %. Before issue 34 the exact figures were 19.2, 12.3
    # and 3.2 %: the 1 s averages split the counter periods.
    "1 s average in the instant field": {20: (0.12, 0.55), 50: (0.06, 0.45), 200: (0.03, 0.16)},
    # 2.7 / 44.6, 0.6 / 35.0, 0.3 / 11.6 %, as before issue 34.
    "H100: instant field, 25 ms head of the last period": {
        20: (0.04, 0.55),
        50: (0.015, 0.45),
        200: (0.006, 0.16),
    },
    # 3.7 / 6.4, 1.8 / 1.5, 0.9 / 1.2 %, as before issue 34.
    "a sensor refreshed every 10 ms": {20: (0.05, 0.08), 50: (0.025, 0.025), 200: (0.012, 0.02)},
}


@pytest.mark.parametrize("device", list(BOUNDS))
def test_short_windows_on_every_kind_of_reading(device: str) -> None:
    got = anyio.run(_windows, DEVICES[device][0], 30)
    for length, (exact, provisional) in BOUNDS[device].items():
        assert got[length][0] <= exact, (device, length, got)
        assert got[length][1] <= provisional, (device, length, got)


SQUARE = SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1)
#: A smooth load, no steps: a 0.8 s sine between 10 % and 100 %, held 5 ms at a time.
SINE = TraceWorkload(
    segments=tuple((0.005, 0.55 + 0.45 * math.sin(2 * math.pi * k / 160)) for k in range(160))
)
#: MAPE bounds of the exact figure per window length on readings that are 1 s averages, on
#: two device models, for a load of steps and a smooth one: a counter period between two
#: levels is split as one step only where the power does not go on changing beyond its
#: neighbours. Measured (30 windows of each length on 2 GPUs) in the comments, with a margin.
STEP_BOUNDS: dict[str, dict[int, float]] = {
    # 20/50/200 ms: 6.6 / 1.5 / 1.8 % (A100 model: 6.1 / 1.4 / 1.7 %); with the sloped
    # split alone, 29.2 / 21.9 / 6.1 % (bench, 60 windows).
    "square": {20: 0.09, 50: 0.03, 200: 0.03},
    # 50/200 ms: 4.5 / 1.2 % (A100 model: 4.1 / 1.1 %), the sloped split's figures kept.
    "sine": {20: 0.07, 50: 0.055, 200: 0.016},
}


@pytest.mark.parametrize("load", list(STEP_BOUNDS))
@pytest.mark.parametrize(
    "device",
    [
        "1 s average in the instant field",
        "A100, driver 525, nvmlDeviceGetPowerUsage averaged after all",
    ],
)
def test_short_windows_on_averaged_readings_steps_and_slopes(device: str, load: str) -> None:
    got = anyio.run(_windows, DEVICES[device][0], 30, SQUARE if load == "square" else SINE)
    for length, exact in STEP_BOUNDS[load].items():
        assert got[length][0] <= exact, (device, load, length, got)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("seed", range(40))
def test_the_evidence_from_arrays_is_the_evidence_sample_by_sample(seed: int) -> None:
    """The offline analysis builds histories from arrays (vectorized evidence); every value
    the verdict rests on equals, to the last bit, what adding each sample in turn gives:
    jittered and stalled reads, duplicates, samples out of order, missing values, power that
    changes rarely or often (enough for a final verdict)."""
    rng = random.Random(seed)
    t, counter, power = 1_000_000_000, 5000.0, 300.0
    rows: list[tuple[int, float, float]] = []
    for k in range(rng.randrange(1, 3000)):
        t += rng.choice([10, 9, 12, 0, 40]) * MS if rng.random() < 0.98 else -20 * MS
        if rng.random() < (0.3 if seed % 2 else 0.05):
            power = rng.uniform(50.0, 700.0)
        if k % 10 == 0:
            counter += power * 0.1
        rows.append(
            (
                t,
                power if rng.random() > 0.05 else float("nan"),
                counter if rng.random() > 0.05 else float("nan"),
            )
        )
    one_by_one = DeviceHistory("gpu:0")
    for t_ns, watts, joules in rows:
        if watts == watts or joules == joules:
            one_by_one.add(
                t_ns, watts if watts == watts else None, joules if joules == joules else None
            )
    arrays = DeviceHistory.from_arrays(
        "gpu:0",
        np.array([r[0] for r in rows], dtype=np.int64),
        np.array([r[1] for r in rows]),
        np.array([r[2] for r in rows]),
    )
    assert _same(one_by_one._evidence.state(), arrays._evidence.state())
    assert (one_by_one._reading_sum, one_by_one._readings) == (
        arrays._reading_sum,
        arrays._readings,
    )
    assert one_by_one.power_readings == arrays.power_readings
