"""The planner's result: the time-energy Pareto frontier of clock plans.

:class:`FrontierPoint` is one plan (a clock per instruction) with its time and energy;
:class:`Frontier` holds them by iteration time and picks the plan for a deadline.
"""

from __future__ import annotations

import bisect
import logging
import math

import msgspec

from .schedule import OpKey, PipelineSchedule

logger = logging.getLogger(__name__)


class FrontierPoint(msgspec.Struct, frozen=True):
    """One plan of the frontier.

    Attributes:
        iteration_time_s: The plan's iteration time (longest path of the DAG), s.
        energy_j: The plan's energy, J, idle energy at ``p_block_w`` included.
        frequencies: ``(stage, microbatch, instruction) -> MHz`` for every instruction.
    """

    iteration_time_s: float
    energy_j: float
    frequencies: dict[OpKey, int]

    def stage_plan(self, schedule: PipelineSchedule, stage: int) -> list[tuple[str, int]]:
        """``[(instruction, MHz), ...]`` of one stage in its execution order: the frequency
        schedule of that stage's ranks."""
        return [
            (instr, self.frequencies[(stage, mb, instr)])
            for instr, mb in schedule.stage_order(stage)
        ]


class Frontier(msgspec.Struct, frozen=True):
    """Pareto frontier of plans: ``points`` by iteration time ascending, energy strictly
    decreasing.

    Attributes:
        points: The Pareto-optimal plans found.
        max_frequency_time_s: Iteration time with every instruction at its highest profiled
            clock (the "no slowdown" reference of :meth:`pick`).
        schedule: The schedule planned for.
        p_block_w: Idle power the energies include, W.
        max_frequency_energy_j: Energy of that all-highest-clock plan (the baseline a plan's
            saving is measured against), with the same ``p_block_w``.
    """

    points: list[FrontierPoint]
    max_frequency_time_s: float
    schedule: PipelineSchedule
    p_block_w: float = 0.0
    max_frequency_energy_j: float = math.nan

    @property
    def fastest_time_s(self) -> float:
        """The shortest iteration time of any plan."""
        return self.points[0].iteration_time_s

    def pick(self, target_time_s: float | None = None) -> FrontierPoint:
        """The least-energy plan whose iteration time is at most ``target_time_s``.

        ``None`` picks the least-energy plan no slower than running every instruction at its
        highest clock (:attr:`max_frequency_time_s`).

        Raises:
            ValueError: ``target_time_s`` is below the fastest plan's time, or not a number.
        """
        target = self.max_frequency_time_s if target_time_s is None else float(target_time_s)
        if math.isnan(target):
            raise ValueError("target_time_s must be a number, got NaN")
        if target < self.fastest_time_s:
            raise ValueError(
                f"target iteration time {target:.6g} s is below the fastest achievable "
                f"{self.fastest_time_s:.6g} s"
            )
        times = [p.iteration_time_s for p in self.points]
        return self.points[bisect.bisect_right(times, target) - 1]
