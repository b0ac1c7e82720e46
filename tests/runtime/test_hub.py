"""The hub's batched consumers: order, back-pressure, end of stream, unsubscribe."""

from __future__ import annotations

import anyio
import pytest

from zeus_async.events import Event, Heartbeat
from zeus_async.runtime.hub import EventBatches, Hub

pytestmark = pytest.mark.anyio


def beat(i: int) -> Event:
    return Heartbeat(host="h", t_ns=i, stream_id="s")


async def test_batches_keep_order_and_end_after_the_last_event() -> None:
    hub = Hub()
    batches = hub.subscribe_batches(max_buffer=8)
    plain = hub.subscribe(max_buffer=1000)
    got: list[Event] = []
    sizes: list[int] = []

    async def consume() -> None:
        async for batch in batches:
            assert batch
            sizes.append(len(batch))
            got.extend(batch)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for i in range(100):
            await hub.publish(beat(i))
        hub.close()
    assert [e.t_ns for e in got] == list(range(100))
    assert max(sizes) <= 8 and len(sizes) < 100  # batched, and bounded by max_buffer
    rest = [e async for e in plain]
    assert [e.t_ns for e in rest] == list(range(100))


async def test_a_full_buffer_holds_the_publisher_back() -> None:
    hub = Hub()
    batches = hub.subscribe_batches(max_buffer=3)
    for i in range(3):
        assert hub.try_publish(beat(i)) == -1
    index = hub.try_publish(beat(3))
    assert index == 0  # full: the caller must wait
    done = anyio.Event()

    async def finish() -> None:
        await hub.resume(beat(3), index)
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(finish)
        await anyio.wait_all_tasks_blocked()
        assert not done.is_set()
        assert [e.t_ns for e in batches.take_nowait()] == [0, 1, 2]
        await done.wait()
    assert [e.t_ns for e in await batches.receive_batch()] == [3]


async def test_unsubscribing_releases_a_waiting_publisher() -> None:
    hub = Hub()
    batches = hub.subscribe_batches(max_buffer=1)
    await hub.publish(beat(0))
    async with anyio.create_task_group() as tg:
        tg.start_soon(hub.publish, beat(1))
        await anyio.wait_all_tasks_blocked()
        await batches.aclose()
    assert hub.consumer_count == 0
    with pytest.raises(anyio.ClosedResourceError):
        await batches.receive_batch()


async def test_end_of_stream_and_bad_size() -> None:
    batches = EventBatches(4)
    batches.close()
    with pytest.raises(anyio.EndOfStream):
        await batches.receive_batch()
    with pytest.raises(ValueError):
        EventBatches(0)
    hub = Hub()
    hub.close()
    with pytest.raises(RuntimeError):
        hub.subscribe_batches()


async def test_many_deliveries_waiting_on_a_stream_that_closes_all_go_on() -> None:
    # A burst left several deliveries waiting on one full consumer; it then went away: the
    # first to see it closed takes it out, the others deliver to the consumers after it
    # (each raised "list.remove(x): x not in list" before).
    hub = Hub()
    full = hub.subscribe(max_buffer=1)
    after = hub.subscribe(max_buffer=100)
    assert hub.try_publish(beat(0)) == -1
    indexes = [hub.try_publish(beat(i)) for i in range(1, 6)]
    assert indexes == [0] * 5  # every one waits on the full stream
    async with anyio.create_task_group() as tg:
        for i, index in enumerate(indexes, 1):
            tg.start_soon(hub.resume, beat(i), index)
        await anyio.wait_all_tasks_blocked()
        full.close()
    assert hub.consumer_count == 1
    got = [after.receive_nowait().t_ns for _ in range(6)]
    assert sorted(got) == list(range(6))
