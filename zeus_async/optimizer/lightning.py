"""Deprecated: the Lightning power-limit callback is in :mod:`zeus_async.integrations.lightning`.

``from zeus_async.optimizer.lightning import LightningPowerLimitOptimizer`` still gives the
same class, with a :class:`DeprecationWarning` naming the new path: a Lightning user now
imports everything for it (energy in the logs too) from one module. Importing this module
imports nothing; the name, looked up, imports its new module (and Lightning with it).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any

logger = logging.getLogger(__name__)

#: Each name this module had, and the module it is now in.
_MOVED = {"LightningPowerLimitOptimizer": "zeus_async.integrations.lightning"}


def __getattr__(name: str) -> Any:
    """A moved name, from its new module, warning the caller (``stacklevel=2``: its line)."""
    new = _MOVED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"{__name__}.{name} moved: import it from {new}", DeprecationWarning, stacklevel=2
    )
    return getattr(importlib.import_module(new), name)
