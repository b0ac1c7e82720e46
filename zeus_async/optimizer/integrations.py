"""Training-framework callbacks around :class:`~.power_limit.GlobalPowerLimitOptimizer`.

* :class:`HFGlobalPowerLimitOptimizer`: a Hugging Face ``transformers.TrainerCallback``
  (``Trainer(..., callbacks=[HFGlobalPowerLimitOptimizer(monitor)])``), the drop-in for Zeus's
  class of the same name.
* :class:`LightningPowerLimitOptimizer`: a PyTorch Lightning ``Callback``
  (``Trainer(callbacks=[LightningPowerLimitOptimizer(monitor)])``), from ``lightning.pytorch``
  or, failing that, ``pytorch_lightning``.

Both frameworks are optional: this module imports without them, and constructing a callback
whose framework is missing raises :class:`ImportError` saying what to install. Each callback
forwards the framework's hooks to the optimizer it wraps (``.optimizer``) and restores the
maximum power limit when training ends.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING, Any

from .power_limit import AdaptiveOptions, GlobalPowerLimitOptimizer, OptimumSelector

if TYPE_CHECKING:
    from ..monitor import Monitor

__all__ = ["HFGlobalPowerLimitOptimizer", "LightningPowerLimitOptimizer"]

logger = logging.getLogger(__name__)

_HF_MISSING = "HFGlobalPowerLimitOptimizer needs transformers: pip install transformers"
_LIGHTNING_MISSING = "LightningPowerLimitOptimizer needs lightning: pip install lightning"


def _base_class(modules: tuple[str, ...], name: str) -> tuple[Any, BaseException | None]:
    """Attribute ``name`` of the first of ``modules`` that imports, or ``None`` and why not."""
    error: BaseException | None = None
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name), None
        except ImportError as exc:  # not installed
            error = exc
        except Exception as exc:  # installed but broken: report it when the callback is built
            logger.debug("importing %s.%s failed", module, name, exc_info=True)
            error = exc
    return None, error


#: The framework base classes, resolved once at import (``None`` when not available).
_TrainerCallback, _hf_error = _base_class(("transformers",), "TrainerCallback")
_LightningCallback, _lightning_error = _base_class(
    ("lightning.pytorch", "pytorch_lightning"), "Callback"
)

if TYPE_CHECKING:
    _HFBase = object
    _LightningBase = object
else:
    _HFBase = object if _TrainerCallback is None else _TrainerCallback
    _LightningBase = object if _LightningCallback is None else _LightningCallback


def _make_optimizer(
    monitor: Monitor,
    optimum_selector: OptimumSelector | None,
    wait_steps: int,
    warmup_steps: int,
    profile_steps: int,
    pl_step: int,
    profile_path: str | os.PathLike[str] | None,
    adaptive: bool | AdaptiveOptions,
    restore_on_signals: bool,
) -> GlobalPowerLimitOptimizer:
    return GlobalPowerLimitOptimizer(
        monitor,
        optimum_selector,
        wait_steps=wait_steps,
        warmup_steps=warmup_steps,
        profile_steps=profile_steps,
        pl_step=pl_step,
        profile_path=profile_path,
        adaptive=adaptive,
        restore_on_signals=restore_on_signals,
    )


class HFGlobalPowerLimitOptimizer(_HFBase):
    """A Hugging Face ``TrainerCallback`` finding and applying the optimal GPU power limit.

    Takes the arguments of :class:`~.power_limit.GlobalPowerLimitOptimizer`, which it wraps
    (``.optimizer``): ``on_step_begin`` and ``on_epoch_end`` are forwarded, and
    ``on_train_end`` restores the maximum power limit (``optimizer.close()``).

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError, NoPermissionError, ConfigError: As the wrapped optimizer.
    """

    def __init__(
        self,
        monitor: Monitor,
        optimum_selector: OptimumSelector | None = None,
        wait_steps: int = 1,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step: int = 25,
        profile_path: str | os.PathLike[str] | None = None,
        *,
        adaptive: bool | AdaptiveOptions = False,
        restore_on_signals: bool = True,
    ) -> None:
        if _TrainerCallback is None:
            raise ImportError(_HF_MISSING) from _hf_error
        super().__init__()
        self.optimizer = _make_optimizer(
            monitor,
            optimum_selector,
            wait_steps,
            warmup_steps,
            profile_steps,
            pl_step,
            profile_path,
            adaptive,
            restore_on_signals,
        )

    # ``model`` may come positionally, as Zeus's hooks take it (the Trainer passes keywords).

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

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """The end of training: restore the maximum power limit."""
        self.optimizer.close()


class LightningPowerLimitOptimizer(_LightningBase):
    """A PyTorch Lightning ``Callback`` finding and applying the optimal GPU power limit.

    Takes the arguments of :class:`~.power_limit.GlobalPowerLimitOptimizer`, which it wraps
    (``.optimizer``): ``on_train_batch_start`` is a step, ``on_train_epoch_end`` an epoch's
    end, and ``on_train_end`` or ``on_exception`` restore the maximum power limit
    (``optimizer.close()``). Each rank of a distributed run has its own callback.

    Raises:
        ImportError: Neither ``lightning`` nor ``pytorch_lightning`` is installed.
        ValueError, NoPermissionError, ConfigError: As the wrapped optimizer.
    """

    def __init__(
        self,
        monitor: Monitor,
        optimum_selector: OptimumSelector | None = None,
        wait_steps: int = 1,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step: int = 25,
        profile_path: str | os.PathLike[str] | None = None,
        *,
        adaptive: bool | AdaptiveOptions = False,
        restore_on_signals: bool = True,
    ) -> None:
        if _LightningCallback is None:
            raise ImportError(_LIGHTNING_MISSING) from _lightning_error
        super().__init__()
        self.optimizer = _make_optimizer(
            monitor,
            optimum_selector,
            wait_steps,
            warmup_steps,
            profile_steps,
            pl_step,
            profile_path,
            adaptive,
            restore_on_signals,
        )

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """The start of a training step."""
        self.optimizer.on_step_begin()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """The end of a training epoch."""
        self.optimizer.on_epoch_end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The end of training: restore the maximum power limit."""
        self.optimizer.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Training failed: restore the maximum power limit."""
        self.optimizer.close()
