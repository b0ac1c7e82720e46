"""An external consumer: subscribe to a zeus_async stream over ZeroMQ and summarize it.

    python examples/subscriber.py tcp://127.0.0.1:5555          # a running publisher
    python examples/subscriber.py --spawn-monitor --seconds 3   # start one for the demo

Every second it prints each GPU's mean power over that second; at the end, how many frames
were received and how many were lost (the bus numbers every frame, so a drop cannot hide).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import defaultdict

import anyio

from zeus_async.bus import Subscriber
from zeus_async.events import GpuSample


async def summarize(endpoint: str, seconds: float) -> int:
    sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    async with Subscriber(endpoint, topics=["gpu/"]) as sub:
        await sub.wait_ready(timeout=15)
        print(f"connected to {endpoint}")
        with anyio.move_on_after(seconds):
            async with anyio.create_task_group() as tg:

                async def report() -> None:
                    while True:
                        await anyio.sleep(1.0)
                        line = "  ".join(
                            f"{host}/gpu{gpu}: {s / n:6.1f} W"
                            for (host, gpu), (s, n) in sorted(sums.items())
                            if n
                        )
                        print(line)
                        sums.clear()

                tg.start_soon(report)
                async for event in sub:
                    if isinstance(event, GpuSample) and event.power_w is not None:
                        acc = sums[(event.host, event.gpu)]
                        acc[0] += event.power_w
                        acc[1] += 1
        stats = sub.stats
    print(f"frames received {stats.frames_received}, lost {stats.frames_lost}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("endpoint", nargs="?", default="tcp://127.0.0.1:5558")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--spawn-monitor", action="store_true", help="start a publisher too")
    args = parser.parse_args()
    monitor = None
    if args.spawn_monitor:
        monitor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "zeus_async",
                "monitor",
                "--backend",
                "sim",
                "--publish",
                args.endpoint,
                "--duration",
                str(args.seconds + 10),
            ],
            stdout=subprocess.DEVNULL,
        )
    try:
        return anyio.run(summarize, args.endpoint, args.seconds, backend="asyncio")
    except TimeoutError:
        sys.stderr.write(f"no publisher answered at {args.endpoint} within 15 s\n")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if monitor is not None:
            monitor.terminate()
            monitor.wait(timeout=10)


if __name__ == "__main__":
    raise SystemExit(main())
