"""GPU energy in the Hugging Face ``Trainer``'s logs (imports transformers).

``pip install 'zeus_async[hf]'``; see :mod:`zeus_async.integrations`::

    from zeus_async.integrations.hf import EnergyCallback

    trainer = Trainer(model, args, train_dataset=..., callbacks=[EnergyCallback()])
    trainer.train()
    trainer.state.log_history   # ..., {"loss": ..., "gpu_energy_j": ..., "gpu_power_w": ...}
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ..optimizer import integrations
from ._energy_log import EnergyCallbackBase

__all__ = ["EnergyCallback"]

logger = logging.getLogger(__name__)

_Base, _base_error = integrations.base_class(("transformers",), "TrainerCallback")

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

    Args:
        monitor, job, prefix: As :class:`~zeus_async.integrations.EnergyLog`.

    Raises:
        ImportError: ``transformers`` is not installed.
    """

    _missing = "" if _base_error is None else MISSING
    _missing_error = _base_error

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Training starts: the first interval opens, on this rank's GPU."""
        self._go_first(sys._getframe(1))
        gpus, local_rank = integrations.hf_rank(args)
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
