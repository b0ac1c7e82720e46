"""Building blocks of :mod:`zeus_async.testing.sim_pynvml`: the real pynvml, codes, handles.

Constants, error classes and result structs come from the *real* nvidia-ml-py module whenever it
is importable (:func:`load_real_pynvml` never mistakes the shim for it), else from
:mod:`._nvml_fallback`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ..devices.sim import SimGpu

logger = logging.getLogger(__name__)

#: Directory whose ``pynvml.py`` re-exports this module (put it first on ``PYTHONPATH``).
SHIM_DIR = Path(__file__).resolve().parent / "_pynvml_shim"
_REAL_ALIAS = "_zeus_async_real_pynvml"


def _is_real(module: ModuleType) -> bool:
    return hasattr(module, "_LoadNvmlLibrary") and not getattr(module, "__zeus_async_sim__", False)


def _load_private(paths: list[str]) -> ModuleType | None:
    if _REAL_ALIAS in sys.modules:
        return sys.modules[_REAL_ALIAS]
    found = importlib.machinery.PathFinder.find_spec("pynvml", paths)
    if found is None or found.origin is None:
        return None
    # Load under the alias: nvidia-ml-py attaches its error classes to sys.modules[__name__].
    spec = importlib.util.spec_from_file_location(_REAL_ALIAS, found.origin)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_REAL_ALIAS] = module  # nvidia-ml-py looks itself up in sys.modules
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[_REAL_ALIAS]
        raise
    return module


def load_real_pynvml() -> ModuleType | None:
    """The real nvidia-ml-py module, without ever importing the shim in its place."""
    try:
        current = sys.modules.get("pynvml")
        if current is not None and _is_real(current):
            return current
        paths = [p for p in sys.path if Path(p or ".").resolve() != SHIM_DIR]
        if current is None:
            spec = importlib.util.find_spec("pynvml")
            if spec is not None and spec.origin and Path(spec.origin).resolve().parent != SHIM_DIR:
                module = importlib.import_module("pynvml")
                if _is_real(module):
                    return module
        return _load_private(paths)
    except Exception as exc:  # a broken install must not break the simulator
        logger.debug("real pynvml not importable (%s); using built-in constants", exc)
        return None


_real = load_real_pynvml()
if _real is None:
    from . import _nvml_fallback as _fallback

    _src: Any = _fallback
else:
    _src = _real

NVMLError: Any = _src.NVMLError

# NVML return codes used below (C ABI values; identical in every nvidia-ml-py version).
UNINITIALIZED, INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION = 1, 2, 3, 4
NOT_FOUND, FUNCTION_NOT_FOUND, GPU_IS_LOST, ARG_VERSION_MISMATCH = 6, 13, 15, 25
FI_TOTAL_ENERGY, FI_ENERGY = 83, 191
FI_POWER_AVERAGE, FI_POWER_INSTANT = 185, 186
FI_POWER_MIN, FI_POWER_MAX, FI_POWER_DEFAULT, FI_POWER_CURRENT = 187, 188, 189, 190
SCOPE_GPU, SCOPE_MODULE, SCOPE_MEMORY = 0, 1, 2
VT_UINT, VT_ULL = 1, 3
CLOCK_LIMIT_ID_START = 0xFFFFFF00
VIDEO_CLOCK_MHZ = 1755
UNSET_INSTANCE_ID = 0xFFFFFFFF
TEMPERATURE_V1 = 0x100000C
MEMORY_V2 = 0x02000028


class Handle:
    """A device handle (what ``nvmlDeviceGetHandleBy*`` returns)."""

    __slots__ = ("gpu", "index")

    def __init__(self, gpu: SimGpu) -> None:
        self.gpu = gpu
        self.index = gpu.index

    def __repr__(self) -> str:
        return f"<sim nvmlDevice {self.index}>"
