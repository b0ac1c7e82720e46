"""Training-thread overhead of measuring every step, with the Hugging Face energy callback on.

Issue 20's second benchmark: the owner's measure, since this 2-vCPU VM cannot resolve 1 % of
wall time. A Hugging Face ``Trainer`` trains a tiny model whose steps take ``--step-ms`` (10 ms
by default: its forward pass busy-waits the rest) for ``--steps`` steps, with

* a window per step (``push_window`` at ``on_step_begin``, ``pop_window`` and the energy read
  at once at ``on_step_end``), and
* :class:`zeus_async.integrations.hf.EnergyCallback` (logging every 10 steps),

both on one ``Monitor`` (sampler process, simulated GPUs). Counted per step:

* **our code on the training thread**: the CPU time (``CLOCK_THREAD_CPUTIME_ID``) of every call
  into zeus_async from the two callbacks' hooks;
* **our threads in the training process**: the CPU time of zeus_async's threads there (the
  sampler process's I/O thread), an upper bound on the GIL time they take from training (they
  hold the GIL only while running Python, and wait in ``poll`` without it).

Target: their sum ≤ 0.5 % of the step. Run:
``.venv/bin/python bench/training/bench_training_overhead.py [--steps 600] [--step-ms 10]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("ZEUS_ASYNC_AGENT", "off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--gpus", type=int, default=4, help="GPUs the monitor measures")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="instead of a window per step, only the floor: 2 time stamps and 2 board reads",
    )
    args = parser.parse_args()
    step_s = args.step_ms / 1e3

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zeus_async import Monitor
    from zeus_async.integrations.hf import EnergyCallback

    ours_ns = [0]
    parts: dict[str, int] = {}

    def counted(fn: Any) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return fn(*a, **kw)
            finally:
                spent = time.thread_time_ns() - t0
                ours_ns[0] += spent
                parts[fn.__name__] = parts.get(fn.__name__, 0) + spent

        return wrapper

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)
            self.deadline = 0.0

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            loss = torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)
            while time.perf_counter() < self.deadline:  # the rest of a step_s step
                pass
            return {"loss": loss}

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 1 << 20

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x = torch.ones(8) * (i % 7)
            return {"x": x, "y": x.sum()}

    model = Tiny()
    energies: list[float] = []

    class StepWindows(TrainerCallback):
        def __init__(self, monitor: Monitor) -> None:
            self.monitor = monitor

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            model.deadline = time.perf_counter() + step_s
            counted(self.monitor.push_window)()

        @counted
        def _pop(self) -> None:
            res = self.monitor.pop_window()
            energies.append(sum(res.energy))

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            self._pop()

    class Floor(TrainerCallback):
        """The cheapest per-step work there could be, counted the same way: two edge time
        stamps queued, and each GPU's latest reading read twice from the power board."""

        def __init__(self, monitor: Monitor) -> None:
            process = monitor._process
            assert process is not None and process._board is not None
            self.board = process._board
            self.keys = [process._board_keys[f"gpu:{g}"] for g in monitor.gpu_indices]
            self.edges: list[int] = []

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            model.deadline = time.perf_counter() + step_s
            counted(self.edges.append)(time.time_ns())

        @counted
        def _pop(self) -> None:
            self.edges.append(time.time_ns())
            for key in self.keys:
                self.board.latest(key)
                self.board.latest(key)
            energies.append(0.0)

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            self._pop()

    gpus = list(range(args.gpus))
    with Monitor(gpus, backend="sim", cpu_indices=[], sync_execution_with=None) as monitor:
        energy_cb = EnergyCallback(monitor)
        for hook in ("on_train_begin", "on_log", "on_train_end"):
            setattr(energy_cb, hook, counted(getattr(energy_cb, hook)))
        targs = TrainingArguments(
            output_dir=tempfile.mkdtemp(),
            max_steps=args.steps,
            logging_steps=10,
            per_device_train_batch_size=4,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(
            model, targs, train_dataset=Data(), callbacks=[StepWindows(monitor), energy_cb]
        )
        ours = [t for t in threading.enumerate() if t.name.startswith("zeus-async")]
        clocks = {t.name: time.pthread_getcpuclockid(t.ident) for t in ours if t.ident}
        before = {n: time.clock_gettime_ns(c) for n, c in clocks.items()}
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        threads_ns = sum(time.clock_gettime_ns(c) - before[n] for n, c in clocks.items())
        io_wakeups = getattr(monitor._process, "io_wakeups", 0)
    steps = args.steps
    ours_us = ours_ns[0] / steps / 1e3
    threads_us = threads_ns / steps / 1e3
    total_us = ours_us + threads_us
    step_us = step_s * 1e6
    print(
        f"\n{args.gpus} GPU(s){' FLOOR' if args.floor else ''}, {steps} steps of "
        f"{args.step_ms:g} ms (measured {wall / steps * 1e3:.2f} ms/step); "
        f"{len(energies)} windows read at once; threads: {', '.join(clocks) or 'none'}; "
        f"I/O thread wake-ups: {io_wakeups}\n"
    )
    print("| per step | µs | % of the step |")
    print("|---|---:|---:|")
    print(
        f"| our code on the training thread (CPU) | {ours_us:.1f} | {ours_us / step_us * 100:.3f} |"
    )
    print(
        f"| our threads in the process (CPU, ≥ GIL) | {threads_us:.1f} | "
        f"{threads_us / step_us * 100:.3f} |"
    )
    for name, spent in sorted(parts.items()):
        print(f"| — of which {name} | {spent / steps / 1e3:.1f} | |")
    print(f"| **total** | **{total_us:.1f}** | **{total_us / step_us * 100:.3f}** (target ≤ 0.5) |")


if __name__ == "__main__":
    main()
