"""The systemd unit (deploy/systemd/): ``systemd-analyze verify`` finds nothing to say about it
or about its drop-in example with every option turned on, and the unit keeps its promises:
the agent's command line, a restore after any stop, journals kept across stops, a clean exit
after SIGTERM counted as a success."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "zeus-async-agent.service"
DROPIN = SYSTEMD / "zeus-async-agent.service.d" / "override.conf.example"
INSTALLED = "/usr/local/bin/zeus-async"
VENV = "/opt/zeus-async/bin/zeus-async"  # the drop-in example's other install


def zeus_async() -> str:
    """An executable zeus-async to stand for /usr/local/bin's (verify checks it exists)."""
    exe = shutil.which("zeus-async") or str(Path(sys.executable).parent / "zeus-async")
    assert Path(exe).is_file(), "the package is not installed in this environment"
    return exe


def verify(
    tmp_path: Path, unit: str, dropin: str | None = None
) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("ZEUS_ASYNC_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail("systemd-analyze is missing and ZEUS_ASYNC_REQUIRE_DEPLOY_TOOLS=1 is set")
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    path = tmp_path / UNIT.name
    path.write_text(unit.replace(INSTALLED, zeus_async()))
    if dropin is not None:
        (tmp_path / f"{UNIT.name}.d").mkdir()
        (tmp_path / f"{UNIT.name}.d" / "override.conf").write_text(
            dropin.replace(INSTALLED, zeus_async()).replace(VENV, zeus_async())
        )
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{tmp_path}:", SYSTEMD_LOG_COLOR="0")
    return subprocess.run(
        [analyze, "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_systemd_analyze_verify_is_silent(tmp_path: Path) -> None:
    proc = verify(tmp_path, UNIT.read_text())
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_the_drop_in_example_with_everything_on_is_valid(tmp_path: Path) -> None:
    # Every commented-out setting (#Key=value) switched on.
    on = re.sub(r"(?m)^#([A-Z][A-Za-z]*=)", r"\1", DROPIN.read_text())
    assert on.count("\nExecStart=") >= 4
    proc = verify(tmp_path, UNIT.read_text(), on)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_verify_would_say_so(tmp_path: Path) -> None:
    """The check is not vacuous: a misspelt setting is reported."""
    proc = verify(tmp_path, UNIT.read_text().replace("ProtectSystem=", "ProtectSistem="))
    assert "Unknown key 'ProtectSistem' in section [Service]" in proc.stderr


def service() -> dict[str, list[str]]:
    """The [Service] settings, each with every value it is given."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().split("[Service]", 1)[1].split("[Install]")[0].splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_the_unit_keeps_its_promises() -> None:
    s = service()
    assert s["ExecStart"] == [
        f"{INSTALLED} agent --system --prometheus-port 9466 --prometheus-addr 0.0.0.0 "
        "--policy /etc/zeus-async/policy.toml --group zeus-async $ZEUS_ASYNC_AGENT_ARGS"
    ]
    assert s["ExecStopPost"] == [f"{INSTALLED} agent --restore --system"]
    assert s["Restart"] == ["on-failure"] and s["KillSignal"] == ["SIGTERM"]
    assert s["KillMode"] == ["mixed"]  # SIGTERM to the agent alone; it restores, then exits
    assert int(s["TimeoutStopSec"][0].removesuffix("s")) >= 60
    # 128 + SIGHUP, SIGINT, SIGTERM: what the agent exits with after restoring everything.
    assert s["SuccessExitStatus"] == ["129 130 143"]
    assert s["RuntimeDirectory"] == ["zeus-async"] and s["RuntimeDirectoryMode"] == ["0755"]
    assert s["RuntimeDirectoryPreserve"] == ["yes"]  # the lease journals outlive a stop
    assert s["StateDirectory"] == ["zeus-async"]
    assert s["ProtectSystem"] == ["strict"] and s["PrivateTmp"] == ["yes"]
    assert "CAP_SYS_ADMIN" in s["CapabilityBoundingSet"][0].split()
    # The GPUs and the other users' processes stay visible.
    for hiding in ("PrivateDevices", "DevicePolicy", "ProtectProc", "MemoryDenyWriteExecute"):
        assert hiding not in s, hiding


def test_the_sysusers_file_creates_the_group() -> None:
    lines = [
        line.split()
        for line in (SYSTEMD / "zeus-async.sysusers.conf").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines == [["g", "zeus-async", "-"]]
