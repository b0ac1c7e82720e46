"""The workload resolver: which job, pod or user holds each GPU and each process, with a label
set that stays bounded however many jobs come and go."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeus_async.agent.slurm import SlurmSource
from zeus_async.agent.workloads import UNKNOWN, Workload, WorkloadResolver
from zeus_async.clock import FakeClock
from zeus_async.errors import ConfigError
from zeus_async.testing.fake_proc import FakeProc

S = 1_000_000_000
UUIDS = [f"GPU-{i}{i}{i}{i}0000-aaaa-bbbb-cccc-dddddddddddd" for i in range(8)]


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _resolver(proc: FakeProc, clock: FakeClock, **kw: object) -> WorkloadResolver:
    return WorkloadResolver(
        slurm=SlurmSource(proc.root),
        gpu_uuids=UUIDS,
        expire_s=60,
        clock=clock,
        **kw,  # type: ignore[arg-type]
    )


def test_bad_settings() -> None:
    with pytest.raises(ConfigError, match=r"^expire_s must be >= 0, got -1$"):
        WorkloadResolver(expire_s=-1)
    with pytest.raises(ConfigError, match=r"^max_pids must be >= 1, got 0$"):
        WorkloadResolver(max_pids=0)


def test_slurm_processes_and_their_job(proc: FakeProc, clock: FakeClock) -> None:
    env = {
        "SLURM_JOB_ID": "4711",
        "SLURM_JOB_USER": "alice",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_GPUS": "0,1",
    }
    proc.add(100, uid=1001, comm="python", cgroup=FakeProc.slurm_v1(1001, 4711, "0"), environ=env)
    proc.add(101, uid=1001, comm="python", cgroup=FakeProc.slurm_v1(1001, 4711, "1"), environ=env)
    proc.add(102, uid=1001, comm="bash", cgroup=FakeProc.slurm_v1(1001, 4711, "batch"))
    r = _resolver(proc, clock)
    job = Workload(
        kind="slurm",
        key="slurm:4711",
        job_id="4711",
        user="alice",
        uid=1001,
        partition="gpu",
        command="train",
        started_ns=clock.wall_ns(),
    )
    assert r.for_pid(100) == Workload(
        kind="slurm",
        key="slurm:4711",
        job_id="4711",
        step="0",
        user="alice",
        uid=1001,
        partition="gpu",
        command="python",
        started_ns=clock.wall_ns(),
    )
    assert r.for_pid(101).step == "1"
    assert (r.for_pid(102).key, r.for_pid(102).step, r.for_pid(102).command) == (
        "slurm:4711",
        "batch",
        "bash",
    )
    assert r.for_gpu(0) == job
    assert r.for_gpu(UUIDS[1]) == job
    assert r.for_gpu(2) is None
    assert r.workloads() == [job]


def test_a_job_is_known_from_its_prolog_before_any_process(
    proc: FakeProc, clock: FakeClock
) -> None:
    slurm = SlurmSource(proc.root)
    r = WorkloadResolver(slurm=slurm, gpu_uuids=UUIDS, expire_s=60, clock=clock)
    slurm.register(9, gpus=[UUIDS[3], 4], user="root", partition="a100")
    job = Workload(
        kind="slurm",
        key="slurm:9",
        job_id="9",
        user="root",
        uid=0,
        partition="a100",
        started_ns=clock.wall_ns(),
    )
    assert r.for_gpu(3) == job
    assert r.for_gpu(4) == job
    clock.advance_sync(5)
    slurm.unregister(9)  # the epilog: ended at once, no refresh needed
    assert r.for_gpu(3) is None
    assert r.workloads() == [
        Workload(
            kind="slurm",
            key="slurm:9",
            job_id="9",
            user="root",
            uid=0,
            partition="a100",
            started_ns=clock.wall_ns() - 5 * S,
            ended_ns=clock.wall_ns(),
        )
    ]


def test_which_claim_on_a_gpu_wins(proc: FakeProc, clock: FakeClock) -> None:
    """Registration > pod > a job's environment > a process seen on the GPU; then the
    workload that started last."""
    slurm = SlurmSource(proc.root)
    r = WorkloadResolver(slurm=slurm, gpu_uuids=UUIDS, expire_s=60, clock=clock)
    proc.add(200, uid=1001, comm="python")  # a plain process, seen on GPUs 0 and 1
    assert r.for_pid(200, gpus=[0, UUIDS[1]]).key == "uid:1001"
    assert r.for_gpu(0).key == "uid:1001"  # type: ignore[union-attr]
    assert r.for_gpu(1).key == "uid:1001"  # type: ignore[union-attr]

    clock.advance_sync(1)
    proc.add(
        201, cgroup=FakeProc.slurm_v2(5, "0"), environ={"SLURM_JOB_ID": "5", "SLURM_STEP_GPUS": "1"}
    )
    assert r.for_pid(201).key == "slurm:5"
    assert r.for_gpu(1).key == "slurm:5"  # type: ignore[union-attr]

    clock.advance_sync(1)
    slurm.register(6, gpus=[0, 1])
    assert r.for_gpu(0).key == "slurm:6"  # type: ignore[union-attr]
    assert r.for_gpu(1).key == "slurm:6"  # type: ignore[union-attr]

    clock.advance_sync(1)
    slurm.register(7, gpus=[1])  # two registrations: the later one
    assert r.for_gpu(1).key == "slurm:7"  # type: ignore[union-attr]
    slurm.unregister(7)
    slurm.unregister(6)
    assert r.for_gpu(1).key == "slurm:5"  # type: ignore[union-attr]
    assert r.for_gpu(0).key == "uid:1001"  # type: ignore[union-attr]


def test_a_reused_pid_is_resolved_again(proc: FakeProc, clock: FakeClock) -> None:
    r = _resolver(proc, clock)
    proc.add(300, cgroup=FakeProc.slurm_v2(42, "0"), environ={"SLURM_JOB_GPUS": "2"})
    assert r.for_pid(300).key == "slurm:42"
    proc.remove(300)
    proc.add(300, uid=1002, comm="vim")  # exited, and its pid went to another process
    assert r.for_pid(300).key == "slurm:42"  # until the next refresh (documented)
    clock.advance_sync(1)
    r.refresh()
    assert r.for_pid(300) == Workload(
        kind="process", key="uid:1002", uid=1002, command="vim", started_ns=clock.wall_ns()
    )
    assert {w.key: w.ended_ns for w in r.workloads()} == {
        "slurm:42": clock.wall_ns(),
        "uid:1002": None,
    }
    assert r.for_gpu(2) is None


def test_a_gone_process_is_unknown(proc: FakeProc, clock: FakeClock) -> None:
    r = _resolver(proc, clock)
    assert r.for_pid(4242) is UNKNOWN
    assert r.workloads() == []


def test_the_process_cache_is_bounded(proc: FakeProc, clock: FakeClock) -> None:
    """Least recently asked for go first; a workload no cached process holds ends."""
    r = _resolver(proc, clock, max_pids=2)
    for pid, uid in ((1, 2001), (2, 2002), (3, 2003)):
        proc.add(pid, uid=uid)
        assert r.for_pid(pid).key == f"uid:{uid}"
    r.refresh()
    assert {w.key: w.ended_ns is None for w in r.workloads()} == {
        "uid:2001": False,
        "uid:2002": True,
        "uid:2003": True,
    }
    assert r.for_pid(1).ended_ns is None  # asked again: back, and 2002 is now the oldest
    r.refresh()
    assert {w.key: w.ended_ns is None for w in r.workloads()} == {
        "uid:2001": True,
        "uid:2002": False,
        "uid:2003": True,
    }


def test_label_set_bounded_over_1000_registered_jobs(clock: FakeClock) -> None:
    """A job starts every second and runs 10 s; ended ones are kept 60 s. At any time 10 run
    and 61 ended ones are kept (those that ended 0..60 s ago): exactly 71, and none once
    the last has been gone 60 s."""
    slurm = SlurmSource()
    r = WorkloadResolver(slurm=slurm, gpu_uuids=UUIDS, expire_s=60, clock=clock)
    sizes = []
    for t in range(1080):
        clock.set_ns(t * S)
        if t < 1000:
            slurm.register(t + 1, gpus=[t % 8])
        if 10 <= t < 1010:
            slurm.unregister(t - 9)
        r.refresh()
        sizes.append(len(r.workloads()))
        if t < 1000:
            assert r.for_gpu(t % 8).key == f"slurm:{t + 1}"  # type: ignore[union-attr]
    assert max(sizes) == 71
    assert sizes[70:1000] == [71] * 930
    assert sizes[1069] == 1  # the last job ended at 1009 s, and is kept until 1069 s
    assert sizes[1070:] == [0] * 10


def test_label_set_bounded_over_1000_jobs_seen_in_proc(proc: FakeProc, clock: FakeClock) -> None:
    """The same, with jobs learned only from their processes (no prolog): a job ends when its
    last process is gone."""
    r = _resolver(proc, clock)
    sizes = []
    for t in range(1080):
        clock.set_ns(t * S)
        if t < 1000:
            proc.add(10_000 + t, uid=1000 + t % 7, cgroup=FakeProc.slurm_v2(t + 1, "0"))
            assert r.for_pid(10_000 + t).key == f"slurm:{t + 1}"
        if 10 <= t < 1010:
            proc.remove(10_000 + t - 10)
        r.refresh()
        sizes.append(len(r.workloads()))
    assert max(sizes) == 71
    assert sizes[70:1000] == [71] * 930
    assert sizes[1070:] == [0] * 10


# Says so once it runs: until then its environment may read empty (mid-execve), even though
# Popen has returned.
READY_CHILD = "import sys; sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for child in started:
            child.kill()
            child.wait()


def _start(env: dict[str, str], started: list[subprocess.Popen[bytes]]) -> int:
    child = subprocess.Popen(
        [sys.executable, "-c", READY_CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    started.append(child)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child.pid


def test_a_process_mid_exec_is_read_again(proc: FakeProc, clock: FakeClock) -> None:
    """Its environment reads empty until the kernel has laid it out: not settled until then."""
    r = _resolver(proc, clock)
    env = {"SLURM_JOB_ID": "8", "SLURM_JOB_USER": "alice", "SLURM_JOB_GPUS": "1"}
    proc.add(600, uid=1001, comm="python", environ={})
    assert r.for_pid(600).key == "uid:1001"
    proc.add(600, uid=1001, comm="python", environ=env, start=proc.add(601))  # same start
    assert r.for_pid(600).key == "slurm:8"
    # settled: read no more (a changed file is not read again)
    proc.add(600, uid=1001, comm="python", environ={"SLURM_JOB_ID": "9"}, start=1000)
    assert r.for_pid(600).key == "slurm:8"

    # a Slurm job's cgroup names it at once; the environment, once there, completes it
    proc.add(602, uid=1001, comm="python", cgroup=FakeProc.slurm_v2(8, "0"), environ={})
    assert (r.for_pid(602, gpus=[3]).key, r.for_pid(602).user) == ("slurm:8", "alice")
    proc.add(603, uid=1002, comm="python", environ={})
    start = proc.add(604, uid=1002, comm="python", cgroup=FakeProc.slurm_v2(10, "0"), environ={})
    assert r.for_pid(604, gpus=[5]).step == "0"
    proc.add(
        604,
        uid=1002,
        comm="python",
        cgroup=FakeProc.slurm_v2(10, "0"),
        start=start,
        environ={"SLURM_JOB_ID": "10", "SLURM_JOB_USER": "bob"},
    )
    r.refresh()  # read again at refresh, and what it was seen using is kept
    assert r.for_gpu(5).user == "bob"  # type: ignore[union-attr]


def test_real_processes(children: list[subprocess.Popen[bytes]], clock: FakeClock) -> None:
    """Real children in the real /proc: a plain one is its user's, one with a Slurm
    environment is its job's, and both end once they exited."""
    plain = _start({"HOME": "/"}, children)
    in_job = _start(
        {
            "SLURM_JOB_ID": "4711",
            "SLURM_STEP_ID": "3",
            "SLURM_JOB_USER": "alice",
            "SLURM_JOB_PARTITION": "a100",
            "SLURM_STEP_GPUS": "2,3",
        },
        children,
    )
    me = os.getuid()
    command = Path(sys.executable).name[:15]  # the kernel's: the name exec was given
    r = WorkloadResolver(slurm=SlurmSource(), expire_s=60, clock=clock)
    assert r.for_pid(plain, gpus=[0]) == Workload(
        kind="process",
        key=f"uid:{me}",
        uid=me,
        user=pwd.getpwuid(me).pw_name,
        command=command,
        started_ns=clock.wall_ns(),
    )
    job = Workload(
        kind="slurm",
        key="slurm:4711",
        job_id="4711",
        user="alice",
        uid=me,
        partition="a100",
        started_ns=clock.wall_ns(),
    )
    assert r.for_pid(in_job) == Workload(
        kind="slurm",
        key="slurm:4711",
        job_id="4711",
        step="3",
        user="alice",
        uid=me,
        partition="a100",
        command=command,
        started_ns=clock.wall_ns(),
    )
    assert [r.for_gpu(g) for g in range(4)] == [r.workloads()[0], None, job, job]
    r.refresh()
    assert all(w.ended_ns is None for w in r.workloads())

    clock.advance_sync(1)
    for child in children:
        child.kill()
        child.wait()
    r.refresh()
    assert [(w.key, w.ended_ns) for w in r.workloads()] == [
        (f"uid:{me}", clock.wall_ns()),
        ("slurm:4711", clock.wall_ns()),
    ]
    assert [r.for_gpu(g) for g in range(4)] == [None] * 4
    clock.advance_sync(61)
    r.refresh()
    assert r.workloads() == []


def test_a_job_its_epilog_ended_holds_no_gpu_whatever_its_stragglers_say(
    tmp_path: Path,
) -> None:
    """A job's process still alive after the epilog (a straggler) named the job's GPUs in
    its environment: the GPUs were still the job's, and its energy went on counting."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(500, uid=0, comm="python", environ={"SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "1"})
    slurm = SlurmSource(proc_root=proc.root)
    resolver = WorkloadResolver(slurm=slurm, proc_root=proc.root)
    slurm.register(77, gpus=[1], user="root", uid=0)
    assert resolver.for_pid(500).key == "slurm:77"
    assert resolver.for_gpu(1) is not None
    slurm.unregister(77)
    assert resolver.for_gpu(1) is None
    assert resolver.for_pid(500).key == "slurm:77"  # still the job's process
    slurm.register(77, gpus=[1], user="root", uid=0)  # announced again: its GPU again
    w = resolver.for_gpu(1)
    assert w is not None and w.key == "slurm:77"


@pytest.mark.parametrize(
    "cgroup",
    [
        "0::/kubepods/burstable/pod6f1c3e2a-59b1-4c1e-9a55-0123456789ab/cafe01",
        "0::/kubepods.slice/kubepods-burstable.slice/"
        "kubepods-burstable-pod6f1c3e2a_59b1_4c1e_9a55_0123456789ab.slice/cri-containerd-cafe01.scope",
    ],
)
def test_a_process_of_a_pod_with_no_gpu_is_its_pods_by_uid(tmp_path: Path, cgroup: str) -> None:
    """Issue 36 (cgroups for CPU): a pod that holds no GPU is not in the kubelet's GPU list;
    its processes were their user's. Now they are their pod's, by the UID their cgroup names."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(900, uid=1000, cgroup=(cgroup,))
    resolver = WorkloadResolver(proc_root=proc.root)
    w = resolver.for_pid(900)
    assert (w.kind, w.key) == ("kubernetes", "k8s-pod:6f1c3e2a-59b1-4c1e-9a55-0123456789ab")
    assert w.key in {k.key for k in resolver.workloads()}
