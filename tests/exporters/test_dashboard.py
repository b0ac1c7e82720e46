"""The shipped Grafana dashboard and Prometheus recording rules (docs/grafana/) ask only for
metrics the exporter exports (or the rules record), and the rules pass promtool."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from zeus_async.exporters import PrometheusExporter

DOCS = Path(__file__).resolve().parents[2] / "docs" / "grafana"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", text)  # label lists
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group() in KEYWORDS:
            continue  # a function or an aggregation
        names.add(match.group())
    return names


def exported() -> set[str]:
    """Every sample name the exporter can write (counters with ``_total``)."""
    names = set()
    for metric in PrometheusExporter().describe():
        names.add(metric.name + ("_total" if metric.type == "counter" else ""))
    return names


def recording_rules() -> dict[str, str]:
    import yaml

    doc = yaml.safe_load((DOCS / "zeus_async.rules.yml").read_text())
    return {r["record"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def test_metric_names_are_parsed_from_promql() -> None:
    expr = 'sum by (host, pid) (rate(zeus_x_total{a="b"}[1m])) + zeus:y:sum * 100'
    assert metric_names(expr) == {"zeus_x_total", "zeus:y:sum"}


def test_every_rule_and_panel_reads_exported_metrics() -> None:
    pytest.importorskip("yaml")
    ours = exported()
    rules = recording_rules()
    assert len(rules) == 7
    for record, expr in rules.items():
        assert metric_names(expr) and metric_names(expr) <= ours, (record, expr)
    dashboard = json.loads((DOCS / "zeus_async.json").read_text())
    panels = dashboard["panels"]
    assert len(panels) >= 10
    queried = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names and names <= ours | set(rules), (panel["title"], target["expr"])
            queried |= names
    # Power, energy, windows, optimizer-set limits and processes are all on it.
    for needed in (
        "zeus_gpu_power_watts",
        "zeus:gpu_power_watts:rate1m",
        "zeus:window_energy_joules:increase5m",
        "zeus_gpu_power_limit_watts",
        "zeus:process_gpu_power_watts:sum",
    ):
        assert needed in queried
    host = dashboard["templating"]["list"][1]
    source = re.fullmatch(r"label_values\((\w+), host\)", host["query"]["query"])
    assert source is not None and source.group(1) in ours


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("ZEUS_ASYNC_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("promtool is not installed and ZEUS_ASYNC_REQUIRE_PROMETHEUS=1 is set")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    proc = subprocess.run(
        [promtool, "check", "rules", str(DOCS / "zeus_async.rules.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 7 rules found" in proc.stdout + proc.stderr
