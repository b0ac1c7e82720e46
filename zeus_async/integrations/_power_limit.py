"""What the power-limit optimizer's framework callbacks share (imports no framework).

The callbacks themselves live with the rest of their framework's integration, one module per
framework, each importing only its own framework, and only when used:

* :mod:`zeus_async.integrations.hf` — :class:`~.hf.HFGlobalPowerLimitOptimizer`, a Hugging
  Face ``transformers.TrainerCallback`` (``Trainer(..., callbacks=[
  HFGlobalPowerLimitOptimizer(monitor)])``), the drop-in for Zeus's class of the same name
  (``pip install 'zeus_async[hf]'``);
* :mod:`zeus_async.integrations.lightning` — :class:`~.lightning.LightningPowerLimitOptimizer`,
  a PyTorch Lightning ``Callback`` from ``lightning.pytorch`` or, failing that,
  ``pytorch_lightning`` (``pip install 'zeus_async[lightning]'``).

This module is private and framework-neutral: it names neither callback, so that each
framework's module imports it and nothing imports back (no import circle). A framework that is
missing makes constructing its callback raise :class:`ImportError` saying what to install.
Each callback forwards the framework's hooks to the optimizer it wraps (``.optimizer``) and
restores the maximum power limit when training ends.

A monitor made at the top of the script, before the framework's launcher said which rank
this process is (Lightning's ``ddp`` runs rank 0 as the script's own process; ``ddp_spawn``
starts the ranks later), measures every GPU until then: when training is set up, each
callback gives it the rank's device (Lightning's ``trainer.strategy.root_device``, the
Trainer's ``args.device``; else the rank's local rank) and starts the optimizer on it
(:meth:`Monitor.resolve_gpus <zeus_async.Monitor.resolve_gpus>`). No GPU is touched before.
The callbacks pickle (``ddp_spawn`` sends them to the ranks): a rank that unpickles one gets
a monitor and an optimizer of its own, made there at first use.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from ..optimizer.power_limit import GlobalPowerLimitOptimizer

__all__ = [
    "HF_MISSING",
    "LIGHTNING_MISSING",
    "OptimizerCallback",
    "base_class",
    "hf_rank",
    "lightning_rank",
    "power_limit_metrics",
    "resolve_gpus",
]

logger = logging.getLogger(__name__)

HF_MISSING = "HFGlobalPowerLimitOptimizer needs transformers: pip install 'zeus_async[hf]'"
LIGHTNING_MISSING = (
    "LightningPowerLimitOptimizer needs lightning: pip install 'zeus_async[lightning]'"
)


def lightning_rank(trainer: Any) -> tuple[list[int] | None, int | None]:
    """This rank's GPU from a Lightning ``Trainer`` in a job of several ranks: the strategy's
    CUDA root device, else (CPU, or another accelerator) its local rank; ``(None, None)`` for a
    single process (its monitor keeps every GPU, as in any single process)."""
    if int(getattr(trainer, "world_size", 1) or 1) <= 1:
        return None, None
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    if getattr(device, "type", None) == "cuda":
        index = getattr(device, "index", None)
        return [0 if index is None else int(index)], None
    return None, int(getattr(trainer, "local_rank", 0))


def hf_rank(args: Any) -> tuple[list[int] | None, int | None]:
    """This rank's GPU from Hugging Face ``TrainingArguments`` (see :func:`lightning_rank`)."""
    if int(getattr(args, "world_size", 1) or 1) <= 1:
        return None, None
    device = getattr(args, "device", None)
    if getattr(device, "type", None) == "cuda":
        index = getattr(device, "index", None)
        return [0 if index is None else int(index)], None
    local = getattr(args, "local_process_index", None)
    return None, int(getattr(args, "local_rank", 0) if local is None else local)


def resolve_gpus(monitor: Any, rank: tuple[list[int] | None, int | None]) -> None:
    """Tell ``monitor`` this rank's GPU (``rank``: :func:`lightning_rank`'s answer), so that
    one made before the launcher spoke measures it (a monitor stand-in without
    ``resolve_gpus`` is left as it is)."""
    resolve = getattr(monitor, "resolve_gpus", None)
    if resolve is not None:
        gpus, local_rank = rank
        resolve(gpus, local_rank=local_rank)


def power_limit_metrics(optimizer: Any) -> dict[str, float]:
    """What the callbacks put in the framework's logs: the power limit the optimizer set
    (``power_limit_w``: being profiled, or chosen) and, once chosen, ``optimal_power_limit_w``
    (Zeus printed its choice; here it is also a metric beside the loss)."""
    metrics: dict[str, float] = {}
    current = getattr(optimizer, "current_power_limit", None)
    if current is not None:
        metrics["power_limit_w"] = float(current)
    optimal = getattr(optimizer, "optimal_power_limit", None)
    if optimal is not None:
        metrics["optimal_power_limit_w"] = float(optimal)
    return metrics


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
    :class:`~zeus_async.optimizer.power_limit.GlobalPowerLimitOptimizer` (checked against its
    signature, so a wrong one fails as it would there) and build the optimizer they forward
    hooks to (``.optimizer``). A subclass names its framework's base class after this one, and sets
    ``_missing``/``_missing_error`` when that framework is not available."""

    _missing: str = ""
    _missing_error: BaseException | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self._missing:
            raise ImportError(self._missing) from self._missing_error
        bound = _OPTIMIZER_SIGNATURE.bind(*args, **kwargs)
        super().__init__()
        self._arguments: dict[str, Any] = dict(bound.arguments)
        self._optimizer: GlobalPowerLimitOptimizer | None = GlobalPowerLimitOptimizer(
            **self._arguments
        )

    @property
    def optimizer(self) -> GlobalPowerLimitOptimizer:
        """The optimizer the hooks drive. In a process that unpickled this callback (a
        ``ddp_spawn`` rank) it is made at first use there, on that process's monitor."""
        if self._optimizer is None:
            self._optimizer = GlobalPowerLimitOptimizer(**self._arguments)
        return self._optimizer

    def __getstate__(self) -> dict[str, Any]:
        """The optimizer's arguments (its monitor pickles as its own arguments), not the
        optimizer: it holds this process's locks, signal handlers and GPU settings."""
        state = dict(self.__dict__)
        state["_optimizer"] = None
        return state

    def _start(self, rank: tuple[list[int] | None, int | None]) -> None:
        """Training is set up (the ranks launched): the monitor takes this rank's GPU and the
        optimizer starts on it (:meth:`GlobalPowerLimitOptimizer.start
        <zeus_async.optimizer.power_limit.GlobalPowerLimitOptimizer.start>`)."""
        resolve_gpus(self._arguments.get("monitor"), rank)
        start = getattr(self.optimizer, "start", None)
        if start is not None:
            start()
