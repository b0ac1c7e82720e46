"""Pipeline schedules: the order in which each stage runs its forwards and backwards.

:class:`PipelineSchedule` (1F1B or GPipe, ``S`` stages, ``M`` microbatches) and the names the
planner uses for an iteration's instructions (:data:`INSTRUCTIONS`, :data:`OpKey`).
"""

from __future__ import annotations

import logging
from typing import Literal

import msgspec

logger = logging.getLogger(__name__)


#: Instruction names, in the order the profile rows and plans use them.
INSTRUCTIONS: tuple[str, str] = ("forward", "backward")

ScheduleKind = Literal["1f1b", "gpipe"]
#: ``(stage, microbatch, instruction)``: one node of the iteration's DAG.
OpKey = tuple[int, int, str]


_SCHEDULE_KINDS = ("1f1b", "gpipe")


class PipelineSchedule(msgspec.Struct, frozen=True):
    """A non-interleaved pipeline schedule of one training iteration.

    Attributes:
        kind: ``"1f1b"`` (PipeDream-Flush / Megatron / DeepSpeed ``TrainSchedule``, the order
            lowtime's ``Synchronous1F1B`` yields) or ``"gpipe"`` (all forwards, then all
            backwards; both in microbatch order 0..M-1, as PyTorch's ``ScheduleGPipe``).
        num_stages: Pipeline stages ``S`` (>= 1).
        num_microbatches: Microbatches per iteration ``M`` (>= 1).

    Raises:
        ValueError: Unknown kind, or ``S`` / ``M`` below 1.
    """

    kind: ScheduleKind
    num_stages: int
    num_microbatches: int

    def __post_init__(self) -> None:
        if self.kind not in _SCHEDULE_KINDS:
            raise ValueError(
                f"unknown pipeline schedule kind {self.kind!r} (expected one of {_SCHEDULE_KINDS})"
            )
        for name in ("num_stages", "num_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def num_instructions(self) -> int:
        """Instructions of one iteration: ``2 * S * M``."""
        return 2 * self.num_stages * self.num_microbatches

    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        """The ``(instruction, microbatch)`` pairs stage ``stage`` (0-based) runs, in order.

        1F1B: ``min(S - stage - 1, M)`` warm-up forwards, then forward/backward pairs, then the
        remaining backwards. GPipe: forwards 0..M-1, then backwards 0..M-1.

        Raises:
            ValueError: ``stage`` is not in ``range(num_stages)``.
        """
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise ValueError(f"stage must be an integer, got {stage!r}")
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is out of range (0..{self.num_stages - 1})")
        m_count = self.num_microbatches
        if self.kind == "gpipe":
            return [("forward", m) for m in range(m_count)] + [
                ("backward", m) for m in range(m_count)
            ]
        warmup = min(self.num_stages - stage - 1, m_count)
        order: list[tuple[str, int]] = [("forward", m) for m in range(warmup)]
        fwd, bwd = warmup, 0
        while fwd < m_count:
            order.append(("forward", fwd))
            order.append(("backward", bwd))
            fwd += 1
            bwd += 1
        order.extend(("backward", m) for m in range(bwd, m_count))
        return order
