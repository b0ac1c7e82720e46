"""Every energy method name the code can produce is documented in docs/energy-methods.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    ROOT / "zeus_async" / "aggregate" / "history.py",
    ROOT / "zeus_async" / "aggregate" / "live.py",
    *sorted((ROOT / "zeus_async" / "store" / "analysis").glob("*.py")),
]
NAME = re.compile(r"^(counter|integrated|unavailable)[a-z+]*$")
SUFFIX = re.compile(r"^, [a-z]+$")


def _produced() -> set[str]:
    names: set[str] = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and NAME.match(node.value)
            ):
                names.add(node.value)
            if isinstance(node, ast.JoinedStr):  # f"{...}, clamped": a documented suffix
                for part in node.values:
                    if isinstance(part, ast.Constant) and SUFFIX.match(str(part.value)):
                        names.add(str(part.value))
    return names


def test_every_method_name_is_documented() -> None:
    doc = (ROOT / "docs" / "energy-methods.md").read_text()
    produced = _produced()
    assert {"counter", "counter+interpolated", "counter+extrapolated", ", clamped"} <= produced
    missing = sorted(name for name in produced if f"`{name}`" not in doc)
    assert not missing, f"undocumented method names: {missing}"
