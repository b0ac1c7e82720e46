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
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec

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

#: Instruction names, in the order the profile rows and plans use them.
INSTRUCTIONS: tuple[str, str] = ("forward", "backward")

ScheduleKind = Literal["1f1b", "gpipe"]
#: ``(stage, microbatch, instruction)``: one node of the iteration's DAG.
OpKey = tuple[int, int, str]

_SCHEDULE_KINDS = ("1f1b", "gpipe")
#: Besides the state at every step of the relaxation's walk, its states at this many evenly
#: spaced iteration times are rounded to plans too: a dense frontier where the walk's steps are
#: long (few events, e.g. many identical instructions moving together).
_GRID_POINTS = 1000
_ROW_FIELDS = ("stage", "instruction", "frequency", "time", "energy")


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


# --------------------------------------------------------------------------------------------
# The DAG


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


def check_p_block(p_block_w: float) -> float:
    """``p_block_w`` as a float, or ``ValueError`` unless it is within 0..MAX_P_BLOCK_W."""
    value = float(p_block_w)
    if not (math.isfinite(value) and 0.0 <= value <= MAX_P_BLOCK_W):
        raise ValueError(
            f"the blocking power (p_block_w) must be a number of W within 0..{MAX_P_BLOCK_W:g}, "
            f"got {p_block_w!r}"
        )
    return value


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
        p_block_w: Power drawn while a GPU waits, W (see the module docstring).

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


# --------------------------------------------------------------------------------------------
# Minimum cut


class _FlowNetwork:
    """Dinic's maximum flow on a small graph; edges ``2k`` and ``2k + 1`` are each other's
    reverse."""

    __slots__ = ("adj", "cap", "to")

    def __init__(self, num_nodes: int) -> None:
        self.adj: list[list[int]] = [[] for _ in range(num_nodes)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add_edge(self, u: int, v: int, capacity: float) -> int:
        edge = len(self.to)
        self.adj[u].append(edge)
        self.to.append(v)
        self.cap.append(capacity)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0.0)
        return edge

    def max_flow(self, source: int, sink: int, tiny: float, limit: float) -> float:
        """Push flow until none is left (or ``limit`` is reached); residual capacities below
        ``tiny`` count as saturated."""
        adj, to, cap = self.adj, self.to, self.cap
        n = len(adj)
        flow = 0.0
        while flow < limit:
            level = [-1] * n
            level[source] = 0
            queue = deque([source])
            while queue:
                u = queue.popleft()
                for e in adj[u]:
                    v = to[e]
                    if level[v] < 0 and cap[e] > tiny:
                        level[v] = level[u] + 1
                        queue.append(v)
            if level[sink] < 0:
                break
            it = [0] * n
            while True:
                # One augmenting path along the level graph (iterative DFS).
                path: list[int] = []
                u = source
                while u != sink:
                    edges = adj[u]
                    i = it[u]
                    while i < len(edges):
                        e = edges[i]
                        v = to[e]
                        if cap[e] > tiny and level[v] == level[u] + 1:
                            break
                        i += 1
                    it[u] = i
                    if i == len(edges):
                        if not path:
                            break
                        level[u] = -1  # dead end
                        e = path.pop()
                        u = to[e ^ 1]
                        it[u] += 1
                        continue
                    path.append(edges[i])
                    u = to[edges[i]]
                if u != sink:
                    break
                push = min(cap[e] for e in path)
                for e in path:
                    cap[e] -= push
                    cap[e ^ 1] += push
                flow += push
                if flow >= limit:
                    return flow
        return flow

    def reachable(self, source: int, tiny: float) -> list[bool]:
        seen = [False] * len(self.adj)
        seen[source] = True
        stack = [source]
        adj, to, cap = self.adj, self.to, self.cap
        while stack:
            u = stack.pop()
            for e in adj[u]:
                v = to[e]
                if not seen[v] and cap[e] > tiny:
                    seen[v] = True
                    stack.append(v)
        return seen


# --------------------------------------------------------------------------------------------
# The planner


_Record = list[tuple[float, float, tuple[int, ...]]]


class _Planner:
    """One frontier computation (see :func:`plan_frontier`).

    Instruction ``v`` (a node of the DAG, numbered in topological order) uses the options of
    its spec ``spec[v]`` (its stage and instruction): the non-dominated clocks, fastest first,
    with time ``opt_time``, energy ``opt_energy`` and effective energy ``opt_cost`` =
    energy - p_block * time (the total energy of a plan is Σ cost + p_block * S * T). A plan
    is a ``choice`` of option index per instruction.
    """

    def __init__(self, profile: InstructionProfile, schedule: PipelineSchedule, p_block: float):
        self.dag = dag = _dag(schedule)
        self.p_block = p_block
        self.n = len(dag.keys)
        spec_index: dict[tuple[int, str], int] = {}
        self.opt_freq: list[list[int]] = []
        self.opt_time: list[list[float]] = []
        self.opt_energy: list[list[float]] = []
        self.opt_cost: list[list[float]] = []
        for s in range(schedule.num_stages):
            for instr in INSTRUCTIONS:
                options = profile.frontier(s, instr, p_block_w=p_block)
                spec_index[(s, instr)] = len(self.opt_freq)
                self.opt_freq.append([o[0] for o in options])
                self.opt_time.append([o[1] for o in options])
                self.opt_energy.append([o[2] for o in options])
                self.opt_cost.append([o[2] - p_block * o[1] for o in options])
        self.spec: list[int] = [spec_index[(k[0], k[2])] for k in dag.keys]
        # Lower convex hull of every spec's (time, cost) options: vertex times and the cost
        # per second of moving along each hull segment (positive, decreasing with time).
        self.hull_t: list[list[float]] = []
        self.hull_slope: list[list[float]] = []
        for ts, cs in zip(self.opt_time, self.opt_cost, strict=True):
            hull: list[int] = []
            for k in range(len(ts)):
                while len(hull) >= 2:
                    a, b = hull[-2], hull[-1]
                    if (ts[b] - ts[a]) * (cs[k] - cs[a]) - (cs[b] - cs[a]) * (ts[k] - ts[a]) > 0:
                        break
                    hull.pop()
                hull.append(k)
            self.hull_t.append([ts[k] for k in hull])
            self.hull_slope.append(
                [(cs[a] - cs[b]) / (ts[b] - ts[a]) for a, b in itertools.pairwise(hull)]
            )

    def num_plans(self) -> int:
        count = 1
        for v in range(self.n):
            count *= len(self.opt_time[self.spec[v]])
        return count

    def durations(self, choice: Sequence[int]) -> list[float]:
        opt_time, spec = self.opt_time, self.spec
        return [opt_time[spec[v]][c] for v, c in enumerate(choice)]

    def exact(self, choice: Sequence[int]) -> tuple[float, float]:
        """Exact (time, energy), computed as :func:`evaluate` does."""
        dur = self.durations(choice)
        energy = [self.opt_energy[self.spec[v]][c] for v, c in enumerate(choice)]
        _, total = _forward_pass(self.dag.preds, dur)
        dag = self.dag
        return total, _energy(total, dur, energy, dag.stage_of, dag.num_stages, self.p_block)

    def record(self, choice: Sequence[int], dur: Sequence[float], out: _Record) -> None:
        """Append ``(exact time, approximate energy, choice)``."""
        _, total = _forward_pass(self.dag.preds, dur)
        opt_cost, spec = self.opt_cost, self.spec
        cost = math.fsum(opt_cost[spec[v]][c] for v, c in enumerate(choice))
        out.append((total, cost + self.p_block * self.dag.num_stages * total, tuple(choice)))

    # -- exhaustive search ---------------------------------------------------------------------

    def enumerate_all(self, out: _Record) -> None:
        """Every plan (only for tiny problems)."""
        ranges = [range(len(self.opt_time[self.spec[v]])) for v in range(self.n)]
        for choice in itertools.product(*ranges):
            self.record(choice, self.durations(choice), out)

    # -- slack recovery ------------------------------------------------------------------------

    def recover(self, choice: list[int], dur: list[float], deadline: float) -> None:
        """Move instructions with slack to cheaper (slower) clocks, greedily by energy saved,
        without the iteration time exceeding ``max(its time, deadline)`` (checked exactly, so
        a plan's time never grows past that bound). ``choice`` and ``dur`` change in place."""
        preds, succs, spec = self.dag.preds, self.dag.succs, self.spec
        opt_time, opt_cost = self.opt_time, self.opt_cost
        es, total = _forward_pass(preds, dur)
        total = max(total, deadline)
        lf = _backward_pass(succs, dur, total)
        tol = 1e-12 * total
        heap: list[tuple[float, int]] = []
        for v in range(self.n):
            sp, c = spec[v], choice[v]
            if c + 1 < len(opt_time[sp]) and lf[v] - es[v] - opt_time[sp][c + 1] >= -tol:
                heap.append((opt_cost[sp][c + 1] - opt_cost[sp][c], v))
        heapq.heapify(heap)
        while heap:
            _, v = heapq.heappop(heap)
            sp, c = spec[v], choice[v]
            new_dur = opt_time[sp][c + 1]
            if lf[v] - es[v] - new_dur < -tol:
                continue  # its slack shrank since it was queued (slack never grows here)
            # Push the later finish forward, exactly as _forward_pass computes it; undo the
            # move if any instruction would then end after ``total``.
            old_dur = dur[v]
            dur[v] = new_dur
            changed: list[tuple[int, float]] = []
            work = [v]
            ok = True
            while work:
                u = heapq.heappop(work)
                finish = es[u] + dur[u]
                if finish > total:
                    ok = False
                    break
                for w in succs[u]:
                    if finish > es[w]:
                        changed.append((w, es[w]))
                        es[w] = finish
                        heapq.heappush(work, w)
            if not ok:
                dur[v] = old_dur
                for w, old in reversed(changed):
                    es[w] = old
                continue
            choice[v] = c + 1
            back = [-v]
            while back:
                u = -heapq.heappop(back)
                start = lf[u] - dur[u]
                for p in preds[u]:
                    if start < lf[p]:
                        lf[p] = start
                        heapq.heappush(back, -p)
            if c + 2 < len(opt_time[sp]) and lf[v] - es[v] - opt_time[sp][c + 2] >= -tol:
                heapq.heappush(heap, (opt_cost[sp][c + 2] - opt_cost[sp][c + 1], v))

    def record_rounded(self, d: Sequence[float], total: float, out: _Record) -> None:
        """Round a relaxed state (durations ``d``, iteration time ``total``) to the slowest
        clock no slower than each duration, hand slack back up to ``total`` and record it."""
        spec, opt_time = self.spec, self.opt_time
        choice = [
            bisect.bisect_right(opt_time[spec[v]], d[v] * (1.0 + 1e-12)) - 1 for v in range(self.n)
        ]
        dur = self.durations(choice)
        self.recover(choice, dur, total)
        self.record(choice, dur, out)

    # -- the relaxation's walk -----------------------------------------------------------------

    def relax_walk(
        self,
        time_limit_s: float | None,
        out: _Record,
        samples: int = 0,
        report: _Progress | None = None,
    ) -> None:
        """Walk the optimal time-energy curve of the convex relaxation (every instruction's
        options replaced by their lower convex hull, durations continuous) from the cheapest
        plan to the fastest, by Phillips-Dessouky steps: a minimum cut of the critical subgraph
        picks the instructions to shorten (cut forwards) and to lengthen (cut backwards) so
        every critical path shortens at the least cost per second; the step runs until an
        instruction reaches a hull vertex or another path becomes critical. Each state is
        rounded to clocks and recorded."""
        preds, succs, spec = self.dag.preds, self.dag.succs, self.spec
        hull_t, hull_slope = self.hull_t, self.hull_slope
        n = self.n
        # d[v]: relaxed duration; lo[v]: largest hull vertex with hull_t <= d[v] (d[v] equals
        # hull_t[lo[v]] exactly when at a vertex).
        lo = [len(hull_t[spec[v]]) - 1 for v in range(n)]
        d = [hull_t[spec[v]][lo[v]] for v in range(n)]
        big = 4.0 * (
            math.fsum(hull_slope[spec[v]][0] for v in range(n) if hull_slope[spec[v]]) + 1.0
        )
        tiny = 1e-12 * big
        _, t_slow = _forward_pass(preds, d)
        _, t_fast = _forward_pass(preds, [hull_t[spec[v]][0] for v in range(n)])
        grid = (t_slow - t_fast) / samples if samples > 0 else 0.0

        def bounds(v: int) -> tuple[float, float]:
            """(lb, ub): energy per second of lengthening / shortening instruction v; -big /
            big where it cannot move that way."""
            ht, hs, j = hull_t[spec[v]], hull_slope[spec[v]], lo[v]
            if d[v] == ht[j]:
                return (hs[j] if j < len(hs) else -big), (hs[j - 1] if j > 0 else big)
            return hs[j], hs[j]

        # One residual network serves the whole walk: instruction v is the arc 2v -> 2v + 1
        # with a flow f in [lb, ub] (residual ub - f forward, f - lb backward), critical
        # precedences are uncapacitated arcs. The maximum flow of a step stays feasible for the
        # next (bounds only change on cut arcs, which sit at the bound that does not move), so
        # each step only augments it; the flow value is the cost per second of the next step.
        source, sink = 2 * n, 2 * n + 1
        net = _FlowNetwork(2 * n + 2)
        cap = net.cap
        arc: list[int] = []
        cur: list[tuple[float, float]] = []
        for v in range(n):
            lb, ub = bounds(v)
            arc.append(net.add_edge(2 * v, 2 * v + 1, ub))
            cap[arc[v] ^ 1] = -lb
            cur.append((lb, ub))
        linked: set[tuple[int, int]] = set()
        flow_value = 0.0
        started = last_log = time.perf_counter()
        steps = 0
        # Every step ends at an event (a hull vertex reached, a path turned critical); this
        # bounds them generously in case rounding ever made the walk crawl.
        max_steps = 50 * (n + sum(len(hull_t[spec[v]]) for v in range(n))) + 1000
        while True:
            es, total = _forward_pass(preds, d)
            self.record_rounded(d, total, out)
            if steps >= max_steps:  # pragma: no cover - defensive
                logger.warning("planner: stopped after %d steps at T=%.6f s", steps, total)
                break
            now = time.perf_counter()
            if time_limit_s is not None and now - started > time_limit_s:
                logger.warning(
                    "planner: time limit %.1f s reached after %d steps at T=%.6f s; the "
                    "frontier's faster part is missing",
                    time_limit_s,
                    steps,
                    total,
                )
                break
            if now - last_log > 1.0:
                last_log = now
                logger.debug("planner: step %d, T=%.6f s, %.1f s", steps, total, now - started)
            if report is not None and t_slow > t_fast:
                report(_WALK_SHARE * (t_slow - total) / (t_slow - t_fast))
            lf = _backward_pass(succs, d, total)
            tol = 1e-9 * total
            crit = [v for v in range(n) if lf[v] - es[v] - d[v] <= tol]
            for v in crit:
                finish = es[v] + d[v]
                if es[v] <= tol and (source, v) not in linked:
                    linked.add((source, v))
                    net.add_edge(source, 2 * v, big)
                if finish >= total - tol and (v, sink) not in linked:
                    linked.add((v, sink))
                    net.add_edge(2 * v + 1, sink, big)
                for w in succs[v]:
                    if (
                        abs(es[w] - finish) <= tol
                        and lf[w] - es[w] - d[w] <= tol
                        and (v, w) not in linked
                    ):
                        linked.add((v, w))
                        net.add_edge(2 * v + 1, 2 * w, big)
            flow_value += net.max_flow(source, sink, tiny, big)
            if flow_value >= 0.5 * big:
                break  # a critical path is at its fastest everywhere: T is minimal
            seen = net.reachable(source, tiny)
            sigma: dict[int, int] = {}
            delta = math.inf
            for v in crit:
                ht, j = hull_t[spec[v]], lo[v]
                if seen[2 * v] and not seen[2 * v + 1]:
                    sigma[v] = 1
                    delta = min(delta, d[v] - (ht[j] if d[v] > ht[j] else ht[j - 1]))
                elif seen[2 * v + 1] and not seen[2 * v]:
                    sigma[v] = -1
                    delta = min(delta, ht[j + 1] - d[v])
            if sigma:
                delta = self.max_step(d, sigma, total, delta)
            if not sigma or not delta > 0.0:  # pragma: no cover - numerically stuck
                logger.debug("planner: no progress at step %d (T=%.6f s); stopping", steps, total)
                break
            if grid > 0.0:
                # Also round the states between this step's ends at every grid point.
                k = math.floor((total - t_fast) / grid)
                if t_fast + k * grid >= total:
                    k -= 1
                while k >= 0 and t_fast + k * grid > total - delta:
                    target = t_fast + k * grid
                    mid = list(d)
                    for v, sg in sigma.items():
                        mid[v] -= sg * (total - target)
                    self.record_rounded(mid, target, out)
                    k -= 1
            for v, sg in sigma.items():
                ht, j = hull_t[spec[v]], lo[v]
                if sg > 0:
                    if d[v] == ht[j]:
                        j -= 1  # leaves vertex j for the segment below it
                    nd = d[v] - delta
                    if nd <= ht[j] * (1.0 + 1e-12):
                        nd = ht[j]
                else:
                    nd = d[v] + delta
                    if nd >= ht[j + 1] * (1.0 - 1e-12):
                        j += 1
                        nd = ht[j]
                lo[v], d[v] = j, nd
                lb, ub = bounds(v)
                old_lb, old_ub = cur[v]
                if lb != old_lb or ub != old_ub:
                    cur[v] = (lb, ub)
                    e = arc[v]
                    cap[e] = max(cap[e] + ub - old_ub, 0.0)
                    cap[e ^ 1] = max(cap[e ^ 1] + old_lb - lb, 0.0)
            steps += 1
        logger.debug(
            "planner: relaxation walk of %d steps in %.3f s", steps, time.perf_counter() - started
        )

    def max_step(
        self, d: Sequence[float], sigma: Mapping[int, int], total: float, delta: float
    ) -> float:
        """The largest step ``<= delta`` along ``sigma`` (durations ``d - step * sigma``) that
        shortens the iteration by exactly the step, i.e. before a non-critical path catches up.

        The longest path at the trial step is either a critical one (fine) or a path whose
        crossing point with ``total - step`` bounds the step; a few passes converge."""
        preds = self.dag.preds
        n = self.n
        for _ in range(100):
            dd = list(d)
            for v, sg in sigma.items():
                dd[v] -= sg * delta
            es = [0.0] * n
            arg = [-1] * n
            best_v, best = -1, -math.inf
            for v in range(n):
                start, a = 0.0, -1
                for p in preds[v]:
                    f = es[p] + dd[p]
                    if f > start:
                        start, a = f, p
                es[v], arg[v] = start, a
                f = start + dd[v]
                if f > best:
                    best, best_v = f, v
            if best <= total - delta + 1e-12 * total:
                return delta
            length, k, v = 0.0, 0, best_v
            while v >= 0:
                length += d[v]
                k += sigma.get(v, 0)
                v = arg[v]
            if k >= 1:  # pragma: no cover - only by rounding
                return delta
            delta = (total - length) / (1 - k)
            if delta <= 0.0:
                return 0.0
        return delta  # pragma: no cover


class PlanningStopped(Exception):
    """:func:`plan_frontier` was stopped (its ``stop`` event was set)."""


#: The share of :func:`plan_frontier`'s progress given to the walk (the rest: exact evaluation).
_WALK_SHARE = 0.9


class _Progress:
    """Reports the fraction done at most every 0.1 s, and raises :class:`PlanningStopped` once
    ``stop`` is set (checked at every report)."""

    def __init__(
        self, progress: Callable[[float], None] | None, stop: threading.Event | None
    ) -> None:
        self._progress = progress
        self._stop = stop
        self._last = 0.0

    def __call__(self, fraction: float, *, force: bool = False) -> None:
        if self._stop is not None and self._stop.is_set():
            raise PlanningStopped("planning stopped")
        if self._progress is None:
            return
        now = time.monotonic()
        if force or now - self._last >= 0.1:
            self._last = now
            self._progress(min(max(fraction, 0.0), 1.0))


def plan_frontier(
    profile: InstructionProfile,
    schedule: PipelineSchedule,
    *,
    p_block_w: float = 0.0,
    exhaustive_limit: int = 10_000,
    time_limit_s: float | None = None,
    progress: Callable[[float], None] | None = None,
    stop: threading.Event | None = None,
) -> Frontier:
    """The time-energy Pareto frontier of clock plans for one training iteration.

    Args:
        profile: Measured time and energy per stage, instruction and clock; it must cover
            exactly the schedule's stages, both instructions each.
        schedule: The pipeline schedule.
        p_block_w: Power a GPU draws while it waits on others, W: idle time is charged at this
            power (Perseus's objective).
        exhaustive_limit: Problems with at most this many plans (the product over instructions
            of their non-dominated clocks) are solved exactly by enumerating every plan.
        time_limit_s: Stop the walk after this long (logs a warning; the frontier then lacks
            plans between the last one reached and the fastest); ``None``: no limit.
        progress: Called with the fraction done (0 to 1), at most every 0.1 s and once at 1.0:
            how far the walk is from the cheapest plan's iteration time to the fastest's
            (most of the work), then the exact evaluation of the candidate plans.
        stop: Set from another thread to abandon the planning: :class:`PlanningStopped` is
            raised within one walk step (milliseconds, even on large pipelines).

    Returns:
        The frontier. Every point is a feasible plan whose time and energy are exactly what
        :func:`evaluate` returns for its clocks; the first point is as fast as any plan can be.

    Raises:
        ValueError: The profile does not cover the schedule, or ``p_block_w`` is negative.
        PlanningStopped: ``stop`` was set.

    Algorithm: each instruction's clocks are reduced to the non-dominated ones (in time and
    energy - ``p_block_w`` * time) and their lower convex hull. The exact optimal curve of that
    convex relaxation is walked from the cheapest plan to the fastest with Phillips-Dessouky
    minimum-cut steps: not in unit-time increments but from breakpoint to breakpoint, on one
    residual network augmented from step to step. The relaxed states at every step and at
    1000 evenly spaced iteration times are rounded to real clocks (the slowest no slower than
    each duration), then slack is handed back greedily by energy saved; the all-fastest plan
    gets the same treatment. The Pareto set of all these plans, re-evaluated exactly, is the
    frontier.
    """
    p_block = check_p_block(p_block_w)
    profile.check_covers(schedule)
    started = time.perf_counter()
    planner = _Planner(profile, schedule, p_block)
    dag = planner.dag
    report = _Progress(progress, stop)

    plans: _Record = []
    exhaustive = planner.num_plans() <= exhaustive_limit
    if exhaustive:
        planner.enumerate_all(plans)
    else:
        planner.relax_walk(time_limit_s, plans, _GRID_POINTS, report)
        # The all-fastest plan with its slack handed back.
        fastest = [0] * planner.n
        dur = planner.durations(fastest)
        planner.recover(fastest, dur, 0.0)
        planner.record(fastest, dur, plans)

    # Pre-filter on approximate energies (keeping near-ties), then make the survivors exact.
    plans.sort(key=lambda x: (x[0], x[1]))
    candidates: set[tuple[int, ...]] = set()
    best = math.inf
    for _, energy, choice in plans:
        if energy < best + 1e-9 * abs(energy):
            candidates.add(choice)
            best = min(best, energy)
    points: list[FrontierPoint] = []
    exact = []
    for n, c in enumerate(candidates):
        exact.append((planner.exact(c), c))
        report(_WALK_SHARE + (1.0 - _WALK_SHARE) * (n + 1) / len(candidates))
    for (total, energy), choice in sorted(exact):
        if points and energy >= points[-1].energy_j:
            continue
        freqs = [planner.opt_freq[planner.spec[v]][c] for v, c in enumerate(choice)]
        points.append(FrontierPoint(total, energy, dict(zip(dag.keys, freqs, strict=True))))

    max_freq_plan = {key: max(profile.measurements(key[0], key[2])) for key in dag.keys}
    max_freq_time, max_freq_energy = evaluate(profile, schedule, max_freq_plan, p_block_w=p_block)
    logger.debug(
        "planner: %s %dx%d, %d frontier points from %d plans (%s) in %.3f s",
        schedule.kind,
        schedule.num_stages,
        schedule.num_microbatches,
        len(points),
        len(plans),
        "exhaustive" if exhaustive else "relaxation walk",
        time.perf_counter() - started,
    )
    report(1.0, force=True)
    return Frontier(points, max_freq_time, schedule, p_block, max_freq_energy)
