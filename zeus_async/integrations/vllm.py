"""Energy per request in vLLM: a stat-logger plugin that feeds a request meter.

vLLM (0.33) loads the classes registered under the entry-point group
``vllm.stat_logger_plugins`` in its front-end process (the OpenAI server, ``AsyncLLM``) and
calls their ``record(scheduler_stats, iteration_stats, engine_idx=...)`` once per batch of
engine outputs. zeus_async registers :data:`ZeusStatLogger` there (``pyproject.toml``), so an
installed zeus_async is picked up by ``vllm serve`` with no flag; ``VLLM_PLUGINS`` (a comma
list of plugin names) can restrict which plugins load, the name of this one is ``zeus_async``.

What the stat logger sees of a request is one :class:`FinishedRequestStats` when it finishes:
its token counts, finish reason and durations measured on the engine core's monotonic clock
(queued, prefill, decode, inference = prefill + decode), in the ``IterationStats`` whose
``iteration_timestamp`` (``time.time()``, the front end's wall clock) is when the front end
processed the batch that finished it. From these the plugin reconstructs the request's edges
on the wall clock and hands them to the meter *after the fact*, with explicit timestamps:

- ``begin`` at scheduling (``finish - inference_time``): time in the queue is not the GPU's;
- ``phase("decode")`` at the first token (``finish - decode_time``), when there was one;
- ``end`` (finish reason ``stop``, ``length``, ``repetition``) or ``abort`` (``abort`` ->
  ``cancelled``, ``error`` -> ``error``) at ``finish``, with the prompt tokens computed
  (prompt minus prefix-cache hits: the prefill the GPU did) and the generated tokens.

Because every edge arrives when the request ends, the meter must keep its horizon that far
behind: ``RequestMeter(max_edge_delay_s=...)`` at least the longest request (an edge older
than what is settled is clipped and counted as bad input ``late``).

Where the meter comes from, in this order:

1. :func:`configure` (``configure(meter=RequestMeter(...), gpus=...)``) in the process that
   starts the engine (``AsyncLLM.from_engine_args(...)`` in your own program);
2. ``ZEUS_ASYNC_VLLM_METER=remote``: a :class:`zeus_async.inference.remote.RemoteMeter`,
   which sends the edges to the node agent (one attributor per node: ``vllm serve`` with
   several API servers or engines, next to other servers on the same GPUs);
3. otherwise the plugin stays inert (one warning).

The GPUs of an engine (its tensor- and pipeline-parallel workers) are, in this order: what
:func:`configure` or ``ZEUS_ASYNC_VLLM_GPUS`` say (``"0,1"`` for every engine, or
``"0,1;2,3"`` one group per local data-parallel engine), else the engine's slice of
``CUDA_VISIBLE_DEVICES`` (``world_size = TP x PP`` devices per engine, local DP rank ``k``
taking the ``k``-th slice), else ``0 .. world_size-1`` shifted the same way.

The engine-core hook :mod:`zeus_async.integrations.vllm_scheduler` (``--scheduler-cls``)
measures what follows from inside vLLM's scheduler, per step and as it happens; for an engine
that runs it, this stat logger steps aside (:func:`scheduler_hook_enabled`). With
``ZEUS_ASYNC_VLLM_METER=remote`` it then *follows* the engine cores instead: a
``RemoteMeter(follow=...)`` of the front end receives the results the cores' meters
(:func:`core_meter_name`) sent to the node agent, and :func:`request_energy` gives them in
this process by the client's request id (vLLM's internal ``<id>-<8 characters>`` mapped back,
:func:`external_id`), e.g. for a log line or a span once the request settled.

Not exposed by vLLM 0.33 to stat loggers (see ``docs/vllm.md``): requests aborted by the
client (``AsyncLLM.abort``, a client hanging up) never reach them, so their energy goes to
the requests in flight beside them or to idle; per-step batch composition with request ids
(``SchedulerStats.iteration_details`` has per-step *counts* only, and only with
``--enable-logging-iteration-details``), so :meth:`RequestMeter.step` is not fed; the
engine-core timestamps themselves (only their differences), so the edges are placed relative
to the front end's clock, late by the engine-to-front-end delay (below a millisecond when the
front end keeps up).

Importing this module does not import vLLM; :data:`ZeusStatLogger` is made (a subclass of
vLLM's ``StatLoggerBase``, which vLLM requires) on first access.
"""

from __future__ import annotations

import collections
import importlib
import logging
import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENTRY_POINT_NAME",
    "ENV_GPUS",
    "ENV_METER",
    "ENV_MODEL",
    "FINISH_REASON_MAP",
    "SCHEDULER_CLS",
    "StatsFeed",
    "configure",
    "core_meter_name",
    "engine_gpus",
    "external_id",
    "follow_engine_cores",
    "request_energy",
    "reset",
    "scheduler_hook_enabled",
]

logger = logging.getLogger(__name__)

#: The entry-point group vLLM loads stat loggers from (``vllm.plugins.STAT_LOGGER_PLUGINS_GROUP``).
ENTRY_POINT_GROUP: Final = "vllm.stat_logger_plugins"
#: This plugin's name in that group (what ``VLLM_PLUGINS`` lists to allow it).
ENTRY_POINT_NAME: Final = "zeus_async"
#: ``remote``: feed a ``RemoteMeter`` (the node agent's attributor).
ENV_METER: Final = "ZEUS_ASYNC_VLLM_METER"
#: GPUs per engine: ``"0,1"`` (every engine) or ``"0,1;2,3"`` (one group per local engine).
ENV_GPUS: Final = "ZEUS_ASYNC_VLLM_GPUS"
#: The model label of the results (default: vLLM's served model name).
ENV_MODEL: Final = "ZEUS_ASYNC_VLLM_MODEL"

#: vLLM's finish reason (``str(FinishReason)``) -> how the meter is told: ``None`` for
#: ``meter.end`` (completed), else the ``meter.abort`` reason.
FINISH_REASON_MAP: Final[Mapping[str, str | None]] = {
    "stop": None,
    "length": None,
    "repetition": None,
    "abort": "cancelled",
    "error": "error",
}

#: Request ids remembered to tell a repeated one (parallel sampling: ``n > 1`` children
#: share the external id) and make it unique.
_RECENT_IDS = 10_000
#: A duration (s) above this is not believed (a timestamp vLLM never set reads as 0 there).
_MAX_DURATION_S = 7 * 24 * 3600.0


class MeterLike(Protocol):
    """What the plugin calls: :class:`~zeus_async.inference.RequestMeter`'s serving API
    (``RemoteMeter`` has the same)."""

    def begin(self, request_id: str, gpus: Sequence[int] = ..., *, at_ns: int | None = ...) -> Any:
        """A request starts."""

    def phase(self, request_id: str, name: str = ..., *, at_ns: int | None = ...) -> Any:
        """Its first token is out."""

    def end(self, request_id: str, **kwargs: Any) -> Any:
        """It completed."""

    def abort(self, request_id: str, reason: str = ..., **kwargs: Any) -> Any:
        """It stopped unfinished."""


GpuSpec = Sequence[int] | Mapping[int, Sequence[int]] | None


class _Config:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.meter: MeterLike | None = None
        self.gpus: GpuSpec = None
        self.model: str | None = None
        self.pid = os.getpid()  # the process configure() was called in


_config = _Config()


def configure(
    meter: MeterLike | None = None, *, gpus: GpuSpec = None, model: str | None = None
) -> None:
    """Say where :class:`ZeusStatLogger` sends the edges: call it before the engine starts,
    in the process that starts it.

    Args:
        meter: A :class:`~zeus_async.inference.RequestMeter` (give it
            ``max_edge_delay_s`` of at least the longest request) or anything with its
            ``begin``/``phase``/``end``/``abort`` (a ``RemoteMeter``).
        gpus: The GPUs of every engine (a sequence), or per engine index (a mapping; an
            engine mapped to no GPU, e.g. one on another node, is not fed); default from
            ``ZEUS_ASYNC_VLLM_GPUS``, then ``CUDA_VISIBLE_DEVICES``.
        model: The model label of the results (default: vLLM's served model name).
    """
    with _config.lock:
        _config.meter = meter
        _config.gpus = gpus
        _config.model = model
        _config.pid = os.getpid()


def reset() -> None:
    """Forget what :func:`configure` set."""
    configure(None)


#: What ``--scheduler-cls`` names to run the engine-core hook (``vllm_scheduler``).
SCHEDULER_CLS: Final = "zeus_async.integrations.vllm_scheduler.ZeusScheduler"


def scheduler_hook_enabled(vllm_config: Any) -> bool:
    """Whether the engine of ``vllm_config`` runs ``vllm_scheduler.ZeusScheduler``: the
    engine core then tells the meter everything, and the stat logger steps aside."""
    sc = getattr(vllm_config, "scheduler_config", None)
    cls = getattr(sc, "scheduler_cls", None)
    if isinstance(cls, str):
        return cls == SCHEDULER_CLS
    return cls is not None and getattr(cls, "_zeus_hook", False) is True


def core_meter_name(engine_index: int) -> str:
    """The name of an engine core's ``RemoteMeter`` at the node agent (the scheduler hook's):
    what the front end follows."""
    return f"vllm-core{engine_index}"


#: vLLM's internal request id: the client's, ``-`` and 8 random characters (a uuid4's hex).
_INTERNAL_ID = re.compile(r"^(.+)-[0-9a-zA-Z]{8}$")


def external_id(internal_id: str, *, randomized: bool | None = None) -> str:
    """The client's request id of vLLM's internal one (``<id>-<8 characters>``: the suffix
    taken off). ``randomized``: whether vLLM adds the suffix (default: unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set); when not, the id is the client's."""
    if randomized is None:
        randomized = os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0").strip() in (
            "",
            "0",
        )
    if not randomized:
        return internal_id
    m = _INTERNAL_ID.match(internal_id)
    return m.group(1) if m else internal_id


#: Results kept for :func:`request_energy` at most (oldest dropped).
_KEEP_RESULTS = 100_000


class _Followed:
    """The engine cores' results in the front end, by the client's request id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.meter: Any = None  # the RemoteMeter following the cores
        self.by_id: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.randomized: bool | None = None

    def take(self, name: str, out: Any) -> None:
        """A batch of a core's results (``RemoteMeter.subscribe_followed``)."""
        with self.lock:
            by_id = self.by_id
            for rid, r in out.requests.items():
                key = external_id(rid, randomized=self.randomized)
                by_id[key] = r
                by_id.move_to_end(key)
            while len(by_id) > _KEEP_RESULTS:
                by_id.popitem(last=False)


_followed = _Followed()


def follow_engine_cores(engines: int, *, endpoint: str | None = None) -> Any:
    """In the front end: receive the results of the engine cores ``0 .. engines-1`` (their
    scheduler hooks' ``RemoteMeter``, :func:`core_meter_name`) from the node agent, for
    :func:`request_energy`. Once per process (a second call returns the same meter); the
    ``RemoteMeter`` that follows, or None when none can be made."""
    with _followed.lock:
        if _followed.meter is not None:
            return _followed.meter
        try:
            remote = importlib.import_module("zeus_async.inference.remote")
            names = tuple(core_meter_name(i) for i in range(max(1, int(engines))))
            meter = remote.RemoteMeter(endpoint, name="vllm", follow=names)
        except Exception:
            logger.exception("zeus_async vLLM plugin: cannot follow the engine cores")
            return None
        meter.subscribe_followed(_followed.take)
        _followed.meter = meter
    logger.info("zeus_async vLLM plugin: following the engine cores %s", ", ".join(names))
    return meter


def _unfollow() -> None:
    """Stop following the engine cores and forget their results (tests)."""
    with _followed.lock:
        meter, _followed.meter = _followed.meter, None
        _followed.by_id.clear()
    if meter is not None:
        meter.close()


def request_energy(request_id: str) -> Any:
    """The energy of a request of this front end, by the id its client gave (vLLM's
    ``request_id``, e.g. ``chatcmpl-...``): a :class:`~zeus_async.inference.RequestEnergy`
    once the node agent settled it (its ``requests_settle_s`` and edge delay after the
    request ended), else None. Fed by :func:`follow_engine_cores` (the stat logger calls it
    for engines that run the scheduler hook, with ``ZEUS_ASYNC_VLLM_METER=remote``). Its
    ``request_id`` is vLLM's internal one."""
    with _followed.lock:
        return _followed.by_id.get(request_id)


def _meter_from_env() -> MeterLike | None:
    kind = os.environ.get(ENV_METER, "").strip().lower()
    if not kind:
        return None
    if kind != "remote":
        logger.error("%s=%r: only 'remote' is known; the plugin stays inert", ENV_METER, kind)
        return None
    try:  # the node agent's attributor, over its socket
        remote = importlib.import_module("zeus_async.inference.remote")
        meter: MeterLike = remote.RemoteMeter(name="vllm")
    except Exception:
        logger.exception("%s=remote: no RemoteMeter; the plugin stays inert", ENV_METER)
        return None
    return meter


def _parse_gpus(text: str) -> list[tuple[int, ...]] | None:
    """``"0,1"`` -> [(0, 1)]; ``"0,1;2,3"`` -> [(0, 1), (2, 3)]; None when not integers."""
    groups: list[tuple[int, ...]] = []
    for part in text.split(";"):
        items = [s.strip() for s in part.split(",") if s.strip()]
        if not items or not all(s.isdigit() for s in items):
            return None
        groups.append(tuple(int(s) for s in items))
    return groups


def engine_gpus(
    world_size: int,
    local_rank: int,
    *,
    gpus: GpuSpec = None,
    engine_index: int = 0,
    env: Mapping[str, str] | None = None,
) -> tuple[int, ...]:
    """The GPUs of one engine (see the module docstring for the order of the sources).

    Args:
        world_size: Workers per engine (tensor x pipeline parallel).
        local_rank: The engine's data-parallel rank on this node.
        gpus: What :func:`configure` was given.
        engine_index: The engine's index as vLLM gives it (keys a ``gpus`` mapping).
        env: The environment (default ``os.environ``).
    """
    env = os.environ if env is None else env
    world_size = max(1, int(world_size))
    local_rank = max(0, int(local_rank))
    if isinstance(gpus, Mapping):
        mine = gpus.get(engine_index)
        if mine is not None:
            return tuple(int(g) for g in mine)
    elif gpus is not None:
        return tuple(int(g) for g in gpus)
    text = env.get(ENV_GPUS, "").strip()
    if text:
        groups = _parse_gpus(text)
        if groups is None:
            logger.warning("%s=%r is not a list of GPU indices; ignored", ENV_GPUS, text)
        elif len(groups) == 1:
            return groups[0]
        elif local_rank < len(groups):
            return groups[local_rank]
        else:
            logger.warning("%s has no group for local engine %d; ignored", ENV_GPUS, local_rank)
    lo, hi = local_rank * world_size, (local_rank + 1) * world_size
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        groups = _parse_gpus(visible)
        if groups is not None and len(groups) == 1 and len(groups[0]) >= hi:
            return groups[0][lo:hi]
        logger.warning(
            "CUDA_VISIBLE_DEVICES=%r does not give %d integer indices; using positions %d..%d"
            " (set %s)",
            visible,
            hi,
            lo,
            hi - 1,
            ENV_GPUS,
        )
    return tuple(range(lo, hi))


def _seconds(value: Any) -> float | None:
    """A duration vLLM computed, or None when it is not one (unset timestamps)."""
    try:
        s = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(s) or s < 0.0 or s > _MAX_DURATION_S:
        return None
    return s


class StatsFeed:
    """Turns vLLM's stats into meter edges (no vLLM import: any objects with the fields of
    ``IterationStats``/``FinishedRequestStats`` will do).

    Args:
        meter: Where the edges go.
        gpus: The engine's GPUs.
        model: The model label of every request.
        engine_index: Prefixes request ids when not 0 (two engines' ids may collide).
    """

    def __init__(
        self, meter: MeterLike, gpus: Sequence[int], *, model: str = "", engine_index: int = 0
    ) -> None:
        self.meter = meter
        self.gpus = tuple(gpus)
        self.model = model
        self.engine_index = engine_index
        self._recent: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._anonymous = 0
        #: Requests fed, by how they finished (``completed``, ``cancelled``, ``error``).
        self.counts: collections.Counter[str] = collections.Counter()
        #: Requests whose timestamps vLLM never set (never scheduled, or no token): fed with
        #: the edges that could be placed (see :meth:`feed_finished`).
        self.partial = 0
        self._unknown_reasons: set[str] = set()

    def _unique(self, request_id: Any) -> str:
        if request_id is None:
            self._anonymous += 1
            rid = f"vllm-{self._anonymous}"
        else:
            rid = str(request_id)
        if self.engine_index:
            rid = f"e{self.engine_index}:{rid}"
        seen = self._recent.get(rid)
        if seen is None:
            self._recent[rid] = 0
        else:
            self._recent[rid] = seen + 1
            self._recent.move_to_end(rid)
            rid = f"{rid}#{seen + 1}"
        while len(self._recent) > _RECENT_IDS:
            self._recent.popitem(last=False)
        return rid

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """What ``StatLoggerBase.record`` gets: feeds every finished request of the batch."""
        if iteration_stats is None:
            return
        finished = getattr(iteration_stats, "finished_requests", None)
        if not finished:
            return
        end_s = float(iteration_stats.iteration_timestamp)
        for fr in finished:
            self.feed_finished(fr, end_s)

    def feed_finished(self, fr: Any, end_s: float) -> None:
        """One ``FinishedRequestStats``, finished at ``end_s`` (wall-clock seconds)."""
        end_ns = round(end_s * 1e9)
        reason_name = str(fr.finish_reason).lower()
        if reason_name not in FINISH_REASON_MAP and reason_name not in self._unknown_reasons:
            self._unknown_reasons.add(reason_name)
            logger.warning("vLLM finish reason %r unknown here: counted as completed", reason_name)
        abort_reason = FINISH_REASON_MAP.get(reason_name)
        tokens_out = int(fr.num_generation_tokens)
        prompt = int(fr.num_prompt_tokens)
        cached = int(getattr(fr, "num_cached_tokens", 0) or 0)
        tokens_in = max(0, prompt - max(0, cached))

        inference = _seconds(fr.inference_time)
        decode = _seconds(fr.decode_time) if tokens_out > 0 else None
        if inference is not None and decode is not None and decode > inference:
            decode = None
        if inference is None or (tokens_out == 0 and fr.inference_time == 0.0):
            # Never produced a token (an error or abort in prefill, or never scheduled): the
            # last-token timestamp is unset, so inference_time is not a duration. Place the
            # begin at arrival + time queued (both known), no decode phase.
            self.partial += 1
            e2e = _seconds(fr.e2e_latency) or 0.0
            queued = _seconds(fr.queued_time) or 0.0
            inference = max(0.0, e2e - queued)
            decode = None
        begin_ns = end_ns - round(inference * 1e9)
        rid = self._unique(fr.request_id)
        meter = self.meter
        meter.begin(rid, self.gpus, at_ns=begin_ns)
        if decode is not None:
            meter.phase(rid, "decode", at_ns=end_ns - round(decode * 1e9))
        if abort_reason is None:
            meter.end(
                rid, tokens_in=tokens_in, tokens_out=tokens_out, model=self.model, at_ns=end_ns
            )
            self.counts["completed"] += 1
        else:
            meter.abort(
                rid,
                abort_reason,
                tokens_in=tokens_in,
                tokens_out=tokens_out,
                model=self.model,
                at_ns=end_ns,
            )
            self.counts[abort_reason] += 1


def _engine_layout(vllm_config: Any, engine_index: int) -> tuple[int, int]:
    """(world size per engine, local data-parallel rank) from ``vllm_config``."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None:
        return 1, 0
    world = getattr(pc, "world_size", None)
    if not isinstance(world, int) or world < 1:
        world = int(getattr(pc, "tensor_parallel_size", 1)) * int(
            getattr(pc, "pipeline_parallel_size", 1)
        )
    local_size = getattr(pc, "data_parallel_size_local", 1) or 1
    return world, int(engine_index) % max(1, int(local_size))


def _model_name(vllm_config: Any) -> str:
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return ""
    name = getattr(mc, "served_model_name", None) or getattr(mc, "model", "")
    if isinstance(name, (list, tuple)):
        name = name[0] if name else ""
    return str(name)


def feed_for(vllm_config: Any, engine_index: int = 0) -> StatsFeed | None:
    """The feed of one engine, from :func:`configure` or the environment (None: inert)."""
    with _config.lock:
        meter, gpus, model = _config.meter, _config.gpus, _config.model
    if meter is None:
        meter = _meter_from_env()
    if meter is None:
        logger.warning(
            "zeus_async vLLM plugin: no meter (call zeus_async.integrations.vllm.configure() "
            "or set %s=remote); energy per request is not measured",
            ENV_METER,
        )
        return None
    world, local_rank = _engine_layout(vllm_config, engine_index)
    engine = engine_gpus(world, local_rank, gpus=gpus, engine_index=engine_index)
    if not engine:
        logger.info("zeus_async vLLM plugin: engine %d has no GPU here; not fed", engine_index)
        return None
    if model is None:
        model = os.environ.get(ENV_MODEL) or _model_name(vllm_config)
    logger.info(
        "zeus_async vLLM plugin: engine %d on GPUs %s, model %r", engine_index, engine, model
    )
    return StatsFeed(meter, engine, model=model, engine_index=engine_index)


def _make_stat_logger() -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ZeusStatLogger(StatLoggerBase):  # type: ignore[misc]
        """vLLM stat logger feeding a zeus_async request meter (one per engine)."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.vllm_config = vllm_config
            self.engine_index = engine_index
            self.feed: StatsFeed | None = None
            if scheduler_hook_enabled(vllm_config):  # the engine core tells the meter everything
                logger.info(
                    "zeus_async vLLM plugin: engine %d runs ZeusScheduler; the stat logger "
                    "steps aside",
                    engine_index,
                )
                if os.environ.get(ENV_METER, "").strip().lower() == "remote":
                    pc = getattr(vllm_config, "parallel_config", None)
                    follow_engine_cores(int(getattr(pc, "data_parallel_size", 1) or 1))
            else:
                self.feed = feed_for(vllm_config, engine_index)
            self._failed = False

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            feed = self.feed
            if feed is None:
                return
            try:  # never into vLLM's output handler: an exception there fails every request
                feed.record(scheduler_stats, iteration_stats)
            except Exception:
                if not self._failed:
                    self._failed = True
                    logger.exception("zeus_async vLLM plugin: a batch's stats were dropped")

        def log_engine_initialized(self) -> None:
            if self.feed is not None:
                logger.info(
                    "zeus_async: energy per request for engine %d on GPUs %s",
                    self.engine_index,
                    self.feed.gpus,
                )

    return ZeusStatLogger


_lazy: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """``ZeusStatLogger``: made on first access (it imports vLLM)."""
    if name == "ZeusStatLogger":
        cls = _lazy.get(name)
        if cls is None:
            cls = _lazy[name] = _make_stat_logger()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
