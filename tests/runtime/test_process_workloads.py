"""Each process sample names the workload its pid works for: the process sampler asks a
``workload_of(pid, gpus)`` callable once per pid and period, with the GPUs the pid was seen on,
and a runtime passes its ``process_workload`` to its sampler."""

from __future__ import annotations

import os
from collections.abc import Sequence

import anyio
import anyio.abc
import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices.base import GpuProcesses
from zeus_async.devices.processes import ProcessStat
from zeus_async.devices.sim import SimConfig
from zeus_async.events import ProcessSample
from zeus_async.runtime import ProcessTracking, Runtime
from zeus_async.runtime.hub import Hub
from zeus_async.runtime.processes import EnergyMeter, ProcessSampler
from zeus_async.testing.fakes import FakeProcessSource

GIB = 1 << 30
T0 = 1_760_000_000 * 1_000_000_000
STAT = ProcessStat(1.0, GIB, GIB, GIB)


class FakeGpu:
    def __init__(self, index: int, reading: GpuProcesses) -> None:
        self.index = index
        self.reading = reading

    def read_processes(self, since_us: int) -> GpuProcesses:
        return self.reading


class Workloads:
    """A scripted ``workload_of``: records each question."""

    def __init__(self, keys: dict[int, str]) -> None:
        self.keys = keys
        self.asked: list[tuple[int, list[int]]] = []

    def __call__(self, pid: int, gpus: Sequence[int]) -> str:
        self.asked.append((pid, list(gpus)))
        return self.keys[pid]


def test_each_sample_names_its_pids_workload_asked_once_per_pid_with_its_gpus() -> None:
    source = FakeProcessSource(stats={7: STAT, 50: STAT})
    gpus = [
        FakeGpu(0, GpuProcesses({50: GIB, 60: GIB}, {50: 0.5}, 1)),
        FakeGpu(1, GpuProcesses({50: GIB}, {}, 1)),
    ]
    workloads = Workloads({7: "uid:1001", 50: "slurm:4711", 60: ""})
    clock = FakeClock(wall_start_ns=T0)
    sampler = ProcessSampler(ProcessTracking(pids=(7,), gpu_all=True), source, gpus, Hub(),
                             clock, "h", EnergyMeter(), workload_of=workloads)  # fmt: skip
    samples = sampler.tick(clock.wall_ns(), {})
    assert {(s.pid, s.gpu): s.workload for s in samples} == {
        (7, None): "uid:1001",
        (50, None): "slurm:4711",
        (50, 0): "slurm:4711",
        (50, 1): "slurm:4711",
        (60, 0): "",  # unknown: no label
    }
    # One question per pid (not per sample), with the GPUs it has samples on.
    assert sorted(workloads.asked) == [(7, []), (50, [0, 1]), (60, [0])]
    # The answer may change from one period to the next (a process read mid-exec).
    workloads.keys[7] = "slurm:9"
    clock.advance_sync(1.0)
    again = {(s.pid, s.gpu): s.workload for s in sampler.tick(clock.wall_ns(), {})}
    assert again[(7, None)] == "slurm:9" and len(workloads.asked) == 6


def test_without_a_callable_samples_name_no_workload() -> None:
    source = FakeProcessSource(stats={7: STAT})
    clock = FakeClock(wall_start_ns=T0)
    sampler = ProcessSampler(ProcessTracking(pids=(7,)), source, [], Hub(), clock, "h",
                             EnergyMeter())  # fmt: skip
    assert [s.workload for s in sampler.tick(clock.wall_ns(), {})] == [""]


def test_a_failing_callable_leaves_the_workload_empty_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(pid: int, gpus: Sequence[int]) -> str:
        raise RuntimeError("resolver defect")

    source = FakeProcessSource(stats={7: STAT, 8: STAT})
    clock = FakeClock(wall_start_ns=T0)
    sampler = ProcessSampler(ProcessTracking(pids=(7, 8)), source, [], Hub(), clock, "h",
                             EnergyMeter(), workload_of=broken)  # fmt: skip
    with caplog.at_level("WARNING"):
        first = sampler.tick(clock.wall_ns(), {})
        clock.advance_sync(1.0)
        second = sampler.tick(clock.wall_ns(), {})
    assert [s.workload for s in first + second] == ["", "", "", ""]
    assert sampler.stats.errors == 4
    assert sum("finding the workload of process" in r.message for r in caplog.records) == 1


@pytest.mark.anyio
async def test_a_runtime_passes_process_workload_to_its_sampler() -> None:
    me = os.getpid()
    clock = FakeClock(wall_start_ns=T0)
    sim = SimConfig(num_gpus=2, process_pids=(me,))
    workloads = Workloads({me: "k8s:ns/pod/main"})
    samples: list[ProcessSample] = []

    async def consumer(stream: anyio.abc.ObjectReceiveStream[object]) -> None:
        async for event in stream:
            if isinstance(event, ProcessSample):
                samples.append(event)

    async with Runtime(backend="sim", cpus=None, clock=clock, sim_config=sim, host="h",
                       processes=ProcessTracking(pids=(me,), period_s=1.0),
                       process_source=FakeProcessSource(stats={me: STAT}),
                       process_workload=workloads, consumers=[consumer]):  # fmt: skip
        while len({s.t_ns for s in samples}) < 2:
            await anyio.sleep(0)  # the fake clock jumps whenever every task waits on it
    assert {(s.pid, s.gpu) for s in samples} == {(me, None), (me, 0), (me, 1)}
    assert {s.workload for s in samples} == {"k8s:ns/pod/main"}
    assert workloads.asked[0] == (me, [0, 1])  # asked from the first period on
