"""The Hugging Face ``TrainerCallback`` of the power-limit optimizer (imports transformers).

``pip install 'zeus_async[hf]'``; see :mod:`zeus_async.optimizer.integrations`.
"""

from __future__ import annotations

import logging
from typing import Any

from . import integrations

__all__ = ["HFGlobalPowerLimitOptimizer"]

logger = logging.getLogger(__name__)

#: The framework's callback class, resolved at import (``object`` when not available).
_Base, _base_error = integrations.base_class(("transformers",), "TrainerCallback")


class HFGlobalPowerLimitOptimizer(integrations.OptimizerCallback, _Base):  # type: ignore[misc,valid-type]
    """A Hugging Face ``TrainerCallback`` finding and applying the optimal GPU power limit.

    Takes the arguments of :class:`~.power_limit.GlobalPowerLimitOptimizer`, which it wraps
    (``.optimizer``): ``on_step_begin`` and ``on_epoch_end`` are forwarded, and
    ``on_train_end`` restores the maximum power limit (``optimizer.close()``).
    ``on_train_begin`` gives a monitor made before the launcher said the rank this rank's
    device (``args.device``) and starts the optimizer there (see
    :mod:`~zeus_async.optimizer.integrations`).

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError, NoPermissionError, ConfigError: As the wrapped optimizer.
    """

    _missing = "" if _base_error is None else integrations.HF_MISSING
    _missing_error = _base_error

    # ``model`` may come positionally, as Zeus's hooks take it (the Trainer passes keywords).

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """Training starts (the ranks are launched): this rank's GPU, the optimizer on it."""
        self._start(integrations.hf_rank(args))

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
        metrics = integrations.power_limit_metrics(self.optimizer)
        logs.update(metrics)  # the report_to integrations after this callback see them
        history = getattr(state, "log_history", None)
        if history and isinstance(history[-1], dict):
            history[-1].update(metrics)  # the Trainer copied the logs there just before

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """The end of training: restore the maximum power limit."""
        self.optimizer.close()
