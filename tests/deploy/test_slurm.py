"""The Slurm prolog and epilog (deploy/slurm/): the exact ``zeus-async`` and ``scontrol`` commands
they run, the report file they write (where, as whom, what), and that nothing zeus-async does
can fail a job. ``zeus-async``, ``scontrol`` and ``logger`` are stubs on PATH that record their
argv (one argument a line) and print what the test says; the scripts themselves are the real
ones, run by bash."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SLURM = Path(__file__).resolve().parents[2] / "deploy" / "slurm"
PROLOG = SLURM / "prolog.sh"
EPILOG = SLURM / "epilog.sh"

REPORT = {
    "job_id": "4711",
    "energy_j": 12345.5,
    "gpus": {"0": 6000.25, "1": 6345.25},
    "start_ns": 1_700_000_000_000_000_000,
    "end_ns": 1_700_000_360_000_000_000,
}

# Each stub appends "<name> <argv...>" (one argument a line, a blank line after each call) to
# $STUB_LOG; zeus-async also notes the socket variables it was given.
ZEUS_STUB = r"""#!/bin/bash
{ echo zeus-async; printf '%s\n' "$@"; echo "ZEUS_ASYNC_SOCKET=$ZEUS_ASYNC_SOCKET";
  echo "ZEUS_ASYNC_SYSTEM_AGENT=$ZEUS_ASYNC_SYSTEM_AGENT"; echo; } >> "$STUB_LOG"
[ -n "$STUB_ZEUS_SLEEP" ] && sleep "$STUB_ZEUS_SLEEP"
if [ -n "$STUB_ZEUS_FAIL" ]; then echo "$STUB_ZEUS_FAIL" >&2; exit 1; fi
[ "$2" = end ] && cat "$STUB_REPORT"
exit 0
"""
SCONTROL_STUB = r"""#!/bin/bash
{ echo scontrol; printf '%s\n' "$@"; echo; } >> "$STUB_LOG"
if [ "$1" = show ]; then cat "$STUB_SHOW"; exit 0; fi
if [ -n "$STUB_SCONTROL_FAIL" ]; then echo "$STUB_SCONTROL_FAIL" >&2; exit 1; fi
exit 0
"""
SACCTMGR_STUB = r"""#!/bin/bash
{ echo sacctmgr; printf '%s\n' "$@"; echo; } >> "$STUB_LOG"
if [ -n "$STUB_SACCTMGR_OUT" ]; then echo "$STUB_SACCTMGR_OUT"; exit 0; fi
echo "sacctmgr: fatal: Could not establish a configuration source" >&2; exit 1
"""
LOGGER_STUB = r"""#!/bin/bash
{ echo logger; printf '%s\n' "$@"; echo; } >> "$STUB_LOG"
"""

NOBODY = 65534


def show_job(**fields: str | None) -> str:
    """One line of ``scontrol show job -o``, with the fields the epilog reads among others."""
    base: dict[str, str | None] = {
        "JobId": "4711",
        "JobName": "train",
        "UserId": "alice(1001)",
        "JobState": "COMPLETING",
        "NumNodes": "1",
        "NumCPUs": "8",
        "Comment": "(null)",
        "AdminComment": "(null)",
        "WorkDir": "/nonexistent",
        "StdErr": "/nonexistent/slurm-4711.out",
        "StdIn": "/dev/null",
        "StdOut": "/nonexistent/slurm-4711.out",
        "Power": "",
    }
    base.update(fields)
    return " ".join(f"{k}={v}" for k, v in base.items() if v is not None) + "\n"


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    calls: list[list[str]]

    def of(self, name: str) -> list[list[str]]:
        """The argv of each call to stub ``name``."""
        return [c[1:] for c in self.calls if c[0] == name]


class Node:
    """A fake Slurm node: stub commands on PATH, the job's output directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir()
        for name, text in (
            ("zeus-async", ZEUS_STUB),
            ("scontrol", SCONTROL_STUB),
            ("sacctmgr", SACCTMGR_STUB),
            ("logger", LOGGER_STUB),
        ):
            path = self.bin / name
            path.write_text(text)
            path.chmod(0o755)
        self.log = root / "calls"
        self.report = root / "report.json"
        self.report.write_text(json.dumps(REPORT) + "\n")
        self.show = root / "show"
        # The job's output directory: its user's, reachable by that user.
        self.uid = NOBODY if os.geteuid() == 0 else os.geteuid()
        self.gid = NOBODY if os.geteuid() == 0 else os.getegid()
        self.out = root / "out"
        self.out.mkdir()
        if os.geteuid() == 0:
            os.chown(self.out, self.uid, self.gid)

    def run(self, script: Path, env: dict[str, str] | None = None, **job: str | None) -> Run:
        self.log.write_text("")
        base: dict[str, str | None] = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "STUB_LOG": str(self.log),
            "STUB_REPORT": str(self.report),
            "STUB_SHOW": str(self.show),
            "ZEUS_ASYNC_SLURM_ENV": str(self.root / "no-settings"),
            "ZEUS_ASYNC_SOCKET": str(self.root / "agent.sock"),
            "SLURM_JOB_ID": "4711",
            "SLURM_JOB_USER": "alice",
            "SLURM_JOB_UID": str(self.uid),
            "SLURM_JOB_GID": str(self.gid),
            "SLURM_JOB_PARTITION": "gpu",
            "SLURM_JOB_GPUS": "0,1",
            "SLURMD_NODENAME": "gpu07",
        }
        base.update(job)
        base.update(env or {})
        proc = subprocess.run(
            ["bash", str(script)],
            env={k: v for k, v in base.items() if v is not None},
            capture_output=True,
            text=True,
            timeout=60,
        )
        calls = [c.split("\n") for c in self.log.read_text().split("\n\n") if c]
        return Run(proc.returncode, proc.stdout, proc.stderr, calls)


@pytest.fixture
def node() -> Iterator[Node]:
    # Not under pytest's tmp_path: its parents are root's alone (0700), and the job's user
    # (nobody, when the tests run as root) must reach the output directory.
    root = Path(tempfile.mkdtemp(prefix="za-slurm-"))
    root.chmod(0o755)
    yield Node(root)
    shutil.rmtree(root, ignore_errors=True)


# -- prolog -------------------------------------------------------------------------------------


def test_prolog_registers_the_job_with_the_agent(node: Node) -> None:
    run = node.run(PROLOG)
    assert (run.rc, run.stdout, run.stderr) == (0, "", "")
    sock = str(node.root / "agent.sock")
    assert run.of("zeus-async") == [
        [
            *("job", "start", "--job", "4711", "--gpus", "0,1", "--user", "alice"),
            *("--uid", str(node.uid), "--partition", "gpu"),
            f"ZEUS_ASYNC_SOCKET={sock}",
            f"ZEUS_ASYNC_SYSTEM_AGENT={sock}",
        ]
    ]
    assert run.of("logger") == [] and run.of("scontrol") == []


def test_prolog_takes_the_gpus_from_cuda_visible_devices_and_the_default_socket(
    node: Node,
) -> None:
    run = node.run(
        PROLOG,
        SLURM_JOB_GPUS=None,
        CUDA_VISIBLE_DEVICES="3",
        SLURM_JOB_PARTITION=None,
        ZEUS_ASYNC_SOCKET=None,
    )
    assert run.rc == 0
    assert run.of("zeus-async") == [
        [
            *("job", "start", "--job", "4711", "--gpus", "3", "--user", "alice"),
            *("--uid", str(node.uid)),
            "ZEUS_ASYNC_SOCKET=/run/zeus-async/agent.sock",
            "ZEUS_ASYNC_SYSTEM_AGENT=/run/zeus-async/agent.sock",
        ]
    ]


def test_prolog_reads_the_settings_file(node: Node) -> None:
    settings = node.root / "settings"
    settings.write_text(f"ZEUS_ASYNC_SOCKET={node.root}/other.sock\n")
    run = node.run(PROLOG, ZEUS_ASYNC_SLURM_ENV=str(settings), ZEUS_ASYNC_SOCKET=None)
    assert run.rc == 0
    assert run.of("zeus-async")[0][-2:] == [
        f"ZEUS_ASYNC_SOCKET={node.root}/other.sock",
        f"ZEUS_ASYNC_SYSTEM_AGENT={node.root}/other.sock",
    ]


def test_prolog_of_a_job_without_gpus_here_does_nothing(node: Node) -> None:
    run = node.run(PROLOG, SLURM_JOB_GPUS=None)
    assert (run.rc, run.calls) == (0, [])


@pytest.mark.parametrize(
    ("env", "logged"),
    [
        (
            {"STUB_ZEUS_FAIL": "zeus-async job: no agent answers on /run/zeus-async/agent.sock"},
            "prolog: job 4711: zeus-async job start failed: zeus-async job: no agent answers "
            "on /run/zeus-async/agent.sock",
        ),
        (
            {"STUB_ZEUS_SLEEP": "30", "ZEUS_ASYNC_TIMEOUT": "0.2"},
            "prolog: job 4711: zeus-async job start failed: no output (timed out after 0.2 s?)",
        ),
    ],
    ids=["agent-error", "agent-hangs"],
)
def test_prolog_never_fails_the_job(node: Node, env: dict[str, str], logged: str) -> None:
    run = node.run(PROLOG, env)
    assert run.rc == 0
    assert run.of("logger") == [["-t", "zeus-async-slurm", "-p", "daemon.warning", "--", logged]]


def test_prolog_without_zeus_async_installed_logs_and_exits_0(node: Node) -> None:
    (node.bin / "zeus-async").unlink()
    run = node.run(PROLOG)
    assert run.rc == 0
    [[*_, message]] = run.of("logger")
    assert message.startswith("prolog: job 4711: zeus-async job start failed: ")
    assert "zeus-async" in message.split("failed: ", 1)[1]  # timeout's "No such file" names it


def test_both_scripts_exit_0_in_an_empty_environment(node: Node) -> None:
    for script in (PROLOG, EPILOG):
        proc = subprocess.run(
            [
                *("/usr/bin/env", "-i", f"PATH={node.bin}:/usr/bin:/bin", f"STUB_LOG={node.log}"),
                *(f"ZEUS_ASYNC_SLURM_ENV={node.root}/none", "bash", str(script)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
    assert "no SLURM_JOB_ID in the environment" in node.log.read_text()
    assert "zeus-async\n" not in node.log.read_text()


# -- epilog -------------------------------------------------------------------------------------


def written(node: Node, name: str = "zeus-energy-4711.json") -> tuple[object, int, int, int]:
    path = node.out / name
    st = path.lstat()
    return json.loads(path.read_text()), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def test_epilog_reports_the_energy_in_admincomment_and_beside_the_output(node: Node) -> None:
    node.show.write_text(show_job(StdOut=f"{node.out}/slurm-4711.out", WorkDir="/home/alice"))
    run = node.run(EPILOG)
    assert (run.rc, run.stdout, run.stderr) == (0, "", "")
    assert run.of("zeus-async") == [
        [
            *("job", "end", "--job", "4711", "--json"),
            f"ZEUS_ASYNC_SOCKET={node.root}/agent.sock",
            f"ZEUS_ASYNC_SYSTEM_AGENT={node.root}/agent.sock",
        ]
    ]
    assert run.of("scontrol") == [
        ["show", "job", "-o", "4711"],
        ["update", "JobId=4711", "AdminComment=zeus_energy_j=12345.5"],
    ]
    assert run.of("logger") == []
    assert written(node) == (REPORT, node.uid, node.gid, 0o644)
    assert sorted(p.name for p in node.out.iterdir()) == ["zeus-energy-4711.json"]


def test_epilog_keeps_what_other_tools_wrote_in_admincomment(node: Node) -> None:
    node.show.write_text(
        show_job(
            AdminComment="jobstats=JS1:abc zeus_energy_j=1.0 note=x",
            StdOut=f"{node.out}/slurm-4711.out",
        )
    )
    run = node.run(EPILOG)
    assert run.of("scontrol")[1] == [
        "update",
        "JobId=4711",
        "AdminComment=jobstats=JS1:abc note=x zeus_energy_j=12345.5",
    ]


def test_epilog_of_a_multi_node_job_writes_one_key_and_one_file_per_node(node: Node) -> None:
    node.show.write_text(
        show_job(
            NumNodes="2",
            AdminComment="zeus_energy_j.gpu08=99.5",
            StdOut=f"{node.out}/slurm-4711.out",
        )
    )
    run = node.run(EPILOG)
    assert run.rc == 0
    assert run.of("scontrol")[1] == [
        "update",
        "JobId=4711",
        "AdminComment=zeus_energy_j.gpu08=99.5 zeus_energy_j.gpu07=12345.5",
    ]
    assert written(node, "zeus-energy-4711.gpu07.json")[0] == REPORT


@pytest.mark.parametrize(
    "stdout",
    ["/scratch/%u/logs/slurm-%j.out", None, "(null)"],
    ids=["unexpanded-pattern", "no-stdout", "null"],
)
def test_epilog_falls_back_to_the_workdir(node: Node, stdout: str | None) -> None:
    node.show.write_text(show_job(StdOut=stdout, WorkDir=str(node.out)))
    run = node.run(EPILOG)
    assert (run.rc, run.of("logger")) == (0, [])
    assert written(node) == (REPORT, node.uid, node.gid, 0o644)


def test_epilog_output_directory_with_spaces(node: Node) -> None:
    spaced = node.out / "my runs"
    spaced.mkdir()
    if os.geteuid() == 0:
        os.chown(spaced, node.uid, node.gid)
    node.show.write_text(show_job(StdOut=f"{spaced}/slurm-4711.out"))
    run = node.run(EPILOG)
    assert (run.rc, run.of("logger")) == (0, [])
    assert json.loads((spaced / "zeus-energy-4711.json").read_text()) == REPORT


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the epilog as Slurm does")
def test_epilog_writes_as_the_user_and_never_follows_a_planted_link(node: Node) -> None:
    target = node.root / "root-only"
    target.write_text("root's\n")
    target.chmod(0o644)
    (node.out / "zeus-energy-4711.json").symlink_to(target)
    node.show.write_text(show_job(StdOut=f"{node.out}/slurm-4711.out"))
    run = node.run(EPILOG)
    assert (run.rc, run.of("logger")) == (0, [])
    assert target.read_text() == "root's\n"
    assert written(node) == (REPORT, NOBODY, NOBODY, 0o644)  # the link itself was replaced


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the epilog as Slurm does")
def test_epilog_cannot_write_where_the_user_cannot(node: Node) -> None:
    locked = node.root / "locked"
    locked.mkdir(mode=0o755)  # root's: the job's user (nobody) cannot write there
    node.show.write_text(show_job(StdOut=f"{locked}/slurm-4711.out"))
    run = node.run(EPILOG)
    assert run.rc == 0
    [[*_, message]] = run.of("logger")
    assert message.startswith(
        f"epilog: job 4711: cannot write {locked}/zeus-energy-4711.json as uid {NOBODY}: "
    )
    assert list(locked.iterdir()) == []
    assert run.of("scontrol")[1] == ["update", "JobId=4711", "AdminComment=zeus_energy_j=12345.5"]


def test_epilog_when_the_agent_fails_logs_and_exits_0(node: Node) -> None:
    node.show.write_text(show_job(StdOut=f"{node.out}/slurm-4711.out"))
    run = node.run(EPILOG, {"STUB_ZEUS_FAIL": "zeus-async job: job 4711 is not known"})
    assert run.rc == 0
    assert run.of("scontrol") == []
    assert run.of("logger") == [
        [
            *("-t", "zeus-async-slurm", "-p", "daemon.warning", "--"),
            "epilog: job 4711: zeus-async job end failed: zeus-async job: job 4711 is not known",
        ]
    ]
    assert list(node.out.iterdir()) == []


def test_epilog_when_the_report_has_no_energy_logs_and_exits_0(node: Node) -> None:
    node.report.write_text('{"job_id": "4711"}\n')
    run = node.run(EPILOG)
    assert run.rc == 0
    assert run.of("scontrol") == []
    assert run.of("logger")[0][-1] == (
        'epilog: job 4711: no energy_j in zeus-async\'s report: {"job_id": "4711"}'
    )


def test_epilog_when_scontrol_update_fails_still_writes_the_file(node: Node) -> None:
    node.show.write_text(show_job(StdOut=f"{node.out}/slurm-4711.out"))
    run = node.run(EPILOG, {"STUB_SCONTROL_FAIL": "slurm_update error: Access/permission denied"})
    assert run.rc == 0
    # No accounting database either (sacctmgr fails, tried 10 times): one line for both.
    assert len(run.of("sacctmgr")) == 10
    assert run.of("logger")[0][-1] == (
        "epilog: job 4711: AdminComment not written: scontrol: "
        "slurm_update error: Access/permission denied; sacctmgr: "
        "sacctmgr: fatal: Could not establish a configuration source"
    )
    assert written(node)[0] == REPORT


def test_epilog_of_a_finished_job_writes_admincomment_in_the_accounting_database(
    node: Node,
) -> None:
    """slurmctld refuses to update a finished job (the epilog runs after it finished); with
    slurmdbd the job's record is written through sacctmgr (tests/agent/test_slurm_jobs.py
    does it against a real slurmdbd)."""
    node.show.write_text(show_job(StdOut=f"{node.out}/slurm-4711.out", AdminComment="x=1"))
    run = node.run(
        EPILOG,
        {
            "STUB_SCONTROL_FAIL": "Job has already finished for job 4711",
            "STUB_SACCTMGR_OUT": " Modified jobs...\n  4711 submitted at 2026-11-27T06:02:38",
        },
    )
    assert run.rc == 0 and run.of("logger") == []
    assert run.of("sacctmgr") == [
        [
            "-i",
            "modify",
            "job",
            "where",
            "jobid=4711",
            "set",
            "AdminComment=x=1 zeus_energy_j=12345.5",
        ]
    ]
    assert written(node)[0] == REPORT


def test_epilog_of_a_job_without_gpus_here_does_nothing(node: Node) -> None:
    run = node.run(EPILOG, SLURM_JOB_GPUS=None)
    assert (run.rc, run.calls) == (0, [])


def test_scripts_are_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("ZEUS_ASYNC_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail("shellcheck is not installed and ZEUS_ASYNC_REQUIRE_DEPLOY_TOOLS=1 is set")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run(
        [shellcheck, "--severity=style", str(PROLOG), str(EPILOG)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_epilog_with_a_vanished_output_directory_logs_and_exits_0(node: Node) -> None:
    node.show.write_text(show_job(StdOut="/nonexistent/dir/slurm-4711.out"))
    run = node.run(EPILOG)
    assert run.rc == 0
    assert run.of("scontrol")[1] == ["update", "JobId=4711", "AdminComment=zeus_energy_j=12345.5"]
    [[*_, message]] = run.of("logger")
    assert message.startswith(
        f"epilog: job 4711: cannot write /nonexistent/dir/zeus-energy-4711.json as uid {node.uid}: "
    )
