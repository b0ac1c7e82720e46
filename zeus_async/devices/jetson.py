"""NVIDIA Jetson power rails (INA3221 sysfs), issue 37: a placeholder until the backend lands."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import DriverNotLoadedError
from .base import Device


def jetson_present() -> bool:
    """Whether this machine has Jetson INA3221 power rails in sysfs."""
    return False


def open_jetson_gpus(
    indices: Sequence[int] | None = None,
    *,
    root: str | Path | None = None,
    fs: Any = None,
    first_index: int = 0,
) -> list[Device]:
    raise DriverNotLoadedError("the jetson backend is not built yet")
