"""Frequency schedulers: the policies the PFO server runs, one instance per job.

A scheduler is a generator in disguise (Zeus's ``FrequencyScheduler``, seed 003): ``_run`` yields
the schedules of the next round (one :class:`FrequencySchedule` per rank) and receives the
ranks' :class:`ProfilingResult` for them from the ``yield``. When the generator ends, the last
schedule is served for the rest of training. The server calls :meth:`next_schedule` and
:meth:`observe` in a worker thread, so a slow policy (the frontier planner) never stalls the
requests of other jobs.

* :class:`PointSolution` serves a plan read from a file.
* :class:`InstructionProfiler` sweeps each stage's forward and backward clocks downwards, one
  clock per round, and stops a sweep once its energy has not improved for ``patience`` rounds
  in a row;
  the result is an :class:`InstructionProfilingResult` (also written as CSV).
* :class:`FrontierPlanner` profiles like :class:`InstructionProfiler`, then plans the whole
  iteration with :mod:`.planner` (Perseus's time-energy frontier) and serves the plan for a
  target iteration time (by default the least energy with no slowdown).
* :func:`make_3d_parallel` wraps any of them so it only sees pipeline parallelism; the ``*3D``
  variants are the wrapped classes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from ...errors import ConfigError
from .messages import (
    FrequencySchedule,
    InstructionProfilingResult,
    JobInfo,
    OfflineProfilingResult,
    ProfilingResult,
    RankInfo,
)
from .planner import (
    FrontierPoint,
    InstructionProfile,
    PipelineSchedule,
    check_p_block,
    plan_frontier,
)

__all__ = [
    "SCHEDULERS",
    "FrequencyScheduler",
    "FrontierPlanner",
    "FrontierPlanner3D",
    "InstructionProfiler",
    "InstructionProfiler3D",
    "PointSolution",
    "PointSolution3D",
    "make_3d_parallel",
    "scheduler_class",
]

logger = logging.getLogger(__name__)

ScheduleGen = Generator[list[FrequencySchedule], list[ProfilingResult], None]


class SchedulerSettings(Protocol):
    """What a scheduler reads of the server's settings (the server passes its
    :class:`~.settings.PfoSettings`). Named here so the schedulers sit below the settings that
    choose among them: the settings import the schedulers, never the other way round."""

    @property
    def dump_data(self) -> bool: ...

    @property
    def dump_dir(self) -> str: ...


class FrequencyScheduler(ABC):
    """Base of every scheduler: write :meth:`_run` as a generator of rounds.

    Args:
        job_info: The job.
        rank_infos: Its ranks, in any order (kept sorted by rank).
        pfo_settings: The server's settings (``dump_dir``, ...).
    """

    def __init__(
        self, job_info: JobInfo, rank_infos: list[RankInfo], pfo_settings: SchedulerSettings
    ) -> None:
        self.job_info = job_info
        self.rank_infos = sorted(rank_infos, key=lambda info: info.rank)
        self.world_size = job_info.world_size
        self.pfo_settings = pfo_settings
        self._generator = self._run()
        self._next_schedule: list[FrequencySchedule] | None = None
        #: Set once ``_run`` has ended: :meth:`next_schedule` is final from then on.
        self.finished = False

    @property
    def dump_dir(self) -> Path:
        """This job's folder under the server's ``dump_dir``."""
        return Path(self.pfo_settings.dump_dir) / (self.job_info.job_id or "unregistered")

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        """Take the results of the last round (any rank order); prepares the next round."""
        try:
            self._next_schedule = self._generator.send(profiling_results)
        except StopIteration:
            self.finished = True

    def next_schedule(self) -> list[FrequencySchedule]:
        """The schedules of the next round (one per rank; the last one again once done)."""
        if self._next_schedule is None:
            try:
                self._next_schedule = next(self._generator)
            except StopIteration as exc:
                raise RuntimeError(
                    f"{type(self).__name__}._run ended before yielding a schedule"
                ) from exc
        return self._next_schedule

    @abstractmethod
    def _run(self) -> ScheduleGen:
        """Yield each round's schedules; each ``yield`` returns that round's results."""

    @classmethod
    def validate_args(cls, **scheduler_args: Any) -> None:
        """Check ``scheduler_args`` when the server starts (beyond the signature).

        Raises:
            ConfigError: The arguments cannot work (a plan file that does not parse, ...).
        """
        return None


def _aggregate(results: Sequence[ProfilingResult], stage: int) -> ProfilingResult:
    """One result for a stage: times are the slowest replica's, energies the replicas' sum."""

    def agg(
        rows: Sequence[Sequence[float]], fun: Callable[[Sequence[float]], float]
    ) -> list[float]:
        return [fun(vals) for vals in zip(*rows, strict=True)]

    def agg2(
        rows: Sequence[Sequence[Sequence[float]]], fun: Callable[[Sequence[float]], float]
    ) -> list[list[float]]:
        return [agg(vals, fun) for vals in zip(*rows, strict=True)]

    # Replicas may have profiled different numbers of iterations: merge the common ones.
    n = min(len(r.iter_time) for r in results)
    results = [
        msgspec.structs.replace(
            r,
            iter_time=r.iter_time[:n],
            iter_energy=r.iter_energy[:n],
            time_breakdown={k: v[:n] for k, v in r.time_breakdown.items()},
            energy_breakdown={k: v[:n] for k, v in r.energy_breakdown.items()},
        )
        for r in results
    ]

    try:
        keys = set(results[0].time_breakdown)
        return ProfilingResult(
            rank=stage,
            iter_time=agg([r.iter_time for r in results], max),
            iter_energy=agg([r.iter_energy for r in results], math.fsum),
            time_breakdown={
                k: agg2([r.time_breakdown[k] for r in results], max) for k in sorted(keys)
            },
            energy_breakdown={
                k: agg2([r.energy_breakdown[k] for r in results], math.fsum) for k in sorted(keys)
            },
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"ranks of pipeline stage {stage} reported results of different shapes: {exc}"
        ) from None


def make_3d_parallel(
    sched_cls: type[FrequencyScheduler], name: str | None = None
) -> type[FrequencyScheduler]:
    """Wrap ``sched_cls`` so that it plans for pipeline stages only.

    The wrapped scheduler sees a job of ``pp_degree`` ranks (rank = ``pp_rank``; the infos of
    data/tensor-parallel rank 0). Results of the ranks of one stage are merged (slowest time,
    summed energy) before it observes them, and each stage's schedule is copied to every rank
    of that stage.
    """

    class Wrapper(sched_cls):  # type: ignore[valid-type,misc]
        def __init__(
            self,
            job_info: JobInfo,
            rank_infos: list[RankInfo],
            pfo_settings: SchedulerSettings,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            self._orig_job_info = job_info
            self._orig_rank_infos = sorted(rank_infos, key=lambda r: r.rank)
            self._rank_to_stage = {r.rank: r.pp_rank for r in rank_infos}
            pp_job = msgspec.structs.replace(
                job_info, dp_degree=1, tp_degree=1, world_size=job_info.pp_degree
            )
            pp_ranks = [
                msgspec.structs.replace(r, rank=r.pp_rank)
                for r in rank_infos
                if r.dp_rank == 0 and r.tp_rank == 0
            ]
            super().__init__(pp_job, pp_ranks, pfo_settings, *args, **kwargs)

        def observe(self, profiling_results: list[ProfilingResult]) -> None:
            per_stage: list[list[ProfilingResult]] = [
                [] for _ in range(self._orig_job_info.pp_degree)
            ]
            for result in sorted(profiling_results, key=lambda r: r.rank):
                per_stage[self._rank_to_stage[result.rank]].append(result)
            merged = [_aggregate(rs, stage) for stage, rs in enumerate(per_stage) if rs]
            super().observe(merged)

        def next_schedule(self) -> list[FrequencySchedule]:
            by_stage = {s.rank: s for s in super().next_schedule()}
            out = []
            for info in self._orig_rank_infos:
                stage_schedule = by_stage.get(info.pp_rank)
                if stage_schedule is None:
                    raise RuntimeError(f"no schedule for pipeline stage {info.pp_rank}")
                out.append(
                    FrequencySchedule(rank=info.rank, frequencies=stage_schedule.frequencies)
                )
            return out

    Wrapper.__name__ = Wrapper.__qualname__ = name or (sched_cls.__name__ + "3D")
    # Settings check scheduler_args against this signature: the wrapped class's, not *args.
    Wrapper.__signature__ = inspect.signature(sched_cls)
    if sched_cls.__doc__ is not None:
        Wrapper.__doc__ = "[Wrapped for 3D parallelism] " + sched_cls.__doc__
    return Wrapper


# -- PointSolution -------------------------------------------------------------------------------

_Plan = list[list[tuple[str, int]]]


def read_plan(path: str | Path) -> _Plan:
    """Read a plan file: per rank, ``[(instruction, MHz), ...]`` in execution order.

    JSON (``.json``) or a Python literal (``.py``, what lowtime/Perseus write), parsed with
    ``json`` / ``ast.literal_eval``: no code in the file is ever run.

    Raises:
        ConfigError: The file is missing, does not parse, or does not hold such a list.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"plan file not found: {str(p)!r}")
    text = p.read_text(encoding="utf-8")
    try:
        raw: Any = json.loads(text) if p.suffix == ".json" else ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ConfigError(f"{p}: not a JSON or Python literal plan: {exc}") from None
    try:
        plan = msgspec.convert(raw, list[list[tuple[str, int]]])
    except msgspec.ValidationError as exc:
        raise ConfigError(
            f"{p}: a plan is a list (one per rank) of [instruction, MHz] pairs: {exc}"
        ) from None
    for rank, freqs in enumerate(plan):
        for name, mhz in freqs:
            if not name or mhz <= 0:
                raise ConfigError(f"{p}: rank {rank}: invalid entry ({name!r}, {mhz!r})")
    return plan


def write_plan(path: str | Path, schedules: Sequence[FrequencySchedule]) -> None:
    """Write ``schedules`` (sorted by rank) as a JSON plan file :class:`PointSolution` reads."""
    plan = [s.frequencies for s in sorted(schedules, key=lambda s: s.rank)]
    Path(path).write_bytes(msgspec.json.encode(plan))


def blocking_power_path(profile_csv: str | Path) -> Path:
    """Where the blocking power measured with an instruction profile is kept: beside it,
    ``<name>.p_block.json`` (``{"p_block_w": W}``)."""
    path = Path(profile_csv)
    return path.with_name(path.stem + ".p_block.json")


class _BlockingPower(msgspec.Struct, forbid_unknown_fields=True):
    p_block_w: float
    #: Given to the server (``p_block_w``) rather than measured while profiling.
    given: bool = False


def write_blocking_power(profile_csv: str | Path, p_block_w: float | None, given: bool) -> None:
    """Keep beside the profile the blocking power the server charges idle time at: the one it
    was given, else the one measured while profiling."""
    if p_block_w is not None:
        record = _BlockingPower(p_block_w=p_block_w, given=given)
        blocking_power_path(profile_csv).write_bytes(msgspec.json.encode(record))


def read_blocking_power(profile_csv: str | Path) -> tuple[float, bool] | None:
    """The blocking power kept with a profile (W) and whether it was given to the server (not
    measured), or ``None`` when none was kept."""
    path = blocking_power_path(profile_csv)
    if not path.exists():
        return None
    try:
        record = msgspec.json.decode(path.read_bytes(), type=_BlockingPower)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{path}: not a blocking power file: {exc}") from None
    try:
        return check_p_block(record.p_block_w), record.given
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


class PointSolution(FrequencyScheduler):
    """Serves the plan in ``solution_path`` (see :func:`read_plan`), one entry per rank."""

    @classmethod
    def validate_args(cls, **scheduler_args: Any) -> None:
        path = scheduler_args["solution_path"]
        if not isinstance(path, str):
            raise ConfigError(f"solution_path must be a path, not {path!r}")
        read_plan(path)

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        pfo_settings: SchedulerSettings,
        solution_path: str,
    ) -> None:
        plan = read_plan(solution_path)
        if len(plan) != job_info.world_size:
            raise ConfigError(
                f"{solution_path} plans {len(plan)} ranks, but the job has {job_info.world_size}"
            )
        self.schedule = [FrequencySchedule(rank=r, frequencies=f) for r, f in enumerate(plan)]
        super().__init__(job_info, rank_infos, pfo_settings)

    def _run(self) -> ScheduleGen:
        yield self.schedule


# -- InstructionProfiler -------------------------------------------------------------------------


class _Sweep:
    """The downward clock sweep of one instruction of one stage."""

    def __init__(self, freqs: list[int], patience: int) -> None:
        self.freqs = freqs
        self.index = 0
        self.patience = patience
        self.rises = 0
        self.best = math.inf
        self.time: dict[int, float] = {}
        self.energy: dict[int, float] = {}
        self.done = not freqs

    @property
    def current(self) -> int:
        return self.freqs[min(self.index, len(self.freqs) - 1)]

    def record(self, time_s: float, energy_j: float) -> None:
        freq = self.current
        self.time[freq], self.energy[freq] = time_s, energy_j
        if energy_j < self.best:
            self.best, self.rises = energy_j, 0
        else:
            self.rises += 1
        self.index += 1
        if self.rises >= self.patience or self.index >= len(self.freqs):
            self.done = True


def _mean_breakdown(result: ProfilingResult, instr: str) -> tuple[float, float] | None:
    times = [t for it in result.time_breakdown.get(instr, []) for t in it]
    energies = [e for it in result.energy_breakdown.get(instr, []) for e in it]
    if not times:
        return None
    return math.fsum(times) / len(times), math.fsum(energies) / len(energies)


def _check_profiler_args(
    num_microbatches: Any = 1,
    pipeline: Any = "1f1b",
    frequency_step: Any = 1,
    minimum_frequency: Any = 0,
    patience: Any = 2,
    output_csv: Any = None,
    target_time_s: Any = None,
    max_slowdown: Any = None,
    p_block_w: Any = None,
) -> None:
    """Check the values of :class:`InstructionProfiler`'s and :class:`FrontierPlanner`'s
    arguments (at server start, and again when a job builds its scheduler)."""

    def whole(name: str, value: Any, minimum: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{name} must be a whole number >= {minimum}, not {value!r}")

    def number(name: str, value: Any, *, positive: bool) -> None:
        if value is None:
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ConfigError(
                f"{name} must be a number {'>' if positive else '>='} 0, not {value!r}"
            )

    whole("num_microbatches", num_microbatches, 1)
    whole("frequency_step", frequency_step, 1)
    whole("minimum_frequency", minimum_frequency, 0)
    whole("patience", patience, 1)
    if pipeline not in PIPELINES:
        raise ConfigError(f"pipeline must be one of {', '.join(PIPELINES)}, not {pipeline!r}")
    if output_csv is not None and (
        not isinstance(output_csv, str) or not output_csv.endswith(".csv")
    ):
        raise ConfigError(f"output_csv must be a path ending in .csv, not {output_csv!r}")
    number("target_time_s", target_time_s, positive=True)
    number("max_slowdown", max_slowdown, positive=False)
    number("p_block_w", p_block_w, positive=False)
    if target_time_s is not None and max_slowdown is not None:
        raise ConfigError("give target_time_s or max_slowdown, not both")


#: Pipeline schedules the profiler and planner know.
PIPELINES = ("1f1b", "gpipe")


class InstructionProfiler(FrequencyScheduler):
    """Profile every stage's forward and backward at decreasing SM clocks, one per round.

    Each round runs every stage's forwards at one clock and its backwards at another; a sweep
    moves down the rank's available clocks (every ``frequency_step``-th, none below
    ``minimum_frequency``) and stops once its energy has not improved for ``patience`` rounds
    in a row (lower clocks would only cost more). When every sweep has stopped, the means are
    an :class:`InstructionProfilingResult` (:attr:`profile`), written to ``output_csv``
    (default ``<dump_dir>/<job>/instruction_profile.csv`` when the server dumps data), and the
    job runs at the highest clocks from then on.

    Args:
        pipeline: ``"1f1b"`` or ``"gpipe"``: the order of each stage's instructions.
        num_microbatches: Microbatches per iteration.
        frequency_step: Profile every n-th available clock.
        minimum_frequency: Lowest clock to profile (MHz).
        patience: Rounds of rising energy that end a sweep.
        output_csv: Where to write the profile.
    """

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        pfo_settings: SchedulerSettings,
        num_microbatches: int,
        pipeline: str = "1f1b",
        frequency_step: int = 1,
        minimum_frequency: int = 0,
        patience: int = 2,
        output_csv: str | None = None,
    ) -> None:
        _check_profiler_args(
            num_microbatches, pipeline, frequency_step, minimum_frequency, patience, output_csv
        )
        try:
            self.pipeline = PipelineSchedule(pipeline, job_info.pp_degree, num_microbatches)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.frequency_step = frequency_step
        self.minimum_frequency = minimum_frequency
        self.patience = patience
        self._output_csv = output_csv
        #: The result, once every sweep has stopped.
        self.profile: InstructionProfilingResult | None = None
        #: Blocking power (W) estimated from the profiling rounds (idle time and energy).
        self.blocking_power_w: float | None = None
        super().__init__(job_info, rank_infos, pfo_settings)

    @classmethod
    def validate_args(cls, **scheduler_args: Any) -> None:
        _check_profiler_args(**scheduler_args)

    def _stage_infos(self) -> dict[int, RankInfo]:
        infos: dict[int, RankInfo] = {}
        for info in self.rank_infos:
            infos.setdefault(info.pp_rank, info)
        missing = set(range(self.job_info.pp_degree)) - set(infos)
        if missing:
            raise ValueError(f"no rank registered for pipeline stage(s) {sorted(missing)}")
        return infos

    def stage_schedule(self, stage: int, freq: Callable[[str, int], int]) -> list[tuple[str, int]]:
        """``[(instruction, MHz)]`` of ``stage``'s iteration; ``freq(instruction, microbatch)``."""
        return [(name, freq(name, mb)) for name, mb in self.pipeline.stage_order(stage)]

    def _round(self, sweeps: dict[tuple[int, str], _Sweep]) -> list[FrequencySchedule]:
        out = []
        for info in self.rank_infos:
            stage = info.pp_rank
            top = max(info.available_frequencies)

            def pick(name: str, _mb: int, stage: int = stage, top: int = top) -> int:
                sweep = sweeps.get((stage, name))
                return top if sweep is None or sweep.done else sweep.current

            out.append(
                FrequencySchedule(rank=info.rank, frequencies=self.stage_schedule(stage, pick))
            )
        return out

    def _profile_rounds(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        stages = self._stage_infos()
        sweeps: dict[tuple[int, str], _Sweep] = {}
        for stage, info in stages.items():
            freqs = sorted(set(info.available_frequencies), reverse=True)[:: self.frequency_step]
            freqs = [f for f in freqs if f >= self.minimum_frequency]
            if not freqs:
                raise ValueError(
                    f"pipeline stage {stage}: no available clock is >= minimum_frequency "
                    f"{self.minimum_frequency} MHz (the GPU has {min(info.available_frequencies)}"
                    f"..{max(info.available_frequencies)})"
                )
            for instr in ("forward", "backward"):
                sweeps[(stage, instr)] = _Sweep(freqs, self.patience)
        idle_t = idle_e = 0.0
        round_num = 0
        while not all(s.done for s in sweeps.values()):
            results = yield self._round(sweeps)
            round_num += 1
            stage_of = {info.rank: info.pp_rank for info in self.rank_infos}
            grouped: dict[int, list[ProfilingResult]] = {}
            for r in sorted(results, key=lambda r: r.rank):
                if r.rank not in stage_of:
                    raise ValueError(f"round {round_num}: result from unknown rank {r.rank}")
                grouped.setdefault(stage_of[r.rank], []).append(r)
            by_stage = {
                stage: rs[0] if len(rs) == 1 else _aggregate(rs, stage)
                for stage, rs in grouped.items()
            }
            for (stage, instr), sweep in sweeps.items():
                if sweep.done:
                    continue
                result = by_stage.get(stage)
                measured = None if result is None else _mean_breakdown(result, instr)
                if measured is None:
                    raise ValueError(
                        f"round {round_num}: no {instr} timings reported for pipeline stage {stage}"
                    )
                sweep.record(*measured)
            for r in by_stage.values():
                busy_t = sum(math.fsum(it) for v in r.time_breakdown.values() for it in v)
                busy_e = sum(math.fsum(it) for v in r.energy_breakdown.values() for it in v)
                idle_t += max(0.0, math.fsum(r.iter_time) - busy_t)
                idle_e += max(0.0, math.fsum(r.iter_energy) - busy_e)
            logger.debug(
                "job %s: profiled round %d; sweeps left: %d",
                self.job_info.job_id,
                round_num,
                sum(not s.done for s in sweeps.values()),
            )
        self.blocking_power_w = idle_e / idle_t if idle_t > 1e-9 else 0.0
        self.profile = InstructionProfilingResult(
            [
                OfflineProfilingResult(
                    rank=info.rank,
                    dp_rank=info.dp_rank,
                    pp_rank=stage,
                    tp_rank=info.tp_rank,
                    forward_time=sweeps[(stage, "forward")].time,
                    forward_energy=sweeps[(stage, "forward")].energy,
                    backward_time=sweeps[(stage, "backward")].time,
                    backward_energy=sweeps[(stage, "backward")].energy,
                )
                for stage, info in sorted(stages.items())
            ]
        )
        out = self._output_csv
        if out is None and self.pfo_settings.dump_data:
            out = str(self.dump_dir / "instruction_profile.csv")
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            self.profile.to_csv(out)
            p_block, given = self.planning_p_block()
            write_blocking_power(out, p_block, given)
            logger.info(
                "job %s: instruction profile written to %s (P_block %.1f W measured%s)",
                self.job_info.job_id,
                out,
                self.blocking_power_w,
                f"; {p_block:g} W given, and kept with it" if given else "",
            )

    def planning_p_block(self) -> tuple[float | None, bool]:
        """The blocking power plans charge idle time at, and whether it was given (else it is
        the one measured while profiling)."""
        return self.blocking_power_w, False

    def _run(self) -> ScheduleGen:
        yield from self._profile_rounds()
        yield self._round({})


class FrontierPlanner(InstructionProfiler):
    """Profile (as :class:`InstructionProfiler`), then serve a Perseus time-energy plan.

    From the profile and the pipeline schedule, :func:`.planner.plan_frontier` computes the
    Pareto frontier of iteration time and energy over frequency plans; the plan served is the
    least-energy one within ``target_time_s``, or within ``(1 + max_slowdown)`` x the fastest
    plan's time, or (neither given) the least-energy plan with no slowdown. Blocking power
    (energy a GPU draws while it waits on another stage) is ``p_block_w`` or, by default, what
    the profiling rounds measured outside instructions. The frontier is written to
    ``<dump_dir>/<job>/frontier.json`` and the plan to ``plan.json`` (a :class:`PointSolution`
    file).
    """

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: list[RankInfo],
        pfo_settings: SchedulerSettings,
        num_microbatches: int,
        pipeline: str = "1f1b",
        frequency_step: int = 1,
        minimum_frequency: int = 0,
        patience: int = 2,
        output_csv: str | None = None,
        target_time_s: float | None = None,
        max_slowdown: float | None = None,
        p_block_w: float | None = None,
    ) -> None:
        _check_profiler_args(
            num_microbatches,
            target_time_s=target_time_s,
            max_slowdown=max_slowdown,
            p_block_w=p_block_w,
        )
        self.target_time_s = target_time_s
        self.max_slowdown = max_slowdown
        self.p_block_w = p_block_w
        #: The plan served, once planned.
        self.plan: FrontierPoint | None = None
        super().__init__(
            job_info,
            rank_infos,
            pfo_settings,
            num_microbatches,
            pipeline,
            frequency_step,
            minimum_frequency,
            patience,
            output_csv,
        )

    def planning_p_block(self) -> tuple[float | None, bool]:
        if self.p_block_w is not None:
            return self.p_block_w, True
        return super().planning_p_block()

    def _run(self) -> ScheduleGen:
        yield from self._profile_rounds()
        assert self.profile is not None
        p_block = self.planning_p_block()[0] or 0.0
        profile = InstructionProfile.from_rows(self.profile.rows())
        frontier = plan_frontier(profile, self.pipeline, p_block_w=p_block)
        target = self.target_time_s
        if target is None and self.max_slowdown is not None:
            target = frontier.points[0].iteration_time_s * (1.0 + self.max_slowdown)
        self.plan = point = frontier.pick(target)
        logger.info(
            "job %s: planned %.4f s / %.3f J per iteration (%d frontier points, P_block %.1f W)",
            self.job_info.job_id,
            point.iteration_time_s,
            point.energy_j,
            len(frontier.points),
            p_block,
        )
        schedules = [
            FrequencySchedule(
                rank=info.rank, frequencies=point.stage_plan(self.pipeline, info.pp_rank)
            )
            for info in self.rank_infos
        ]
        if self.pfo_settings.dump_data:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (self.dump_dir / "frontier.json").write_bytes(
                msgspec.json.encode(
                    [
                        {"iteration_time_s": p.iteration_time_s, "energy_j": p.energy_j}
                        for p in frontier.points
                    ]
                )
            )
            write_plan(self.dump_dir / "plan.json", schedules)
        yield schedules


PointSolution3D = make_3d_parallel(PointSolution)
InstructionProfiler3D = make_3d_parallel(InstructionProfiler)
FrontierPlanner3D = make_3d_parallel(FrontierPlanner)

#: Schedulers by the name ``ZEUS_PFO_SCHEDULER`` uses.
SCHEDULERS: dict[str, type[FrequencyScheduler]] = {
    cls.__name__: cls
    for cls in (
        PointSolution,
        PointSolution3D,
        InstructionProfiler,
        InstructionProfiler3D,
        FrontierPlanner,
        FrontierPlanner3D,
    )
}


def scheduler_class(name: str) -> type[FrequencyScheduler]:
    """The scheduler ``name`` names: a key of :data:`SCHEDULERS`, or ``package.module:Class``
    for your own :class:`FrequencyScheduler` subclass.

    Raises:
        ConfigError: An unknown name, or one that does not load or is not a scheduler.
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            found = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cannot load scheduler {name!r}: {exc}") from None
        if not (isinstance(found, type) and issubclass(found, FrequencyScheduler)):
            raise ConfigError(f"{name!r} is not a FrequencyScheduler subclass")
        return found
    try:
        return SCHEDULERS[name]
    except KeyError:
        raise ConfigError(
            f"unknown scheduler {name!r}; known: {', '.join(sorted(SCHEDULERS))} "
            "(or 'package.module:Class')"
        ) from None
