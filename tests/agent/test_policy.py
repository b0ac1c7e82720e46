"""The system agent's policy file: parsing, errors that name file and key, rule decisions, and
the default allocation hook read from a real process's environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeus_async.agent import policy as policy_module
from zeus_async.agent.policy import Policy, Who, allocated_from_environ, load_policy
from zeus_async.errors import ConfigError, PolicyDeniedError, PolicyError

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "policy.example.toml"

ALICE = Who(1001, "alice", frozenset({100, 2001}), frozenset({"users", "ml"}))
BOB = Who(1002, "bob", frozenset({100}), frozenset({"users"}))
ROOT = Who(0, "root", frozenset({0}), frozenset({"root"}))


def _load(tmp_path: Path, text: str) -> Policy:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return load_policy(path, group="zeus-async")


def _never() -> set[int] | None:
    raise AssertionError("the allocation hook must not be asked when a rule applies")


def test_the_example_policy_reads_and_decides(tmp_path: Path) -> None:
    policy = load_policy(EXAMPLE, group="zeus-async")
    assert policy.default == "allocated"
    assert [r.key for r in policy.rules] == ["control.rule[1]", "control.rule[2]"]
    # ml (alice) may cap GPUs 0-3 within 200-400 W; bob (not in ml) gets the default.
    policy.check_control(ALICE, 42, "power_limit", [0, 3], 300, _never)
    with pytest.raises(PolicyDeniedError, match=r"outside what .* \[200, 400\] W"):
        policy.check_control(ALICE, 42, "power_limit", [0], 450, _never)
    policy.check_control(ALICE, 42, "sm_clocks", [0], 1200, _never)
    policy.check_control(ALICE, 42, "sm_clocks", [0], None, _never)  # a reset
    policy.check_control(BOB, 43, "power_limit", [5], 650, lambda: {5})
    assert policy.may_read(Who(7, "x", frozenset({9}), frozenset({"zeus-async"})))
    assert not policy.may_read(BOB)


def test_a_missing_default_file_means_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = tmp_path / "etc-policy.toml"
    monkeypatch.setattr(policy_module, "SYSTEM_POLICY", absent)
    policy = load_policy(None, group="gpu-users")
    assert policy.read.groups == {"gpu-users"} and policy.rules == ()
    assert policy.socket_group_only("gpu-users")
    with pytest.raises(PolicyDeniedError) as info:
        policy.check_control(BOB, 43, "power_limit", [1], 300, lambda: None)
    assert str(info.value) == (
        f"gpu:1 power limit: no rule of {absent} (absent: the defaults apply) lets user bob "
        "change it, and the GPUs allocated to the job of process 43 are unknown (no "
        "SLURM_JOB_GPUS or CUDA_VISIBLE_DEVICES in its environment); ask the operator for a "
        "[[control.rule]]"
    )
    # A file named on the command line must exist.
    with pytest.raises(PolicyError) as missing:
        load_policy(absent, group="g")
    assert str(missing.value) == f"policy file {absent}: does not exist"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("read = [", "not valid TOML"),
        ("[reed]\n", ": reed: unknown key (known: control, read)"),
        ("[read]\nall = 1\n", ": read.all: must be true or false, not 1"),
        ("[read]\nusers = [true]\n", ": read.users: must be a list of names or ids"),
        ('[control]\ndefault = "any"\n', ': control.default: must be "allocated" or "none"'),
        ("[[control.rule]]\ngpus = [0]\n", ": control.rule[1]: names nobody"),
        (
            '[[control.rule]]\nall = true\n[[control.rule]]\nusers = ["a"]\nmax_power = 3\n',
            ": control.rule[2].max_power: unknown key (known: all, gpus, groups, max_power_w,",
        ),
        (
            "[[control.rule]]\nall = true\ngpus = [-1]\n",
            ": control.rule[1].gpus: must be a list of GPU indices, not [-1]",
        ),
        (
            '[[control.rule]]\nall = true\nsettings = ["fan"]\n',
            ': control.rule[1].settings: must list "power_limit" and/or "sm_clocks"',
        ),
        (
            "[[control.rule]]\nall = true\nmin_power_w = 300\nmax_power_w = 200\n",
            ": control.rule[1].min_power_w: 300 is above max_power_w (200)",
        ),
        (
            '[[control.rule]]\nall = true\nmax_sm_mhz = "fast"\n',
            ": control.rule[1].max_sm_mhz: must be a positive number, not 'fast'",
        ),
    ],
)
def test_a_bad_policy_is_one_line_naming_file_and_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(PolicyError) as info:
        _load(tmp_path, text)
    text_of = str(info.value)
    assert text_of.startswith(f"policy file {tmp_path / 'policy.toml'}")
    assert message in text_of
    assert "\n" not in text_of
    assert isinstance(info.value, ConfigError)


def test_rules_limit_and_the_default_decides_elsewhere(tmp_path: Path) -> None:
    policy = _load(
        tmp_path,
        '[control]\ndefault = "none"\n'
        '[[control.rule]]\nusers = ["alice"]\ngpus = [0]\nmin_power_w = 250\n'
        '[[control.rule]]\ngroups = ["ml"]\ngpus = [0]\nmax_power_w = 300\n'
        '[[control.rule]]\nusers = [1002]\nsettings = ["sm_clocks"]\n',
    )
    # Two rules apply to alice on GPU 0: either range grants.
    policy.check_control(ALICE, 1, "power_limit", [0], 200, _never)  # the ml rule
    policy.check_control(ALICE, 1, "power_limit", [0], 650, _never)  # her own
    assert policy.power_range(ALICE, 0) == (None, None)  # hull: unbounded on both sides
    assert policy.power_range(ALICE, 1) == (None, None)  # no rule
    with pytest.raises(PolicyDeniedError) as info:
        policy.check_control(ALICE, 1, "power_limit", [0, 1], 300, _never)
    assert str(info.value) == (
        f"gpu:1 power limit: no rule of {tmp_path / 'policy.toml'} lets user alice change it "
        '([control] default = "none")'
    )
    # A uid in users names that user; rules for one setting say nothing of the other.
    policy.check_control(BOB, 2, "sm_clocks", [3], 1000, _never)
    with pytest.raises(PolicyDeniedError, match="gpu:3 power limit: no rule"):
        policy.check_control(BOB, 2, "power_limit", [3], 300, _never)
    policy.check_control(ROOT, 3, "power_limit", [7], 9999, _never)  # root: never refused


def test_allocated_gpus_come_from_the_clients_environment() -> None:
    uuids = [f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]
    hook = allocated_from_environ(uuids)
    cases = [
        ({"SLURM_JOB_GPUS": "1,3"}, {1, 3}),
        ({"SLURM_STEP_GPUS": "2", "SLURM_JOB_GPUS": "1,2,3"}, {2}),
        ({"CUDA_VISIBLE_DEVICES": f"{uuids[2]},0"}, {0, 2}),
        ({"CUDA_VISIBLE_DEVICES": ""}, set()),
        ({}, None),
    ]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_"))}
    for env, expected in cases:
        # A real process: its environment as the kernel keeps it (/proc/<pid>/environ).
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(base, **env),
        )
        try:
            # Running (just after exec, the kernel shows an empty environment for a moment).
            assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
            assert hook(os.getuid(), proc.pid) == expected, env
        finally:
            proc.communicate(timeout=10)
    assert hook(os.getuid(), proc.pid) is None  # gone


def test_a_system_agents_allocated_gpus_come_from_the_job_its_prolog_announced(
    tmp_path: Path,
) -> None:
    """A job's process whose environment names no GPU (SLURM_JOB_ID only): its job's GPUs are
    those the prolog announced, not none."""
    from types import SimpleNamespace
    from typing import Any

    from zeus_async.agent.server import _allocated_by
    from zeus_async.agent.slurm import SlurmSource
    from zeus_async.agent.workloads import WorkloadResolver
    from zeus_async.testing.fake_proc import FakeProc

    proc = FakeProc(tmp_path / "proc")
    proc.add(700, uid=1000, environ={"SLURM_JOB_ID": "5"})
    proc.add(701, uid=1000, environ={"CUDA_VISIBLE_DEVICES": "3"})  # in no job
    slurm = SlurmSource(proc_root=proc.root)
    resolver = WorkloadResolver(slurm=slurm, proc_root=proc.root)
    slurm.register(5, gpus=[2], user="root", uid=0)
    gpus = [
        SimpleNamespace(key=f"gpu:{i}", describe=lambda i=i: SimpleNamespace(uuid=f"GPU-{i}"))
        for i in range(4)
    ]
    rt: Any = SimpleNamespace(devices=gpus)
    allocated = _allocated_by(resolver, rt)
    assert allocated(1000, 700) == {2}
    # A process in no job: what its own environment says (read from the real /proc).
    assert allocated(os.getuid(), os.getpid()) == allocated_from_environ(
        [f"GPU-{i}" for i in range(4)]
    )(os.getuid(), os.getpid())
