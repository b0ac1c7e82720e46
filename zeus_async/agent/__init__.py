"""The node agent: one owner of the GPUs per node, leases on hardware settings, and the
journal that puts them back however a job stops (``docs/agent.md``)."""

from __future__ import annotations

from .leases import Restored, recover_orphans

__all__ = ["Restored", "recover_orphans"]
