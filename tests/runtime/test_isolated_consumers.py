"""Isolated consumers: a failing or hung output does not stop the runtime (fake clock)."""

from __future__ import annotations

import anyio
import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices.sim_config import SimConfig
from zeus_async.errors import ConfigError
from zeus_async.events import DeviceFault, Event, GpuSample
from zeus_async.runtime import Runtime
from zeus_async.runtime.hub import EventBatches
from zeus_async.runtime.runtime import output_stall_s
from zeus_async.testing import sim_pynvml

CONFIG = SimConfig(num_gpus=1, seed=5)
S = 10**9

pytestmark = pytest.mark.anyio


async def _run(consumer: object, *, batched: bool, until_s: float) -> list[Event]:
    clock = FakeClock()
    seen: list[Event] = []
    try:
        async with Runtime(
            backend="sim", cpus=None, sim_config=CONFIG, clock=clock, period_s=0.01
        ) as rt:
            stream = rt.subscribe()

            async def collect() -> None:
                async for event in stream:
                    seen.append(event)

            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                rt.start_consumer(
                    consumer,  # type: ignore[arg-type]
                    batched=batched,
                    max_buffer=100_000,
                    isolate="out",
                    stall_s=2.0,
                )
                await clock.sleep_until(round(until_s * S))
                tg.cancel_scope.cancel()
    finally:
        sim_pynvml.uninstall()
    return seen


def _faults(events: list[Event]) -> list[DeviceFault]:
    return [e for e in events if isinstance(e, DeviceFault) and e.device == "consumer:out"]


async def test_failing_consumer_becomes_a_fault_and_sampling_goes_on() -> None:
    async def consumer(stream: object) -> None:
        raise OSError(28, "No space left on device")

    events = await _run(consumer, batched=False, until_s=1.0)
    (fault,) = _faults(events)
    assert fault.kind == "consumer_failed" and "No space left on device" in fault.message
    samples = [e for e in events if isinstance(e, GpuSample)]
    assert samples and samples[-1].t_ns - events[0].t_ns > 0.9 * S  # sampled to the end


async def test_consumer_hung_in_one_write_is_detached_before_its_buffer_fills() -> None:
    taken: list[int] = []

    async def consumer(batches: EventBatches) -> None:
        async for batch in batches:
            taken.append(len(batch))
            await anyio.sleep_forever()  # one write that never returns

    events = await _run(consumer, batched=True, until_s=6.0)
    (fault,) = _faults(events)
    assert fault.kind == "consumer_stalled"
    assert "has not taken an event for 2 s" in fault.message
    assert len(taken) == 1  # the buffer (100,000) never filled: progress is what is watched
    # Detached within stall_s plus one watchdog step of its first wait.
    first = next(e for e in events if isinstance(e, GpuSample))
    assert fault.t_ns - first.t_ns <= 3.0 * S
    assert any(isinstance(e, GpuSample) and e.t_ns > fault.t_ns + 2 * S for e in events)


async def test_slow_but_moving_consumer_is_not_detached() -> None:
    clock_waits: list[int] = []

    async def consumer(batches: EventBatches) -> None:
        async for batch in batches:
            clock_waits.append(len(batch))
            await anyio.sleep(0)  # takes every batch, however slowly

    events = await _run(consumer, batched=True, until_s=6.0)
    assert _faults(events) == []
    assert sum(clock_waits) > 0


def test_stall_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZEUS_ASYNC_STALL_S", raising=False)
    assert output_stall_s() == 10.0
    monkeypatch.setenv("ZEUS_ASYNC_STALL_S", "0.5")
    assert output_stall_s() == 0.5
    for bad in ("0", "-1", "inf", "nan", "soon"):
        monkeypatch.setenv("ZEUS_ASYNC_STALL_S", bad)
        with pytest.raises(ConfigError, match="ZEUS_ASYNC_STALL_S"):
            output_stall_s()
