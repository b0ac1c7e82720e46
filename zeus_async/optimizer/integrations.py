"""Deprecated: the framework callbacks are in :mod:`zeus_async.integrations.hf` and
:mod:`zeus_async.integrations.lightning`, what they share in the private
:mod:`zeus_async.integrations._power_limit`.

Every name this module had still works, with a :class:`DeprecationWarning` naming its new
path. Importing this module imports nothing (no framework, and none of the modules that
moved); a name, looked up, imports its new module (a callback: its framework with it).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any

logger = logging.getLogger(__name__)

_SHARED = "zeus_async.integrations._power_limit"

#: Each name this module had, and the module it is now in.
_MOVED = {
    "HFGlobalPowerLimitOptimizer": "zeus_async.integrations.hf",
    "LightningPowerLimitOptimizer": "zeus_async.integrations.lightning",
    "GlobalPowerLimitOptimizer": "zeus_async.optimizer",
    **{
        name: _SHARED
        for name in (
            "HF_MISSING",
            "LIGHTNING_MISSING",
            "OptimizerCallback",
            "base_class",
            "hf_rank",
            "lightning_rank",
            "power_limit_metrics",
            "resolve_gpus",
        )
    },
}


def __getattr__(name: str) -> Any:
    """A moved name, from its new module, warning the caller (``stacklevel=2``: its line)."""
    new = _MOVED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"{__name__}.{name} moved: import it from {new}", DeprecationWarning, stacklevel=2
    )
    return getattr(importlib.import_module(new), name)
