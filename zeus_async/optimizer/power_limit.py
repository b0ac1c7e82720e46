"""Power-limit optimization: just-in-time profiling of GPU power limits during training.

The same semantics as Zeus's ``GlobalPowerLimitOptimizer`` (seed 001): starting at the highest
power limit and stepping down by ``pl_step`` W, each limit is warmed up for ``warmup_steps``
training steps and profiled for ``profile_steps``; an :class:`OptimumSelector` then picks the
limit from the measured energy and time, and training continues at it. The state machine::

    Ready --(wait_steps)--> Warmup --(warmup_steps)--> Profiling --(profile_steps)--> Warmup ...
                                                                  \\-> Done (last limit)
    Warmup/Profiling --on_epoch_end--> Ready (the same limit again, after one step)

What differs is the cost on the training thread and what you can see:

* ``on_step_begin()`` is a few attribute updates; window edges are deque appends and power-limit
  changes are handed to the runtime (the sampler process or thread) and never waited for.
  Measurements resolve in the background; the choice is made off the training thread as soon
  as the last one is in.
* Every state change and the chosen limit are :class:`~zeus_async.events.OptimizerState`
  events, and every limit change a ``PowerLimitChange``, on the monitor's bus and recording.
* ``adaptive=True`` ends each warmup once two consecutive steps agree (the GPU has settled at
  the new limit), profiles each limit only until its per-step time and energy are known within
  the tolerance (95 % confidence), and stops descending once the selector's choice can no
  longer change (see :class:`AdaptiveOptions`): the same optimum in far fewer steps.

Limits are restored to the maximum on :meth:`GlobalPowerLimitOptimizer.close`, at interpreter
exit, on an exception leaving a ``with`` block, and on SIGINT/SIGTERM.

This module holds the states and the optimizer that drives them, and reads and writes the
profile; the measurements and selectors are in :mod:`.power_limit_selectors`, adaptive
profiling's settings and statistics in :mod:`.power_limit_adaptive`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .._exit import ClosedOnExit, SignalRestorer, call_at_exit
from ..errors import ConfigError, NoPermissionError
from ..events import OptimizerState
from ..ranks import Collectives, collectives, rank_path
from .power_limit_adaptive import OUTLIER_FACTOR as OUTLIER_FACTOR
from .power_limit_adaptive import AdaptiveOptions, _StepStats
from .power_limit_selectors import (
    Energy,
    MaxSlowdownConstraint,
    OptimumSelector,
    PowerLimitMeasurement,
    PowerLimitProfile,
    Time,
    ZeusCost,
    zeus_cost,
)
from .power_limit_selectors import PositiveFloat as PositiveFloat
from .power_limit_selectors import PositiveInt as PositiveInt

if TYPE_CHECKING:
    from ..aggregate.windows import WindowResult
    from ..monitor import Monitor

__all__ = [
    "AdaptiveOptions",
    "Done",
    "Energy",
    "GlobalPowerLimitOptimizer",
    "MaxSlowdownConstraint",
    "OptimumSelector",
    "PowerLimitMeasurement",
    "PowerLimitProfile",
    "Profiling",
    "Ready",
    "Time",
    "Warmup",
    "ZeusCost",
    "zeus_cost",
]

logger = logging.getLogger(__name__)

#: ``source`` of the power-limit changes and ``optimizer`` of the events this module publishes.
SOURCE = "power_limit"


# -- states ---------------------------------------------------------------------------------------


class Ready(msgspec.Struct):
    """Waiting ``steps`` more steps before warming up ``next_power_limit`` (initial state)."""

    next_power_limit: int
    steps: int


class Warmup(msgspec.Struct):
    """Warming up at ``current_power_limit`` for ``steps`` more steps."""

    current_power_limit: int
    steps: int


class Profiling(msgspec.Struct):
    """Measuring ``current_power_limit``: ``steps`` more steps (0: waiting for the choice)."""

    current_power_limit: int
    steps: int


class Done(msgspec.Struct):
    """The choice is made and in force (also the initial state with a saved profile)."""

    optimal_power_limit: int


State = Ready | Warmup | Profiling | Done


# -- the optimizer --------------------------------------------------------------------------------


class GlobalPowerLimitOptimizer(ClosedOnExit):
    """Finds the optimal GPU power limit by profiling during training (see the module doc).

    Args:
        monitor: The :class:`~zeus_async.Monitor` measuring the GPUs to optimize (all of its
            GPUs get the same limit). With several ranks, each rank's monitor watches its GPU;
            one made before the launcher said the rank (Lightning's ``ddp``) gets it at the
            first step (:meth:`start`).
        optimum_selector: Default ``ZeusCost(eta_knob=0.5, world_size=len(monitor GPUs))``;
            with several ranks, ``world_size`` becomes every rank's GPUs (Zeus keeps this
            rank's count while it sums every rank's energy, which underweights time).
        wait_steps: Steps to let pass before the first warmup.
        warmup_steps: Steps at each limit before profiling it.
        profile_steps: Steps profiled at each limit.
        pl_step: Stride between profiled limits (W).
        profile_path: An existing file: load the measurements from it and skip profiling; a
            new file: profile and save the measurements to it. May hold ``{node}``,
            ``{host}``, ... (:func:`zeus_async.ranks.rank_path`). With several ranks the
            measurements are the job's (combined), so every rank loads the same file and rank
            0 alone writes it.
        adaptive: Profile adaptively (:class:`AdaptiveOptions`; ``True`` for the defaults).
        restore_on_signals: Restore the maximum limit on SIGINT and SIGTERM (main thread only),
            then let the signal do what it did before.

    Where it differs from Zeus 0.16, on purpose: persistence mode is left as it is (Zeus turns
    it on and never back: node-wide driver state that outlives the job; the node agent keeps
    NVML open while it holds a limit, which is what keeps the limit in force); the steps while
    the choice is made run at the maximum limit, not the lowest one profiled; a monitor takes
    one optimizer at a time; epochs too short to profile a limit are said in a warning.

    Raises:
        ValueError: Invalid step counts, GPUs with different power-limit ranges.
        NoPermissionError: The process may not change power limits (says which privilege);
            also a ``RuntimeError``, as Zeus raises. At construction; with a monitor made
            before the launcher said the rank (its ``gpus_resolved`` false), no GPU is
            touched until :meth:`start`, at the first step or in a framework callback's
            setup, which raises it then.
        ConfigError: ``profile_path`` holds a corrupt profile, or is new and its directory is
            missing or not writable; adaptive profiling across ranks; a monitor that already
            has an optimizer; GPUs without a power cap (``Capabilities.power_cap`` false:
            Jetson, Apple Silicon).
    """

    def __init__(
        self,
        monitor: Monitor,
        optimum_selector: OptimumSelector | None = None,
        wait_steps: int = 1,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step: int = 25,
        profile_path: str | os.PathLike[str] | None = None,
        *,
        adaptive: bool | AdaptiveOptions = False,
        restore_on_signals: bool = True,
    ) -> None:
        if wait_steps < 0:
            raise ValueError(f"wait_steps must be non-negative, got {wait_steps!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be non-negative, got {warmup_steps!r}")
        if profile_steps <= 0:
            raise ValueError(f"profile_steps must be positive, got {profile_steps!r}")
        if pl_step <= 0:
            raise ValueError(f"pl_step must be positive, got {pl_step!r}")
        current = getattr(monitor, "_power_limit_optimizer", None)
        if current is not None and not current._closed:
            raise ConfigError(
                "this monitor already has a power-limit optimizer: two would set the GPUs' "
                "limits over each other (close() the first one)"
            )
        self.monitor = monitor
        # The default weighs time by the job's maximum power: every rank's GPUs once ranks
        # combine (Zeus counts this rank's only, while summing every rank's energy).
        self._default_selector = optimum_selector is None
        self.optimum_selector: OptimumSelector = optimum_selector or ZeusCost(
            eta_knob=0.5, world_size=len(monitor.gpu_indices)
        )
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.pl_step = pl_step
        # One profile for the job (every rank holds the combined measurements; rank 0 writes
        # it): placeholders such as {node} are filled in, the rank is not added.
        self.profile_path = (
            None if profile_path is None else rank_path(profile_path, per_rank=False)
        )
        if self.profile_path is not None and not self.profile_path.exists():
            folder = self.profile_path.absolute().parent
            if not folder.is_dir() or not os.access(folder, os.W_OK):
                # Said now, not by the background thread once profiling is done and lost.
                raise ConfigError(
                    f"cannot write the profile {str(self.profile_path)!r}: no writable "
                    f"directory {str(folder)!r}"
                )
        self.adaptive: AdaptiveOptions | None = (
            AdaptiveOptions() if adaptive is True else adaptive or None
        )
        self._dist: Collectives | None = collectives()
        self._joined = False
        self._looked = False
        if self.adaptive is not None and self._dist is not None:
            raise ConfigError(
                "adaptive profiling is single-process for now: its early decisions are not "
                "synchronized across ranks (use adaptive=False with torch.distributed)"
            )
        self.power_limits = self._limits()
        self.max_power_limit = self.power_limits[0]
        self.measurements: list[PowerLimitMeasurement] = []
        #: Training steps spent in warmup and profiling (the cost of finding the optimum).
        self.profiling_step_count = 0
        #: Of those, the steps inside profile windows (Zeus: ``profile_steps`` per limit).
        self.measured_step_count = 0
        self.current_power_limit: int | None = None
        # limit, its profile window, steps in it, its per-step statistics (adaptive)
        self._pending: list[tuple[int, WindowResult, int, _StepStats | None]] = []
        self._stats: _StepStats | None = None
        self._step_window: str | None = None
        self._profiled_steps = 0
        self._deciding = False
        #: Epoch ends that interrupted each limit's warmup or profile.
        self._interrupted: dict[int, int] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._signals = SignalRestorer(self.close, "restoring the maximum power limit")
        self._on_signal = self._signals.on_signal
        self._host = socket.gethostname()
        # Until started, no GPU is touched: a monitor made before the launcher said the rank
        # (Lightning's ddp, ddp_spawn) still measures every GPU of the node.
        self._started = False
        self._said_waiting = False
        self.state: State
        if self.profile_path is not None and self.profile_path.exists():
            self.measurements = _load_profile(self.profile_path)
            optimal = self._select()
            self.state = Done(optimal)
            logger.info("loaded the power-limit profile %s: %d W", self.profile_path, optimal)
            self._emit("done", optimal, detail=f"profile loaded from {self.profile_path}")
        else:
            self.state = Ready(self.power_limits[0], wait_steps + 1)
            self._emit("ready", self.power_limits[0], steps=wait_steps + 1)
        if getattr(monitor, "gpus_resolved", True):
            # Checks the privilege now, synchronously: a clear error at construction. (Not
            # fixing the GPUs: a framework may still correct a rank's GPU taken from its
            # LOCAL_RANK, Lightning's devices=[2, 3].)
            self._start(final=False)
        with contextlib.suppress(AttributeError):  # a monitor stand-in with __slots__
            monitor._power_limit_optimizer = self  # type: ignore[attr-defined]
        call_at_exit(self.close)
        # Closing the monitor first closes this (its restores go through the monitor).
        on_close = getattr(self.monitor, "on_close", None)
        if on_close is not None:
            on_close(self.close)
        if restore_on_signals:
            self._signals.install()

    # -- setup ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Fix the GPUs and put them at the maximum limit (or the loaded profile's choice).

        At construction when the monitor knows its GPUs; else (a monitor made before the
        launcher said the rank, :attr:`Monitor.gpus_resolved <zeus_async.Monitor.gpus_resolved>`
        false) at the first step or when a framework callback is set up, once the monitor has
        resolved them (:meth:`Monitor.resolve_gpus <zeus_async.Monitor.resolve_gpus>`): no GPU
        is touched before. The GPUs are final from then on. While the monitor's resolution
        waits for windows opened on every GPU to end, it does nothing (the steps until then
        do not count). Idempotent.

        Raises:
            NoPermissionError: The process may not change power limits.
            ValueError: As at construction, for the GPUs now monitored.
        """
        self._start(final=True)

    def _start(self, *, final: bool) -> None:
        if self._started or self._closed:
            return
        resolve = getattr(self.monitor, "resolve_gpus", None)
        if resolve is not None and not resolve(final=final):
            if not self._said_waiting:
                self._said_waiting = True
                logger.info(
                    "power-limit optimizer: waiting for the monitor's windows opened before "
                    "the launcher said the rank to end; no GPU is touched until then"
                )
            return
        limits = self._limits()
        if limits != self.power_limits:  # other GPUs than those seen at construction
            self.power_limits = limits
            self.max_power_limit = limits[0]
            if type(self.state) is Ready:
                self.state = Ready(limits[0], self.state.steps)
        if self._default_selector and isinstance(self.optimum_selector, ZeusCost):
            self.optimum_selector.world_size = max(len(self.monitor.gpu_indices), 1)
        self._set_limit(self.max_power_limit, wait=True, why="start at the maximum")
        self._started = True
        if type(self.state) is Done:
            self._set_limit(self.state.optimal_power_limit, why="loaded profile")

    def _limits(self) -> list[int]:
        devices = self.monitor.gpu_devices
        if not devices:
            raise ValueError("the monitor watches no GPU: nothing to optimize")
        capless = [
            d for d in devices if d.capabilities is not None and not d.capabilities.power_cap
        ]
        if capless:
            described = ", ".join(f"{d.key} ({d.name}, vendor {d.vendor or '?'})" for d in capless)
            raise ConfigError(
                f"no power cap to tune: {described} cannot have its power limit set "
                "(Capabilities.power_cap is False); the power-limit optimizer needs GPUs with "
                "a power limit (NVIDIA) or power cap (AMD)"
            )
        ranges = {(d.power_limit_min_w, d.power_limit_max_w) for d in devices}
        if len(ranges) != 1:
            described = ", ".join(
                f"{d.key}: {d.power_limit_min_w}-{d.power_limit_max_w} W" for d in devices
            )
            raise ValueError(
                f"the monitored GPUs have different power-limit ranges ({described}); "
                "optimize them with separate monitors"
            )
        lo, hi = ranges.pop()
        if lo is None or hi is None:
            raise ValueError("the GPUs do not report a power-limit range")
        return list(range(int(hi), int(lo) - 1, -self.pl_step))

    # -- the training thread's hooks ------------------------------------------------------------

    def on_step_begin(self) -> None:
        """Call at the start of every training step (microseconds; never waits, except once
        per profiled limit with several ranks, see :meth:`_start_deciding`)."""
        if not self._started:
            self.start()
            if not self._started:
                return
        state = self.state
        if type(state) is Done:
            return
        if not self._looked:
            # Once, at the first step (then again only when a limit is combined): not on
            # every step of a single-process run, where no group ever appears.
            self._looked = True
            self._join_ranks()
        if type(state) is Ready:
            state.steps -= 1
            if state.steps == 0:
                self._enter_warmup(state.next_power_limit)
        elif type(state) is Warmup:
            self.profiling_step_count += 1
            state.steps -= 1
            if self._stats is not None and state.steps > 0:
                self._adaptive_warmup_step(state)
            if state.steps <= 0:
                self._end_step_windows()
                self._enter_profiling(state.current_power_limit)
        elif type(state) is Profiling and state.steps > 0:
            self.profiling_step_count += 1
            self.measured_step_count += 1
            self._profiled_steps += 1
            state.steps -= 1
            if self._stats is not None:
                self._adaptive_step(state)
            if state.steps == 0:
                self._finish_limit(state)
        if self._pending and self._collect() and self.adaptive is not None:
            self._check_settled()

    def on_epoch_end(self) -> None:
        """Call at the end of every epoch: an interrupted warmup or profile starts over."""
        state = self.state
        if type(state) is Warmup or (type(state) is Profiling and state.steps > 0):
            limit = state.current_power_limit
            logger.info(
                "%s at %d W interrupted by the end of an epoch", type(state).__name__, limit
            )
            if type(state) is Profiling:
                self.monitor.end_window(self._window_name(limit), sync_execution=False, cancel=True)
            self._end_step_windows()
            interrupted = self._interrupted[limit] = self._interrupted.get(limit, 0) + 1
            if interrupted == 2:
                logger.warning(
                    "power-limit optimizer: epochs keep ending before %d W is profiled, which "
                    "takes %d warmup + %d profiled steps in one epoch; with epochs this short "
                    "profiling never finishes (lower warmup_steps or profile_steps)",
                    limit,
                    self.warmup_steps,
                    self.profile_steps,
                )
            self.state = Ready(limit, 1)
            self._set_limit(self.max_power_limit, why="epoch ended mid-profile")
            self._emit("ready", limit, steps=1, detail="interrupted by the end of an epoch")

    def _join_ranks(self) -> None:
        """Find the job's ranks (``torch.distributed``), at the first step and again when a
        limit's measurement is combined: every rank runs this at the same step, whenever the
        framework created its process group (Lightning: inside ``trainer.fit()``; Hugging
        Face: with the ``TrainingArguments``). Counts every rank's GPUs for the default
        selector (one collective, once)."""
        if self._dist is None:
            self._dist = collectives()
            if self._dist is None:
                return
        self._joined = True
        if self.adaptive is not None:
            logger.warning(
                "power-limit optimizer: %d ranks; adaptive profiling is single-process for "
                "now, so every limit is profiled in full",
                self._dist.world_size,
            )
            self.adaptive = None
            self._stats = None
        if self._default_selector and isinstance(self.optimum_selector, ZeusCost):
            gpus = self._dist.total(len(self.monitor.gpu_indices))
            self.optimum_selector.world_size = max(gpus, 1)
            logger.info("power-limit optimizer: %d ranks, %d GPUs", self._dist.world_size, gpus)

    # -- transitions ------------------------------------------------------------------------------

    def _enter_warmup(self, limit: int) -> None:
        self._set_limit(limit, why="warmup")
        if self.warmup_steps == 0:
            self.state = Warmup(limit, 0)
            self._enter_profiling(limit)
            return
        self.state = Warmup(limit, self.warmup_steps)
        if self.adaptive is not None:
            self._stats = _StepStats()  # per-step windows show when the new limit has settled
            self._step_window = None
        self._emit("warmup", limit, steps=self.warmup_steps)

    def _end_step_windows(self) -> None:
        """Adaptive: drop the per-step bookkeeping (cancelling an open step window)."""
        if self._step_window is not None:
            self.monitor.end_window(self._step_window, sync_execution=False, cancel=True)
            self._step_window = None
        self._stats = None

    def _adaptive_warmup_step(self, state: Warmup) -> None:
        """Adaptive: end the warmup once two consecutive steps agree within the tolerance.

        The first step after the limit change has no window (the change may still be landing);
        from the second on each step gets one, and when two finished in a row differ by no
        more than twice ``tolerance`` in time and in energy the GPU has settled at the limit.
        """
        stats = self._stats
        assert stats is not None and self.adaptive is not None
        if self._step_window is not None:
            stats.pending.append(self.monitor.end_window(self._step_window, sync_execution=False))
            self._step_window = None
        stats.collect()
        if stats.steady(2 * self.adaptive.tolerance):
            self._emit(
                "settled",
                state.current_power_limit,
                steps=self.warmup_steps - state.steps,
                detail="two consecutive warmup steps agree",
            )
            state.steps = 0
            return
        self._step_window = f"__plo_warm_{state.current_power_limit}_{state.steps}"
        self.monitor.begin_window(self._step_window, sync_execution=False, restart=True)

    def _enter_profiling(self, limit: int) -> None:
        self.state = Profiling(limit, self.profile_steps)
        self._profiled_steps = 0
        self.monitor.begin_window(self._window_name(limit), sync_execution=False, restart=True)
        if self.adaptive is not None:
            self._stats = _StepStats()
            self._step_window = None
        self._emit("profiling", limit, steps=self.profile_steps)

    def _adaptive_step(self, state: Profiling) -> None:
        stats = self._stats
        assert stats is not None and self.adaptive is not None
        if self._step_window is not None:
            stats.pending.append(self.monitor.end_window(self._step_window, sync_execution=False))
        stats.collect()
        if stats.n >= self.adaptive.min_steps:
            dt, de = stats.relative_half_widths()
            if dt <= self.adaptive.tolerance and de <= self.adaptive.tolerance:
                state.steps = 0  # stable: this limit is known well enough
                self._step_window = None
                return
        if state.steps > 0:
            self._step_window = f"__plo_step_{state.current_power_limit}_{state.steps}"
            self.monitor.begin_window(self._step_window, sync_execution=False, restart=True)
        else:
            self._step_window = None

    def _finish_limit(self, state: Profiling) -> None:
        limit = state.current_power_limit
        done_steps = self._profiled_steps
        result = self.monitor.end_window(self._window_name(limit), sync_execution=False)
        stats, self._stats = self._stats, None
        if self._step_window is not None:
            self.monitor.end_window(self._step_window, sync_execution=False, cancel=True)
            self._step_window = None
        if not self._joined:
            self._join_ranks()
        if self._dist is not None:
            # Every rank must run the all-reduce at this same step, in the same order relative
            # to its other collectives (DDP's): record now, waiting ~0.2 s once per limit.
            self._record(limit, result, done_steps, stats)
        else:
            with self._lock:
                self._pending.append((limit, result, done_steps, stats))
        state.steps = 0
        index = self.power_limits.index(limit)
        if index == len(self.power_limits) - 1:
            self._start_deciding(limit, "every limit profiled")
        else:
            self._enter_warmup(self.power_limits[index + 1])

    def _start_deciding(self, limit: int, why: str) -> None:
        """Stop profiling; choose once the outstanding measurements are in.

        Single process: in a background thread, so the training thread never waits. With
        several ranks: here, on the training thread (the ranks' collectives must run in the
        same order on one thread each); it waits at most ~0.2 s, once.
        """
        state = self.state
        if type(state) is Profiling and state.steps > 0:  # adaptive stop in mid-profile
            self.monitor.end_window(self._window_name(limit), sync_execution=False, cancel=True)
        if self._step_window is not None:
            self.monitor.end_window(self._step_window, sync_execution=False, cancel=True)
            self._step_window = None
        self._stats = None
        self.state = Profiling(limit, 0)
        self._deciding = True
        self._emit("deciding", limit, detail=why)
        if self._dist is not None:
            self._decide()
        else:
            # The steps until the decision lands (the last window's figures, ~0.2 s) run at
            # the maximum, not at the lowest limit just profiled.
            self._set_limit(self.max_power_limit, why="deciding")
            threading.Thread(target=self._decide, name="zeus-async-plo", daemon=True).start()

    # -- measurements -----------------------------------------------------------------------------

    def _window_name(self, limit: int) -> str:
        return f"__GlobalPowerLimitOptimizer_{limit}"

    def _collect(self) -> bool:
        """Turn finalized profile windows into measurements; True when one was added."""
        if self._deciding or not self._pending[0][1].done():
            return False
        with self._lock:
            added = False
            while self._pending and self._pending[0][1].done():
                limit, result, steps, stats = self._pending.pop(0)
                self._record(limit, result, steps, stats)
                added = True
        return added

    def _record(
        self, limit: int, result: WindowResult, steps: int, stats: _StepStats | None = None
    ) -> None:
        try:
            m = result.wait()
        except Exception as exc:  # e.g. the GPU was lost: this limit goes unmeasured
            logger.warning("power-limit optimizer: no measurement at %d W (%s)", limit, exc)
            if self._dist is not None:
                # The other ranks are in (or on their way to) the combine: take part, saying
                # this rank has nothing, so that every rank drops the limit alike.
                self._dist.combine(0.0, 0.0, True)
            self._emit("failed", limit, detail=f"measurement failed: {exc}")
            return
        energy = sum(m.gpu_energy_j.values())
        elapsed = m.time_s
        values: dict[str, float] = {}
        if stats is not None and self.adaptive is not None:
            stats.collect()
            t_run, e_run, outliers = stats.kept()
            values["outlier_steps"] = float(outliers)
        if stats is not None and self.adaptive is not None and t_run.n >= self.adaptive.min_steps:
            # The per-step means without outlier steps, for a full profile's length.
            elapsed = t_run.mean * self.profile_steps
            energy = e_run.mean * self.profile_steps
        elif steps and steps != self.profile_steps:  # adaptive: scale to a full profile
            energy *= self.profile_steps / steps
            elapsed *= self.profile_steps / steps
        if self._dist is not None:
            energy, elapsed, failed = self._dist.combine(energy, elapsed, False)
            if failed:
                logger.warning(
                    "power-limit optimizer: another rank has no measurement at %d W; every "
                    "rank leaves this limit out",
                    limit,
                )
                self._emit("failed", limit, detail="another rank's measurement failed")
                return
        measurement = PowerLimitMeasurement(limit, max(energy, 1e-9), max(elapsed, 1e-9))
        self.measurements.append(measurement)
        self._emit(
            "measured",
            limit,
            steps=steps,
            values={"energy_j": measurement.energy, "time_s": measurement.time, **values},
        )

    def _check_settled(self) -> None:
        """Adaptive: stop descending once lower limits can no longer change the choice.

        Runs when a measurement comes in (during the next limit's warmup, typically), using
        only the measurements already in: nothing waits.
        """
        assert self.adaptive is not None
        if self._deciding or not self._choice_settled(self.measurements, self.adaptive):
            return
        state = self.state
        limit = getattr(state, "current_power_limit", self.measurements[-1].power_limit)
        self._start_deciding(limit, "lower limits cannot change the choice")

    def _choice_settled(
        self, ms: Sequence[PowerLimitMeasurement], options: AdaptiveOptions
    ) -> bool:
        if len(ms) < 2:
            return False
        selector = self.optimum_selector
        if isinstance(selector, MaxSlowdownConstraint):
            top = max(ms, key=lambda m: m.power_limit)
            return ms[-1].time > selector.factor * top.time * (1 + options.tolerance)
        cost = getattr(selector, "cost", None)
        if cost is None:
            return False  # a selector we cannot reason about: profile every limit
        costs = [cost(m, ms) for m in ms]
        best = min(range(len(ms)), key=costs.__getitem__)
        if len(ms) - 1 - best < options.patience:
            return False
        # The latest `patience` limits all cost clearly more than the best (beyond both
        # estimates' uncertainty): under unimodality, lower limits only cost more.
        margin = 1 + 2 * options.tolerance
        return all(c > costs[best] * margin for c in costs[-options.patience :])

    def _decide(self) -> None:
        """Off the training thread: wait for the last measurements, choose, apply, save."""
        try:
            with self._lock:
                pending, self._pending = self._pending, []
                for limit, result, steps, stats in pending:
                    self._record(limit, result, steps, stats)
            optimal = self._select()
        except Exception as exc:
            logger.exception("power-limit optimizer could not decide; keeping the maximum")
            self._set_limit(self.max_power_limit, why="decision failed")
            self._emit("failed", self.max_power_limit, detail=f"{type(exc).__name__}: {exc}")
            self.state = Done(self.max_power_limit)  # settled: training goes on at the maximum
            return
        self._set_limit(optimal, why="optimum")
        try:
            self._save_profile()
            self._emit(
                "done",
                optimal,
                detail=f"{type(self.optimum_selector).__name__} over "
                f"{len(self.measurements)} limits",
                values={"profiling_steps": float(self.profiling_step_count)},
            )
        finally:
            # Last: whoever sees Done (wait_done) finds the profile saved and the event sent.
            self.state = Done(optimal)
        # As Zeus says it, and seen by default: at INFO where the program configured logging,
        # else through Python's last-resort handler (which shows WARNING and above only).
        level = logging.INFO if logger.hasHandlers() else logging.WARNING
        logger.log(level, "Optimal power limit is %d W", optimal)

    def _select(self) -> int:
        return int(self.optimum_selector.select(self.measurements))

    def wait_done(self, timeout: float | None = None) -> int:
        """Block until the optimum is chosen (tests, scripts); returns it in W."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not isinstance(self.state, Done):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no power limit chosen within {timeout} s")
            time.sleep(0.005)
        return self.state.optimal_power_limit

    @property
    def optimal_power_limit(self) -> int | None:
        """The chosen limit (W), once :class:`Done`."""
        return self.state.optimal_power_limit if isinstance(self.state, Done) else None

    # -- power limits, events, profile ------------------------------------------------------------

    def _set_limit(self, watts: int, *, wait: bool = False, why: str = "") -> None:
        if self.current_power_limit == watts:
            return
        future = self.monitor.set_power_limit(watts, source=f"{SOURCE}: {why}" if why else SOURCE)
        self.current_power_limit = watts
        if wait:
            try:
                future.result(timeout=30)
            except NoPermissionError as exc:
                raise NoPermissionError(
                    "changing GPU power limits needs root or the CAP_SYS_ADMIN capability "
                    "(run as root, or start the container with --cap-add SYS_ADMIN); "
                    f"NVML said: {exc}"
                ) from None
        else:
            future.add_done_callback(_log_failure)

    def _emit(
        self,
        state: str,
        limit: int | None,
        *,
        steps: int | None = None,
        detail: str = "",
        values: dict[str, float] | None = None,
    ) -> None:
        if self._closed and state != "restored":
            return
        event = OptimizerState(
            host=self._host,
            t_ns=time.time_ns(),
            optimizer=SOURCE,
            state=state,
            power_limit_w=None if limit is None else float(limit),
            steps=steps,
            detail=detail,
            values=values or {},
        )
        try:
            self.monitor.publish(event).add_done_callback(_log_failure)
        except RuntimeError:  # the monitor is closed
            pass

    def _save_profile(self) -> None:
        if self.profile_path is None:
            return
        if self._dist is not None and self._dist.rank != 0:
            return  # the same measurements as rank 0's, which writes them (one writer)
        data = msgspec.json.format(
            msgspec.json.encode(PowerLimitProfile(self.measurements)), indent=2
        )
        tmp = self.profile_path.with_name(self.profile_path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.profile_path)
        logger.info("power-limit profile saved to %s", self.profile_path)

    # -- restoring --------------------------------------------------------------------------------

    def close(self) -> None:
        """Restore the maximum power limit (waiting for it) and stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._signals.uninstall()
        if not self._started:
            return  # no limit was changed: nothing to restore (and no GPU to touch)
        try:
            self.current_power_limit = None
            self._emit("restored", self.max_power_limit, detail="closing")
            self.monitor.set_power_limit(self.max_power_limit, source=f"{SOURCE}: restore").result(
                timeout=10
            )
        except Exception as exc:  # the monitor may be gone already at interpreter exit
            logger.warning("could not restore the maximum power limit: %s", exc)


def _log_failure(future: Any) -> None:
    exc = future.exception()
    if exc is not None:
        logger.error("power-limit optimizer: %s: %s", type(exc).__name__, exc)


def _load_profile(path: Path) -> list[PowerLimitMeasurement]:
    try:
        profile = msgspec.json.decode(path.read_bytes(), type=PowerLimitProfile)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(
            f"the power-limit profile {path} is corrupt ({exc}); delete it to profile again"
        ) from None
    if not profile.measurements:
        raise ConfigError(f"the power-limit profile {path} holds no measurement")
    return profile.measurements
