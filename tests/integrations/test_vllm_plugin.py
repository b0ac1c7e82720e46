"""The vLLM stat-logger plugin (issue 38, item 4) against the installed vLLM's own classes.

A scripted engine drives vLLM's real stats code exactly as its front end (``OutputProcessor``)
does: per engine step, a real ``IterationStats`` is filled from real ``EngineCoreOutput``s
(``update_from_output``, with the QUEUED/SCHEDULED events on a request's first output) and
``update_from_finished_request`` makes the ``FinishedRequestStats``; vLLM's own
``PerEngineStatLoggerAdapter`` (what ``StatLoggerManager`` wraps a per-engine plugin in) then
calls the plugin's ``record``. Engine-core timestamps are on a monotonic clock unrelated to
the wall clock; the front end sees each batch DELAY later."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

loggers = pytest.importorskip("vllm.v1.metrics.loggers")

from vllm.config import DeviceConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.v1.engine import (  # noqa: E402
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    FinishReason,
)
from vllm.v1.metrics.stats import (  # noqa: E402
    IterationStats,
    LoRARequestStates,
    RequestStateStats,
    SchedulerStats,
)

from zeus_async.inference import RequestMeter, RequestSpan, attribute  # noqa: E402
from zeus_async.integrations import vllm as plugin  # noqa: E402
from zeus_async.testing.fakes import SquareWaveFeed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MS = 1_000_000
T0 = 1_700_000_000_000_000_000  # wall clock, ns
MONO0 = 5_000.0  # the engine core's monotonic clock at T0, s
DELAY_NS = 300_000  # engine core -> front end
US = 1_000  # vLLM's timestamps are float seconds: about 0.2 us of resolution at T0


def wall_s(t_ms: float) -> float:
    return (T0 + t_ms * MS) / 1e9


def mono(t_ms: float) -> float:
    return MONO0 + t_ms / 1000.0


@dataclass
class Req:
    rid: str
    arrival_ms: float
    sched_ms: float
    token_ms: list[float]  # engine steps at which it output a token (the first: its prefill)
    finish: FinishReason
    prompt: int = 40
    cached: int = 0
    finish_ms: float | None = None  # default: its last token's step
    state: RequestStateStats = field(default_factory=RequestStateStats)

    @property
    def end_ms(self) -> float:
        return self.finish_ms if self.finish_ms is not None else self.token_ms[-1]


def script() -> list[Req]:
    """Steps every 20 ms; requests overlapping, every finish reason, a parallel-sampling id."""
    steps = lambda a, b: [float(t) for t in range(a, b + 1, 20)]  # noqa: E731
    return [
        Req("a", 95, 110, steps(130, 250), FinishReason.LENGTH, prompt=50, cached=10),
        Req("b", 118, 130, steps(150, 210), FinishReason.STOP, prompt=30),
        Req("c", 140, 150, steps(170, 230), FinishReason.ABORT, prompt=20),  # engine-side
        Req("d", 180, 190, [], FinishReason.ERROR, prompt=25, finish_ms=210),  # no token
        Req("e", 200, 210, steps(230, 290), FinishReason.STOP, prompt=12),  # n=2: twice
        Req("e", 200, 210, steps(230, 330), FinishReason.REPETITION, prompt=12),
    ]


def run_engine(
    reqs: Sequence[Req], stat_logger: Any, engine_idx: int = 0, on_step: Any = None
) -> None:
    """Drive vLLM's stats code as AsyncLLM's output handler does, one engine step at a time."""
    lora = LoRARequestStates(log_stats=True)
    for r in reqs:
        r.state.arrival_time = wall_s(r.arrival_ms)
    times = sorted({t for r in reqs for t in (*r.token_ms, r.end_ms)})
    first = {id(r): True for r in reqs}
    for t in times:
        front_ns = T0 + round(t * MS) + DELAY_NS
        if on_step is not None:
            on_step(front_ns)
        it = IterationStats()
        it.iteration_timestamp = front_ns / 1e9
        for r in reqs:
            tokens = [7] if t in r.token_ms else []
            if not tokens and t != r.end_ms:
                continue
            finished = r.finish if t == r.end_ms else None
            events = None
            if first[id(r)]:
                events = [
                    EngineCoreEvent.new_event(EngineCoreEventType.QUEUED, mono(r.arrival_ms + 1)),
                    EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED, mono(r.sched_ms)),
                ]
            out = EngineCoreOutput(
                request_id=r.rid, new_token_ids=tokens, finish_reason=finished, events=events
            )
            it.update_from_output(out, mono(t), first[id(r)], r.state, lora, None)
            first[id(r)] = False
            if finished is not None:
                it.update_from_finished_request(
                    finished, r.rid, r.prompt, None, r.state, num_cached_tokens=r.cached
                )
        stat_logger.record(
            scheduler_stats=SchedulerStats(num_running_reqs=1),
            iteration_stats=it,
            mm_cache_stats=None,
            engine_idx=engine_idx,
        )


class Recorder:
    """A meter that records the calls (the serving API of RequestMeter / RemoteMeter)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def begin(self, rid: str, gpus: Sequence[int] = (0,), *, at_ns: int | None = None) -> None:
        self.calls.append(("begin", rid, tuple(gpus), at_ns))

    def phase(self, rid: str, name: str = "decode", *, at_ns: int | None = None) -> None:
        self.calls.append(("phase", rid, name, at_ns))

    def end(self, rid: str, **kw: Any) -> None:
        self.calls.append(("end", rid, "completed", kw["tokens_in"], kw["tokens_out"], kw))

    def abort(self, rid: str, reason: str = "cancelled", **kw: Any) -> None:
        self.calls.append(("end", rid, reason, kw["tokens_in"], kw["tokens_out"], kw))


def make_config(tp: int = 1, dp: int = 1) -> VllmConfig:
    pc = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, data_parallel_size_local=dp)
    return VllmConfig(parallel_config=pc, device_config=DeviceConfig(device="cpu"))


def make_logger(config: VllmConfig, engines: Sequence[int] = (0,)) -> Any:
    """The plugin as vLLM builds it: loaded from the entry point, wrapped per engine."""
    (cls,) = [
        f for f in loggers.load_stat_logger_plugin_factories() if f.__name__ == "ZeusStatLogger"
    ]
    return loggers.PerEngineStatLoggerAdapter(config, list(engines), cls)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (plugin.ENV_METER, plugin.ENV_GPUS, plugin.ENV_MODEL, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    plugin.reset()
    yield
    plugin.reset()


def test_entry_point_is_in_pyproject_and_vllm_loads_it_as_a_stat_logger() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    group = project["entry-points"][plugin.ENTRY_POINT_GROUP]
    assert group == {plugin.ENTRY_POINT_NAME: "zeus_async.integrations.vllm:ZeusStatLogger"}
    from vllm.plugins import STAT_LOGGER_PLUGINS_GROUP

    assert plugin.ENTRY_POINT_GROUP == STAT_LOGGER_PLUGINS_GROUP
    (ep,) = [e for e in entry_points(group=STAT_LOGGER_PLUGINS_GROUP) if e.name == "zeus_async"]
    cls = ep.load()
    assert cls is plugin.ZeusStatLogger  # made once
    assert issubclass(cls, loggers.StatLoggerBase)
    assert not issubclass(cls, loggers.AggregateStatLoggerBase)  # one per engine
    assert cls in loggers.load_stat_logger_plugin_factories()  # what AsyncLLM calls


def test_importing_the_module_does_not_import_vllm() -> None:
    code = (
        "import sys, zeus_async.integrations.vllm as z\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
        "z.configure(None)\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_edges_tokens_and_finish_reasons_come_from_vllms_stats() -> None:
    meter = Recorder()
    plugin.configure(meter, model="llama")
    reqs = script()
    run_engine(reqs, make_logger(make_config()))

    calls = meter.calls
    ids = [c[1] for c in calls if c[0] == "begin"]
    # In the order they finished; the second child of "e" gets a unique id.
    assert ids == ["b", "d", "c", "a", "e", "e#1"]
    by_id: dict[str, list[tuple[Any, ...]]] = {}
    for c in calls:
        by_id.setdefault(c[1], []).append(c)
    for r, rid in zip(reqs, ["a", "b", "c", "d", "e", "e#1"], strict=True):
        got = by_id[rid]
        # Every edge is where the engine put it, as the front end sees it (DELAY later).
        begin = got[0]
        assert begin[:3] == ("begin", rid, (0,))
        assert begin[3] == pytest.approx(T0 + r.sched_ms * MS + DELAY_NS, abs=US)
        end = got[-1]
        assert end[5]["at_ns"] == pytest.approx(T0 + r.end_ms * MS + DELAY_NS, abs=US)
        assert end[5]["model"] == "llama"
        if r.token_ms:
            assert got[1][:3] == ("phase", rid, "decode")
            assert got[1][3] == pytest.approx(T0 + r.token_ms[0] * MS + DELAY_NS, abs=US)
        else:
            assert len(got) == 2  # no token: no decode phase
        reason = {
            FinishReason.STOP: "completed",
            FinishReason.LENGTH: "completed",
            FinishReason.REPETITION: "completed",
            FinishReason.ABORT: "cancelled",
            FinishReason.ERROR: "error",
        }[r.finish]
        # Prompt tokens computed (prefix-cache hits are not prefill work), tokens generated.
        assert end[2:5] == (reason, r.prompt - r.cached, len(r.token_ms))
    assert by_id["a"][-1][3] == 40


def test_a_request_without_engine_timestamps_is_placed_by_arrival_and_queue_time() -> None:
    """Scheduled but failed before its first output reached the front end: vLLM's last-token
    timestamp is unset (0), so its inference time is not a duration."""
    from vllm.v1.metrics.stats import FinishedRequestStats

    meter = Recorder()
    feed = plugin.StatsFeed(meter, (0,))
    fr = FinishedRequestStats(
        finish_reason=FinishReason.ERROR,
        request_id="x",
        e2e_latency=0.5,
        queued_time=0.125,
        inference_time=0.0 - mono(100),  # last_token_ts (unset) - scheduled_ts
        decode_time=0.0,
        num_prompt_tokens=10,
    )
    feed.feed_finished(fr, wall_s(1000))
    end = T0 + 1000 * MS
    assert meter.calls[0] == ("begin", "x", (0,), pytest.approx(end - 375 * MS, abs=US))
    assert [c[0] for c in meter.calls] == ["begin", "end"]  # no decode phase
    assert meter.calls[1][:5] == ("end", "x", "error", 10, 0)
    assert (feed.partial, dict(feed.counts)) == (1, {"error": 1})


def test_engine_gpus_follow_tensor_parallel_ranks_and_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = make_config(tp=2, dp=2)
    assert config.parallel_config.world_size == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    meter = Recorder()
    plugin.configure(meter)
    adapter = make_logger(config, engines=(0, 1))
    run_engine(script()[:1], adapter, engine_idx=1)
    run_engine(script()[1:2], adapter, engine_idx=0)
    begins = [c for c in meter.calls if c[0] == "begin"]
    # engine 1: the second TP group of the visible devices; its ids are prefixed
    assert [(c[1], c[2]) for c in begins] == [("e1:a", (6, 7)), ("b", (4, 5))]

    env = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}  # UUIDs: positions instead
    assert plugin.engine_gpus(2, 0, env=env) == (0, 1)
    assert plugin.engine_gpus(2, 1, env={}) == (2, 3)
    env = {plugin.ENV_GPUS: "3,2;1,0", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert plugin.engine_gpus(2, 1, env=env) == (1, 0)
    assert plugin.engine_gpus(2, 1, env={plugin.ENV_GPUS: "3"}) == (3,)
    assert plugin.engine_gpus(2, 1, gpus={1: [9]}, engine_index=1, env=env) == (9,)
    assert plugin.engine_gpus(2, 0, gpus=[8, 9], env=env) == (8, 9)
    # an engine on another node (multi-node data parallel): mapped to no GPU, not fed
    plugin.configure(meter, gpus={0: [0, 1], 1: []})
    assert plugin.feed_for(config, 1) is None
    feed = plugin.feed_for(config, 0)
    assert feed is not None and feed.gpus == (0, 1)


def test_without_a_meter_the_plugin_is_inert_and_never_raises_into_vllm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_engine(script(), make_logger(make_config()))  # no meter: nothing, no error
    assert "no meter" in caplog.text

    class Broken(Recorder):
        def begin(self, *a: Any, **k: Any) -> None:
            raise RuntimeError("boom")

    plugin.configure(Broken())
    caplog.clear()
    run_engine(script(), make_logger(make_config()))  # an exception here would fail vLLM
    assert caplog.text.count("a batch's stats were dropped") == 1


def test_a_bad_meter_setting_in_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(plugin.ENV_METER, "local")
    assert plugin.feed_for(make_config()) is None
    assert "only 'remote' is known" in caplog.text


def test_the_environment_selects_a_remote_meter_for_the_node_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zeus_async.inference.remote import RemoteMeter

    monkeypatch.setenv(plugin.ENV_METER, "remote")
    monkeypatch.setenv(plugin.ENV_GPUS, "2,3")
    monkeypatch.setenv(plugin.ENV_MODEL, "served")
    feed = plugin.feed_for(make_config(tp=2))
    assert feed is not None
    try:
        assert isinstance(feed.meter, RemoteMeter)
        assert (feed.gpus, feed.model) == ((2, 3), "served")
    finally:
        feed.meter.close()  # type: ignore[attr-defined]


def Feed(meter: RequestMeter) -> SquareWaveFeed:
    """Readings every 10 ms (power steps between 100 and 600 W every 100 ms) into the meter
    and a reference history."""
    return SquareWaveFeed(meter.add, gpu=0, t0_ns=T0, half_period_ns=100 * MS, every_ns=10 * MS)


@pytest.mark.parametrize("policy", ["equal", "tokens"])
def test_settled_energy_matches_the_reference_and_is_conserved(policy: str) -> None:
    clock = [T0]
    meter = RequestMeter(
        policy,  # type: ignore[arg-type]
        gpus=[0],
        clock=lambda: clock[0],
        lag_s=0.02,
        max_edge_delay_s=0.5,  # the longest request here is 240 ms, reported at its end
    )
    feed = Feed(meter)
    plugin.configure(meter, model="m")
    reqs = script()

    def on_step(now: int) -> None:
        clock[0] = now
        feed.to(now)
        meter.settle()

    run_engine(reqs, make_logger(make_config()), on_step=on_step)
    clock[0] = T0 + 2000 * MS
    feed.to(clock[0])
    meter.settle()
    meter.settle()

    assert meter.totals.bad_input == {}  # no edge late, none dropped
    assert meter.totals.finished == {"completed": 4, "cancelled": 1, "error": 1}
    spans = []
    for r, rid in zip(reqs, ["a", "b", "c", "d", "e", "e#1"], strict=True):
        got = meter.settled(rid)
        assert got is not None, rid
        assert got.model == "m"
        assert (got.tokens_in, got.tokens_out) == (r.prompt - r.cached, len(r.token_ms))
        spans.append(
            RequestSpan(
                rid, (0,), got.begin_ns, got.end_ns, got.decode_ns, got.tokens_in, got.tokens_out
            )
        )
        assert got.begin_ns == pytest.approx(T0 + r.sched_ms * MS + DELAY_NS, abs=US)
        assert got.end_ns == pytest.approx(T0 + r.end_ms * MS + DELAY_NS, abs=US)

    def energy(gpu: int, a: int, b: int) -> float:
        return feed.reference.energy(a, b).energy_j or 0.0

    want = attribute(spans, energy, start_ns=T0, end_ns=T0 + 1000 * MS, policy=policy)  # type: ignore[arg-type]
    for rid, w in want.requests.items():
        got = meter.settled(rid)
        assert got is not None
        assert got.energy_j == pytest.approx(w.energy_j, rel=1e-4), rid
        assert got.energy_j > 0
    totals = meter.totals
    assert totals.requests_j[0] + totals.idle_j[0] == pytest.approx(totals.energy_j[0], rel=1e-12)
    assert sum(r.energy_j for r in meter.results()) == pytest.approx(
        totals.requests_j[0], rel=1e-12
    )
