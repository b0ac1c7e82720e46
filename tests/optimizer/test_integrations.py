"""The Hugging Face and Lightning callbacks, against fake framework modules (no real install)."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import zeus_async.optimizer.integrations as integrations

HF_MODULES = ("transformers", "transformers.trainer_callback")
LIGHTNING_MODULES = ("lightning", "lightning.pytorch", "pytorch_lightning")


class Recorder:
    """Stands in for ``GlobalPowerLimitOptimizer``: records its arguments and hook calls."""

    instances: list[Recorder] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.calls: list[str] = []
        Recorder.instances.append(self)

    def on_step_begin(self) -> None:
        self.calls.append("step")

    def on_epoch_end(self) -> None:
        self.calls.append("epoch")

    def close(self) -> None:
        self.calls.append("close")


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
def reload(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], types.ModuleType]]:
    """``reload()`` re-imports the integrations module under the test's ``sys.modules``, with
    ``GlobalPowerLimitOptimizer`` replaced by :class:`Recorder`; afterwards ``sys.modules`` is
    restored and the module re-imported as it was."""
    Recorder.instances.clear()

    def do_reload() -> types.ModuleType:
        module = importlib.reload(integrations)
        monkeypatch.setattr(module, "GlobalPowerLimitOptimizer", Recorder)
        return module

    yield do_reload
    monkeypatch.undo()
    importlib.reload(integrations)


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
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], types.ModuleType]
) -> None:
    _fake_transformers(monkeypatch)
    module = reload()
    monitor = object()
    cb = module.HFGlobalPowerLimitOptimizer(
        monitor, None, 2, 3, 4, 50, "p.json", adaptive=True, restore_on_signals=False
    )
    assert isinstance(cb, FakeTrainerCallback)
    assert cb.optimizer is Recorder.instances[-1]
    assert cb.optimizer.args == (monitor, None)
    assert cb.optimizer.kwargs == {
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


def test_hf_callback_defaults_match_the_optimizer(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], types.ModuleType]
) -> None:
    _fake_transformers(monkeypatch)
    module = reload()
    cb = module.HFGlobalPowerLimitOptimizer("monitor")
    assert cb.optimizer.kwargs == {
        "wait_steps": 1,
        "warmup_steps": 10,
        "profile_steps": 40,
        "pl_step": 25,
        "profile_path": None,
        "adaptive": False,
        "restore_on_signals": True,
    }


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_callback_forwards_hooks(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], types.ModuleType], package: str
) -> None:
    _without(monkeypatch, LIGHTNING_MODULES)
    if package == "lightning.pytorch":
        monkeypatch.setitem(sys.modules, "lightning", _module("lightning"))
    monkeypatch.setitem(sys.modules, package, _module(package, Callback=FakeLightningCallback))
    module = reload()
    cb = module.LightningPowerLimitOptimizer("monitor", warmup_steps=2, profile_steps=8)
    assert isinstance(cb, FakeLightningCallback)
    assert cb.optimizer.args == ("monitor", None)
    assert cb.optimizer.kwargs["warmup_steps"] == 2 and cb.optimizer.kwargs["profile_steps"] == 8
    trainer, pl_module = object(), object()
    for i in range(2):
        cb.on_train_batch_start(trainer, pl_module, batch=[i], batch_idx=i)
    cb.on_train_epoch_end(trainer, pl_module)
    cb.on_exception(trainer, pl_module, RuntimeError("boom"))
    cb.on_train_end(trainer, pl_module)
    assert cb.optimizer.calls == ["step", "step", "epoch", "close", "close"]


def test_lightning_is_preferred_over_pytorch_lightning(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], types.ModuleType]
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
    assert module.LightningPowerLimitOptimizer.__mro__[1] is FakeLightningCallback


def test_module_imports_without_the_frameworks(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], types.ModuleType]
) -> None:
    _without(monkeypatch, HF_MODULES + LIGHTNING_MODULES)
    module = reload()
    assert module.HFGlobalPowerLimitOptimizer.__mro__[1:] == (object,)
    assert module.LightningPowerLimitOptimizer.__mro__[1:] == (object,)
    with pytest.raises(
        ImportError,
        match=r"^HFGlobalPowerLimitOptimizer needs transformers: pip install transformers$",
    ):
        module.HFGlobalPowerLimitOptimizer("monitor")
    with pytest.raises(
        ImportError,
        match=r"^LightningPowerLimitOptimizer needs lightning: pip install lightning$",
    ):
        module.LightningPowerLimitOptimizer("monitor", adaptive=True)
    assert Recorder.instances == []  # no optimizer (no power-limit change) was made


def test_a_broken_framework_counts_as_missing(
    monkeypatch: pytest.MonkeyPatch, reload: Callable[[], types.ModuleType]
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


def test_module_is_restored_after_the_fakes() -> None:
    # Runs after the tests above: the fixture re-imported the module under the real sys.modules.
    for name in HF_MODULES + LIGHTNING_MODULES:  # no fake left behind (fakes have no file)
        module = sys.modules.get(name)
        assert module is None or getattr(module, "__file__", None) is not None
    base = integrations.HFGlobalPowerLimitOptimizer.__mro__[1]
    assert base is not FakeTrainerCallback
    assert integrations.GlobalPowerLimitOptimizer is not Recorder
