"""PFO records, settings and schedulers (no sockets)."""

from __future__ import annotations

import json
import tempfile
from datetime import datetime
from pathlib import Path

import anyio
import msgspec
import pytest

from zeus_async.errors import ConfigError
from zeus_async.optimizer.pipeline import (
    FrequencySchedule,
    InstructionProfiler,
    InstructionProfilingResult,
    JobInfo,
    OfflineProfilingResult,
    PfoSettings,
    PointSolution,
    PointSolution3D,
    ProfilingResult,
    RankInfo,
    load_prof,
    load_ranks,
    load_sched,
    make_3d_parallel,
    read_plan,
    save_prof,
    save_ranks,
    save_sched,
)
from zeus_async.optimizer.pipeline.schedulers import FrequencyScheduler, ScheduleGen

#: A valid plan file: the default scheduler (PointSolution) checks its plan at start.
PLAN = Path(tempfile.mkdtemp(prefix="pfo-test-")) / "plan.json"
PLAN.write_text('[[["forward", 1980]]]')


def _settings(**kwargs: object) -> PfoSettings:
    """Settings for schedulers built directly (the default scheduler needs a plan path)."""
    return PfoSettings(scheduler_args={"solution_path": str(PLAN)}, **kwargs)  # type: ignore[arg-type]


def test_job_info_validation_and_id() -> None:
    job = JobInfo(pp_degree=2, dp_degree=3, tp_degree=1, world_size=6, job_metadata="bert")
    when = datetime(2026, 11, 21, 9, 8, 7)
    assert (
        job.make_job_id("PointSolution", when)
        == "2026-11-21-09-08-07+dp3+pp2+tp1+PointSolution+bert"
    )
    with pytest.raises(ValueError, match=r"world_size \(5\) must equal"):
        JobInfo(pp_degree=2, dp_degree=3, tp_degree=1, world_size=5)
    with pytest.raises(ValueError, match="tp_degree must be >= 1"):
        JobInfo(pp_degree=1, dp_degree=1, tp_degree=0, world_size=0)
    with pytest.raises(msgspec.ValidationError, match=r"world_size"):
        msgspec.json.decode(
            b'{"pp_degree":2,"dp_degree":2,"tp_degree":2,"world_size":4}', type=JobInfo
        )
    with pytest.raises(msgspec.ValidationError, match=r"\$.pp_degree"):
        msgspec.json.decode(
            b'{"pp_degree":0,"dp_degree":1,"tp_degree":1,"world_size":1}', type=JobInfo
        )
    with pytest.raises(ValueError, match="'/'"):
        JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1, job_metadata="a/b")


def test_rank_schedule_and_result_validation() -> None:
    with pytest.raises(msgspec.ValidationError, match="available_frequencies"):
        msgspec.json.decode(
            b'{"rank":0,"dp_rank":0,"pp_rank":0,"tp_rank":0,"available_frequencies":[0]}',
            type=RankInfo,
        )
    with pytest.raises(ValueError, match="non-empty"):
        RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[])
    info = RankInfo(rank=3, dp_rank=1, pp_rank=1, tp_rank=0, available_frequencies=[1980])
    info.check_against(JobInfo(pp_degree=2, dp_degree=2, tp_degree=1, world_size=4))
    with pytest.raises(ValueError, match="pp_rank 1 is out of range"):
        info.check_against(JobInfo(pp_degree=1, dp_degree=4, tp_degree=1, world_size=4))
    with pytest.raises(ValueError, match="invalid schedule entry"):
        FrequencySchedule(rank=0, frequencies=[("forward", 0)])
    with pytest.raises(ValueError, match="iter_time has 2 iterations but iter_energy 1"):
        ProfilingResult(rank=0, iter_time=[1.0, 2.0], iter_energy=[1.0])
    with pytest.raises(ValueError, match="same instructions"):
        ProfilingResult(rank=0, iter_time=[], iter_energy=[], time_breakdown={"forward": []})
    with pytest.raises(ValueError, match="differ in shape"):
        ProfilingResult(
            rank=0,
            iter_time=[1.0],
            iter_energy=[1.0],
            time_breakdown={"forward": [[0.1, 0.2]]},
            energy_breakdown={"forward": [[0.1]]},
        )
    with pytest.raises(msgspec.ValidationError, match="iter_energy"):
        msgspec.json.decode(
            b'{"rank":0,"iter_time":[1.0],"iter_energy":[-1.0]}', type=ProfilingResult
        )
    with pytest.raises(ValueError, match="finite"):
        ProfilingResult(rank=0, iter_time=[float("nan")], iter_energy=[1.0])
    with pytest.raises(ValueError, match="same clocks"):
        OfflineProfilingResult(
            rank=0,
            dp_rank=0,
            pp_rank=0,
            tp_rank=0,
            forward_time={1980: 1.0},
            forward_energy={},
            backward_time={},
            backward_energy={},
        )


def _profile() -> InstructionProfilingResult:
    return InstructionProfilingResult(
        [
            OfflineProfilingResult(
                rank=r,
                dp_rank=0,
                pp_rank=r,
                tp_rank=0,
                forward_time={1980: 0.1 + r, 1500: 0.125 + r},
                forward_energy={1980: 30.0, 1500: 1 / 3},
                backward_time={1980: 0.2},
                backward_energy={1980: 60.5},
            )
            for r in range(2)
        ]
    )


def test_instruction_profile_csv_round_trip(tmp_path: Path) -> None:
    prof = _profile()
    path = tmp_path / "p.csv"
    prof.to_csv(path)
    lines = path.read_text().splitlines()
    assert lines[0] == "rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy"
    assert lines[1] == "0,0,0,0,0,forward,1980,0.1,30.0"
    assert lines[3] == "0,0,0,0,0,backward,1980,0.2,60.5"
    assert len(lines) == 1 + 2 * 3
    assert InstructionProfilingResult.from_csv(path) == prof  # floats exactly (repr)
    with pytest.raises(ValueError, match=r"end in '\.csv'"):
        prof.to_csv(tmp_path / "p.txt")
    bad = tmp_path / "bad.csv"
    bad.write_text(lines[0] + "\n0,0,0,0,1,forward,1980,0.1,1.0\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: stage 1 differs from pp_rank 0"):
        InstructionProfilingResult.from_csv(bad)
    bad.write_text(lines[0] + "\n0,0,0,0,0,sideways,1980,0.1,1.0\n")
    with pytest.raises(ValueError, match="unknown instruction 'sideways'"):
        InstructionProfilingResult.from_csv(bad)
    bad.write_text("a,b\n")
    with pytest.raises(ValueError, match="expected the header"):
        InstructionProfilingResult.from_csv(bad)


def test_state_dumps_round_trip(tmp_path: Path) -> None:
    ranks = [
        RankInfo(rank=i, dp_rank=0, pp_rank=i, tp_rank=0, available_frequencies=[1980, 990])
        for i in range(2)
    ]
    scheds = [FrequencySchedule(rank=i, frequencies=[("forward", 1980 - i)]) for i in range(2)]
    profs = [ProfilingResult(rank=i, iter_time=[0.5], iter_energy=[9.0 + i]) for i in range(2)]

    async def dump() -> None:
        await save_ranks(ranks, tmp_path / "job")
        await save_sched(scheds, tmp_path / "job", 3)
        await save_prof(profs, tmp_path / "job", 3)

    anyio.run(dump)
    assert load_ranks(tmp_path / "job") == ranks
    assert load_sched(tmp_path / "job", 3) == scheds
    assert load_prof(tmp_path / "job", 3) == profs
    (tmp_path / "job" / "ranks.json").write_text('[{"rank": -1}]')
    with pytest.raises(ValueError, match=r"ranks\.json"):
        load_ranks(tmp_path / "job")


def test_settings_from_env() -> None:
    env = {
        "ZEUS_PFO_SCHEDULER": "InstructionProfiler",
        "ZEUS_PFO_SCHEDULER_ARGS": '{"num_microbatches": 4, "patience": 3}',
        "ZEUS_PFO_LOG_LEVEL": "debug",
        "ZEUS_PFO_DUMP_DATA": "no",
        "ZEUS_PFO_DUMP_DIR": "/tmp/x",
        "ZEUS_PFO_MAX_JOB_IDLE_TIME": "90",
    }
    s = PfoSettings.from_env(env)
    assert (s.scheduler, s.log_level, s.dump_data, s.dump_dir, s.max_job_idle_time) == (
        "InstructionProfiler",
        "DEBUG",
        False,
        "/tmp/x",
        90.0,
    )
    assert s.scheduler_args == {"num_microbatches": 4, "patience": 3}
    assert s.scheduler_class() is InstructionProfiler
    default = PfoSettings.from_env(
        {"ZEUS_PFO_SCHEDULER_ARGS": json.dumps({"solution_path": str(PLAN)})}
    )
    assert (default.scheduler, default.log_level, default.dump_data) == (
        "PointSolution",
        "INFO",
        True,
    )
    assert PfoSettings.from_env(env, dump_data=True).dump_data is True


def test_settings_names_and_booleans_as_pydantic_settings_reads_them() -> None:
    # Variable names in any case; t/f/y/n booleans; the exact upper-case name wins.
    plan = {"zeus_pfo_scheduler_args": json.dumps({"solution_path": str(PLAN)})}
    s = PfoSettings.from_env({**plan, "zeus_pfo_dump_dir": "/tmp/low", "Zeus_Pfo_Dump_Data": "f"})
    assert (s.dump_dir, s.dump_data) == ("/tmp/low", False)
    for text, value in (("t", True), ("Y", True), ("n", False), ("F", False)):
        assert PfoSettings.from_env({**plan, "ZEUS_PFO_DUMP_DATA": text}).dump_data is value
    both = {**plan, "zeus_pfo_dump_dir": "/tmp/low", "ZEUS_PFO_DUMP_DIR": "/tmp/up"}
    assert PfoSettings.from_env(both).dump_dir == "/tmp/up"


def test_job_info_with_a_degree_that_is_not_a_number_says_so() -> None:
    with pytest.raises(ConfigError, match="pp_degree must be a whole number, not '2'"):
        JobInfo(pp_degree="2", dp_degree=1, tp_degree=1, world_size=2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"ZEUS_PFO_SCHEDULER": "Nope"}, "unknown scheduler 'Nope'; known: FrontierPlanner"),
        ({"ZEUS_PFO_SCHEDULER_ARGS": "{oops"}, "ZEUS_PFO_SCHEDULER_ARGS is not valid JSON"),
        ({"ZEUS_PFO_SCHEDULER_ARGS": "[1]"}, "must be a JSON object"),
        ({"ZEUS_PFO_DUMP_DATA": "maybe"}, "ZEUS_PFO_DUMP_DATA must be true or false"),
        ({"ZEUS_PFO_MAX_JOB_IDLE_TIME": "soon"}, "MAX_JOB_IDLE_TIME must be a number"),
        ({"ZEUS_PFO_MAX_JOB_IDLE_TIME": "-1"}, "max_job_idle_time must be > 0"),
        ({"ZEUS_PFO_LOG_LEVEL": "loud"}, "log_level must be one of"),
        (
            {
                "ZEUS_PFO_SCHEDULER": "InstructionProfiler",
                "ZEUS_PFO_SCHEDULER_ARGS": '{"num_microbatches": 2, "patiense": 2}',
            },
            "the InstructionProfiler scheduler takes no patiense",
        ),
        (
            {"ZEUS_PFO_SCHEDULER": "InstructionProfiler"},
            "the InstructionProfiler scheduler needs num_microbatches",
        ),
        ({"ZEUS_PFO_SCHEDULER": "os:path"}, "is not a FrequencyScheduler subclass"),
        ({"ZEUS_PFO_SCHEDULER": "no_such_module:X"}, "cannot load scheduler"),
    ],
)
def test_settings_errors(env: dict[str, str], match: str) -> None:
    if (
        "ZEUS_PFO_SCHEDULER_ARGS" not in env
        and env.get("ZEUS_PFO_SCHEDULER") != "InstructionProfiler"
    ):
        env = {**env, "ZEUS_PFO_SCHEDULER_ARGS": '{"solution_path": "x.json"}'}
    with pytest.raises(ConfigError, match=match):
        PfoSettings.from_env(env)


def test_custom_scheduler_by_import_path() -> None:
    s = PfoSettings.from_env({"ZEUS_PFO_SCHEDULER": f"{__name__}:Constant"})
    assert s.scheduler_class() is Constant


class Constant(FrequencyScheduler):
    """Every rank at 1000 MHz for one forward; a module-level class for the import-path test."""

    def _run(self) -> ScheduleGen:
        results = yield [
            FrequencySchedule(rank=r.rank, frequencies=[("forward", 1000)]) for r in self.rank_infos
        ]
        self.seen = results


def _ranks(pp: int, dp: int) -> list[RankInfo]:
    return [
        RankInfo(
            rank=d * pp + s, dp_rank=d, pp_rank=s, tp_rank=0, available_frequencies=[1980, 1000]
        )
        for d in range(dp)
        for s in range(pp)
    ]


def test_plan_files_are_parsed_safely(tmp_path: Path) -> None:
    py = tmp_path / "plan.py"
    py.write_text("[[('forward', 1980), ('backward', 1500)], [('forward', 1000)]]\n")
    assert read_plan(py) == [[("forward", 1980), ("backward", 1500)], [("forward", 1000)]]
    evil = tmp_path / "evil.py"
    marker = tmp_path / "pwned"
    evil.write_text(f"__import__('pathlib').Path({str(marker)!r}).write_text('x')")
    with pytest.raises(ConfigError, match="not a JSON or Python literal plan"):
        read_plan(evil)
    assert not marker.exists()
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([["forward", 1980]]))
    with pytest.raises(ConfigError, match=r"list \(one per rank\) of \[instruction, MHz\] pairs"):
        read_plan(wrong)
    with pytest.raises(ConfigError, match="plan file not found"):
        read_plan(tmp_path / "missing.json")
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps([[["forward", -5]]]))
    with pytest.raises(ConfigError, match="rank 0: invalid entry"):
        read_plan(neg)


def test_point_solution_and_3d_wrapping(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([[["forward", 1000 + s]] for s in range(2)]))
    settings = _settings()
    job = JobInfo(pp_degree=2, dp_degree=2, tp_degree=1, world_size=4, job_id="j")
    with pytest.raises(ConfigError, match="plans 2 ranks, but the job has 4"):
        PointSolution(job, _ranks(2, 2), settings, str(plan))
    sched = PointSolution3D(job, list(reversed(_ranks(2, 2))), settings, str(plan))
    assert type(sched).__name__ == "PointSolution3D"
    assert sched.__doc__ is not None and sched.__doc__.startswith("[Wrapped for 3D parallelism]")
    out = sched.next_schedule()
    assert [(s.rank, s.frequencies) for s in out] == [
        (0, [("forward", 1000)]),
        (1, [("forward", 1001)]),
        (2, [("forward", 1000)]),
        (3, [("forward", 1001)]),
    ]
    sched.observe([])  # generator finished: the same plan forever
    assert sched.next_schedule() == out


def test_3d_wrapper_merges_stage_results() -> None:
    Wrapped = make_3d_parallel(Constant)
    job = JobInfo(pp_degree=2, dp_degree=2, tp_degree=1, world_size=4, job_id="j")
    sched = Wrapped(job, _ranks(2, 2), _settings())
    inner_ranks = [(r.rank, r.pp_rank) for r in sched.rank_infos]
    assert inner_ranks == [(0, 0), (1, 1)] and sched.world_size == 2
    assert len(sched.next_schedule()) == 4

    def res(rank: int, t: float, e: float) -> ProfilingResult:
        return ProfilingResult(
            rank=rank,
            iter_time=[t],
            iter_energy=[e],
            time_breakdown={"forward": [[t / 2]]},
            energy_breakdown={"forward": [[e / 2]]},
        )

    sched.observe([res(3, 2.0, 20.0), res(0, 1.0, 10.0), res(2, 1.5, 12.0), res(1, 1.0, 5.0)])
    merged = {r.rank: r for r in sched.seen}  # type: ignore[attr-defined]
    assert merged[0].iter_time == [1.5] and merged[0].iter_energy == [22.0]  # max time, sum energy
    assert merged[1].iter_time == [2.0] and merged[1].iter_energy == [25.0]
    assert merged[1].time_breakdown == {"forward": [[1.0]]}
    assert merged[1].energy_breakdown == {"forward": [[12.5]]}


def test_instruction_profiler_rounds_without_a_server(tmp_path: Path) -> None:
    settings = _settings(dump_dir=str(tmp_path))
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1, job_id="solo")
    ranks = [
        RankInfo(
            rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[900, 1200, 1500, 1800]
        )
    ]
    prof = InstructionProfiler(
        job, ranks, settings, num_microbatches=2, pipeline="gpipe", patience=1
    )
    # energy per clock: lowest at 1500 -> the sweep stops at 1200 (patience 1)
    energy = {1800: 5.0, 1500: 4.0, 1200: 4.5, 900: 3.0}
    clocks = []
    for _ in range(5):
        sched = prof.next_schedule()[0]
        assert [n for n, _ in sched.frequencies] == ["forward", "forward", "backward", "backward"]
        f = sched.frequencies[0][1]
        clocks.append(f)
        bd = {"forward": [[0.1, 0.1]], "backward": [[0.2, 0.2]]}
        eb = {"forward": [[energy[f]] * 2], "backward": [[energy[f]] * 2]}
        prof.observe(
            [
                ProfilingResult(
                    rank=0,
                    iter_time=[1.0],
                    iter_energy=[20.0],
                    time_breakdown=bd,
                    energy_breakdown=eb,
                )
            ]
        )
    assert clocks == [1800, 1500, 1200, 1800, 1800]
    assert prof.profile is not None
    assert prof.profile.results[0].forward_energy == {1800: 5.0, 1500: 4.0, 1200: 4.5}
    # iterations took 1.0 s with 0.6 s of instructions: 0.4 s blocked at (20 - 2*f(E)) J
    assert prof.blocking_power_w == pytest.approx(((20 - 20) + (20 - 16) + (20 - 18)) / 1.2)
    assert (tmp_path / "solo" / "instruction_profile.csv").is_file()
    # kept beside the profile for `pfo-plan`, which charges idle time as the server does
    from zeus_async.optimizer.pipeline.schedulers import read_blocking_power

    assert read_blocking_power(tmp_path / "solo" / "instruction_profile.csv") == (
        prof.blocking_power_w,
        False,  # measured, not given
    )
    with pytest.raises(ConfigError, match="num_microbatches must be a whole number >= 1"):
        InstructionProfiler(job, ranks, settings, num_microbatches=0)
    with pytest.raises(ConfigError):
        InstructionProfiler(job, ranks, settings, num_microbatches=2, pipeline="zigzag")


def test_3d_schedulers_check_the_wrapped_constructor_and_plans_at_start(tmp_path: Path) -> None:
    for name in ("PointSolution3D", "FrontierPlanner3D"):
        env = {"ZEUS_PFO_SCHEDULER": name, "ZEUS_PFO_SCHEDULER_ARGS": '{"solution_pth": "x"}'}
        with pytest.raises(ConfigError, match=f"the {name} scheduler needs "):
            PfoSettings.from_env(env)
    missing = {"ZEUS_PFO_SCHEDULER_ARGS": json.dumps({"solution_path": str(tmp_path / "no.json")})}
    with pytest.raises(ConfigError, match="plan file not found"):
        PfoSettings.from_env(missing)
    odd = tmp_path / "odd.py"
    odd.write_text("{[1]: 2}")  # a literal that raises TypeError when evaluated
    with pytest.raises(ConfigError, match="not a JSON or Python literal plan"):
        read_plan(odd)


def test_profiler_refuses_a_minimum_above_every_clock() -> None:
    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1, job_id="j")
    ranks = [RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[900, 1200])]
    prof = InstructionProfiler(job, ranks, _settings(), num_microbatches=1, minimum_frequency=2000)
    with pytest.raises(ValueError, match="no available clock is >= minimum_frequency 2000"):
        prof.next_schedule()
