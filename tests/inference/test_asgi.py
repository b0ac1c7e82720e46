"""The ASGI middleware behind a real HTTP server (uvicorn running a Starlette app), with many
concurrent clients; and the Prometheus histograms of the settled requests."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from zeus_async.events import GpuSample
from zeus_async.inference import RequestMeter
from zeus_async.inference.asgi import EnergyMiddleware
from zeus_async.inference.metrics import RequestMetrics

uvicorn = pytest.importorskip("uvicorn")
starlette = pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

WATTS = 300.0


def readings(meter: RequestMeter, stop: threading.Event) -> None:
    """A GPU drawing 300 W, read every 5 ms with an exact energy counter (real time)."""
    t0 = time.time_ns()
    while not stop.is_set():
        t = time.time_ns()
        meter.add(GpuSample("h", t, 0, power_w=WATTS, energy_j=WATTS * (t - t0) / 1e9))
        time.sleep(0.005)


async def generate(request: Request) -> JSONResponse:
    n = int(request.query_params.get("n", "8"))
    await _busy(0.05)
    request.state.tokens = (n, 2 * n)
    return JSONResponse({"generated": 2 * n})


async def stream(request: Request) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        await _busy(0.02)  # prefill, then tokens one by one
        for i in range(3):
            yield f"token{i} ".encode()
            await _busy(0.01)
        request.state.tokens = (5, 3)

    return StreamingResponse(chunks(), media_type="text/plain")


async def events(request: Request) -> StreamingResponse:
    """An event stream; ``?fail=1``: the engine fails after the first event."""
    fail = request.query_params.get("fail") == "1"

    async def chunks() -> AsyncIterator[bytes]:
        await _busy(0.02)
        yield b"data: a\n\n"
        await _busy(0.01)
        if fail:
            raise RuntimeError("the engine died")
        yield b"data: b\n\n"
        request.state.tokens = (5, 2)

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def _busy(seconds: float) -> None:
    import anyio

    await anyio.sleep(seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server() -> Iterator[tuple[str, RequestMeter, RequestMetrics]]:
    meter = RequestMeter("tokens", gpus=[0], lag_s=0.02)
    metrics = RequestMetrics(meter)
    routes = [Route("/generate", generate), Route("/stream", stream), Route("/events", events)]
    app = Starlette(routes=routes)
    wrapped = EnergyMiddleware(app, meter, energy_header=True, header_wait_s=10.0)
    port = _free_port()
    config = uvicorn.Config(wrapped, host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    stop = threading.Event()
    feeder = threading.Thread(target=readings, args=(meter, stop), daemon=True)
    feeder.start()
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    try:
        yield f"http://127.0.0.1:{port}", meter, metrics
    finally:
        srv.should_exit = True
        thread.join(10)
        stop.set()
        feeder.join(5)


def _get(url: str) -> tuple[dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return {k.lower(): v for k, v in response.headers.items()}, response.read()


def _settled(meter: RequestMeter, rid: str) -> Any:
    deadline = time.monotonic() + 10
    while meter.settled(rid) is None and time.monotonic() < deadline:
        meter.settle_soon()
        time.sleep(0.01)
    return meter.settled(rid)


def test_each_response_carries_its_energy(
    server: tuple[str, RequestMeter, RequestMetrics],
) -> None:
    base, meter, _metrics = server
    headers, body = _get(f"{base}/generate?n=4")
    assert json.loads(body) == {"generated": 8}
    energy = float(headers["x-energy-joules"])
    # Alone on the GPU for ~50 ms at 300 W: all of it is this request's.
    assert 0.8 * WATTS * 0.05 < energy < WATTS * 0.3
    assert headers["x-energy-method"].startswith("tokens share of counter")
    r = meter.settled(headers["x-energy-request-id"])
    assert r is not None and (r.tokens_in, r.tokens_out) == (4, 8)
    assert r.energy_j == pytest.approx(energy, rel=1e-5)
    headers, body = _get(f"{base}/stream")
    assert body == b"token0 token1 token2 "
    assert "x-energy-joules" not in headers  # a stream is never held for the header
    r = _settled(meter, headers["x-energy-request-id"])
    assert r is not None and r.prefill_j is not None and r.decode_j is not None  # streamed


def test_many_concurrent_requests_conserve_the_gpu_energy(
    server: tuple[str, RequestMeter, RequestMetrics],
) -> None:
    base, meter, metrics = server
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda i: _get(f"{base}/generate?n={1 + i % 7}"), range(96)))
    energies = [float(h["x-energy-joules"]) for h, _ in got]
    assert len({h["x-energy-request-id"] for h, _ in got}) == 96
    assert all(e > 0 for e in energies)
    totals = meter.totals
    assert totals.requests == 96
    assert totals.requests_j[0] + totals.idle_j[0] == pytest.approx(totals.energy_j[0], abs=1e-6)
    assert sum(energies) == pytest.approx(totals.requests_j[0], rel=1e-4)
    # Prometheus: every request observed once; the per-GPU counters add up to the measured.
    sample = metrics.registry.get_sample_value
    labels = {"policy": "tokens", "route": "/generate", "model": ""}  # the matched template
    assert sample("zeus_request_energy_joules_count", labels) == 96
    assert sample("zeus_request_energy_joules_sum", labels) == pytest.approx(
        sum(energies), rel=1e-4
    )
    assert sample("zeus_request_energy_per_output_token_joules_count", labels) == 96
    requests = sample("zeus_request_gpu_energy_joules_total", {"gpu": "0", "kind": "requests"})
    idle = sample("zeus_request_gpu_energy_joules_total", {"gpu": "0", "kind": "idle"})
    assert requests is not None and idle is not None
    assert requests + idle == pytest.approx(totals.energy_j[0], rel=1e-9)


def _sse_payload(body: bytes) -> dict[str, Any]:
    (energy,) = [b for b in body.split(b"\n\n") if b.startswith(b"event: energy")]
    payload: dict[str, Any] = json.loads(energy.split(b"data: ", 1)[1])
    return payload


def test_event_streams_end_with_their_energy_and_a_failure_keeps_what_was_sent(
    server: tuple[str, RequestMeter, RequestMetrics],
) -> None:
    """Behind uvicorn, with the header mode on: a stream is not held, its last event carries
    its settled figure; one failing midway keeps its first event and gets its energy event
    (``error``), then the connection closes: no 500 in place of the started stream."""
    base, meter, _metrics = server
    headers, body = _get(f"{base}/events")
    assert "x-energy-joules" not in headers
    assert body.startswith(b"data: a\n\ndata: b\n\nevent: energy\n")
    payload = _sse_payload(body)
    r = meter.settled(headers["x-energy-request-id"])
    assert r is not None and payload["energy_j"] == r.energy_j > 0
    assert payload["finish_reason"] == r.finish_reason == "completed"
    with urllib.request.urlopen(f"{base}/events?fail=1", timeout=30) as response:
        assert response.status == 200
        rid = response.headers["x-energy-request-id"]
        with pytest.raises(http.client.IncompleteRead) as got:
            response.read()
    partial = got.value.partial
    assert partial.startswith(b"data: a\n\nevent: energy\n")
    payload = _sse_payload(partial)
    r = meter.settled(rid)
    assert r is not None and payload["energy_j"] == r.energy_j > 0
    assert payload["finish_reason"] == r.finish_reason == "error"
