"""The iteration's instruction DAG: construction, longest paths and exact plan evaluation.

:class:`_Dag` numbers the instructions of a schedule in topological order with their
precedence edges; the forward and backward passes give earliest starts, latest finishes and
the iteration time; :func:`evaluate` is the exact time and energy of any plan.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import deque
from collections.abc import Mapping, Sequence

from .profile import InstructionProfile, check_p_block
from .schedule import INSTRUCTIONS, OpKey, PipelineSchedule

logger = logging.getLogger(__name__)


class _Dag:
    """The instruction DAG with nodes numbered in a topological order."""

    __slots__ = ("index", "keys", "num_stages", "preds", "stage_of", "succs")

    def __init__(self, schedule: PipelineSchedule) -> None:
        s_count, m_count = schedule.num_stages, schedule.num_microbatches
        keys: list[OpKey] = [
            (s, m, i) for s in range(s_count) for i in INSTRUCTIONS for m in range(m_count)
        ]
        pos = {k: n for n, k in enumerate(keys)}
        edges: set[tuple[int, int]] = set()
        for s in range(s_count):
            order = schedule.stage_order(s)
            for (i1, m1), (i2, m2) in itertools.pairwise(order):
                edges.add((pos[(s, m1, i1)], pos[(s, m2, i2)]))
            for m in range(m_count):
                if s + 1 < s_count:
                    edges.add((pos[(s, m, "forward")], pos[(s + 1, m, "forward")]))
                    edges.add((pos[(s + 1, m, "backward")], pos[(s, m, "backward")]))
                else:
                    edges.add((pos[(s, m, "forward")], pos[(s, m, "backward")]))
        n = len(keys)
        out: list[list[int]] = [[] for _ in range(n)]
        indeg = [0] * n
        for u, v in sorted(edges):
            out[u].append(v)
            indeg[v] += 1
        queue = deque(v for v in range(n) if indeg[v] == 0)
        topo: list[int] = []
        while queue:
            u = queue.popleft()
            topo.append(u)
            for v in out[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    queue.append(v)
        if len(topo) != n:  # pragma: no cover - the schedules above are acyclic
            raise RuntimeError("pipeline schedule has a dependency cycle")
        new = {old: idx for idx, old in enumerate(topo)}
        self.keys: list[OpKey] = [keys[old] for old in topo]
        self.index: dict[OpKey, int] = {k: i for i, k in enumerate(self.keys)}
        self.stage_of: list[int] = [k[0] for k in self.keys]
        self.succs: list[tuple[int, ...]] = [
            tuple(sorted(new[v] for v in out[old])) for old in topo
        ]
        preds: list[list[int]] = [[] for _ in range(n)]
        for u in range(n):
            for v in self.succs[u]:
                preds[v].append(u)
        self.preds: list[tuple[int, ...]] = [tuple(p) for p in preds]
        self.num_stages = s_count


@functools.lru_cache(maxsize=16)
def _dag(schedule: PipelineSchedule) -> _Dag:
    return _Dag(schedule)


def _forward_pass(
    preds: Sequence[tuple[int, ...]], dur: Sequence[float]
) -> tuple[list[float], float]:
    """Earliest start of every node and the iteration time (the longest path)."""
    es = [0.0] * len(dur)
    total = 0.0
    for v, pv in enumerate(preds):
        start = 0.0
        for p in pv:
            finish = es[p] + dur[p]
            if finish > start:
                start = finish
        es[v] = start
        finish = start + dur[v]
        if finish > total:
            total = finish
    return es, total


def _backward_pass(
    succs: Sequence[tuple[int, ...]], dur: Sequence[float], total: float
) -> list[float]:
    """Latest finish of every node that keeps the iteration time at ``total``."""
    n = len(dur)
    lf = [total] * n
    for v in range(n - 1, -1, -1):
        latest = total
        for w in succs[v]:
            start = lf[w] - dur[w]
            if start < latest:
                latest = start
        lf[v] = latest
    return lf


def _energy(
    total: float,
    dur: Sequence[float],
    energy: Sequence[float],
    stage_of: Sequence[int],
    num_stages: int,
    p_block_w: float,
) -> float:
    """Σ instruction energies + ``p_block_w`` * Σ_stages (T - busy time of the stage)."""
    busy = [0.0] * num_stages
    e_sum = 0.0
    for v, e in enumerate(energy):
        e_sum += e
        busy[stage_of[v]] += dur[v]
    if p_block_w:
        idle = 0.0
        for b in busy:
            idle += total - b
        e_sum += p_block_w * idle
    return e_sum


def evaluate(
    profile: InstructionProfile,
    schedule: PipelineSchedule,
    frequencies: Mapping[OpKey, int],
    *,
    p_block_w: float = 0.0,
) -> tuple[float, float]:
    """Exact ``(iteration_time_s, energy_j)`` of a plan.

    Args:
        profile: Measured time and energy per stage, instruction and clock.
        schedule: The pipeline schedule.
        frequencies: ``(stage, microbatch, instruction) -> MHz`` for every instruction; each
            clock must be one the profile measured for that stage and instruction.
        p_block_w: Power drawn while a GPU waits, W (see the package docstring).

    Raises:
        ValueError: The profile does not cover the schedule, the plan misses or adds
            instructions, or names a clock that was not profiled.
    """
    p_block = check_p_block(p_block_w)
    profile.check_covers(schedule)
    dag = _dag(schedule)
    if len(frequencies) != len(dag.keys):
        extra = [k for k in frequencies if k not in dag.index]
        if extra:
            raise ValueError(f"plan has instructions not in the schedule: {extra[:5]}")
    tables = {
        (s, i): profile.measurements(s, i) for s in range(schedule.num_stages) for i in INSTRUCTIONS
    }
    dur: list[float] = []
    energy: list[float] = []
    for key in dag.keys:
        try:
            freq = frequencies[key]
        except KeyError:
            raise ValueError(f"plan has no frequency for {key}") from None
        try:
            time_s, energy_j = tables[(key[0], key[2])][freq]
        except KeyError:
            raise ValueError(
                f"{key}: {freq!r} MHz was not profiled for stage {key[0]} {key[2]}"
            ) from None
        dur.append(time_s)
        energy.append(energy_j)
    _, total = _forward_pass(dag.preds, dur)
    return total, _energy(total, dur, energy, dag.stage_of, dag.num_stages, p_block)
