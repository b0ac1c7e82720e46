"""Rank awareness: the launcher's variables, per-rank paths, and two real ranks writing the
same-script paths without a collision."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from zeus_async.devices.sim_config import SimConfig
from zeus_async.errors import ConfigError
from zeus_async.events import GpuSample
from zeus_async.ranks import RankInfo, rank_info, rank_path
from zeus_async.store import RecordingReader
from zeus_async.testing.procs import run_ranks, sim_env


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, (0, 0, 1, None, "")),
        (  # torchrun, accelerate
            {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "2"},
            (5, 1, 8, 2, "RANK"),
        ),
        (  # Lightning's children
            {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "NODE_RANK": "1"},
            (3, 1, 4, 1, "RANK"),
        ),
        (  # Lightning's launching process: no global rank yet
            {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "NODE_RANK": "0"},
            (0, 0, 2, 0, "LOCAL_RANK"),
        ),
        (
            {"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "SLURM_NTASKS": "8", "SLURM_NODEID": "1"},
            (7, 3, 8, 1, "SLURM_PROCID"),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "4",
            },
            (2, 0, 4, None, "OMPI_COMM_WORLD_RANK"),
        ),
        # torchrun's variables win over Slurm's (torchrun under srun).
        (
            {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
            (1, 1, 2, None, "RANK"),
        ),
    ],
)
def test_each_launcher_is_understood(
    env: dict[str, str], want: tuple[int, int, int, int | None, str]
) -> None:
    info = rank_info(env)
    assert (info.rank, info.local_rank, info.world_size, info.node, info.launcher) == want
    assert info.host


def test_a_malformed_variable_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"\$RANK must be a whole number, not 'one'"):
        rank_info({"RANK": "one", "WORLD_SIZE": "2"})


RANK1 = RankInfo(rank=1, local_rank=1, world_size=4, node=0, host="n1")


@pytest.mark.parametrize(
    ("path", "info", "want"),
    [
        ("run.zarc", RankInfo(host="h"), "run.zarc"),  # one process: as given
        ("run.zarc", RANK1, "run.rank1.zarc"),  # several: never one file for all
        ("out/w.csv", RANK1, "out/w.rank1.csv"),
        ("log", RANK1, "log.rank1"),
        ("run.{rank}.zarc", RANK1, "run.1.zarc"),
        ("{host}/{node}-{local_rank}-of-{world_size}.zarc", RANK1, "n1/0-1-of-4.zarc"),
        ("{node}.zarc", RankInfo(rank=1, world_size=2, host="h"), "h.zarc"),  # no node index
    ],
)
def test_rank_paths(path: str, info: RankInfo, want: str) -> None:
    assert rank_path(path, info) == Path(want)


def test_a_job_file_keeps_its_name_on_every_rank() -> None:
    assert rank_path("profile.json", RANK1, per_rank=False) == Path("profile.json")
    assert rank_path("p-{node}.json", RANK1, per_rank=False) == Path("p-0.json")


@pytest.mark.parametrize(
    ("path", "message"),
    [("run.{rnak}.zarc", r"unknown placeholder \{rnak\}"), ("run.{rank.zarc", "expected")],
)
def test_bad_placeholders_are_config_errors(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rank_path(path, RANK1)


RANK_SCRIPT = """
import sys, time
from zeus_async import Monitor
with Monitor(record=sys.argv[1], log_file=sys.argv[2], backend="sim") as mon:
    assert mon.gpu_indices == [int(sys.argv[3])], mon.gpu_indices
    for k in range(3):
        mon.begin_window(f"step{k}")
        time.sleep(0.05)
        mon.end_window(f"step{k}").wait(timeout=5)
print("done", flush=True)
"""


def test_two_ranks_with_the_same_paths_write_their_own_files(tmp_path: Path) -> None:
    # The usual same-script job: every rank passes record="run.zarc", log_file="w.csv".
    config = SimConfig(num_gpus=2, seed=4)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, "run.zarc", "w.csv", str(rank)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=sim_env(
                config,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                ZEUS_ASYNC_AGENT="off",
            ),
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.strip() == "done", err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "run.rank0.zarc",
        "run.rank1.zarc",
        "w.rank0.csv",
        "w.rank1.csv",
    ]
    for rank in (0, 1):
        reader = RecordingReader(tmp_path / f"run.rank{rank}.zarc")
        samples = [e for e in reader if isinstance(e, GpuSample)]
        assert reader.report.clean and samples
        # Each rank measured its own GPU only, and says which rank it is.
        assert {e.gpu for e in samples} == {rank}
        assert reader.header.meta["rank"] == str(rank)
        assert reader.header.meta["world_size"] == "2"
        with (tmp_path / f"w.rank{rank}.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert [r["name"] for r in rows] == ["step0", "step1", "step2"]
        assert {r["rank"] for r in rows} == {str(rank)} and all(r["host"] for r in rows)
        assert all(f"gpu{rank}_energy_j" in r for r in rows)


JOB_SCRIPT = """
import sys
import torch.distributed as dist
from zeus_async.events import Measurement
from zeus_async.ranks import job_energy

class Result:  # a window's result on this rank: GPU r drew 10 * (r + 1) J
    def __init__(self, rank):
        self.m = Measurement("h", 0, "step", 0, 0, 0, 1.0, {rank: 10.0 * (rank + 1)})
    def wait(self, timeout=None):
        return self.m

dist.init_process_group("gloo", init_method="env://")
print(job_energy(Result(dist.get_rank())), flush=True)
dist.destroy_process_group()
"""


def test_the_energy_of_a_window_over_every_rank() -> None:
    pytest.importorskip("torch")
    outputs = run_ranks([sys.executable, "-c", JOB_SCRIPT], sim_env(SimConfig()))
    assert [float(out) for out in outputs] == [30.0, 30.0]  # the job's figure, on every rank


def test_the_energy_of_a_window_in_one_process() -> None:
    from zeus_async.events import Measurement
    from zeus_async.ranks import job_energy

    class Result:
        def wait(self, timeout: float | None = None) -> Measurement:
            return Measurement("h", 0, "w", 0, 0, 0, 1.0, {0: 2.0, 1: 3.0})

    assert job_energy(Result()) == 5.0  # type: ignore[arg-type]
