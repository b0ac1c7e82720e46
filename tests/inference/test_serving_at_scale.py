"""Serving at scale through the node agent: real processes, one simulated GPU.

A node agent (the node's one request attributor, ``steps`` policy, a requests maximum age of
a few seconds); ``uvicorn --workers 4`` serving an OpenAI-style SSE stream through
``EnergyMiddleware(app, RemoteMeter(), delivery=("sse",))``; a separate engine process (its
own RemoteMeter) reporting its requests and engine steps on the same GPU; 2,000 concurrent
streaming clients on raw sockets, a tenth of them hanging up midway; one request whose
handler never ends; 404s of paths the app lacks (discarded from the node's meter).

With the ``steps`` policy (as with ``equal``) a request in flight does not hold the
attributor's horizon (it is settled in pieces, its result returned once when it ends or
expires), so the never-ending request holds nothing: the streams that overlap it get their
energy events about the edge delay after their end, long before it expires (``MAX_AGE_S``,
well past the streams' end), as a second wave after the expiry does. (With ``tokens`` it would
hold them until its expiry.) Run with ``-s`` for the figures.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_remote import _alive, _stop, _totals, _wait
from test_remote import _start_agent as start_agent

from zeus_async.devices.sim_config import SimConfig
from zeus_async.events import RequestMeasurement
from zeus_async.store.reader import RecordingReader
from zeus_async.testing.procs import sim_env

CONFIG = SimConfig(num_gpus=1, seed=11)
CLIENTS = 2000
#: Every tenth client hangs up after two content chunks.
DISCONNECT_EVERY = 10
#: A stream: a role chunk at once, then CHUNKS content chunks GAP_S apart, then [DONE].
CHUNKS, GAP_S = 6, 0.4
#: The requests' maximum age: above any stream's length here (2.4 s and its queueing), and
#: far enough past the first wave's end that an energy event held until the expiry shows.
MAX_AGE_S = 8.0
#: After the never-ending request expired: a second wave, short streams.
LATER, LATER_CHUNKS = 100, 2
EDGE_DELAY_S = 1.0
SETTLE_S = 0.25

APP = """
import asyncio
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route
from zeus_async.inference.asgi import EnergyMiddleware
from zeus_async.inference.remote import RemoteMeter

CHUNKS, GAP_S = @CHUNKS@, @GAP_S@

async def chat(request):
    hang = request.query_params.get("hang") == "1"
    chunks = int(request.query_params.get("chunks", CHUNKS))
    request.state.tokens = (8, chunks)
    request.state.model = "sim-llm"

    async def stream():
        yield 'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\\n\\n'
        if hang:  # a handler that never ends
            await asyncio.Event().wait()
        for i in range(chunks):
            await asyncio.sleep(GAP_S)
            yield 'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\\n\\n' % i
        yield "data: [DONE]\\n\\n"

    return StreamingResponse(stream(), media_type="text/event-stream")

# One meter per worker process (uvicorn imports this module in each).
app = EnergyMiddleware(
    Starlette(routes=[Route("/v1/chat/completions", chat)]),
    RemoteMeter(name="web", batch_s=0.02),
    delivery=("sse",),
    header_wait_s=30.0,
)
""".replace("@CHUNKS@", str(CHUNKS)).replace("@GAP_S@", repr(GAP_S))

# The engine: its own requests (four in flight, ten 20 ms steps each, 30 ms apart), reported
# after the fact with explicit times and per-step batches, until told to stop.
ENGINE = """
import json, sys, threading, time
from zeus_async.inference.remote import RemoteMeter
m = RemoteMeter(name="engine", batch_s=0.02)
m.wait_connected()
print("ready", flush=True)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
n, live = 0, {}
while not stop.is_set():
    while len(live) < 4:
        rid = f"e{n}"
        n += 1
        m.begin(rid, gpus=(0,))
        live[rid] = [0, 0]
    t0 = time.time_ns()
    time.sleep(0.02)
    t1 = time.time_ns()
    batch = [(rid, 16 if s == 0 else 0, 0 if s == 0 else 1, ctx)
             for rid, (s, ctx) in live.items()]
    m.step(batch, start_ns=t0, end_ns=t1, gpus=(0,))
    for rid in list(live):
        s, ctx = live[rid]
        if s == 0:
            m.phase(rid, at_ns=t1)
        live[rid] = [s + 1, ctx + (16 if s == 0 else 1)]
        if s + 1 >= 10:
            m.end(rid, tokens_in=16, tokens_out=9, at_ns=t1)
            del live[rid]
    time.sleep(0.03)
for rid, (s, _) in live.items():
    m.end(rid, tokens_in=16, tokens_out=max(0, s - 1))
deadline = time.monotonic() + 60
while len(m.results()) < n and time.monotonic() < deadline:
    time.sleep(0.05)
out = {r.request_id: [r.energy_j, r.finish_reason] for r in m.results()}
print(json.dumps({"n": n, "results": out, "dropped": m.totals.dropped}), flush=True)
m.close()
"""

_ENERGY = re.compile(rb"event: energy\ndata: (\{[^\n]*\})\n\n")
_RID = re.compile(rb"x-energy-request-id: ([^\r]+)\r\n", re.IGNORECASE)


@dataclass
class Client:
    """What one streaming client saw (times: ``time.monotonic()``)."""

    i: int
    disconnect: bool
    start: float = 0.0
    first_byte: float | None = None
    last_content: float | None = None
    energy_at: float | None = None
    rid: str = ""
    contents: int = 0
    energy: dict[str, Any] | None = None
    done: bool = False
    error: str = ""
    buf: bytearray = field(default_factory=bytearray)


@dataclass
class Load:
    clients: list[Client]
    peak: int
    wall_s: float


async def _stream(port: int, c: Client, streaming: list[int], chunks: int) -> None:
    """One client: a GET of the stream, read until [DONE] (or hang up after two chunks)."""
    c.start = time.monotonic()
    writer = None
    counted = False
    try:
        for attempt in range(5):  # a refused connect under the storm: try again
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                if attempt == 4:
                    raise
                await asyncio.sleep(0.2)
        assert writer is not None
        writer.write(
            b"GET /v1/chat/completions?chunks=%d HTTP/1.1\r\nHost: x\r\n"
            b"Accept: text/event-stream\r\n\r\n" % chunks
        )
        buf = c.buf
        while True:
            data = await reader.read(65536)
            if not data:
                c.error = c.error or "eof"
                return
            now = time.monotonic()
            if c.first_byte is None:
                c.first_byte = now
                streaming[0] += 1
                streaming[1] = max(streaming[1], streaming[0])
                counted = True
            buf += data
            n = buf.count(b'"content"')
            if n > c.contents:
                c.contents = n
                c.last_content = now
            if c.disconnect and c.contents >= 2:
                return  # hang up midway
            if c.energy is None:
                m = _ENERGY.search(buf)
                if m:
                    c.energy = json.loads(m.group(1))
                    c.energy_at = now
            if b"data: [DONE]" in buf:
                c.done = True
                return
    except Exception as exc:
        c.error = repr(exc)
    finally:
        if counted:
            streaming[0] -= 1
        m = _RID.search(c.buf)
        if m:
            c.rid = m.group(1).decode()
        if writer is not None:
            writer.close()


async def _load(port: int, n: int, chunks: int, disconnect_every: int = 0) -> Load:
    clients = [
        Client(i, disconnect=bool(disconnect_every) and i % disconnect_every == 0) for i in range(n)
    ]
    streaming = [0, 0]  # now, peak
    t0 = time.monotonic()
    await asyncio.wait_for(
        asyncio.gather(*(_stream(port, c, streaming, chunks) for c in clients)), timeout=240
    )
    return Load(clients, streaming[1], time.monotonic() - t0)


async def _open_hanging(port: int) -> tuple[asyncio.StreamWriter, str, float]:
    """The never-ending request: its headers and first chunk read, left open."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/chat/completions?hang=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    buf = bytearray()
    while b"assistant" not in buf:
        data = await asyncio.wait_for(reader.read(65536), 30)
        assert data, "the hanging request's stream closed"
        buf += data
    m = _RID.search(buf)
    assert m, buf
    return writer, m.group(1).decode(), time.time()


def _start_agent(private_dir: Path, record: str) -> subprocess.Popen[bytes]:
    return start_agent(
        private_dir,
        record,
        "steps",
        config=CONFIG,
        requests_max_age_s=MAX_AGE_S,
        requests_settle_s=SETTLE_S,
        requests_edge_delay_s=EDGE_DELAY_S,
    )


def _up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1")
    except OSError:
        return False


def _get(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
        out = bytearray()
        while data := s.recv(65536):
            out += data
        return bytes(out)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


@pytest.mark.slow
def test_2000_streams_four_workers_an_engine_and_a_request_that_never_ends(
    private_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    test_t0 = time.monotonic()
    recording = private_dir / "agent.zarc"
    (tmp_path / "sse_app.py").write_text(APP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = sim_env(CONFIG)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    agent = _start_agent(private_dir, str(recording))
    web = engine = None
    try:
        web = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "sse_app:app", "--workers", "4",
             "--port", str(port), "--backlog", "4096", "--log-level", "warning",
             "--timeout-graceful-shutdown", "5"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )  # fmt: skip
        engine = subprocess.Popen(
            [sys.executable, "-c", ENGINE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=sim_env(CONFIG),
        )
        assert engine.stdout is not None and engine.stdin is not None
        assert engine.stdout.readline().strip() == "ready", engine.stderr
        _wait(lambda: _alive(web) and _up(port), 60, "uvicorn up")
        # Paths the app lacks (scanners, probes): 404s without a route, discarded from the
        # node's meter through each worker's RemoteMeter (neither counted nor settled).
        assert all(_get(port, f"/v1/unknown/{i}").startswith(b"HTTP/1.1 404") for i in range(20))

        # The unfinished request is seen settled by a poller (the agent's own counts).
        unfinished_at: list[float] = []

        def poll() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if _totals(private_dir).finished.get("unfinished"):
                    unfinished_at.append(time.time())
                    return
                time.sleep(0.05)

        async def run() -> tuple[Load, Load, str, float]:
            writer, hang_rid, hang_t = await _open_hanging(port)
            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            try:
                load = await _load(port, CLIENTS, CHUNKS, DISCONNECT_EVERY)
            finally:
                await asyncio.to_thread(poller.join, 120)
            # Once it expired, it holds nothing: the next requests settle on time.
            later = await _load(port, LATER, LATER_CHUNKS)
            writer.close()
            return load, later, hang_rid, hang_t

        load, later, hang_rid, hang_t = asyncio.run(run())
        assert engine.stdin is not None
        engine.stdin.write("stop\n")
        engine.stdin.flush()
        out, _ = engine.communicate(timeout=90)
        eng = json.loads(out.strip().splitlines()[-1])
        n_all = CLIENTS + LATER + 1 + eng["n"]
        _wait(lambda: _totals(private_dir).requests == n_all, 60, "every request settled")
        # The hang-up ended the never-ending request (the server cancelled its handler):
        # an end after it was settled as unfinished, counted and dropped.
        _wait(
            lambda: _totals(private_dir).bad_input == {"ended_after_max_age": 1},
            30,
            "the unfinished request's late end counted",
        )
        totals = _totals(private_dir)
    finally:
        if web is not None:
            _stop(web)
        if engine is not None and engine.poll() is None:
            engine.kill()
            engine.communicate(timeout=10)
        _stop(agent)
    wall_s = time.monotonic() - test_t0

    clients = load.clients
    gone = [c for c in clients if c.disconnect]
    first = [c for c in clients if not c.disconnect]
    completed = first + later.clients
    hang = next(e for e in _published(recording) if e.request_id.endswith("/" + hang_rid))
    expiry = _monotonic(hang.begin_ns / 1e9 + MAX_AGE_S)
    unfinished_s = unfinished_at[0] - hang_t if unfinished_at else math.nan

    def waits(cs: list[Client]) -> list[float]:
        return [c.energy_at - c.last_content for c in cs
                if c.energy_at is not None and c.last_content is not None]  # fmt: skip

    ttfb = [c.first_byte - c.start for c in first if c.first_byte is not None]
    to_energy = [c.energy_at - c.start for c in first if c.energy_at is not None]
    held = [c.energy_at - max(c.last_content, expiry) for c in first
            if c.energy_at is not None and c.last_content is not None]  # fmt: skip
    figures = {
        "wall_s": round(wall_s, 1),
        "load_s": round(load.wall_s, 1),
        "peak_streams": load.peak,
        "completed": len(first),
        "disconnected": len(gone),
        "engine_requests": eng["n"],
        "ttfb_p50_s": _q(ttfb, 0.5),
        "ttfb_p99_s": _q(ttfb, 0.99),
        "energy_event_p50_s": _q(to_energy, 0.5),
        "energy_event_p99_s": _q(to_energy, 0.99),
        "last_chunk_to_energy_p50_s": _q(waits(first), 0.5),
        "last_chunk_to_energy_p99_s": _q(waits(first), 0.99),
        "past_end_or_expiry_p99_s": _q(held, 0.99),
        "past_end_or_expiry_max_s": _q(held, 1.0),
        "later_last_chunk_to_energy_p50_s": _q(waits(later.clients), 0.5),
        "later_last_chunk_to_energy_max_s": _q(waits(later.clients), 1.0),
        "unfinished_settled_s": round(unfinished_s, 3),
        "pending": sum(1 for c in completed if c.energy and c.energy.get("pending")),
        "errors": sum(1 for c in completed if c.error),
    }
    sys.stderr.write(f"\nserving at scale: {json.dumps(figures)}\n")

    assert not [c for c in completed if c.error], [(c.i, c.error) for c in completed if c.error][:5]
    # All 2,000 streams were open at once (but for a few still connecting or done).
    assert load.peak >= 0.95 * CLIENTS, load.peak
    # Every completed stream got its energy event before [DONE], with its figure, never
    # pending; the ones that hung up got none.
    for c in completed:
        chunks = CHUNKS if c in first else LATER_CHUNKS
        assert c.done and c.contents == chunks and c.energy is not None, (c.i, c.buf)
        assert not c.energy.get("pending") and c.energy["finish_reason"] == "completed"
        assert c.energy["request_id"] == c.rid and c.energy["energy_j"] >= 0
        assert c.energy["choices"] == []  # an OpenAI-style chunk without choices
    for c in gone:
        assert c.energy is None and c.rid and not c.done
    assert eng["dropped"] == {} and len(eng["results"]) == eng["n"]

    # The agent: every request of every process once; finish reasons as they happened.
    assert totals.finished == {
        "completed": len(completed) + eng["n"],
        "cancelled": len(gone),
        "unfinished": 1,
    }, totals
    assert totals.requests == totals.returned == n_all
    # Nothing dropped but that late end; nothing else the meter would call bad input.
    assert totals.bad_input == {"ended_after_max_age": 1} and totals.dropped_edges == 1
    assert totals.in_flight == 0 and totals.unpublished == 0
    # Per GPU, across the 4 workers and the engine process: requests + idle == measured.
    assert math.isclose(totals.energy_j[0], totals.requests_j[0] + totals.idle_j[0],
                        rel_tol=1e-9), totals  # fmt: skip
    assert totals.requests_j[0] > 0 and totals.idle_j[0] >= 0

    # The agent's published results (its recording): each request exactly once, with the
    # energy its client got.
    events = _published(recording)
    assert len(events) == n_all == len({e.request_id for e in events})
    by_id = {e.request_id.split("/", 1)[1]: e for e in events}
    assert len(by_id) == n_all
    assert math.isclose(
        math.fsum(sum(e.gpu_energy_j.values()) for e in events), totals.requests_j[0],
        rel_tol=1e-9,
    )  # fmt: skip
    for c in completed:
        e = by_id[c.rid]
        assert e.finish_reason == "completed" and e.request_id.startswith("web")
        assert c.energy is not None
        assert math.isclose(sum(e.gpu_energy_j.values()), c.energy["energy_j"], rel_tol=1e-6)
    for c in gone:
        assert by_id[c.rid].finish_reason == "cancelled"
    for rid, (energy, reason) in eng["results"].items():
        e = by_id[rid]
        assert e.request_id.startswith("engine") and reason == "completed"
        assert math.isclose(sum(e.gpu_energy_j.values()), energy, rel_tol=1e-9)
    assert hang.finish_reason == "unfinished"
    assert hang.end_ns - hang.begin_ns == round(MAX_AGE_S * 1e9)

    # The never-ending request was settled once past its maximum age (plus the attributor's
    # edge delay and settle period, and a margin for a loaded machine) ...
    assert MAX_AGE_S <= unfinished_s <= MAX_AGE_S + EDGE_DELAY_S + 5.0, unfinished_s
    # ... and it held nothing, neither before nor after its expiry: the streams that
    # overlapped it got their energy event about the edge delay after their end (the
    # attributor's horizon follows now less the edge delay, plus its settle period and a
    # margin for a loaded machine), each before the expiry, as later requests did.
    assert max(waits(first)) <= EDGE_DELAY_S + 2.5, max(waits(first))
    assert all(c.energy_at < expiry for c in first if c.energy_at is not None), max(held)
    assert max(waits(later.clients)) <= EDGE_DELAY_S + 2.5


def _published(recording: Path) -> list[RequestMeasurement]:
    return [e for e in RecordingReader(recording) if isinstance(e, RequestMeasurement)]


def _monotonic(wall_s: float) -> float:
    """A wall-clock instant on ``time.monotonic()``."""
    return wall_s - time.time() + time.monotonic()


def _q(xs: list[float], q: float) -> float | None:
    return round(_pct(xs, q), 3) if xs else None


@pytest.mark.slow
def test_a_discarded_request_leaves_the_node_attributor(private_dir: Path) -> None:
    from zeus_async.inference.remote import RemoteMeter, _columns

    assert _columns([(5, "x", 3, None)]).kind == [4]  # a discard on the wire
    agent = _start_agent(private_dir, str(private_dir / "agent.zarc"))
    try:
        with RemoteMeter(name="svc", batch_s=0.02) as meter:
            assert meter.wait_connected()
            _wait(lambda: _totals(private_dir).settled_ns is not None, 10, "attributor on")
            meter.begin("kept", gpus=(0,))
            meter.begin("dropped", gpus=(0,))
            time.sleep(0.2)
            meter.discard("dropped")  # in flight: forgotten, as if never begun
            time.sleep(0.1)
            meter.end("kept", tokens_out=2)
            meter.discard("never-begun")  # counted, never raised
            _wait(lambda: meter.settled("kept") is not None, 20, "kept settled")
            kept = meter.settled("kept")
            # The one request left took the GPU's energy while it was in flight, alone.
            _wait(lambda: _totals(private_dir).bad_input != {}, 10, "bad input counted")
            totals = _totals(private_dir)
            assert meter.settled("dropped") is None and meter.totals.results == 1
    finally:
        _stop(agent)
    assert kept is not None and kept.finish_reason == "completed"
    assert totals.requests == 1 and totals.finished == {"completed": 1}, totals
    assert totals.bad_input == {"unknown_id": 1} and totals.in_flight == 0
    assert math.isclose(totals.requests_j[0], kept.energy_j, rel_tol=1e-9)
    published = _published(private_dir / "agent.zarc")
    assert [e.request_id for e in published] == ["svc/kept"]
