"""Lightning's own launchers with the README's usage: ``Monitor()`` made before the launcher
said which rank the process is (real processes, torch CPU over gloo, 4 simulated GPUs).

Under ``ddp`` rank 0 is the script's own process, which had no ``LOCAL_RANK`` when it made its
monitor; under ``ddp_spawn`` the ranks unpickle the callbacks holding it. The CPU accelerator
stands for a GPU job through the rank → GPU mapping every Monitor uses for a rank (``LOCAL_RANK``
r measures GPU r, as under torchrun): the job's GPUs are 0 and 1, and 2 and 3 are another
job's. ``lightning_launch_job.py`` prints each rank's figures.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import sim_env

JOB = Path(__file__).with_name("lightning_launch_job.py")
CONFIG = SimConfig(num_gpus=4)
IDLE_W = CONFIG.idle_w  # each simulated GPU, idle


def _need(module: str) -> None:
    """``.ci/run`` installs Lightning and requires it; elsewhere these tests skip."""
    if os.environ.get("ZEUS_ASYNC_REQUIRE_FRAMEWORKS"):
        importlib.import_module(module)
    else:
        pytest.importorskip(module)


def _launch(strategy: str) -> tuple[list[dict[str, Any]], str]:
    _need("lightning")
    proc = subprocess.run(
        [sys.executable, str(JOB), strategy],
        env=sim_env(CONFIG),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return sorted(outs, key=lambda o: int(o["rank"])), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_monitor_made_before_the_launcher_measures_and_caps_the_jobs_gpus_only(
    strategy: str,
) -> None:
    outs, stderr = _launch(strategy)
    assert [(o["rank"], o["local_rank"]) for o in outs] == [(0, 0), (1, 1)]
    # The job's energy: each rank's GPU over its span, summed (the simulator's exact integral).
    node = SimNode(CONFIG, shared_state=False)
    truth = sum(node.truth_energy_j(o["local_rank"], o["t0_ns"], o["t1_ns"]) for o in outs)
    for o in outs:
        assert o["metrics"]["train_gpu_energy_j"] == pytest.approx(truth, rel=0.02)
        assert o["metrics"]["train_gpu_power_w"] == pytest.approx(2 * IDLE_W, rel=0.02)
    # The optimizer profiled every limit on the job's GPUs, and both ranks chose alike.
    assert [m["power_limit"] for m in outs[0]["measurements"]] == [700, 450, 200]
    assert outs[1]["measurements"] == outs[0]["measurements"]
    assert outs[1]["optimal"] == outs[0]["optimal"] is not None
    assert "LeaseConflictError" not in stderr
    assert "could not restore" not in stderr
    states = read_sim_node_state(CONFIG)
    # Every limit is back to the default, and GPUs 2 and 3 were never set at all.
    assert all(s.is_default(CONFIG) for s in states), states
    assert [s.changed_ns is not None for s in states] == [True, True, False, False], states
