"""Every ``zeus-async`` command line the deploy files run is one the CLI takes: the systemd
unit's ExecStart and ExecStopPost, the DaemonSet's arguments, the Slurm prolog's and epilog's
commands (as they run them in tests/deploy/test_slurm.py). Parsed by the CLI's own parser,
nothing run."""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
from pathlib import Path

import pytest

from zeus_async.cli import build_parser

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "zeus-async-agent.service"
DAEMONSET = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"


def unit_line(key: str) -> list[str]:
    [line] = [ln for ln in UNIT.read_text().splitlines() if ln.startswith(f"{key}=")]
    argv = shlex.split(line.partition("=")[2])
    assert argv[0] == "/usr/local/bin/zeus-async"
    return [a for a in argv[1:] if a != "$ZEUS_ASYNC_AGENT_ARGS"]  # empty by default


def daemonset_args() -> list[str]:
    ds = yaml.safe_load(DAEMONSET.read_text())
    [container] = ds["spec"]["template"]["spec"]["containers"]
    return ["agent", *container["args"]]  # the image's ENTRYPOINT is `zeus-async agent`


def parse(argv: list[str]) -> argparse.Namespace:
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            return build_parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"zeus-async {shlex.join(argv)}: {errors.getvalue()}") from None


def test_systemd_exec_stop_post() -> None:
    args = parse(unit_line("ExecStopPost"))
    assert (args.command, args.restore, args.system) == ("agent", True, True)


def test_systemd_exec_start() -> None:
    parse(unit_line("ExecStart"))


def test_daemonset_args() -> None:
    parse(daemonset_args())


def test_slurm_prolog_and_epilog_commands() -> None:
    start = ("job", "start", "--job", "4711", "--gpus", "0,1", "--user", "alice")
    parse([*start, "--uid", "1001", "--partition", "gpu"])
    parse(["job", "end", "--job", "4711", "--json"])
