"""The engine-core scheduler hook (issue 38, item 4) driving the installed vLLM's real scheduler.

A real ``vllm.v1.core.sched.scheduler.Scheduler`` (and ``AsyncScheduler``) is built on CPU
the way ``EngineCore.__init__`` does (``scheduler_config.get_scheduler_cls()`` resolves
``--scheduler-cls``, then the constructor's keywords), with a small KV cache (one full-attention
group, 16-token blocks) and a stand-in for the model config (the scheduler reads a few flags
of it; building a real ``ModelConfig`` needs the model's files). The model runner is played by
the test: per step it returns a ``ModelRunnerOutput`` with one sampled token per request that
is past its prompt, as the GPU worker does. Time is a fake clock."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

import torch
from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from zeus_async.inference import RequestMeter, RequestSpan, StepEntry, attribute
from zeus_async.inference.attribution import StepSpan, default_step_weight
from zeus_async.integrations import vllm as plugin
from zeus_async.integrations import vllm_scheduler as hook
from zeus_async.testing.fakes import SquareWaveFeed

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
BLOCK = 16


class Recorder:
    """A meter that records the calls (RequestMeter's serving API, with step)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def begin(self, rid: str, gpus: Sequence[int] = (0,), *, at_ns: int | None = None) -> None:
        self.calls.append(("begin", rid, tuple(gpus), at_ns))

    def phase(self, rid: str, name: str = "decode", *, at_ns: int | None = None) -> None:
        self.calls.append(("phase", rid, at_ns))

    def end(self, rid: str, **kw: Any) -> None:
        self.calls.append(("end", rid, "completed", kw["tokens_in"], kw["tokens_out"], kw["at_ns"]))

    def abort(self, rid: str, reason: str = "cancelled", **kw: Any) -> None:
        self.calls.append(("end", rid, reason, kw["tokens_in"], kw["tokens_out"], kw["at_ns"]))

    def step(
        self, batch: Sequence[Any], *, start_ns: int, end_ns: int, gpus: Sequence[int] | None = None
    ) -> None:
        self.calls.append(("step", [tuple(e) for e in batch], start_ns, end_ns, tuple(gpus or ())))

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]


class _ModelFlags(types.SimpleNamespace):
    """What the scheduler reads of ``ModelConfig`` (a decoder-only text model)."""


def make_config(
    *, batched: int = 64, async_scheduling: bool = False, cls: str | None = hook.SCHEDULER_CLS
) -> VllmConfig:
    sc = SchedulerConfig.default_factory(
        max_num_batched_tokens=batched,
        max_num_seqs=8,
        max_model_len=512,
        enable_chunked_prefill=True,
        scheduler_cls=cls,
        async_scheduling=async_scheduling,
    )
    vc = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=sc,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
    )
    vc.cache_config.num_gpu_blocks = 64
    flags = _ModelFlags(
        uses_mrope=False,
        is_encoder_decoder=False,
        max_model_len=512,
        runner_type="generate",
        is_diffusion=False,
        is_multimodal_model=False,
        multimodal_config=None,
        supports_multimodal_inputs=False,
        return_sampling_mask=False,
        skip_tokenizer_init=True,
        served_model_name="tiny",
        model="tiny",
    )
    object.__setattr__(vc, "model_config", flags)
    return vc


def build(vc: VllmConfig) -> Any:
    """The scheduler as ``EngineCore.__init__`` makes it."""
    cls = vc.scheduler_config.get_scheduler_cls()
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    return cls(
        vllm_config=vc,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vc),
        include_finished_set=False,
        log_stats=False,
        block_size=BLOCK,
        hash_block_size=BLOCK,
    )


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> int:
        return self.t


def add(sched: Any, rid: str, prompt: int, max_tokens: int) -> None:
    sched.add_request(
        Request(
            rid,
            list(range(1, prompt + 1)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            arrival_time=time.time(),
        )
    )


def runner_output(sched: Any, out: Any) -> ModelRunnerOutput:
    """What the GPU worker returns: a token per request past its prompt."""
    ids = list(out.num_scheduled_tokens)
    sampled = [[] if sched.requests[r].is_prefill_chunk else [7] for r in ids]
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )


def engine_step(sched: Any, clock: Clock, gap_ms: int = 1, run_ms: int = 10) -> Any:
    """``EngineCore.step``: schedule, run on the GPU, update."""
    clock.t += gap_ms * MS
    out = sched.schedule()
    clock.t += run_ms * MS
    return sched.update_from_output(out, runner_output(sched, out))


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (plugin.ENV_METER, plugin.ENV_GPUS, plugin.ENV_MODEL, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    plugin.reset()
    yield
    plugin.reset()


def hooked(meter: Any, **kw: Any) -> tuple[Any, Clock]:
    plugin.configure(meter, gpus=[3], model="m")
    sched = build(make_config(**kw))
    clock = Clock()
    assert sched.zeus_feed is not None
    sched.zeus_feed.clock = clock
    return sched, clock


def test_the_official_scheduler_cls_builds_vllms_scheduler_with_the_hook() -> None:
    sched = build(make_config())
    assert isinstance(sched, Scheduler) and not isinstance(sched, AsyncScheduler)
    assert type(sched).__name__ == "ZeusScheduler"
    asched = build(make_config(async_scheduling=True))
    assert isinstance(asched, AsyncScheduler)
    assert type(asched).__name__ == "ZeusAsyncScheduler"
    assert hook.hook_enabled(make_config())
    assert not hook.hook_enabled(make_config(cls=None))


def test_steps_carry_each_requests_prefill_decode_and_context_with_chunked_prefill() -> None:
    meter = Recorder()
    sched, clock = hooked(meter, batched=64)
    add(sched, "a", 40, 3)
    add(sched, "b", 100, 2)
    for _ in range(5):
        engine_step(sched, clock)
    t = lambda i, ms: T0 + (i * 11 + ms) * MS  # noqa: E731  step i: scheduled +1, done +11
    steps = meter.of("step")
    assert [s[1] for s in steps] == [
        [("a", 40, 0, 0), ("b", 24, 0, 0)],  # a whole prompt, b's first chunk (64 tokens)
        [("a", 0, 1, 40), ("b", 63, 0, 24)],  # a decodes; b's second chunk
        [("a", 0, 1, 41), ("b", 13, 0, 87)],  # a's last token; b's prompt done
        [("b", 0, 1, 100)],
    ]
    assert [(s[2], s[3], s[4]) for s in steps] == [(t(i, 1), t(i, 11), (3,)) for i in range(4)]
    assert meter.calls[:3] == [
        ("begin", "a", (3,), t(0, 1)),
        ("begin", "b", (3,), t(0, 1)),
        ("step", *steps[0][1:]),
    ]
    assert ("phase", "a", t(1, 1)) in meter.calls
    assert ("phase", "b", t(3, 1)) in meter.calls
    # ends at the update of the step that produced the last token, with vLLM's counts
    assert meter.of("end") == [
        ("end", "a", "completed", 40, 3, t(2, 11)),
        ("end", "b", "completed", 100, 2, t(3, 11)),
    ]
    assert sched.zeus_feed.open == {}
    assert sched.zeus_feed.counts["completed"] == 2


def test_a_client_abort_ends_the_request_as_cancelled_and_a_queued_one_sends_nothing() -> None:
    meter = Recorder()
    sched, clock = hooked(meter, batched=64)
    add(sched, "a", 20, 50)
    add(sched, "b", 20, 50)
    engine_step(sched, clock)
    engine_step(sched, clock)
    add(sched, "late", 20, 5)  # aborted before it is ever scheduled
    clock.t += 3 * MS
    # EngineCore.abort_requests -> scheduler.finish_requests(ids, FINISHED_ABORTED)
    sched.finish_requests(["a", "late"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("b", RequestStatus.FINISHED_ERROR)
    assert meter.of("end") == [
        ("end", "a", "cancelled", 20, 2, clock.t),
        ("end", "b", "error", 20, 2, clock.t),
    ]
    assert not [c for c in meter.calls if c[1] == "late"]
    engine_step(sched, clock)  # the finished ids pass through the next SchedulerOutput
    assert len(meter.of("end")) == 2
    assert sched.zeus_feed.counts == {"completed": 0, "cancelled": 1, "error": 1}


def test_a_finish_below_the_public_methods_is_caught_from_finished_req_ids() -> None:
    meter = Recorder()
    sched, clock = hooked(meter)
    add(sched, "a", 20, 50)
    engine_step(sched, clock)
    req = sched.requests["a"]  # finished by an internal path (e.g. a KV-load failure)
    sched.running.remove(req)
    req.status = RequestStatus.FINISHED_ERROR
    sched._free_request(req)
    engine_step(sched, clock)
    assert meter.of("end") == [("end", "a", "error", 20, 1, T0 + 12 * MS)]


def test_async_scheduling_steps_do_not_overlap_on_the_gpu() -> None:
    """AsyncScheduler: step N+1 is scheduled before step N's output is back (as
    ``EngineCore.step_with_batch_queue`` does); its start is cut at N's end."""
    meter = Recorder()
    sched, clock = hooked(meter, async_scheduling=True)
    add(sched, "a", 30, 4)
    clock.t += MS
    first = sched.schedule()
    for _ in range(6):
        clock.t += 2 * MS
        nxt = sched.schedule()  # the next step, while the GPU runs ``first``
        clock.t += 8 * MS
        sched.update_from_output(first, runner_output(sched, first))
        first = nxt
    steps = meter.of("step")
    assert [s[1] for s in steps][:4] == [
        [("a", 30, 0, 0)],
        [("a", 0, 1, 30)],
        [("a", 0, 1, 31)],
        [("a", 0, 1, 32)],
    ]
    for prev, cur in itertools.pairwise(steps):
        assert cur[2] == prev[3]  # starts where the previous step ended
    assert meter.of("end") == [("end", "a", "completed", 30, 4, steps[3][3])]


def test_without_a_meter_the_scheduler_is_vllms_and_a_forked_meter_is_not_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = build(make_config())
    assert sched.zeus_feed is None
    add(sched, "a", 20, 2)
    clock = Clock()
    outs = [engine_step(sched, clock) for _ in range(2)]
    assert outs[1][0].outputs[0].finish_reason is not None  # vLLM's own behaviour
    # a meter configured in a parent process (inherited by a fork) is not fed
    meter = Recorder()
    plugin.configure(meter)
    plugin._config.pid = os.getpid() + 1
    assert hook.feed_for_core(make_config()) is None
    assert "belongs to process" in caplog.text


def test_a_failing_meter_never_reaches_vllm() -> None:
    class Broken(Recorder):
        def step(self, *a: Any, **k: Any) -> None:
            raise RuntimeError("boom")

    sched, clock = hooked(Broken())
    add(sched, "a", 20, 2)
    outs = [engine_step(sched, clock) for _ in range(2)]
    assert outs[1][0].outputs[0].finish_reason is not None


def test_the_stat_logger_steps_aside_when_the_scheduler_hook_runs() -> None:
    plugin.configure(Recorder())
    cls = plugin.ZeusStatLogger
    assert cls(make_config(), 0).feed is None
    assert cls(make_config(cls=None), 0).feed is not None


def test_importing_zeus_async_does_not_import_vllm() -> None:
    code = (
        "import sys, zeus_async, zeus_async.integrations.vllm_scheduler as h; "
        "assert h.SCHEDULER_CLS.endswith('ZeusScheduler'); "
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def Feed(meter: RequestMeter) -> SquareWaveFeed:
    """Readings every 5 ms (power 100 W, 600 W alternating every 50 ms)."""
    return SquareWaveFeed(meter.add, gpu=3, t0_ns=T0, half_period_ns=50 * MS, every_ns=5 * MS)


def test_steps_policy_follows_the_schedulers_batches_and_conserves_energy() -> None:
    clock = Clock()
    meter = RequestMeter(
        "steps",
        gpus=[3],
        clock=clock,
        lag_s=0.01,
        max_edge_delay_s=0.1,
        max_age_s=60.0,
        step_base_w=100.0,
    )
    feed = Feed(meter)
    sched, _ = hooked(meter, batched=48)
    sched.zeus_feed.clock = clock
    rec = Recorder()  # the same edges, to build the reference
    tee = hook.SchedulerFeed(rec, (3,), model="m", clock=clock)
    real = sched.zeus_feed

    class Both:
        def on_schedule(self, *a: Any) -> None:
            real.on_schedule(*a)
            tee.on_schedule(*a)

        def on_update(self, *a: Any) -> None:
            real.on_update(*a)
            tee.on_update(*a)

        def on_finish(self, *a: Any) -> None:
            real.on_finish(*a)
            tee.on_finish(*a)

    sched.zeus_feed = Both()
    plan = {0: [("a", 70, 6), ("b", 10, 12)], 3: [("c", 40, 4)], 8: [("d", 30, 20)]}
    for i in range(30):
        for rid, prompt, n in plan.get(i, []):
            add(sched, rid, prompt, n)
        if i == 12:
            clock.t += MS
            sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
        engine_step(sched, clock, gap_ms=2, run_ms=7 + (i % 3))
        feed.to(clock.t)
        meter.settle()
    clock.t += 500 * MS
    feed.to(clock.t)
    meter.settle()
    meter.settle()

    assert meter.totals.bad_input == {}
    assert meter.totals.finished == {"completed": 3, "cancelled": 1}
    got = {r: meter.settled(r) for r in "abcd"}
    assert all(g is not None and g.energy_j > 0 for g in got.values())
    assert got["d"].finish_reason == "cancelled"  # type: ignore[union-attr]

    # the reference: attribute() over the same requests and steps, on the reference history
    spans, opened, decode = [], {}, {}
    for c in rec.calls:
        if c[0] == "begin":
            opened[c[1]] = c[3]
        elif c[0] == "phase":
            decode[c[1]] = c[2]
        elif c[0] == "end":
            spans.append(RequestSpan(c[1], (3,), opened[c[1]], c[5], decode.get(c[1]), c[3], c[4]))
    steps = [
        StepSpan(s[2], s[3], (3,), tuple((e[0], default_step_weight(StepEntry(*e))) for e in s[1]))
        for s in rec.of("step")
    ]
    assert len(steps) == 13

    def energy(gpu: int, a: int, b: int) -> float:
        return feed.reference.energy(a, b).energy_j or 0.0

    want = attribute(
        spans,
        energy,
        start_ns=T0,
        end_ns=clock.t - 200 * MS,
        policy="steps",
        steps=steps,
        step_base_w=100.0,
    )
    for rid, w in want.requests.items():
        g = meter.settled(rid)
        assert g is not None
        assert g.energy_j == pytest.approx(w.energy_j, rel=1e-4), rid
    totals = meter.totals
    assert totals.requests_j[3] + totals.idle_j[3] == pytest.approx(totals.energy_j[3], rel=1e-12)
    assert sum(r.energy_j for r in meter.results()) == pytest.approx(
        totals.requests_j[3], rel=1e-12
    )


def test_speculative_and_recomputed_tokens_are_split_as_documented() -> None:
    """vLLM's real SchedulerOutput, filled as the scheduler would for: a request decoding with
    2 draft tokens, one resumed after a preemption (prompt and 3 generated tokens recomputed),
    one with a prefix-cache hit."""
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=["spec", "resumed"],
        resumed_req_ids={"resumed"},
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None, None],
        num_computed_tokens=[50, 0],
        num_output_tokens=[10, 3],
    )
    out.scheduled_new_reqs = [
        NewRequestData(
            req_id="cached",
            prompt_token_ids=list(range(64)),
            mm_features=[],
            sampling_params=None,
            pooling_params=None,
            block_ids=([0],),
            num_computed_tokens=32,
            lora_request=None,
        )
    ]
    out.num_scheduled_tokens = {"spec": 3, "resumed": 23, "cached": 32}
    out.scheduled_spec_decode_tokens = {"spec": [5, 6]}
    prompts = {"spec": 40, "resumed": 20, "cached": 64}
    reqs = {r: types.SimpleNamespace(num_prompt_tokens=p) for r, p in prompts.items()}
    assert hook.step_entries(out, reqs) == [
        ("spec", 0, 3, 50),
        ("resumed", 22, 1, 0),
        ("cached", 32, 0, 32),
    ]


def test_the_environment_gives_the_engine_core_a_remote_meter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zeus_async.inference.remote import RemoteMeter

    monkeypatch.setenv(plugin.ENV_METER, "remote")
    monkeypatch.setenv(plugin.ENV_GPUS, "4,5")
    feed = hook.feed_for_core(make_config())
    assert feed is not None
    try:
        assert isinstance(feed.meter, RemoteMeter)
        assert feed.meter.name == "vllm-core0"
        assert (feed.gpus, feed.model) == ((4, 5), "tiny")
    finally:
        feed.meter.close()  # type: ignore[attr-defined]
