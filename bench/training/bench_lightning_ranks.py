"""Lightning ``ddp`` job energy against the truth, with ``Monitor()`` made before the launcher.

The README's usage: ``monitor = Monitor()`` first in the script, then ``EnergyCallback(monitor)``
and ``LightningPowerLimitOptimizer(monitor)`` in a ``Trainer(strategy="ddp")`` of 2 ranks
(CPU accelerator over gloo: rank r stands for the job's GPU r, as ``LOCAL_RANK`` maps it) on a
simulated node of 4 GPUs. Lightning runs rank 0 as the script's own process and sets its
``LOCAL_RANK`` only inside ``trainer.fit()``, after the monitor was made.

Two modes, side by side in one run, each a fresh node (state, agents):

* ``every-gpu``: rank 0's monitor keeps every GPU of the node, as ``Monitor()`` did before it
  resolved its GPUs when the launcher spoke (made here with ``gpu_indices=[0, 1, 2, 3]``, which
  is what it resolved to then);
* ``resolved``: ``Monitor()``, which takes rank 0's GPU when Lightning sets the rank.

For each: the job's ``train_gpu_energy_j`` logged by the energy callback, the truth (the
simulator's exact energy of GPUs 0 and 1 over each rank's logging span), their ratio, whether
GPUs 2 and 3 (another job's) were ever set, the lease conflicts and failed restores the ranks
logged, and whether every limit was back at its default after the run.

Run: ``.venv/bin/python bench/training/bench_lightning_ranks.py [--steps 40] [--rounds 2]``
(needs the ``lightning`` extra; ``--job`` is the training script itself, run by the bench).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import sim_env

CONFIG = SimConfig(num_gpus=4)
MODES = ("every-gpu", "resolved")
OPTIMIZER = {"wait_steps": 1, "warmup_steps": 2, "profile_steps": 4, "pl_step": 250}


def job(mode: str, steps: int) -> None:
    """One rank of the job (rank 0 runs this first; Lightning re-executes it for rank 1)."""
    import lightning as L
    import msgspec
    import torch

    from zeus_async import Monitor
    from zeus_async.integrations.lightning import EnergyCallback, LightningPowerLimitOptimizer

    launched = "LOCAL_RANK" in os.environ  # rank 1, re-executed by the launcher
    if mode == "every-gpu" and not launched:
        monitor = Monitor(gpu_indices=list(range(CONFIG.num_gpus)))
    else:
        monitor = Monitor()

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            time.sleep(0.05)
            return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    span = [0, 0]

    class Span(L.Callback):  # just before the energy callback's own hooks
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            span[0] = time.time_ns()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            span[1] = time.time_ns()

    plo = LightningPowerLimitOptimizer(monitor, **OPTIMIZER)

    class Report(L.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            metrics = trainer.callback_metrics
            out = {
                "local_rank": trainer.local_rank,
                "span": span,
                "energy_j": float(metrics["train_gpu_energy_j"]),
                "gpus": monitor.gpu_indices,
                "measurements": msgspec.to_builtins(plo.optimizer.measurements),
            }
            print(json.dumps(out), flush=True)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        log_every_n_steps=5,
        callbacks=[Span(), EnergyCallback(monitor), plo, Report()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    x = torch.randn(4 * steps, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(-1))
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    monitor.close()


def run(mode: str, steps: int) -> dict[str, Any]:
    """The job in a fresh private directory (node state, agents); its figures."""
    with tempfile.TemporaryDirectory(prefix="zl-") as private:
        env = sim_env(CONFIG, ZEUS_ASYNC_DIR=private)
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--job", mode, "--steps", str(steps)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"{mode}: the job failed: {proc.stderr[-3000:]}")
        old = os.environ.get("ZEUS_ASYNC_DIR")
        os.environ["ZEUS_ASYNC_DIR"] = private
        try:
            states = read_sim_node_state(CONFIG)
        finally:
            if old is None:
                del os.environ["ZEUS_ASYNC_DIR"]
            else:
                os.environ["ZEUS_ASYNC_DIR"] = old
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    node = SimNode(CONFIG, shared_state=False)
    truth = sum(node.truth_energy_j(r["local_rank"], *r["span"]) for r in ranks)
    logged = ranks[0]["energy_j"]
    return {
        "mode": mode,
        "logged_j": logged,
        "truth_j": truth,
        "ratio": logged / truth,
        "rank0_gpus": next(r["gpus"] for r in ranks if r["local_rank"] == 0),
        "other_jobs_gpus_set": [s.gpu for s in states[2:] if s.changed_ns is not None],
        "lease_conflicts": proc.stderr.count("LeaseConflictError"),
        "failed_restores": proc.stderr.count("could not restore"),
        "limits_default_after": all(s.is_default(CONFIG) for s in states),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per job")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per mode (alternating)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--job", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.job, args.steps)
        return
    rows = [run(mode, args.steps) for _ in range(args.rounds) for mode in MODES]
    print(
        f"Lightning ddp, 2 ranks of a 4-GPU simulated node, {args.steps} steps, "
        f"{args.rounds} jobs per mode\n"
    )
    print(
        "| rank 0's monitor | rank 0 GPUs | logged job J | truth J | logged/truth | "
        "GPUs 2,3 set | lease conflicts | failed restores | limits default after | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['rank0_gpus']} | {row['logged_j']:.1f} | "
            f"{row['truth_j']:.1f} | {row['ratio']:.3f} | {row['other_jobs_gpus_set'] or 'none'} | "
            f"{row['lease_conflicts']} | {row['failed_restores']} | "
            f"{row['limits_default_after']} | {row['wall_s']:.1f} |"
        )
    for mode in MODES:
        ratios = [r["ratio"] for r in rows if r["mode"] == mode]
        print(f"\n{mode}: logged/truth mean {statistics.mean(ratios):.3f} over {len(ratios)} jobs")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
