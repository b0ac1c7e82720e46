"""Apple Silicon energy through IOReport, issue 37: a placeholder until the backend lands."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import DriverNotLoadedError
from .base import Device


def apple_present() -> bool:
    """Whether this is an Apple Silicon Mac whose IOReport energy channels can be read."""
    return False


def open_apple_gpus(
    indices: Sequence[int] | None = None,
    *,
    source: Any = None,
    first_index: int = 0,
) -> list[Device]:
    raise DriverNotLoadedError("the apple backend is not built yet")
