"""Test helpers that users can use too.

* :mod:`zeus_async.testing.sim_pynvml` — the GPU simulator behind the ``pynvml`` API;
* :mod:`zeus_async.testing.sim_state` — the simulated node's settable state (power limit, locked
  clocks, persistence), shared by every process: :func:`read_sim_node_state`,
  :func:`reset_sim_node_state`;
* :mod:`zeus_async.testing.fakes` — scripted devices for runtime tests;
* :mod:`zeus_async.testing.fake_sysfs` — a fake RAPL powercap tree;
* :mod:`zeus_async.testing.procs` — real processes on a simulated node (a node agent, the
  restore job, their environment);
* :mod:`zeus_async.testing.recording` — a real recorder fed from a list of events.
"""

from __future__ import annotations

from .sim_state import SimGpuState as SimGpuState
from .sim_state import read_sim_node_state as read_sim_node_state
from .sim_state import reset_sim_node_state as reset_sim_node_state
from .sim_state import sim_node_state_path as sim_node_state_path

__all__ = ["SimGpuState", "read_sim_node_state", "reset_sim_node_state", "sim_node_state_path"]
