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
  over the last ``average_window_s``, refreshed every ``average_period_s``; which of them each
  NVML power query answers depends on ``power_reading`` and the driver version
  (:class:`~zeus_async.devices.sim_config.SimConfig`); temperature follows
  mean power over the last ``thermal_tau_s`` (a box-filter thermal lag). Reported power can
  carry deterministic sensor noise (``power_noise_w``, uniform, per update); truth and the
  energy counter never do.

Time comes from an injectable :class:`~zeus_async.clock.Clock` (``wall_ns()``), so a
``FakeClock`` runs the simulator faster than real time. Integer nanoseconds throughout.

Several processes with the same configuration see the same node: the trace, UUIDs, processes
and the counter origin (``config.counter_origin_ns``, default midnight UTC of the day the node
was created) are deterministic. **Settable state (power limit, locked SM clocks, persistence
mode) belongs to the node, as with the driver**: it is kept in a small file shared by every
process simulating the same configuration (:mod:`zeus_async.devices.sim_state`), so a limit set
in one process is seen by every other one and outlives the process that set it. A node starts
from that state; a change made by another process is seen when a setting is read, and by power,
energy and clock readings within about 50 ms (they look at the file's ``st_mtime_ns`` at most
every 50 ms; memoized readings when the driver next updates them). It takes effect at the time
the other process made it, but never before the last reading this process reported (reported
counters never go back) nor after now. Locked *memory* clocks stay per process.
``SimNode(..., shared_state=False)`` keeps all settable state in the process.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import threading
import time
import uuid
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Final, NamedTuple

from ..clock import Clock, RealClock
from ..errors import ConfigError
from .sim_config import (
    ARCH_CODES,
    COMPUTE_CAPABILITY,
    POWER_FIELDS_DRIVER,
    SIM_ENV_VAR,
    ArchName,
    Feature,
    GpuOverride,
    GraceSim,
    PowerReading,
    SimConfig,
    load_sim_config,
)
from .sim_state import FileKey, GpuState, NodeState, NodeStateFile, clamp_state
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
#: The last 48 bits of every simulated GPU's UUID: ``GPU-...-515151515151`` (the first ones
#: stay distinct, so that a UUID prefix in ``CUDA_VISIBLE_DEVICES`` still names one GPU).
SIM_UUID_MARK: Final = 0x5151_5151_5151
_LAST_48: Final = (1 << 48) - 1
DAY_NS: Final = 86_400 * NS
_NEG_INF: Final = -(1 << 62)
_POS_INF: Final = 1 << 62
#: Least monotonic time between two looks at the node state file on the read path.
STATE_POLL_NS: Final = 50_000_000
_monotonic_ns = time.monotonic_ns


class SimProcess(NamedTuple):
    """A fake process running on a simulated GPU."""

    pid: int
    sm_share: float
    memory_bytes: int


class _Settings(NamedTuple):
    limit_w: float
    lock_min_mhz: int | None
    lock_max_mhz: int | None
    #: Utilization replacing the workload trace (:meth:`SimGpu.set_load`); ``None``: the trace.
    load: float | None = None


def _div_ns(value: float, ns: int) -> float:
    return value * ns / NS


class _Table:
    """Rates of one GPU's trace segments under fixed settings, with running sums over a period.

    ``cum_x[i]`` is the integral of rate ``x`` from the period start to segment ``i``'s start
    (``cum_x[n]``: one whole period); units: J for power, work-seconds for throughput,
    util-seconds for utilization.
    """

    __slots__ = ("clk_mhz", "cum_e", "cum_u", "cum_w", "power", "profile", "thru", "utils")

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
        utils = prof.utils if settings.load is None else [settings.load] * len(prof.utils)
        self.utils: list[float] = utils
        for u in utils:
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
        self.cum_u = self._running(utils)

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
    """One simulated GPU. Methods take wall-clock ns; settings are the node's (see the module
    docstring)."""

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
        #: What its power readings report (SimConfig.power_reading, or this GPU's override).
        self.power_reading: PowerReading = ov.power_reading or cfg.power_reading
        #: Whether the driver knows the power field ids (NVML_FI_DEV_POWER_*, 185-190).
        self.power_fields = _driver_branch(cfg.driver_version) >= POWER_FIELDS_DRIVER
        self.lost_at_ns: int | None = (
            None if ov.lost_at_s is None else cfg.epoch_ns + round(ov.lost_at_s * NS)
        )
        self.idle_w: float = ov.idle_w if ov.idle_w is not None else cfg.idle_w
        self.max_w: float = ov.max_w if ov.max_w is not None else cfg.max_w
        if self.idle_w >= self.max_w:
            raise ConfigError(f"gpu {index}: idle_w must be below max_w")
        mbf = ov.memory_bound_frac
        self.memory_bound_frac: float = cfg.memory_bound_frac if mbf is None else mbf
        #: The Grace CPU and memory of this GPU's module (``None``: not a superchip).
        self.grace: GraceSim | None = cfg.grace
        self._grace_factor = 1.0
        if cfg.grace is not None and cfg.grace.load_spread:
            u = stable_hash(cfg.seed, index, "grace-load") / 2.0**64
            self._grace_factor = 1.0 - cfg.grace.load_spread * u
        hi, lo = stable_hash(cfg.seed, index, "uuid-hi"), stable_hash(cfg.seed, index, "uuid-lo")
        # Marked as simulated in its own identity (GPU-...-515151515151), so that a UUID that
        # reaches a dashboard or a log says what it is.
        self.uuid = "GPU-" + str(uuid.UUID(int=((hi << 64 | lo) & ~_LAST_48) | SIM_UUID_MARK))
        self.profile: Profile = build_profile(ov.workload or cfg.workload, cfg.seed, index)
        self.processes: list[SimProcess] = self._make_processes()
        self.memory_used_bytes = cfg.memory_base_bytes + sum(p.memory_bytes for p in self.processes)
        self._persistence: bool = cfg.persistence_mode
        self.memory_locked_clocks: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._cache: dict[_Settings, _Table] = {}
        # Last reported value per kind, keyed by its grid time: reads between driver updates
        # cost a dict lookup (valid because settings only change "now", after those windows;
        # other processes' changes are dated after the last reading too).
        self._memo: dict[str, tuple[int, int]] = {}
        default = _Settings(cfg.power_limit_default_w, None, None)
        self._settings: list[_Settings] = [default]
        self._tables: list[_Table] = [self._table(default)]
        self._cum: list[float] = [0.0]  # energy from the counter origin to each epoch start
        self._starts: list[int] = [_NEG_INF]  # settings epochs; appended last (readers bisect)
        self._reported_ns = _NEG_INF  # latest time a driver reading was made for

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
        """Power limit now in force (the node's, including other processes' changes)."""
        self.node.poll_state(force=True)
        return self._settings[-1].limit_w

    @property
    def persistence_mode(self) -> bool:
        """Persistence mode (the node's; set with :meth:`set_persistence_mode`)."""
        self.node.poll_state(force=True)
        return self._persistence

    @property
    def locked_sm_clocks_mhz(self) -> tuple[int, int] | None:
        """``(min, max)`` locked SM clock range, or ``None`` when not locked."""
        self.node.poll_state(force=True)
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
        self._change(t_ns, lambda s: s._replace(limit_w=float(watts)))

    def lock_sm_clocks_mhz(self, min_mhz: int, max_mhz: int, t_ns: int | None = None) -> None:
        """Lock SM clocks to ``[min_mhz, max_mhz]`` (clamped to the supported range)."""
        cfg = self.node.config
        if min_mhz > max_mhz:
            raise ConfigError(f"locked clock range {min_mhz}..{max_mhz} MHz is empty")
        lo = min(max(min_mhz, cfg.min_sm_clock_mhz), cfg.max_sm_clock_mhz)
        hi = min(max(max_mhz, cfg.min_sm_clock_mhz), cfg.max_sm_clock_mhz)
        self._change(t_ns, lambda s: s._replace(lock_min_mhz=lo, lock_max_mhz=hi))

    def set_load(self, util: float | None, t_ns: int | None = None) -> None:
        """From ``t_ns`` (default: now) on, run at utilization ``util`` (0..1) instead of the
        workload trace; ``None`` returns to the trace. A program that drives its simulated GPU
        (kernels running, then waiting on other ranks) sets it at each change, so power drops
        to idle between its kernels as a real GPU's does. This process only: other processes
        keep the trace."""
        if util is not None and not 0.0 <= util <= 1.0:
            raise ConfigError(f"load must be within 0..1, not {util!r}")
        t = self._now(t_ns)
        self._apply(t, self._settings[-1]._replace(load=util))

    def reset_sm_clocks(self, t_ns: int | None = None) -> None:
        """Undo :meth:`lock_sm_clocks_mhz` from ``t_ns`` (default: now) on."""
        self._change(t_ns, lambda s: s._replace(lock_min_mhz=None, lock_max_mhz=None))

    def set_persistence_mode(self, enabled: bool, t_ns: int | None = None) -> None:
        """Turn persistence mode on or off (``t_ns``, default now, dates the change)."""
        self._change(t_ns, None, bool(enabled))

    def _now(self, t_ns: int | None) -> int:
        return self.node.now_ns() if t_ns is None else t_ns

    def _change(
        self,
        t_ns: int | None,
        edit: Callable[[_Settings], _Settings] | None,
        persistence: bool | None = None,
    ) -> None:
        """Apply a change here and in the node state (``edit`` works on the latest settings,
        other processes' changes included)."""
        t = self._now(t_ns)
        with self.node._publishing() as publish:
            if edit is not None:
                self._apply(t, edit(self._settings[-1]))
                t = max(t, self._starts[-1])
            if persistence is not None:
                self._persistence = persistence
            publish(self.index, self._state(t))

    def _state(self, t_ns: int) -> GpuState:
        s = self._settings[-1]
        return GpuState(
            power_limit_w=s.limit_w,
            locked_sm_clock_min_mhz=s.lock_min_mhz,
            locked_sm_clock_max_mhz=s.lock_max_mhz,
            persistence_mode=self._persistence,
            changed_ns=t_ns,
        )

    def _absorb(self, state: GpuState | None, now_ns: int) -> None:
        """Take the node state's settings (``None``: the defaults) if they differ from ours,
        dated at their change time, but not before the last reading reported (so no reported
        value changes) nor after now."""
        limit, lock, persistence, changed = clamp_state(self.node.config, state)
        # The load is this process's (a program driving its GPU), not the node state's.
        lo, hi = lock or (None, None)
        settings = _Settings(limit, lo, hi, self._settings[-1].load)
        if settings != self._settings[-1]:
            t = now_ns if changed is None else changed
            self._apply(min(max(t, self._reported_ns), now_ns), settings)
            logger.debug("gpu %d: settings %s from the node state", self.index, settings)
        self._persistence = persistence

    def _observe(self, t_ns: int) -> None:
        """Before a driver reading that depends on the settings up to ``t_ns``: look for other
        processes' changes (at most every :data:`STATE_POLL_NS`), then note ``t_ns`` as
        reported (changes found later are dated after it).

        Memoized readings call it only when they compute a new value (once per driver update):
        until then they repeat a value that no change found later may alter anyway.
        """
        node = self.node
        if _monotonic_ns() >= node._next_poll_ns:  # inlined _maybe_poll: the hot path
            node.poll_state()
        if t_ns > self._reported_ns:
            self._reported_ns = t_ns

    # -- ground truth -----------------------------------------------------------------------

    def util_at(self, t_ns: int) -> float:
        """Utilization (0..1) at ``t_ns``: the trace's, or the load set (:meth:`set_load`)."""
        table, i = self._segment(t_ns)
        return table.utils[i]

    def _segment(self, t_ns: int) -> tuple[_Table, int]:
        table = self._tables[self._epoch(t_ns)]
        return table, self.profile.locate(self._rel(t_ns))[2]

    def power_w(self, t_ns: int) -> float:
        """True power draw at ``t_ns``."""
        self.node._maybe_poll()
        table, i = self._segment(t_ns)
        return table.power[i]

    def sm_clock_mhz(self, t_ns: int) -> float:
        """Effective SM clock at ``t_ns`` (idle clock while utilization is 0)."""
        if _monotonic_ns() >= self.node._next_poll_ns:  # _observe, inlined: not memoized
            self.node.poll_state()
        if t_ns > self._reported_ns:
            self._reported_ns = t_ns
        table, i = self._segment(t_ns)
        return table.clk_mhz[i]

    def throughput(self, t_ns: int) -> float:
        """Speed of compute work at ``t_ns`` relative to full clocks (1.0 = uncapped, unlocked).

        During idle segments this is the speed work *would* run at with the settings in force.
        """
        self.node._maybe_poll()
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
                total += table.integral(table.cum_u, table.utils, self._rel(t), self._rel(end))
            t, j = end, j + 1
        return total

    def energy_j(self, t0_ns: int, t1_ns: int) -> float:
        """Exact energy (J) drawn over ``[t0_ns, t1_ns]`` (negative if reversed)."""
        self.node._maybe_poll()
        return self._walk(True, t0_ns, t1_ns)

    def module_energy_j(self, t0_ns: int, t1_ns: int) -> float:
        """Exact energy (J) the whole module (GPU + Grace CPU + memory) drew over
        ``[t0_ns, t1_ns]``; raises ``ConfigError`` on a GPU that is not a superchip."""
        self.node._maybe_poll()
        return self._walk(True, t0_ns, t1_ns) + self._grace_j(t0_ns, t1_ns)

    def module_power_w(self, t_ns: int) -> float:
        """True power of the whole module at ``t_ns``."""
        g = self._grace()
        table, i = self._segment(t_ns)
        load = min(1.0, table.utils[i] * self._grace_factor) if g.cpu_load == "gpu" else g.cpu_load
        idle = g.cpu_idle_w + g.memory_idle_w
        dyn = g.cpu_max_w - g.cpu_idle_w + g.memory_max_w - g.memory_idle_w
        return table.power[i] + idle + dyn * load

    def _grace(self) -> GraceSim:
        if self.grace is None:
            raise ConfigError(f"gpu {self.index} is not a Grace superchip (SimConfig.grace)")
        return self.grace

    def _grace_j(self, t0_ns: int, t1_ns: int) -> float:
        """Energy (J) of the Grace CPU and memory over ``[t0_ns, t1_ns]`` (signed)."""
        g = self._grace()
        seconds = (t1_ns - t0_ns) / NS
        if g.cpu_load == "gpu":  # utils are within 0..1 and the factor <= 1: no clamping
            load_s = self._walk(False, t0_ns, t1_ns) * self._grace_factor
        else:
            load_s = g.cpu_load * seconds
        idle = g.cpu_idle_w + g.memory_idle_w
        dyn = g.cpu_max_w - g.cpu_idle_w + g.memory_max_w - g.memory_idle_w
        return idle * seconds + dyn * load_s

    def mean_util(self, t0_ns: int, t1_ns: int) -> float:
        """Mean utilization over ``[t0_ns, t1_ns)``."""
        self.node._maybe_poll()
        return self._mean_util(t0_ns, t1_ns)

    def _mean_util(self, t0_ns: int, t1_ns: int) -> float:
        return self._walk(False, t0_ns, t1_ns) * NS / (t1_ns - t0_ns)

    def work_duration_s(self, work_units: float, start_ns: int) -> float:
        """Seconds needed for ``work_units`` (seconds of full-speed work) started at ``start_ns``.

        Uses the settings in force over time: recorded changes, then the latest settings.
        """
        if work_units <= 0:
            return 0.0
        self.node._maybe_poll()
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
        self._observe(b)
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
        self._observe(start + node.instant_window_ns)
        e = self._walk(True, start, start + node.instant_window_ns)
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
        self._observe(end)
        e = self._walk(True, end - node.average_window_ns, end)
        mw = self._noisy(round(e * 1000.0 * NS / node.average_window_ns), "average", end)
        self._memo["average"] = (end, mw)
        return mw

    def instant_module_mw(self, t_ns: int) -> int:
        """MODULE scope (GPU + CPU + memory) of :meth:`instant_field_mw`: the mean module power
        over the same window (the 1 s average with ``power_reading="average_only"``)."""
        node = self.node
        if self.power_reading == "average_only":
            return self.average_module_mw(t_ns)
        start = self.grid_floor_ns(t_ns, node.instant_period_ns) - node.instant_period_ns
        memo = self._memo.get("instant_module")
        if memo is not None and memo[0] == start:
            return memo[1]
        self._observe(start + node.instant_window_ns)
        end = start + node.instant_window_ns
        e = self._walk(True, start, end) + self._grace_j(start, end)
        mw = self._noisy(round(e * 1000.0 * NS / node.instant_window_ns), "instant_module", start)
        self._memo["instant_module"] = (start, mw)
        return mw

    def average_module_mw(self, t_ns: int) -> int:
        """MODULE scope of :meth:`average_power_mw`: mean module power over the averaging
        window ending at its last refresh."""
        node = self.node
        end = self.grid_floor_ns(t_ns, node.average_period_ns)
        memo = self._memo.get("average_module")
        if memo is not None and memo[0] == end:
            return memo[1]
        self._observe(end)
        start = end - node.average_window_ns
        e = self._walk(True, start, end) + self._grace_j(start, end)
        mw = self._noisy(round(e * 1000.0 * NS / node.average_window_ns), "average_module", end)
        self._memo["average_module"] = (end, mw)
        return mw

    def power_usage_mw(self, t_ns: int) -> int:
        """What ``nvmlDeviceGetPowerUsage`` reports (mW): the 1 s average, or on a GA100-like
        GPU (``power_reading="instant"``) the instant sensor."""
        if self.power_reading == "instant":
            return self.instant_power_mw(t_ns)
        return self.average_power_mw(t_ns)

    def instant_field_mw(self, t_ns: int) -> int:
        """What ``NVML_FI_DEV_POWER_INSTANT`` reports (mW): the instant sensor, or the 1 s
        average where there is none (``power_reading="average_only"``)."""
        if self.power_reading == "average_only":
            return self.average_power_mw(t_ns)
        return self.instant_power_mw(t_ns)

    def _noisy(self, mw: int, kind: str, grid_ns: int) -> int:
        """Add the sensor noise of ``config.power_noise_w`` (deterministic per update)."""
        noise_w = self.node.config.power_noise_w
        if not noise_w:
            return mw
        u = stable_hash(self.node.config.seed, self.index, kind, grid_ns) / 2.0**64
        return max(0, mw + round(noise_w * 1000.0 * (2.0 * u - 1.0)))

    def memory_power_mw(self, t_ns: int) -> int:
        """Memory power (mW), averaged like :meth:`average_power_mw`; part of the total."""
        self._observe(t_ns)
        node, cfg = self.node, self.node.config
        end = self.grid_floor_ns(t_ns, node.average_period_ns)
        u = self._mean_util(end - node.average_window_ns, end)
        return round((cfg.memory_idle_w + cfg.memory_dyn_w * u) * 1000.0)

    def temperature_c(self, t_ns: int) -> float:
        """Die temperature: ambient plus a coefficient times mean power over the thermal lag."""
        self._observe(t_ns)
        cfg = self.node.config
        tau = round(cfg.thermal_tau_s * NS)
        return cfg.ambient_c + cfg.thermal_c_per_w * self._walk(True, t_ns - tau, t_ns) * NS / tau

    def utilization_pct(self, t_ns: int) -> tuple[int, int]:
        """``(gpu %, memory %)`` over the last completed utilization sample period."""
        self._observe(t_ns)
        node = self.node
        end = self.grid_floor_ns(t_ns, node.instant_period_ns)
        u = self._mean_util(end - node.instant_period_ns, end)
        return round(u * 100.0), round(u * self.memory_bound_frac * 100.0)


def _driver_branch(version: str) -> int:
    """The branch of a driver version (``"550.90.07"`` -> 550); 0 when it is not a number."""
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


class SimNode:
    """A simulated node: ``config.num_gpus`` :class:`SimGpu` sharing one clock.

    Args:
        config: The node description (default :class:`SimConfig()`).
        clock: Source of wall time (default: the real clock).
        shared_state: Keep settable state (power limit, locked SM clocks, persistence mode) in
            the node state file shared with every process simulating the same configuration
            (:mod:`~zeus_async.devices.sim_state`), as the driver would; ``False`` keeps it in
            this node object only (pure in-process simulations).

    Raises:
        ConfigError: With ``shared_state``, the private directory is not safe to use.
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        clock: Clock | None = None,
        *,
        shared_state: bool = True,
    ) -> None:
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
        #: Extra CPU a read of the energy counter / of the power limit burns (ns).
        self.energy_latency_ns = round(cfg.energy_call_latency_s * NS)
        self.limit_read_latency_ns = round(cfg.power_limit_call_latency_s * NS)
        #: How long after a clock lock returns the SM clock reaches the locked value (ns).
        self.clock_settle_ns = round(cfg.clock_settle_s * NS)
        self._state_file: NodeStateFile | None = (
            NodeStateFile(cfg) if shared_state and cfg.num_gpus else None
        )
        self._state_key: FileKey = None  # version of the state file last taken in
        self._read_failed = False  # the last look failed (warned once, until one succeeds)
        self._state_lock = threading.RLock()
        # monotonic ns of the next look at the file on the read path (never without one)
        self._next_poll_ns = 0 if self._state_file is not None else _POS_INF
        self.gpus: list[SimGpu] = [SimGpu(self, i) for i in range(cfg.num_gpus)]
        self.poll_state(force=True)
        logger.debug(
            "simulated node: %d x %s, origin %d", cfg.num_gpus, cfg.name, self.counter_origin_ns
        )

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        *,
        shared_state: bool = True,
    ) -> SimNode:
        """A node from :data:`SIM_ENV_VAR` (JSON or a path), or the defaults when unset."""
        value = (os.environ if env is None else env).get(SIM_ENV_VAR)
        config = load_sim_config(value) if value else SimConfig()
        return cls(config, clock, shared_state=shared_state)

    @property
    def state_path(self) -> Path | None:
        """The node state file (``None`` without ``shared_state``); it may not exist yet."""
        return None if self._state_file is None else self._state_file.path

    def poll_state(self, force: bool = False) -> None:
        """Take in changes other processes made to the node state since the last look.

        One ``os.stat`` when the file is unchanged. Without ``force``, returns at once while
        another thread is looking. A file that cannot be read is logged (once) and skipped: the
        next look retries.
        """
        sf = self._state_file
        if sf is None:
            return
        lock = self._state_lock
        if not lock.acquire(blocking=force):
            return
        try:
            self._next_poll_ns = time.monotonic_ns() + STATE_POLL_NS
            try:
                if sf.stat_key() == self._state_key:
                    return
                state, key = sf.read()
            except OSError as exc:
                if not self._read_failed:
                    logger.warning("cannot read simulated node state %s: %s", sf.path, exc)
                self._read_failed = True
                return
            self._read_failed = False
            self._absorb(state, key)
        finally:
            lock.release()

    def _maybe_poll(self) -> None:
        """:meth:`poll_state` at most every :data:`STATE_POLL_NS` (the read path)."""
        if _monotonic_ns() >= self._next_poll_ns:
            self.poll_state()

    def _absorb(self, state: NodeState | None, key: FileKey) -> None:
        """Make every GPU's settings those of ``state`` (``None``: the defaults); call under
        ``_state_lock``."""
        now = self.now_ns()
        gpus = {} if state is None else state.gpus
        for gpu in self.gpus:
            gpu._absorb(gpus.get(gpu.index), now)
        self._state_key = key

    @contextlib.contextmanager
    def _publishing(self) -> Iterator[Callable[[int, GpuState], None]]:
        """Read-modify-write of the node state under its lock: takes in the latest state, then
        yields ``publish(index, state)``; what was published is written on exit."""
        sf = self._state_file
        if sf is None:
            yield lambda index, state: None
            return
        with self._state_lock, sf.locked():
            try:
                current, key = sf.read()
            except OSError as exc:
                raise ConfigError(f"cannot read simulated node state {sf.path}: {exc}") from exc
            self._absorb(current, key)
            gpus: dict[int, GpuState] = {} if current is None else dict(current.gpus)
            yield gpus.__setitem__
            self._state_key = sf.write(NodeState(node=sf.key, gpus=gpus))

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
            self.burn(self._latency_ns)

    @staticmethod
    def burn(ns: int) -> None:
        """Burn ``ns`` of CPU without holding the GIL (see :meth:`spin`)."""
        if ns > 0:
            end = time.perf_counter_ns() + ns
            while time.perf_counter_ns() < end:
                hashlib.sha1(_SPIN_CHUNK)

    def truth_energy_j(self, gpu: int, t0_ns: int, t1_ns: int) -> float:
        """Exact energy (J) drawn by GPU ``gpu`` over ``[t0_ns, t1_ns]``."""
        return self.gpus[gpu].energy_j(t0_ns, t1_ns)

    def truth_module_energy_j(self, gpu: int, t0_ns: int, t1_ns: int) -> float:
        """Exact energy (J) drawn by GPU ``gpu``'s whole module (GPU + Grace CPU + memory) over
        ``[t0_ns, t1_ns]`` (what the MODULE power scope measures; ``SimConfig.grace`` set)."""
        return self.gpus[gpu].module_energy_j(t0_ns, t1_ns)

    def truth_power_w(self, gpu: int, t_ns: int) -> float:
        """Exact power (W) of GPU ``gpu`` at ``t_ns``."""
        return self.gpus[gpu].power_w(t_ns)

    def work_duration_s(self, gpu: int, work_units: float, start_ns: int | None = None) -> float:
        """Seconds GPU ``gpu`` needs for ``work_units`` of full-speed work from ``start_ns``."""
        return self.gpus[gpu].work_duration_s(
            work_units, self.now_ns() if start_ns is None else start_ns
        )
