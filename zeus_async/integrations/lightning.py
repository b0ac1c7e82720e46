"""GPU energy in PyTorch Lightning's logged metrics (imports Lightning).

``pip install 'zeus_async[lightning]'``; see :mod:`zeus_async.integrations`::

    from zeus_async.integrations.lightning import EnergyCallback

    trainer = lightning.Trainer(callbacks=[EnergyCallback()], ...)
    trainer.fit(model)
    trainer.logged_metrics   # {"train_loss": ..., "gpu_energy_j": ..., "gpu_power_w": ...}
"""

from __future__ import annotations

import logging
from typing import Any

from ..optimizer import integrations
from ._energy_log import EnergyCallbackBase

__all__ = ["EnergyCallback"]

logger = logging.getLogger(__name__)

_Base, _base_error = integrations.base_class(("lightning.pytorch", "pytorch_lightning"), "Callback")

MISSING = "EnergyCallback needs lightning: pip install 'zeus_async[lightning]'"


class EnergyCallback(EnergyCallbackBase, _Base):  # type: ignore[misc,valid-type]
    """A Lightning ``Callback`` logging GPU energy through the module's ``self.log``.

    Every ``log_every_n_steps`` training steps it logs ``gpu_energy_j``, ``gpu_power_w``
    (since the previous time) and ``gpu_energy_total_j``, so every configured logger
    (TensorBoard, W&B, MLflow, CSV...) and ``trainer.logged_metrics`` get them; on several ranks
    summed over the ranks by Lightning (``sync_dist``, ``reduce_fx="sum"``). When training ends,
    ``train_gpu_energy_j`` and ``train_gpu_power_w`` go to the trainer's loggers and into
    ``trainer.callback_metrics``.

    A monitor made before Lightning's launcher started the ranks (``Monitor()`` at the top of
    a ``ddp`` script) is given this rank's GPU in ``setup``; under ``ddp_spawn`` the callback
    is pickled to the ranks, each measuring with a monitor of its own.

    Args:
        monitor, job, prefix: As :class:`~zeus_async.integrations.EnergyLog`.

    Raises:
        ImportError: Lightning is not installed.
    """

    _missing = "" if _base_error is None else MISSING
    _missing_error = _base_error

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The ranks are launched: the monitor measures this rank's GPU (``ddp``'s rank 0
        made it before the launcher; see :meth:`~zeus_async.integrations.EnergyLog.resolve`)."""
        gpus, local_rank = integrations.lightning_rank(trainer)
        self.energy.resolve(gpus, local_rank)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.energy.start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = max(int(getattr(trainer, "log_every_n_steps", 50) or 1), 1)
        if trainer.global_step % every:
            return
        job = self.energy.job and int(getattr(trainer, "world_size", 1)) > 1
        for name, value in self.energy.interval(reduce=False).items():
            pl_module.log(name, value, on_step=True, on_epoch=False, sync_dist=job, reduce_fx="sum")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        metrics = self.energy.finish()
        if not metrics:
            return
        import torch

        for name, value in metrics.items():
            trainer.callback_metrics[name] = torch.tensor(value)
        for logger_ in getattr(trainer, "loggers", []):
            logger_.log_metrics(metrics, step=trainer.global_step)
