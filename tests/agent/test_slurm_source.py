"""The Slurm workload source: jobs read from processes (cgroup v1 and v2 as Slurm writes them,
the environment when readable) and jobs announced by a prolog."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeus_async.agent.slurm import SlurmJob, SlurmSource, job_from_cgroup, parse_gpu_list
from zeus_async.errors import ConfigError
from zeus_async.testing.fake_proc import FakeProc

UUID_A = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
UUID_B = "GPU-0e9a3b11-5c2f-4c6e-9a8e-1f2d3c4b5a69"


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def test_cgroup_v1_forms() -> None:
    assert job_from_cgroup(FakeProc.slurm_v1(1001, 4711, "0")) == ("4711", "0", 1001)
    assert job_from_cgroup(["4:devices:/slurm_node07/uid_5/job_12/step_batch/task_0"]) == (
        "12",
        "batch",
        5,
    )
    assert job_from_cgroup(["3:memory:/slurm/uid_7/job_99/step_extern"]) == ("99", "extern", 7)
    # the job's own cgroup (a prolog's process), no step yet
    assert job_from_cgroup(["3:memory:/slurm/uid_7/job_99"]) == ("99", None, 7)


def test_cgroup_v2_forms() -> None:
    assert job_from_cgroup(FakeProc.slurm_v2(4711, "3")) == ("4711", "3", None)
    assert job_from_cgroup(
        ["0::/system.slice/node07_slurmstepd.scope/job_8/step_interactive/user/task_1"]
    ) == ("8", "interactive", None)
    assert job_from_cgroup(["0::/system.slice/slurmstepd.scope/job_8"]) == ("8", None, None)


def test_cgroups_of_no_slurm_job() -> None:
    assert job_from_cgroup(["0::/"]) is None
    assert job_from_cgroup(["0::/user.slice/user-1000.slice/session-3.scope"]) is None
    assert job_from_cgroup(FakeProc.kubepods("1f2e-33", "abc")) is None
    # slurmd itself is not a job
    assert job_from_cgroup(["0::/system.slice/slurmd.service"]) is None
    assert job_from_cgroup(["0::/system.slice/slurmstepd.scope/system"]) is None


def test_gpu_lists() -> None:
    assert parse_gpu_list("0,2") == (0, 2)
    assert parse_gpu_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_gpu_list(f"{UUID_A}, 1") == (UUID_A, 1)
    assert parse_gpu_list("1,1,0") == (1, 0)
    assert parse_gpu_list("") == ()
    assert parse_gpu_list(None) == ()
    assert parse_gpu_list("(null)") == ()
    assert parse_gpu_list("MIG-5c1e0b6c-2a3e-5b8c-9b1e-7e6a1c2d3e4f,3") == (3,)
    # CUDA_VISIBLE_DEVICES: indices are renumbered inside a job, only UUIDs say which GPU
    assert parse_gpu_list(f"0,{UUID_B}", indices=False) == (UUID_B,)


def test_v1_process_with_environment(proc: FakeProc) -> None:
    proc.add(
        4242,
        uid=1001,
        cgroup=FakeProc.slurm_v1(1001, 4711, "0"),
        environ={
            "SLURM_JOB_ID": "4711",
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_USER": "alice",
            "SLURM_JOB_UID": "1001",
            "SLURM_JOB_PARTITION": "gpu",
            "SLURM_JOB_NAME": "train",
            "SLURM_JOB_GPUS": "0,1,2,3",
            "SLURM_STEP_GPUS": "2,3",
            "CUDA_VISIBLE_DEVICES": "0,1",
            "HOME": "/home/alice",
        },
    )
    assert SlurmSource(proc.root).from_pid(4242) == SlurmJob(
        job_id="4711",
        step="0",
        user="alice",
        uid=1001,
        partition="gpu",
        name="train",
        gpus=(2, 3),
    )


def test_v2_process_batch_step_job_gpus(proc: FakeProc) -> None:
    proc.add(
        77,
        uid=1002,
        cgroup=FakeProc.slurm_v2(900, "batch"),
        environ={
            "SLURM_JOB_ID": "900",
            "SLURM_JOB_USER": "bob",
            "SLURM_JOB_UID": "1002",
            "SLURM_JOB_GPUS": "5",
        },
    )
    assert SlurmSource(proc.root).from_pid(77) == SlurmJob(
        job_id="900", step="batch", user="bob", uid=1002, gpus=(5,)
    )


def test_cuda_visible_uuids_when_slurm_names_no_gpus(proc: FakeProc) -> None:
    proc.add(
        78,
        cgroup=FakeProc.slurm_v2(901, "0"),
        environ={"SLURM_JOB_ID": "901", "CUDA_VISIBLE_DEVICES": f"0,{UUID_A}"},
    )
    assert SlurmSource(proc.root).from_pid(78) == SlurmJob(job_id="901", step="0", gpus=(UUID_A,))


def test_environment_of_another_job_is_ignored(proc: FakeProc) -> None:
    """The cgroup is the kernel's word; the environment is the process's."""
    proc.add(
        79,
        cgroup=FakeProc.slurm_v1(1001, 4711, "1"),
        environ={"SLURM_JOB_ID": "12", "SLURM_JOB_USER": "mallory", "SLURM_JOB_GPUS": "0-7"},
    )
    assert SlurmSource(proc.root).from_pid(79) == SlurmJob(job_id="4711", step="1", uid=1001)


def test_unreadable_environment_gives_the_cgroup_job(proc: FakeProc) -> None:
    proc.add(80, uid=1003, cgroup=FakeProc.slurm_v2(55, "2"), environ=None)
    assert SlurmSource(proc.root).from_pid(80) == SlurmJob(job_id="55", step="2")


def test_environment_alone_where_no_cgroup_names_a_job(proc: FakeProc) -> None:
    """A container's private cgroup namespace shows ``0::/``: the environment is all there is."""
    proc.add(
        81,
        cgroup=["0::/"],
        environ={"SLURM_JOBID": "31", "SLURM_STEPID": "4", "SLURM_STEP_GPUS": "1"},
    )
    assert SlurmSource(proc.root).from_pid(81) == SlurmJob(job_id="31", step="4", gpus=(1,))


def test_processes_of_no_job(proc: FakeProc) -> None:
    proc.add(82, environ={"HOME": "/root"})
    proc.add(83, environ={"SLURM_JOB_ID": "not-a-job"})
    source = SlurmSource(proc.root)
    assert source.from_pid(82) is None
    assert source.from_pid(83) is None
    assert source.from_pid(99999) is None  # gone


def test_register_and_unregister() -> None:
    source = SlurmSource()
    assert source.version == 0
    job = source.register(4711, [0, "1", UUID_A], user="root", partition="gpu")
    assert job == SlurmJob(job_id="4711", user="root", uid=0, partition="gpu", gpus=(0, 1, UUID_A))
    assert source.version == 1
    assert source.register("12", uid=0) == SlurmJob(job_id="12", user="root", uid=0)
    assert source.registered() == {"4711": job, "12": SlurmJob(job_id="12", user="root", uid=0)}
    assert source.unregister("4711") is True
    assert source.unregister(4711) is False
    assert source.version == 3
    assert list(source.registered()) == ["12"]


@pytest.mark.parametrize(
    ("job_id", "gpus", "message"),
    [
        ("47a", [], "not a Slurm job ID: '47a' (expected digits, e.g. 4711)"),
        ("", [], "not a Slurm job ID: '' (expected digits, e.g. 4711)"),
        (5, [-1], "job 5: GPU index -1 is negative"),
        (5, ["cuda:0"], "job 5: GPU 'cuda:0' is neither an index nor a GPU UUID"),
        (5, [1.5], "job 5: GPU 1.5 is neither an index nor a GPU UUID"),
        (5, [True], "job 5: GPU True is neither an index nor a GPU UUID"),
    ],
)
def test_bad_registrations(job_id: object, gpus: list[object], message: str) -> None:
    source = SlurmSource()
    with pytest.raises(ConfigError) as info:
        source.register(job_id, gpus)  # type: ignore[arg-type]
    assert str(info.value) == message
    assert source.version == 0


# Says so once it runs: until then its environment may read empty (mid-execve), even though
# Popen has returned.
READY_CHILD = "import sys; sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process with a crafted Slurm environment, running."""
    env = {
        "SLURM_JOB_ID": "4711",
        "SLURM_STEP_ID": "3",
        "SLURM_JOB_USER": "alice",
        "SLURM_JOB_PARTITION": "a100",
        "SLURM_STEP_GPUS": "2,3",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    child = subprocess.Popen(
        [sys.executable, "-c", READY_CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        yield child
    finally:
        child.kill()
        child.wait()


def test_real_process(sleeper: subprocess.Popen[bytes]) -> None:
    """The real /proc of a real child: its environment is readable (ours), and its cgroup is
    this test's, which is no Slurm job's, so the environment names the job."""
    assert job_from_cgroup(Path(f"/proc/{sleeper.pid}/cgroup").read_text().splitlines()) is None
    assert SlurmSource().from_pid(sleeper.pid) == SlurmJob(
        job_id="4711", step="3", user="alice", partition="a100", gpus=(2, 3)
    )
    assert SlurmSource().from_pid(os.getpid()) is None or "SLURM_JOB_ID" in os.environ
    sleeper.kill()
    sleeper.wait()
    assert SlurmSource().from_pid(sleeper.pid) is None


def test_real_process_user_completion() -> None:
    me = pwd.getpwuid(os.getuid())
    assert SlurmSource().register(1, uid=me.pw_uid).user == me.pw_name
