"""Rank side: clock control through the monitor, the frequency controller, the optimizer's hooks."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest
from pfo_helpers import running_server

from zeus_async import Monitor
from zeus_async.errors import ConfigError
from zeus_async.events import ClockChange
from zeus_async.optimizer.pipeline import (
    FrequencyController,
    JobInfo,
    PfoClient,
    PfoServerError,
    PipelineFrequencyOptimizer,
    load_prof,
)
from zeus_async.store import RecordingReader
from zeus_async.testing import sim_pynvml


@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_monitor_sets_and_resets_sm_clocks(sampler: str, tmp_path: Path) -> None:
    path = tmp_path / "clocks.zarc"
    with Monitor(
        backend="sim", sampler=sampler, gpu_indices=[1], record=path, sync_execution_with=None
    ) as m:
        m.set_sm_clocks(1200, source="t").result(timeout=30)
        if sampler == "thread":
            node = sim_pynvml.current_node()
            assert node is not None and node.gpus[1].locked_sm_clocks_mhz == (1200, 1200)
        m.set_sm_clocks(None, source="t").result(timeout=30)
        with pytest.raises(ConfigError, match="positive number of MHz"):
            m.set_sm_clocks(-5).result(timeout=30)
        with pytest.raises(ConfigError, match="not controlled"):
            m.set_sm_clocks(1000, [7]).result(timeout=30)
    changes = [e for e in RecordingReader(path) if isinstance(e, ClockChange)]
    assert [(c.gpu, c.min_hz, c.max_hz, c.source) for c in changes] == [
        (1, 1200e6, 1200e6, "t"),
        (1, None, None, "t"),
    ]


class _SlowMonitor:
    """Records set_sm_clocks calls; completes them only when told (a change in flight)."""

    def __init__(self) -> None:
        from concurrent.futures import Future

        self.calls: list[float | None] = []
        self.futures: list[Future[object]] = []
        self._future = Future

    def set_sm_clocks(self, mhz: float | None, gpus: object = None, *, source: str = "") -> object:
        f = self._future()
        self.calls.append(mhz)
        self.futures.append(f)
        if mhz is None:
            f.set_result([])
        return f


def test_frequency_controller_coalesces_to_the_latest_request() -> None:
    mon = _SlowMonitor()
    ctl = FrequencyController(mon, 0)  # type: ignore[arg-type]
    ctl.set_frequency(1500)
    for mhz in (1400, 1300, 1200):  # while 1500 is in flight: only the target moves
        ctl.set_frequency(mhz)
    ctl.set_frequency(0)  # 0 = leave the clock as it is
    assert mon.calls == [1500]
    mon.futures[0].set_result([])  # 1500 lands -> the latest target (1200) is sent
    assert mon.calls == [1500, 1200] and ctl.applied == 1500
    mon.futures[1].set_result([])
    assert ctl.applied == 1200 and ctl.changes == 2
    ctl.set_frequency(1200)  # already there: nothing sent
    assert mon.calls == [1500, 1200]
    ctl.set_frequency(1000)
    mon.futures[2].set_exception(RuntimeError("lost"))  # a failure is logged, not raised
    ctl.set_frequency(1000)  # and the next request tries again
    assert mon.calls == [1500, 1200, 1000, 1000]
    ctl.set_frequency(900)  # asked for while 1000 is in flight...
    assert not ctl.settled(1200)  # (1200 is in force, but a change is on its way)
    mon.futures[3].set_exception(RuntimeError("lost"))
    assert mon.calls[-1] == 900  # ... and sent when 1000 fails, not dropped
    mon.futures[4].set_result([])
    assert ctl.settled(900)
    ctl.reset()
    assert mon.calls[-1] is None and ctl.applied is None


def _plan(tmp_path: Path) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps([[["forward", 1500], ["forward", 1200], ["backward", 990]]]))
    return str(path)


def test_single_rank_optimizer_applies_reports_and_resets(tmp_path: Path) -> None:
    args = {"solution_path": _plan(tmp_path)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        monitor = Monitor(
            backend="sim",
            sampler="thread",
            gpu_indices=[0],
            sample_period=0.005,
            sync_execution_with=None,
        )
        node = sim_pynvml.current_node()
        assert node is not None
        gpu = node.gpus[0]
        pfo = PipelineFrequencyOptimizer(
            rank=0, dp_rank=0, pp_rank=0, tp_rank=0, device_id=0, dp_degree=1, pp_degree=1,
            tp_degree=1, world_size=1, server_url=ep, monitor=monitor, warmup_iters=1,
            profile_iters=2, restore_on_signals=False,
        )  # fmt: skip
        assert pfo.schedule.frequencies == [("forward", 1500), ("forward", 1200), ("backward", 990)]
        seen = []
        for _ in range(3):
            pfo.on_step_begin()
            for name in ("forward", "forward", "backward"):
                pfo.on_instruction_begin(name)
                threading.Event().wait(0.01)  # the clock lands on the runtime's thread
                seen.append(gpu.locked_sm_clocks_mhz)
                pfo.on_instruction_end(name)
            pfo.on_step_end()
        assert seen[-3:] == [(1500, 1500), (1200, 1200), (990, 990)]
        for _ in range(200):  # the background thread reports round 0 and fetches round 1
            if pfo.round == 0:
                pfo.on_step_begin()
                for name in ("forward", "forward", "backward"):
                    pfo.on_instruction_begin(name)
                    pfo.on_instruction_end(name)
                pfo.on_step_end()
            threading.Event().wait(0.02)
        assert pfo.round >= 1
        # wrong instruction order and too many instructions are refused
        pfo.on_step_begin()
        with pytest.raises(RuntimeError, match="should be 'forward', not 'backward'"):
            pfo.on_instruction_begin("backward")
        for name in ("forward", "forward", "backward"):
            pfo.on_instruction_begin(name)
        with pytest.raises(RuntimeError, match="one more"):
            pfo.on_instruction_begin("forward")
        pfo.close()
        assert gpu.locked_sm_clocks_mhz is None  # reset on close
        monitor.close()
        job_dir = next((tmp_path / "dump").iterdir())
    (result,) = load_prof(job_dir, 0)
    assert len(result.iter_time) == 2 and len(result.iter_energy) == 2
    assert [len(x) for x in result.time_breakdown["forward"]] == [2, 2]
    assert [len(x) for x in result.time_breakdown["backward"]] == [1, 1]
    assert all(e > 0 for it in result.energy_breakdown["forward"] for e in it)
    assert all(t >= 0.01 for it in result.time_breakdown["backward"] for t in it)


def test_signal_resets_clocks_then_calls_the_previous_handler(tmp_path: Path) -> None:
    args = {"solution_path": _plan(tmp_path)}
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))
    try:
        with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
            monitor = Monitor(
                backend="sim", sampler="thread", gpu_indices=[0], sync_execution_with=None
            )
            node = sim_pynvml.current_node()
            assert node is not None
            pfo = PipelineFrequencyOptimizer(
                rank=0, dp_rank=0, pp_rank=0, tp_rank=0, device_id=0, dp_degree=1,
                pp_degree=1, tp_degree=1, world_size=1, server_url=ep, monitor=monitor,
            )  # fmt: skip
            pfo.on_step_begin()
            pfo.on_instruction_begin("forward")
            for _ in range(100):
                if node.gpus[0].locked_sm_clocks_mhz is not None:
                    break
                threading.Event().wait(0.01)
            assert node.gpus[0].locked_sm_clocks_mhz == (1500, 1500)
            handler = signal.getsignal(signal.SIGTERM)
            assert callable(handler)
            handler(signal.SIGTERM, None)
            assert calls == [signal.SIGTERM]
            assert node.gpus[0].locked_sm_clocks_mhz is None
            assert signal.getsignal(signal.SIGTERM) is not handler  # uninstalled on close
            monitor.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_registration_errors_are_clear(tmp_path: Path) -> None:
    args = {"solution_path": _plan(tmp_path)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        with pytest.raises(ConfigError, match=r"after torch\.distributed\.init_process_group"):
            PipelineFrequencyOptimizer(
                rank=1, dp_rank=0, pp_rank=1, tp_rank=0, device_id=0, dp_degree=1, pp_degree=2,
                tp_degree=1, world_size=2, server_url=ep,
            )  # fmt: skip
        with pytest.raises(ValueError, match="world_size"):
            PipelineFrequencyOptimizer(
                rank=0, dp_rank=0, pp_rank=0, tp_rank=0, device_id=0, dp_degree=1, pp_degree=1,
                tp_degree=2, world_size=1, server_url=ep,
            )  # fmt: skip
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args, max_jobs=1) as (
        _,
        ep,
    ):
        PfoClient(ep).register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
        with pytest.raises(PfoServerError) as full:  # the server's code reaches the rank
            PipelineFrequencyOptimizer(
                rank=0, dp_rank=0, pp_rank=0, tp_rank=0, device_id=0, dp_degree=1, pp_degree=1,
                tp_degree=1, world_size=1, server_url=ep,
            )  # fmt: skip
        assert full.value.code == "busy" and "maximum of 1 jobs" in full.value.message
    with pytest.raises(TimeoutError, match="no reply from the PFO server"):
        PfoClient("tcp://127.0.0.1:9", timeout_s=0.3).info()
    with pytest.raises(ConfigError, match="tcp://host:port"):
        PfoClient("localhost:7787")


def test_a_reset_controller_never_locks_the_clock_again() -> None:
    mon = _SlowMonitor()
    ctl = FrequencyController(mon, 0)  # type: ignore[arg-type]
    ctl.set_frequency(1500)
    ctl.set_frequency(1200)  # waits behind 1500
    ctl.reset()  # e.g. SIGTERM: handed off after 1500, so applied after it
    mon.futures[0].set_result([])  # 1500 lands late: 1200 must not follow the reset
    ctl.set_frequency(990)  # training went on after the signal
    assert mon.calls == [1500, None]


def test_close_after_a_signal_and_from_another_thread_leaves_clocks_reset(tmp_path: Path) -> None:
    args = {"solution_path": _plan(tmp_path)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        monitor = Monitor(
            backend="sim", sampler="thread", gpu_indices=[0], sync_execution_with=None
        )
        node = sim_pynvml.current_node()
        assert node is not None
        pfo = PipelineFrequencyOptimizer(
            rank=0, dp_rank=0, pp_rank=0, tp_rank=0, device_id=0, dp_degree=1, pp_degree=1,
            tp_degree=1, world_size=1, server_url=ep, monitor=monitor, restore_on_signals=True,
        )  # fmt: skip
        pfo.on_step_begin()
        pfo.on_instruction_begin("forward")
        closer = threading.Thread(target=pfo.close)  # e.g. a framework's shutdown hook
        closer.start()
        closer.join(30)
        assert node.gpus[0].locked_sm_clocks_mhz is None
        # training finishes its step after the close: nothing locks the clock again
        pfo.on_instruction_end("forward")
        pfo.on_instruction_begin("forward")
        pfo.on_instruction_end("forward")
        pfo.on_instruction_begin("backward")
        pfo.on_instruction_end("backward")
        pfo.on_step_end()
        threading.Event().wait(0.1)
        assert node.gpus[0].locked_sm_clocks_mhz is None
        pfo.close()
        monitor.close()


ALTERNATING = [("forward", 1500), ("forward", 990), ("backward", 1500), ("backward", 990)]


def _run_alternating(
    tmp_path: Path,
    *,
    clock_wait_s: float,
    gap_s: float,
    latency_s: float = 0.02,
    wait_for_lower_clocks: bool = True,
) -> tuple[PipelineFrequencyOptimizer, list[bool], list[object]]:
    """Four instructions of 5 ms per iteration, every one at another clock, on a simulated GPU
    whose clock changes take ``latency_s``; ``gap_s`` of pipeline communication between
    instructions. Returns the optimizer (closed), whether the simulated GPU's clock was the
    planned one throughout each instruction (read as it starts, every millisecond of its work
    and as it ends), and the clock events published."""
    from zeus_async.devices.sim import SimConfig
    from zeus_async.events import OptimizerState

    plan = tmp_path / "alternating.json"
    plan.write_text(json.dumps([ALTERNATING]))
    record = tmp_path / "pfo.zarc"
    args = {"solution_path": str(plan)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        monitor = Monitor(
            backend="sim",
            sampler="thread",
            gpu_indices=[0],
            sync_execution_with=None,
            record=record,
            sim_config=SimConfig(num_gpus=1, set_clock_latency_s=latency_s),
        )
        node = sim_pynvml.current_node()
        assert node is not None
        gpu = node.gpus[0]
        pfo = PipelineFrequencyOptimizer(
            rank=0, dp_rank=0, pp_rank=0, tp_rank=0, device_id=0, dp_degree=1, pp_degree=1,
            tp_degree=1, world_size=1, server_url=ep, monitor=monitor, warmup_iters=1000,
            restore_on_signals=False, clock_wait_s=clock_wait_s, stats_every=5,
            wait_for_lower_clocks=wait_for_lower_clocks,
        )  # fmt: skip
        truth = []
        for _ in range(10):
            pfo.on_step_begin()
            for name, mhz in ALTERNATING:
                pfo.on_instruction_begin(name)
                seen = {gpu.locked_sm_clocks_mhz}
                for _ in range(5):  # the instruction's GPU work, 5 ms
                    threading.Event().wait(0.001)
                    seen.add(gpu.locked_sm_clocks_mhz)
                truth.append(seen == {(mhz, mhz)})
                pfo.on_instruction_end(name)
                threading.Event().wait(gap_s)  # sending activations, receiving gradients
            pfo.on_step_end()
        pfo.close()
        monitor.close()
    events = [
        e for e in RecordingReader(record) if isinstance(e, OptimizerState) and e.optimizer == "pfo"
    ]
    return pfo, truth, events


def test_clocks_are_in_force_when_their_instructions_start(tmp_path: Path) -> None:
    pfo, truth, events = _run_alternating(tmp_path, clock_wait_s=0.1, gap_s=0.0)
    stats = pfo.clock_stats
    assert (stats.instructions, stats.on_time, stats.late, stats.missed) == (40, 40, 0, 0)
    assert all(truth)  # the simulated GPU agrees: every instruction started at its clock
    # No gap to hide the 20 ms change in: the training thread waited for each one.
    assert stats.waited_s >= 39 * 0.02 * 0.9
    assert [e.values["instructions"] for e in events] == [20.0, 40.0]
    assert events[-1].values["on_time_frac"] == 1.0
    assert events[-1].state == "clocks" and "round 0" in events[-1].detail


def test_clocks_set_ahead_hide_the_latency_in_the_pipeline_gaps(tmp_path: Path) -> None:
    pfo, truth, _ = _run_alternating(tmp_path, clock_wait_s=0.1, gap_s=0.03)
    stats = pfo.clock_stats
    assert stats.on_time == stats.instructions == 40 and all(truth)
    # Set when the previous instruction ended, each clock landed during the 30 ms gap.
    assert stats.waited_s < 40 * 0.02 * 0.25, stats


def test_clocks_that_land_late_are_counted_and_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="zeus_async.optimizer.pipeline.client")
    pfo, truth, events = _run_alternating(tmp_path, clock_wait_s=0.0, gap_s=0.0)
    stats = pfo.clock_stats
    assert stats.instructions == 40 and stats.waited_s == 0.0
    # A 20 ms change cannot land within a 5 ms instruction: most run at another clock (some
    # find theirs in force by chance: with changes coalesced, the clock in flight may be it).
    assert stats.late + stats.missed >= 20
    assert stats.on_time == stats.instructions - stats.late - stats.missed
    # Counted from the landings this process saw: never more on time than the GPU really was.
    assert stats.on_time <= sum(truth)
    assert events[-1].values["late"] + events[-1].values["missed"] >= 20
    warned = [r.getMessage() for r in caplog.records if "planned clock" in r.getMessage()]
    assert warned and "raise clock_wait_s" in warned[0]


def test_a_clock_with_another_change_on_its_way_is_not_counted_on_time(tmp_path: Path) -> None:
    # Waiting for higher clocks only: a lower clock is set and not waited for; the next
    # instruction's (higher) clock may then be the one in force while the lower one is still
    # on its way, and that one lands mid-instruction. Counted on time, it would not have run
    # at its clock throughout.
    pfo, truth, _ = _run_alternating(
        tmp_path, clock_wait_s=0.1, gap_s=0.0, wait_for_lower_clocks=False
    )
    stats = pfo.clock_stats
    assert stats.instructions == 40
    assert stats.on_time <= sum(truth), (stats, sum(truth))
    assert stats.late + stats.missed >= 15  # the lower clocks, never waited for
