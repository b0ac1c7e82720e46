"""RemoteMeter: serving processes sharing a GPU, attributed once by the node agent.

Real processes: a node agent on the simulator, client processes that meter requests through
it; a client killed with requests in flight; the agent absent, killed and started again.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from zeus_async.agent.client import agent_request, node_agent_config
from zeus_async.agent.protocol import Control, RequestTotals
from zeus_async.agent.server import NODE_SOCKET, node_agent_running
from zeus_async.devices.sim_config import SimConfig
from zeus_async.events import RequestIdle, RequestMeasurement
from zeus_async.inference.remote import RemoteMeter, _columns
from zeus_async.store.reader import RecordingReader
from zeus_async.testing.procs import sim_env

CONFIG = SimConfig(num_gpus=2, seed=5)


def _start_agent(
    private_dir: Path,
    record: str | None = None,
    policy: str = "equal",
    *,
    config: SimConfig = CONFIG,
    **settings: Any,
) -> subprocess.Popen[bytes]:
    """A node agent on the simulated node, settling requests often (quick tests); ``settings``
    override the agent's configuration (``requests_max_age_s=...``)."""
    options: dict[str, Any] = {"requests_settle_s": 0.1, "requests_edge_delay_s": 0.3}
    cfg = node_agent_config(
        backend="sim",
        workloads=False,
        record=record,
        requests_policy=policy,
        **{**options, **settings},
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeus_async.agent.server", msgspec.json.encode(cfg)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=sim_env(config),
    )
    _wait(
        lambda: _alive(proc) and node_agent_running() and (private_dir / NODE_SOCKET).exists(),
        60,
        "the node agent started",
    )
    return proc


def _alive(proc: subprocess.Popen[Any]) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"exited: {proc.stderr.read() if proc.stderr else ''!r}")
    return True


def _stop(proc: subprocess.Popen[Any], timeout_s: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)


@pytest.fixture
def agent(private_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = _start_agent(private_dir)
    yield proc
    _stop(proc)


def _totals(private_dir: Path) -> RequestTotals:
    reply = agent_request(f"ipc://{private_dir / NODE_SOCKET}", Control(seq=1, op="requests"))
    assert reply.requests_totals is not None
    return reply.requests_totals


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# A serving process: N requests on the given GPU (overlapping the other process's), every
# id the same as in the other process; then its results, as JSON.
CLIENT = """
import json, sys, time
from zeus_async.inference.remote import RemoteMeter
name, n, gpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = RemoteMeter(name=name, batch_s=0.02)
print("ready", flush=True)
sys.stdin.readline()
for i in range(n):
    m.begin(f"r{i}", gpus=(gpu,))
    time.sleep(0.01)
    m.phase(f"r{i}")
    time.sleep(0.02)
    if i % 5 == 4:
        m.abort(f"r{i}", "cancelled", tokens_in=10)
    else:
        m.end(f"r{i}", tokens_in=10, tokens_out=i + 1, route="/v1", model=name)
deadline = time.monotonic() + 20
while len(m.results()) < n and time.monotonic() < deadline:
    time.sleep(0.05)
out = {r.request_id: [r.energy_j, r.gpu_energy_j, r.finish_reason, r.tokens_out, r.model]
       for r in m.results()}
print(json.dumps({"results": out, "dropped": m.totals.dropped,
                  "sent": m.totals.sent_edges}), flush=True)
m.close()
"""


def _client(name: str, n: int, gpu: int = 0, **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, name, str(n), str(gpu)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=sim_env(CONFIG, **env),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
    return proc


@pytest.mark.slow
def test_processes_sharing_a_gpu_split_its_energy_once(private_dir: Path) -> None:
    recording = private_dir / "agent.zarc"
    agent = _start_agent(private_dir, record=str(recording))
    try:
        outs, totals = _serve_three(private_dir)
    finally:
        _stop(agent)
    _check_three(outs, totals, recording)


def _serve_three(private_dir: Path) -> tuple[list[dict[str, Any]], RequestTotals]:
    n = 20
    # Three serving processes: two on GPU 0, one on GPU 1 that sees it as its GPU 0
    # (CUDA_VISIBLE_DEVICES=1): its results come back in its own indices.
    procs = [_client("a", n), _client("b", n), _client("c", n, CUDA_VISIBLE_DEVICES="1")]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs, _totals(private_dir)


def _check_three(outs: list[dict[str, Any]], totals: RequestTotals, recording: Path) -> None:
    n = 20
    ids = {f"r{i}" for i in range(n)}
    for name, out in zip("abc", outs, strict=True):
        # Each process gets its own requests back, by its own ids, all of them, nothing else.
        assert set(out["results"]) == ids, (name, sorted(out["results"]))
        assert out["dropped"] == {} and out["sent"] == 3 * n
        for i in range(n):
            energy, gpus, reason, tokens_out, model = out["results"][f"r{i}"]
            assert reason == ("cancelled" if i % 5 == 4 else "completed")
            assert set(gpus) == {"0"} and energy > 0  # the client's index (JSON keys)
            assert math.isclose(sum(gpus.values()), energy, rel_tol=1e-9)
            if reason == "completed":
                assert tokens_out == i + 1 and model == name
    assert totals.active and totals.requests == 3 * n and totals.returned == 3 * n
    assert totals.finished == {"completed": 3 * 16, "cancelled": 3 * 4}
    assert totals.bad_input == {} and totals.dropped_edges == 0
    # Per GPU (the agent's indices): the requests of every process + idle == measured, and
    # the requests' part is exactly what the processes got back (each counted once).
    on_gpu0 = sum(e for out in outs[:2] for e, *_ in out["results"].values())
    on_gpu1 = sum(e for e, *_ in outs[2]["results"].values())
    for gpu, got in ((0, on_gpu0), (1, on_gpu1)):
        assert math.isclose(totals.requests_j[gpu], got, rel_tol=1e-6)
        assert math.isclose(totals.energy_j[gpu], got + totals.idle_j[gpu], rel_tol=1e-6), (
            gpu,
            totals,
        )
        assert totals.idle_j[gpu] > 0 and got > 0
    # Published on the agent's hub (here its recording): every request once, by its full
    # id, with the energy its process got; each interval's idle beside them.
    events = list(RecordingReader(recording))
    published = {e.request_id: e for e in events if isinstance(e, RequestMeasurement)}
    assert len(published) == 3 * n
    for name, out in zip("abc", outs, strict=True):
        for rid, (energy, *_) in out["results"].items():
            event = published[f"{name}/{rid}"]
            assert set(event.gpu_energy_j) == {1 if name == "c" else 0}  # the agent's index
            assert math.isclose(sum(event.gpu_energy_j.values()), energy, rel_tol=1e-12)
    idle = [e for e in events if isinstance(e, RequestIdle)]
    for gpu in (0, 1):
        measured = math.fsum(e.gpu_energy_j.get(gpu, 0.0) for e in idle)
        unused = math.fsum(e.gpu_idle_j.get(gpu, 0.0) for e in idle)
        used = math.fsum(e.gpu_energy_j.get(gpu, 0.0) for e in published.values())
        assert math.isclose(measured, used + unused, rel_tol=1e-6), gpu


HANGING = """
import sys, time
from zeus_async.inference.remote import RemoteMeter
m = RemoteMeter(name="hang", batch_s=0.01)
m.begin("stuck", gpus=(0,))
m.settle_soon()
while m.totals.sent_edges < 1:
    time.sleep(0.01)
print("begun", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_client_does_not_hold_the_others(
    agent: subprocess.Popen[bytes], private_dir: Path
) -> None:
    hang = subprocess.Popen(
        [sys.executable, "-c", HANGING],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=sim_env(CONFIG),
    )
    try:
        assert hang.stdout is not None
        assert hang.stdout.readline().strip() == "begun", hang.stderr
        with RemoteMeter(name="live", batch_s=0.02) as meter:
            meter.begin("x", gpus=(0,))
            time.sleep(0.05)
            meter.end("x", tokens_out=3)
            _wait(lambda: _totals(private_dir).in_flight == 1, 10, "the stuck request seen")
            # The stuck request holds nothing (policy equal): "x" settles while it lives.
            _wait(lambda: meter.settled("x") is not None, 10, "x settled, the stuck one live")
            assert _totals(private_dir).in_flight == 1
            hang.kill()
            hang.wait(timeout=10)
        # The stuck request: aborted as cancelled when its process died, settled too.
        _wait(lambda: _totals(private_dir).requests == 2, 10, "the stuck request settled")
        totals = _totals(private_dir)
        assert totals.orphaned == 1 and totals.in_flight == 0
        assert totals.finished == {"completed": 1, "cancelled": 1}
    finally:
        if hang.poll() is None:
            hang.kill()
        hang.communicate(timeout=10)


@pytest.mark.slow
def test_agent_absent_killed_and_back_drops_and_counts(private_dir: Path) -> None:
    endpoint = f"ipc://{private_dir / NODE_SOCKET}"
    meter = RemoteMeter(endpoint, name="svc", batch_s=0.02, reconnect_s=0.1)
    try:
        # No agent: nothing raises, every edge is dropped and counted.
        for i in range(5):
            meter.begin(f"a{i}")
            meter.end(f"a{i}", tokens_in=None)  # type: ignore[arg-type]
        _wait(lambda: meter.totals.dropped.get("no_agent") == 10, 5, "dropped: no agent")
        assert meter.connected_to is None and meter.totals.connects == 0

        agent = _start_agent(private_dir)
        try:
            _wait(lambda: meter.connected_to == endpoint, 10, "connected")
            meter.begin("b", gpus=(1,))
            time.sleep(0.05)
            meter.end("b", tokens_in="x")  # type: ignore[arg-type]  # bad: counted there
            _wait(lambda: meter.settled("b") is not None, 10, "b settled")
            b = meter.settled("b")
            assert b is not None and set(b.gpu_energy_j) == {1} and b.tokens_in == 0
            assert _totals(private_dir).bad_input == {"tokens": 1}
            agent.kill()  # gone without a word
            agent.wait(timeout=10)
            _wait(lambda: meter.connected_to is None, 5, "the agent's death seen")
            meter.begin("c")
            meter.end("c")
            _wait(lambda: meter.totals.dropped.get("no_agent") == 12, 5, "dropped: agent dead")
        finally:
            _stop(agent)
        agent = _start_agent(private_dir)
        try:
            _wait(lambda: meter.totals.connects == 2, 10, "connected again")
            meter.begin("d")
            time.sleep(0.05)
            meter.end("d")
            _wait(lambda: meter.settled("d") is not None, 10, "d settled")
            assert meter.totals.dropped == {"no_agent": 12}
            assert meter.totals.results == 2
        finally:
            _stop(agent)
    finally:
        meter.close()


def test_queue_bound_drops_on_the_serving_thread(private_dir: Path) -> None:
    meter = RemoteMeter(f"ipc://{private_dir}/none.sock", batch_s=30, max_queue=10)
    try:
        for i in range(100):
            meter.begin(f"r{i}")
        assert meter.pending == 10
        _wait(lambda: meter.totals.dropped.get("queue_full") == 90, 5, "counted")
    finally:
        meter.close()
    assert meter.totals.dropped == {"queue_full": 90, "no_agent": 10}


def test_columns_make_what_the_app_passed_wire_safe() -> None:
    batch = [
        (0, "r1", 5, (0, 1)),
        (0, 7, 6, "gpu0"),  # an id not a str, GPUs not indices
        (1, "r1", 7, "decode"),
        (2, "r1", 8, (3, None, "/v1", None, "")),
        (3, "r2", 9, (True, -2, 1, "m", "cancelled")),
        (4, [("r1", 2, 1, 30), ("bad",)], 10, (20, None)),
    ]
    msg = _columns(batch)
    assert msg.kind == [0, 0, 1, 2, 3]
    assert msg.id == ["r1", "7", "r1", "r1", "r2"]
    assert msg.gpus == [[0, 1], [], [], [], []]
    assert msg.tokens_in == [0, 0, 0, 3, -1] and msg.tokens_out == [0, 0, 0, -1, -1]
    assert msg.text == ["", "", "decode", "", "cancelled"]
    assert msg.route == ["", "", "", "/v1", "1"] and msg.model == ["", "", "", "", "m"]
    [step] = msg.steps
    assert (step.start_ns, step.end_ns, step.gpus, step.ids) == (10, 20, None, ["r1"])
    assert (step.prefill, step.decode, step.context) == ([2], [1], [30])
    msgspec.msgpack.encode(msg)


@pytest.mark.slow
def test_steps_and_explicit_times_reach_the_node_attributor(private_dir: Path) -> None:
    agent = _start_agent(private_dir, policy="steps")
    try:
        with RemoteMeter(name="engine", batch_s=0.02) as meter:
            # Two requests with the same edges, stamped after the fact (as an engine's stat
            # logger reports them); one step in between where "big" did far more work.
            # The attributor (started at the connection) has readings: it settled once.
            _wait(lambda: _totals(private_dir).settled_ns is not None, 10, "attributor on")
            t0 = time.time_ns()
            time.sleep(0.25)
            ms = 1_000_000
            for rid in ("big", "small", "twin"):
                meter.begin(rid, gpus=(1,), at_ns=t0)
            meter.step(
                [("big", 500, 0, 0), ("small", 0, 1, 10), ("twin", 0, 1, 10)],
                start_ns=t0 + 10 * ms,
                end_ns=t0 + 190 * ms,
                gpus=(1,),
            )
            for rid in ("big", "small", "twin"):
                meter.end(rid, tokens_in=10, tokens_out=1, at_ns=t0 + 200 * ms)
            _wait(lambda: len(meter.results()) == 3, 10, "settled")
            big, small, twin = (meter.settled(r) for r in ("big", "small", "twin"))
        totals = _totals(private_dir)
        assert totals.policy == "steps" and totals.bad_input == {}, totals
        assert big is not None and small is not None and twin is not None
        assert (big.begin_ns, big.end_ns) == (t0, t0 + 200 * ms)
        assert set(big.gpu_energy_j) == {1}
        # The step reached the attributor (its entries known: no bad input above). The
        # simulated GPU is idle: its power is the steps policy's base power (estimated from
        # its readings), split equally among the step's requests; only power above it goes
        # by the weights, so "big" gets at least as much as the others.
        assert big.energy_j >= small.energy_j * (1 - 1e-9)
        assert math.isclose(small.energy_j, twin.energy_j, rel_tol=1e-9)
    finally:
        _stop(agent)


APP = """
import asyncio
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from zeus_async.inference.asgi import EnergyMiddleware
from zeus_async.inference.remote import RemoteMeter

async def gen(request):
    await asyncio.sleep(0.05)
    request.state.tokens = (5, 7)
    return PlainTextResponse("ok")

# One meter per worker process (uvicorn imports this module in each).
app = EnergyMiddleware(
    Starlette(routes=[Route("/gen", gen)]), RemoteMeter(name="web", batch_s=0.02)
)
"""


@pytest.mark.slow
def test_uvicorn_workers_and_an_engine_process_share_one_gpu(
    agent: subprocess.Popen[bytes], private_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    import concurrent.futures
    import socket
    import urllib.request

    (tmp_path / "energy_app.py").write_text(APP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = sim_env(CONFIG)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    web = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "energy_app:app", "--workers", "2",
         "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )  # fmt: skip
    engine = _client("engine", 10)
    try:

        def get(_: int) -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/gen", timeout=10) as r:
                return str(r.read().decode())

        _wait(lambda: _up(port), 30, "uvicorn up")
        assert engine.stdin is not None
        engine.stdin.write("go\n")
        engine.stdin.flush()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(get, range(40))) == ["ok"] * 40
        out, err = engine.communicate(timeout=60)
        assert len(json.loads(out.strip().splitlines()[-1])["results"]) == 10, err
        # Every worker's requests and the engine's, settled by one attributor (the probes of
        # _up are not metered: /health is excluded).
        _wait(lambda: _totals(private_dir).requests == 50, 15, "all settled")
        totals = _totals(private_dir)
        assert totals.finished == {"completed": 48, "cancelled": 2}
        assert totals.returned == 50 and totals.bad_input == {}
        assert math.isclose(
            totals.energy_j[0], totals.requests_j[0] + totals.idle_j[0], rel_tol=1e-9
        )
        assert totals.requests_j[0] > 0 and totals.requests_j[1] == 0.0
    finally:
        web.terminate()
        web.communicate(timeout=20)
        if engine.poll() is None:
            engine.kill()
            engine.communicate(timeout=10)


def _up(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
    except urllib.error.HTTPError:
        return True  # a 404: serving
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_agent_command_line_sets_the_attributor(private_dir: Path) -> None:
    from zeus_async.testing.procs import start_node_agent

    proc = start_node_agent(sim_env(CONFIG), "--requests-policy", "tokens")
    try:
        assert _totals(private_dir) == RequestTotals(policy="tokens")  # not made yet
        with RemoteMeter(name="svc") as meter:
            assert meter.wait_connected()
            _wait(lambda: _totals(private_dir).active, 10, "made at the connection")
        assert _totals(private_dir).policy == "tokens"
    finally:
        _stop(proc)
