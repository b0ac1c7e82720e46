"""A tiny training run (a rank of a job, or alone) with zeus_async's framework callbacks.

    python frameworks_job.py hf|lightning [optimizer] [late] [carbon]

Trains a linear model built in code (no downloads) for 24 steps, logging every 4, with the
energy callback and, with ``optimizer``, the power-limit optimizer's callback on the same
monitor (3 limits, 4 steps each), built before the process group or (``late``, HF) after it.
With ``carbon``, the energy callback makes its own monitor with a carbon configuration
(:data:`CARBON`) and an ``emissions.csv``, whose rows are printed too.
Prints one JSON line: what the framework logged, and the
optimizer's measurements and choice.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import msgspec
import torch

from zeus_async import Monitor

STEPS, EVERY = 24, 4
LATE = "late" in sys.argv[2:]
WITH_CARBON = "carbon" in sys.argv[2:]
#: The carbon configuration of ``carbon`` runs (as a mapping: msgspec.convert'ed in the job).
CARBON = {
    "source": "constant",
    "g_per_kwh": 300.0,
    "price_per_kwh": 0.25,
    "currency": "EUR",
    "pue": 1.5,
}
EMISSIONS = os.path.join(tempfile.mkdtemp(), "emissions.csv")


def energy_callback(module: Any, monitor: Monitor) -> Any:
    if not WITH_CARBON:
        return module.EnergyCallback(monitor)
    from zeus_async.carbon import CarbonConfig

    config = msgspec.convert(CARBON, CarbonConfig)
    return module.EnergyCallback(carbon=config, emissions_file=EMISSIONS)


GROUP_AT_BUILD: list[bool] = []
OPTIMIZER = {"wait_steps": 1, "warmup_steps": 1, "profile_steps": 2, "pl_step": 250}


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(-1))


def hf(monitor: Monitor, optimizer: bool) -> tuple[list[dict[str, Any]], Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zeus_async.integrations import hf as module
    from zeus_async.integrations.hf import HFGlobalPowerLimitOptimizer

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)}

    class Pairs(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self) -> None:
            self.inner = data()

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x, y = self.inner[i]
            return {"x": x, "y": y}

    class Seen(TrainerCallback):  # stands for a report_to integration, listed first
        keys: list[list[str]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            self.keys.append(sorted(logs or {}))

    def arguments() -> TrainingArguments:
        return TrainingArguments(
            output_dir=tempfile.mkdtemp(),
            max_steps=STEPS,
            logging_steps=EVERY,
            per_device_train_batch_size=4,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        )

    # The optimizer built before the arguments (which set up the process group) or after.
    args = arguments() if LATE else None
    GROUP_AT_BUILD.append(torch.distributed.is_initialized())
    callbacks: list[Any] = [Seen(), energy_callback(module, monitor)]
    opt = HFGlobalPowerLimitOptimizer(monitor, **OPTIMIZER) if optimizer else None
    if opt is not None:
        callbacks.append(opt)
    args = args or arguments()
    trainer = Trainer(Tiny(), args, train_dataset=Pairs(), callbacks=callbacks)
    trainer.train()
    seen = [k for k in Seen.keys if "loss" in k]
    assert seen and all("gpu_energy_j" in k for k in seen), seen  # reached the integrations
    return trainer.state.log_history, None if opt is None else opt.optimizer


def lightning(monitor: Monitor, optimizer: bool) -> tuple[list[dict[str, Any]], Any]:
    import lightning as L

    from zeus_async.integrations import lightning as module
    from zeus_async.integrations.lightning import LightningPowerLimitOptimizer

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    GROUP_AT_BUILD.append(torch.distributed.is_initialized())  # Lightning: in fit()
    callbacks: list[Any] = [energy_callback(module, monitor)]
    opt = LightningPowerLimitOptimizer(monitor, **OPTIMIZER) if optimizer else None
    if opt is not None:
        callbacks.append(opt)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_steps=STEPS,
        log_every_n_steps=EVERY,
        callbacks=callbacks,
        logger=L.pytorch.loggers.CSVLogger(tempfile.mkdtemp()),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data(), batch_size=4))
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    final = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train_")}
    return [logged, final], None if opt is None else opt.optimizer


def main() -> None:
    framework, optimizer = sys.argv[1], "optimizer" in sys.argv[2:]
    torch.manual_seed(0)
    with Monitor() as monitor:
        history, opt = (hf if framework == "hf" else lightning)(monitor, optimizer)
        out: dict[str, Any] = {
            "rank": int(os.environ.get("RANK", "0")),
            "history": history,
            "group_at_build": GROUP_AT_BUILD[0] if GROUP_AT_BUILD else False,
        }
        if WITH_CARBON:
            with open(EMISSIONS) as f:
                out["emissions"] = f.read()
        if opt is not None:
            out["optimal"] = opt.wait_done(timeout=20)
            out["measurements"] = msgspec.to_builtins(opt.measurements)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
