"""A monitor made before a launcher said which rank the process is (Lightning's ``ddp`` rank 0,
``ddp_spawn``, accelerate's notebook launcher) measures every GPU until then, then the rank's;
it pickles to the processes a launcher spawns and rebuilds itself in a forked child; the
power-limit optimizer built on it touches no GPU before the GPUs are resolved. Simulated
node of 4 GPUs, real processes where processes are the point."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import select
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from zeus_async import Monitor
from zeus_async.devices.sim import SimConfig
from zeus_async.optimizer import GlobalPowerLimitOptimizer, Ready, Warmup
from zeus_async.testing import read_sim_node_state

CONFIG = SimConfig(num_gpus=4)
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
)


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """A script started by hand: no launcher has spoken yet."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def monitor() -> Iterator[Monitor]:
    with Monitor(sampler="thread", sim_config=CONFIG, sync_execution_with=None) as m:
        yield m


def _launch(monkeypatch: pytest.MonkeyPatch, local_rank: int) -> None:
    """What Lightning's ddp launcher does in rank 0's process inside ``trainer.fit()``."""
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NODE_RANK", "0")


def _gpus(monitor: Monitor, name: str) -> list[int]:
    """The GPUs a window opened now measures."""
    monitor.begin_window(name)
    return sorted(monitor.end_window(name).wait(5).gpu_energy_j)


def test_the_rank_is_taken_at_the_first_window_once_the_launcher_spoke(
    monitor: Monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert monitor.gpu_indices == [0, 1, 2, 3]
    assert not monitor.gpus_resolved
    assert _gpus(monitor, "before") == [0, 1, 2, 3]  # no launcher yet: a single process
    assert not monitor.gpus_resolved
    _launch(monkeypatch, 1)
    assert _gpus(monitor, "after") == [1]
    assert monitor.gpu_indices == [1]
    assert monitor.gpus_resolved
    assert (monitor.rank.local_rank, monitor.rank.world_size) == (1, 2)
    monitor.push_window()  # the monitor keeps working as before
    result = monitor.pop_window(exact=True)
    assert len(result.energy) == 1 and result.energy[0] > 0


def test_windows_open_on_every_gpu_keep_it_until_they_end(
    monitor: Monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor.begin_window("around-fit")
    _launch(monkeypatch, 1)
    assert _gpus(monitor, "inside") == [0, 1, 2, 3]
    assert not monitor.gpus_resolved
    assert sorted(monitor.end_window("around-fit").wait(5).gpu_energy_j) == [0, 1, 2, 3]
    assert _gpus(monitor, "next") == [1]


def test_a_frameworks_device_wins_and_final_fixes_the_gpus(
    monitor: Monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    _launch(monkeypatch, 0)
    # Lightning's devices=[2, 3]: rank 0's root device is cuda:2, whatever LOCAL_RANK says.
    assert monitor.resolve_gpus([2])
    assert monitor.gpu_indices == [2]
    assert monitor.resolve_gpus(local_rank=1)  # not final yet: the framework may correct it
    assert monitor.gpu_indices == [1]
    assert monitor.resolve_gpus(final=True)
    assert monitor.resolve_gpus([3]) and monitor.gpu_indices == [1]  # fixed now


def test_with_no_launcher_final_keeps_every_gpu(
    monitor: Monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert monitor.resolve_gpus(final=True)
    _launch(monkeypatch, 1)
    assert _gpus(monitor, "w") == [0, 1, 2, 3]


def test_the_optimizer_touches_no_gpu_before_they_are_resolved(
    monitor: Monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt = GlobalPowerLimitOptimizer(
        monitor,
        wait_steps=0,
        warmup_steps=1,
        profile_steps=1,
        pl_step=250,
        restore_on_signals=False,
    )
    assert opt.power_limits == [700, 450, 200]
    assert [s.changed_ns for s in read_sim_node_state(CONFIG)] == [None] * 4
    opt.close()  # closed before it started: still nothing to restore, nothing touched
    assert [s.changed_ns for s in read_sim_node_state(CONFIG)] == [None] * 4

    opt = GlobalPowerLimitOptimizer(
        monitor,
        wait_steps=0,
        warmup_steps=1,
        profile_steps=1,
        pl_step=250,
        restore_on_signals=False,
    )
    _launch(monkeypatch, 1)
    opt.on_step_begin()  # the first step: rank 1's GPU, at the maximum, then warming up 700 W
    opt.on_step_begin()
    assert monitor.gpu_indices == [1]
    opt.on_step_begin()  # profiling 700 W done: 450 W next (set without waiting)
    deadline = time.monotonic() + 10
    while read_sim_node_state(CONFIG)[1].power_limit_w != 450 and time.monotonic() < deadline:
        time.sleep(0.01)
    limits = [s.power_limit_w for s in read_sim_node_state(CONFIG)]
    assert limits == [700, 450, 700, 700]
    opt.close()
    states = read_sim_node_state(CONFIG)
    assert all(s.is_default(CONFIG) for s in states)
    assert [s.changed_ns is not None for s in states] == [False, True, False, False]


def test_the_optimizer_waits_while_windows_opened_on_every_gpu_are_open(
    monitor: Monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt = GlobalPowerLimitOptimizer(
        monitor,
        wait_steps=0,
        warmup_steps=1,
        profile_steps=1,
        pl_step=250,
        restore_on_signals=False,
    )
    monitor.begin_window("around-fit")
    _launch(monkeypatch, 1)
    for _ in range(3):
        opt.on_step_begin()
    assert opt.state == Ready(700, 1) and not monitor.gpus_resolved
    assert [s.changed_ns for s in read_sim_node_state(CONFIG)] == [None] * 4
    monitor.end_window("around-fit")
    opt.on_step_begin()
    assert monitor.gpu_indices == [1] and isinstance(opt.state, Warmup)
    opt.close()
    states = read_sim_node_state(CONFIG)
    assert [s.changed_ns is not None for s in states] == [False, True, False, False]


def _rank_in_spawned_process(payload: bytes, rank: int, how: str, out: Any) -> None:
    monitor = pickle.loads(payload)
    if how == "launcher":
        os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE="2")  # as ddp_spawn sets them
    else:  # torch.multiprocessing.spawn and a process group, no variable at all
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=how, rank=rank, world_size=2)
    out.put(json.dumps({"pid": os.getpid(), "gpus": _gpus(monitor, "step")}))
    monitor.close()


@pytest.mark.parametrize("how", ["launcher", "group"])
def test_a_pickled_monitor_samples_in_the_process_that_unpickles_it(
    monitor: Monitor, how: str
) -> None:
    payload = pickle.dumps(monitor)
    assert len(payload) < 4096  # its arguments, not its sampler
    if how == "group":
        pytest.importorskip("torch")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            how = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    procs = [
        context.Process(target=_rank_in_spawned_process, args=(payload, rank, how, queue))
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    answers = sorted((json.loads(queue.get()) for _ in procs), key=lambda a: a["gpus"])
    assert [a["gpus"] for a in answers] == [[0], [1]]
    assert all(a["pid"] != os.getpid() for a in answers)
    # This process's monitor was neither closed nor changed by theirs.
    assert _gpus(monitor, "parent") == [0, 1, 2, 3]


def test_a_forked_child_builds_its_own_sampler_and_leaves_the_parents(monitor: Monitor) -> None:
    assert _gpus(monitor, "before") == [0, 1, 2, 3]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: accelerate's notebook launcher sets the rank, then trains
        code = 1
        try:
            os.close(read)
            os.environ.update(LOCAL_RANK="1", WORLD_SIZE="2", RANK="1")
            os.write(write, json.dumps(_gpus(monitor, "child")).encode())
            monitor.close()
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        if not select.select([f], [], [], 60)[0]:
            os.kill(pid, signal.SIGKILL)
        answer = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert json.loads(answer) == [1]
    assert _gpus(monitor, "after") == [0, 1, 2, 3]  # the parent's sampler still runs


def test_a_change_without_gpus_goes_to_the_ranks_gpu_once_the_launcher_spoke(
    monitor: Monitor, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 34: set_power_limit() on a monitor made before the launcher changed every GPU of
    the node, the job's or not."""
    _launch(monkeypatch, 1)
    monitor.set_power_limit(300).result(5)
    limits = [g.power_limit_w for g in read_sim_node_state()]
    assert limits[1] == 300 and 300 not in (limits[0], limits[2], limits[3]), limits
    assert "every GPU watched" not in caplog.text
    monitor.release().result(5)


def test_a_change_before_any_launcher_says_it_goes_to_every_gpu(
    monitor: Monitor, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="zeus_async.monitor")
    monitor.set_power_limit(300).result(5)
    assert "changing the power limit of every GPU watched (0, 1, 2, 3)" in caplog.text
    monitor.release().result(5)
