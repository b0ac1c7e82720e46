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
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
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


STRATEGIES = ["ddp", "ddp_spawn"]
#: What one launch left: its ranks' figures (rank order), its stderr, its private directory.
Launched = tuple[list[dict[str, Any]], str, str]


@pytest.fixture(scope="module")
def launched(request: pytest.FixtureRequest) -> Iterator[Callable[[str], Launched]]:
    """``launched(strategy)``: that launch, run to its end.

    The launches of every selected strategy start together when the first is needed: each is
    its own job with its own private directory (``ZEUS_ASYNC_DIR``: its agent, leases and
    simulated node), so they share nothing, and the interpreter starts and Lightning imports
    that are most of each launch's time overlap instead of queueing."""
    selected = {
        item.callspec.params["strategy"]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.module is request.module
        and hasattr(item, "callspec")
    }
    outputs = Path(tempfile.mkdtemp(prefix="zl-"))  # files, not pipes: nobody reads them yet
    jobs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    if importlib.util.find_spec("lightning") is not None:
        for strategy in (s for s in STRATEGIES if s in selected):
            private = tempfile.mkdtemp(prefix="za-")
            env = sim_env(CONFIG, ZEUS_ASYNC_DIR=private)
            with (
                open(outputs / f"{strategy}.out", "wb") as out,
                open(outputs / f"{strategy}.err", "wb") as err,
            ):
                proc = subprocess.Popen(
                    [sys.executable, str(JOB), strategy], env=env, stdout=out, stderr=err
                )
            jobs[strategy] = (proc, private)

    def launch(strategy: str) -> Launched:
        _need("lightning")
        proc, private = jobs[strategy]
        proc.wait(timeout=150)
        stdout = (outputs / f"{strategy}.out").read_text()
        stderr = (outputs / f"{strategy}.err").read_text()
        assert proc.returncode == 0, stderr[-4000:]
        outs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        return sorted(outs, key=lambda o: int(o["rank"])), stderr, private

    yield launch
    for proc, private in jobs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(private, ignore_errors=True)
    shutil.rmtree(outputs, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_monitor_made_before_the_launcher_measures_and_caps_the_jobs_gpus_only(
    strategy: str, launched: Callable[[str], Launched], monkeypatch: pytest.MonkeyPatch
) -> None:
    outs, stderr, private = launched(strategy)
    monkeypatch.setenv("ZEUS_ASYNC_DIR", private)  # that job's simulated node, read below
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
