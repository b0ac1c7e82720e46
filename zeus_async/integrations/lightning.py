"""Everything for PyTorch Lightning (imports Lightning, never transformers).

``pip install 'zeus_async[lightning]'``. Two ``Callback`` classes, from ``lightning.pytorch`` or,
failing that, ``pytorch_lightning``:

* :class:`EnergyCallback` — GPU energy in Lightning's logged metrics (see
  :mod:`zeus_async.integrations`)::

    from zeus_async.integrations.lightning import EnergyCallback

    trainer = lightning.Trainer(callbacks=[EnergyCallback()], ...)
    trainer.fit(model)
    trainer.logged_metrics   # {"train_loss": ..., "gpu_energy_j": ..., "gpu_power_w": ...}

* :class:`LightningPowerLimitOptimizer` — the power-limit optimizer (see
  :mod:`zeus_async.integrations._power_limit`)::

    from zeus_async.integrations.lightning import LightningPowerLimitOptimizer

    trainer = lightning.Trainer(callbacks=[LightningPowerLimitOptimizer(monitor)], ...)

Both are here so that a Lightning user has one module to import; it was
``zeus_async.optimizer.lightning`` for the optimizer, which still works, with a
``DeprecationWarning``.
"""

from __future__ import annotations

import logging
from typing import Any

from . import _power_limit
from ._energy_log import EnergyCallbackBase

__all__ = ["EnergyCallback", "LightningPowerLimitOptimizer"]

logger = logging.getLogger(__name__)

#: The framework's callback class, resolved at import (``object`` when not available).
_Base, _base_error = _power_limit.base_class(("lightning.pytorch", "pytorch_lightning"), "Callback")

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

    With a carbon configuration (``EnergyCallback(carbon=CarbonConfig(zone="FR"))``, or the
    monitor's), it also logs ``gpu_co2e_g`` and ``gpu_co2e_total_g`` (and ``gpu_cost``,
    ``gpu_cost_total`` where priced), and ``train_gpu_co2e_g`` (``train_gpu_cost``) at the end;
    ``emissions_file``: CodeCarbon's ``emissions.csv`` row for the run.

    Args:
        monitor, job, prefix, carbon, emissions_file: As
            :class:`~zeus_async.integrations.EnergyLog`.

    Raises:
        ImportError: Lightning is not installed.
    """

    _missing = "" if _base_error is None else MISSING
    _missing_error = _base_error

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The ranks are launched: the monitor measures this rank's GPU (``ddp``'s rank 0
        made it before the launcher; see :meth:`~zeus_async.integrations.EnergyLog.resolve`)."""
        gpus, local_rank = _power_limit.lightning_rank(trainer)
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


class LightningPowerLimitOptimizer(_power_limit.OptimizerCallback, _Base):  # type: ignore[misc,valid-type]
    """A PyTorch Lightning ``Callback`` finding and applying the optimal GPU power limit.

    Takes the arguments of :class:`~zeus_async.optimizer.GlobalPowerLimitOptimizer`, which it
    wraps (``.optimizer``): ``on_train_batch_start`` is a step, ``on_train_epoch_end`` an
    epoch's end, and ``on_train_end`` or ``on_exception`` restore the maximum power limit
    (``optimizer.close()``). Each rank of a distributed run has its own callback.

    ``setup`` (the ranks are launched) gives a monitor made before the launcher said the rank
    (``ddp``: rank 0 is the script's own process) this rank's device, and starts the optimizer
    there: until then no GPU is touched. Under ``ddp_spawn`` the callback is pickled to each
    rank, which makes its own monitor and optimizer from their arguments.

    Raises:
        ImportError: Neither ``lightning`` nor ``pytorch_lightning`` is installed.
        ValueError, NoPermissionError, ConfigError: As the wrapped optimizer.
    """

    _missing = "" if _base_error is None else _power_limit.LIGHTNING_MISSING
    _missing_error = _base_error

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The ranks are launched: this rank's GPU, and the optimizer starts on it."""
        if stage == "fit":
            self._start(_power_limit.lightning_rank(trainer))

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """The start of a training step."""
        self.optimizer.on_step_begin()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The power limit in force (``power_limit_w``) and, once chosen,
        ``optimal_power_limit_w``, in the logged metrics."""
        for name, value in _power_limit.power_limit_metrics(self.optimizer).items():
            pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """The end of a training epoch."""
        self.optimizer.on_epoch_end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The end of training: restore the maximum power limit."""
        self.optimizer.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Training failed: restore the maximum power limit."""
        self.optimizer.close()
