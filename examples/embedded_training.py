"""Embed zeus_async in a training script: a window per step, sampling on a background thread.

    python examples/embedded_training.py --steps 200

Uses real GPUs when an NVIDIA driver is present, simulated H100s otherwise. The training
loop below is a small PyTorch MLP on CPU when torch is installed, and plain Python arithmetic
otherwise, so the example runs anywhere. While it trains, every sample and every window's
measurement is also published on ZeroMQ (watch with
``zeus-async subscribe tcp://127.0.0.1:5557 --topic window/``).
"""

from __future__ import annotations

import argparse
import time

from zeus_async import Monitor


def make_step() -> tuple[str, object]:
    try:
        import torch
    except ImportError:

        def step() -> None:
            sum(i * i for i in range(20_000))

        return "pure Python", step

    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))

    def torch_step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return "torch MLP", torch_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--publish", default="tcp://127.0.0.1:5557")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")

    kind, step = make_step()
    with Monitor(publish=args.publish) as monitor:
        print(f"measuring GPUs {monitor.gpu_indices}; training a {kind} for {args.steps} steps")
        monitor.begin_window("training")
        results = []
        t0 = time.perf_counter()
        for i in range(args.steps):
            with monitor.window(f"step-{i}") as w:  # edges cost microseconds
                step()  # type: ignore[operator]
            results.append(w.result)
        elapsed = time.perf_counter() - t0
        total = monitor.end_window("training")
        # Read now, a window's figures are provisional (from the latest power readings) until
        # the exact, counter-based ones arrive ~0.1 s after its end; closing the monitor
        # waits for those, so below they are exact.
    per_step = [r.total_energy for r in results if r is not None]
    print(f"trained in {elapsed:.2f} s ({elapsed / args.steps * 1e3:.2f} ms/step)")
    gpus = sum(total.gpu_energy.values())
    print(
        f"whole run: {total.time:.2f} s, {gpus:.1f} J on the GPUs "
        f"({total.total_energy:.1f} J with CPU and DRAM where RAPL is readable)"
    )
    for gpu, joules in sorted(total.gpu_energy.items()):
        print(f"  gpu:{gpu}  {joules:9.1f} J  ({total.methods[f'gpu:{gpu}']})")
    print(
        f"per step: mean {sum(per_step) / len(per_step):.2f} J, "
        f"min {min(per_step):.2f} J, max {max(per_step):.2f} J"
    )


if __name__ == "__main__":
    main()
