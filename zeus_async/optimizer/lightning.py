"""The PyTorch Lightning ``Callback`` of the power-limit optimizer (imports Lightning).

``pip install 'zeus_async[lightning]'``; see :mod:`zeus_async.optimizer.integrations`.
"""

from __future__ import annotations

import logging
from typing import Any

from . import integrations

__all__ = ["LightningPowerLimitOptimizer"]

logger = logging.getLogger(__name__)

#: The framework's callback class, resolved at import (``object`` when not available).
_Base, _base_error = integrations.base_class(("lightning.pytorch", "pytorch_lightning"), "Callback")


class LightningPowerLimitOptimizer(integrations.OptimizerCallback, _Base):  # type: ignore[misc,valid-type]
    """A PyTorch Lightning ``Callback`` finding and applying the optimal GPU power limit.

    Takes the arguments of :class:`~.power_limit.GlobalPowerLimitOptimizer`, which it wraps
    (``.optimizer``): ``on_train_batch_start`` is a step, ``on_train_epoch_end`` an epoch's
    end, and ``on_train_end`` or ``on_exception`` restore the maximum power limit
    (``optimizer.close()``). Each rank of a distributed run has its own callback.

    ``setup`` (the ranks are launched) gives a monitor made before the launcher said the rank
    (``ddp``: rank 0 is the script's own process) this rank's device, and starts the optimizer
    there: until then no GPU is touched. Under ``ddp_spawn`` the callback is pickled to each
    rank, which makes its own monitor and optimizer from their arguments.

    Raises:
        ImportError: Neither ``lightning`` nor ``pytorch_lightning`` is installed.
        ValueError, NoPermissionError, ConfigError: As the wrapped optimizer.
    """

    _missing = "" if _base_error is None else integrations.LIGHTNING_MISSING
    _missing_error = _base_error

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The ranks are launched: this rank's GPU, and the optimizer starts on it."""
        if stage == "fit":
            self._start(integrations.lightning_rank(trainer))

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
        for name, value in integrations.power_limit_metrics(self.optimizer).items():
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
