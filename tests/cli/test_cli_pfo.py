"""``zeus-async pfo-server`` and ``pfo-plan`` as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from cli_helpers import popen, run_cli

from zeus_async.optimizer.pipeline import (
    InstructionProfilingResult,
    JobInfo,
    OfflineProfilingResult,
    PfoClient,
    PfoServerError,
    RankInfo,
    read_plan,
)
from zeus_async.optimizer.pipeline import protocol as p


def _profile(path: Path) -> None:
    def stage(s: int) -> OfflineProfilingResult:
        w = 2.0 if s == 0 else 1.0  # stage 0 is the bottleneck
        t = {1980: 0.010 * w, 1500: 0.012 * w, 1000: 0.016 * w}
        e = {1980: 3.0 * w, 1500: 2.2 * w, 1000: 2.0 * w}
        return OfflineProfilingResult(
            rank=s, dp_rank=0, pp_rank=s, tp_rank=0,
            forward_time=t, forward_energy=e,
            backward_time={f: 2 * v for f, v in t.items()},
            backward_energy={f: 2 * v for f, v in e.items()},
        )  # fmt: skip

    InstructionProfilingResult([stage(0), stage(1)]).to_csv(path)


def test_pfo_plan_writes_a_point_solution_file(tmp_path: Path) -> None:
    csv = tmp_path / "profile.csv"
    _profile(csv)
    out = tmp_path / "plan.json"
    proc = run_cli("pfo-plan", str(csv), "--microbatches", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "frontier " in proc.stdout and f"plan        written to {out}" in proc.stdout
    plan = read_plan(out)
    assert [len(p) for p in plan] == [8, 8]  # 4 forwards + 4 backwards per stage
    # no slowdown (the chosen plan is as fast as the fastest), but clocks lowered where the
    # pipeline has slack: most of all on stage 1, which does half of stage 0's work
    fastest = float(proc.stdout.split("fastest ")[1].split(" s")[0])
    chosen = float(proc.stdout.split("chosen")[1].split()[0])
    assert chosen <= fastest * (1 + 1e-9)
    assert sum(f < 1980 for _, f in plan[1]) > sum(f < 1980 for _, f in plan[0])
    slow = run_cli("pfo-plan", str(csv), "--microbatches", "4", "--max-slowdown", "0.5")
    assert slow.returncode == 0, slow.stderr
    relaxed = json.loads(slow.stdout.splitlines()[-1])
    slow_time = float(slow.stdout.split("chosen")[1].split()[0])
    assert fastest < slow_time <= 1.5 * fastest
    assert sum(f < 1980 for p in relaxed for _, f in p) > sum(f < 1980 for p in plan for _, f in p)
    bad = run_cli("pfo-plan", str(tmp_path / "missing.csv"), "--microbatches", "4")
    assert bad.returncode == 1 and "missing.csv" in bad.stderr


def test_pfo_server_settings_errors_are_one_line(tmp_path: Path) -> None:
    proc = run_cli("pfo-server", "--scheduler", "InstructionProfiler", "--duration", "1")
    assert proc.returncode == 1
    assert "the InstructionProfiler scheduler needs num_microbatches" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("pfo-server", "--scheduler-args", "{oops")
    assert proc.returncode == 1 and "--scheduler-args is not valid JSON" in proc.stderr


def test_pfo_server_serves_until_interrupted(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("[]")
    server = popen(
        "pfo-server",
        "--bind",
        "tcp://127.0.0.1:*",
        "--scheduler-args",
        json.dumps({"solution_path": str(plan)}),
        "--no-dump",
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert "scheduler PointSolution" in line
        endpoint = line.split(": ", 1)[1].split(" ", 1)[0]
        info = PfoClient(endpoint, timeout_s=10).info()
        assert (info.scheduler, info.jobs) == ("PointSolution", [])
    finally:
        server.send_signal(2)
        _, err = server.communicate(timeout=20)
    assert server.returncode == 130, err  # Ctrl-C: the same status on every command


def _large_profile(path: Path, stages: int = 8, clocks: int = 40) -> None:
    """GPU-like curves over many clocks: a plan of 8 stages x 48 microbatches takes this VM
    well over ten seconds."""

    def stage(s: int) -> OfflineProfilingResult:
        freqs = [990 + 25 * k for k in range(clocks)]
        w = 1.0 + 0.1 * s
        t = {f: w * (0.004 + 0.02 * 990 / f) for f in freqs}
        e = {f: t[f] * (80 + 400 * (f / 1980) ** 2.5) for f in freqs}
        return OfflineProfilingResult(
            rank=s, dp_rank=0, pp_rank=s, tp_rank=0,
            forward_time=t, forward_energy=e,
            backward_time={f: 2 * v for f, v in t.items()},
            backward_energy={f: 2 * v for f, v in e.items()},
        )  # fmt: skip

    InstructionProfilingResult([stage(s) for s in range(stages)]).to_csv(path)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_pfo_plan_stops_within_a_second_of_a_signal(tmp_path: Path, signum: int) -> None:
    csv = tmp_path / "profile.csv"
    _large_profile(csv)
    out = tmp_path / "plan.json"
    proc = popen("pfo-plan", str(csv), "--microbatches", "48", "--out", str(out))
    time.sleep(3.0)  # imports, reading, and into the walk
    assert proc.poll() is None, proc.communicate()
    sent = time.monotonic()
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signum, stderr  # 130 for Ctrl-C, 143 for SIGTERM
    assert stderr.strip() == "zeus-async pfo-plan: interrupted while planning; no plan written"
    assert took < 1.0, took
    assert not out.exists() and stdout.startswith("P_block") and len(stdout.splitlines()) == 1


def _lines(stdout: str) -> dict[str, str]:
    return {line.split()[0]: line.split(maxsplit=1)[1] for line in stdout.splitlines()[:-1]}


def test_pfo_plan_shows_the_baseline_the_saving_and_its_p_block(tmp_path: Path) -> None:
    from zeus_async.optimizer.pipeline import (
        InstructionProfile,
        InstructionProfilingResult,
        PipelineSchedule,
    )
    from zeus_async.optimizer.pipeline.planner import evaluate
    from zeus_async.optimizer.pipeline.schedulers import write_blocking_power

    csv = tmp_path / "profile.csv"
    _profile(csv)
    proc = run_cli("pfo-plan", str(csv), "--microbatches", "4", "--max-slowdown", "0.2")
    assert proc.returncode == 0, proc.stderr
    lines = _lines(proc.stdout)
    assert lines["P_block"].startswith("0 W per stage (not measured: give --p-block)")
    # The baseline is every instruction at its top clock, evaluated exactly.
    profile = InstructionProfile.from_rows(InstructionProfilingResult.from_csv(csv).rows())
    schedule = PipelineSchedule("1f1b", 2, 4)
    top = {
        (stage, mb, name): 1980 for stage in range(2) for name, mb in schedule.stage_order(stage)
    }
    want_t, want_e = evaluate(profile, schedule, top)
    base_t, base_e = (float(x.split()[0]) for x in lines["baseline"].split(", ")[:2])
    assert (base_t, base_e) == (float(f"{want_t:.6g}"), float(f"{want_e:.6g}"))
    chosen_t, chosen_e = (float(x.split()[0]) for x in lines["chosen"].split(", ")[:2])
    saved = float(lines["saving"].split()[0])
    assert saved == pytest.approx(base_e - chosen_e, rel=1e-5)
    percent = float(lines["saving"].split("(")[1].split()[0])
    assert percent == pytest.approx(100 * (base_e - chosen_e) / base_e, abs=0.01)
    assert chosen_e < base_e and chosen_t <= base_t * 1.2 * (1 + 1e-6)
    # The blocking power the server measured, kept beside the profile, is used and said.
    write_blocking_power(csv, 55.5, given=False)
    measured = run_cli("pfo-plan", str(csv), "--microbatches", "4")
    p_block = _lines(measured.stdout)["P_block"]
    assert p_block.startswith("55.5 W per stage (measured while profiling)")
    # A server given p_block_w planned with it, and keeps that one: so does pfo-plan.
    write_blocking_power(csv, 42.0, given=True)
    kept = run_cli("pfo-plan", str(csv), "--microbatches", "4")
    p_block = _lines(kept.stdout)["P_block"]
    assert p_block.startswith("42 W per stage (given to the server that profiled)")
    write_blocking_power(csv, 55.5, given=False)
    given = run_cli("pfo-plan", str(csv), "--microbatches", "4", "--p-block", "10")
    assert _lines(given.stdout)["P_block"].startswith("10 W per stage (given)")
    e_measured = float(_lines(measured.stdout)["chosen"].split(", ")[1].split()[0])
    e_given = float(_lines(given.stdout)["chosen"].split(", ")[1].split()[0])
    assert e_measured > e_given  # idle time costs more at 55.5 W


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--microbatches", "0"], 2, "--microbatches: expected a whole number >= 1, got '0'"),
        (["--microbatches", "4", "--max-slowdown", "-0.5"], 2, "expected a number >= 0"),
        (["--microbatches", "4", "--p-block", "-1"], 2, "expected a number >= 0"),
        (
            ["--microbatches", "4", "--target-time", "0.001"],
            1,
            "target iteration time 0.001 s is below the fastest achievable",
        ),
        (
            ["--microbatches", "4", "--p-block", "1e308"],
            1,
            "the blocking power (p_block_w) must be a number of W within 0..1e+06, got 1e+308",
        ),
        # Outputs are checked before planning (which can take minutes), not after.
        (
            ["--microbatches", "4", "--out", "{dir}/profile.csv"],
            1,
            "--out {dir}/profile.csv is the profile being read",
        ),
        (["--microbatches", "4", "--out", "{dir}/no/plan.json"], 1, "no directory {dir}/no"),
        (["--microbatches", "4", "--out", "{dir}"], 1, "is a directory"),
    ],
)
def test_pfo_plan_bad_input(tmp_path: Path, args: list[str], code: int, message: str) -> None:
    csv = tmp_path / "profile.csv"
    _profile(csv)
    before = csv.read_bytes()
    proc = run_cli("pfo-plan", str(csv), *(a.format(dir=tmp_path) for a in args))
    assert proc.returncode == code
    assert message.format(dir=tmp_path) in proc.stderr
    assert code == 2 or len(proc.stderr.strip().splitlines()) == 1  # argparse adds its usage
    assert "Error:" not in proc.stderr and "Traceback" not in proc.stderr
    assert csv.read_bytes() == before


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe", "not a usable instruction profile: 'utf-8' codec can't decode"),
        (b"a,b\n", "not a usable instruction profile: "),
        (b"", "not a usable instruction profile: "),
        (
            b"rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy\n"
            b"0,0,0,0,0,forward,1000,1e308,1\n0,0,0,0,0,backward,1000,1e308,1\n",
            "profile.csv: not a usable instruction profile: stage 0 forward at 1000 MHz: time "
            "must be above 0 and at most 86400 s, got 1e+308",
        ),
        (
            b"rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy\n"
            b"0,0,0,0,0,forward,1000,0.1,1\n0,0,0,0,0,forward,1000,0.2,1\n",
            "profile.csv:3: not a usable instruction profile: a second row for rank 0 forward "
            "at 1000 MHz",
        ),
    ],
)
def test_pfo_plan_unusable_profiles_are_one_line(
    tmp_path: Path, content: bytes, message: str
) -> None:
    csv = tmp_path / "profile.csv"
    csv.write_bytes(content)
    proc = run_cli("pfo-plan", str(csv), "--microbatches", "4")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Error:" not in lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "choose what to serve: --scheduler FrontierPlanner3D --scheduler-args"),
        (["--scheduler", "PointSolution"], "the PointSolution scheduler needs solution_path"),
        (
            ["--scheduler", "FrontierPlanner", "--scheduler-args", '{"num_microbatches": -3}'],
            "num_microbatches must be a whole number >= 1, not -3",
        ),
        (
            [
                "--scheduler",
                "FrontierPlanner3D",
                "--scheduler-args",
                '{"num_microbatches": 4, "pipeline": "zb"}',
            ],
            "pipeline must be one of 1f1b, gpipe, not 'zb'",
        ),
        (
            [
                "--scheduler",
                "InstructionProfiler",
                "--scheduler-args",
                '{"num_microbatches": 4, "patiense": 3}',
            ],
            "takes no patiense",
        ),
    ],
)
def test_pfo_server_checks_scheduler_arguments_at_start(args: list[str], message: str) -> None:
    proc = run_cli("pfo-server", "--no-dump", "--duration", "1", *args)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_pfo_server_queue_and_registration_grace_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = run_cli("pfo-server", "--max-queue-mib", "0")
    assert bad.returncode == 2 and "--max-queue-mib" in bad.stderr
    monkeypatch.setenv("ZEUS_PFO_MAX_QUEUE_MIB", "lots")
    planner = ("--scheduler", "FrontierPlanner3D", "--scheduler-args", '{"num_microbatches": 2}')
    bad = run_cli("pfo-server", *planner, "--duration", "1")
    assert bad.returncode == 1
    assert bad.stderr.strip() == (
        "zeus-async pfo-server: ZEUS_PFO_MAX_QUEUE_MIB must be a number of MiB, not 'lots'"
    )

    monkeypatch.setenv("ZEUS_PFO_MAX_QUEUE_MIB", "1")
    plan = tmp_path / "plan.json"
    plan.write_text("[]")
    server = popen(
        "pfo-server", "--bind", "tcp://127.0.0.1:*", "--no-dump",
        "--scheduler-args", json.dumps({"solution_path": str(plan)}),
        "--max-jobs-per-client", "1", "--registration-grace", "0.2",
    )  # fmt: skip
    try:
        assert server.stdout is not None
        endpoint = server.stdout.readline().split(": ", 1)[1].split(" ", 1)[0]
        # A request of 1.2 MiB (its frames each under the 1 MiB that libzmq lets through):
        # past the queue's 1 MiB, answered busy.
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        info = msgspec.msgpack.encode({"type": "info", "token": "x" * 600_000})
        sock.send_multipart([b"", b"r" * 600_000, info])
        assert sock.poll(10_000)
        reply = p.reply_decoder.decode(sock.recv_multipart()[-1])
        sock.close()
        assert isinstance(reply, p.ErrorReply) and reply.code == "busy"
        assert "(1 MiB, max_queue_mib" in reply.message

        # One job per client: a second one takes the first's place once the first has been
        # left incomplete for 0.2 s (registration_grace).
        client = PfoClient(endpoint, timeout_s=10)
        never = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
        client.register_job(never)
        with pytest.raises(PfoServerError) as err:
            client.register_job(never)
        assert err.value.code == "busy"
        assert "incomplete for 0.2 s (registration_grace)" in err.value.message
        deadline = time.monotonic() + 10
        while True:
            try:
                second = client.register_job(never)
                break
            except PfoServerError as exc:
                assert exc.code == "busy" and time.monotonic() < deadline
                time.sleep(0.05)
        assert client.info(second).jobs_total == 1  # in the first's place
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=20)


CHOOSE = (
    "zeus-async pfo-server: choose what to serve: --scheduler FrontierPlanner3D "
    "--scheduler-args '{\"num_microbatches\": M}' profiles every pipeline stage and serves the "
    "least-energy clocks with no slowdown (M: microbatches per iteration), or --scheduler "
    'PointSolution3D --scheduler-args \'{"solution_path": "plan.json"}\' serves a plan '
    "(docs/pfo.md)"
)


def _server_in(cwd: Path, *args: str) -> subprocess.Popen[str]:
    """``pfo-server ARGS`` run from ``cwd``, with no ``ZEUS_PFO_*`` from this environment."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("ZEUS_PFO_")}
    return subprocess.Popen(
        [sys.executable, "-m", "zeus_async", "pfo-server", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env, PYTHONUNBUFFERED="1"),
    )


def test_pfo_server_alone_says_what_to_serve_and_writes_nothing_unasked(tmp_path: Path) -> None:
    alone = _server_in(tmp_path)
    _, err = alone.communicate(timeout=30)
    assert alone.returncode == 1
    assert err.splitlines() == [CHOOSE]
    assert list(tmp_path.iterdir()) == []

    # The planner, for a job of one rank: state is written only under --dump DIR.
    planner = ("--scheduler", "FrontierPlanner3D", "--scheduler-args", '{"num_microbatches": 2}')
    for dump in ([], ["--dump", "state"]):
        server = _server_in(tmp_path, "--bind", "tcp://127.0.0.1:*", *planner, *dump)
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            assert "(scheduler FrontierPlanner3D)" in line, line
            client = PfoClient(line.split(": ", 1)[1].split(" ", 1)[0], timeout_s=10)
            job = client.register_job(JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1))
            rank = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0, available_frequencies=[1980])
            client.register_rank(job, rank)
            schedule = client.get_schedule(job, 0).schedule
            assert schedule.frequencies == [("forward", 1980), ("backward", 1980)] * 2
            client.close()
        finally:
            server.send_signal(signal.SIGINT)  # a stopping server finishes its dumps first
            _, err = server.communicate(timeout=20)
        assert server.returncode == 130, err
        written = sorted(str(f.relative_to(tmp_path)) for f in tmp_path.rglob("*") if f.is_file())
        if not dump:
            assert written == []
        else:
            assert written == [f"state/{job}/ranks.json"]  # a round's files: once reported
