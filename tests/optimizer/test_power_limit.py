"""The power-limit optimizer: Zeus's state machine step for step, selectors, profiles, privileges,
adaptive profiling, and real processes (SIGTERM restore, two ranks over gloo)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from zeus_async import Monitor
from zeus_async.devices.sim_config import GpuOverride, SimConfig
from zeus_async.errors import ConfigError, NoPermissionError
from zeus_async.events import DeviceInfo, Measurement, OptimizerState, PowerLimitChange
from zeus_async.optimizer import (
    AdaptiveOptions,
    Done,
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    PowerLimitProfile,
    Profiling,
    Ready,
    Time,
    Warmup,
    ZeusCost,
    zeus_cost,
)
from zeus_async.ranks import collective_device
from zeus_async.store import RecordingReader
from zeus_async.testing.procs import run_ranks

SCRIPT = Path(__file__).with_name("plo_procs.py")
M = PowerLimitMeasurement
PROFILE_WINDOW = "__GlobalPowerLimitOptimizer_{}"


# -- a fake monitor -------------------------------------------------------------------------------


def per_step(limit: int) -> tuple[float, float]:
    """Time (s) and energy (J, both GPUs) of one training step at ``limit`` W.

    Time is flat down to 575 W and grows 10 % per 25 W below; both GPUs draw 90 % of the limit.
    Energy and the Zeus cost (eta 0.5, world size 2) are lowest at 575 W (600 W among 100 W
    strides), and rise by more than 4 % per 25 W just below it.
    """
    t = 0.1 * 1.1 ** (max(0, 575 - limit) / 25)
    return t, 2 * limit * 0.9 * t


class FakeResult:
    """A lazy window result: ``done()`` once released, then ``wait()`` returns (or raises)."""

    def __init__(self, m: Measurement, *, ready: bool = True) -> None:
        self._m = m
        self._event = threading.Event()
        self.error: BaseException | None = None
        if ready:
            self._event.set()

    def release(self) -> None:
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Measurement:
        if not self._event.wait(timeout):
            raise TimeoutError("not finalized")
        if self.error is not None:
            raise self.error
        return self._m


def _completed(value: Any = None) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class FakeMonitor:
    """The parts of :class:`~zeus_async.Monitor` the optimizer uses, over scripted steps.

    Every training step (:meth:`advance`) costs ``per_step(limit)`` at the limit in force, times
    ``1 + noise`` (deterministic, per step and limit, uniform in ``±noise``); a window's result
    sums the steps it spanned, its energy split evenly between the GPUs.
    """

    def __init__(
        self,
        *,
        gpus: int = 2,
        ranges: list[tuple[float, float]] | None = None,
        noise: float = 0.0,
        hold: bool = False,
        cost: Callable[[int], tuple[float, float]] = per_step,
    ) -> None:
        ranges = ranges or [(200.0, 700.0)] * gpus
        self.gpu_indices = list(range(len(ranges)))
        self.gpu_devices = [
            DeviceInfo(f"gpu:{i}", "fake", power_limit_min_w=lo, power_limit_max_w=hi)
            for i, (lo, hi) in enumerate(ranges)
        ]
        self.noise = noise
        self.hold = hold
        self.cost = cost
        self.limit: float | None = None
        self.trace: list[tuple[float, float]] = []
        self.open: dict[str, int] = {}
        self.limit_calls: list[tuple[float, str]] = []  # (watts, source); always all GPUs
        self.events: list[OptimizerState] = []
        self.window_calls: list[tuple[str, str, bool]] = []
        self.results: dict[str, FakeResult] = {}

    # the training loop's side
    def advance(self) -> None:
        assert self.limit is not None
        t, e = self.cost(int(self.limit))
        if self.noise:
            rng = random.Random(f"{self.limit}/{len(self.trace)}")
            t *= 1 + rng.uniform(-self.noise, self.noise)
            e *= 1 + rng.uniform(-self.noise, self.noise)
        self.trace.append((t, e))

    # the monitor's API
    def set_power_limit(self, watts: float, gpus: Any = None, *, source: str = "") -> Future[Any]:
        assert gpus is None
        self.limit_calls.append((watts, source))
        self.limit = watts
        return _completed()

    def publish(self, event: Any) -> Future[Any]:
        assert isinstance(event, OptimizerState)
        self.events.append(event)
        return _completed()

    def begin_window(self, name: str, sync_execution: bool = True, restart: bool = False) -> None:
        assert sync_execution is False  # the optimizer never synchronizes the devices
        if name in self.open and not restart:
            raise ValueError(f"window {name!r} already open")
        self.window_calls.append(("begin", name, restart))
        self.open[name] = len(self.trace)

    def end_window(
        self, name: str, sync_execution: bool = True, cancel: bool = False
    ) -> FakeResult:
        assert sync_execution is False
        start = self.open.pop(name)  # KeyError: not open
        self.window_calls.append(("end", name, cancel))
        steps = self.trace[start:]
        t = sum(s[0] for s in steps)
        e = sum(s[1] for s in steps)
        n = len(self.gpu_indices)
        energy = {} if cancel else {i: e / n for i in self.gpu_indices}
        m = Measurement("h", 0, name, 0, 0, 0, 0.0 if cancel else t, energy)
        result = FakeResult(m, ready=cancel or not self.hold)
        self.results[name] = result
        return result

    # helpers for the tests
    @property
    def profile_windows(self) -> list[tuple[str, str, bool]]:
        return [c for c in self.window_calls if not c[1].startswith(("__plo_step_", "__plo_warm_"))]

    def events_of(self, state: str) -> list[OptimizerState]:
        return [e for e in self.events if e.state == state]

    def states(self) -> list[tuple[str, float | None]]:
        return [(e.state, e.power_limit_w) for e in self.events]


def snap(opt: GlobalPowerLimitOptimizer) -> tuple[Any, ...]:
    s = opt.state
    if isinstance(s, Ready):
        return ("Ready", s.next_power_limit, s.steps)
    if isinstance(s, (Warmup, Profiling)):
        return (type(s).__name__, s.current_power_limit, s.steps)
    return ("Done", s.optimal_power_limit)


def step(opt: GlobalPowerLimitOptimizer, mon: FakeMonitor, n: int = 1) -> tuple[Any, ...]:
    """``n`` training steps: the hook, then the step at the limit in force.

    Returns the state after the last hook, where a ``Done`` that the background decision
    reached since reads as the deciding state it followed, ``("Profiling", limit, 0)``.
    """
    deciding = sum(e.state == "deciding" for e in mon.events)
    for _ in range(n):
        opt.on_step_begin()
        mon.advance()
    decided_now = sum(e.state == "deciding" for e in mon.events) > deciding
    if decided_now and isinstance(opt.state, Done):
        return ("Profiling", int(mon.events_of("deciding")[-1].power_limit_w or 0), 0)
    return snap(opt)


@pytest.fixture
def make_opt() -> Iterator[Callable[..., GlobalPowerLimitOptimizer]]:
    """Optimizers that are closed (limits restored, handlers and atexit hooks removed) after."""
    made: list[GlobalPowerLimitOptimizer] = []

    def make(monitor: Any, **kwargs: Any) -> GlobalPowerLimitOptimizer:
        kwargs.setdefault("restore_on_signals", False)
        opt = GlobalPowerLimitOptimizer(cast(Monitor, monitor), **kwargs)
        made.append(opt)
        return opt

    yield make
    for opt in made:
        opt.close()


def zeus_reference(
    limits: list[int], wait: int, warmup: int, profile: int, epoch_ends: set[int]
) -> tuple[list[tuple[Any, ...]], list[int]]:
    """Zeus 0.16's state machine, transliterated: the state after each ``on_step_begin`` (with
    ``on_epoch_end`` after the calls in ``epoch_ends``) and the limits it sets, in order. Its
    last Profiling → Done is reported as ``("Profiling", last, 0)``, our deciding state."""
    state: list[Any] = ["Ready", limits[0], wait + 1]
    current = limits[0]
    sets = [limits[0]]
    out: list[tuple[Any, ...]] = []

    def set_limit(pl: int) -> None:
        nonlocal current
        if pl != current:
            sets.append(pl)
            current = pl

    call = 0
    while state[0] != "Deciding":
        call += 1
        kind, pl, _ = state
        state[2] -= 1
        if kind == "Ready" and state[2] == 0:
            set_limit(pl)
            state = ["Warmup", pl, warmup]
        elif kind == "Warmup" and state[2] == 0:
            state = ["Profiling", pl, profile]
        elif kind == "Profiling" and state[2] == 0:
            i = limits.index(pl)
            if i == len(limits) - 1:
                state = ["Deciding", pl, 0]
            else:
                set_limit(limits[i + 1])
                state = ["Warmup", limits[i + 1], warmup]
        if call in epoch_ends and state[0] in ("Warmup", "Profiling"):
            state = ["Ready", state[1], 1]
            set_limit(limits[0])
        out.append(("Profiling", pl, 0) if state[0] == "Deciding" else tuple(state))
    return out, sets


# -- 1. the state machine -------------------------------------------------------------------------


def test_power_limits_and_defaults(make_opt: Callable[..., GlobalPowerLimitOptimizer]) -> None:
    mon = FakeMonitor()
    opt = make_opt(mon)
    assert opt.power_limits == list(range(700, 199, -25))
    assert opt.power_limits[:3] == [700, 675, 650] and opt.power_limits[-1] == 200
    assert opt.max_power_limit == 700
    assert isinstance(opt.optimum_selector, ZeusCost)
    assert opt.optimum_selector.eta_knob == 0.5 and opt.optimum_selector.world_size == 2
    assert snap(opt) == ("Ready", 700, 2)  # wait_steps=1 → Zeus's Ready(steps=wait_steps + 1)
    assert mon.limit_calls == [(700.0, "power_limit: start at the maximum")]
    assert mon.states() == [("ready", 700.0)] and mon.events[0].steps == 2
    # A range that is not a multiple of the stride stops above the minimum (as range() does).
    assert make_opt(FakeMonitor(), pl_step=150).power_limits == [700, 550, 400, 250]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"wait_steps": -1},
        {"warmup_steps": -1},
        {"profile_steps": 0},
        {"pl_step": 0},
        {"pl_step": -25},
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any]) -> None:
    mon = FakeMonitor()
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        GlobalPowerLimitOptimizer(cast(Monitor, mon), **kwargs)
    assert mon.limit_calls == []


def test_different_power_limit_ranges_are_refused() -> None:
    mon = FakeMonitor(ranges=[(200.0, 700.0), (100.0, 400.0)])
    with pytest.raises(ValueError, match=r"different power-limit ranges.*gpu:1: 100.0-400.0 W"):
        GlobalPowerLimitOptimizer(cast(Monitor, mon), restore_on_signals=False)
    assert mon.limit_calls == []


def test_state_machine_step_by_step(make_opt: Callable[..., GlobalPowerLimitOptimizer]) -> None:
    mon = FakeMonitor()
    opt = make_opt(mon, wait_steps=1, warmup_steps=2, profile_steps=3, pl_step=100)
    assert opt.power_limits == [700, 600, 500, 400, 300, 200]
    assert snap(opt) == ("Ready", 700, 2)
    assert step(opt, mon) == ("Ready", 700, 1)
    assert step(opt, mon) == ("Warmup", 700, 2)  # call wait_steps + 1
    assert step(opt, mon) == ("Warmup", 700, 1)
    assert mon.window_calls == []
    assert step(opt, mon) == ("Profiling", 700, 3)  # the warmup_steps'th call in Warmup
    assert mon.window_calls == [("begin", "__GlobalPowerLimitOptimizer_700", True)]
    assert step(opt, mon, 2) == ("Profiling", 700, 1)
    assert step(opt, mon) == ("Warmup", 600, 2)  # the profile_steps'th call in Profiling
    assert mon.window_calls[-1] == ("end", "__GlobalPowerLimitOptimizer_700", False)
    assert mon.limit_calls[-1] == (600.0, "power_limit: warmup")
    # The window spanned exactly profile_steps training steps, all at 700 W.
    t, e = per_step(700)
    [m700] = opt.measurements
    assert m700.power_limit == 700
    assert m700.energy == pytest.approx(3 * e) and m700.time == pytest.approx(3 * t)
    assert opt.profiling_step_count == 5  # warmup_steps + profile_steps per limit

    # The rest, against Zeus's state machine: every state after every call.
    expected, sets = zeus_reference(opt.power_limits, 1, 2, 3, set())
    got = [("Ready", 700, 1), ("Warmup", 700, 2), ("Warmup", 700, 1), ("Profiling", 700, 3)]
    got += [("Profiling", 700, 2), ("Profiling", 700, 1), ("Warmup", 600, 2)]
    while len(got) < len(expected):
        got.append(step(opt, mon))
    assert got == expected
    assert got[-1] == ("Profiling", 200, 0)  # deciding; the choice is made off this thread
    assert opt.wait_done(timeout=5) == 600
    assert snap(opt) == ("Done", 600) and opt.optimal_power_limit == 600
    # Zeus's limits, then the maximum while the choice is made (the steps in between do not
    # run at the lowest limit), then the choice.
    assert [c[0] for c in mon.limit_calls] == [*sets, 700, 600]
    assert mon.limit_calls[-2] == (700.0, "power_limit: deciding")
    assert mon.limit_calls[-1] == (600.0, "power_limit: optimum")
    assert [m.power_limit for m in opt.measurements] == [700, 600, 500, 400, 300, 200]
    for m in opt.measurements:
        t, e = per_step(m.power_limit)
        assert m.energy == pytest.approx(3 * e) and m.time == pytest.approx(3 * t)
    assert opt.profiling_step_count == 6 * 5
    # Every limit got one window, begun with restart=True, ended (not cancelled).
    windows = [PROFILE_WINDOW.format(pl) for pl in opt.power_limits]
    assert mon.window_calls == [c for w in windows for c in (("begin", w, True), ("end", w, False))]

    # The events: ready, then warmup/profiling per limit, each measurement once it is in.
    want: list[tuple[str, float | None]] = [("ready", 700.0)]
    for i, pl in enumerate(opt.power_limits):
        want.append(("warmup", pl))
        if i:  # the previous limit's result came in as this one's warmup began
            want.append(("measured", opt.power_limits[i - 1]))
        want.append(("profiling", pl))
    want += [("deciding", 200.0), ("measured", 200.0), ("done", 600.0)]
    assert mon.states() == want
    by_state = {e.state: e for e in mon.events}
    assert by_state["warmup"].steps == 2 and by_state["profiling"].steps == 3
    assert by_state["measured"].steps == 3
    assert by_state["measured"].values == {
        "energy_j": opt.measurements[-1].energy,
        "time_s": opt.measurements[-1].time,
    }
    assert by_state["deciding"].detail == "every limit profiled"
    assert by_state["done"].values == {"profiling_steps": 30.0}
    assert "ZeusCost over 6 limits" in by_state["done"].detail
    assert all(e.optimizer == "power_limit" and e.host for e in mon.events)

    # Done ignores everything from now on.
    calls, events, windows_now = len(mon.limit_calls), len(mon.events), len(mon.window_calls)
    for _ in range(20):
        opt.on_step_begin()
        opt.on_epoch_end()
        mon.advance()
    assert snap(opt) == ("Done", 600)
    assert (len(mon.limit_calls), len(mon.events), len(mon.window_calls)) == (
        calls,
        events,
        windows_now,
    )
    assert opt.profiling_step_count == 30


def test_zero_wait_and_warmup_steps(make_opt: Callable[..., GlobalPowerLimitOptimizer]) -> None:
    """wait_steps=0: the first call starts warming up; warmup_steps=0 profiles at once (Zeus
    itself would count its Warmup(steps=0) below zero and never profile)."""
    mon = FakeMonitor()
    opt = make_opt(mon, wait_steps=0, warmup_steps=0, profile_steps=2, pl_step=250)
    assert opt.power_limits == [700, 450, 200]
    assert snap(opt) == ("Ready", 700, 1)
    assert step(opt, mon) == ("Profiling", 700, 2)
    assert step(opt, mon) == ("Profiling", 700, 1)
    assert step(opt, mon) == ("Profiling", 450, 2)
    assert mon.limit_calls[-1][0] == 450
    assert step(opt, mon, 2) == ("Profiling", 200, 2)
    assert step(opt, mon, 2) == ("Profiling", 200, 0)
    assert opt.wait_done(timeout=5) == 700
    assert opt.profiling_step_count == 6
    assert "warmup" not in [s for s, _ in mon.states()]


def test_epoch_end_during_warmup_and_profiling(
    make_opt: Callable[..., GlobalPowerLimitOptimizer],
) -> None:
    mon = FakeMonitor()
    opt = make_opt(mon, wait_steps=1, warmup_steps=2, profile_steps=3, pl_step=250)
    assert opt.power_limits == [700, 450, 200]
    opt.on_epoch_end()  # Ready: nothing
    assert snap(opt) == ("Ready", 700, 2) and len(mon.events) == 1
    assert step(opt, mon, 6) == ("Profiling", 700, 1)
    assert step(opt, mon) == ("Warmup", 450, 2)

    # During warmup: back to Ready(the same limit, 1 step) at the maximum limit.
    assert step(opt, mon) == ("Warmup", 450, 1)
    opt.on_epoch_end()
    assert snap(opt) == ("Ready", 450, 1)
    assert mon.limit_calls[-1] == (700.0, "power_limit: epoch ended mid-profile")
    assert mon.events[-1].state == "ready" and mon.events[-1].steps == 1
    assert mon.events[-1].detail == "interrupted by the end of an epoch"
    opt.on_epoch_end()  # Ready again: nothing more
    assert snap(opt) == ("Ready", 450, 1) and mon.limit_calls[-1][0] == 700
    assert step(opt, mon) == ("Warmup", 450, 2)  # the full warmup again
    assert mon.limit_calls[-1] == (450.0, "power_limit: warmup")
    assert step(opt, mon, 2) == ("Profiling", 450, 3)

    # During profiling: the window is cancelled, Ready(same limit, 1), the maximum limit.
    assert step(opt, mon) == ("Profiling", 450, 2)
    opt.on_epoch_end()
    assert snap(opt) == ("Ready", 450, 1)
    assert mon.window_calls[-1] == ("end", "__GlobalPowerLimitOptimizer_450", True)
    assert mon.limit_calls[-1] == (700.0, "power_limit: epoch ended mid-profile")
    assert [m.power_limit for m in opt.measurements] == [700]  # nothing from the cancelled one
    assert step(opt, mon) == ("Warmup", 450, 2)
    assert step(opt, mon, 2) == ("Profiling", 450, 3)
    assert mon.window_calls[-1] == ("begin", "__GlobalPowerLimitOptimizer_450", True)
    assert step(opt, mon, 3) == ("Warmup", 200, 2)
    t, e = per_step(450)  # the restarted window: 3 steps, all at 450 W
    m450 = opt.measurements[-1]
    assert m450.power_limit == 450
    assert m450.energy == pytest.approx(3 * e) and m450.time == pytest.approx(3 * t)

    # Each profiled/warmed step counts, including the interrupted ones.
    assert opt.profiling_step_count == 5 + 1 + 2 + 1 + 2 + 3

    # The whole run against Zeus's state machine with the same epoch ends.
    mon2 = FakeMonitor()
    opt2 = make_opt(mon2, wait_steps=1, warmup_steps=2, profile_steps=3, pl_step=250)
    ends = {8, 12}
    expected, sets = zeus_reference(opt2.power_limits, 1, 2, 3, ends)
    got = []
    for call in range(1, len(expected) + 1):
        got.append(step(opt2, mon2))
        if call in ends:  # the epoch ends after this step
            opt2.on_epoch_end()
            got[-1] = snap(opt2)
    assert got == expected
    opt2.on_epoch_end()  # while deciding (or done): nothing
    optimal = opt2.wait_done(timeout=5)
    assert optimal == 700
    assert [c[0] for c in mon2.limit_calls] == [*sets, optimal]
    assert [m.power_limit for m in opt2.measurements] == [700, 450, 200]
    cancelled = [c for c in mon2.window_calls if c[0] == "end" and c[2]]
    assert cancelled == [("end", "__GlobalPowerLimitOptimizer_450", True)]


def test_decision_waits_for_measurements_off_the_training_thread(
    make_opt: Callable[..., GlobalPowerLimitOptimizer],
) -> None:
    """Results that are not in yet never hold up a step; the choice waits for them."""
    mon = FakeMonitor(hold=True)
    opt = make_opt(mon, wait_steps=0, warmup_steps=1, profile_steps=2, pl_step=250)
    assert step(opt, mon, 1 + 3 * 3) == ("Profiling", 200, 0)
    assert opt.measurements == []  # none in yet, yet profiling went on
    assert mon.states()[-1] == ("deciding", 200.0)
    with pytest.raises(TimeoutError):
        opt.wait_done(timeout=0.05)
    step(opt, mon, 3)
    assert snap(opt) == ("Profiling", 200, 0)
    for result in mon.results.values():
        result.release()
    assert opt.wait_done(timeout=5) == 700
    assert [m.power_limit for m in opt.measurements] == [700, 450, 200]
    assert [s for s, _ in mon.states()][-5:] == [
        "deciding",
        "measured",
        "measured",
        "measured",
        "done",
    ]


def test_measurements_collected_on_later_steps(
    make_opt: Callable[..., GlobalPowerLimitOptimizer],
) -> None:
    mon = FakeMonitor(hold=True)
    opt = make_opt(mon, wait_steps=0, warmup_steps=2, profile_steps=2, pl_step=250)
    assert step(opt, mon, 5) == ("Warmup", 450, 2)
    assert opt.measurements == []
    mon.results[PROFILE_WINDOW.format(700)].release()
    assert step(opt, mon) == ("Warmup", 450, 1)
    assert [m.power_limit for m in opt.measurements] == [700]
    assert mon.states()[-1] == ("measured", 700.0)


def test_failed_decision_keeps_the_maximum(
    make_opt: Callable[..., GlobalPowerLimitOptimizer],
) -> None:
    mon = FakeMonitor(hold=True)
    opt = make_opt(mon, wait_steps=0, warmup_steps=0, profile_steps=1, pl_step=500)
    assert opt.power_limits == [700, 200]
    step(opt, mon, 3)
    assert snap(opt) == ("Profiling", 200, 0)
    mon.results[PROFILE_WINDOW.format(200)].error = RuntimeError("sampler died")
    for result in mon.results.values():
        result.release()
    # The failed limit goes unmeasured; the choice is made from the others (here: 700 W).
    assert opt.wait_done(5) == 700
    failed = [e for e in mon.events if e.state == "failed"]
    assert [(e.power_limit_w, e.detail) for e in failed] == [
        (200.0, "measurement failed: sampler died")
    ]
    assert [m.power_limit for m in opt.measurements] == [700]
    # Back at the maximum while deciding, which is also the choice: nothing more to set.
    assert mon.limit_calls[-1] == (700.0, "power_limit: deciding")


def test_a_decision_that_cannot_be_made_settles_at_the_maximum(
    make_opt: Callable[..., GlobalPowerLimitOptimizer],
) -> None:
    mon = FakeMonitor(hold=True)
    opt = make_opt(mon, wait_steps=0, warmup_steps=0, profile_steps=1, pl_step=500)
    step(opt, mon, 3)
    for name in (PROFILE_WINDOW.format(700), PROFILE_WINDOW.format(200)):
        mon.results[name].error = RuntimeError("sampler died")
    for result in mon.results.values():
        result.release()
    assert opt.wait_done(5) == 700  # nothing measured: no choice, training goes on at max
    assert mon.events[-1].state == "failed"
    assert mon.limit_calls[-1][0] == 700.0


def test_close_and_with_restore_the_maximum(
    make_opt: Callable[..., GlobalPowerLimitOptimizer],
) -> None:
    mon = FakeMonitor()
    with GlobalPowerLimitOptimizer(
        cast(Monitor, mon),
        wait_steps=0,
        warmup_steps=1,
        profile_steps=2,
        pl_step=250,
        restore_on_signals=False,
    ) as opt:
        step(opt, mon, 4)
        assert mon.limit == 450
    assert mon.limit_calls[-1] == (700.0, "power_limit: restore")
    assert mon.events[-1].state == "restored" and mon.events[-1].power_limit_w == 700.0
    n = len(mon.limit_calls)
    opt.close()  # idempotent
    opt.on_step_begin()
    assert len(mon.limit_calls) == n


def test_signal_restores_then_calls_the_previous_handler() -> None:
    calls: list[int] = []
    before = signal.getsignal(signal.SIGTERM)
    sigint = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        mon = FakeMonitor()
        opt = GlobalPowerLimitOptimizer(
            cast(Monitor, mon), wait_steps=0, warmup_steps=1, profile_steps=1, pl_step=250
        )
        assert signal.getsignal(signal.SIGTERM) == opt._on_signal
        assert signal.getsignal(signal.SIGINT) == opt._on_signal
        step(opt, mon, 3)
        assert mon.limit == 450
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        assert mon.limit_calls[-1] == (700.0, "power_limit: restore")
        assert signal.getsignal(signal.SIGTERM) != opt._on_signal  # closed: uninstalled
        assert signal.getsignal(signal.SIGINT) == sigint
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_with_the_default_action_exits_through_system_exit() -> None:
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        mon = FakeMonitor()
        opt = GlobalPowerLimitOptimizer(
            cast(Monitor, mon), wait_steps=0, warmup_steps=1, profile_steps=1, pl_step=250
        )
        step(opt, mon, 3)
        assert mon.limit == 450
        with pytest.raises(SystemExit) as info:
            opt._on_signal(signal.SIGTERM, None)  # as the signal would, without the signal
        assert info.value.code == 128 + signal.SIGTERM
        assert mon.limit_calls[-1] == (700.0, "power_limit: restore")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


# -- 2. selectors ---------------------------------------------------------------------------------

MS = [M(300, 1000.0, 10.0), M(250, 800.0, 11.0), M(200, 700.0, 14.0)]


def test_energy_and_time() -> None:
    assert Energy().select(MS) == 200
    assert Time().select(MS) == 300
    # Ties: the first measured, i.e. the higher limit.
    tie = [M(300, 900.0, 10.0), M(250, 800.0, 10.0), M(200, 800.0, 12.0)]
    assert Energy().select(tie) == 250
    assert Time().select(tie) == 300
    assert Time().select(list(reversed(tie))) == 250  # first in the list, whatever the order


def test_zeus_cost() -> None:
    assert zeus_cost(1000.0, 10.0, 0.5, 300.0) == 0.5 * 1000 + 0.5 * 300 * 10
    # eta 0.5, max power 300: 2000, 2050, 2450.
    assert ZeusCost(0.5).select(MS) == 300
    assert ZeusCost(1.0).select(MS) == 200  # energy only
    assert ZeusCost(0.0).select(MS) == 300  # time only
    # eta 0.9, max power 300: 1200, 1050, 1050: a tie goes to the first, the higher limit.
    assert ZeusCost(0.9).select(MS) == 250
    # eta 0.9, world size 2 (max power 600): 1500, 1380, 1470.
    assert ZeusCost(0.9, world_size=2).select(MS) == 250
    # eta 0.95, world size 1 (max 300): 1100, 925, 875; world size 4 (max 1200): 1550, 1420,
    # 1505: the world size changes the choice.
    assert ZeusCost(0.95).select(MS) == 200
    assert ZeusCost(0.95, world_size=4).select(MS) == 250
    assert ZeusCost(0.5).cost(MS[1], MS) == 0.5 * 800 + 0.5 * 300 * 11


def test_max_slowdown_constraint() -> None:
    ms = [M(300, 9.0, 8.0), M(250, 8.0, 9.0), M(200, 7.0, 10.0), M(150, 6.0, 12.0)]
    assert MaxSlowdownConstraint(1.0).select(ms) == 300
    assert MaxSlowdownConstraint(1.125).select(ms) == 250  # 9 <= 1.125 * 8, inclusive
    assert MaxSlowdownConstraint(1.25).select(ms) == 200  # 10 <= 10
    assert MaxSlowdownConstraint(1.5).select(ms) == 150
    assert MaxSlowdownConstraint(1.25).select(list(reversed(ms))) == 200  # order-free
    # Against the time at the highest limit, not the shortest.
    noisy = [M(300, 9.0, 10.0), M(250, 8.0, 9.0), M(200, 7.0, 10.5)]
    assert MaxSlowdownConstraint(1.05).select(noisy) == 200


@pytest.mark.parametrize("eta", [-0.01, 1.01, float("nan")])
def test_zeus_cost_rejects_eta(eta: float) -> None:
    with pytest.raises(ValueError, match="eta_knob"):
        ZeusCost(eta)


def test_selector_argument_errors() -> None:
    with pytest.raises(ValueError, match="world_size"):
        ZeusCost(0.5, world_size=0)
    for factor in (0.99, 0.0, float("nan")):
        with pytest.raises(ValueError, match="slowdown factor"):
            MaxSlowdownConstraint(factor)
    for selector in (Energy(), Time(), ZeusCost(0.5), MaxSlowdownConstraint(1.1)):
        with pytest.raises(ValueError, match="no measurements"):
            selector.select([])


@pytest.mark.parametrize(
    "values",
    [
        (0, 1.0, 1.0),
        (-5, 1.0, 1.0),
        (700, 0.0, 1.0),
        (700, -1.0, 1.0),
        (700, 1.0, 0.0),
        (700, 1.0, -2.0),
        (700, float("nan"), 1.0),
    ],
)
def test_measurement_rejects_non_positive_values(values: tuple[int, float, float]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        M(*values)
    pl, e, t = values
    doc = json.dumps({"power_limit": pl, "energy": e, "time": t}).encode()
    with pytest.raises(ValueError):  # msgspec.ValidationError is a ValueError
        msgspec.json.decode(doc, type=M)


# -- 3. profile files -----------------------------------------------------------------------------


def test_profile_is_saved_and_loaded(
    tmp_path: Path, make_opt: Callable[..., GlobalPowerLimitOptimizer]
) -> None:
    path = tmp_path / "profile.json"
    mon = FakeMonitor()
    opt = make_opt(
        mon, wait_steps=0, warmup_steps=1, profile_steps=2, pl_step=100, profile_path=str(path)
    )
    step(opt, mon, 1 + 6 * 3 - 1)
    assert snap(opt) == ("Profiling", 200, 1) and not path.exists()
    step(opt, mon)
    assert opt.wait_done(timeout=5) == 600
    assert path.exists()  # saved by the time Done is visible
    assert not path.with_name("profile.json.tmp").exists()
    saved = msgspec.json.decode(path.read_bytes(), type=PowerLimitProfile)
    assert saved.measurements == opt.measurements
    assert [m.power_limit for m in saved.measurements] == [700, 600, 500, 400, 300, 200]
    assert json.loads(path.read_text())["measurements"][0]["power_limit"] == 700

    mon2 = FakeMonitor()
    opt2 = make_opt(mon2, profile_path=path)
    assert snap(opt2) == ("Done", 600)
    assert opt2.measurements == opt.measurements
    assert mon2.limit_calls == [
        (700.0, "power_limit: start at the maximum"),
        (600.0, "power_limit: loaded profile"),
    ]
    assert mon2.states() == [("done", 600.0)]
    assert f"profile loaded from {path}" in mon2.events[0].detail
    step(opt2, mon2, 10)
    opt2.on_epoch_end()
    assert mon2.window_calls == [] and len(mon2.limit_calls) == 2 and snap(opt2) == ("Done", 600)
    # The choice is the selector's, made again from the saved measurements.
    opt3 = make_opt(FakeMonitor(), profile_path=path, optimum_selector=Energy())
    assert snap(opt3) == ("Done", min(opt.measurements, key=lambda m: m.energy).power_limit)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00garbage{", "is corrupt"),
        (b"", "is corrupt"),
        (b'{"measurements": "none"}', "is corrupt"),
        (b'{"measurements": [{"power_limit": "700", "energy": 1.0, "time": 1.0}]}', "is corrupt"),
        (b'{"measurements": [{"power_limit": 700, "energy": 1.0}]}', "is corrupt"),
        (b'{"measurements": [{"power_limit": 700, "energy": -3.5, "time": 1.0}]}', "is corrupt"),
        (b'{"measurements": [{"power_limit": 700.5, "energy": 1.0, "time": 1.0}]}', "is corrupt"),
        (b'{"measurements": []}', "holds no measurement"),
        (b"[]", "is corrupt"),
    ],
)
def test_corrupt_profile_is_a_config_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "profile.json"
    path.write_bytes(content)
    mon = FakeMonitor()
    with pytest.raises(ConfigError, match=message) as info:
        GlobalPowerLimitOptimizer(cast(Monitor, mon), profile_path=path, restore_on_signals=False)
    assert str(path) in str(info.value)
    if message == "is corrupt":
        assert "delete it to profile again" in str(info.value)
    assert path.read_bytes() == content  # left alone


def test_a_profile_path_that_cannot_be_written_is_a_config_error(tmp_path: Path) -> None:
    # It was accepted, and the background thread failed once profiling was done (profile lost).
    mon = FakeMonitor()
    with pytest.raises(ConfigError, match="no writable directory"):
        GlobalPowerLimitOptimizer(
            cast(Monitor, mon), profile_path=tmp_path / "no" / "p.json", restore_on_signals=False
        )


# -- 4. privileges --------------------------------------------------------------------------------


def test_no_permission_is_reported_at_construction() -> None:
    before = signal.getsignal(signal.SIGTERM)
    config = SimConfig(num_gpus=1, gpus=(GpuOverride(no_permission=True),))
    with Monitor(
        backend="sim", sampler="thread", sync_execution_with=None, sim_config=config
    ) as monitor:
        with pytest.raises(NoPermissionError) as info:
            GlobalPowerLimitOptimizer(monitor)
        assert isinstance(info.value, RuntimeError)  # what Zeus raises: except clauses work
        message = str(info.value)
        assert "CAP_SYS_ADMIN" in message and "root" in message
        assert "NVML said" in message
    assert signal.getsignal(signal.SIGTERM) == before  # nothing installed


def test_a_second_optimizer_on_one_monitor_is_refused(
    make_opt: Callable[..., GlobalPowerLimitOptimizer],
) -> None:
    mon = FakeMonitor()
    first = make_opt(mon)
    with pytest.raises(ConfigError, match="already has a power-limit optimizer"):
        make_opt(mon)
    first.close()
    make_opt(mon)  # once the first is closed, a new one may take over


def test_epochs_too_short_to_profile_are_said(
    make_opt: Callable[..., GlobalPowerLimitOptimizer], caplog: pytest.LogCaptureFixture
) -> None:
    mon = FakeMonitor()
    opt = make_opt(mon, wait_steps=0, warmup_steps=3, profile_steps=5)
    with caplog.at_level("WARNING"):
        for _epoch in range(3):  # 4-step epochs: 3 warmup + 5 profiled steps never fit
            for _ in range(4):
                step(opt, mon)
            opt.on_epoch_end()
    said = [r.getMessage() for r in caplog.records if "profiling never finishes" in r.getMessage()]
    assert len(said) == 1, said  # once, at the second interruption
    assert "700 W" in said[0] and "3 warmup + 5 profiled steps" in said[0]
    assert opt.measurements == []


# -- 5. adaptive profiling ------------------------------------------------------------------------


def _until_decided(opt: GlobalPowerLimitOptimizer, mon: FakeMonitor) -> None:
    """Step until profiling is over, then wait for the choice."""
    for _ in range(2000):
        if isinstance(opt.state, Done) or (
            isinstance(opt.state, Profiling) and opt.state.steps == 0
        ):
            break
        step(opt, mon)
    opt.wait_done(timeout=5)


def _run(
    mon: FakeMonitor, make_opt: Callable[..., GlobalPowerLimitOptimizer], **kwargs: Any
) -> GlobalPowerLimitOptimizer:
    opt = make_opt(mon, wait_steps=1, warmup_steps=2, profile_steps=20, **kwargs)
    _until_decided(opt, mon)
    return opt


@pytest.mark.parametrize(
    ("selector", "optimum"),
    [(None, 575), (MaxSlowdownConstraint(1.15), 550), (Energy(), 575)],
)
def test_adaptive_reaches_the_same_optimum_in_fewer_steps(
    make_opt: Callable[..., GlobalPowerLimitOptimizer], selector: Any, optimum: int
) -> None:
    full_mon = FakeMonitor(noise=0.005)
    full = _run(full_mon, make_opt, optimum_selector=selector)
    assert full.optimal_power_limit == optimum
    assert len(full.measurements) == len(full.power_limits) == 21
    assert full.profiling_step_count == 21 * 22

    mon = FakeMonitor(noise=0.005)
    opt = _run(mon, make_opt, optimum_selector=selector, adaptive=True)
    assert opt.adaptive == AdaptiveOptions()
    assert opt.optimal_power_limit == optimum
    assert mon.limit == optimum and mon.limit_calls[-1][1] == "power_limit: optimum"
    assert opt.profiling_step_count <= 0.5 * full.profiling_step_count

    # Each limit's profile stopped early (after min_steps per-step windows, the first step
    # has none)...
    measured = [e for e in mon.events if e.state == "measured"]
    assert measured and all(e.steps is not None and e.steps < 20 for e in measured)
    assert all(e.steps == AdaptiveOptions().min_steps + 1 for e in measured)
    # ... with per-step windows, each ended and collected.
    step_windows = [c for c in mon.window_calls if c[1].startswith("__plo_step_")]
    assert step_windows and all(c[2] is False for c in step_windows if c[0] == "end")
    assert mon.open == {}
    # ... scaled to a full profile, so they compare with the full run's.
    for m, f in zip(opt.measurements, full.measurements, strict=False):
        assert m.power_limit == f.power_limit
        assert m.energy == pytest.approx(f.energy, rel=0.01)
        assert m.time == pytest.approx(f.time, rel=0.01)
    # The descent stopped once lower limits could not change the choice.
    profiled = [m.power_limit for m in opt.measurements]
    assert profiled == opt.power_limits[: len(profiled)]
    assert len(profiled) < len(opt.power_limits)
    deciding = [e for e in mon.events if e.state == "deciding"]
    assert len(deciding) == 1
    assert deciding[0].detail == "lower limits cannot change the choice"
    assert mon.states()[-1] == ("done", float(optimum))
    # The descent stopped during a warmup: no profile window was cancelled.
    assert [c for c in mon.profile_windows if c[0] == "end" and c[2]] == []


def test_adaptive_profiles_fully_when_noisy(
    make_opt: Callable[..., GlobalPowerLimitOptimizer],
) -> None:
    """Step times too noisy to be known within 2 %: every limit gets its profile_steps."""
    mon = FakeMonitor(noise=0.3)
    opt = make_opt(mon, wait_steps=0, warmup_steps=1, profile_steps=8, pl_step=250, adaptive=True)
    step(opt, mon, 10)
    assert snap(opt) == ("Warmup", 450, 1)
    assert [e.steps for e in mon.events if e.state == "measured"] == [8]


# -- 6. real processes ----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=root if not path else f"{root}{os.pathsep}{path}",
    )


@pytest.mark.slow
def test_sigterm_restores_the_maximum_limit(tmp_path: Path) -> None:
    recording = tmp_path / "run.zarc"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "sigterm", str(recording)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("profiling "), (line, proc.stderr.read() if proc.stderr else "")
        limit = int(line.split()[1])
        assert limit < 700
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The optimizer's handler restored, then exited as SIGTERM would (128 + 15), through
    # SystemExit: the monitor closed and wrote the recording's last frame.
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "not signalled" not in out
    assert "Traceback" not in err, err

    reader = RecordingReader(recording)
    events = list(reader)
    assert reader.report.clean, reader.report
    changes = [e for e in events if isinstance(e, PowerLimitChange)]
    assert {c.gpu for c in changes} == {0, 1}
    for gpu in (0, 1):
        mine = [c for c in changes if c.gpu == gpu]
        assert any(c.power_limit_w == limit for c in mine)  # it was profiling below max
        last = mine[-1]
        assert last.power_limit_w == 700.0 and "restore" in last.source
        assert last.previous_w == float(limit)
    states = [e.state for e in events if isinstance(e, OptimizerState)]
    assert states[0] == "ready" and "profiling" in states and states[-1] == "restored"


def _run_ranks(*options: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two ``plo_procs.py rank`` processes over gloo; their JSON outputs, rank 0 first."""
    pytest.importorskip("torch")
    outs = run_ranks([sys.executable, str(SCRIPT), "rank", *options], _env())
    r0, r1 = (json.loads(out.strip().splitlines()[-1]) for out in outs)
    assert (r0["rank"], r1["rank"]) == (0, 1)
    return r0, r1


def _combined(limits: Sequence[int]) -> list[tuple[int, float, float]]:
    """The measurements both ranks must hold: energy summed, time the maximum, over the 4
    profiled steps (rank 0: t = 0.1 + (300-pl)/1000, e = pl/10 per step; rank 1:
    t = 0.15 + (300-pl)/2000, e = pl/20 + 1)."""
    want = []
    for pl in limits:
        e0, t0 = 4 * pl / 10, 4 * (0.10 + (300 - pl) / 1000)
        e1, t1 = 4 * (pl / 20 + 1), 4 * (0.15 + (300 - pl) / 2000)
        want.append((pl, e0 + e1, max(t0, t1)))
    return want


# Built before the process group (Lightning creates it in trainer.fit()) or after.
@pytest.mark.slow
@pytest.mark.parametrize("order", ["group-first", "group-after"])
def test_two_ranks_over_gloo_combine_measurements(order: str, tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"  # the same path on both ranks: one job profile
    options = [f"profile={profile}", *(["group-after"] if order == "group-after" else [])]
    r0, r1 = _run_ranks(*options)
    saved = msgspec.json.decode(profile.read_bytes(), type=PowerLimitProfile)
    assert msgspec.to_builtins(saved.measurements) == r0["measurements"]
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]
    assert r0["measurements"] == r1["measurements"]
    got = [(m["power_limit"], m["energy"], m["time"]) for m in r0["measurements"]]
    want = _combined((300, 200, 100))
    assert got == [(pl, pytest.approx(e), pytest.approx(t)) for pl, e, t in want]
    # The max comes from rank 1 at 300 W and from rank 0 at 100 W.
    assert got[0][2] == pytest.approx(0.6) and got[2][2] == pytest.approx(1.2)
    # The training steps' own collectives were never mixed up with the optimizer's, though
    # rank 1's results resolved two steps later than rank 0's.
    assert r0["grad_mismatches"] == r1["grad_mismatches"] == 0
    # The default selector weighs time by the job's maximum power: both ranks' GPUs.
    selector = ZeusCost(0.5, world_size=2)
    assert r0["optimal"] == r1["optimal"] == selector.select([M(*w) for w in want])
    assert r0["profiling_steps"] == r1["profiling_steps"] == 3 * 5


@pytest.mark.slow
def test_a_rank_without_a_measurement_does_not_hang_the_others() -> None:
    # Rank 1 loses its measurement at 200 W: both ranks leave that limit out and agree.
    r0, r1 = _run_ranks("fail=1:200")
    assert r0["measurements"] == r1["measurements"]
    assert [m["power_limit"] for m in r0["measurements"]] == [300, 100]
    want = _combined((300, 100))
    assert (
        r0["optimal"] == r1["optimal"] == ZeusCost(0.5, world_size=2).select([M(*w) for w in want])
    )
    assert r0["grad_mismatches"] == r1["grad_mismatches"] == 0


@pytest.mark.parametrize(
    ("backend", "cuda", "device"),
    [
        ("gloo", None, "cpu"),
        ("gloo", 3, "cpu"),
        ("nccl", 3, "cuda:3"),
        ("cpu:gloo,cuda:nccl", 1, "cpu"),
        ("mpi", None, "cpu"),
        ("NCCL", 0, "cuda:0"),
    ],
)
def test_collectives_run_on_the_device_the_backend_needs(
    backend: str, cuda: int | None, device: str
) -> None:
    assert collective_device(backend, cuda) == device


def test_an_nccl_group_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no CPU collectives"):
        collective_device("nccl", None)


def test_adaptive_warmup_ends_once_two_steps_agree(
    make_opt: Callable[..., GlobalPowerLimitOptimizer],
) -> None:
    mon = FakeMonitor(noise=0.005)
    opt = make_opt(mon, wait_steps=0, warmup_steps=10, profile_steps=20, adaptive=True)
    _until_decided(opt, mon)
    settled = mon.events_of("settled")
    # The fake GPU settles at once: the second and third warmup steps get windows, and the
    # warmup ends at the fourth call, when both are in and agree — not after 10 steps.
    assert settled and all(e.steps == 3 for e in settled)
    # (every warmup but the one the descent stopped in)
    assert len(settled) == len([e for e in mon.events if e.state == "warmup"]) - 1
    warm = [c for c in mon.window_calls if c[1].startswith("__plo_warm_")]
    assert warm and all(c[2] is False for c in warm if c[0] == "end")


@pytest.mark.slow
def test_states_and_limits_reach_the_stream_of_a_real_monitor(tmp_path: Path) -> None:
    """Through a real monitor (sampler process), every state change and chosen limit is on the
    monitor's stream: here read back from its recording, as a subscriber would see them."""
    from zeus_async.events import PowerLimitChange
    from zeus_async.store import RecordingReader

    path = tmp_path / "plo.zarc"
    with Monitor(backend="sim", sync_execution_with=None, gpu_indices=[0], record=path) as mon:
        opt = GlobalPowerLimitOptimizer(
            mon, Energy(), wait_steps=0, warmup_steps=1, profile_steps=2, pl_step=250
        )
        for _ in range(200):
            if opt.optimal_power_limit is not None:
                break
            opt.on_step_begin()
            threading.Event().wait(0.02)
        chosen = opt.wait_done(10)
        opt.close()
    events = list(RecordingReader(path))
    states = [(e.state, e.power_limit_w) for e in events if isinstance(e, OptimizerState)]
    assert states[0] == ("ready", 700.0)
    assert ("warmup", 450.0) in states and ("profiling", 200.0) in states
    assert ("done", float(chosen)) in states and states[-1] == ("restored", 700.0)
    limits = [(e.power_limit_w, e.source) for e in events if isinstance(e, PowerLimitChange)]
    # Start at the max (also the first limit), then down; back at the max while deciding.
    expected = [700.0, 450.0, 200.0, 700.0]
    if chosen != 700:
        expected.append(float(chosen))
    assert [w for w, _ in limits] == [*expected, 700.0]
    assert limits[-1] == (700.0, "power_limit: restore")


def test_adaptive_estimates_leave_out_stalled_steps() -> None:
    from zeus_async.optimizer.power_limit import OUTLIER_FACTOR, _StepStats

    stats = _StepStats()
    stats.steps = [(0.030, 21.0)] * 7 + [(0.031, 21.7)] * 2 + [(0.130, 91.0)]  # one stall
    t_run, e_run, outliers = stats.kept()
    assert outliers == 1 and t_run.n == 9
    assert t_run.mean == pytest.approx((7 * 0.030 + 2 * 0.031) / 9)
    assert e_run.mean == pytest.approx((7 * 21.0 + 2 * 21.7) / 9)
    dt, de = stats.relative_half_widths()
    assert dt < 0.02 and de < 0.02  # the stall does not blow the confidence interval up
    assert OUTLIER_FACTOR * 0.030 < 0.130


@pytest.mark.slow
def test_interpreter_exit_restores_the_maximum_before_the_monitor_closes(tmp_path: Path) -> None:
    """Neither the optimizer nor the monitor is closed by the program: at exit the optimizer
    restores the maximum limit first, then the monitor closes and flushes its recording."""
    import subprocess
    import sys

    from zeus_async.store import RecordingReader

    path = tmp_path / "exit.zarc"
    script = (
        "import time\n"
        "from zeus_async import Monitor\n"
        "from zeus_async.optimizer import GlobalPowerLimitOptimizer, Profiling\n"
        f"m = Monitor(backend='sim', gpu_indices=[0], record={str(path)!r},"
        " sync_execution_with=None)\n"
        "o = GlobalPowerLimitOptimizer(m, wait_steps=0, warmup_steps=1, profile_steps=50,"
        " pl_step=250)\n"
        "for _ in range(3):\n"
        "    o.on_step_begin(); time.sleep(0.02)\n"
        "assert isinstance(o.state, Profiling)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "could not restore" not in proc.stderr
    events = list(RecordingReader(path))
    limits = [(e.power_limit_w, e.source) for e in events if isinstance(e, PowerLimitChange)]
    assert limits[-1] == (700.0, "power_limit: restore")


def test_the_choice_is_said_as_zeus_says_it_with_logging_left_unconfigured() -> None:
    """Zeus prints "Optimal power limit is X W"; a script that configured no logging sees the
    same line (it was an INFO record nobody saw)."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from zeus_async import Monitor\n"
        "from zeus_async.optimizer import GlobalPowerLimitOptimizer\n"
        "m = Monitor(backend='sim', gpu_indices=[0], cpu_indices=[], sync_execution_with=None)\n"
        "o = GlobalPowerLimitOptimizer(m, wait_steps=0, warmup_steps=1, profile_steps=3,"
        " pl_step=250)\n"
        "while o.optimal_power_limit is None:\n"
        "    o.on_step_begin(); time.sleep(0.01)\n"
        "print('chosen', o.optimal_power_limit)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    chosen = int(proc.stdout.split()[-1])
    assert f"Optimal power limit is {chosen} W" in proc.stderr.splitlines(), proc.stderr
