"""The dashboard's Jobs panels (docs/grafana/zeus_async.json) compute what the per-workload
recording rules record: each panel's query, with Grafana's variables filled in, is evaluated by
promtool over the rules' own unit-test series (deploy/prometheus/zeus-async.rules.test.yml) and
must give the same figures as the rule it mirrors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "zeus_async.json"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "zeus-async.rules.test.yml"

# Panel title -> (evaluation time, the samples expected: labels -> value).
EXPECTED: dict[str, tuple[str, dict[str, float]]] = {
    "Jobs: GPU power per Slurm job": ("10m", {'{job_id="4711", user="alice"}': 35}),
    "Jobs: GPU power per user": ("10m", {'{user="alice"}': 36, '{user="bob"}': 10}),
    "Jobs: top Slurm jobs by GPU energy in the time range": (
        "1h",
        {'{job_id="4711", user="alice"}': 126000},
    ),
    "Jobs: GPU energy per user in the time range": (
        "1h",
        {'{user="alice"}': 129600, '{user="bob"}': 36000},
    ),
    "Jobs: GPU power per Kubernetes pod": ("10m", {'{namespace="ml", pod="p1"}': 10}),
    "Jobs: GPU power no workload held": (
        "10m",
        {'{host="n1"}': 50, '{host="n2"}': 0, '{host="n3"}': 0},
    ),
}


def jobs_panels() -> dict[str, dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {p["title"]: p for p in dashboard["panels"] if p["title"].startswith("Jobs: ")}


def grafana(expr: str, range_: str) -> str:
    """The query as Grafana sends it over the whole dashboard (every host, every user)."""
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$__range", range_)
        .replace('"$host"', '".*"')
        .replace('"$user"', '".*"')
    )


def test_jobs_panels_are_on_the_dashboard() -> None:
    panels = jobs_panels()
    assert set(panels) == set(EXPECTED)
    table = panels["Jobs: top Slurm jobs by GPU energy in the time range"]
    assert table["type"] == "table"
    [target] = table["targets"]
    assert target["instant"] is True and target["format"] == "table"
    assert target["expr"].startswith("topk(20, ")
    dashboard = json.loads(DASHBOARD.read_text())
    [user] = [v for v in dashboard["templating"]["list"] if v["name"] == "user"]
    assert user["allValue"] == ".*"  # pods without a known user are not left out
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert min(p["gridPos"]["y"] for p in panels.values()) >= max(
        p["gridPos"]["y"] + p["gridPos"]["h"]
        for p in dashboard["panels"]
        if not p["title"].startswith("Jobs: ")
    )


def test_jobs_panels_give_the_rules_figures(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("ZEUS_ASYNC_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("promtool is not installed and ZEUS_ASYNC_REQUIRE_PROMETHEUS=1 is set")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    series = yaml.safe_load(RULE_TESTS.read_text())["tests"][0]["input_series"]
    checks = []
    for title, panel in jobs_panels().items():
        at, samples = EXPECTED[title]
        [target] = panel["targets"]
        checks.append(
            {
                "expr": grafana(target["expr"], "1h" if at == "1h" else "10m"),
                "eval_time": at,
                "exp_samples": [{"labels": k, "value": v} for k, v in samples.items()],
            }
        )
    (tmp_path / "empty.rules.yml").write_text("groups: []\n")
    (tmp_path / "panels.test.yml").write_text(
        yaml.safe_dump(
            {
                "rule_files": ["empty.rules.yml"],
                "evaluation_interval": "15s",
                "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": checks}],
            }
        )
    )
    proc = subprocess.run(
        [promtool, "test", "rules", "panels.test.yml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
