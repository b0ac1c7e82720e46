"""Training-framework callbacks around :class:`~.power_limit.GlobalPowerLimitOptimizer`.

One module per framework, each importing only its own framework, and only when used:

* :mod:`zeus_async.optimizer.hf` — :class:`~.hf.HFGlobalPowerLimitOptimizer`, a Hugging Face
  ``transformers.TrainerCallback`` (``Trainer(..., callbacks=[HFGlobalPowerLimitOptimizer(
  monitor)])``), the drop-in for Zeus's class of the same name
  (``pip install 'zeus_async[hf]'``);
* :mod:`zeus_async.optimizer.lightning` — :class:`~.lightning.LightningPowerLimitOptimizer`, a
  PyTorch Lightning ``Callback`` from ``lightning.pytorch`` or, failing that,
  ``pytorch_lightning`` (``pip install 'zeus_async[lightning]'``).

This module names both (``from zeus_async.optimizer.integrations import
HFGlobalPowerLimitOptimizer`` imports transformers, not Lightning, and importing this module
imports neither). A framework that is missing makes constructing its callback raise
:class:`ImportError` saying what to install. Each callback forwards the framework's hooks to
the optimizer it wraps (``.optimizer``) and restores the maximum power limit when training
ends.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import TYPE_CHECKING, Any

from .power_limit import GlobalPowerLimitOptimizer

if TYPE_CHECKING:
    from .hf import HFGlobalPowerLimitOptimizer as HFGlobalPowerLimitOptimizer
    from .lightning import LightningPowerLimitOptimizer as LightningPowerLimitOptimizer

__all__ = ["HFGlobalPowerLimitOptimizer", "LightningPowerLimitOptimizer"]

logger = logging.getLogger(__name__)

HF_MISSING = "HFGlobalPowerLimitOptimizer needs transformers: pip install 'zeus_async[hf]'"
LIGHTNING_MISSING = (
    "LightningPowerLimitOptimizer needs lightning: pip install 'zeus_async[lightning]'"
)


def base_class(modules: tuple[str, ...], name: str) -> tuple[type, BaseException | None]:
    """Attribute ``name`` of the first of ``modules`` that imports; else ``object`` and why
    not (the callback then raises :class:`ImportError` when built)."""
    error: BaseException | None = None
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name), None
        except ImportError as exc:  # not installed
            error = exc
        except Exception as exc:  # installed but broken: report it when the callback is built
            logger.debug("importing %s.%s failed", module, name, exc_info=True)
            error = exc
    return object, error


#: What the callbacks take: the optimizer's own arguments.
_OPTIMIZER_SIGNATURE = inspect.signature(GlobalPowerLimitOptimizer)


class OptimizerCallback:
    """What both callbacks share: they take the arguments of
    :class:`~.power_limit.GlobalPowerLimitOptimizer` (checked against its signature, so a
    wrong one fails as it would there) and build the optimizer they forward hooks to
    (``.optimizer``). A subclass names its framework's base class after this one, and sets
    ``_missing``/``_missing_error`` when that framework is not available."""

    _missing: str = ""
    _missing_error: BaseException | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self._missing:
            raise ImportError(self._missing) from self._missing_error
        bound = _OPTIMIZER_SIGNATURE.bind(*args, **kwargs)
        super().__init__()
        self.optimizer: GlobalPowerLimitOptimizer = GlobalPowerLimitOptimizer(**bound.arguments)


def __getattr__(name: str) -> Any:
    """The callbacks, each imported (with its framework) on first use."""
    if name == "HFGlobalPowerLimitOptimizer":
        from .hf import HFGlobalPowerLimitOptimizer

        return HFGlobalPowerLimitOptimizer
    if name == "LightningPowerLimitOptimizer":
        from .lightning import LightningPowerLimitOptimizer

        return LightningPowerLimitOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
