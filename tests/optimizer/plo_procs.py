"""Processes for the power-limit optimizer's multi-process tests.

``python plo_procs.py sigterm RECORDING``
    A simulated two-GPU monitor (thread sampler) recording to RECORDING, and an optimizer that
    is soon profiling below the maximum limit: prints ``profiling`` then, and keeps stepping
    (10 ms per step) until a signal ends it. The optimizer's signal handler restores the limit.

``python plo_procs.py rank [group-after] [fail=RANK:LIMIT]``
    One rank of a two-rank gloo job (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``
    in the environment) optimizing with a fake monitor whose energy and time depend on the rank
    and the limit; prints ``{"rank": R, "optimal": W, "measurements": [...]}`` as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec

from zeus_async.events import DeviceInfo, Measurement


def sigterm(recording: str) -> None:
    from zeus_async import Monitor
    from zeus_async.devices.sim_config import SimConfig
    from zeus_async.optimizer import GlobalPowerLimitOptimizer, Profiling

    # ``with``: the monitor closes (and flushes the recording) as the SystemExit raised by the
    # optimizer's SIGTERM handler unwinds. (Closing it from atexit instead loses the recording:
    # the recorder's aiofiles executor is already shut down then.)
    with Monitor(
        backend="sim",
        sampler="thread",
        record=recording,
        sync_execution_with=None,
        sim_config=SimConfig(num_gpus=2),
    ) as monitor:
        opt = GlobalPowerLimitOptimizer(
            monitor, wait_steps=0, warmup_steps=1, profile_steps=5, pl_step=100
        )
        said = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            opt.on_step_begin()
            state = opt.state
            if (
                not said
                and isinstance(state, Profiling)
                and state.steps > 0
                and state.current_power_limit < opt.max_power_limit
            ):
                print("profiling", state.current_power_limit, flush=True)
                said = True
            time.sleep(0.01)
    print("not signalled", flush=True)


def _done(value: Any = None) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class _Result:
    """A window result that is ``done()`` from the monitor's step ``ready_at`` on (as a real
    one resolves a little after the window ends); ``wait()`` returns at once (a real one would
    block those ~0.2 s)."""

    def __init__(self, monitor: RankMonitor, m: Measurement, ready_at: int) -> None:
        self._monitor = monitor
        self._m = m
        self._ready_at = ready_at

    def done(self) -> bool:
        return self._monitor.steps >= self._ready_at

    def wait(self, timeout: float | None = None) -> Measurement:
        return self._m


class RankMonitor:
    """One GPU (100-300 W); a window's time and energy are ``per_step(limit)`` times its steps;
    results resolve ``delay`` steps after the window ends."""

    def __init__(self, per_step: Callable[[int], tuple[float, float]], delay: int) -> None:
        self.per_step = per_step
        self.delay = delay
        self.gpu_indices = [0]
        self.gpu_devices = [
            DeviceInfo("gpu:0", "fake", power_limit_min_w=100.0, power_limit_max_w=300.0)
        ]
        self.limit = 300
        self.steps = 0
        self.open: dict[str, int] = {}

    def set_power_limit(self, watts: float, gpus: Any = None, *, source: str = "") -> Future[Any]:
        self.limit = int(watts)
        return _done()

    def publish(self, event: Any) -> Future[Any]:
        return _done()

    def begin_window(self, name: str, sync_execution: bool = True, restart: bool = False) -> None:
        self.open[name] = self.steps

    def end_window(self, name: str, sync_execution: bool = True, cancel: bool = False) -> _Result:
        steps = self.steps - self.open.pop(name)
        t, e = self.per_step(self.limit)
        m = Measurement("h", 0, name, 0, 0, 0, t * steps, {0: e * steps})
        return _Result(self, m, self.steps + self.delay)


class _Failed:
    """A window result whose measurement failed (the GPU was lost, say)."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> Measurement:
        raise RuntimeError("gpu:0 was lost")


class FailingMonitor(RankMonitor):
    """A :class:`RankMonitor` whose window at ``fail_limit`` has no measurement."""

    def __init__(self, *args: Any, fail_limit: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_limit = fail_limit

    def end_window(self, name: str, sync_execution: bool = True, cancel: bool = False) -> Any:
        result = super().end_window(name, sync_execution, cancel)
        return _Failed() if self.limit == self.fail_limit and not cancel else result


def rank(options: list[str]) -> None:
    """``rank [group-after] [fail=RANK:LIMIT] [profile=PATH]``: ``group-after`` builds the
    optimizer before the process group exists (Lightning's order); ``fail`` loses RANK's
    measurement at LIMIT; ``profile`` is the optimizer's ``profile_path`` on every rank."""
    import torch
    import torch.distributed as dist

    from zeus_async.optimizer import GlobalPowerLimitOptimizer

    r = int(os.environ["RANK"])
    fail = next((o.removeprefix("fail=") for o in options if o.startswith("fail=")), None)
    fail_rank, fail_limit = (int(x) for x in fail.split(":")) if fail else (-1, 0)
    group_after = "group-after" in options
    profile = next((o.removeprefix("profile=") for o in options if o.startswith("profile=")), None)
    if not group_after:
        dist.init_process_group("gloo", init_method="env://")
    # Rank 0 is faster and hungrier, its results resolve at once; rank 1 is slower and frugal,
    # its results resolve 2 steps late: sums and maxima differ from both ranks' own figures.
    per_step: Callable[[int], tuple[float, float]]
    if r == 0:
        per_step, delay = (lambda pl: (0.10 + (300 - pl) / 1000, pl / 10)), 0
    else:
        per_step, delay = (lambda pl: (0.15 + (300 - pl) / 2000, pl / 20 + 1)), 2
    monitor = (
        FailingMonitor(per_step, delay, fail_limit=fail_limit)
        if r == fail_rank
        else RankMonitor(per_step, delay)
    )
    opt = GlobalPowerLimitOptimizer(
        monitor,  # type: ignore[arg-type]
        wait_steps=0,
        warmup_steps=1,
        profile_steps=4,
        pl_step=100,
        profile_path=profile,
        restore_on_signals=False,
    )
    if group_after:
        dist.init_process_group("gloo", init_method="env://")
    grad_mismatches = 0
    for _ in range(40):
        opt.on_step_begin()
        # The training step's own collective (DDP's gradient all-reduce): the optimizer's
        # collectives must not interleave with it differently on different ranks.
        grad = torch.tensor([float(r + 1)], dtype=torch.float64)
        dist.all_reduce(grad)
        grad_mismatches += grad.item() != 3.0
        monitor.steps += 1
    optimal = opt.wait_done(timeout=20)
    opt.close()
    out = {
        "rank": r,
        "optimal": optimal,
        "grad_mismatches": grad_mismatches,
        "profiling_steps": opt.profiling_step_count,
        "measurements": msgspec.to_builtins(opt.measurements),
    }
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "sigterm":
        sigterm(sys.argv[2])
    elif sys.argv[1] == "rank":
        rank(sys.argv[2:])
    else:
        raise SystemExit(f"unknown command {sys.argv[1:]!r}")
