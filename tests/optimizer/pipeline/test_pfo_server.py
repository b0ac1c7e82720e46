"""PFO server: request/reply over a real ROUTER socket, error replies, rounds, dumps, eviction."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from pfo_helpers import FakeClock, clients, result_for, running_server

from zeus_async.optimizer.pipeline import (
    InstructionProfilingResult,
    JobInfo,
    PfoClient,
    PfoServerError,
    RankInfo,
    load_prof,
    load_ranks,
    load_sched,
    read_plan,
)
from zeus_async.optimizer.pipeline import protocol as p

FREQS = [1980, 1800, 1600, 1400, 1200, 1000]


def _rank(rank: int, pp: int, dp: int = 0) -> RankInfo:
    return RankInfo(rank=rank, dp_rank=dp, pp_rank=pp, tp_rank=0, available_frequencies=FREQS)


def _plan_file(tmp_path: Path, ranks: int) -> str:
    plan = [[["forward", 1800 - 100 * r], ["backward", 1600]] for r in range(ranks)]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


def _raw(endpoint: str, payload: bytes, frames: list[bytes] | None = None) -> p.Reply:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames if frames is not None else [b"", b"12345678", payload])
        assert sock.poll(5000), "no reply"
        parts = sock.recv_multipart()
        return p.reply_decoder.decode(parts[-1])
    finally:
        sock.close()


def test_point_solution_rounds_and_dumps(tmp_path: Path) -> None:
    args = {"solution_path": _plan_file(tmp_path, 2)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        c0, c1 = clients(ep, 2)
        job_id = c0.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        assert job_id.endswith("+dp1+pp2+tp1+PointSolution")
        c0.register_rank(job_id, _rank(0, 0))
        c1.register_rank(job_id, _rank(1, 1))
        replies = [c.get_schedule(job_id, r) for r, c in enumerate((c0, c1))]
        assert [(r.round, r.final) for r in replies] == [(0, False), (0, False)]
        assert replies[1].schedule.frequencies == [("forward", 1700), ("backward", 1600)]
        for r, c in enumerate((c0, c1)):
            c.report(job_id, result_for(replies[r].schedule))
        # PointSolution has nothing more to learn: round 1 is the same plan, marked final
        finals = [c.get_schedule(job_id, r) for r, c in enumerate((c0, c1))]
        assert [(r.round, r.final) for r in finals] == [(1, True), (1, True)]
        assert finals[1].schedule == replies[1].schedule
        again = c1.get_schedule(job_id, 1)  # asked again (a restarted rank): the same answer
        assert (again.round, again.final, again.schedule) == (1, True, replies[1].schedule)
        with pytest.raises(PfoServerError, match=r"out_of_order: .*final"):
            c0.report(job_id, result_for(finals[0].schedule))
        info = c0.info(job_id)
        assert info.scheduler == "PointSolution"
        status = [(j.job_id, j.ranks_registered, j.world_size, j.state, j.round) for j in info.jobs]
        assert status == [(job_id, 2, 2, "done", 1)]
    dump = tmp_path / "dump" / job_id
    assert [r.rank for r in load_ranks(dump)] == [0, 1]
    assert load_sched(dump, 0)[0].frequencies == [("forward", 1800), ("backward", 1600)]
    assert load_sched(dump, 1) == load_sched(dump, 0)
    assert load_prof(dump, 0)[1] == result_for(load_sched(dump, 0)[1])
    assert not (dump / "1.prof.json").exists()


def test_a_stopping_server_finishes_its_dumps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The final schedule is dumped after it is handed out; a server stopped right then (here
    # while a slowed-down dump is under way) must still write it.
    import anyio

    from zeus_async.optimizer.pipeline import server as server_mod

    save_sched = server_mod.save_sched

    async def slow_save_sched(*args: object) -> None:
        await anyio.sleep(0.3)
        await save_sched(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(server_mod, "save_sched", slow_save_sched)
    args = {"solution_path": _plan_file(tmp_path, 2)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        c0, c1 = clients(ep, 2)
        job_id = c0.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        c0.register_rank(job_id, _rank(0, 0))
        c1.register_rank(job_id, _rank(1, 1))
        replies = [c.get_schedule(job_id, r) for r, c in enumerate((c0, c1))]
        for r, c in enumerate((c0, c1)):
            c.report(job_id, result_for(replies[r].schedule))
        finals = [c.get_schedule(job_id, r) for r, c in enumerate((c0, c1))]
        assert [f.final for f in finals] == [True, True]
    dump = tmp_path / "dump" / job_id
    assert load_sched(dump, 1) == load_sched(dump, 0)


def test_error_replies_and_server_keeps_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="zeus_async.optimizer.pipeline.server")
    args = {"solution_path": _plan_file(tmp_path, 2)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        (c,) = clients(ep, 1)

        def code(call: object, *a: object) -> str:
            with pytest.raises(PfoServerError) as err:
                call(*a)  # type: ignore[operator]
            return err.value.code

        bad = _raw(ep, b"\xc1 not msgpack")
        assert isinstance(bad, p.ErrorReply) and bad.code == "bad_request"
        envelope = _raw(ep, b"", frames=[b"only-one-frame"])
        assert isinstance(envelope, p.ErrorReply) and envelope.code == "bad_request"
        mismatch = msgspec.msgpack.encode(
            {
                "type": "register_job",
                "job": {"pp_degree": 2, "dp_degree": 2, "tp_degree": 1, "world_size": 3},
            }
        )
        reply = _raw(ep, mismatch)
        assert isinstance(reply, p.ErrorReply) and reply.code == "bad_request"
        assert "world_size" in reply.message
        negative = msgspec.msgpack.encode(
            {
                "type": "register_job",
                "job": {"pp_degree": 0, "dp_degree": 1, "tp_degree": 1, "world_size": 0},
            }
        )
        reply = _raw(ep, negative)
        assert isinstance(reply, p.ErrorReply) and "pp_degree" in reply.message

        preset = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2, job_id="mine")
        assert code(c.register_job, preset) == "bad_request"
        assert code(c.register_rank, "nope", _rank(0, 0)) == "unknown_job"
        job = c.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        assert code(c.register_rank, job, _rank(2, 0)) == "bad_rank"  # rank >= world size
        assert code(c.register_rank, job, _rank(1, 5)) == "bad_rank"  # pp_rank >= pp degree
        c.register_rank(job, _rank(0, 0))
        assert code(c.register_rank, job, _rank(0, 0)) == "duplicate"
        assert code(c.get_schedule, job, 1) == "bad_rank"  # not registered
        c.register_rank(job, _rank(1, 1))
        sched = c.get_schedule(job, 0).schedule
        assert code(c.get_schedule, job, 0) == "out_of_order"  # no report yet
        assert code(c.report, job, result_for(sched.__class__(rank=1, frequencies=[]))) == (
            "out_of_order"  # rank 1 has not fetched this round
        )
        c.report(job, result_for(sched))
        assert code(c.report, job, result_for(sched)) == "duplicate"
        assert c.info().jobs[0].job_id == job
    # At DEBUG the server says every request and what it answered.
    said = [r.getMessage() for r in caplog.records if r.name.endswith("pipeline.server")]
    assert any(m.startswith("request RegisterJob(") for m in said), said
    assert any(m.startswith("reply error bad_rank: ") for m in said)
    assert any(m.startswith("reply ") and "error" not in m for m in said)
    assert any(m.startswith("bad request (") for m in said)
    # ... and never a token: not the one it handed out, nor the ones the requests carried.
    token = c.tokens[job]
    assert any("JobRegistered(" in m and "<hidden>" in m for m in said)
    assert any(m.startswith("request RegisterRank(") and "<hidden>" in m for m in said)
    assert not [m for m in said if token in m]


def test_scheduler_failure_is_reported_to_waiting_ranks_only(tmp_path: Path) -> None:
    args = {"solution_path": _plan_file(tmp_path, 3)}  # plans 3 ranks
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        c0, c1, c2 = clients(ep, 3)
        bad = c0.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        good = c2.register_job(
            JobInfo(pp_degree=3, dp_degree=1, tp_degree=1, world_size=3, job_metadata="ok")
        )
        assert bad != good and good.endswith("+ok")
        c0.register_rank(bad, _rank(0, 0))
        waiting: dict[str, BaseException] = {}

        def wait() -> None:
            try:
                c0.get_schedule(bad, 0)
            except BaseException as exc:
                waiting["error"] = exc

        thread = threading.Thread(target=wait)
        thread.start()
        c1.register_rank(bad, _rank(1, 1))  # completes registration: the scheduler fails
        thread.join(10)
        err = waiting["error"]
        assert isinstance(err, PfoServerError) and err.code == "scheduler_error"
        assert "plans 3 ranks" in str(err)
        with pytest.raises(PfoServerError, match="scheduler_error"):
            c1.get_schedule(bad, 1)
        for r in range(3):
            c2.register_rank(good, _rank(r, r))
        assert c2.get_schedule(good, 2).schedule.frequencies[0] == ("forward", 1600)
        states = {j.job_id: j.state for j in c2.info().jobs}
        assert states[bad] == "failed"
        # Its ranks can still leave it, and so end it (it held its client's place otherwise).
        for r in range(2):
            leaving = PfoClient(ep, timeout_s=10.0)
            leaving.join(bad, c0.tokens[bad])
            leaving.leave(bad, r)
        deadline = time.monotonic() + 10
        while bad in {j.job_id for j in c2.info().jobs} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [j.job_id for j in c2.info().jobs] == [good]


def test_a_failed_job_nobody_asks_about_is_evicted(tmp_path: Path) -> None:
    clock = FakeClock()
    args = {"solution_path": _plan_file(tmp_path, 3)}  # plans 3 ranks: a job of 2 fails
    with running_server(
        tmp_path, clock, scheduler="PointSolution", scheduler_args=args, registration_timeout=60
    ) as (server, ep):
        (c,) = clients(ep, 1)
        bad = c.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        c.register_rank(bad, _rank(0, 0))
        c.register_rank(bad, _rank(1, 1))
        deadline = time.monotonic() + 10
        while c.info().jobs[0].state != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        clock.now += 59
        assert server.call(server.evict_idle) == []
        clock.now += 2  # past registration_timeout with no request about it
        assert server.call(server.evict_idle) == [bad]


@pytest.mark.parametrize("fails", [False, True])
def test_a_job_whose_ranks_leave_while_it_plans_ends_when_the_plan_returns(
    tmp_path: Path, fails: bool
) -> None:
    # (With a plan for 3 ranks, the job of 2 fails as planning ends: it ends all the same,
    # since no rank is left to be told or to leave it.)
    from pfo_helpers import GatedPointSolution

    GatedPointSolution.GATE.clear()
    args = {"solution_path": _plan_file(tmp_path, 3 if fails else 2)}
    try:
        with running_server(
            tmp_path, scheduler="pfo_helpers:GatedPointSolution", scheduler_args=args,
            max_jobs_per_client=1,
        ) as (_, ep):  # fmt: skip
            (c,) = clients(ep, 1)
            job = c.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
            token = c.tokens[job]
            for r in range(2):
                c.register_rank(job, _rank(r, r))
            deadline = time.monotonic() + 10
            while c.info().jobs[0].state != "planning" and time.monotonic() < deadline:
                time.sleep(0.02)
            assert c.info().jobs[0].state == "planning"
            for r in range(2):
                leaving = PfoClient(ep, timeout_s=10.0)
                leaving.join(job, token)
                leaving.leave(job, r)
            deadline = time.monotonic() + 10
            while c.info().jobs[0].ranks_left < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            # Its planner cannot be stopped: the job keeps its place until the plan returns.
            assert [(j.state, j.ranks_left) for j in c.info().jobs] == [("planning", 2)]
            with pytest.raises(PfoServerError, match="busy"):
                c.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
            GatedPointSolution.GATE.set()
            deadline = time.monotonic() + 10
            while c.info().jobs_total and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.info().jobs_total == 0
            c.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
    finally:
        GatedPointSolution.GATE.set()


def test_idle_jobs_are_evicted_and_their_waiters_told(tmp_path: Path) -> None:
    clock = FakeClock()
    args = {"solution_path": _plan_file(tmp_path, 2)}
    with running_server(
        tmp_path, clock, scheduler="PointSolution", scheduler_args=args, max_job_idle_time=60
    ) as (srv, ep):
        c0, c1 = clients(ep, 2)
        job = c0.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        c0.register_rank(job, _rank(0, 0))
        errors: list[BaseException] = []
        thread = threading.Thread(target=lambda: _catch(errors, c0.get_schedule, job, 0))
        thread.start()
        for _ in range(100):  # wait until the request is parked on the server
            if srv.call(lambda: bool(srv.jobs[job].parked)):
                break
            threading.Event().wait(0.01)
        clock.now += 30
        assert srv.call(srv.evict_idle) == []
        clock.now += 31
        assert srv.call(srv.evict_idle) == [job]
        thread.join(10)
        assert isinstance(errors[0], PfoServerError) and errors[0].code == "evicted"
        with pytest.raises(PfoServerError, match="unknown_job"):
            c1.register_rank(job, _rank(1, 1))


def _catch(errors: list[BaseException], func: object, *args: object) -> None:
    try:
        func(*args)  # type: ignore[operator]
    except BaseException as exc:
        errors.append(exc)


def _drive(c: PfoClient, job: str, world: int, rounds: int) -> list[list[tuple[str, int]]]:
    """Run rounds for every rank from one client until the final schedule (at most
    ``rounds``); returns rank 0's schedules."""
    seen = []
    for _ in range(rounds):
        replies = [c.get_schedule(job, r) for r in range(world)]
        seen.append(replies[0].schedule.frequencies)
        if replies[0].final:
            assert all(r.final for r in replies)
            break
        for reply in replies:
            c.report(job, result_for(reply.schedule))
    return seen


def test_instruction_profiler_3d_sweeps_down_and_stops_when_energy_rises(tmp_path: Path) -> None:
    args = {"num_microbatches": 2, "patience": 2}
    with running_server(tmp_path, scheduler="InstructionProfiler3D", scheduler_args=args) as (
        _,
        ep,
    ):
        (c,) = clients(ep, 1)
        job = c.register_job(JobInfo(pp_degree=2, dp_degree=2, tp_degree=1, world_size=4))
        for r in range(4):  # rank = dp * pp + pp_rank
            c.register_rank(job, _rank(r, r % 2, r // 2))
        seen = _drive(c, job, 4, 20)
    # stage 0 of 1F1B with 2 stages, 2 microbatches: F0 F1 B0 B1
    assert [name for name, _ in seen[0]] == ["forward", "forward", "backward", "backward"]
    fwd = [s[0][1] for s in seen]
    # E(f) = t(f) * P(f) of result_for is lowest at 1400 among FREQS; energy rises at 1200 and
    # 1000, so the sweep stops after 1000 and the job runs at the top clock from then on.
    assert fwd[:6] == [1980, 1800, 1600, 1400, 1200, 1000]
    assert fwd[6:] == [1980, 1980]
    profile = InstructionProfilingResult.from_csv(
        tmp_path / "dump" / job / "instruction_profile.csv"
    )
    assert [r.pp_rank for r in profile.results] == [0, 1]
    assert sorted(profile.results[0].forward_time) == sorted(FREQS)


@pytest.mark.parametrize("given", [None, 33.0])
def test_frontier_planner_serves_a_plan_no_slower_than_max_clocks(
    tmp_path: Path, given: float | None
) -> None:
    args: dict[str, object] = {"num_microbatches": 3, "patience": 2}
    if given is not None:
        args["p_block_w"] = given
    with running_server(tmp_path, scheduler="FrontierPlanner3D", scheduler_args=args) as (_, ep):
        (c,) = clients(ep, 1)
        job = c.register_job(JobInfo(pp_degree=2, dp_degree=2, tp_degree=1, world_size=4))
        for r in range(4):
            c.register_rank(job, _rank(r, r % 2, r // 2))
        seen = _drive(c, job, 4, 20)
        final = [c.get_schedule(job, r).schedule for r in range(4)]
    plan = read_plan(tmp_path / "dump" / job / "plan.json")
    assert [s.frequencies for s in final] == [plan[r % 2] for r in range(4)]
    assert seen[-1] == plan[0]
    # The plan lowers some clocks (there is slack in the pipeline), never below the profiled set
    all_freqs = {f for stage in plan for _, f in stage}
    assert all_freqs <= set(FREQS) and min(all_freqs) < 1980
    frontier = json.loads((tmp_path / "dump" / job / "frontier.json").read_text())
    times = [pt["iteration_time_s"] for pt in frontier]
    assert times == sorted(times)
    # Kept beside the profile: the P_block the plan was made with (pfo-plan uses it too).
    from zeus_async.optimizer.pipeline.schedulers import read_blocking_power

    kept = read_blocking_power(tmp_path / "dump" / job / "instruction_profile.csv")
    assert kept is not None
    assert kept == (given, True) if given is not None else kept[1] is False


def test_job_ids_are_unique_within_one_second(tmp_path: Path) -> None:
    args = {"solution_path": _plan_file(tmp_path, 2)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        (c,) = clients(ep, 1)
        info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
        ids = {c.register_job(info) for _ in range(5)}
        assert len(ids) == 5


def test_request_ids_pair_replies_with_requests(tmp_path: Path) -> None:
    args = {"solution_path": _plan_file(tmp_path, 2)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        reply = _raw(ep, p.encoder.encode(p.Info()), frames=None)
        assert isinstance(reply, p.InfoReply)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(ep)
        rid = struct.pack("<Q", 77)
        sock.send_multipart([b"", rid, p.encoder.encode(p.Info())])
        assert sock.poll(5000)
        assert sock.recv_multipart()[1] == rid
        sock.close(linger=0)


def test_eviction_counts_hand_outs_as_activity(tmp_path: Path) -> None:
    """A job whose ranks waited through a long planning phase is not evicted right after."""
    clock = FakeClock()
    args = {"solution_path": _plan_file(tmp_path, 2)}
    with running_server(
        tmp_path, clock, scheduler="PointSolution", scheduler_args=args, max_job_idle_time=60
    ) as (srv, ep):
        c0, c1 = clients(ep, 2)
        job = c0.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        c0.register_rank(job, _rank(0, 0))
        c1.register_rank(job, _rank(1, 1))
        clock.now += 3600  # e.g. a long plan: no request for an hour
        sched = c0.get_schedule(job, 0).schedule  # handed out now
        assert srv.call(srv.evict_idle) == []
        c0.report(job, result_for(sched))
        clock.now += 59
        assert srv.call(srv.evict_idle) == []
        clock.now += 2
        assert srv.call(srv.evict_idle) == [job]


def test_reports_that_do_not_match_the_schedule_are_refused(tmp_path: Path) -> None:
    args = {"solution_path": _plan_file(tmp_path, 1)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        (c,) = clients(ep, 1)
        job = c.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
        c.register_rank(job, _rank(0, 0))
        sched = c.get_schedule(job, 0).schedule  # forward, backward
        good = result_for(sched, iters=2)

        def bad(**changes: object) -> str:
            with pytest.raises(PfoServerError) as err:
                c.report(job, msgspec.structs.replace(good, **changes))
            assert err.value.code == "bad_request"
            return str(err.value)

        assert "times instructions ['forward'], the schedule has ['backward', 'forward']" in bad(
            time_breakdown={"forward": good.time_breakdown["forward"]},
            energy_breakdown={"forward": good.energy_breakdown["forward"]},
        )
        assert "timed in 1 iterations, not 2" in bad(
            time_breakdown={k: v[:1] for k, v in good.time_breakdown.items()},
            energy_breakdown={k: v[:1] for k, v in good.energy_breakdown.items()},
        )
        assert "an iteration times 2 'forward', the schedule has 1" in bad(
            time_breakdown={k: [v[0] * 2, v[1]] for k, v in good.time_breakdown.items()},
            energy_breakdown={k: [v[0] * 2, v[1]] for k, v in good.energy_breakdown.items()},
        )
        zero = {k: [[0.0], [0.0]] for k in good.time_breakdown}
        assert "time is not positive" in bad(time_breakdown=zero)
        c.report(job, good)  # the valid one is still accepted


def test_job_metadata_must_be_safe_in_a_path(tmp_path: Path) -> None:
    args = {"solution_path": _plan_file(tmp_path, 1)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args) as (_, ep):
        (c,) = clients(ep, 1)
        for meta in ("a\x00b", "x" * 101, "back\\slash"):
            job = {"pp_degree": 1, "dp_degree": 1, "tp_degree": 1, "world_size": 1}
            raw = msgspec.msgpack.encode(
                {"type": "register_job", "job": {**job, "job_metadata": meta}}
            )
            reply = _raw(ep, raw)
            assert isinstance(reply, p.ErrorReply) and reply.code == "bad_request", meta
            assert "job_metadata" in reply.message
        ok = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1, job_metadata="gpt-3 b32")
        assert c.register_job(ok).endswith("+gpt-3 b32")


@pytest.mark.parametrize(
    ("limits", "named"),
    [({"max_client_mib": 0.05}, "max_client_mib"), ({"max_total_mib": 0.05}, "max_total_mib")],
)
def test_results_past_the_memory_limits_are_refused(
    tmp_path: Path, limits: dict[str, float], named: str
) -> None:
    args = {"solution_path": _plan_file(tmp_path, 2)}
    with running_server(tmp_path, scheduler="PointSolution", scheduler_args=args, **limits) as (
        _,
        ep,
    ):
        c0, c1 = clients(ep, 2)
        job = c0.register_job(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2))
        c0.register_rank(job, _rank(0, 0))
        c1.register_rank(job, _rank(1, 1))
        sched = c0.get_schedule(job, 0).schedule
        c0.report(job, result_for(sched, iters=2))  # small: accepted
        with pytest.raises(PfoServerError) as err:  # ~52 kB: past the 0.05 MiB
            c1.report(job, result_for(c1.get_schedule(job, 1).schedule, iters=1000))
        assert err.value.code == "busy" and named in err.value.message
