"""Instruction profiles: measured time and energy per stage, instruction and SM clock.

:class:`InstructionProfile` validates and holds the profiler's figures (from a table or its
CSV rows) and gives each instruction's non-dominated clocks; :func:`check_p_block` validates
the blocking power the planner charges for idle time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .schedule import INSTRUCTIONS, PipelineSchedule

logger = logging.getLogger(__name__)


_ROW_FIELDS = ("stage", "instruction", "frequency", "time", "energy")


#: Bounds on a profile's figures and on the blocking power: far beyond any real instruction
#: (a day, a gigajoule) or stage (a megawatt), and small enough that no sum over a pipeline
#: overflows a float.
MAX_TIME_S = 86_400.0
MAX_ENERGY_J = 1e9
MAX_P_BLOCK_W = 1e6


class InstructionProfile:
    """Time (s) and energy (J) of each instruction of each stage at each profiled clock (MHz).

    Args:
        measurements: ``(stage, instruction) -> {frequency: (time_s, energy_j)}``.

    Raises:
        ValueError: An unknown instruction, a negative stage or non-positive frequency, an empty
            measurement table, a time that is not within (0, :data:`MAX_TIME_S`] or an energy
            not within [0, :data:`MAX_ENERGY_J`].

    Every measured clock is kept (so :func:`evaluate` accepts any of them); the planner only
    considers the clocks of :meth:`frontier`, which drops those another clock dominates.
    """

    def __init__(self, measurements: Mapping[tuple[int, str], Mapping[int, tuple[float, float]]]):
        table: dict[tuple[int, str], dict[int, tuple[float, float]]] = {}
        for key, per_freq in measurements.items():
            stage, instruction = key
            if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
                raise ValueError(f"stage must be an integer >= 0, got {stage!r}")
            if instruction not in INSTRUCTIONS:
                raise ValueError(
                    f"unknown instruction {instruction!r} (expected one of {INSTRUCTIONS})"
                )
            if not per_freq:
                raise ValueError(f"empty profile for stage {stage} {instruction}")
            clean: dict[int, tuple[float, float]] = {}
            for freq, (time_s, energy_j) in per_freq.items():
                where = f"stage {stage} {instruction} at {freq} MHz"
                if isinstance(freq, bool) or not isinstance(freq, int) or freq <= 0:
                    raise ValueError(f"frequency must be a positive integer (MHz), got {freq!r}")
                time_f, energy_f = float(time_s), float(energy_j)
                if not (math.isfinite(time_f) and 0.0 < time_f <= MAX_TIME_S):
                    raise ValueError(
                        f"{where}: time must be above 0 and at most {MAX_TIME_S:g} s, "
                        f"got {time_s!r}"
                    )
                if not (math.isfinite(energy_f) and 0.0 <= energy_f <= MAX_ENERGY_J):
                    raise ValueError(
                        f"{where}: energy must be within 0..{MAX_ENERGY_J:g} J, got {energy_j!r}"
                    )
                clean[freq] = (time_f, energy_f)
            table[(stage, instruction)] = clean
        if not table:
            raise ValueError("empty instruction profile")
        self._table = table

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any] | Sequence[Any]]) -> InstructionProfile:
        """Build a profile from profiler rows.

        A row is a mapping with the keys ``stage``, ``instruction``, ``frequency``, ``time``,
        ``energy`` (e.g. a :class:`csv.DictReader` row of the profiler's CSV, values may be
        strings), or a sequence ``(stage, instruction, frequency, time, energy)``, or the
        profiler CSV's full 9 columns ``(rank, dp_rank, pp_rank, tp_rank, stage, instruction,
        frequency, time, energy)``. Rows of one ``(stage, instruction, frequency)`` from several
        ranks (tensor or data parallel replicas of a stage) are averaged.

        Raises:
            ValueError: A malformed row, or any error of the constructor.
        """
        sums: dict[tuple[int, str], dict[int, list[float]]] = {}
        for lineno, row in enumerate(rows):
            try:
                if isinstance(row, Mapping):
                    values = [row[name] for name in _ROW_FIELDS]
                elif len(row) == 5:
                    values = list(row)
                elif len(row) == 9:
                    values = list(row[4:])
                else:
                    raise ValueError(f"expected 5 or 9 columns, got {len(row)}")
                stage_v, instr_v, freq_v, time_v, energy_v = values
                stage = _as_int(stage_v, "stage")
                freq = _as_int(freq_v, "frequency")
                time_s, energy_j = float(time_v), float(energy_v)
                instruction = str(instr_v).strip().lower()
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"profile row {lineno}: {exc!s}") from None
            acc = sums.setdefault((stage, instruction), {}).setdefault(freq, [0.0, 0.0, 0.0])
            acc[0] += time_s
            acc[1] += energy_j
            acc[2] += 1.0
        return cls(
            {
                key: {f: (a[0] / a[2], a[1] / a[2]) for f, a in per_freq.items()}
                for key, per_freq in sums.items()
            }
        )

    @property
    def stages(self) -> list[int]:
        """The stages with at least one measured instruction, ascending."""
        return sorted({stage for stage, _ in self._table})

    def measurements(self, stage: int, instruction: str) -> dict[int, tuple[float, float]]:
        """Every measured ``{frequency: (time_s, energy_j)}`` of one instruction of a stage.

        Raises:
            ValueError: Nothing was measured for this stage and instruction.
        """
        try:
            return dict(self._table[(stage, instruction)])
        except KeyError:
            raise ValueError(f"no profile for stage {stage} {instruction}") from None

    def frontier(
        self, stage: int, instruction: str, *, p_block_w: float = 0.0
    ) -> list[tuple[int, float, float]]:
        """The non-dominated ``(frequency, time_s, energy_j)`` options, fastest first.

        A clock is dominated when another is at least as fast and costs at most as much
        *effective* energy ``energy - p_block_w * time`` (one of the two strictly): with idle
        power, a slower instruction also shortens the wait of its stage, so only this
        comparison is safe. With ``p_block_w = 0`` it is plain "slower and more energy". Ties
        keep the higher clock. Times strictly increase and energies strictly decrease along
        the list when ``p_block_w = 0``.
        """
        items = sorted(
            self.measurements(stage, instruction).items(),
            key=lambda kv: (kv[1][0], kv[1][1] - p_block_w * kv[1][0], -kv[0]),
        )
        out: list[tuple[int, float, float]] = []
        best = math.inf
        for freq, (time_s, energy_j) in items:
            cost = energy_j - p_block_w * time_s
            if cost < best:
                out.append((freq, time_s, energy_j))
                best = cost
        return out

    def check_covers(self, schedule: PipelineSchedule) -> None:
        """Raise :class:`ValueError` unless every stage of ``schedule`` has both instructions
        profiled and no profiled stage lies beyond it."""
        missing = [
            f"stage {s} {i}"
            for s in range(schedule.num_stages)
            for i in INSTRUCTIONS
            if (s, i) not in self._table
        ]
        if missing:
            raise ValueError("missing instruction profiles: " + ", ".join(missing))
        extra = sorted({s for s, _ in self._table if s >= schedule.num_stages})
        if extra:
            raise ValueError(
                f"profile has stages {extra} beyond the schedule's {schedule.num_stages} stages"
            )

    def __repr__(self) -> str:
        sizes = {f"{s}/{i}": len(v) for (s, i), v in sorted(self._table.items())}
        return f"InstructionProfile({sizes})"


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    number = float(value)
    if not number.is_integer():
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(number)


def check_p_block(p_block_w: float) -> float:
    """``p_block_w`` as a float, or ``ValueError`` unless it is within 0..MAX_P_BLOCK_W."""
    value = float(p_block_w)
    if not (math.isfinite(value) and 0.0 <= value <= MAX_P_BLOCK_W):
        raise ValueError(
            f"the blocking power (p_block_w) must be a number of W within 0..{MAX_P_BLOCK_W:g}, "
            f"got {p_block_w!r}"
        )
    return value
