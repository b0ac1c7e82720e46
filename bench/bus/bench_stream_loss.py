"""Subscriber-reported loss against true loss, tail included, for a subscriber slower than the
stream.

    python bench/bus/bench_stream_loss.py [--runs 3] [--cases 400x50,3000x4]
        [--topics ",gpu/;stream/"]

Per run: a publisher process (send high-water mark 2) floods frames as fast as it can and
closes; a subscriber process (receive high-water mark 2, 2 ms per frame) reads until
the stream's FINAL frame, or until it has been silent for 3 s (then its tail is unknown, as
``zeus-async subscribe`` says). True loss = frames the publisher handed to ZeroMQ from the
subscriber's first frame on, minus the frames it received. "Lost before the last data frame"
is what a subscriber that never learns the stream's end could count (the wave-1 report); the
rest is the tail. Each case runs a subscriber of every topic (it follows the stream seq) and a
topic-filtered one (``gpu/`` and ``stream/``: it follows each topic's seq, and counts the tail of
each topic from the per-topic counts in the FINAL heartbeat); for the latter the true loss is
taken per topic. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

PUB = """
import json, sys, anyio
from zeus_async.bus import Publisher
from zeus_async.events import GpuSample
async def main(endpoint, frames, batch):
    pub = Publisher(endpoint, host="b", sndhwm=2, max_batch_events=batch, flush_interval_s=0,
                    heartbeat_s=3600)
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        print("bound", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for f in range(frames):
            pub.publish_many([GpuSample("b", f * batch + k, 0, 1.0) for k in range(batch)])
            await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    print(json.dumps({"frames_sent": pub.stats.frames_sent}), flush=True)
anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
"""

SUB = """
import json, sys, anyio
from zeus_async.bus import Subscriber
async def main(endpoint, topics):
    async with Subscriber(endpoint, topics=topics.split(","), rcvhwm=2) as sub:
        await sub.wait_ready(timeout=30)
        print("ready", flush=True)
        first = final = last_data = -1
        lost_before_last_data = 0
        per_topic = {}  # topic -> [first topic seq, frames received]
        it = sub.frames()
        while True:
            frame = None
            with anyio.move_on_after(3):  # silent for 3 s with no end: the tail is unknown
                frame = await it.__anext__()
            if frame is None:
                break
            if first < 0:
                first = frame.header.seq
            seen = per_topic.setdefault(frame.topic, [frame.header.topic_seq, 0])
            seen[1] += 1
            if frame.header.flags & 1:
                final = frame.header.seq
                break
            if frame.topic.startswith("gpu/"):
                last_data = frame.header.seq
                lost_before_last_data = sub.stats.frames_lost
            await anyio.sleep(0.002)
        (st,) = sub.stats.streams.values()
        print(json.dumps({"first": first, "final": final, "received": st.frames_received,
                          "lost": st.frames_lost, "finished": st.finished,
                          "lost_before_last_data": lost_before_last_data,
                          "per_topic": per_topic}), flush=True)
anyio.run(main, sys.argv[1], sys.argv[2])
"""


def run_once(frames: int, batch: int, topics: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/loss.sock"
        pub = subprocess.Popen(
            [sys.executable, "-c", PUB, endpoint, str(frames), str(batch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        sub = subprocess.Popen(
            [sys.executable, "-c", SUB, endpoint, topics],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert pub.stdout is not None and pub.stdin is not None and sub.stdout is not None
            assert pub.stdout.readline().strip() == "bound"
            assert sub.stdout.readline().strip() == "ready"
            pub.stdin.write("go\n")
            pub.stdin.flush()
            sent = json.loads(pub.stdout.readline())
            got = json.loads(sub.stdout.readline())
        finally:
            for p in (pub, sub):
                if p.poll() is None:
                    p.kill()
                p.communicate()
    if topics == "":
        true_lost = sent["frames_sent"] - got["first"] - got["received"]
    else:
        # Per topic, from the first frame received on it to the last the publisher sent: the
        # flood's frames on gpu/b/0, the rest (StreamInfo, FINAL) on stream/b.
        published = {"gpu/b/0": frames, "stream/b": sent["frames_sent"] - frames}
        true_lost = sum(
            published[topic] - first_tseq - received
            for topic, (first_tseq, received) in got["per_topic"].items()
        )
    return {**got, "frames_sent": sent["frames_sent"], "true_lost": true_lost}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--cases", default="400x50,3000x4", help="FRAMESxEVENTS_PER_FRAME, comma-separated"
    )
    parser.add_argument(
        "--topics",
        default=",gpu/;stream/",
        help="subscriptions to try, ';' between prefixes of one subscriber, ',' between "
        "subscribers (default: every topic, then gpu/ and stream/: topic-filtered)",
    )
    args = parser.parse_args()
    print(
        "| flood | topics | run | frames published | received | true loss | reported loss "
        "| reported as | lost before the last data frame (what was counted without an end) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    for case in args.cases.split(","):
        frames, batch = (int(x) for x in case.split("x"))
        for topics in (t.replace(";", ",") for t in args.topics.split(",")):
            for run in range(1, args.runs + 1):
                r = run_once(frames, batch, topics)
                said = "exact (end seen)" if r["finished"] else "so far; tail unknown"
                print(
                    f"| {frames} frames x {batch} events | {topics or 'all'} | {run} "
                    f"| {r['frames_sent']} "
                    f"| {r['received']} | {r['true_lost']} | {r['lost']} | {said} "
                    f"| {r['lost_before_last_data']} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
