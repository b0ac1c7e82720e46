"""``CUDA_VISIBLE_DEVICES`` as CUDA reads it, mapped onto NVML indices.

NVML ignores ``CUDA_VISIBLE_DEVICES``; CUDA applies it, so GPU ``cuda:0`` in a training script is
the first *visible* GPU. To report the GPUs the script uses under the indices it uses, the NVML
backend applies the same rules as CUDA:

* unset: every GPU; empty string: no GPU;
* comma-separated entries, each an NVML index or a GPU UUID (``GPU-8932f937-...``, any unique
  prefix, ``GPU-`` optional);
* parsing stops at the first invalid entry (out of range, negative such as ``-1``, unknown or
  ambiguous UUID, repeated GPU, garbage); the entries before it still count;
* MIG devices (``MIG-...``) are refused with a clear error: NVML cannot measure the power of a MIG
  slice.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Callable, Sequence

from ..errors import ConfigError

__all__ = ["parse_cuda_visible_devices"]

logger = logging.getLogger(__name__)

_HEX = frozenset(string.hexdigits + "-")


def _uuid_match(entry: str, uuids: Sequence[str]) -> int | None:
    prefix = entry.lower()
    if not prefix.startswith("gpu-"):
        if not set(prefix) <= _HEX:
            return None
        prefix = "gpu-" + prefix
    matches = [i for i, u in enumerate(uuids) if u and u.lower().startswith(prefix)]
    return matches[0] if len(matches) == 1 else None


def parse_cuda_visible_devices(
    value: str | None,
    count: int,
    uuids: Callable[[], Sequence[str]] | Sequence[str] = (),
) -> list[int]:
    """NVML indices CUDA exposes for ``CUDA_VISIBLE_DEVICES=value``, in CUDA order.

    Args:
        value: The variable's value, ``None`` when unset.
        count: Number of GPUs NVML reports.
        uuids: UUID of each NVML index, or a callable returning them (called only when an
            entry is not an integer, so the common case costs no NVML calls).

    Raises:
        ConfigError: A MIG device is listed.
    """
    if value is None:
        return list(range(count))
    table: Sequence[str] | None = None if callable(uuids) else uuids
    out: list[int] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.upper().startswith("MIG-"):
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES lists a MIG device ({entry}); NVML cannot measure MIG "
                "slices, set CUDA_VISIBLE_DEVICES to whole GPUs (indices or GPU-UUIDs)"
            )
        index: int | None = None
        try:
            index = int(entry)
        except ValueError:
            if entry:  # not an integer: a GPU UUID (prefix), looked up once
                if table is None:
                    table = list(uuids()) if callable(uuids) else uuids
                index = _uuid_match(entry, table)
        else:
            if not 0 <= index < count:
                index = None
        if index is None or index in out:
            if entry:
                logger.info("CUDA_VISIBLE_DEVICES: stopping at invalid entry %r", entry)
            break
        out.append(index)
    return out
