"""Time to first byte of streamed (SSE) responses behind the energy middleware.

A uvicorn server streams OpenAI-style chunks (a 20 ms prefill, then 20 tokens 10 ms apart,
then ``data: [DONE]``) to ``--clients`` concurrent raw-socket clients, behind:

* ``none``: no middleware (the floor);
* ``sse``: ``EnergyMiddleware(..., energy_header=True)`` as it is now: the stream passes
  through, the energy comes in an ``event: energy`` before ``[DONE]``;
* ``old``: the middleware of commit 279b6d9 with ``energy_header=True``, which held the whole
  stream until the request's energy was attributed (read with ``git show``; left out when
  there is no git history).

Each row: time to the first ``data:`` chunk (p50, p99), time to the end (p50), energy events
received and how many said ``pending``. A meter fed with 300 W readings every 5 ms settles
in its own thread.

Run: ``.venv/bin/python bench/inference/bench_sse_delivery.py [--clients 200] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OLD_REV = "279b6d9"


def serve(port: int, which: str) -> None:
    """The server (run in a child process)."""
    import anyio
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from zeus_async.events import GpuSample
    from zeus_async.inference import RequestMeter

    async def chat(request: Request) -> StreamingResponse:
        async def chunks() -> Any:
            await anyio.sleep(0.02)
            for i in range(20):
                yield f'data: {{"tok": {i}}}\n\n'.encode()
                await anyio.sleep(0.01)
            request.state.tokens = (10, 20)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    meter = RequestMeter("tokens", gpus=[0], lag_s=0.02)

    def feed() -> None:
        t0 = time.time_ns()
        while True:
            t = time.time_ns()
            meter.add(GpuSample("h", t, 0, power_w=300.0, energy_j=300.0 * (t - t0) / 1e9))
            time.sleep(0.005)

    threading.Thread(target=feed, daemon=True).start()
    app: Any = Starlette(routes=[Route("/v1/chat/completions", chat)])
    if which == "sse":
        from zeus_async.inference.asgi import EnergyMiddleware

        app = EnergyMiddleware(app, meter, energy_header=True, header_wait_s=10.0)
    elif which == "old":
        spec = importlib.util.spec_from_file_location("asgi_old", os.environ["OLD_ASGI"])
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        app = old.EnergyMiddleware(app, meter, energy_header=True, header_wait_s=10.0)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def one(port: int) -> tuple[float, float, bool, bool]:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    first = None
    data = b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        data += chunk
        if first is None and b"data: {" in data:
            first = time.perf_counter() - t0
        if data.endswith(b"0\r\n\r\n"):
            break
    writer.close()
    total = time.perf_counter() - t0
    return first or total, total, b"event: energy" in data, b'"pending": true' in data


async def clients(port: int, n: int) -> list[tuple[float, float, bool, bool]]:
    return list(await asyncio.gather(*(one(port) for _ in range(n))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def old_middleware(tmp: Path) -> Path | None:
    """The middleware of ``OLD_REV``, its relative import made absolute."""
    try:
        text = subprocess.run(
            ["git", "show", f"{OLD_REV}:zeus_async/inference/asgi.py"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    path = tmp / "asgi_old.py"
    path.write_text(text.replace("from .meter import", "from zeus_async.inference.meter import"))
    return path


def measure(which: str, n: int, rounds: int, env: dict[str, str]) -> list[dict[str, float]]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", which, "--port", str(port)], env=env
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        asyncio.run(clients(port, 20))  # warm up
        out = []
        for _ in range(rounds):
            res = asyncio.run(clients(port, n))
            ttfb = sorted(r[0] for r in res)
            out.append(
                {
                    "ttfb_p50": statistics.median(ttfb),
                    "ttfb_p99": ttfb[int(0.99 * (len(ttfb) - 1))],
                    "total_p50": statistics.median(r[1] for r in res),
                    "energy": sum(r[2] for r in res),
                    "pending": sum(r[3] for r in res),
                }
            )
        return out
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.serve)
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        modes = ["none", "sse"]
        old = old_middleware(Path(tmp))
        if old is not None:
            env["OLD_ASGI"] = str(old)
            modes.append("old")
        rows = [(mode, measure(mode, args.clients, args.rounds, env)) for mode in modes]
    print(f"SSE streams, {args.clients} concurrent clients, {args.rounds} rounds each")
    print(f"{'middleware':<11} {'TTFB p50 s':>11} {'TTFB p99 s':>11} {'end p50 s':>10} "
          f"{'energy events':>14} {'pending':>8}")  # fmt: skip
    for mode, rounds in rows:
        for r in rounds:
            print(f"{mode:<11} {r['ttfb_p50']:>11.3f} {r['ttfb_p99']:>11.3f} "
                  f"{r['total_p50']:>10.3f} {r['energy']:>14.0f} {r['pending']:>8.0f}")  # fmt: skip
    print(json.dumps({mode: rounds for mode, rounds in rows}))


if __name__ == "__main__":
    main()
