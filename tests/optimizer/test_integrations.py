"""The Hugging Face and Lightning callbacks, against fake framework modules (no real install)."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import zeus_async.integrations._power_limit as integrations
import zeus_async.integrations.hf as hf
import zeus_async.integrations.lightning as lightning

ROOT = str(Path(__file__).resolve().parents[2])
HF_MODULES = ("transformers", "transformers.trainer_callback")
LIGHTNING_MODULES = ("lightning", "lightning.pytorch", "pytorch_lightning")


class Recorder:
    """Stands in for ``GlobalPowerLimitOptimizer``: records its arguments and hook calls."""

    instances: list[Recorder] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.calls: list[str] = []
        self.lock = threading.Lock()  # as the optimizer: it does not pickle
        Recorder.instances.append(self)

    def on_step_begin(self) -> None:
        self.calls.append("step")

    def on_epoch_end(self) -> None:
        self.calls.append("epoch")

    def close(self) -> None:
        self.calls.append("close")

    def start(self) -> None:
        self.calls.append("start")


class ResolvingMonitor:
    """A monitor stand-in recording what the callbacks say this rank's GPU is."""

    def __init__(self) -> None:
        self.told: list[tuple[Any, Any]] = []

    def resolve_gpus(self, gpus: Any = None, *, local_rank: Any = None) -> bool:
        self.told.append((gpus, local_rank))
        return True


def _trainer(world_size: int, device: Any, local_rank: int = 1) -> Any:
    """What the callbacks read of a Lightning ``Trainer``."""
    strategy = types.SimpleNamespace(root_device=device)
    return types.SimpleNamespace(world_size=world_size, local_rank=local_rank, strategy=strategy)


CUDA_3 = types.SimpleNamespace(type="cuda", index=3)
CPU = types.SimpleNamespace(type="cpu", index=None)


class FakeTrainerCallback:
    """What ``transformers.TrainerCallback`` is: hooks that do nothing."""

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pass


class FakeLightningCallback:
    """What ``lightning.pytorch.Callback`` is: hooks that do nothing."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        pass


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


@pytest.fixture
def reload(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], Any]]:
    """``reload()`` re-imports the integrations modules under the test's ``sys.modules``, with
    ``GlobalPowerLimitOptimizer`` replaced by :class:`Recorder`, and gives both callbacks;
    afterwards ``sys.modules`` is restored and the modules re-imported as they were."""
    Recorder.instances.clear()

    def do_reload() -> Any:
        module = importlib.reload(integrations)
        monkeypatch.setattr(module, "GlobalPowerLimitOptimizer", Recorder)
        importlib.reload(hf)  # each resolves its framework's base class at import
        importlib.reload(lightning)
        return types.SimpleNamespace(
            HFGlobalPowerLimitOptimizer=hf.HFGlobalPowerLimitOptimizer,
            LightningPowerLimitOptimizer=lightning.LightningPowerLimitOptimizer,
        )

    yield do_reload
    monkeypatch.undo()
    for module in (integrations, hf, lightning):
        importlib.reload(module)


def _without(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> None:
    for name in names:  # None in sys.modules makes `import name` raise ImportError
        monkeypatch.setitem(sys.modules, name, None)


def _fake_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    callback = _module("transformers.trainer_callback", TrainerCallback=FakeTrainerCallback)
    package = _module("transformers", TrainerCallback=FakeTrainerCallback)
    package.trainer_callback = callback  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", package)
    monkeypatch.setitem(sys.modules, "transformers.trainer_callback", callback)


def test_hf_callback_forwards_hooks(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], Any]
) -> None:
    _fake_transformers(monkeypatch)
    module = reload()
    monitor = object()
    cb = module.HFGlobalPowerLimitOptimizer(
        monitor, None, 2, 3, 4, 50, "p.json", adaptive=True, restore_on_signals=False
    )
    assert isinstance(cb, FakeTrainerCallback)
    assert cb.optimizer is Recorder.instances[-1]
    # The optimizer's own arguments, by name (checked against its signature).
    assert cb.optimizer.args == ()
    assert cb.optimizer.kwargs == {
        "monitor": monitor,
        "optimum_selector": None,
        "wait_steps": 2,
        "warmup_steps": 3,
        "profile_steps": 4,
        "pl_step": 50,
        "profile_path": "p.json",
        "adaptive": True,
        "restore_on_signals": False,
    }
    args, state, control = object(), object(), object()
    for _ in range(3):
        assert cb.on_step_begin(args, state, control, model=None) is None
    cb.on_epoch_end(args, state, control)
    cb.on_step_begin(args, state, control)
    cb.on_train_end(args, state, control, model=None)
    assert cb.optimizer.calls == ["step", "step", "step", "epoch", "step", "close"]
    # Zeus's hooks take the model positionally; code calling them so keeps working.
    model = object()
    cb.on_step_begin(args, state, control, model)
    cb.on_epoch_end(args, state, control, model, extra=1)
    cb.on_train_end(args, state, control, model)
    assert cb.optimizer.calls[-3:] == ["step", "epoch", "close"]


def test_hf_callback_takes_the_optimizers_arguments(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], Any]
) -> None:
    _fake_transformers(monkeypatch)
    module = reload()
    cb = module.HFGlobalPowerLimitOptimizer("monitor")
    assert cb.optimizer.kwargs == {"monitor": "monitor"}  # its defaults are the optimizer's
    with pytest.raises(TypeError, match="unexpected keyword argument 'warmup'"):
        module.HFGlobalPowerLimitOptimizer("monitor", warmup=3)
    with pytest.raises(TypeError, match="too many positional"):  # adaptive is keyword-only
        module.HFGlobalPowerLimitOptimizer("monitor", None, 1, 10, 40, 25, None, True)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_callback_forwards_hooks(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], Any], package: str
) -> None:
    _without(monkeypatch, LIGHTNING_MODULES)
    if package == "lightning.pytorch":
        monkeypatch.setitem(sys.modules, "lightning", _module("lightning"))
    monkeypatch.setitem(sys.modules, package, _module(package, Callback=FakeLightningCallback))
    module = reload()
    cb = module.LightningPowerLimitOptimizer("monitor", warmup_steps=2, profile_steps=8)
    assert isinstance(cb, FakeLightningCallback)
    assert cb.optimizer.kwargs == {"monitor": "monitor", "warmup_steps": 2, "profile_steps": 8}
    trainer, pl_module = object(), object()
    for i in range(2):
        cb.on_train_batch_start(trainer, pl_module, batch=[i], batch_idx=i)
    cb.on_train_epoch_end(trainer, pl_module)
    cb.on_exception(trainer, pl_module, RuntimeError("boom"))
    cb.on_train_end(trainer, pl_module)
    assert cb.optimizer.calls == ["step", "step", "epoch", "close", "close"]


def test_lightning_is_preferred_over_pytorch_lightning(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], Any]
) -> None:
    class Old(FakeLightningCallback):
        pass

    monkeypatch.setitem(sys.modules, "lightning", _module("lightning"))
    monkeypatch.setitem(
        sys.modules,
        "lightning.pytorch",
        _module("lightning.pytorch", Callback=FakeLightningCallback),
    )
    monkeypatch.setitem(
        sys.modules, "pytorch_lightning", _module("pytorch_lightning", Callback=Old)
    )
    module = reload()
    assert module.LightningPowerLimitOptimizer.__mro__[2] is FakeLightningCallback


def test_module_imports_without_the_frameworks(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], Any]
) -> None:
    _without(monkeypatch, HF_MODULES + LIGHTNING_MODULES)
    module = reload()
    shared = integrations.OptimizerCallback
    assert module.HFGlobalPowerLimitOptimizer.__mro__[1:] == (shared, object)
    assert module.LightningPowerLimitOptimizer.__mro__[1:] == (shared, object)
    with pytest.raises(
        ImportError,
        match=r"^HFGlobalPowerLimitOptimizer needs transformers: pip install 'zeus_async\[hf\]'$",
    ):
        module.HFGlobalPowerLimitOptimizer("monitor")
    with pytest.raises(
        ImportError,
        match=(
            r"^LightningPowerLimitOptimizer needs lightning: "
            r"pip install 'zeus_async\[lightning\]'$"
        ),
    ):
        module.LightningPowerLimitOptimizer("monitor", adaptive=True)
    assert Recorder.instances == []  # no optimizer (no power-limit change) was made


def test_a_broken_framework_counts_as_missing(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], Any]
) -> None:
    _without(monkeypatch, LIGHTNING_MODULES)
    monkeypatch.setitem(sys.modules, "transformers", _module("transformers"))  # no TrainerCallback
    module = reload()
    with pytest.raises(ImportError, match="needs transformers") as info:
        module.HFGlobalPowerLimitOptimizer("monitor")
    assert isinstance(info.value.__cause__, AttributeError)
    with pytest.raises(ImportError, match="needs lightning") as info:
        module.LightningPowerLimitOptimizer("monitor")
    assert isinstance(info.value.__cause__, ImportError)


def test_a_ranks_gpu_is_its_frameworks_device_else_its_local_rank() -> None:
    # Lightning: devices=[2, 3] puts local rank 1 on cuda:3; on the CPU accelerator (tests,
    # or a GPU job's stand-in) the local rank is the GPU, as LOCAL_RANK is under torchrun.
    assert integrations.lightning_rank(_trainer(2, CUDA_3)) == ([3], None)
    assert integrations.lightning_rank(_trainer(2, CPU)) == (None, 1)
    assert integrations.lightning_rank(_trainer(2, None)) == (None, 1)
    # A single process keeps every GPU, as a Monitor() outside a job does.
    assert integrations.lightning_rank(_trainer(1, CUDA_3)) == (None, None)
    args = types.SimpleNamespace(world_size=2, device=CUDA_3, local_process_index=1)
    assert integrations.hf_rank(args) == ([3], None)
    args = types.SimpleNamespace(world_size=4, device=CPU, local_process_index=2, local_rank=-1)
    assert integrations.hf_rank(args) == (None, 2)
    assert integrations.hf_rank(types.SimpleNamespace(world_size=1, device=CUDA_3)) == (None, None)


def test_setup_tells_the_monitor_the_ranks_gpu_then_starts_the_optimizer(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], Any]
) -> None:
    _fake_transformers(monkeypatch)
    _without(monkeypatch, LIGHTNING_MODULES)
    monkeypatch.setitem(sys.modules, "lightning", _module("lightning"))
    monkeypatch.setitem(
        sys.modules,
        "lightning.pytorch",
        _module("lightning.pytorch", Callback=FakeLightningCallback),
    )
    module = reload()
    monitor = ResolvingMonitor()
    cb = module.LightningPowerLimitOptimizer(monitor)
    cb.setup(_trainer(2, CUDA_3), object(), "validate")  # no training: nothing to start
    cb.setup(_trainer(2, CUDA_3), object(), "fit")
    assert monitor.told == [([3], None)]
    assert cb.optimizer.calls == ["start"]
    hf_cb = module.HFGlobalPowerLimitOptimizer(monitor)
    hf_cb.on_train_begin(types.SimpleNamespace(world_size=2, device=CPU, local_rank=1), None, None)
    assert monitor.told[-1] == (None, 1)
    assert hf_cb.optimizer.calls == ["start"]


def test_callbacks_pickle_as_their_optimizers_arguments(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], Any]
) -> None:
    # ddp_spawn pickles the trainer's callbacks to the ranks: the optimizer (locks, signal
    # handlers, this process's GPU settings) stays here; a rank makes its own at first use.
    _fake_transformers(monkeypatch)
    module = reload()
    cb = module.HFGlobalPowerLimitOptimizer("monitor", warmup_steps=2)
    here = cb.optimizer
    copy = pickle.loads(pickle.dumps(cb))
    assert Recorder.instances == [here]  # unpickling made none
    there = copy.optimizer
    assert there is not here and there.kwargs == {"monitor": "monitor", "warmup_steps": 2}
    assert copy.optimizer is there
    assert cb.optimizer is here


def test_module_is_restored_after_the_fakes() -> None:
    # Runs after the tests above: the fixture re-imported the module under the real sys.modules.
    for name in HF_MODULES + LIGHTNING_MODULES:  # no fake left behind (fakes have no file)
        module = sys.modules.get(name)
        assert module is None or getattr(module, "__file__", None) is not None
    base = hf.HFGlobalPowerLimitOptimizer.__mro__[2]
    assert base is not FakeTrainerCallback
    assert integrations.GlobalPowerLimitOptimizer is not Recorder


FAKE_FRAMEWORK = "raise SystemExit(3)  # imported: the test fails\n"


@pytest.mark.parametrize(
    ("code", "imported"),
    [
        ("import zeus_async.integrations._power_limit, zeus_async.optimizer", None),
        ("from zeus_async.integrations.hf import HFGlobalPowerLimitOptimizer", "hf"),
        ("from zeus_async.integrations.lightning import LightningPowerLimitOptimizer", "lightning"),
    ],
)
def test_frameworks_are_imported_only_by_their_own_callback(
    tmp_path: Path, code: str, imported: str | None
) -> None:
    # Fake frameworks that end the process when imported: importing zeus_async's optimizer
    # modules must not touch them (transformers and Lightning take 10 s to import), and a
    # callback's module touches its own framework only.
    for name in ("transformers", "lightning", "pytorch_lightning"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(FAKE_FRAMEWORK)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == (0 if imported is None else 3), proc.stderr
