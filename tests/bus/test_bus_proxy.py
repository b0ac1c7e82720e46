"""Two publishers -> XSUB/XPUB proxy -> subscribers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from bus_helpers import gpu

from zeus_async.bus import Publisher, Subscriber, run_proxy
from zeus_async.errors import ConfigError
from zeus_async.events import GpuSample

pytestmark = pytest.mark.anyio

TIMEOUT = 10


async def test_two_publishers_through_the_proxy(ipc_dir: str) -> None:
    a = Publisher(f"ipc://{ipc_dir}/a.sock", host="a", max_batch_events=1)
    b = Publisher(f"ipc://{ipc_dir}/b.sock", host="b", max_batch_events=1, max_pending_events=1)
    async with anyio.create_task_group() as tg:
        await tg.start(a.run)
        await tg.start(b.run)
        out = await tg.start(run_proxy, [a.endpoint, b.endpoint], "tcp://127.0.0.1:*")
        assert out.startswith("tcp://127.0.0.1:")
        async with (
            Subscriber(out, topics=[""]) as every,
            Subscriber(out, topics=["gpu/b/"]) as only_b,
        ):
            # The handshake crosses the proxy: both streams answer each subscriber.
            await every.wait_ready(streams=2, timeout=TIMEOUT)
            await only_b.wait_ready(streams=2, timeout=TIMEOUT)
            assert set(every.ready_streams) == {a.stream_id, b.stream_id}

            for i in range(5):
                a.publish(gpu(i, host="a"))
            b.publish(gpu(0, host="b"))
            seen: list[tuple[str, int, int]] = []  # (host, t_ns, seq)
            with anyio.fail_after(TIMEOUT):
                async for frame in every.frames():
                    for ev in frame.events:
                        if isinstance(ev, GpuSample):
                            seen.append((ev.host, ev.t_ns, frame.header.seq))
                    if len(seen) == 6:
                        break
            # A gap upstream: b drops 4 of 5 frames before sending (local bound of 1 event).
            b.publish_many(gpu(i, host="b") for i in range(1, 6))
            assert b.stats.frames_dropped_local == 4
            with anyio.fail_after(TIMEOUT):
                async for frame in every.frames():
                    if frame.topic == "gpu/b/0" and frame.events[0].t_ns == 5:
                        break
            with anyio.fail_after(TIMEOUT):
                got_b = [ev.t_ns async for ev in _take(only_b, 2)]
        tg.cancel_scope.cancel()

    assert sorted(t for h, t, _ in seen if h == "a") == list(range(5))
    # Sequence numbers are those the publishers assigned: the proxy forwards frames unchanged.
    a_seqs = [s for h, _, s in seen if h == "a"]
    assert a_seqs == sorted(a_seqs) and len(set(a_seqs)) == 5
    assert a.stats.frames_sent >= a_seqs[-1] + 1
    assert got_b == [0, 5]
    assert every.stats.streams[b.stream_id].frames_lost == 4
    assert every.stats.streams[a.stream_id].frames_lost == 0
    assert only_b.stats.frames_lost == 4
    assert every.stats.decode_errors == only_b.stats.decode_errors == 0


async def _take(sub: Subscriber, n: int) -> AsyncIterator[GpuSample]:
    async for ev in sub:
        if isinstance(ev, GpuSample):
            yield ev
            n -= 1
            if n == 0:
                return


async def test_proxy_is_cancellable_and_rebindable(ipc_dir: str) -> None:
    out = f"ipc://{ipc_dir}/out.sock"
    for _ in range(2):  # the second run proves the first released its sockets
        async with anyio.create_task_group() as tg:
            assert await tg.start(run_proxy, [f"ipc://{ipc_dir}/none.sock"], out) == out
            tg.cancel_scope.cancel()


async def test_proxy_policy() -> None:
    with pytest.raises(ConfigError):
        await run_proxy([], "tcp://127.0.0.1:*")
    with pytest.raises(ConfigError, match="require_curve"):
        await run_proxy(["tcp://127.0.0.1:1"], "tcp://*:*", require_curve=True)
