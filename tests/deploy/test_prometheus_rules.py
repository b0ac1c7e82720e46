"""The per-workload recording rules (deploy/prometheus/zeus-async.rules.yml): promtool accepts
them, their unit tests (zeus-async.rules.test.yml: jobs over two nodes, a user's job and bare
process, a pod's two containers, idle GPUs) pass, and those unit tests catch a wrong rule."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "zeus-async.rules.yml"
TESTS = ROOT / "deploy" / "prometheus" / "zeus-async.rules.test.yml"
NODE_RULES = ROOT / "docs" / "grafana" / "zeus_async.rules.yml"
#: The node agents' counters the rules read (zeus_async.exporters, the workload ledger).
COUNTERS = {"zeus_workload_gpu_energy_joules_total", "zeus_gpu_energy_joules_total"}


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        if os.environ.get("ZEUS_ASYNC_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("promtool is not installed and ZEUS_ASYNC_REQUIRE_PROMETHEUS=1 is set")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return exe


def rules(path: Path = RULES) -> dict[str, str]:
    doc = yaml.safe_load(path.read_text())
    return {r["record"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def test_promtool_accepts_the_rules() -> None:
    proc = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 8 rules found" in proc.stdout + proc.stderr


def test_rule_unit_tests_pass() -> None:
    proc = subprocess.run(
        [promtool(), "test", "rules", str(TESTS)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=TESTS.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_rule_unit_tests_catch_a_wrong_rule(tmp_path: Path) -> None:
    """A job summed per node instead of across nodes: the unit tests say so."""
    text = RULES.read_text()
    job = 'rate(zeus_workload_gpu_energy_joules_total{kind="slurm"}[1m]))'
    wrong = text.replace(f"sum by (job_id, user) ({job}", f"sum by (job_id, user, host) ({job}")
    assert wrong != text
    (tmp_path / RULES.name).write_text(wrong)
    (tmp_path / TESTS.name).write_text(TESTS.read_text())
    proc = subprocess.run(
        [promtool(), "test", "rules", TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert "zeus:job_gpu_power_watts:rate1m" in proc.stdout + proc.stderr


def test_rules_read_only_the_agents_counters_and_never_shadow_the_node_rules() -> None:
    ours = rules()
    assert set(ours).isdisjoint(rules(NODE_RULES))
    for record, expr in ours.items():
        assert re.fullmatch(r"zeus:[a-z_]+:[a-z0-9]+", record), record
        text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
        text = re.sub(r"\b(?:by|on)\s*\([^)]*\)", "", text)
        names = {
            m.group()
            for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text)
            if not text[m.end() :].lstrip().startswith("(")
            and m.group() not in ("and", "or", "unless")
        }
        assert names and names <= COUNTERS | set(ours), (record, names)
