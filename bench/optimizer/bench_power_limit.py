"""Power-limit optimization: zeus_async ``GlobalPowerLimitOptimizer`` vs Zeus 0.16's, same GPUs.

Each run is a fresh process training a synthetic loop on one simulated H100 (the simulator
installed as ``pynvml``, so Zeus drives it unchanged; our monitor samples it on a thread of
the same process). A step is ``WORK_S`` seconds of full-speed GPU work, slept for as long as the
simulator says it takes at the power limit in force — so lowering the limit really slows the
steps and saves energy, for both optimizers alike. For every selector (Energy, Time,
ZeusCost η ∈ {0, 0.5, 1}, MaxSlowdownConstraint(1.1)) it runs Zeus, ours, and ours with
``adaptive=True``, and prints the chosen limits, the steps spent warming up and profiling, and
the cost of ``on_step_begin`` on the training thread.

Run: ``bench/.venv/bin/python bench/optimizer/bench_power_limit.py [--pl-step 50] [--json PATH]``
(``bench/.venv`` has ``zeus==0.16.0``; see bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SELECTORS = ["energy", "time", "zeus0", "zeus0.5", "zeus1", "slowdown1.1"]
IMPLS = ["zeus", "ours", "ours-adaptive"]
#: Full-speed GPU work per step (s) and the simulated energy counter's update period (s): Zeus
#: reads the counter at the window edges only, so with H100's 100 ms updates a 40-step profile
#: of short steps is off by up to a counter period of energy at each edge — enough to change
#: its choice. A 10 ms counter and 30 ms steps let both optimizers measure within ~1 %, so a
#: difference in choice is a difference in the optimizer, not in the measurement.
WORK_S = 0.03
COUNTER_PERIOD_S = 0.01


def make_selector(name: str, impl: str) -> Any:
    if impl == "zeus":
        from zeus.optimizer.power_limit import Energy, MaxSlowdownConstraint, Time, ZeusCost
    else:
        from zeus_async.optimizer import Energy, MaxSlowdownConstraint, Time, ZeusCost
    if name == "energy":
        return Energy()
    if name == "time":
        return Time()
    if name.startswith("zeus"):
        return ZeusCost(eta_knob=float(name[4:]), world_size=1)
    return MaxSlowdownConstraint(factor=float(name[8:]))


def precise_sleep(seconds: float) -> None:
    """Sleep, then spin the last 2 ms: step times exact to microseconds, not to the VM's
    scheduler (whose oversleep would add ~1 % noise to every profile)."""
    deadline = time.perf_counter() + seconds
    if seconds > 0.002:
        time.sleep(seconds - 0.002)
    while time.perf_counter() < deadline:
        pass


def build(
    impl: str, selector: Any, config: Any, warmup: int, profile: int, pl_step: int
) -> tuple[Any, Any, Callable[[], bool]]:
    """The optimizer under test, its monitor (ours; ``None`` for Zeus, whose monitor needs no
    closing) and a ``done()`` test that is true once it has stopped profiling."""
    if impl == "zeus":
        from zeus.monitor import ZeusMonitor
        from zeus.optimizer.power_limit import Done, GlobalPowerLimitOptimizer

        class NoSyncZeusMonitor(ZeusMonitor):  # type: ignore[misc]
            """No GPU to synchronize here (torch is CPU-only): like our sync_execution_with=None."""

            def begin_window(self, key: str, sync_execution: bool = True) -> None:
                super().begin_window(key, sync_execution=False)

            def end_window(
                self, key: str, sync_execution: bool = True, cancel: bool = False
            ) -> Any:
                return super().end_window(key, sync_execution=False, cancel=cancel)

        zeus_opt = GlobalPowerLimitOptimizer(
            NoSyncZeusMonitor(gpu_indices=[0], cpu_indices=[], approx_instant_energy=True),
            selector,
            warmup_steps=warmup,
            profile_steps=profile,
            pl_step=pl_step,
        )
        return zeus_opt, None, lambda: isinstance(zeus_opt.state, Done)
    from zeus_async import Monitor
    from zeus_async.optimizer import GlobalPowerLimitOptimizer as Ours

    # The default monitor: sampling (and limit changes) in a child process, which builds the
    # same simulated node. The caller's copy of the node only times the steps.
    monitor = Monitor(
        gpu_indices=[0], cpu_indices=[], backend="sim", sim_config=config, sync_execution_with=None
    )
    ours = Ours(
        monitor,
        selector,
        warmup_steps=warmup,
        profile_steps=profile,
        pl_step=pl_step,
        adaptive=impl == "ours-adaptive",
    )
    return ours, monitor, lambda: ours.optimal_power_limit is not None or ours._deciding


def run_one(impl: str, selector: str, pl_step: int, warmup: int, profile: int) -> dict[str, Any]:
    """One optimization in this process; returns its figures."""
    from zeus_async.devices.sim_config import SimConfig
    from zeus_async.devices.sim_workload import ConstantWorkload
    from zeus_async.testing import sim_pynvml

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("zeus").setLevel(logging.ERROR)
    config = SimConfig(
        num_gpus=1,
        workload=ConstantWorkload(util=1.0),
        seed=3,
        counter_period_s=COUNTER_PERIOD_S,
    )
    node = sim_pynvml.install(config=config)
    sim_pynvml.install_as_pynvml()
    opt, monitor, done = build(
        impl, make_selector(selector, impl), config, warmup, profile, pl_step
    )
    if impl == "zeus":
        from zeus.optimizer.power_limit import Profiling, Warmup

    costs: list[float] = []
    counted = 0
    measured = 0
    mirrored: int | None = None
    t_start = time.perf_counter()
    for _ in range(100_000):
        if impl == "zeus" and isinstance(opt.state, (Warmup, Profiling)):
            counted += 1
            measured += isinstance(opt.state, Profiling)
        t0 = time.perf_counter()
        opt.on_step_begin()
        costs.append(time.perf_counter() - t0)
        if done():
            break
        if impl != "zeus" and opt.current_power_limit != mirrored:
            mirrored = opt.current_power_limit
            node.gpus[0].set_power_limit_w(float(mirrored))
        precise_sleep(node.work_duration_s(0, WORK_S))
    wall = time.perf_counter() - t_start
    if impl == "zeus":
        chosen = opt.state.optimal_power_limit // 1000
        measurements = [(m.power_limit, m.energy, m.time) for m in opt.measurements]
    else:
        chosen = opt.wait_done(60)
        counted = opt.profiling_step_count
        measured = opt.measured_step_count
        measurements = [(m.power_limit, m.energy, m.time) for m in opt.measurements]
        opt.close()
        monitor.close()
    return {
        "impl": impl,
        "selector": selector,
        "chosen_w": chosen,
        "profiling_steps": counted,
        "measured_steps": measured,
        "step_begin_mean_us": statistics.fmean(costs) * 1e6,
        "step_begin_p50_us": statistics.median(costs) * 1e6,
        "step_begin_max_us": max(costs) * 1e6,
        "wall_s": wall,
        "measurements": measurements,
    }


class _Scripted:
    """Fake monitors for the same-inputs check: window ``__..._<limit>`` measures
    ``profiles[limit]`` (energy J, time s), whatever the clock says."""

    def __init__(self, profiles: dict[int, tuple[float, float]]) -> None:
        self.profiles = profiles
        self.gpu_indices = [0]

    def _limit(self, key: str) -> int:
        return int(key.rsplit("_", 1)[1])

    def begin_window(self, key: str, sync_execution: bool = True, restart: bool = False) -> None:
        pass


class ScriptedZeus(_Scripted):
    def end_window(self, key: str, sync_execution: bool = True, cancel: bool = False) -> Any:
        from zeus.monitor.energy import Measurement

        energy, elapsed = self.profiles[self._limit(key)]
        return Measurement(time=elapsed, gpu_energy={0: energy}, cpu_energy=None)


class ScriptedOurs(_Scripted):
    def __init__(self, profiles: dict[int, tuple[float, float]]) -> None:
        from zeus_async.events import DeviceInfo

        super().__init__(profiles)
        self.gpu_devices = [
            DeviceInfo("gpu:0", "sim", power_limit_min_w=200.0, power_limit_max_w=700.0)
        ]

    def set_power_limit(self, watts: float, gpus: Any = None, *, source: str = "") -> Any:
        return _done_future()

    def publish(self, event: Any) -> Any:
        return _done_future()

    def end_window(self, key: str, sync_execution: bool = True, cancel: bool = False) -> Any:
        from zeus_async.aggregate.windows import WindowResult
        from zeus_async.events import Measurement

        energy, elapsed = self.profiles.get(self._limit(key), (1.0, 1.0))
        result = WindowResult(key, 0, 0, round(elapsed * 1e9))
        result._resolve(Measurement("h", 0, key, 0, 0, round(elapsed * 1e9), elapsed, {0: energy}))
        return result


def _done_future() -> Any:
    from concurrent.futures import Future

    f: Future[None] = Future()
    f.set_result(None)
    return f


def step_cost(impl: str, pl_step: int, warmup: int, profile: int) -> dict[str, float]:
    """CPU cost of ``on_step_begin`` in a hot loop: a whole optimization with zero-length steps
    (the GPU stays simulated), timed per call beside an empty call in the same loop."""
    from zeus_async.devices.sim_config import SimConfig
    from zeus_async.testing import sim_pynvml

    logging.basicConfig(level=logging.ERROR)
    config = SimConfig(num_gpus=1, seed=3)
    sim_pynvml.install(config=config)
    sim_pynvml.install_as_pynvml()
    logging.getLogger("zeus").setLevel(logging.ERROR)
    opt, monitor, done = build(
        impl, make_selector("zeus0.5", impl), config, warmup, profile, pl_step
    )

    def noop() -> None:
        pass

    calls: list[float] = []
    empty: list[float] = []
    clock = time.perf_counter
    while not done():
        t0 = clock()
        noop()
        t1 = clock()
        opt.on_step_begin()
        t2 = clock()
        empty.append(t1 - t0)
        calls.append(t2 - t1)
    if monitor is not None:
        opt.close()
        monitor.close()
    return {
        "steps": len(calls),
        "mean_us": statistics.fmean(calls) * 1e6,
        "p50_us": statistics.median(calls) * 1e6,
        "empty_mean_us": statistics.fmean(empty) * 1e6,
    }


def same_inputs(trials: int, pl_step: int) -> dict[str, Any]:
    """Drive Zeus's and our optimizer with identical scripted measurements (random profiles,
    energy U-shaped in the limit, time rising as it drops, plus noise); count agreements."""
    import random

    from zeus_async.devices.sim_config import SimConfig
    from zeus_async.optimizer import GlobalPowerLimitOptimizer as Ours
    from zeus_async.testing import sim_pynvml

    sim_pynvml.install(config=SimConfig(num_gpus=1))
    sim_pynvml.install_as_pynvml()  # before Zeus imports pynvml
    from zeus.optimizer.power_limit import Done as ZeusDone
    from zeus.optimizer.power_limit import GlobalPowerLimitOptimizer as ZeusOpt

    logging.getLogger("zeus").setLevel(logging.ERROR)
    logging.getLogger("zeus_async").setLevel(logging.ERROR)
    rng = random.Random(7)
    limits = list(range(700, 199, -pl_step))
    agree: dict[str, int] = dict.fromkeys(SELECTORS, 0)
    for _ in range(trials):
        knee = rng.uniform(200, 700)
        noise = rng.uniform(0.0, 0.05)
        profiles = {}
        for p in limits:
            t = 1.0 + rng.uniform(0.1, 1.0) * max(0.0, (knee - p) / 500) ** 1.5
            t *= 1 + rng.uniform(-noise, noise)
            e = p * t * (0.6 + rng.uniform(0, 0.4)) * (1 + rng.uniform(-noise, noise))
            profiles[p] = (e, t)
        for name in SELECTORS:
            z = ZeusOpt(ScriptedZeus(profiles), make_selector(name, "zeus"), pl_step=pl_step)
            o = Ours(
                ScriptedOurs(profiles),
                make_selector(name, "ours"),
                pl_step=pl_step,
                restore_on_signals=False,
            )
            while not isinstance(z.state, ZeusDone):
                z.on_step_begin()
            while o.optimal_power_limit is None:
                o.on_step_begin()
                if o._deciding:
                    o.wait_done(10)
            o.close()
            agree[name] += z.state.optimal_power_limit // 1000 == o.optimal_power_limit
    return {"trials": trials, "agree": agree}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pl-step", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--profile", type=int, default=40)
    parser.add_argument("--selectors", default=",".join(SELECTORS))
    parser.add_argument("--impls", default=",".join(IMPLS), help=argparse.SUPPRESS)
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per optimizer and selector (majority kept)"
    )
    parser.add_argument("--one", nargs=2, metavar=("IMPL", "SELECTOR"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--same-inputs", type=int, default=0, metavar="N", help="only the same-inputs check"
    )
    parser.add_argument("--step-cost", action="store_true", help="only the hot-loop cost")
    parser.add_argument("--cost-one", metavar="IMPL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cost_one:
        print(json.dumps(step_cost(args.cost_one, args.pl_step, args.warmup, args.profile)))
        return 0
    if args.step_cost:
        print("\n### on_step_begin in a hot loop (zero-length steps, a whole optimization)\n")
        print("| optimizer | steps | mean µs | p50 µs | empty call, same loop, mean µs |")
        print("|---|---:|---:|---:|---:|")
        for impl in IMPLS:
            proc = subprocess.run(
                [sys.executable, __file__, "--cost-one", impl, "--pl-step", str(args.pl_step)],
                capture_output=True,
                text=True,
                check=True,
            )
            c = json.loads(proc.stdout.strip().splitlines()[-1])
            print(
                f"| {impl} | {c['steps']:.0f} | {c['mean_us']:.2f} | {c['p50_us']:.2f} "
                f"| {c['empty_mean_us']:.2f} |"
            )
        return 0
    if args.same_inputs:
        out = same_inputs(args.same_inputs, args.pl_step)
        print(f"\n### Same inputs: {out['trials']} random profiles per selector\n")
        print("| selector | identical choices |\n|---|---:|")
        for name, n in out["agree"].items():
            print(f"| {name} | {n}/{out['trials']} |")
        return 0
    if args.one:
        out = run_one(args.one[0], args.one[1], args.pl_step, args.warmup, args.profile)
        print(json.dumps(out))
        return 0
    results: list[dict[str, Any]] = []
    for rep in range(args.repeat):
        for selector in args.selectors.split(","):
            for impl in args.impls.split(","):
                proc = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        impl,
                        selector,
                        "--pl-step",
                        str(args.pl_step),
                        "--warmup",
                        str(args.warmup),
                        "--profile",
                        str(args.profile),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                r = results[-1]
                print(
                    f"  run {rep + 1}: {selector:<12} {impl:<14} -> {r['chosen_w']} W",
                    file=sys.stderr,
                )
    print(
        f"\n### Power-limit optimization, 1 simulated H100, {WORK_S * 1e3:g} ms of GPU work per "
        f"step, energy counter every {COUNTER_PERIOD_S * 1e3:g} ms, limits 700..200 W by "
        f"{args.pl_step} W, warmup {args.warmup}, profile {args.profile}, "
        f"{args.repeat} runs each\n"
    )
    print(
        "| selector | Zeus 0.16 | ours | ours adaptive | warmup+profile steps Zeus / ours / "
        "adaptive (mean) | adaptive/Zeus | profiled steps Zeus / adaptive | adaptive/Zeus |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|")

    def runs(selector: str, impl: str) -> list[dict[str, Any]]:
        return [r for r in results if r["selector"] == selector and r["impl"] == impl]

    def choices(rs: list[dict[str, Any]]) -> str:
        picks = [r["chosen_w"] for r in rs]
        majority = max(set(picks), key=picks.count)
        return f"**{majority}** ({'/'.join(map(str, picks))})"

    def mean(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.fmean(r[key] for r in rs)

    for selector in args.selectors.split(","):
        z, o, a = (runs(selector, i) for i in IMPLS)
        zs, os_, as_ = (mean(x, "profiling_steps") for x in (z, o, a))
        zm, am = mean(z, "measured_steps"), mean(a, "measured_steps")
        print(
            f"| {selector} | {choices(z)} | {choices(o)} | {choices(a)} "
            f"| {zs:.0f} / {os_:.0f} / {as_:.0f} | {as_ / zs:.2f}x "
            f"| {zm:.0f} / {am:.0f} | {am / zm:.2f}x |"
        )
    print("\n| on_step_begin on the training thread | mean µs | p50 µs | max µs |")
    print("|---|---:|---:|---:|")
    for impl in IMPLS:
        rs = [r for r in results if r["impl"] == impl]
        print(
            f"| {impl} | {statistics.fmean(r['step_begin_mean_us'] for r in rs):.1f} "
            f"| {statistics.median(r['step_begin_p50_us'] for r in rs):.1f} "
            f"| {max(r['step_begin_max_us'] for r in rs):.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
