"""Publisher -> Subscriber in one process (both anyio backends), over ipc and tcp loopback."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest
import zmq
from bus_helpers import gpu

from zeus_async.bus import FrameEncoder, Publisher, Subscriber
from zeus_async.bus._endpoints import is_local_endpoint
from zeus_async.bus.codec import Frame
from zeus_async.errors import ConfigError
from zeus_async.events import Event, GpuSample, Heartbeat, StreamInfo

pytestmark = pytest.mark.anyio

TIMEOUT = 10


@asynccontextmanager
async def running(pub: Publisher) -> AsyncIterator[Publisher]:
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        yield pub
        tg.cancel_scope.cancel()


async def take(sub: Subscriber, n: int) -> list[Event]:
    out: list[Event] = []
    with anyio.fail_after(TIMEOUT):
        async for event in sub:
            out.append(event)
            if len(out) == n:
                break
    return out


async def take_gpu(sub: Subscriber, n: int) -> list[GpuSample]:
    """The next ``n`` GPU samples (skipping StreamInfo/Heartbeat of an all-topics subscriber)."""
    out: list[GpuSample] = []
    with anyio.fail_after(TIMEOUT):
        async for event in sub:
            if isinstance(event, GpuSample):
                out.append(event)
                if len(out) == n:
                    break
    return out


async def take_frames(sub: Subscriber, n: int) -> list[Frame]:
    out: list[Frame] = []
    with anyio.fail_after(TIMEOUT):
        async for frame in sub.frames():
            out.append(frame)
            if len(out) == n:
                break
    return out


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_all_events_arrive_after_handshake(transport: str, ipc_endpoint: str) -> None:
    endpoint = ipc_endpoint if transport == "ipc" else "tcp://127.0.0.1:*"
    async with running(Publisher(endpoint, host="n1")) as pub:
        if transport == "tcp":
            assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        async with Subscriber(pub.endpoint, topics=["gpu/"]) as sub:
            await sub.wait_ready(timeout=TIMEOUT)
            assert list(sub.ready_streams) == [pub.stream_id]
            # Published right after the handshake: no slow-joiner loss.
            pub.publish_many(gpu(i, index=i % 4) for i in range(1000))
            events = await take(sub, 1000)
    assert sorted(e.t_ns for e in events) == list(range(1000))
    for index in range(4):  # per topic, order is preserved
        ts = [e.t_ns for e in events if isinstance(e, GpuSample) and e.gpu == index]
        assert ts == sorted(ts)
    assert sub.stats.frames_lost == 0
    assert sub.stats.decode_errors == 0
    assert pub.stats.events_sent >= 1000


async def test_random_port_zero_is_resolved() -> None:
    async with running(Publisher("tcp://127.0.0.1:0", host="n1")) as pub:
        port = int(pub.endpoint.rsplit(":", 1)[1])
        assert port > 0


async def test_topic_filtering_without_false_gaps(ipc_endpoint: str) -> None:
    async with (
        running(Publisher(ipc_endpoint, host="n1", max_batch_events=1)) as pub,
        Subscriber(pub.endpoint, topics=["gpu/n1/1"]) as one,
        Subscriber(pub.endpoint, topics=[""]) as every,
    ):
        await one.wait_ready(timeout=TIMEOUT)
        await every.wait_ready(timeout=TIMEOUT)
        pub.publish_many(gpu(i, index=i % 3) for i in range(30))  # one frame per event
        got_one = await take(one, 10)
        got_all = await take_gpu(every, 30)
    assert [e.t_ns for e in got_one] == list(range(1, 30, 3))
    assert {e.gpu for e in got_one if isinstance(e, GpuSample)} == {1}
    assert len(got_all) == 30
    # The filtered subscriber saw holes in the stream sequence (other topics), not losses.
    assert one.stats.frames_lost == 0
    assert every.stats.frames_lost == 0


async def test_real_gaps_are_counted_exactly_filtered_or_not(ipc_endpoint: str) -> None:
    pub = Publisher(ipc_endpoint, host="n1", max_batch_events=1, max_pending_events=1)
    async with (
        running(pub),
        Subscriber(pub.endpoint, topics=["gpu/n1/1"]) as one,
        Subscriber(pub.endpoint, topics=[""]) as every,
    ):
        await one.wait_ready(timeout=TIMEOUT)
        await every.wait_ready(timeout=TIMEOUT)
        pub.publish(gpu(0, index=1))
        await take(one, 1)
        await take_gpu(every, 1)
        # Ten full batches before the socket task can run: the bound keeps only the newest.
        pub.publish_many(gpu(i, index=1) for i in range(1, 11))
        assert pub.stats.frames_dropped_local == 9
        assert [e.t_ns for e in await take(one, 1)] == [10]
        assert [e.t_ns for e in await take_gpu(every, 1)] == [10]
    assert one.stats.frames_lost == 9
    assert every.stats.frames_lost == 9
    st = one.stats.streams[pub.stream_id]
    assert st.frames_lost == 9 and st.host == "n1"


async def test_late_subscriber_also_completes_the_handshake(ipc_endpoint: str) -> None:
    async with (
        running(Publisher(ipc_endpoint, host="n1")) as pub,
        Subscriber(pub.endpoint) as first,
    ):
        await first.wait_ready(timeout=TIMEOUT)
        async with Subscriber(pub.endpoint, topics=["gpu/"]) as second:
            await second.wait_ready(timeout=TIMEOUT)
            pub.publish(gpu(1))
            assert await take(second, 1) == [gpu(1)]
        assert pub.stats.stream_infos_sent >= 2
        assert pub.stats.subscriptions >= 3


async def test_heartbeats_carry_the_stream_counters(ipc_endpoint: str) -> None:
    async with (
        running(Publisher(ipc_endpoint, host="n1", heartbeat_s=0.02)) as pub,
        Subscriber(pub.endpoint, topics=["stream/"]) as sub,
    ):
        await sub.wait_ready(timeout=TIMEOUT)
        pub.publish_many(gpu(i) for i in range(5))
        with anyio.fail_after(TIMEOUT):
            async for frame in sub.frames():
                beat = frame.events[0]
                if isinstance(beat, Heartbeat) and beat.events_published >= 7:
                    break
    assert beat.stream_id == pub.stream_id
    assert beat.host == "n1"
    assert beat.frames_published == frame.header.seq
    assert pub.stats.heartbeats_sent >= 1
    assert sub.stats.streams[pub.stream_id].last_heartbeat is not None


async def test_shutdown_flushes_pending_and_sends_a_final_heartbeat(ipc_endpoint: str) -> None:
    pub = Publisher(ipc_endpoint, host="n1", flush_interval_s=60)
    async with Subscriber(ipc_endpoint) as sub:
        async with running(pub):
            await sub.wait_ready(timeout=TIMEOUT)
            assert isinstance((await take_frames(sub, 1))[0].events[0], StreamInfo)
            pub.publish(gpu(0))  # the topic was quiet: goes out at once
            assert [f.events for f in await take_frames(sub, 1)] == [[gpu(0)]]
            pub.publish_many(gpu(i) for i in range(1, 5))  # waits for the 60 s timer...
        # ...or for the shutdown, which flushes it.
        frames = await take_frames(sub, 2)
    assert frames[0].events == [gpu(i) for i in range(1, 5)]
    final = frames[1]
    assert final.header.final
    assert isinstance(final.events[0], Heartbeat)
    assert final.events[0].events_published == 6  # StreamInfo + 5 samples
    assert final.events[0].frames_published == final.header.seq == 3
    assert sub.stats.streams[pub.stream_id].finished
    pub.publish(gpu(9))  # after shutdown: dropped and counted, never raised
    assert pub.stats.events_dropped_local == 1


async def test_batches_by_size_and_by_timer(ipc_endpoint: str) -> None:
    pub = Publisher(ipc_endpoint, host="n1", max_batch_events=10, flush_interval_s=0.05)
    async with running(pub), Subscriber(pub.endpoint, topics=["gpu/"]) as sub:
        await sub.wait_ready(timeout=TIMEOUT)
        pub.publish(gpu(0))
        assert [len(f.events) for f in await take_frames(sub, 1)] == [1]
        pub.publish_many(gpu(i) for i in range(1, 26))
        frames = await take_frames(sub, 3)
        assert [len(f.events) for f in frames] == [10, 10, 5]
        assert [f.header.topic_seq for f in frames] == [1, 2, 3]


async def test_flush_interval_zero_sends_at_the_next_loop_turn(ipc_endpoint: str) -> None:
    async with (
        running(Publisher(ipc_endpoint, host="n1", flush_interval_s=0)) as pub,
        Subscriber(pub.endpoint, topics=["gpu/"]) as sub,
    ):
        await sub.wait_ready(timeout=TIMEOUT)
        for i in range(3):
            pub.publish(gpu(i))
            assert [len(f.events) for f in await take_frames(sub, 1)] == [1]


async def test_update_stream_info_is_sent(ipc_endpoint: str) -> None:
    async with (
        running(Publisher(ipc_endpoint, host="n1")) as pub,
        Subscriber(pub.endpoint, topics=["stream/"]) as sub,
    ):
        await sub.wait_ready(timeout=TIMEOUT)
        info = msgspec.structs.replace(pub.stream_info, pid=4242, stream_id="ignored")
        pub.update_stream_info(info)
        with anyio.fail_after(TIMEOUT):
            async for event in sub:
                if isinstance(event, StreamInfo) and event.pid == 4242:
                    break
    assert event.stream_id == pub.stream_id
    assert sub.ready_streams[pub.stream_id].pid == 4242


async def test_malformed_frames_are_counted_and_skipped(ipc_endpoint: str) -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.XPUB)
    raw.bind(ipc_endpoint)
    enc = FrameEncoder("12345678-1234-4234-8234-123456789abc")
    try:
        async with Subscriber(ipc_endpoint, topics=["gpu/"]) as sub:
            with anyio.fail_after(TIMEOUT):  # the subscription has arrived: no slow joiner
                while not raw.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    await anyio.wait_readable(raw.getsockopt(zmq.FD))
            raw.recv()
            good = enc.encode("gpu/n1/0", [gpu(1)])
            raw.send_multipart([b"gpu/n1/0", b"junk", b"junk"])
            raw.send_multipart([b"gpu/n1/0", good[1]])
            raw.send_multipart([b"gpu/n1/0", good[1][:40] + b"x" * 12, good[2]])
            raw.send_multipart([b"gpu/n1/0", enc.encode("gpu/n1/0", [gpu(2)])[1], b"\xc1"])
            unknown = msgspec.msgpack.encode([["new_kind", 1], *msgspec.msgpack.decode(good[2])])
            hdr = enc.encode("gpu/n1/0", [gpu(1), gpu(1)])[1]
            raw.send_multipart([b"gpu/n1/0", hdr, unknown])
            # A forged header whose sequence numbers jump by 2**63: not 9.2e18 lost frames.
            forged = bytearray(hdr)
            forged[24:40] = (2**63).to_bytes(8, "big") * 2
            raw.send_multipart([b"gpu/n1/0", bytes(forged), good[2]])
            raw.send_multipart(enc.encode("gpu/n1/0", [gpu(3)]))
            events = await take(sub, 2)
    finally:
        raw.close(0)
        ctx.term()
    assert events == [gpu(1), gpu(3)]
    assert sub.stats.decode_errors == 5
    assert sub.stats.unknown_events == 1
    assert sub.stats.frames_lost == 0


async def test_wait_ready_times_out_without_publisher(ipc_endpoint: str) -> None:
    async with Subscriber(ipc_endpoint) as sub:
        with pytest.raises(TimeoutError):
            await sub.wait_ready(timeout=0.05)


async def test_close_from_another_task_ends_iteration(ipc_endpoint: str) -> None:
    seen: list[Any] = []
    async with running(Publisher(ipc_endpoint, host="n1")):
        sub = Subscriber(ipc_endpoint, topics=["gpu/"])
        async with sub, anyio.create_task_group() as tg:
            await sub.wait_ready(timeout=TIMEOUT)

            async def consume() -> None:
                async for event in sub:
                    seen.append(event)
                seen.append("end")

            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            sub.close()
    assert seen == ["end"]
    with pytest.raises(anyio.ClosedResourceError):
        await sub.receive_frame()


# ---------------------------------------------------------------- configuration and policy


def test_local_endpoint_detection() -> None:
    assert is_local_endpoint("ipc:///tmp/x.sock")
    assert is_local_endpoint("inproc://x")
    assert is_local_endpoint("tcp://127.0.0.1:5555")
    assert is_local_endpoint("tcp://127.0.0.2:*")
    assert is_local_endpoint("tcp://[::1]:5555")
    assert is_local_endpoint("tcp://localhost:5555")
    assert is_local_endpoint("tcp://lo:5555")
    assert not is_local_endpoint("tcp://*:5555")
    assert not is_local_endpoint("tcp://0.0.0.0:5555")
    assert not is_local_endpoint("tcp://10.0.0.1:5555")
    assert not is_local_endpoint("tcp://eth0:5555")
    assert not is_local_endpoint("epgm://eth0;239.192.1.1:5555")
    with pytest.raises(ConfigError):
        is_local_endpoint("no-transport")


async def test_non_local_bind_warns_or_fails(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zeus_async.bus"):
        async with running(Publisher("tcp://0.0.0.0:*", host="n1")):
            pass
    assert any("without CURVE" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="require_curve"):
        await Publisher("tcp://*:*", host="n1", require_curve=True).run()
    # No warning for what is not a network transport (it fails to bind, and says so).
    from zeus_async.bus._endpoints import check_bind_endpoint

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zeus_async.bus"):
        check_bind_endpoint("foo://x", curve=False, require_curve=False, what="t")
    assert not caplog.records
    with pytest.raises(ConfigError, match="require_curve"):  # unknown: refused, to be safe
        check_bind_endpoint("foo://x", curve=False, require_curve=True, what="t")
    with pytest.raises(ConfigError, match="transport://address"):
        check_bind_endpoint("bogus", curve=False, require_curve=False, what="t")


async def test_bind_errors_are_config_errors(ipc_endpoint: str) -> None:
    async with running(Publisher(ipc_endpoint, host="n1")) as pub:
        with pytest.raises(ConfigError, match="in use"):
            await Publisher(ipc_endpoint, host="n2").run()
        with pytest.raises(ConfigError, match="only be called once"):
            await pub.run()
    with pytest.raises(ConfigError, match="tcp port must be"):
        Publisher("tcp://127.0.0.1:notaport", host="n1")  # refused before binding
    with pytest.raises(ConfigError, match="cannot bind"):
        await Publisher("tcp://192.0.2.1:5555", host="n1").run()  # not an address of this host


@pytest.mark.parametrize(
    "kwargs",
    [
        {"host": ""},
        {"host": "a/b"},
        {"host": "n", "max_batch_events": 0},
        {"host": "n", "flush_interval_s": -1},
        {"host": "n", "heartbeat_s": 0},
        {"host": "n", "stream_id": "not-a-uuid"},
        {"host": "n", "max_batch_events": 10, "max_pending_events": 5},
    ],
)
def test_publisher_rejects_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Publisher("ipc:///tmp/never.sock", **kwargs)


@pytest.mark.parametrize(
    ("endpoints", "kwargs"),
    [
        ([], {}),
        (["nope"], {}),
        (["ipc:///tmp/x"], {"topics": []}),
        (["ipc:///x"], {"topics": "gpu/"}),
    ],
)
def test_subscriber_rejects_bad_settings(endpoints: list[str], kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Subscriber(endpoints, **kwargs)


def test_stream_id_and_info_defaults() -> None:
    sid = "12345678-1234-4234-8234-123456789abc"
    pub = Publisher("ipc:///tmp/never.sock", host="n1", stream_id=sid)
    assert pub.stream_id == sid
    assert pub.stream_info.stream_id == sid
    assert pub.stream_info.host == "n1"
    assert pub.stream_topic == "stream/n1"


async def test_shared_context_and_inproc_even_an_asyncio_context() -> None:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()  # its sockets would be async; the bus makes plain ones
    try:
        pub = Publisher("inproc://bus-test", host="n1", context=ctx)
        async with (
            running(pub),
            Subscriber("inproc://bus-test", topics=["gpu/"], context=ctx) as sub,
        ):
            await sub.wait_ready(timeout=TIMEOUT)
            pub.publish(gpu(7))
            assert await take(sub, 1) == [gpu(7)]
    finally:
        ctx.term()


async def test_frames_nobody_subscribed_to_are_sequenced_but_not_sent(ipc_endpoint: str) -> None:
    pub = Publisher(ipc_endpoint, host="n1", max_batch_events=1)
    async with running(pub):
        # No subscriber: every frame is sequenced and skipped (nothing encoded or sent).
        pub.publish_many(gpu(i, index=i % 2) for i in range(10))
        with anyio.fail_after(TIMEOUT):
            while pub.stats.frames_unsubscribed < 10:
                await anyio.sleep(0.001)
        assert pub.stats.frames_sent == 0 and pub.stats.events_unsubscribed == 10
        async with Subscriber(pub.endpoint, topics=["gpu/n1/1"]) as one:
            await one.wait_ready(timeout=TIMEOUT)
            sent_before = pub.stats.frames_sent  # the StreamInfo of the handshake
            skipped_before = pub.stats.frames_unsubscribed
            pub.publish_many(gpu(i, index=i % 2) for i in range(10, 20))
            got = await take(one, 5)
            # Only GPU 1's topic is sent; GPU 0's frames are still skipped.
            assert [e.t_ns for e in got] == [11, 13, 15, 17, 19]
            assert pub.stats.frames_sent - sent_before == 5
            assert pub.stats.frames_unsubscribed - skipped_before == 5
        # The topic seq went on through the skipped frames: 6th frame of GPU 1's topic first,
        # and the subscriber counts no loss from the frames sent before it came.
        assert one.stats.frames_lost == 0
        async with Subscriber(pub.endpoint, topics=["gpu/"]) as every:
            await every.wait_ready(timeout=TIMEOUT)
            frames_before = pub.stats.frames_sent
            pub.publish_many(gpu(i, index=i % 2) for i in range(20, 24))
            got_frames = await take_frames(every, 4)
        assert [f.events[0].t_ns for f in got_frames] == [20, 21, 22, 23]
        assert [f.header.topic_seq for f in got_frames] == [10, 10, 11, 11]
        assert pub.stats.frames_sent - frames_before == 4
        assert every.stats.frames_lost == 0
        # Both subscribers gone: ZeroMQ reports their prefixes unsubscribed, and frames are
        # skipped again.
        with anyio.fail_after(TIMEOUT):
            while pub.stats.unsubscriptions < 2:
                await anyio.sleep(0.005)
        skipped_before = pub.stats.frames_unsubscribed
        pub.publish_many(gpu(i, index=i % 2) for i in range(24, 28))
        with anyio.fail_after(TIMEOUT):
            while pub.stats.frames_unsubscribed < skipped_before + 4:
                await anyio.sleep(0.001)
