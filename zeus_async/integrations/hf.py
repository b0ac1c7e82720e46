"""Everything for the Hugging Face ``Trainer`` (imports transformers, never Lightning).

``pip install 'zeus_async[hf]'``. Two ``TrainerCallback`` classes:

* :class:`EnergyCallback` — GPU energy in the Trainer's logs (see
  :mod:`zeus_async.integrations`)::

    from zeus_async.integrations.hf import EnergyCallback

    trainer = Trainer(model, args, train_dataset=..., callbacks=[EnergyCallback()])
    trainer.train()
    trainer.state.log_history   # ..., {"loss": ..., "gpu_energy_j": ..., "gpu_power_w": ...}

* :class:`HFGlobalPowerLimitOptimizer` — the power-limit optimizer, the drop-in for Zeus's
  class of the same name (see :mod:`zeus_async.integrations._power_limit`)::

    from zeus_async.integrations.hf import HFGlobalPowerLimitOptimizer

    trainer = Trainer(..., callbacks=[HFGlobalPowerLimitOptimizer(monitor)])

Both are here so that a Trainer's user has one module to import; it was
``zeus_async.optimizer.hf`` for the optimizer, which still works, with a
``DeprecationWarning``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from . import _power_limit
from ._energy_log import EnergyCallbackBase

__all__ = ["EnergyCallback", "HFGlobalPowerLimitOptimizer"]

logger = logging.getLogger(__name__)

#: The framework's callback class, resolved at import (``object`` when not available).
_Base, _base_error = _power_limit.base_class(("transformers",), "TrainerCallback")

MISSING = "EnergyCallback needs transformers: pip install 'zeus_async[hf]'"


class EnergyCallback(EnergyCallbackBase, _Base):  # type: ignore[misc,valid-type]
    """A ``TrainerCallback`` adding GPU energy to every log of the Trainer.

    At each logging step (``logging_steps``) the logs get ``gpu_energy_j``, ``gpu_power_w``
    (since the previous logging step) and ``gpu_energy_total_j``; the final log of training
    (with ``train_runtime``) gets ``train_gpu_energy_j`` and ``train_gpu_power_w``. They reach
    ``trainer.state.log_history`` and every ``report_to`` integration (TensorBoard, W&B,
    MLflow...): when training starts, this callback moves itself ahead of the others so that
    they see the figures. On several ranks the figures are the job's (see
    :class:`~zeus_async.integrations.EnergyLog`).

    With a carbon configuration (``EnergyCallback(carbon=CarbonConfig(zone="FR"))``, or the
    monitor's), the logs also get ``gpu_co2e_g``, ``gpu_co2e_total_g`` and
    ``train_gpu_co2e_g`` (and ``gpu_cost``, ``gpu_cost_total``, ``train_gpu_cost`` where
    priced); with ``emissions_file`` the run's CodeCarbon ``emissions.csv`` row is written at
    the end: what ``report_to="codecarbon"`` did (``docs/migrating-from-codecarbon.md``).

    Args:
        monitor, job, prefix, carbon, emissions_file: As
            :class:`~zeus_async.integrations.EnergyLog`.

    Raises:
        ImportError: ``transformers`` is not installed.
    """

    _missing = "" if _base_error is None else MISSING
    _missing_error = _base_error

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Training starts: the first interval opens, on this rank's GPU."""
        self._go_first(sys._getframe(1))
        gpus, local_rank = _power_limit.hf_rank(args)
        self.energy.resolve(gpus, local_rank)
        self.energy.start()

    def _go_first(self, caller: Any) -> None:
        # The Trainer puts its report_to integrations before user callbacks, and calls each
        # in order with the same logs dict: to reach them, this callback must come first. Its
        # caller is the CallbackHandler's loop over that list; moving this callback from its
        # place to the front leaves the loop's next item where it was.
        handler = caller.f_locals.get("self")
        callbacks = getattr(handler, "callbacks", None)
        if isinstance(callbacks, list) and self in callbacks and callbacks[0] is not self:
            callbacks.remove(self)
            callbacks.insert(0, self)

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """A logging step: the interval's figures into ``logs`` and the history's last entry."""
        if logs is None:
            return
        final = "train_runtime" in logs
        metrics = self.energy.finish() if final else self.energy.interval()
        logs.update(metrics)
        history = getattr(state, "log_history", None)
        if history and isinstance(history[-1], dict):
            history[-1].update(metrics)  # the Trainer copied the logs there just before

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Training ends (after its final log): closes a monitor made here."""
        self.energy.finish()


class HFGlobalPowerLimitOptimizer(_power_limit.OptimizerCallback, _Base):  # type: ignore[misc,valid-type]
    """A Hugging Face ``TrainerCallback`` finding and applying the optimal GPU power limit.

    Takes the arguments of :class:`~zeus_async.optimizer.GlobalPowerLimitOptimizer`, which it
    wraps (``.optimizer``): ``on_step_begin`` and ``on_epoch_end`` are forwarded, and
    ``on_train_end`` restores the maximum power limit (``optimizer.close()``).
    ``on_train_begin`` gives a monitor made before the launcher said the rank this rank's
    device (``args.device``) and starts the optimizer there (see
    :mod:`~zeus_async.integrations._power_limit`).

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError, NoPermissionError, ConfigError: As the wrapped optimizer.
    """

    _missing = "" if _base_error is None else _power_limit.HF_MISSING
    _missing_error = _base_error

    # ``model`` may come positionally, as Zeus's hooks take it (the Trainer passes keywords).

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """Training starts (the ranks are launched): this rank's GPU, the optimizer on it."""
        self._start(_power_limit.hf_rank(args))

    def on_step_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """The start of a training step."""
        self.optimizer.on_step_begin()

    def on_epoch_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """The end of an epoch."""
        self.optimizer.on_epoch_end()

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Each logging step: the power limit in force (``power_limit_w``) and, once chosen,
        ``optimal_power_limit_w``, in the Trainer's logs (``state.log_history``)."""
        if logs is None:
            return
        metrics = _power_limit.power_limit_metrics(self.optimizer)
        logs.update(metrics)  # the report_to integrations after this callback see them
        history = getattr(state, "log_history", None)
        if history and isinstance(history[-1], dict):
            history[-1].update(metrics)  # the Trainer copied the logs there just before

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """The end of training: restore the maximum power limit."""
        self.optimizer.close()
