"""AMD Instinct GPUs through ``amdsmi`` (issue 37): a placeholder until the backend lands."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType

from ..errors import DriverNotLoadedError
from .base import Device


def amd_present() -> bool:
    """Whether this machine has AMD GPUs that ``amdsmi`` answers for."""
    return False


def open_amd_gpus(
    indices: Sequence[int] | None = None,
    *,
    amdsmi_module: ModuleType | None = None,
    env: Mapping[str, str] | None = None,
    first_index: int = 0,
) -> list[Device]:
    raise DriverNotLoadedError("the amd backend is not built yet")
