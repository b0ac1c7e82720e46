"""``auto`` falls back to simulated GPUs only where no NVIDIA driver is installed, and says so;
a driver that is there but fails is a typed error; services ask for ``--backend sim``.

This machine has no NVIDIA driver; a driver that fails is a stand-in ``pynvml`` module whose
``nvmlInit`` raises the NVML error a broken installation raises.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest

import zeus_async.devices as devices
from zeus_async.errors import DriverNotLoadedError, NoPermissionError
from zeus_async.runtime import Runtime

pytestmark = pytest.mark.skipif(
    any(Path(p).exists() for p in devices._DRIVER_PATHS), reason="an NVIDIA driver is here"
)


def _broken_pynvml(code: int) -> types.ModuleType:
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def init() -> None:
        raise NVMLError(code)

    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    module.nvmlInit = init  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_warned_simulated", False)


@pytest.mark.usefixtures("fresh_warning")
def test_no_driver_falls_back_to_the_simulator_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="zeus_async.devices"):
        assert devices.resolve_backend("auto") == "sim"
        assert devices.resolve_backend("auto") == "sim"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per process
    assert "SIMULATED GPUs" in warnings[0].getMessage()
    caplog.clear()
    assert devices.resolve_backend("sim") == "sim"  # asked for: no warning
    assert not caplog.records


@pytest.mark.parametrize(
    ("code", "error"),
    [(4, NoPermissionError), (18, DriverNotLoadedError), (999, Exception)],
    ids=["no-permission", "library-driver-mismatch", "unknown-nvml-error"],
)
@pytest.mark.usefixtures("fresh_warning")
def test_a_driver_that_fails_is_a_typed_error_not_a_fallback(
    monkeypatch: pytest.MonkeyPatch, code: int, error: type[Exception]
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _broken_pynvml(code))
    with pytest.raises(error, match=r"installed but NVML fails .*not falling back"):
        devices.resolve_backend("auto")
    assert devices.resolve_backend("sim") == "sim"


@pytest.mark.usefixtures("fresh_warning")
def test_a_library_without_its_kernel_driver_is_broken_where_the_driver_shows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # NVML "driver not loaded": no driver here -> the simulator; a driver that shows itself
    # (/dev/nvidiactl) but does not load -> the error.
    monkeypatch.setitem(sys.modules, "pynvml", _broken_pynvml(9))
    assert devices.resolve_backend("auto") == "sim"
    monkeypatch.setattr(devices, "_DRIVER_PATHS", (str(tmp_path),))
    with pytest.raises(DriverNotLoadedError, match="not falling back"):
        devices.resolve_backend("auto")


@pytest.mark.anyio
async def test_the_runtime_raises_it_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _broken_pynvml(4))
    with pytest.raises(NoPermissionError, match="not falling back"):
        async with Runtime(backend="auto", cpus=None):
            pass


@pytest.mark.parametrize("command", ["agent", "exporter"])
def test_services_serve_simulated_gpus_only_when_told(command: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zeus_async", command, "--duration", "1"]
        if command == "exporter"
        else [sys.executable, "-m", "zeus_async", command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"zeus-async {command}: no NVIDIA driver on this machine; zeus-async {command} serves "
        "real GPUs only unless told otherwise: run it with --backend sim to serve simulated ones"
    )
