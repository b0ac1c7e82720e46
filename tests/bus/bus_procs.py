"""Publisher and subscriber processes for the multi-process bus tests.

``python bus_procs.py pub ENDPOINT FLOOD_FRAMES BATCH``
    Binds, prints ``bound``; on the stdin line ``go`` publishes FLOOD_FRAMES frames of BATCH
    events as fast as it can (event ``i`` has ``t_ns == i``), then one trailer event every 20 ms
    until the stdin line ``stop``; prints its stats as JSON and exits.

``python bus_procs.py sub ENDPOINT TOPIC FLOOD_FRAMES BATCH``
    A deliberately slow subscriber (RCVHWM 2, 2 ms per frame): prints ``ready`` after the
    handshake, reads until the first trailer, prints what it received and what it counted as
    lost as JSON.
"""

from __future__ import annotations

import functools
import json
import sys

import anyio

from zeus_async.bus import Publisher, Subscriber, run_proxy
from zeus_async.events import GpuSample, Heartbeat


def _event(i: int) -> GpuSample:
    return GpuSample(host="mp", t_ns=i, gpu=0, power_w=float(i))


async def publisher(endpoint: str, flood_frames: int, batch: int) -> None:
    pub = Publisher(
        endpoint,
        host="mp",
        sndhwm=2,
        max_batch_events=batch,
        flush_interval_s=0,
        heartbeat_s=3600,
    )
    stop = anyio.Event()

    async def read_stdin() -> None:
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if line.strip() in ("stop", ""):
                stop.set()
                return

    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        print("bound", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)  # "go"
        tg.start_soon(read_stdin)
        for f in range(flood_frames):
            pub.publish_many([_event(f * batch + k) for k in range(batch)])
            await anyio.lowlevel.checkpoint()  # the socket task sends the full batch
        i = flood_frames * batch
        while not stop.is_set():
            pub.publish(_event(i))
            i += 1
            with anyio.move_on_after(0.02):
                await stop.wait()
        tg.cancel_scope.cancel()
    s = pub.stats
    print(
        json.dumps(
            {
                "frames_sent": s.frames_sent,
                "events_sent": s.events_sent,
                "frames_dropped_local": s.frames_dropped_local,
                "trailers": i - flood_frames * batch,
            }
        ),
        flush=True,
    )


async def subscriber(endpoint: str, topic: str, flood_frames: int, batch: int) -> None:
    flood_events = flood_frames * batch
    async with Subscriber(endpoint, topics=[topic], rcvhwm=2) as sub:
        await sub.wait_ready(timeout=30)
        print("ready", flush=True)
        flood_frames_got = trailer_frames = data_events = 0
        last = -1
        async for frame in sub.frames():
            samples = [e for e in frame.events if isinstance(e, GpuSample)]
            if not samples:
                continue
            if samples[0].t_ns < flood_events:
                flood_frames_got += 1
            else:
                trailer_frames += 1
            data_events += len(samples)
            last = samples[-1].t_ns
            if last >= flood_events:
                break  # the first trailer
            await anyio.sleep(0.002)  # slow consumer: ZeroMQ must drop
        print(
            json.dumps(
                {
                    "flood_frames": flood_frames_got,
                    "trailer_frames": trailer_frames,
                    "data_events": data_events,
                    "last_index": last,
                    "frames_received": sub.stats.frames_received,
                    "frames_lost": sub.stats.frames_lost,
                    "decode_errors": sub.stats.decode_errors,
                }
            ),
            flush=True,
        )


async def publisher_that_ends(endpoint: str, flood_frames: int, batch: int) -> None:
    """Floods, then closes at once: whatever the subscriber lost last is lost at the tail."""
    pub = Publisher(
        endpoint, host="mp", sndhwm=2, max_batch_events=batch, flush_interval_s=0, heartbeat_s=3600
    )
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        print("bound", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)  # "go"
        for f in range(flood_frames):
            pub.publish_many([_event(f * batch + k) for k in range(batch)])
            await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()  # close: pending frames flushed, then the FINAL frame
    s = pub.stats
    print(json.dumps({"frames_sent": s.frames_sent}), flush=True)


async def subscriber_to_the_end(endpoint: str, topics: list[str]) -> None:
    """Slow; reads until the stream's end (or 20 s), then says what it counted."""
    async with Subscriber(endpoint, topics=topics, rcvhwm=2) as sub:
        await sub.wait_ready(timeout=30)
        print("ready", flush=True)
        first_seq = final_seq = first_gpu_tseq = -1
        gpu_frames = 0
        topic_frames: dict[str, int] | None = None
        with anyio.move_on_after(20):
            async for frame in sub.frames():
                if first_seq < 0:
                    first_seq = frame.header.seq
                if frame.topic.startswith("gpu/"):
                    gpu_frames += 1
                    if first_gpu_tseq < 0:
                        first_gpu_tseq = frame.header.topic_seq
                if frame.header.flags & 1:
                    final_seq = frame.header.seq
                    (final,) = frame.events
                    assert isinstance(final, Heartbeat)
                    topic_frames = final.topic_frames
                    break
                await anyio.sleep(0.002)
        (st,) = sub.stats.streams.values()
        print(
            json.dumps(
                {
                    "first_seq": first_seq,
                    "final_seq": final_seq,
                    "first_gpu_topic_seq": first_gpu_tseq,
                    "gpu_frames": gpu_frames,
                    "topic_frames": topic_frames,
                    "finished": st.finished,
                    "frames_received": st.frames_received,
                    "frames_lost": st.frames_lost,
                    "out_of_order": st.out_of_order,
                }
            ),
            flush=True,
        )


async def proxy(upstream: str, downstream: str, hwm: int) -> None:
    """A proxy whose queues hold ``hwm`` frames (a slow subscriber behind it loses frames at
    the proxy, as it would at a publisher); runs until killed."""
    async with anyio.create_task_group() as tg:
        await tg.start(functools.partial(run_proxy, [upstream], downstream, hwm=hwm))
        print("bound", flush=True)


def main() -> None:
    role, endpoint, *rest = sys.argv[1:]
    if role == "pub":
        anyio.run(publisher, endpoint, int(rest[0]), int(rest[1]))
    elif role == "pub-end":
        anyio.run(publisher_that_ends, endpoint, int(rest[0]), int(rest[1]))
    elif role == "proxy":
        anyio.run(proxy, endpoint, rest[0], int(rest[1]))
    elif role == "sub-end":
        anyio.run(subscriber_to_the_end, endpoint, rest[0].split(",") if rest else [""])
    else:
        anyio.run(subscriber, endpoint, rest[0], int(rest[1]), int(rest[2]))


if __name__ == "__main__":
    main()
