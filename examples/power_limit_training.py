"""Find the optimal GPU power limit while training: just-in-time profiling on a simulated GPU.

    python examples/power_limit_training.py --selector zeus [--adaptive]

Trains a small PyTorch MLP on CPU with synthetic data, against one simulated H100 (so it runs
anywhere and may change power limits without root). The simulated GPU is kept busy all the
time; each step also "runs on the GPU": it waits as long as the simulator says the step's GPU
work takes at the current power limit, so lower limits draw less power but make steps slower.
The optimizer profiles the limits from 700 W down in 100 W steps, picks one with the chosen
selector, and training stops once it is in force.
"""

from __future__ import annotations

import argparse
import time

import torch

from zeus_async import Monitor
from zeus_async.devices.sim_config import SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload
from zeus_async.optimizer import (
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    OptimumSelector,
    Profiling,
    Time,
    ZeusCost,
)
from zeus_async.testing import sim_pynvml

#: Seconds of full-speed GPU work per training step.
WORK_S = 0.02


def make_selector(name: str, eta: float, slowdown: float) -> OptimumSelector:
    if name == "energy":
        return Energy()
    if name == "time":
        return Time()
    if name == "slowdown":
        return MaxSlowdownConstraint(slowdown)
    return ZeusCost(eta)


def make_step() -> object:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a tiny model: threads would only add jitter to the step time
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        node = sim_pynvml.current_node()  # the simulated GPU "runs" the step's kernels
        assert node is not None
        time.sleep(node.work_duration_s(0, WORK_S))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--selector", choices=["energy", "time", "zeus", "slowdown"], default="zeus"
    )
    parser.add_argument("--eta", type=float, default=0.5, help="ZeusCost's eta knob")
    parser.add_argument("--slowdown", type=float, default=1.1, help="max slowdown factor")
    parser.add_argument("--adaptive", action="store_true", help="profile adaptively")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    args = parser.parse_args()

    step = make_step()
    selector = make_selector(args.selector, args.eta, args.slowdown)
    config = SimConfig(num_gpus=1, workload=ConstantWorkload(util=1.0), seed=3)
    with (
        Monitor(backend="sim", sampler="thread", sync_execution_with=None, sim_config=config) as m,
        GlobalPowerLimitOptimizer(
            m, selector, warmup_steps=2, profile_steps=8, pl_step=100, adaptive=args.adaptive
        ) as optimizer,
    ):
        limits = ", ".join(str(w) for w in optimizer.power_limits)
        print(f"profiling power limits {limits} W with {type(selector).__name__}")
        t0 = time.perf_counter()
        steps = 0
        for _epoch in range(args.epochs):
            for _ in range(args.steps_per_epoch):
                optimizer.on_step_begin()
                step()  # type: ignore[operator]
                steps += 1
                if optimizer.optimal_power_limit is not None:
                    break
            optimizer.on_epoch_end()
            if optimizer.optimal_power_limit is not None:
                break
        # The choice is made in the background as soon as the last profile is in.
        state = optimizer.state
        if isinstance(state, Profiling) and state.steps == 0:
            optimizer.wait_done(timeout=5.0)
        chosen = optimizer.optimal_power_limit
        elapsed = time.perf_counter() - t0

    print(f"trained {steps} steps in {elapsed:.2f} s")
    print(f"{'limit W':>8} {'energy J':>10} {'time s':>8}")
    for ms in optimizer.measurements:
        print(f"{ms.power_limit:8d} {ms.energy:10.2f} {ms.time:8.3f}")
    print(f"profiling steps: {optimizer.profiling_step_count}")
    if chosen is None:
        print("chosen power limit: none (profiling unfinished: more --epochs?)")
        raise SystemExit(1)
    print(f"chosen power limit: {chosen} W")


if __name__ == "__main__":
    main()
