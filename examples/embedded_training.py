"""Embed zeus_async in a training script: sampling runs on a background thread.

    python examples/embedded_training.py --steps 200

Uses real GPUs when an NVIDIA driver is present, simulated H100s otherwise. The training
loop below is a small PyTorch MLP on CPU when torch is installed, and plain Python arithmetic
otherwise, so the example runs anywhere. While it trains, every sample is also published on
ZeroMQ (watch it with ``zeus-async subscribe tcp://127.0.0.1:5557``).
"""

from __future__ import annotations

import argparse
import time

import anyio

from zeus_async.aggregate import LiveTotals
from zeus_async.cli import render_totals
from zeus_async.events import Event
from zeus_async.runtime import EmbeddedRuntime


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

    totals = LiveTotals()

    async def account(stream: anyio.abc.ObjectReceiveStream[Event]) -> None:
        async for event in stream:  # runs on the runtime's thread, never on the training one
            totals.add(event)

    kind, step = make_step()
    with EmbeddedRuntime(backend="auto", publish=args.publish, consumers=[account]) as rt:
        assert rt.runtime is not None
        print(
            f"sampling {len(rt.runtime.devices)} device(s) ({rt.runtime.backend}); "
            f"training a {kind} for {args.steps} steps"
        )
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()  # type: ignore[operator]
        elapsed = time.perf_counter() - t0
    print(f"trained in {elapsed:.2f} s ({elapsed / args.steps * 1e3:.2f} ms/step)")
    print("\n".join(render_totals(totals)))


if __name__ == "__main__":
    main()
