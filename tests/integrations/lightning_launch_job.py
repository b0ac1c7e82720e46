"""A Lightning job whose launcher starts the ranks, with the README's usage: ``Monitor()``
first, before the launcher has said which rank this is, then the energy callback and the
power-limit optimizer's callback on that monitor.

    python lightning_launch_job.py ddp|ddp_spawn [STEPS]

Two ranks on the CPU accelerator over gloo (``devices=2``): under ``ddp`` rank 0 is this
process and Lightning re-executes the script for rank 1 with ``LOCAL_RANK=1``; under
``ddp_spawn`` both ranks are spawned processes that unpickle the trainer and its callbacks.
Every rank prints one JSON line when training ends: its rank, the edges of the energy
callback's span (wall clock ns, taken just before its first window opens and its last one
ends), the job's ``train_gpu_energy_j`` it logged, and its optimizer's measurements.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import lightning as L
import msgspec
import torch

from zeus_async import Monitor
from zeus_async.integrations.lightning import EnergyCallback, LightningPowerLimitOptimizer

STEPS = 12
OPTIMIZER = {"wait_steps": 1, "warmup_steps": 1, "profile_steps": 2, "pl_step": 250}


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        x, y = batch
        time.sleep(0.05)  # a step long enough for the optimizer's windows to mean something
        return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Span(L.Callback):
    """Listed before the energy callback: its hooks run just before that callback's."""

    def __init__(self) -> None:
        self.t0_ns = self.t1_ns = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.t0_ns = time.time_ns()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.t1_ns = time.time_ns()


class Report(L.Callback):
    """Listed last: prints this rank's figures once the others have ended training."""

    def __init__(self, span: Span, optimizer: LightningPowerLimitOptimizer) -> None:
        self.span = span
        self.plo = optimizer

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if "gpu_" in k}
        out = {
            "rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "pid": os.getpid(),
            "t0_ns": self.span.t0_ns,
            "t1_ns": self.span.t1_ns,
            "metrics": metrics,
            "measurements": msgspec.to_builtins(self.plo.optimizer.measurements),
            "optimal": self.plo.optimizer.optimal_power_limit,
        }
        print(json.dumps(out), flush=True)


def main() -> None:
    strategy = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else STEPS
    monitor = Monitor()  # first, as the power-limit optimizer's README usage has it
    span = Span()
    optimizer = LightningPowerLimitOptimizer(monitor, **OPTIMIZER)
    callbacks = [span, EnergyCallback(monitor), optimizer, Report(span, optimizer)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        log_every_n_steps=4,
        callbacks=callbacks,
        logger=L.pytorch.loggers.CSVLogger(tempfile.mkdtemp()),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(-1)), batch_size=4)
    trainer.fit(Tiny(), loader)
    monitor.close()


if __name__ == "__main__":
    main()
