"""Frontier search: the relaxation walk, rounding, slack recovery and :func:`plan_frontier`.

:class:`_Planner` holds one frontier computation: each instruction's non-dominated clocks and
their lower convex hull, exhaustive enumeration for tiny problems, the Phillips-Dessouky walk of
minimum cuts over the convex relaxation, and the rounding of its states to real clocks with
slack handed back greedily. :func:`plan_frontier` runs it and keeps the Pareto set.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from .dag import _backward_pass, _dag, _energy, _forward_pass, evaluate
from .frontier import Frontier, FrontierPoint
from .mincut import _FlowNetwork
from .profile import InstructionProfile, check_p_block
from .schedule import INSTRUCTIONS, PipelineSchedule

logger = logging.getLogger(__name__)


#: Besides the state at every step of the relaxation's walk, its states at this many evenly
#: spaced iteration times are rounded to plans too: a dense frontier where the walk's steps are
#: long (few events, e.g. many identical instructions moving together).
_GRID_POINTS = 1000


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
