"""Time-energy frontier planner for pipeline-parallel training (Perseus semantics).

One training iteration of a pipeline is a DAG of instructions: node ``(stage, microbatch,
instruction)`` with ``instruction`` ``"forward"`` or ``"backward"``. Its edges are

* ``forward(s, m) -> forward(s + 1, m)`` (activations flow down the pipeline),
* ``backward(s + 1, m) -> backward(s, m)`` (gradients flow back up),
* ``forward(S - 1, m) -> backward(S - 1, m)`` on the last stage,
* and, within each stage, its instructions one after the other in the schedule's order (one GPU
  runs one instruction at a time): see :meth:`PipelineSchedule.stage_order`.

Every instruction runs at one SM clock chosen per instruction, with the time and energy an
instruction profiler measured for its stage at that clock (:class:`InstructionProfile`). A plan
(a clock per instruction) takes the DAG's longest path as its iteration time ``T`` and costs

    energy = Σ_instructions E(f) + p_block_w * Σ_stages (T - busy time of the stage)

— a GPU that waits on its neighbours (pipeline bubbles, blocking P2P) still draws
``p_block_w`` watts. This is Perseus's objective: it subtracts ``p_block_w * time`` from every
instruction's energy and adds ``p_block_w * T`` per stage, the same total.

:func:`plan_frontier` computes the time-energy Pareto frontier of discrete plans
(:class:`Frontier`); :meth:`Frontier.pick` chooses the plan for a deadline and
:meth:`FrontierPoint.stage_plan` gives a stage's clocks in execution order (a rank's frequency
schedule). :func:`evaluate` is the exact time and energy of any plan; every frontier point's
numbers are exactly what :func:`evaluate` returns for its clocks.

Algorithm (see :func:`plan_frontier`): the convex relaxation (each instruction's clocks
replaced by the lower convex hull of their time-energy points) is solved exactly for every
iteration time by a Phillips-Dessouky walk of minimum cuts from the cheapest plan to the
fastest; its states are rounded to real clocks, slack is handed back greedily, and the Pareto
set of the resulting plans is the frontier. Problems small enough are enumerated instead.

The parts, each importing only those listed before it:

* :mod:`.schedule`: :class:`PipelineSchedule` and the instruction names;
* :mod:`.profile`: :class:`InstructionProfile` and the bounds on its figures;
* :mod:`.frontier`: :class:`FrontierPoint` and :class:`Frontier`, the result;
* :mod:`.dag`: the instruction DAG, its longest paths and :func:`evaluate`;
* :mod:`.mincut`: the maximum flow the walk's minimum cuts come from;
* :mod:`.search`: the frontier search, :func:`plan_frontier`.
"""

from __future__ import annotations

import logging

from .dag import evaluate
from .frontier import Frontier, FrontierPoint
from .profile import MAX_ENERGY_J, MAX_P_BLOCK_W, MAX_TIME_S, InstructionProfile, check_p_block
from .schedule import INSTRUCTIONS, PipelineSchedule
from .schedule import OpKey as OpKey
from .schedule import ScheduleKind as ScheduleKind
from .search import PlanningStopped, plan_frontier

logger = logging.getLogger(__name__)

__all__ = [
    "INSTRUCTIONS",
    "MAX_ENERGY_J",
    "MAX_P_BLOCK_W",
    "MAX_TIME_S",
    "Frontier",
    "FrontierPoint",
    "InstructionProfile",
    "PipelineSchedule",
    "PlanningStopped",
    "check_p_block",
    "evaluate",
    "plan_frontier",
]
