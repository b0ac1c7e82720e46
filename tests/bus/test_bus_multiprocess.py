"""Publisher and subscriber in two real processes, with a subscriber too slow to keep up.

ZeroMQ drops frames at the high-water marks (SNDHWM 2, RCVHWM 2). Ground truth comes from the
events' content (event ``i`` has ``t_ns == i``), independent of the sequence numbers: when the
subscriber stops at the first trailer it received (index ``N + k``), the publisher had published
exactly ``D + k + 1`` data frames up to it, and the subscriber must report
``frames_lost == D + k + 1 - data frames received``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("bus_procs.py")
FLOOD_FRAMES = 400
BATCH = 50
TIMEOUT = 30


class Proc:
    """A child process whose stdout lines are read by a thread (readline with a timeout)."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.strip())
        self.lines.put("<eof>")

    def readline(self) -> str:
        try:
            return self.lines.get(timeout=TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"no output from {self.p.args} within {TIMEOUT} s") from None

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def json(self) -> dict[str, Any]:
        line = self.readline()
        try:
            result: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"expected JSON, got {line!r}") from None
        return result

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(TIMEOUT)


@pytest.mark.parametrize("topic", ["", "gpu/"], ids=["all-topics", "topic-filtered"])
def test_slow_subscriber_reports_exactly_what_was_lost(topic: str, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/mp.sock"
    if len(endpoint) > 100:  # sun_path limit
        endpoint = f"ipc:///tmp/zb-mp-{os.getpid()}-{topic.strip('/') or 'all'}.sock"
    pub = Proc("pub", endpoint, str(FLOOD_FRAMES), str(BATCH))
    sub = None
    try:
        assert pub.readline() == "bound"
        sub = Proc("sub", endpoint, topic, str(FLOOD_FRAMES), str(BATCH))
        assert sub.readline() == "ready"  # handshake done: the flood cannot be lost to it
        pub.send("go")
        got = sub.json()
        pub.send("stop")
        sent = pub.json()
    finally:
        pub.close()
        if sub is not None:
            sub.close()

    flood_events = FLOOD_FRAMES * BATCH
    k = got["last_index"] - flood_events  # the subscriber stopped at trailer k
    assert k >= 0
    published = FLOOD_FRAMES + k + 1  # data frames published up to and including trailer k
    assert got["decode_errors"] == 0
    assert got["frames_lost"] > 0, "the slow subscriber should have lost frames"
    received = got["flood_frames"] + got["trailer_frames"]
    assert got["frames_lost"] == published - received
    assert got["frames_lost"] == (FLOOD_FRAMES - got["flood_frames"]) + (
        k + 1 - got["trailer_frames"]
    )
    assert got["data_events"] == got["flood_frames"] * BATCH + got["trailer_frames"]
    # The publisher handed every frame to ZeroMQ: all drops happened in transit.
    assert sent["frames_dropped_local"] == 0
    assert sent["trailers"] >= k + 1
    assert sent["events_sent"] >= flood_events + k + 1


def _flood_to_the_end(
    published: str, subscribed: str, *topics: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``pub-end`` publisher on ``published`` floods and closes; a slow ``sub-end``
    subscriber (``topics``) on ``subscribed`` reads to the end: what each said."""
    pub = Proc("pub-end", published, str(FLOOD_FRAMES), str(BATCH))
    sub = None
    try:
        assert pub.readline() == "bound"
        sub = Proc("sub-end", subscribed, *topics)
        assert sub.readline() == "ready"
        pub.send("go")
        return pub.json(), sub.json()
    finally:
        pub.close()
        if sub is not None:
            sub.close()


@pytest.mark.parametrize("topics", ["", "gpu/,stream/"], ids=["all-topics", "topic-filtered"])
def test_loss_at_the_tail_is_counted(topics: str, tmp_path: Path) -> None:
    # The publisher floods a slow subscriber and closes: frames lost after the last one the
    # subscriber got are counted from the FINAL frame, which the publisher repeats so that it
    # reaches a subscriber whose queue was full when the stream ended. A topic-filtered
    # subscriber counts them from the per-topic counts the FINAL heartbeat carries.
    endpoint = f"ipc://{tmp_path}/end.sock"
    if len(endpoint) > 100:
        endpoint = f"ipc:///tmp/zb-end-{os.getpid()}.sock"
    sent, got = _flood_to_the_end(endpoint, endpoint, topics)
    assert got["finished"], got
    assert got["final_seq"] == sent["frames_sent"] - 1  # the FINAL is the stream's last frame
    assert got["frames_lost"] > 0, "the slow subscriber should have lost frames"
    assert got["topic_frames"]["gpu/mp/0"] == FLOOD_FRAMES
    if topics == "":
        # Exact, tail included: every frame from the first one received to the FINAL is
        # either received or counted lost; the FINAL's copies are neither.
        span = got["final_seq"] - got["first_seq"] + 1
        assert got["frames_received"] + got["frames_lost"] == span
    else:
        # Per topic: every GPU frame from the first received to the last published is
        # received or counted lost (no heartbeat was published besides the FINAL, and the
        # StreamInfo and the FINAL were received: the stream topic lost nothing).
        gpu_span = FLOOD_FRAMES - got["first_gpu_topic_seq"]
        assert got["gpu_frames"] + got["frames_lost"] == gpu_span
    assert got["out_of_order"] == 0


def test_loss_at_the_tail_is_counted_through_a_proxy(tmp_path: Path) -> None:
    # The same, with a proxy between them: the FINAL and its copies pass through the proxy
    # like any frame, and the subscriber's count stays exact.
    upstream, downstream = f"ipc://{tmp_path}/up.sock", f"ipc://{tmp_path}/down.sock"
    if len(downstream) > 100:
        upstream = f"ipc:///tmp/zb-up-{os.getpid()}.sock"
        downstream = f"ipc:///tmp/zb-down-{os.getpid()}.sock"
    proxy = Proc("proxy", upstream, downstream, "2")  # the proxy's queues hold 2 frames too
    try:
        assert proxy.readline() == "bound"
        sent, got = _flood_to_the_end(upstream, downstream)  # the handshake goes through it
    finally:
        proxy.close()
    assert got["finished"], got
    assert got["final_seq"] == sent["frames_sent"] - 1
    assert got["frames_lost"] > 0, "the slow subscriber should have lost frames"
    span = got["final_seq"] - got["first_seq"] + 1
    assert got["frames_received"] + got["frames_lost"] == span
    assert got["out_of_order"] == 0
