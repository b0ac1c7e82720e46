"""Delivery that works with streaming (issue 38, item 5): the ASGI middleware never holds a
stream (its first chunk reaches the server before the request ends), puts the figure in the
stream's final ``event: energy``, in the OpenAI ``usage`` object and in HTTP trailers; a stream
failing midway keeps what it sent and is settled as ``error``; metrics and health paths and
unmatched 404s are not metered; a request begins when the app marks it scheduled; the
histograms are labelled by route and model, bounded.

Real Starlette apps behind a minimal ASGI server harness (it records every message the
middleware sends, in order, and supports the trailers extension, which uvicorn lacks); a fake
clock and a GPU drawing a constant 300 W read every 10 ms with an exact energy counter, so a
request alone on the GPU for ``d`` seconds has exactly 300 * d joules.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import pytest

from zeus_async.errors import ConfigError
from zeus_async.events import GpuSample
from zeus_async.inference import RequestMeter
from zeus_async.inference.asgi import EnergyMiddleware, mark_scheduled
from zeus_async.inference.metrics import RequestMetrics

pytest.importorskip("starlette")

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
WATTS = 300.0
START = T0 - 1000 * MS  # the readings' start


class Sim:
    """A fake wall clock and a GPU at 300 W, read every 10 ms up to the clock."""

    def __init__(self) -> None:
        self.now = T0
        self.fed = START
        self.meter = RequestMeter("tokens", gpus=[0], clock=self, lag_s=0.0)
        self.feed()

    def __call__(self) -> int:
        return self.now

    def feed(self) -> None:
        while self.fed <= self.now:
            joules = WATTS * (self.fed - START) / 1e9
            self.meter.add(GpuSample("h", self.fed, 0, power_w=WATTS, energy_j=joules))
            self.fed += 10 * MS

    def advance(self, ms: int) -> None:
        self.now += ms * MS
        self.feed()


Message = dict[str, Any]


async def serve(
    app: Any,
    path: str = "/",
    *,
    headers: Sequence[tuple[bytes, bytes]] = (),
    trailers: bool = False,
    on_send: Callable[[Message], None] | None = None,
) -> tuple[list[Message], BaseException | None]:
    """One request through ``app``: every message it sends, and what it raised."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": list(headers),
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 80),
    }
    if trailers:
        scope["extensions"] = {"http.response.trailers": {}}
    sent: list[Message] = []
    asked = False

    async def receive() -> Message:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await anyio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async def send(message: Any) -> None:
        sent.append(dict(message))
        if on_send is not None:
            on_send(message)

    error: BaseException | None = None
    with anyio.fail_after(20):  # a guard against a hang (a held stream), not a measurement
        try:
            await app(scope, receive, send)
        except Exception as e:
            error = e
    return sent, error


def run(app: Any, path: str = "/", **kw: Any) -> tuple[list[Message], BaseException | None]:
    async def main() -> tuple[list[Message], BaseException | None]:
        return await serve(app, path, **kw)

    return anyio.run(main)


def body_of(sent: list[Message]) -> bytes:
    return b"".join(bytes(m.get("body", b"")) for m in sent if m["type"] == "http.response.body")


def headers_of(sent: list[Message]) -> dict[bytes, bytes]:
    start = [m for m in sent if m["type"] == "http.response.start"]
    assert len(start) == 1
    return dict(start[0]["headers"])


def events_of(body: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event."""
    out = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        name = None
        data = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        out.append((name, "\n".join(data)))
    return out


def chat_stream_app(
    sim: Sim,
    *,
    usage: bool = False,
    fail_after: int | None = None,
    first_seen: anyio.Event | None = None,
) -> Starlette:
    """An OpenAI-style chat completion stream: 20 ms prefill, then 3 tokens 10 ms apart."""

    async def chat(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            sim.advance(20)
            for i in range(3):
                if fail_after is not None and i == fail_after:
                    raise RuntimeError("the engine died")
                chunk = {"choices": [{"delta": {"content": f"tok{i}"}}], "usage": None}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                if i == 0 and first_seen is not None:
                    # The request goes on only once the server has the first token.
                    await first_seen.wait()
                sim.advance(10)
            if usage:
                last = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
                yield f"data: {json.dumps(last)}\n\n".encode()
            else:
                request.state.tokens = (9, 3)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat)])


def test_a_stream_is_not_held_with_the_header_and_ends_with_its_settled_figure() -> None:
    sim = Sim()
    first_seen = anyio.Event()

    def on_send(message: Message) -> None:
        if b"tok0" in bytes(message.get("body", b"")):
            first_seen.set()

    app = EnergyMiddleware(
        chat_stream_app(sim, first_seen=first_seen), sim.meter, energy_header=True, poll_s=0.001
    )
    sent, error = run(app, "/v1/chat/completions", on_send=on_send)
    assert error is None
    headers = headers_of(sent)
    assert b"x-energy-joules" not in headers  # a stream: no header, not held
    assert sent[0]["type"] == "http.response.start"
    assert b"tok0" in sent[1]["body"]  # the first token went out on its own
    events = events_of(body_of(sent))
    assert [name for name, _ in events] == [None, None, None, "energy", None]
    assert events[-1][1] == "[DONE]"  # the energy event goes before [DONE]
    payload = json.loads(events[3][1])
    rid = headers[b"x-energy-request-id"].decode()
    r = sim.meter.settled(rid)
    assert r is not None
    assert payload["request_id"] == rid
    assert payload["energy_j"] == r.energy_j
    assert r.energy_j == pytest.approx(WATTS * 0.05, abs=1e-3)  # alone for 50 ms
    assert payload["prefill_j"] == r.prefill_j == pytest.approx(WATTS * 0.02, abs=1e-3)
    assert payload["decode_j"] == r.decode_j == pytest.approx(WATTS * 0.03, abs=1e-3)
    assert payload["method"] == r.method and payload["finish_reason"] == "completed"
    assert payload["error_j"] == r.error_j
    assert payload["choices"] == []  # an OpenAI SDK sees a chunk without choices
    assert "pending" not in payload and "co2e_g" not in payload
    assert (r.tokens_in, r.tokens_out) == (9, 3)
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_plain_event_stream_gets_the_event_in_its_last_message() -> None:
    sim = Sim()

    async def events(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            sim.advance(30)
            yield b"event: token\ndata: a\n\n"
            sim.advance(30)
            yield b"event: token\ndata: b\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = EnergyMiddleware(
        Starlette(routes=[Route("/events", events)]), sim.meter, delivery=("sse",), poll_s=0.001
    )
    sent, error = run(app, "/events")
    assert error is None
    names = [name for name, _ in events_of(body_of(sent))]
    assert names == ["token", "token", "energy"]
    payload = json.loads(events_of(sent[-1]["body"])[0][1])
    assert sent[-1]["more_body"] is False
    r = sim.meter.settled(payload["request_id"])
    assert r is not None and payload["energy_j"] == r.energy_j
    assert r.energy_j == pytest.approx(WATTS * 0.06, abs=1e-3)
    assert "choices" not in payload  # not an OpenAI-style stream


def test_no_figure_in_time_says_pending() -> None:
    sim = Sim()

    async def events(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            sim.now += 30 * MS  # no readings past here: it cannot settle
            yield b"data: a\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = EnergyMiddleware(
        Starlette(routes=[Route("/e", events)]),
        sim.meter,
        delivery=("sse",),
        header_wait_s=0.05,
        poll_s=0.001,
    )
    sent, _ = run(app, "/e")
    payload = json.loads(events_of(body_of(sent))[-1][1])
    assert payload["pending"] is True and payload["energy_j"] is None
    assert payload["finish_reason"] == "completed"


def test_the_usage_object_of_a_json_response() -> None:
    sim = Sim()

    async def completion(request: Request) -> JSONResponse:
        sim.advance(40)
        usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
        return JSONResponse({"id": "c1", "choices": [], "usage": usage})

    async def other(request: Request) -> JSONResponse:
        sim.advance(40)
        return JSONResponse({"usage": "not an object"})

    routes = [Route("/v1/completions", completion), Route("/other", other)]
    app = EnergyMiddleware(Starlette(routes=routes), sim.meter, delivery=("usage",), poll_s=0.001)
    sent, error = run(app, "/v1/completions")
    assert error is None
    headers = headers_of(sent)
    body = body_of(sent)
    assert int(headers[b"content-length"]) == len(body)
    assert b"x-energy-joules" not in headers  # the header mode is off
    doc = json.loads(body)
    usage = doc["usage"]
    rid = headers[b"x-energy-request-id"].decode()
    r = sim.meter.settled(rid)
    assert r is not None
    assert usage["energy_j"] == r.energy_j == pytest.approx(WATTS * 0.04, abs=1e-3)
    assert usage["energy_method"] == r.method and usage["energy_request_id"] == rid
    assert usage["energy_error_j"] == r.error_j
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (7, 5)
    assert (r.tokens_in, r.tokens_out) == (7, 5)  # taken from the usage: the app set none
    sent, _ = run(app, "/other")
    assert json.loads(body_of(sent)) == {"usage": "not an object"}  # untouched


def test_the_usage_event_of_a_stream_and_the_energy_event_agree() -> None:
    sim = Sim()
    first_seen = anyio.Event()

    def on_send(message: Message) -> None:
        if b"tok0" in bytes(message.get("body", b"")):
            first_seen.set()

    app = EnergyMiddleware(
        chat_stream_app(sim, usage=True, first_seen=first_seen),
        sim.meter,
        delivery=("header", "sse", "usage"),
        poll_s=0.001,
    )
    sent, error = run(app, "/v1/chat/completions", on_send=on_send)
    assert error is None
    events = events_of(body_of(sent))
    assert [name for name, _ in events] == [None, None, None, None, "energy", None]
    usage = json.loads(events[3][1])["usage"]
    energy = json.loads(events[4][1])
    r = sim.meter.settled(energy["request_id"])
    assert r is not None and (r.tokens_in, r.tokens_out) == (9, 3)
    assert usage["energy_j"] == energy["energy_j"] == r.energy_j
    assert r.energy_j == pytest.approx(WATTS * 0.05, abs=1e-3)
    assert usage["prompt_tokens"] == 9
    assert json.loads(events[2][1])["usage"] is None  # the other chunks pass untouched


def test_trailers_where_the_server_and_the_client_support_them() -> None:
    sim = Sim()

    async def generate(request: Request) -> Response:
        sim.advance(50)
        return Response(b"done", media_type="text/plain")

    app = EnergyMiddleware(
        Starlette(routes=[Route("/g", generate)]),
        sim.meter,
        delivery=("trailers",),
        poll_s=0.001,
    )
    te = [(b"te", b"trailers")]
    sent, error = run(app, "/g", headers=te, trailers=True)
    assert error is None
    assert [m["type"] for m in sent] == [
        "http.response.start",
        "http.response.body",
        "http.response.trailers",
    ]
    assert sent[0]["trailers"] is True
    assert headers_of(sent)[b"trailer"].startswith(b"x-energy-joules")
    trailers = dict(sent[-1]["headers"])
    assert sent[-1]["more_trailers"] is False
    r = sim.meter.settled(headers_of(sent)[b"x-energy-request-id"].decode())
    assert r is not None and r.energy_j == pytest.approx(WATTS * 0.05, abs=1e-3)
    assert trailers[b"x-energy-joules"] == f"{r.energy_j:.6g}".encode()
    assert trailers[b"x-energy-method"] == r.method.encode()
    # A stream: the same, after its last body message.
    stream = EnergyMiddleware(chat_stream_app(sim), sim.meter, delivery=("trailers",))
    sent, _ = run(stream, "/v1/chat/completions", headers=te, trailers=True)
    assert sent[-1]["type"] == "http.response.trailers" and sent[-2]["more_body"] is False
    assert b"event: energy" not in body_of(sent)
    # No trailers where the client did not ask for them, or the server lacks the extension.
    for kw in ({"trailers": True}, {"headers": te}):
        sent, _ = run(app, "/g", **kw)
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert not sent[0].get("trailers") and b"trailer" not in headers_of(sent)


def test_a_stream_failing_midway_keeps_what_it_sent_and_is_settled_as_error() -> None:
    sim = Sim()
    app = EnergyMiddleware(
        chat_stream_app(sim, fail_after=2), sim.meter, energy_header=True, poll_s=0.001
    )
    sent, error = run(app, "/v1/chat/completions")
    assert isinstance(error, RuntimeError)  # on to the server, which closes the connection
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1 and starts[0]["status"] == 200  # no 500 in its place
    events = events_of(body_of(sent))
    assert [name for name, _ in events] == [None, None, "energy"]
    assert b"tok0" in body_of(sent) and b"tok1" in body_of(sent)
    payload = json.loads(events[-1][1])
    r = sim.meter.settled(payload["request_id"])
    assert r is not None and r.finish_reason == payload["finish_reason"] == "error"
    assert payload["energy_j"] == r.energy_j == pytest.approx(WATTS * 0.04, abs=1e-3)
    assert all(m.get("more_body") for m in sent if m["type"] == "http.response.body")


def test_excluded_paths_and_unmatched_404s_are_not_metered() -> None:
    sim = Sim()

    async def ok(request: Request) -> Response:
        sim.advance(10)
        return Response(b"ok")

    async def missing_model(request: Request) -> Response:
        sim.advance(10)
        return Response(b"no such model", status_code=404)

    routes = [
        Route("/metrics", ok),
        Route("/healthz", ok),
        Route("/static/app.js", ok),
        Route("/v1/models/x", missing_model),
        Route("/metricsfoo", ok),
    ]
    app = EnergyMiddleware(
        Starlette(routes=routes),
        sim.meter,
        exclude_paths=("/metrics", "/healthz", "/static*"),
        energy_header=True,
        poll_s=0.001,
    )
    for path in ("/metrics", "/metrics/", "/healthz", "/static/app.js"):
        sent, _ = run(app, path)
        assert b"x-energy-request-id" not in headers_of(sent), path
    assert len(sim.meter._edges) == 0  # not a single edge
    sent, _ = run(app, "/nowhere")  # a 404 of no route
    headers = headers_of(sent)
    assert sent[0]["status"] == 404 and b"x-energy-joules" not in headers
    sent, _ = run(app, "/v1/models/x")  # a 404 the app answered: metered
    matched = headers_of(sent)[b"x-energy-request-id"].decode()
    sent, _ = run(app, "/metricsfoo")  # not under /metrics
    assert b"x-energy-joules" in headers_of(sent)
    sim.advance(20)
    sim.meter.settle_all()
    got = {r.request_id: r for r in sim.meter.results()}
    assert got[matched].energy_j == pytest.approx(WATTS * 0.01, abs=1e-3)
    assert len(got) == 2 + (0 if hasattr(sim.meter, "discard") else 1)
    if not hasattr(sim.meter, "discard"):  # dropped as well as the meter allows: no energy
        (dropped,) = [r for r in got.values() if r.finish_reason == "cancelled"]
        assert dropped.energy_j == 0.0
    assert EnergyMiddleware(app.app, sim.meter).excluded({"path": "/readyz"})  # the default
    assert not EnergyMiddleware(app.app, sim.meter, exclude_paths=()).excluded({"path": "/ready"})


def test_begin_at_scheduling() -> None:
    sim = Sim()
    marks: dict[str, int] = {}

    async def queued(request: Request) -> StreamingResponse:
        sim.advance(100)  # waiting in the handler's queue: not prefill
        how = request.query_params.get("how", "")
        if how == "state":
            marks["state"] = sim.now
            request.state.scheduled()
        elif how == "past":
            marks["past"] = sim.now - 40 * MS
            mark_scheduled(request, at_ns=sim.now - 40 * MS)
        elif how == "function":
            marks["function"] = sim.now
            mark_scheduled(request)

        async def chunks() -> AsyncIterator[bytes]:
            sim.advance(20)
            yield b"data: a\n\n"
            sim.advance(30)
            yield b"data: b\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    starlette_app = Starlette(routes=[Route("/q", queued)])
    app = EnergyMiddleware(starlette_app, sim.meter, begin="scheduled", delivery=("sse",))

    def request(how: str) -> Any:
        scope_path = "/q"
        sent, error = anyio.run(_serve_query, app, scope_path, how)
        assert error is None
        payload = json.loads(events_of(body_of(sent))[-1][1])
        r = sim.meter.settled(payload["request_id"])
        assert r is not None
        return r

    for how in ("state", "past", "function"):
        r = request(how)
        assert r.begin_ns == marks[how]
        assert r.prefill_j == pytest.approx(WATTS * (r.decode_ns - marks[how]) / 1e9, abs=1e-3)
    r = request("never")  # never marked: it begins at the first response message
    assert r.decode_ns - r.begin_ns == 20 * MS
    assert r.energy_j == pytest.approx(WATTS * 0.05, abs=1e-3)
    # begin="arrival": from the app's call, queueing included; the mark does nothing.
    arrival = EnergyMiddleware(starlette_app, sim.meter, delivery=("sse",))
    start = sim.now
    sent, _ = anyio.run(_serve_query, arrival, "/q", "state")
    r = sim.meter.settled(json.loads(events_of(body_of(sent))[-1][1])["request_id"])
    assert r is not None and r.begin_ns == start
    assert r.energy_j == pytest.approx(WATTS * 0.15, abs=1e-3)


async def _serve_query(app: Any, path: str, how: str) -> tuple[list[Message], Any]:
    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        scope["query_string"] = f"how={how}".encode()
        await app(scope, receive, send)

    return await serve(wrapped, path)


def test_a_request_failing_before_scheduling_is_not_metered() -> None:
    sim = Sim()

    async def broken(request: Request) -> Response:
        raise ValueError("bad request")

    async def raw(scope: Any, receive: Any, send: Any) -> None:
        raise ValueError("bad request")

    _, error = run(EnergyMiddleware(raw, sim.meter, begin="scheduled"), "/b")
    assert isinstance(error, ValueError)
    assert len(sim.meter._edges) == 0  # nothing sent, never scheduled: not metered
    # Starlette answers 500 first: that response begins it, and it ends there (no energy).
    app = EnergyMiddleware(Starlette(routes=[Route("/b", broken)]), sim.meter, begin="scheduled")
    sent, error = run(app, "/b")
    assert isinstance(error, ValueError) and sent[0]["status"] == 500
    sim.advance(20)
    (r,) = sim.meter.settle_all()
    assert r.finish_reason == "error" and r.energy_j == 0.0


def test_histograms_are_labelled_by_route_and_model_bounded() -> None:
    sim = Sim()
    metrics = RequestMetrics(sim.meter, max_label_values=2)
    for i, (route, model) in enumerate(
        [("/a", "m1"), ("/b", "m1"), ("/c", "m2"), ("/a", "m3"), ("/a", "m1")]
    ):
        sim.meter.begin(f"r{i}")
        sim.advance(10)
        sim.meter.end(f"r{i}", tokens_out=2, route=route, model=model)
    sim.advance(20)
    sim.meter.settle_all()
    value = metrics.registry.get_sample_value

    def count(route: str, model: str) -> float | None:
        labels = {"policy": "tokens", "route": route, "model": model}
        return value("zeus_request_energy_joules_count", labels)

    assert count("/a", "m1") == 2
    assert count("/b", "m1") == 1
    assert count("other", "m2") == 1  # a third route, a second model
    assert count("/a", "other") == 1  # a third model
    per_token = value(
        "zeus_request_energy_per_output_token_joules_sum",
        {"policy": "tokens", "route": "/a", "model": "m1"},
    )
    assert per_token == pytest.approx(2 * WATTS * 0.01 / 2, abs=1e-3)


def test_bad_configuration() -> None:
    sim = Sim()
    with pytest.raises(ConfigError, match="delivery"):
        EnergyMiddleware(Starlette(), sim.meter, delivery=("headers",))
    with pytest.raises(ConfigError, match="begin"):
        EnergyMiddleware(Starlette(), sim.meter, begin="queued")
    assert EnergyMiddleware(Starlette(), sim.meter, energy_header=True).delivery == {
        "header",
        "sse",
    }
    assert EnergyMiddleware(Starlette(), sim.meter).delivery == frozenset()
    assert EnergyMiddleware(Starlette(), sim.meter, delivery="usage").delivery == {"usage"}
    both = EnergyMiddleware(Starlette(), sim.meter, energy_header=True, delivery=("trailers",))
    assert both.delivery == {"header", "trailers"}


def test_a_path_send_releases_the_held_start() -> None:
    """``http.response.pathsend`` (a server extension) is a whole body: the start held for the
    header goes out before it, and the request ends there."""
    sim = Sim()

    async def files(scope: Any, receive: Any, send: Any) -> None:
        sim.advance(10)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.pathsend", "path": "/srv/file"})

    app = EnergyMiddleware(files, sim.meter, energy_header=True, poll_s=0.001)
    sent, error = run(app, "/f")
    assert error is None
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.pathsend"]
    sim.advance(10)
    (r,) = sim.meter.settle_all()
    assert r.finish_reason == "completed"
    assert r.energy_j == pytest.approx(WATTS * 0.01, abs=1e-3)
