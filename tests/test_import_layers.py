"""No import circles inside zeus_async.

The package is layered (events/clock/errors -> carbon, devices, bus, aggregate -> store,
runtime, agent, inference -> monitor, exporters -> optimizer -> integrations, cli) and every
import must point down those layers.  A circle means two modules can only be understood, tested and
imported together, and a lazy import inside a function that goes back up is still a circle:
it merely moves the partial-initialisation failure from import time to the first call.

The graph is computed from the source with :mod:`ast`, so it sees every ``import`` statement
wherever it sits (module level, inside functions, under ``if TYPE_CHECKING:``), with
``from . import x`` resolved to the submodule ``x`` when there is one and to the package's
``__init__`` otherwise.  Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``,
but those implicit parent edges are not counted: a package ``__init__`` re-exporting its
submodules is the normal shape, not a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import zeus_async

PACKAGE = "zeus_async"
ROOT = Path(zeus_async.__file__).resolve().parent

# Circles allowed while a change removes them (each the exact set of modules in one strongly
# connected component); empty: every arrow points down the layers.
ALLOWED_CYCLES: list[frozenset[str]] = []

# Vendored third-party stand-in, not part of the package's own layering.
EXCLUDED_PREFIXES = ("zeus_async.testing._pynvml_shim",)


def _module_name(path: Path) -> tuple[str, bool]:
    """Return (dotted name, is_package) for a source file under ROOT."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _modules() -> dict[str, tuple[Path, bool]]:
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        name, is_package = _module_name(path)
        if not name.startswith(EXCLUDED_PREFIXES):
            found[name] = (path, is_package)
    return found


def _resolve_relative(current: str, is_package: bool, level: int, module: str | None) -> str:
    """Absolute name of ``from <level dots><module> import ...`` written in ``current``."""
    base = current.split(".") if is_package else current.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _target(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    """The module of the package that importing ``name`` executes, if it is one of ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> modules of the package it imports (every import statement in the file)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = _resolve_relative(name, is_package, node.level, node.module)
                else:
                    base = node.module or ""
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else base)
            for target in targets:
                if not target.startswith(PACKAGE):
                    continue
                resolved = _target(target, modules)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                child = pending.pop(0)
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, sorted(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest concrete circle through the component's first module, for the message."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [start]
                    while node != start:
                        path.append(node)
                        node = previous[node]
                    return [start, *reversed(path[1:]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component


def test_resolver_sees_relative_and_lazy_imports() -> None:
    graph = import_graph()
    # `from .aggregate.windows import WindowResult` in the package __init__.
    assert "zeus_async.aggregate.windows" in graph["zeus_async"]
    # `from . import x` resolves to the submodule, not the package.
    assert "zeus_async.aggregate" not in graph["zeus_async.aggregate.windows"]


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = [c for c in strongly_connected(graph) if frozenset(c) not in ALLOWED_CYCLES]
    message = "\n".join(
        f"import circle among {len(c)} modules: " + " -> ".join(_one_cycle(graph, c))
        for c in cycles
    )
    assert not cycles, "\n" + message


def test_allow_list_is_not_stale() -> None:
    components = {frozenset(c) for c in strongly_connected(import_graph())}
    stale = [sorted(allowed) for allowed in ALLOWED_CYCLES if allowed not in components]
    assert not stale, f"allowed circles no longer present, delete them: {stale}"


# Packages that sit just above the bottom layer, so any layer may use them: the modules of ours
# each may import besides its own (zeus_async.carbon must not reach runtime/aggregate/store).
LOW_PACKAGES: dict[str, tuple[str, ...]] = {
    "zeus_async.carbon": ("zeus_async.errors", "zeus_async.clock"),
}


def test_low_packages_import_only_the_bottom_layer() -> None:
    graph = import_graph()
    wrong: list[str] = []
    for package, allowed in LOW_PACKAGES.items():
        members = [m for m in graph if m == package or m.startswith(package + ".")]
        assert members, f"{package} not found"
        for module in members:
            for target in sorted(graph[module]):
                if target == package or target.startswith(package + "."):
                    continue
                if target not in allowed:
                    wrong.append(f"{module} imports {target}")
    assert not wrong, "\n" + "\n".join(wrong)
