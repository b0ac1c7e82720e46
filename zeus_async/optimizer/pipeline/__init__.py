"""Pipeline frequency optimization (Perseus): plan per-instruction GPU clocks for every rank.

* :mod:`.messages`: the records (``JobInfo``, ``RankInfo``, ``FrequencySchedule``, profiling
  results, the instruction profile CSV) and the server's state dumps.
* :mod:`.settings`: ``ZEUS_PFO_*`` server settings.
* :mod:`.protocol`: the ZeroMQ request/reply messages.
* :mod:`.server`: ``zeus-async pfo-server``.
* :mod:`.schedulers`: ``PointSolution``, ``InstructionProfiler``, ``FrontierPlanner`` and
  ``make_3d_parallel``.
* :mod:`.planner`: the time-energy frontier planner over the pipeline's computation DAG.
* :mod:`.client`: ``PipelineFrequencyOptimizer`` for each rank, and its frequency controller.
"""

from __future__ import annotations

from .client import FrequencyController, PfoClient, PfoServerError, PipelineFrequencyOptimizer
from .messages import (
    FrequencySchedule,
    InstructionProfilingResult,
    JobInfo,
    OfflineProfilingResult,
    ProfilingResult,
    RankInfo,
    load_prof,
    load_ranks,
    load_sched,
    save_prof,
    save_ranks,
    save_sched,
)
from .planner import (
    Frontier,
    FrontierPoint,
    InstructionProfile,
    PipelineSchedule,
    PlanningStopped,
    plan_frontier,
)
from .schedulers import (
    SCHEDULERS,
    FrequencyScheduler,
    FrontierPlanner,
    FrontierPlanner3D,
    InstructionProfiler,
    InstructionProfiler3D,
    PointSolution,
    PointSolution3D,
    make_3d_parallel,
    read_plan,
    write_plan,
)
from .server import DEFAULT_ENDPOINT, PfoServer
from .settings import PfoSettings

__all__ = [
    "DEFAULT_ENDPOINT",
    "SCHEDULERS",
    "FrequencyController",
    "FrequencySchedule",
    "FrequencyScheduler",
    "Frontier",
    "FrontierPlanner",
    "FrontierPlanner3D",
    "FrontierPoint",
    "InstructionProfile",
    "InstructionProfiler",
    "InstructionProfiler3D",
    "InstructionProfilingResult",
    "JobInfo",
    "OfflineProfilingResult",
    "PfoClient",
    "PfoServer",
    "PfoServerError",
    "PfoSettings",
    "PipelineFrequencyOptimizer",
    "PipelineSchedule",
    "PlanningStopped",
    "PointSolution",
    "PointSolution3D",
    "ProfilingResult",
    "RankInfo",
    "load_prof",
    "load_ranks",
    "load_sched",
    "make_3d_parallel",
    "plan_frontier",
    "read_plan",
    "save_prof",
    "save_ranks",
    "save_sched",
    "write_plan",
]
