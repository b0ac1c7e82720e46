"""Energy per request in vLLM, from inside the engine core: a scheduler that feeds the meter.

vLLM's stat loggers (:mod:`zeus_async.integrations.vllm`) run in the front-end process and
see a request only when it finishes: no per-step batch composition, no client aborts. What
the GPU computed is decided in the engine-core process by the v1 scheduler, and vLLM 0.33
offers an official way to put a scheduler of one's own there:
``SchedulerConfig.scheduler_cls`` (``vllm serve --scheduler-cls CLASS``, or
``EngineArgs(scheduler_cls=...)``), which ``EngineCore.__init__`` resolves by qualified
name (``get_scheduler_cls``) in the engine-core process and instantiates with
``Scheduler``'s constructor arguments. Name::

    --scheduler-cls zeus_async.integrations.vllm_scheduler.ZeusScheduler

:class:`ZeusScheduler` builds vLLM's own scheduler (``AsyncScheduler`` when
``scheduler_config.async_scheduling`` is on, else ``Scheduler``; the base is not replaced, so
vLLM keeps its async-scheduling path) extended by three overrides, each calling vLLM's method
first and then, never raising into vLLM, feeding the meter:

- ``schedule()`` -> ``SchedulerOutput``: the step's requests (``num_scheduled_tokens`` per
  request id; the context, tokens already in the KV cache, from ``scheduled_new_reqs`` /
  ``scheduled_cached_reqs.num_computed_tokens``); a request's first scheduling is its
  ``begin`` (time in the queue is not the GPU's) and its first step with a decode token its
  ``phase("decode")``; ids in ``finished_req_ids`` that are still open are ended here (a
  catch-all for finishes taken by paths below the public methods);
- ``update_from_output(scheduler_output, model_runner_output)``: the step is over:
  ``meter.step(batch, start_ns=<schedule() returned>, end_ns=<now>, gpus=<the engine's>)``
  (the start is cut at the previous step's end: with async scheduling the next step is
  scheduled while the GPU still runs the last one); requests whose output carries a finish
  reason ``end`` (or ``abort`` for vLLM's ``abort`` / ``error``) with their token counts;
- ``finish_requests(ids, status)``: where the front end's aborts land (a client hanging up,
  ``AsyncLLM.abort``): ``FINISHED_ABORTED`` -> ``abort(id, "cancelled")``,
  ``FINISHED_ERROR`` -> ``abort(id, "error")``; a request aborted before it was ever scheduled
  was never begun and sends nothing.

Prefill and decode tokens of a request in a step: tokens at positions below the prompt length
are prefill; beyond it, up to ``1 + <its speculative tokens>`` are decode (the sampled token
fed back, and drafts), any more are prefill (recomputing generated tokens after a preemption).

Request ids are the engine core's: vLLM 0.33's front end (``InputProcessor.assign_request_id``)
appends ``-`` and 8 random characters to the id the client gave (unless
``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``), and the core never sees the external id; the
results carry the internal id (``id.rsplit("-", 1)[0]`` is the client's). The front end's
stat logger, which only knows external ids, steps aside for an engine whose scheduler is
this one (:func:`hook_enabled`): each request is told to the meter once, by the core.

Where the meter comes from: :func:`zeus_async.integrations.vllm.configure` when the engine
core runs in the process that called it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; a meter
configured in a parent process and inherited by a fork is not used, it would be fed
nowhere), else ``ZEUS_ASYNC_VLLM_METER=remote`` (a ``RemoteMeter`` to the node agent, the
normal case: the engine core is its own process), else the scheduler is plain vLLM's (one
warning). GPUs and model label as for the stat logger (``ZEUS_ASYNC_VLLM_GPUS``,
``CUDA_VISIBLE_DEVICES``, ``ZEUS_ASYNC_VLLM_MODEL``).

Importing this module does not import vLLM; the scheduler classes are made on first use.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol, cast

from zeus_async.integrations import vllm as _plugin

__all__ = [
    "SCHEDULER_CLS",
    "SchedulerFeed",
    "StepMeter",
    "ZeusScheduler",
    "feed_for_core",
    "hook_enabled",
    "step_entries",
]

logger = logging.getLogger(__name__)

#: What ``--scheduler-cls`` names.
SCHEDULER_CLS: Final = _plugin.SCHEDULER_CLS

#: vLLM ``RequestStatus`` name of a request finished from outside -> the abort reason
#: (others, e.g. ``FINISHED_STOPPED``, are ends).
_STATUS_ABORT: Final[Mapping[str, str]] = {
    "FINISHED_ABORTED": "cancelled",
    "FINISHED_ERROR": "error",
}
#: Steps scheduled and not yet updated, at most (a SchedulerOutput vLLM dropped).
_MAX_PENDING = 64


class StepMeter(_plugin.MeterLike, Protocol):
    """The plugin's meter API plus ``step`` (``RequestMeter`` and ``RemoteMeter`` have it)."""

    def step(
        self, batch: Sequence[Any], *, start_ns: int, end_ns: int, gpus: Sequence[int] | None = ...
    ) -> Any:
        """One engine step."""


class _Open:
    """A request the meter was told began (its vLLM ``Request``: tokens at its finish)."""

    __slots__ = ("decoding", "request")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.decoding = False


def step_entries(
    scheduler_output: Any, requests: Mapping[str, Any]
) -> list[tuple[str, int, int, int]]:
    """``(request_id, prefill_tokens, decode_tokens, context_len)`` of each request of a
    ``SchedulerOutput`` (see the module docstring for the prefill/decode split);
    ``requests``: the scheduler's ``requests`` (id -> ``Request``)."""
    scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
    if not scheduled:
        return []
    context: dict[str, int] = {}
    for new in scheduler_output.scheduled_new_reqs:
        context[new.req_id] = int(new.num_computed_tokens)
    cached = scheduler_output.scheduled_cached_reqs
    for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
        context[rid] = int(computed)
    spec: Mapping[str, Sequence[int]] = scheduler_output.scheduled_spec_decode_tokens or {}
    out: list[tuple[str, int, int, int]] = []
    for rid, n in scheduled.items():
        n = int(n)
        ctx = context.get(rid, 0)
        req = requests.get(rid)
        prompt = int(getattr(req, "num_prompt_tokens", 0) or 0) if req is not None else ctx + n
        prefill = max(0, min(n, prompt - ctx))
        decode = min(n - prefill, 1 + len(spec.get(rid, ())))
        out.append((rid, n - decode, decode, ctx))
    return out


class SchedulerFeed:
    """Feeds a meter from one engine core's scheduler (no vLLM import: it reads the
    attributes of vLLM's objects). Every method is called by :class:`ZeusScheduler` after
    vLLM's own, with the scheduler's state; ``clock``: wall-clock ns (the meter's)."""

    def __init__(
        self,
        meter: StepMeter,
        gpus: Sequence[int],
        *,
        model: str = "",
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.meter = meter
        self.gpus = tuple(gpus)
        self.model = model
        self.clock = clock
        self.open: dict[str, _Open] = {}
        # id(SchedulerOutput) -> (its start, its entries); kept in schedule order
        self._pending: dict[int, tuple[int, list[tuple[str, int, int, int]]]] = {}
        self._last_end = 0
        self.steps = 0
        self.counts: dict[str, int] = {"completed": 0, "cancelled": 0, "error": 0}

    # -- the three hooks --------------------------------------------------------------------

    def on_schedule(self, scheduler_output: Any, requests: Mapping[str, Any]) -> None:
        now = self.clock()
        for rid in scheduler_output.finished_req_ids or ():
            if rid in self.open:  # finished by a path below the public methods
                self._finish(rid, None, now)
        entries = step_entries(scheduler_output, requests)
        if not entries:
            return
        meter, gpus, opened = self.meter, self.gpus, self.open
        for rid, _prefill, decode, _ctx in entries:
            state = opened.get(rid)
            if state is None:
                state = opened[rid] = _Open(requests.get(rid))
                meter.begin(rid, gpus, at_ns=now)
            if decode and not state.decoding:
                state.decoding = True
                meter.phase(rid, "decode", at_ns=now)
        pending = self._pending
        pending[id(scheduler_output)] = (now, entries)
        while len(pending) > _MAX_PENDING:
            del pending[next(iter(pending))]

    def on_update(self, scheduler_output: Any, engine_outputs: Any) -> None:
        now = self.clock()
        step = self._pending.pop(id(scheduler_output), None)
        if step is not None:
            start, entries = step
            start = min(now, max(start, self._last_end))
            self.meter.step(entries, start_ns=start, end_ns=now, gpus=self.gpus)
            self._last_end = now
            self.steps += 1
        if not engine_outputs:
            return
        for outs in engine_outputs.values():
            for out in getattr(outs, "outputs", ()):
                reason = out.finish_reason
                if reason is not None and out.request_id in self.open:
                    self._finish(out.request_id, _reason_name(reason), now)

    def on_finish(self, requests: Iterable[Any]) -> None:
        now = self.clock()
        for req in requests:
            rid = req.request_id
            if rid in self.open:
                self._finish(rid, _status_name(req.status), now, by_status=True)

    # -- ---------------------------------------------------------------------------------

    def _finish(self, rid: str, reason: str | None, at_ns: int, *, by_status: bool = False) -> None:
        state = self.open.pop(rid)
        req = state.request
        if reason is None:  # from the request's own status
            reason = _status_name(getattr(req, "status", None))
            by_status = True
        table = _STATUS_ABORT if by_status else _plugin.FINISH_REASON_MAP
        abort = table.get(reason)
        tokens_in = tokens_out = 0
        if req is not None:
            prompt = int(getattr(req, "num_prompt_tokens", 0) or 0)
            cached = int(getattr(req, "num_cached_tokens", 0) or 0)
            tokens_in = max(0, prompt - max(0, cached))
            tokens_out = int(getattr(req, "num_output_tokens", 0) or 0)
        if abort is None:
            self.meter.end(
                rid, tokens_in=tokens_in, tokens_out=tokens_out, model=self.model, at_ns=at_ns
            )
            self.counts["completed"] += 1
        else:
            self.meter.abort(
                rid,
                abort,
                tokens_in=tokens_in,
                tokens_out=tokens_out,
                model=self.model,
                at_ns=at_ns,
            )
            self.counts[abort] = self.counts.get(abort, 0) + 1


def _reason_name(reason: Any) -> str:
    return str(reason).lower()


def _status_name(status: Any) -> str:
    return str(getattr(status, "name", status))


def hook_enabled(vllm_config: Any) -> bool:
    """Whether the engine of ``vllm_config`` runs :class:`ZeusScheduler` (the stat logger
    then steps aside: the core tells the meter everything)."""
    return _plugin.scheduler_hook_enabled(vllm_config)


def _core_meter(engine_index: int) -> StepMeter | None:
    cfg = _plugin._config
    with cfg.lock:
        meter, pid = cfg.meter, cfg.pid
    if meter is not None:
        if pid == os.getpid():
            if not hasattr(meter, "step"):
                logger.error("zeus_async vLLM scheduler: the configured meter has no step()")
                return None
            return meter  # type: ignore[return-value]
        logger.warning(
            "zeus_async vLLM scheduler: the meter configure() was given belongs to process "
            "%s, not this engine core (%s): not used (set %s=remote)",
            pid,
            os.getpid(),
            _plugin.ENV_METER,
        )
    kind = os.environ.get(_plugin.ENV_METER, "").strip().lower()
    if kind != "remote":
        if kind:
            logger.error("%s=%r: only 'remote' is known", _plugin.ENV_METER, kind)
        return None
    try:
        from zeus_async.inference.remote import RemoteMeter

        remote = cast(StepMeter, RemoteMeter(name=_plugin.core_meter_name(engine_index)))
    except Exception:
        logger.exception("%s=remote: no RemoteMeter; the scheduler hook is off", _plugin.ENV_METER)
        return None
    return remote


def feed_for_core(
    vllm_config: Any, *, clock: Callable[[], int] = time.time_ns
) -> SchedulerFeed | None:
    """The feed of the engine core of ``vllm_config`` (None: no meter, the hook is off)."""
    pc = getattr(vllm_config, "parallel_config", None)
    engine_index = int(getattr(pc, "data_parallel_rank", 0) or 0)
    meter = _core_meter(engine_index)
    if meter is None:
        logger.warning(
            "zeus_async vLLM scheduler: no meter (set %s=remote, or configure() in this "
            "process); the scheduler runs as vLLM's own",
            _plugin.ENV_METER,
        )
        return None
    world, local_rank = _plugin._engine_layout(vllm_config, engine_index)
    with _plugin._config.lock:
        gpus_spec, model = _plugin._config.gpus, _plugin._config.model
    gpus = _plugin.engine_gpus(world, local_rank, gpus=gpus_spec, engine_index=engine_index)
    if not gpus:
        logger.info("zeus_async vLLM scheduler: engine %d has no GPU here; off", engine_index)
        return None
    if model is None:
        model = os.environ.get(_plugin.ENV_MODEL) or _plugin._model_name(vllm_config)
    logger.info(
        "zeus_async vLLM scheduler: engine %d on GPUs %s, model %r, steps fed",
        engine_index,
        gpus,
        model,
    )
    return SchedulerFeed(meter, gpus, model=model, clock=clock)


def _hooked(base: Any) -> type:
    """``base`` (a vLLM scheduler class) with the feed's hooks."""

    class Hooked(base):  # type: ignore[misc]
        _zeus_hook = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._zeus_failed = False
            self.zeus_feed: SchedulerFeed | None = None
            try:
                self.zeus_feed = feed_for_core(self.vllm_config)
            except Exception:
                logger.exception("zeus_async vLLM scheduler: not fed")

        def _zeus_error(self, exc: BaseException) -> None:
            if not self._zeus_failed:  # logged once; vLLM goes on
                self._zeus_failed = True
                logger.error("zeus_async vLLM scheduler: an edge was dropped", exc_info=exc)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = super().schedule(*args, **kwargs)
            feed = self.zeus_feed
            if feed is not None:
                try:
                    feed.on_schedule(out, self.requests)
                except Exception as exc:
                    self._zeus_error(exc)
            return out

        def update_from_output(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            res = super().update_from_output(scheduler_output, *args, **kwargs)
            feed = self.zeus_feed
            if feed is not None:
                try:
                    feed.on_update(scheduler_output, res)
                except Exception as exc:
                    self._zeus_error(exc)
            return res

        def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
            res = super().finish_requests(*args, **kwargs)
            feed = self.zeus_feed
            if feed is not None and res:
                try:
                    feed.on_finish(res)
                except Exception as exc:
                    self._zeus_error(exc)
            return res

    Hooked.__name__ = Hooked.__qualname__ = f"Zeus{base.__name__}"
    return Hooked


_classes: dict[str, type] = {}


def scheduler_class(async_scheduling: bool) -> type:
    """vLLM's ``AsyncScheduler`` (or ``Scheduler``) with the hooks (imports vLLM)."""
    key = "async" if async_scheduling else "sync"
    cls = _classes.get(key)
    if cls is None:
        if async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
        else:
            from vllm.v1.core.sched.scheduler import Scheduler as base
        cls = _classes[key] = _hooked(base)
    return cls


class ZeusScheduler:
    """What ``--scheduler-cls`` names: makes vLLM's scheduler of the configured kind
    (async or not) with the hooks, taking ``Scheduler``'s arguments."""

    _zeus_hook = True

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        sc = vllm_config.scheduler_config
        return scheduler_class(bool(getattr(sc, "async_scheduling", False)))(*args, **kwargs)
