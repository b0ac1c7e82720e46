"""One home per framework (issue 35 item 2): ``zeus_async.integrations.hf`` / ``.lightning``
hold everything a user of that framework imports; the old ``zeus_async.optimizer`` paths still
work with a ``DeprecationWarning``; each module imports its own framework only; no import
circle joins these modules; the callbacks pickle under their new module."""

from __future__ import annotations

import ast
import importlib
import json
import os
import pickle
import pickletools
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zeus_async import Monitor
from zeus_async.devices.sim import SimConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zeus_async"
FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "lightning_fabric")
CALLBACK = {"hf": "HFGlobalPowerLimitOptimizer", "lightning": "LightningPowerLimitOptimizer"}
SHARED = "zeus_async.integrations._power_limit"

#: Every name an old module had: (old module, name, the module it is in now).
MOVED = [
    ("zeus_async.optimizer.hf", "HFGlobalPowerLimitOptimizer", "zeus_async.integrations.hf"),
    (
        "zeus_async.optimizer.lightning",
        "LightningPowerLimitOptimizer",
        "zeus_async.integrations.lightning",
    ),
    (
        "zeus_async.optimizer.integrations",
        "HFGlobalPowerLimitOptimizer",
        "zeus_async.integrations.hf",
    ),
    (
        "zeus_async.optimizer.integrations",
        "LightningPowerLimitOptimizer",
        "zeus_async.integrations.lightning",
    ),
    ("zeus_async.optimizer.integrations", "GlobalPowerLimitOptimizer", "zeus_async.optimizer"),
    *[
        ("zeus_async.optimizer.integrations", name, SHARED)
        for name in (
            "HF_MISSING",
            "LIGHTNING_MISSING",
            "OptimizerCallback",
            "base_class",
            "hf_rank",
            "lightning_rank",
            "power_limit_metrics",
            "resolve_gpus",
        )
    ],
]


def _need(module: str) -> None:
    """``.ci/run`` installs both frameworks and requires them; elsewhere their tests skip."""
    if os.environ.get("ZEUS_ASYNC_REQUIRE_FRAMEWORKS"):
        importlib.import_module(module)
    else:
        pytest.importorskip(module)


@pytest.mark.parametrize(("old", "name", "new"), MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_old_paths_warn_and_give_the_same_objects(old: str, name: str, new: str) -> None:
    # As a user's script would write it: the warning names that script's line (stacklevel).
    code = compile(f"from {old} import {name} as got\n", "<user script>", "exec")
    namespace: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(code, namespace)
    assert [(w.category, str(w.message), w.filename, w.lineno) for w in caught] == [
        (DeprecationWarning, f"{old}.{name} moved: import it from {new}", "<user script>", 1)
    ]
    assert namespace["got"] is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize("old", sorted({o for o, _, _ in MOVED}))
def test_an_old_module_has_no_other_name(old: str) -> None:
    module = importlib.import_module(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a name that never was there does not warn
        with pytest.raises(AttributeError, match=f"^module '{old}' has no attribute 'nothing'$"):
            module.nothing  # noqa: B018


def _modules_after(code: str, path: Path | None = None) -> dict[str, list[str]]:
    """What a fresh interpreter has in ``sys.modules`` after ``code``: the frameworks (top
    level) and zeus_async's integration and optimizer modules. ``path``: put first on the
    module path (fake frameworks)."""
    report = (
        "import json, sys\n"
        "names = sorted(sys.modules)\n"
        f"print(json.dumps({{'frameworks': sorted({{n.split('.')[0] for n in names}} & "
        f"{set(FRAMEWORKS)!r}), 'zeus': [n for n in names if n.startswith("
        "('zeus_async.integrations', 'zeus_async.optimizer'))]}))\n"
    )
    paths = [str(ROOT)] if path is None else [str(path), str(ROOT)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run(
        [sys.executable, "-c", code + "\n" + report],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, list[str]] = json.loads(proc.stdout.splitlines()[-1])
    return out


@pytest.fixture
def fake_frameworks(tmp_path: Path) -> Path:
    """Each framework as a package with only its callback class (so that what a module of
    ours imports is told from what the real framework would import itself: Lightning's
    torchmetrics imports transformers when it is installed)."""
    files = {
        "transformers/__init__.py": "class TrainerCallback:\n    pass\n",
        "lightning/__init__.py": "",
        "lightning/pytorch/__init__.py": "class Callback:\n    pass\n",
        "lightning_fabric/__init__.py": "",
        "pytorch_lightning/__init__.py": "class Callback:\n    pass\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


OLD_MODULES = {
    "zeus_async.optimizer.hf",
    "zeus_async.optimizer.integrations",
    "zeus_async.optimizer.lightning",
}
SHARED_MODULES = [
    "zeus_async.integrations",
    "zeus_async.integrations._energy_log",
    "zeus_async.integrations._power_limit",
]


@pytest.mark.parametrize(
    ("code", "frameworks", "zeus"),
    [
        (
            "import zeus_async.integrations.hf",
            ["transformers"],
            [*SHARED_MODULES, "zeus_async.integrations.hf"],
        ),
        (
            "import zeus_async.integrations.lightning",
            ["lightning"],
            [*SHARED_MODULES, "zeus_async.integrations.lightning"],
        ),
        (
            "import zeus_async.integrations, zeus_async.integrations._power_limit",
            [],
            SHARED_MODULES,
        ),
        (
            "import zeus_async.optimizer.hf, zeus_async.optimizer.lightning, "
            "zeus_async.optimizer.integrations",
            [],
            sorted(OLD_MODULES),
        ),
    ],
    ids=["hf", "lightning", "shared", "old-paths"],
)
def test_each_module_imports_its_own_framework_only(
    fake_frameworks: Path, code: str, frameworks: list[str], zeus: list[str]
) -> None:
    found = _modules_after(code, fake_frameworks)
    assert found["frameworks"] == frameworks
    ours = [m for m in found["zeus"] if m.startswith("zeus_async.integrations") or m in OLD_MODULES]
    assert ours == zeus


def test_the_hf_module_with_real_transformers_imports_no_lightning() -> None:
    _need("transformers")
    found = _modules_after(
        "import zeus_async.integrations.hf as hf\n"
        "assert hf.HFGlobalPowerLimitOptimizer.__mro__[2].__module__.startswith('transformers')"
    )
    assert found["frameworks"] == ["transformers"]
    assert "zeus_async.integrations.lightning" not in found["zeus"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """zeus_async's modules and those each imports: every import statement, at the top or in
    a function (``TYPE_CHECKING`` blocks too), and every string naming a module of ours (what
    ``importlib.import_module`` is given)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "_pynvml_shim" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = (
                    node.module
                    if node.level == 0
                    else ".".join(p for p in (base, node.module) if p)
                )
                assert target is not None
                edges.add(target)
                edges.update(f"{target}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                edges.add(node.value)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


#: The modules this layout is about: none of them may be in an import circle.
OURS = {
    "zeus_async.integrations",
    "zeus_async.integrations.hf",
    "zeus_async.integrations.lightning",
    "zeus_async.integrations._power_limit",
    "zeus_async.integrations._energy_log",
    "zeus_async.optimizer",
    "zeus_async.optimizer.hf",
    "zeus_async.optimizer.lightning",
    "zeus_async.optimizer.integrations",
}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_no_import_circle_joins_the_integration_modules() -> None:
    graph = _import_graph()
    assert graph["zeus_async.optimizer.hf"] == {"zeus_async.integrations.hf"}  # the shim's
    circles = {m: sorted(_reachable(graph, m) & {m}) for m in sorted(OURS)}
    assert circles == {m: [] for m in sorted(OURS)}
    # Neither framework's module reaches the other's, nor a deprecated path.
    hf, lightning = (_reachable(graph, f"zeus_async.integrations.{f}") for f in CALLBACK)
    old = {m for m in OURS if m.startswith("zeus_async.optimizer.")}
    assert not hf & ({"zeus_async.integrations.lightning"} | old)
    assert not lightning & ({"zeus_async.integrations.hf"} | old)
    assert not _reachable(graph, SHARED) & {
        "zeus_async.integrations.hf",
        "zeus_async.integrations.lightning",
    }


def _globals(payload: bytes) -> set[str]:
    """The classes and functions a protocol-2 pickle names (``module name``)."""
    return {str(arg) for op, arg, _ in pickletools.genops(payload) if op.name == "GLOBAL"}


@pytest.fixture
def monitor() -> Iterator[Monitor]:
    with Monitor(sampler="thread", sim_config=SimConfig(num_gpus=2), sync_execution_with=None) as m:
        yield m


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_callbacks_pickle_under_their_new_module(framework: str, monitor: Monitor) -> None:
    # Lightning's ddp_spawn pickles the trainer's callbacks to the ranks.
    _need({"hf": "transformers", "lightning": "lightning"}[framework])
    new = f"zeus_async.integrations.{framework}"
    module = importlib.import_module(new)
    cls = getattr(module, CALLBACK[framework])
    callback = cls(monitor, warmup_steps=2, restore_on_signals=False)
    energy = module.EnergyCallback(monitor, prefix="x/")
    try:
        payload = pickle.dumps([callback, energy], protocol=2)
        named = _globals(payload)
        assert {f"{new} {CALLBACK[framework]}", f"{new} EnergyCallback"} <= named
        assert not {g for g in named if g.startswith("zeus_async.optimizer.")}
        copy, energy_copy = pickle.loads(payload)
        assert type(copy) is cls and type(energy_copy) is module.EnergyCallback
        arguments = dict(copy._arguments)
        assert isinstance(arguments.pop("monitor"), Monitor)
        assert arguments == {"warmup_steps": 2, "restore_on_signals": False}
        assert energy_copy.energy.prefix == "x/"
        assert copy._arguments["monitor"] is energy_copy.energy.monitor  # one monitor per rank
        assert pickle.loads(pickle.dumps(callback)).__class__ is cls  # the default protocol
        # One pickled under the old path still unpickles, to the same class, saying so.
        old = payload.replace(
            f"{new}\n{CALLBACK[framework]}\n".encode(),
            f"zeus_async.optimizer.{framework}\n{CALLBACK[framework]}\n".encode(),
        )
        assert old != payload
        with pytest.warns(DeprecationWarning, match=f"import it from {new}$"):
            assert type(pickle.loads(old)[0]) is cls
    finally:
        callback.optimizer.close()
