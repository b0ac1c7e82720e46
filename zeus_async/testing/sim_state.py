"""What the simulated driver holds for a node: read it or reset it from any process.

The GPU simulator keeps settable state (power limit, locked SM clocks, persistence mode) node-wide,
in a file shared by every process simulating the same configuration
(:mod:`zeus_async.devices.sim_state`). A test can therefore check, from a fresh process and after
a job has exited, whether the job restored the GPUs::

    states = read_sim_node_state(config)
    assert all(s.power_limit_w == config.power_limit_default_w for s in states)

Without ``config``, both functions use the node of ``ZEUS_ASYNC_SIM`` (like
:meth:`SimNode.from_env <zeus_async.devices.sim.SimNode.from_env>`), else ``SimConfig()``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NamedTuple

from ..devices.sim_config import SIM_ENV_VAR, SimConfig, load_sim_config
from ..devices.sim_state import NodeStateFile, clamp_state

__all__ = ["SimGpuState", "read_sim_node_state", "reset_sim_node_state", "sim_node_state_path"]

logger = logging.getLogger(__name__)


class SimGpuState(NamedTuple):
    """Settable state of one simulated GPU, as every process of the node sees it.

    Attributes:
        gpu: GPU index.
        power_limit_w: Power limit (W).
        locked_sm_clocks_mhz: ``(min, max)`` locked SM clock range, or ``None``.
        persistence_mode: Persistence mode.
        changed_ns: Wall time (ns) of the last change, or ``None`` if the GPU has never been set
            (it has the configuration's defaults).
    """

    gpu: int
    power_limit_w: float
    locked_sm_clocks_mhz: tuple[int, int] | None
    persistence_mode: bool
    changed_ns: int | None

    def is_default(self, config: SimConfig) -> bool:
        """Whether the settings are the defaults of ``config`` (limit, no lock, persistence)."""
        return (
            self.power_limit_w == config.power_limit_default_w
            and self.locked_sm_clocks_mhz is None
            and self.persistence_mode == config.persistence_mode
        )


def _config(config: SimConfig | None) -> SimConfig:
    if config is not None:
        return config
    value = os.environ.get(SIM_ENV_VAR)
    return load_sim_config(value) if value else SimConfig()


def sim_node_state_path(config: SimConfig | None = None) -> Path:
    """Path of the node state file of ``config`` (it may not exist).

    Raises:
        ConfigError: The private directory is not safe to use.
    """
    return NodeStateFile(_config(config)).path


def read_sim_node_state(config: SimConfig | None = None) -> list[SimGpuState]:
    """The settable state of each GPU of the node of ``config`` (index order).

    Raises:
        ConfigError: The private directory is not safe to use, or ``ZEUS_ASYNC_SIM`` is invalid.
        OSError: The state file exists but cannot be read.
    """
    cfg = _config(config)
    state, _ = NodeStateFile(cfg).read()
    gpus = {} if state is None else state.gpus
    out: list[SimGpuState] = []
    for index in range(cfg.num_gpus):
        limit, lock, persistence, changed = clamp_state(cfg, gpus.get(index))
        out.append(SimGpuState(index, limit, lock, persistence, changed))
    return out


def reset_sim_node_state(config: SimConfig | None = None) -> None:
    """Put every GPU of the node of ``config`` back to the configuration's defaults (running
    simulators take them on their next look at the state file).

    Raises:
        ConfigError: The private directory is not safe to use, or the file cannot be written.
    """
    NodeStateFile(_config(config)).reset()
