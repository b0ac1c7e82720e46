"""Simulated GPUs with a physical power model (pure Python, exact ground truth).

This is the hardware underneath :mod:`zeus_async.testing.sim_pynvml`, a pynvml-compatible
module, so the real NVML backend (:mod:`zeus_async.devices.nvml`) runs unchanged on it.

Model, per GPU:

* Utilization ``u(t)`` follows a :mod:`workload <zeus_async.devices.sim_workload>` (a periodic
  piecewise-constant trace), a pure function of ``wall time - config.epoch_ns`` and the seed.
* Power ``P = idle + (max - idle) * u * (f / f_max)^3`` where ``f`` is the SM clock: ``f_max``,
  or the upper end of the locked clock range. If that exceeds the power limit, the clock drops
  until ``P == limit`` (never below the minimum clock). Throughput relative to full speed is
  ``memory_bound_frac + (1 - memory_bound_frac) * f_eff / f_max``, so a lower limit trades time
  for energy the way real GPUs do.
* Power is piecewise constant between trace breakpoints and setting changes, so ground truth
  (:meth:`SimNode.truth_energy_j`) is an exact sum. Long spans cost O(log n): whole periods of
  the trace are multiplied, not summed.
* What NVML reports is derived from the truth on a grid anchored at the *counter origin*: the
  energy counter (mJ) advances every ``counter_period_s``; instant power is the mean over the
  first ``instant_window_s`` of the last completed ``instant_period_s``; average power is the mean
  over the last ``average_window_s``, refreshed every ``average_period_s``; temperature follows
  mean power over the last ``thermal_tau_s`` (a box-filter thermal lag). Reported power can
  carry deterministic sensor noise (``power_noise_w``, uniform, per update); truth and the
  energy counter never do.

Time comes from an injectable :class:`~zeus_async.clock.Clock` (``wall_ns()``), so a
``FakeClock`` runs the simulator faster than real time. Integer nanoseconds throughout.

Several processes with the same configuration see the same node: the trace, UUIDs, processes
and the counter origin (``config.counter_origin_ns``, default midnight UTC of the day the node
was created) are deterministic. **Settable state (power limit, locked clocks, persistence mode)
is per process**: a limit set in one process does not affect what another process reads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
import uuid
from bisect import bisect_right
from collections.abc import Mapping
from typing import Final, NamedTuple

from ..clock import Clock, RealClock
from ..errors import ConfigError
from .sim_config import (
    ARCH_CODES,
    COMPUTE_CAPABILITY,
    SIM_ENV_VAR,
    ArchName,
    Feature,
    GpuOverride,
    SimConfig,
    load_sim_config,
)
from .sim_workload import (
    ConstantWorkload,
    IdleWorkload,
    Profile,
    RandomWorkload,
    SquareWorkload,
    TraceWorkload,
    Workload,
    build_profile,
    stable_hash,
)

__all__ = [
    "ARCH_CODES",
    "COMPUTE_CAPABILITY",
    "SIM_ENV_VAR",
    "ArchName",
    "ConstantWorkload",
    "Feature",
    "GpuOverride",
    "IdleWorkload",
    "RandomWorkload",
    "SimConfig",
    "SimGpu",
    "SimNode",
    "SimProcess",
    "SquareWorkload",
    "TraceWorkload",
    "Workload",
    "load_sim_config",
]

logger = logging.getLogger(__name__)

# >= 2 KiB so hashlib releases the GIL while hashing it (~2-3 us of CPU per chunk).
_SPIN_CHUNK = bytes(2048)

NS: Final = 1_000_000_000
DAY_NS: Final = 86_400 * NS
_NEG_INF: Final = -(1 << 62)


class SimProcess(NamedTuple):
    """A fake process running on a simulated GPU."""

    pid: int
    sm_share: float
    memory_bytes: int


class _Settings(NamedTuple):
    limit_w: float
    lock_min_mhz: int | None
    lock_max_mhz: int | None


def _div_ns(value: float, ns: int) -> float:
    return value * ns / NS


class _Table:
    """Rates of one GPU's trace segments under fixed settings, with running sums over a period.

    ``cum_x[i]`` is the integral of rate ``x`` from the period start to segment ``i``'s start
    (``cum_x[n]``: one whole period); units: J for power, work-seconds for throughput,
    util-seconds for utilization.
    """

    __slots__ = ("clk_mhz", "cum_e", "cum_u", "cum_w", "power", "profile", "thru")

    def __init__(self, gpu: SimGpu, settings: _Settings) -> None:
        cfg = gpu.node.config
        prof = gpu.profile
        self.profile = prof
        f_max = float(cfg.max_sm_clock_mhz)
        f_min = float(cfg.min_sm_clock_mhz)
        target = f_max if settings.lock_max_mhz is None else float(settings.lock_max_mhz)
        target = min(max(target, f_min), f_max)
        r, r_min = target / f_max, f_min / f_max
        idle_clk = float(max(cfg.idle_sm_clock_mhz, settings.lock_min_mhz or 0))
        idle, dyn, limit = gpu.idle_w, gpu.max_w - gpu.idle_w, settings.limit_w
        self.power: list[float] = []
        self.thru: list[float] = []
        self.clk_mhz: list[float] = []
        for u in prof.utils:
            p, r_eff = idle + dyn * u * r**3, r
            if u > 0 and p > limit:
                cube = (limit - idle) / (dyn * u)
                if cube >= r_min**3:
                    r_eff, p = cube ** (1.0 / 3.0), limit
                else:
                    r_eff, p = r_min, idle + dyn * u * r_min**3
            self.power.append(p)
            self.thru.append(gpu.memory_bound_frac + (1.0 - gpu.memory_bound_frac) * r_eff)
            self.clk_mhz.append(r_eff * f_max if u > 0 else min(idle_clk, target))
        self.cum_e = self._running(self.power)
        self.cum_w = self._running(self.thru)
        self.cum_u = self._running(prof.utils)

    def _running(self, rates: list[float]) -> list[float]:
        offs, out, acc = self.profile.offsets_ns, [0.0], 0.0
        ends = [*offs[1:], self.profile.period_ns]
        for rate, start, end in zip(rates, offs, ends, strict=True):
            acc += _div_ns(rate, end - start)
            out.append(acc)
        return out

    def integral(self, cum: list[float], rates: list[float], a: int, b: int) -> float:
        """Integral of a rate over ``[a, b]`` (times relative to the epoch; signed)."""
        if b < a:
            return -self.integral(cum, rates, b, a)
        prof = self.profile
        ka, ta, ia = prof.locate(a)
        kb, tb, ib = prof.locate(b)
        fa = cum[ia] + _div_ns(rates[ia], ta - prof.offsets_ns[ia])
        fb = cum[ib] + _div_ns(rates[ib], tb - prof.offsets_ns[ib])
        if ka == kb:
            return fb - fa
        return (cum[-1] - fa) + (kb - ka - 1) * cum[-1] + fb

    def advance_work(self, a: int, amount: float) -> int:
        """Relative time at which ``amount`` work-seconds, started at ``a``, are done."""
        prof = self.profile
        k, ta, i = prof.locate(a)
        target = self.cum_w[i] + _div_ns(self.thru[i], ta - prof.offsets_ns[i]) + amount
        per = self.cum_w[-1]
        cycles = int(target // per)
        rem = target - cycles * per
        j = min(max(bisect_right(self.cum_w, rem) - 1, 0), len(self.thru) - 1)
        tau = prof.offsets_ns[j] + (rem - self.cum_w[j]) / self.thru[j] * NS
        return prof.phase_ns + (k + cycles) * prof.period_ns + round(tau)


class SimGpu:
    """One simulated GPU. Methods take wall-clock ns; settings are this process's own."""

    def __init__(self, node: SimNode, index: int) -> None:
        cfg = node.config
        ov = cfg.gpus[index] if index < len(cfg.gpus) else GpuOverride()
        self.node = node
        self.index = index
        self.name: str = ov.name or cfg.name
        self.arch: str = ov.arch or ("pascal" if ov.pre_volta else cfg.arch)
        self.arch_code: int = ARCH_CODES[self.arch]
        self.unsupported: frozenset[str] = frozenset(ov.unsupported)
        self.has_energy_counter = (
            not ov.pre_volta
            and self.arch_code >= ARCH_CODES["volta"]
            and "energy" not in ov.unsupported
        )
        self.no_permission = ov.no_permission
        self.lost_at_ns: int | None = (
            None if ov.lost_at_s is None else cfg.epoch_ns + round(ov.lost_at_s * NS)
        )
        self.idle_w: float = ov.idle_w if ov.idle_w is not None else cfg.idle_w
        self.max_w: float = ov.max_w if ov.max_w is not None else cfg.max_w
        if self.idle_w >= self.max_w:
            raise ConfigError(f"gpu {index}: idle_w must be below max_w")
        mbf = ov.memory_bound_frac
        self.memory_bound_frac: float = cfg.memory_bound_frac if mbf is None else mbf
        hi, lo = stable_hash(cfg.seed, index, "uuid-hi"), stable_hash(cfg.seed, index, "uuid-lo")
        self.uuid = "GPU-" + str(uuid.UUID(int=hi << 64 | lo))
        self.profile: Profile = build_profile(ov.workload or cfg.workload, cfg.seed, index)
        self.processes: list[SimProcess] = self._make_processes()
        self.memory_used_bytes = cfg.memory_base_bytes + sum(p.memory_bytes for p in self.processes)
        self.persistence_mode = cfg.persistence_mode
        self.memory_locked_clocks: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._cache: dict[_Settings, _Table] = {}
        # Last reported value per kind, keyed by its grid time: reads between driver updates
        # cost a dict lookup (valid because settings only change "now", after those windows).
        self._memo: dict[str, tuple[int, int]] = {}
        default = _Settings(cfg.power_limit_default_w, None, None)
        self._settings: list[_Settings] = [default]
        self._tables: list[_Table] = [self._table(default)]
        self._cum: list[float] = [0.0]  # energy from the counter origin to each epoch start
        self._starts: list[int] = [_NEG_INF]  # settings epochs; appended last (readers bisect)

    def _make_processes(self) -> list[SimProcess]:
        cfg = self.node.config
        rng = random.Random(stable_hash(cfg.seed, self.index, "processes"))
        n = len(cfg.process_pids) or cfg.processes_per_gpu
        weights = [rng.random() + 0.1 for _ in range(n)]
        total = sum(weights) or 1.0
        room = max(cfg.memory_total_bytes - cfg.memory_base_bytes, 0) // max(n, 1)
        gib = 1 << 30
        out: list[SimProcess] = []
        for i, w in enumerate(weights):
            pid = cfg.process_pids[i] if cfg.process_pids else 1000 + rng.randrange(4_000_000)
            memory = min(rng.randint(1, 16) * gib, room)
            out.append(SimProcess(pid=pid, sm_share=w / total, memory_bytes=memory))
        return out

    def _table(self, settings: _Settings) -> _Table:
        table = self._cache.get(settings)
        if table is None:
            table = self._cache[settings] = _Table(self, settings)
        return table

    def _rel(self, t_ns: int) -> int:
        return t_ns - self.node.config.epoch_ns

    def _epoch(self, t_ns: int) -> int:
        return bisect_right(self._starts, t_ns) - 1

    # -- state ------------------------------------------------------------------------------

    def is_lost(self, t_ns: int) -> bool:
        """Whether the GPU has fallen off the bus at ``t_ns``."""
        return self.lost_at_ns is not None and t_ns >= self.lost_at_ns

    @property
    def power_limit_w(self) -> float:
        """Power limit now in force (this process's view)."""
        return self._settings[-1].limit_w

    @property
    def locked_sm_clocks_mhz(self) -> tuple[int, int] | None:
        """``(min, max)`` locked SM clock range, or ``None`` when not locked."""
        s = self._settings[-1]
        return (
            None
            if s.lock_min_mhz is None or s.lock_max_mhz is None
            else (s.lock_min_mhz, s.lock_max_mhz)
        )

    def supported_sm_clocks_mhz(self) -> list[int]:
        """Supported SM clocks, highest first (``max``, ``max - step``, ..., ``min``)."""
        cfg = self.node.config
        clocks = list(range(cfg.max_sm_clock_mhz, cfg.min_sm_clock_mhz - 1, -cfg.sm_clock_step_mhz))
        if clocks[-1] != cfg.min_sm_clock_mhz:
            clocks.append(cfg.min_sm_clock_mhz)
        return clocks

    def _apply(self, t_ns: int, settings: _Settings) -> None:
        with self._lock:
            self._memo.clear()  # a change dated in the past may alter reported values
            last = len(self._starts) - 1
            t_ns = max(t_ns, self._starts[last])
            table = self._table(settings)
            if t_ns == self._starts[last]:
                self._tables[last] = table
                self._settings[last] = settings
                return
            start = self.node.counter_origin_ns if last == 0 else self._starts[last]
            self._cum.append(
                self._cum[last]
                + self._tables[last].integral(
                    self._tables[last].cum_e,
                    self._tables[last].power,
                    self._rel(start),
                    self._rel(t_ns),
                )
            )
            self._tables.append(table)
            self._settings.append(settings)
            self._starts.append(t_ns)

    def set_power_limit_w(self, watts: float, t_ns: int | None = None) -> None:
        """Set the power limit from ``t_ns`` (default: now) on."""
        cfg = self.node.config
        if not cfg.power_limit_min_w <= watts <= cfg.power_limit_max_w:
            raise ConfigError(
                f"power limit {watts} W outside "
                f"[{cfg.power_limit_min_w}, {cfg.power_limit_max_w}] W"
            )
        self._apply(self._now(t_ns), self._settings[-1]._replace(limit_w=float(watts)))

    def lock_sm_clocks_mhz(self, min_mhz: int, max_mhz: int, t_ns: int | None = None) -> None:
        """Lock SM clocks to ``[min_mhz, max_mhz]`` (clamped to the supported range)."""
        cfg = self.node.config
        if min_mhz > max_mhz:
            raise ConfigError(f"locked clock range {min_mhz}..{max_mhz} MHz is empty")
        lo = min(max(min_mhz, cfg.min_sm_clock_mhz), cfg.max_sm_clock_mhz)
        hi = min(max(max_mhz, cfg.min_sm_clock_mhz), cfg.max_sm_clock_mhz)
        self._apply(self._now(t_ns), self._settings[-1]._replace(lock_min_mhz=lo, lock_max_mhz=hi))

    def reset_sm_clocks(self, t_ns: int | None = None) -> None:
        """Undo :meth:`lock_sm_clocks_mhz` from ``t_ns`` (default: now) on."""
        self._apply(
            self._now(t_ns), self._settings[-1]._replace(lock_min_mhz=None, lock_max_mhz=None)
        )

    def _now(self, t_ns: int | None) -> int:
        return self.node.now_ns() if t_ns is None else t_ns

    # -- ground truth -----------------------------------------------------------------------

    def util_at(self, t_ns: int) -> float:
        """Utilization (0..1) of the trace at ``t_ns``."""
        return self.profile.util_at(self._rel(t_ns))

    def _segment(self, t_ns: int) -> tuple[_Table, int]:
        table = self._tables[self._epoch(t_ns)]
        return table, self.profile.locate(self._rel(t_ns))[2]

    def power_w(self, t_ns: int) -> float:
        """True power draw at ``t_ns``."""
        table, i = self._segment(t_ns)
        return table.power[i]

    def sm_clock_mhz(self, t_ns: int) -> float:
        """Effective SM clock at ``t_ns`` (idle clock while utilization is 0)."""
        table, i = self._segment(t_ns)
        return table.clk_mhz[i]

    def throughput(self, t_ns: int) -> float:
        """Speed of compute work at ``t_ns`` relative to full clocks (1.0 = uncapped, unlocked).

        During idle segments this is the speed work *would* run at with the settings in force.
        """
        table, i = self._segment(t_ns)
        return table.thru[i]

    def _walk(self, energy: bool, t0_ns: int, t1_ns: int) -> float:
        """Integral of power (``energy``) or utilization over ``[t0_ns, t1_ns]``, across
        setting changes."""
        if t1_ns < t0_ns:
            return -self._walk(energy, t1_ns, t0_ns)
        starts, total, t = self._starts, 0.0, t0_ns
        j = self._epoch(t0_ns)
        while t < t1_ns:
            end = min(t1_ns, starts[j + 1]) if j + 1 < len(starts) else t1_ns
            table = self._tables[j]
            if energy:
                total += table.integral(table.cum_e, table.power, self._rel(t), self._rel(end))
            else:
                total += table.integral(
                    table.cum_u, self.profile.utils, self._rel(t), self._rel(end)
                )
            t, j = end, j + 1
        return total

    def energy_j(self, t0_ns: int, t1_ns: int) -> float:
        """Exact energy (J) drawn over ``[t0_ns, t1_ns]`` (negative if reversed)."""
        return self._walk(True, t0_ns, t1_ns)

    def mean_util(self, t0_ns: int, t1_ns: int) -> float:
        """Mean utilization over ``[t0_ns, t1_ns)``."""
        return self._walk(False, t0_ns, t1_ns) * NS / (t1_ns - t0_ns)

    def work_duration_s(self, work_units: float, start_ns: int) -> float:
        """Seconds needed for ``work_units`` (seconds of full-speed work) started at ``start_ns``.

        Uses the settings in force over time: recorded changes, then the latest settings.
        """
        if work_units <= 0:
            return 0.0
        starts, remaining, t = self._starts, float(work_units), start_ns
        j = self._epoch(start_ns)
        while True:
            table = self._tables[j]
            done = table.advance_work(self._rel(t), remaining) + self.node.config.epoch_ns
            if j + 1 >= len(starts) or done <= starts[j + 1]:
                return (done - start_ns) / NS
            end = starts[j + 1]
            remaining -= table.integral(table.cum_w, table.thru, self._rel(t), self._rel(end))
            t, j = end, j + 1

    # -- what the driver reports ------------------------------------------------------------

    def grid_floor_ns(self, t_ns: int, period_ns: int) -> int:
        """Last multiple of ``period_ns`` after the counter origin that is ``<= t_ns``."""
        origin = self.node.counter_origin_ns
        return origin + (t_ns - origin) // period_ns * period_ns

    def energy_counter_mj(self, t_ns: int) -> int:
        """Energy counter (mJ since the counter origin), as of its last update ``<= t_ns``."""
        origin = self.node.counter_origin_ns
        if t_ns < origin:
            return 0
        b = self.grid_floor_ns(t_ns, self.node.counter_period_ns)
        memo = self._memo.get("counter")
        if memo is not None and memo[0] == b:
            return memo[1]
        j = self._epoch(b)
        start = origin if j == 0 else self._starts[j]
        table = self._tables[j]
        e = self._cum[j] + table.integral(table.cum_e, table.power, self._rel(start), self._rel(b))
        mj = int(e * 1000.0 + 1e-6)
        self._memo["counter"] = (b, mj)
        return mj

    def instant_power_mw(self, t_ns: int) -> int:
        """Mean power (mW) over the window at the start of the last completed period."""
        node = self.node
        start = self.grid_floor_ns(t_ns, node.instant_period_ns) - node.instant_period_ns
        memo = self._memo.get("instant")
        if memo is not None and memo[0] == start:
            return memo[1]
        e = self.energy_j(start, start + node.instant_window_ns)
        mw = self._noisy(round(e * 1000.0 * NS / node.instant_window_ns), "instant", start)
        self._memo["instant"] = (start, mw)
        return mw

    def average_power_mw(self, t_ns: int) -> int:
        """Mean power (mW) over the averaging window ending at its last refresh."""
        node = self.node
        end = self.grid_floor_ns(t_ns, node.average_period_ns)
        memo = self._memo.get("average")
        if memo is not None and memo[0] == end:
            return memo[1]
        e = self.energy_j(end - node.average_window_ns, end)
        mw = self._noisy(round(e * 1000.0 * NS / node.average_window_ns), "average", end)
        self._memo["average"] = (end, mw)
        return mw

    def _noisy(self, mw: int, kind: str, grid_ns: int) -> int:
        """Add the sensor noise of ``config.power_noise_w`` (deterministic per update)."""
        noise_w = self.node.config.power_noise_w
        if not noise_w:
            return mw
        u = stable_hash(self.node.config.seed, self.index, kind, grid_ns) / 2.0**64
        return max(0, mw + round(noise_w * 1000.0 * (2.0 * u - 1.0)))

    def memory_power_mw(self, t_ns: int) -> int:
        """Memory power (mW), averaged like :meth:`average_power_mw`; part of the total."""
        node, cfg = self.node, self.node.config
        end = self.grid_floor_ns(t_ns, node.average_period_ns)
        u = self.mean_util(end - node.average_window_ns, end)
        return round((cfg.memory_idle_w + cfg.memory_dyn_w * u) * 1000.0)

    def temperature_c(self, t_ns: int) -> float:
        """Die temperature: ambient plus a coefficient times mean power over the thermal lag."""
        cfg = self.node.config
        tau = round(cfg.thermal_tau_s * NS)
        return cfg.ambient_c + cfg.thermal_c_per_w * self.energy_j(t_ns - tau, t_ns) * NS / tau

    def utilization_pct(self, t_ns: int) -> tuple[int, int]:
        """``(gpu %, memory %)`` over the last completed utilization sample period."""
        node = self.node
        end = self.grid_floor_ns(t_ns, node.instant_period_ns)
        u = self.mean_util(end - node.instant_period_ns, end)
        return round(u * 100.0), round(u * self.memory_bound_frac * 100.0)


class SimNode:
    """A simulated node: ``config.num_gpus`` :class:`SimGpu` sharing one clock.

    Args:
        config: The node description (default :class:`SimConfig()`).
        clock: Source of wall time (default: the real clock).
    """

    def __init__(self, config: SimConfig | None = None, clock: Clock | None = None) -> None:
        self.config = config if config is not None else SimConfig()
        self.clock: Clock = clock if clock is not None else RealClock()
        cfg = self.config
        now = self.clock.wall_ns()
        origin = cfg.counter_origin_ns
        #: Wall time at which every energy counter read 0 ("driver load").
        self.counter_origin_ns: int = now - now % DAY_NS if origin is None else origin
        self.counter_period_ns = round(cfg.counter_period_s * NS)
        self.instant_window_ns = round(cfg.instant_window_s * NS)
        self.instant_period_ns = round(cfg.instant_period_s * NS)
        self.average_window_ns = round(cfg.average_window_s * NS)
        self.average_period_ns = round(cfg.average_period_s * NS)
        self._latency_ns = round(cfg.call_latency_s * NS)
        self.gpus: list[SimGpu] = [SimGpu(self, i) for i in range(cfg.num_gpus)]
        logger.debug(
            "simulated node: %d x %s, origin %d", cfg.num_gpus, cfg.name, self.counter_origin_ns
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, clock: Clock | None = None) -> SimNode:
        """A node from :data:`SIM_ENV_VAR` (JSON or a path), or the defaults when unset."""
        value = (os.environ if env is None else env).get(SIM_ENV_VAR)
        return cls(load_sim_config(value) if value else SimConfig(), clock)

    def now_ns(self) -> int:
        """Current wall time of the node's clock."""
        return self.clock.wall_ns()

    def spin(self) -> None:
        """Burn ``call_latency_s`` of CPU *without holding the GIL*, like a driver call.

        Real pynvml calls go through ctypes, which releases the GIL while the driver works, so
        other Python threads (a training loop) keep running meanwhile. Hashing a buffer of at
        least 2 KiB does the same: CPython's hashlib releases the GIL for it and burns CPU.
        """
        if self._latency_ns:
            end = time.perf_counter_ns() + self._latency_ns
            while time.perf_counter_ns() < end:
                hashlib.sha1(_SPIN_CHUNK)

    def truth_energy_j(self, gpu: int, t0_ns: int, t1_ns: int) -> float:
        """Exact energy (J) drawn by GPU ``gpu`` over ``[t0_ns, t1_ns]``."""
        return self.gpus[gpu].energy_j(t0_ns, t1_ns)

    def truth_power_w(self, gpu: int, t_ns: int) -> float:
        """Exact power (W) of GPU ``gpu`` at ``t_ns``."""
        return self.gpus[gpu].power_w(t_ns)

    def work_duration_s(self, gpu: int, work_units: float, start_ns: int | None = None) -> float:
        """Seconds GPU ``gpu`` needs for ``work_units`` of full-speed work from ``start_ns``."""
        return self.gpus[gpu].work_duration_s(
            work_units, self.now_ns() if start_ns is None else start_ns
        )
