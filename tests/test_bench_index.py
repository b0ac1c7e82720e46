"""The benchmark index and the results table name only scripts that exist, and list them all.

Every figure in ``bench/RESULTS.md`` comes with the command that measures it, and
``bench/README.md`` is the index of ``bench/`` by capability: a command whose script has moved
or gone leaves a figure no one can check, and a script missing from the index is one no reader
finds. The section of ``RESULTS.md`` marked "in progress" holds a session's text as written,
old paths included, until it is folded into the tables; it is left out of the path check.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

#: A path under bench/ to a script, as commands and the index write it.
SCRIPT_PATH = re.compile(r"bench/[A-Za-z0-9_./-]+?\.(?:py|sh)\b")
#: A link to a script relative to bench/README.md: ``(folder/bench_x.py)``.
RELATIVE_LINK = re.compile(r"\]\(([A-Za-z0-9_/-]+\.(?:py|sh))\)")


def _without_in_progress(text: str) -> str:
    """``text`` less its "## ... in progress" sections (each up to the next ``## `` heading)."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.startswith("## "):
            skipping = "in progress" in line
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def _bench_scripts() -> set[str]:
    """Every script in bench/, as a path from the repository root (the venv left out)."""
    found = {
        p.relative_to(ROOT).as_posix()
        for pattern in ("bench_*.py", "*.sh")
        for p in BENCH.rglob(pattern)
    }
    return {p for p in found if not p.startswith("bench/.venv/")}


def test_every_script_path_in_results_exists() -> None:
    text = _without_in_progress((BENCH / "RESULTS.md").read_text())
    paths = set(SCRIPT_PATH.findall(text))
    assert len(paths) >= 25  # one table per capability, each with its commands
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert missing == []


def test_every_script_path_in_the_bench_index_exists() -> None:
    text = (BENCH / "README.md").read_text()
    paths = set(SCRIPT_PATH.findall(text))
    paths |= {f"bench/{link}" for link in RELATIVE_LINK.findall(text)}
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert missing == []


def test_every_bench_script_is_in_the_index() -> None:
    text = (BENCH / "README.md").read_text()
    linked = {f"bench/{link}" for link in RELATIVE_LINK.findall(text)}
    scripts = _bench_scripts()
    assert len(scripts) >= 30
    assert sorted(scripts - linked) == []


def test_no_script_is_left_flat_in_bench() -> None:
    """Scripts live in a folder by capability; bench/ itself holds the index and the results."""
    flat = sorted(p.name for p in BENCH.glob("*") if p.suffix in (".py", ".sh"))
    assert flat == []


def test_results_links_to_the_journal_it_was_distilled_from() -> None:
    head = (BENCH / "RESULTS.md").read_text()[:2000]
    assert "(history/RESULTS-journal-2026-11.md)" in head
    assert (BENCH / "history" / "RESULTS-journal-2026-11.md").is_file()
