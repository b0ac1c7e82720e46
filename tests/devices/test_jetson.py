"""The Jetson backend (INA3221 rails in sysfs): both layouts on static trees, the simulated
tree beneath it, window energy against the simulator's truth (fake clock), the CLI."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices import open_devices
from zeus_async.devices.jetson import (
    JetsonGpu,
    RealSysFs,
    find_rails,
    jetson_present,
    open_jetson_gpus,
)
from zeus_async.devices.sim import NS, SimNode
from zeus_async.devices.sim_config import JetsonRail, JetsonSim, SimConfig, sim_preset
from zeus_async.devices.sim_workload import SquareWorkload
from zeus_async.errors import (
    ConfigError,
    DeviceError,
    DeviceLostError,
    DeviceNotFoundError,
    DriverNotLoadedError,
    NoPermissionError,
    TransientDeviceError,
)
from zeus_async.events import Capabilities
from zeus_async.runtime import Runtime
from zeus_async.testing import sim_jetson

T0 = 1_760_000_000 * NS
HWMON = "/sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1"
LEGACY = "/sys/bus/i2c/drivers/ina3221x/1-0040/iio:device0"


def jetson(**jetson_fields: object) -> SimConfig:
    """The AGX Orin preset with ``JetsonSim`` fields changed."""
    base = sim_preset("jetson")
    return msgspec.structs.replace(
        base, jetson=msgspec.structs.replace(base.jetson, **jetson_fields)
    )


def orin_nx(**jetson_fields: object) -> SimConfig:
    """An Orin NX-like module: an input rail, the GPU sharing its rail with CPU and CV."""
    fields: dict[str, object] = {
        "gpu_rail": "VDD_CPU_GPU_CV",
        "input_rail": "VDD_IN",
        "input_overhead_w": 1.5,
        "rails": (JetsonRail(name="VDD_SOC", idle_w=1.25, dyn_w=2.0),),
        **jetson_fields,
    }
    return jetson(**fields)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZEUS_ASYNC_JETSON_SCOPE", raising=False)
    monkeypatch.delenv("ZEUS_ASYNC_JETSON_RAIL", raising=False)
    monkeypatch.delenv("ZEUS_ASYNC_SIM", raising=False)


# -- discovery on static trees ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["hwmon", "legacy"])
def test_both_layouts_are_discovered_on_a_static_tree(tmp_path: Path, layout: str) -> None:
    sim_jetson.write_tree(tmp_path, jetson(layout=layout))
    rails = find_rails(RealSysFs(tmp_path))
    # The AGX Orin's rails (the channels labelled NC are left out), chip by chip.
    assert [r.name for r in rails] == [
        "VDD_GPU_SOC",
        "VDD_CPU_CV",
        "VIN_SYS_5V0",
        "VDDQ_VDD2_1V8AO",
    ]
    assert {r.layout for r in rails} == {layout}
    if layout == "hwmon":
        assert [r.channel for r in rails] == [1, 2, 3, 2]
        assert rails[0].directory == HWMON
        assert rails[0].power_file is None  # V x I
        assert rails[0].voltage_file == f"{HWMON}/in1_input"
        assert rails[0].current_file == f"{HWMON}/curr1_input"
    else:
        assert [r.channel for r in rails] == [0, 1, 2, 1]
        assert rails[0].directory == LEGACY
        assert rails[0].power_file == f"{LEGACY}/in_power0_input"
    # Idle preset: exact watts from the integer files (2.0 W at 5000 mV is 400 mA).
    fs = RealSysFs(tmp_path)
    assert [r.read_w(fs) for r in rails] == [2.0, 0.8, 3.2, 0.6]
    (gpu,) = open_jetson_gpus(root=tmp_path)
    assert isinstance(gpu, JetsonGpu)
    (sample,) = gpu.read(gpu.fields, "h", 5)
    assert sample.power_w == 2.0 and sample.energy_j is None and sample.gpu == 0
    assert sample.utilization_frac == 0.0
    assert sample.sm_clock_hz == 306e6
    assert sample.temperature_c == pytest.approx(30.0 + 0.6 * 2.0)


def test_the_files_hold_what_the_ina3221_reports(tmp_path: Path) -> None:
    sim_jetson.write_tree(tmp_path, jetson(layout="legacy"))
    d = tmp_path / LEGACY.lstrip("/")
    assert (d / "rail_name_0").read_text() == "VDD_GPU_SOC\n"
    assert (d / "in_power0_input").read_text() == "2000\n"  # mW
    assert (d / "in_voltage0_input").read_text() == "5000\n"  # mV
    assert (d / "in_current0_input").read_text() == "400\n"  # mA
    sim_jetson.write_tree(tmp_path / "new", jetson(layout="hwmon"))
    h = tmp_path / "new" / HWMON.lstrip("/")
    assert (h / "in1_label").read_text() == "VDD_GPU_SOC\n"
    assert (h / "in1_input").read_text() == "5000\n"
    assert (h / "curr1_input").read_text() == "400\n"
    assert not (h / "in4_label").exists() and (h / "in4_input").exists()  # shunt channel


def test_the_device_says_what_it_measures_and_cannot_do(tmp_path: Path) -> None:
    sim_jetson.write_tree(tmp_path)
    (gpu,) = open_jetson_gpus(root=tmp_path, first_index=2)
    info = gpu.describe()
    assert gpu.key == info.key == "gpu:2"
    assert info.vendor == "nvidia-jetson"
    assert info.name == "NVIDIA Jetson AGX Orin (simulated)"
    assert info.uuid.startswith("JETSON-") and info.uuid.endswith("51515151")
    assert info.energy_method == "integrated-power" and not info.has_energy_counter
    assert info.capabilities == Capabilities(False, False, False, False)
    assert info.power_scope == "gpu"
    assert "VDD_GPU_SOC" in info.energy_note and "integrated" in info.energy_note
    assert "energy_j" not in gpu.fields and gpu.fields[0] == "power_w"
    assert gpu.read(["power_w"], "h", 1)[0].gpu == 2


# -- rail mapping and the power scope ---------------------------------------------------------


def test_module_scope_without_an_input_rail_sums_every_rail(tmp_path: Path) -> None:
    sim_jetson.write_tree(tmp_path)
    (gpu,) = open_jetson_gpus(root=tmp_path, power_scope="module")
    assert isinstance(gpu, JetsonGpu)
    assert [r.name for r in gpu.rails] == [
        "VDD_GPU_SOC",
        "VDD_CPU_CV",
        "VIN_SYS_5V0",
        "VDDQ_VDD2_1V8AO",
    ]
    assert gpu.read(["power_w"], "h", 0)[0].power_w == pytest.approx(2.0 + 0.8 + 3.2 + 0.6)
    info = gpu.describe()
    assert info.power_scope == "module"
    assert "sum of every rail" in info.energy_note and "no input rail" in info.energy_note


@pytest.mark.parametrize("layout", ["hwmon", "legacy"])
def test_a_module_with_an_input_rail_reads_it_for_the_module_scope(
    tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim_jetson.write_tree(tmp_path, orin_nx(layout=layout))
    names = [r.name for r in find_rails(RealSysFs(tmp_path))]
    assert names == ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]
    (gpu,) = open_jetson_gpus(root=tmp_path)
    assert [r.name for r in gpu.rails] == ["VDD_CPU_GPU_CV"]  # type: ignore[attr-defined]
    assert gpu.read(["power_w"], "h", 0)[0].power_w == 2.0
    monkeypatch.setenv("ZEUS_ASYNC_JETSON_SCOPE", "module")  # the scope from the environment
    (module,) = open_jetson_gpus(root=tmp_path)
    assert [r.name for r in module.rails] == ["VDD_IN"]  # type: ignore[attr-defined]
    # VDD_IN carries the GPU rail, VDD_SOC and the overhead: 2.0 + 1.25 + 1.5 W.
    assert module.read(["power_w"], "h", 0)[0].power_w == pytest.approx(4.75)
    assert module.describe().energy_note.endswith("module scope: the input rail VDD_IN")
    # The argument wins over the environment.
    (again,) = open_jetson_gpus(root=tmp_path, power_scope="gpu")
    assert again.describe().power_scope == "gpu"
    (auto,) = open_jetson_gpus(root=tmp_path, power_scope="auto")
    assert auto.describe().power_scope == "gpu"


@pytest.mark.parametrize(
    ("label", "layout"),
    [
        ("GPU", "legacy"),
        ("VDD_SYS_GPU", "legacy"),
        ("POM_5V_GPU", "legacy"),
        ("VDD_GPU_SOC", "hwmon"),
    ],
)
def test_each_modules_gpu_rail_is_known(tmp_path: Path, label: str, layout: str) -> None:
    # Xavier (GPU, CPU, SOC), TX2 (VDD_SYS_GPU), Nano (POM_5V_GPU), Orin (VDD_GPU_SOC): the GPU
    # rail is picked by its label, whichever channel it is on.
    rails = (JetsonRail(name="CPU", idle_w=1.0), JetsonRail(name="SOC", idle_w=0.5))
    sim_jetson.write_tree(tmp_path, jetson(gpu_rail=label, rails=rails, layout=layout))
    (gpu,) = open_jetson_gpus(root=tmp_path)
    assert [r.name for r in gpu.rails] == [label]  # type: ignore[attr-defined]
    assert gpu.read(["power_w"], "h", 0)[0].power_w == 2.0


def test_a_renamed_gpu_rail_is_a_clear_error_and_can_be_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim_jetson.write_tree(tmp_path, jetson(gpu_rail="VDD_GFX"))
    with pytest.raises(DeviceNotFoundError) as err:
        open_jetson_gpus(root=tmp_path)
    message = str(err.value)
    assert "no GPU rail" in message
    assert "rails found: VDD_GFX, VDD_CPU_CV, VIN_SYS_5V0, VDDQ_VDD2_1V8AO" in message
    assert "ZEUS_ASYNC_JETSON_RAIL" in message
    (gpu,) = open_jetson_gpus(root=tmp_path, rail="vdd_gfx")
    assert gpu.read(["power_w"], "h", 0)[0].power_w == 2.0
    monkeypatch.setenv("ZEUS_ASYNC_JETSON_RAIL", "VDD_GFX")
    assert open_jetson_gpus(root=tmp_path)[0].describe().energy_note.endswith("VDD_GFX")
    with pytest.raises(DeviceNotFoundError, match="no INA3221 rail named 'VDD_NONE'"):
        open_jetson_gpus(root=tmp_path, rail="VDD_NONE")


def test_no_rails_bad_scope_and_bad_indices(tmp_path: Path) -> None:
    with pytest.raises(DriverNotLoadedError, match="no INA3221 power rails"):
        open_jetson_gpus(root=tmp_path)
    sim_jetson.write_tree(tmp_path)
    with pytest.raises(ConfigError, match="power scope 'board'"):
        open_jetson_gpus(root=tmp_path, power_scope="board")
    with pytest.raises(ConfigError, match="no GPU 1 on this Jetson"):
        open_jetson_gpus([1], root=tmp_path)
    assert open_jetson_gpus([], root=tmp_path) == []
    assert [g.key for g in open_jetson_gpus([0], root=tmp_path)] == ["gpu:0"]


def test_a_channel_switched_off_is_not_a_rail(tmp_path: Path) -> None:
    sim_jetson.write_tree(tmp_path)
    d = tmp_path / HWMON.lstrip("/")
    (d / "in2_enable").write_text("0\n")
    assert [r.name for r in find_rails(RealSysFs(tmp_path))] == [
        "VDD_GPU_SOC",
        "VIN_SYS_5V0",
        "VDDQ_VDD2_1V8AO",
    ]


# -- read errors --------------------------------------------------------------------------------


def test_read_errors_map_to_typed_errors(tmp_path: Path) -> None:
    sim_jetson.write_tree(tmp_path, jetson(layout="legacy"))
    (gpu,) = open_jetson_gpus(root=tmp_path)
    power = tmp_path / LEGACY.lstrip("/") / "in_power0_input"
    power.write_text("12ab\n")
    with pytest.raises(DeviceError, match=r"malformed value .*in_power0_input.*'12ab'"):
        gpu.read(["power_w"], "h", 0)
    power.unlink()
    with pytest.raises(DeviceLostError, match=r"disappeared .*in_power0_input"):
        gpu.read(["power_w"], "h", 0)


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (errno.EACCES, NoPermissionError),
        (errno.EIO, TransientDeviceError),
        (errno.ENODEV, DeviceLostError),
    ],
)
def test_os_errors_on_a_rail(code: int, error: type[DeviceError]) -> None:
    fs = sim_jetson.install(config=jetson(), clock=FakeClock(wall_start_ns=T0))
    (gpu,) = open_jetson_gpus(fs=fs)
    real = fs.read_text

    def failing(path: str) -> str:
        if path.endswith("curr1_input"):
            raise OSError(code, os.strerror(code), path)
        return real(path)

    fs.read_text = failing  # type: ignore[method-assign]
    with pytest.raises(error) as err:
        gpu.read(["power_w"], "h", 0)
    assert err.value.device == "gpu:0" and err.value.code == code

    # An optional field that fails is None for this tick, not the whole read.
    def load_fails(path: str) -> str:
        if path.endswith("/load"):
            raise OSError(code, os.strerror(code), path)
        return real(path)

    fs.read_text = load_fails  # type: ignore[method-assign]
    (sample,) = gpu.read(["power_w", "utilization_frac"], "h", 0)
    assert sample.power_w == 2.0 and sample.utilization_frac is None


def test_a_lost_gpu_fails_its_rail_reads() -> None:
    clock = FakeClock(wall_start_ns=T0)
    config = msgspec.structs.replace(jetson(), epoch_ns=T0, gpus=())
    config = msgspec.convert(
        {**msgspec.to_builtins(config), "gpus": [{"lost_at_s": 1.0}]}, type=SimConfig
    )
    (gpu,) = open_jetson_gpus(fs=sim_jetson.install(config=config, clock=clock))
    assert gpu.read(["power_w"], "h", 0)[0].power_w == 2.0
    clock.advance_sync(1.5)
    with pytest.raises(DeviceLostError):
        gpu.read(["power_w"], "h", 0)


# -- jetson_present -----------------------------------------------------------------------------


def test_jetson_present(tmp_path: Path) -> None:
    assert not jetson_present(tmp_path)
    sim_jetson.write_tree(tmp_path)
    assert jetson_present(tmp_path)
    (tmp_path / "etc" / "nv_tegra_release").unlink()  # INA3221 rails on some other board
    assert not jetson_present(tmp_path)
    assert jetson_present(tmp_path / "no" / "such" / "dir") is False
    assert jetson_present() is False  # this CI machine is no Jetson


# -- the simulated tree -------------------------------------------------------------------------


def test_readings_are_cycle_means_refreshed_once_a_cycle() -> None:
    clock = FakeClock(wall_start_ns=T0)
    config = msgspec.structs.replace(
        jetson(update_period_s=0.01),
        workload=SquareWorkload(period_s=0.1, duty=0.5, high=1.0, low=0.0),
        epoch_ns=T0,
        counter_origin_ns=T0,
    )
    fs = sim_jetson.install(config=config, clock=clock)
    node = fs.node
    ma, mv = f"{HWMON}/curr1_input", f"{HWMON}/in1_input"
    for k in range(1, 25):
        clock.set_ns(k * 10_000_000 + 3_000_000)  # 3 ms into cycle k
        grid = T0 + k * 10_000_000
        mean_w = node.truth_energy_j(0, grid - 10_000_000, grid) / 0.01
        assert fs.read_text(mv) == "5000\n"
        assert fs.read_text(ma) == f"{round(mean_w * 1e6 / 5000)}\n"
        clock.set_ns(k * 10_000_000 + 9_000_000)  # same cycle: the same reading
        assert fs.read_text(ma) == f"{round(mean_w * 1e6 / 5000)}\n"


async def _window(config: SimConfig, length_ms: int, offset_ms: int) -> tuple[object, SimNode]:
    clock = FakeClock(wall_start_ns=T0 + 3_000_000)
    try:
        async with Runtime(
            backend="sim-jetson", cpus=None, sim_config=config, clock=clock, windows=True
        ) as rt:
            await clock.sleep_until(clock.monotonic_ns() + (300 + offset_ms) * 1_000_000)
            async with rt.window("w") as w:
                await clock.sleep_until(clock.monotonic_ns() + length_ms * 1_000_000)
            assert w.result is not None
            await w.result.wait_async()
            fs = sim_jetson.current_fs()
            assert fs is not None
            return w.result.wait(0), fs.node
    finally:
        sim_jetson.uninstall()


BUSY = SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1)


@pytest.mark.anyio
@pytest.mark.parametrize("offset_ms", [0, 7, 13, 29])
async def test_two_second_window_is_within_3_percent_of_truth(offset_ms: int) -> None:
    config = msgspec.structs.replace(sim_preset("jetson"), workload=BUSY, seed=5)
    m, _ = await _window(config, 2000, offset_ms)
    truth = SimNode(config, shared_state=False).truth_energy_j(0, m.start_ns, m.end_ns)  # type: ignore[attr-defined]
    energy = m.gpu_energy_j[0]  # type: ignore[attr-defined]
    assert m.methods == {"gpu:0": "integrated"}  # type: ignore[attr-defined]
    assert truth > 2.0 * 2.0 * 1.5  # not idle
    assert abs(energy - truth) / truth < 0.03, (energy, truth)


@pytest.mark.anyio
async def test_module_scope_window_matches_the_sum_of_rails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ZEUS_ASYNC_JETSON_SCOPE", "module")
    config = msgspec.structs.replace(orin_nx(), workload=BUSY, seed=5)
    m, node = await _window(config, 2000, 11)
    truth = sim_jetson.rail_truth_energy_j(node, "VDD_IN", m.start_ns, m.end_ns)  # type: ignore[attr-defined]
    gpu_truth = node.truth_energy_j(0, m.start_ns, m.end_ns)  # type: ignore[attr-defined]
    energy = m.gpu_energy_j[0]  # type: ignore[attr-defined]
    assert truth > gpu_truth + 2.0 * 2.75  # the input rail carries more than the GPU's
    assert abs(energy - truth) / truth < 0.03, (energy, truth)


def test_open_devices_serves_the_jetson_simulator() -> None:
    clock = FakeClock(wall_start_ns=T0)
    opened = open_devices("sim-jetson", cpus=None, clock=clock, sim_config=jetson())
    try:
        (gpu,) = opened.gpus
        assert isinstance(gpu, JetsonGpu)
        assert gpu.describe().vendor == "nvidia-jetson"
    finally:
        for d in opened.gpus:
            d.close()
        sim_jetson.uninstall()
    with pytest.raises(ConfigError, match="no GPU 3"):
        open_devices("sim-jetson", gpus=[3], cpus=None, clock=clock, sim_config=jetson())


def test_the_simulated_tree_is_a_filesystem() -> None:
    fs = sim_jetson.install(config=jetson(), clock=FakeClock(wall_start_ns=T0))
    assert fs.listdir("/sys/bus/i2c/drivers/ina3221") == [
        "1-0040",
        "1-0041",
        "bind",
        "uevent",
        "unbind",
    ]
    assert fs.exists(HWMON) and fs.exists(f"{HWMON}/in1_label")
    assert not fs.exists("/sys/bus/i2c/drivers/ina3221x")
    with pytest.raises(FileNotFoundError):
        fs.read_text("/sys/nothing")
    with pytest.raises(IsADirectoryError):
        fs.read_text(HWMON)
    with pytest.raises(NotADirectoryError):
        fs.listdir(f"{HWMON}/in1_label")
    sim_jetson.uninstall()


def test_config_round_trips_and_rejects_bad_fields() -> None:
    config = orin_nx(layout="legacy")
    assert msgspec.json.decode(msgspec.json.encode(config), type=SimConfig) == config
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"layout": "sysfs"}, type=JetsonSim)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"rail": "GPU"}, type=JetsonSim)


# -- the CLI ------------------------------------------------------------------------------------


def test_cli_monitor_runs_on_the_jetson_simulator() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEUS_ASYNC_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zeus_async",
            "monitor",
            "--backend",
            "sim-jetson",
            "--duration",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "backend sim-jetson (SIMULATED GPUs), 1 device(s)" in out
    rows = [line.split() for line in out.split("Totals")[1].strip().splitlines()[1:]]
    (row,) = [r for r in rows if r[0] == "gpu:0"]
    mean_w = float(row[3])
    # The AGX Orin preset's GPU rail: 2 W idle .. 40 W busy (the demo's noise +- 0.11 W).
    assert 1.8 <= mean_w <= 40.2
    assert row[4] == "integrated"
    assert "Traceback" not in proc.stderr
