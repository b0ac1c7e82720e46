"""NVML power scopes (issue 37): the GPU scope, a Grace superchip's MODULE scope (GPU + CPU +
memory) and ``auto``, on the simulator beneath ``pynvml``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices import open_devices
from zeus_async.devices.nvml import MODULE_ENERGY_NOTE, POWER_SCOPES, open_nvml_gpus
from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.devices.sim_config import SIM_ENV_VAR, GraceSim, grace_preset
from zeus_async.devices.sim_workload import ConstantWorkload, SquareWorkload
from zeus_async.errors import ConfigError
from zeus_async.events import Capabilities
from zeus_async.runtime import Runtime
from zeus_async.testing import _sim_nvml_base as _b
from zeus_async.testing import sim_pynvml

MS = 1_000_000
NS = 1_000_000_000
T0 = 1_760_000_000_000_000_000
HALF = ConstantWorkload(util=0.5)
# A GH200 at half load: GPU 70 + (900 - 70) * 0.5 = 485 W; Grace CPU 60 + 160 * 0.5 = 140 W;
# LPDDR 15 + 20 * 0.5 = 25 W; the module 650 W.
GPU_W, MODULE_W = 485.0, 650.0


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    sim_pynvml.uninstall()


def _install(config: SimConfig, clock: FakeClock | None = None) -> SimNode:
    node = SimNode(config, clock or FakeClock(wall_start_ns=T0), shared_state=False)
    sim_pynvml.install(node)
    return node


def _fields(scope: int) -> list[tuple[int, int]]:
    return [(_b.FI_POWER_INSTANT, scope), (_b.FI_POWER_AVERAGE, scope)]


def _answers(values: Any) -> list[tuple[int, int]]:
    return [(int(v.nvmlReturn), int(v.value.uiVal) if v.nvmlReturn == 0 else 0) for v in values]


# -- the simulator ----------------------------------------------------------------------------


def test_sim_module_scope_is_gpu_plus_grace_cpu_and_memory() -> None:
    _install(grace_preset(workload=HALF))
    sim_pynvml.nvmlInit()
    h = sim_pynvml.nvmlDeviceGetHandleByIndex(0)
    gpu = _answers(sim_pynvml.nvmlDeviceGetFieldValues(h, _fields(_b.SCOPE_GPU)))
    module = _answers(sim_pynvml.nvmlDeviceGetFieldValues(h, _fields(_b.SCOPE_MODULE)))
    assert gpu == [(0, 485_000), (0, 485_000)]  # the GPU scope is unchanged
    assert module == [(0, 650_000), (0, 650_000)]
    assert sim_pynvml.nvmlDeviceGetPowerUsage(h) == 485_000  # GPU scope, as NVML documents
    assert sim_pynvml.nvmlDeviceGetC2cModeInfoV(h).isC2cEnabled == 1
    sim_pynvml.nvmlShutdown()


def test_sim_refuses_the_module_scope_on_a_board_without_grace() -> None:
    _install(SimConfig(num_gpus=1, workload=HALF))
    sim_pynvml.nvmlInit()
    h = sim_pynvml.nvmlDeviceGetHandleByIndex(0)
    module = _answers(sim_pynvml.nvmlDeviceGetFieldValues(h, _fields(_b.SCOPE_MODULE)))
    assert module == [(_b.NOT_SUPPORTED, 0), (_b.NOT_SUPPORTED, 0)]
    with pytest.raises(sim_pynvml.NVMLError) as info:
        sim_pynvml.nvmlDeviceGetC2cModeInfoV(h)
    assert info.value.value == _b.NOT_SUPPORTED
    sim_pynvml.nvmlShutdown()


def test_module_truth_is_exact() -> None:
    # Constant CPU load 0.25: 60 + 160 * 0.25 + 15 + 20 * 0.25 = 120 W on top of the GPU.
    node = _install(grace_preset(workload=HALF, grace=GraceSim(cpu_load=0.25)))
    t0, t1 = T0 + NS, T0 + 3 * NS
    assert node.truth_energy_j(0, t0, t1) == pytest.approx(2 * GPU_W)
    assert node.truth_module_energy_j(0, t0, t1) == pytest.approx(2 * (GPU_W + 120.0))
    assert node.gpus[0].module_power_w(t0) == pytest.approx(GPU_W + 120.0)


def test_cpu_load_follows_the_gpu_with_a_seeded_spread() -> None:
    square = SquareWorkload(period_s=1.0, duty=0.5, high=1.0, low=0.0)
    cfg = grace_preset(num_gpus=2, workload=square, seed=3, grace=GraceSim(load_spread=0.5))
    node = _install(cfg)
    again = SimNode(cfg, FakeClock(wall_start_ns=T0), shared_state=False)
    t0, t1 = T0, T0 + 10 * NS
    extra = [node.truth_module_energy_j(g, t0, t1) - node.truth_energy_j(g, t0, t1) for g in (0, 1)]
    # 75 W idle for 10 s, plus up to 180 W while the GPU is busy (5 s), times the factor
    for e in extra:
        assert 750.0 + 0.5 * 900.0 <= e <= 750.0 + 900.0
    assert extra[0] != pytest.approx(extra[1])  # each module its own seeded factor
    assert again.truth_module_energy_j(0, t0, t1) == node.truth_module_energy_j(0, t0, t1)


# -- the backend ------------------------------------------------------------------------------


def test_gpu_scope_is_the_default_and_reads_the_counter() -> None:
    _install(grace_preset(workload=HALF))
    (gpu,) = open_nvml_gpus(pynvml_module=sim_pynvml)
    info = gpu.describe()
    assert (info.power_scope, info.energy_method, info.energy_note) == ("gpu", "counter", "")
    assert info.has_energy_counter and "energy_j" in gpu.fields
    sample = gpu.read(("power_w", "avg_power_w"), "h", 0)[0]
    assert (sample.power_w, sample.avg_power_w) == (GPU_W, GPU_W)
    gpu.close()


def test_module_scope_reads_module_power_and_integrates_it() -> None:
    _install(grace_preset(workload=HALF))
    (gpu,) = open_nvml_gpus(pynvml_module=sim_pynvml, power_scope="module")
    info = gpu.describe()
    assert info.power_scope == "module"
    assert info.energy_method == "integrated-power"
    assert info.energy_note == MODULE_ENERGY_NOTE
    assert MODULE_ENERGY_NOTE == "MODULE scope (GPU + CPU + memory): integrated power"
    assert not info.has_energy_counter  # the GPU's counter does not measure the module
    assert info.capabilities == Capabilities(
        energy_counter=True, power_cap=True, clocks=True, per_process=True
    )
    assert "energy_j" not in gpu.fields
    assert gpu.power_source == "NVML_FI_DEV_POWER_INSTANT (MODULE scope)"
    sample = gpu.read(gpu.fields, "h", 0)[0]
    assert (sample.power_w, sample.avg_power_w, sample.energy_j) == (MODULE_W, MODULE_W, None)
    gpu.close()


def test_module_scope_on_a_board_without_grace_is_refused_by_name() -> None:
    _install(SimConfig(num_gpus=2, workload=HALF))
    with pytest.raises(ConfigError) as info:
        open_nvml_gpus([1], pynvml_module=sim_pynvml, power_scope="module")
    text = str(info.value)
    assert text.startswith("gpu:1 (NVIDIA H100 80GB HBM3 (simulated), NVML index 1) does not")
    assert "MODULE power scope (NVML_POWER_SCOPE_MODULE: Not Supported)" in text
    assert "power_scope='gpu'" in text


def test_unknown_power_scope_is_refused() -> None:
    _install(grace_preset())
    with pytest.raises(ConfigError, match="unknown power scope 'memory'"):
        open_devices("sim", cpus=None, power_scope="memory")
    assert POWER_SCOPES == ("gpu", "module", "auto")


def test_auto_keeps_the_gpu_scope_where_it_is_answered() -> None:
    _install(grace_preset(workload=HALF))
    (gpu,) = open_nvml_gpus(pynvml_module=sim_pynvml, power_scope="auto")
    assert gpu.describe().power_scope == "gpu"
    gpu.close()
    _install(SimConfig(num_gpus=1, workload=HALF))  # not a superchip: auto is gpu, no error
    (gpu,) = open_nvml_gpus(pynvml_module=sim_pynvml, power_scope="auto")
    assert gpu.describe().power_scope == "gpu"
    gpu.close()


def test_auto_falls_back_to_module_where_only_that_is_answered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Some C2C superchips refuse GPU-scope power (what Zeus found, ml-energy/zeus#242).
    real = sim_pynvml._field

    def no_gpu_scope(node: Any, gpu: Any, now: int, fid: int, scope: int) -> Any:
        if scope == _b.SCOPE_GPU and fid in (_b.FI_POWER_INSTANT, _b.FI_POWER_AVERAGE):
            return _b.NOT_SUPPORTED, 0, 0, 0
        return real(node, gpu, now, fid, scope)

    monkeypatch.setattr(sim_pynvml, "_field", no_gpu_scope)
    _install(grace_preset(workload=HALF))
    (gpu,) = open_nvml_gpus(pynvml_module=sim_pynvml, power_scope="auto")
    assert gpu.describe().power_scope == "module"
    assert gpu.read(("power_w",), "h", 0)[0].power_w == MODULE_W
    assert "does not answer the GPU power scope" in caplog.text
    gpu.close()


async def _module_window(config: SimConfig, seconds: float) -> tuple[Any, SimNode]:
    clock = FakeClock(wall_start_ns=T0 + 3 * MS)
    try:
        async with Runtime(
            backend="sim",
            cpus=None,
            sim_config=config,
            clock=clock,
            windows=True,
            power_scope="module",
        ) as rt:
            info = rt.devices[0].describe()
            assert info.power_scope == "module"
            await clock.sleep_until(clock.monotonic_ns() + 500 * MS)
            async with rt.window("w") as w:
                await clock.sleep_until(clock.monotonic_ns() + round(seconds * NS))
            assert w.result is not None
            m = await w.result.wait_async()
            node = sim_pynvml.current_node()
            assert node is not None
    finally:
        sim_pynvml.uninstall()
    return m, node


@pytest.mark.anyio
async def test_two_second_module_window_is_within_3_percent_of_the_module_truth() -> None:
    config = grace_preset(
        workload=SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1), seed=5
    )
    m, node = await _module_window(config, 2.0)
    truth = node.truth_module_energy_j(0, m.start_ns, m.end_ns)
    gpu_only = node.truth_energy_j(0, m.start_ns, m.end_ns)
    assert m.methods["gpu:0"] == "integrated+average"  # the 1 s average's pieces
    assert abs(m.gpu_energy_j[0] - truth) / truth < 0.03, (m.gpu_energy_j[0], truth)
    assert m.gpu_energy_j[0] > gpu_only * 1.15  # the CPU and memory are in it


def test_monitor_passes_the_power_scope_to_its_agent() -> None:
    from zeus_async.monitor import Monitor

    # Refused in the agent process, typed and named here.
    with pytest.raises(ConfigError, match="MODULE power scope"):
        Monitor(
            backend="sim",
            cpus=[],
            sim_config=SimConfig(num_gpus=1),
            power_scope="module",
            agent=False,
        )


def test_monitor_thread_sampler_measures_the_module() -> None:
    from zeus_async.monitor import Monitor

    cfg = grace_preset(workload=HALF)
    with Monitor(
        backend="sim", cpus=[], sim_config=cfg, sampler="thread", power_scope="module"
    ) as mon:
        mon.begin_window("w")
        m = mon.end_window("w")
    # Constant power: integrated module power is the module's 650 W, whatever the length.
    assert m.gpu_energy[0] == pytest.approx(MODULE_W * m.time, rel=0.02)


# -- the CLI ----------------------------------------------------------------------------------


def _cli(*args: str, config: SimConfig) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, SIM_ENV_VAR: config.to_json()}
    return subprocess.run(
        [sys.executable, "-m", "zeus_async", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_monitor_module_scope_on_a_grace_sim() -> None:
    done = _cli(
        "monitor",
        "--backend",
        "sim",
        "--power-scope",
        "module",
        "--duration",
        "0.5",
        "--quiet",
        config=grace_preset(workload=HALF),
    )
    assert done.returncode == 0, done.stderr
    assert "module power scope (GPU + CPU + memory, integrated power)" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("gpu:0"))
    assert row.split()[3] == "650.0" and row.split()[4] == "integrated"


def test_cli_module_scope_refused_on_a_plain_h100() -> None:
    done = _cli(
        "monitor",
        "--backend",
        "sim",
        "--power-scope",
        "module",
        "--duration",
        "0.5",
        "--quiet",
        config=SimConfig(num_gpus=1),
    )
    assert done.returncode != 0
    assert "does not answer NVML's MODULE power scope" in done.stderr + done.stdout


def test_cli_commands_take_the_power_scope() -> None:
    from zeus_async.cli.common import POWER_SCOPE_CHOICES

    assert POWER_SCOPE_CHOICES == POWER_SCOPES
    for command in ("monitor", "agent", "exporter"):
        done = subprocess.run(
            [sys.executable, "-m", "zeus_async", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "--power-scope {gpu,module,auto}" in done.stdout, command
