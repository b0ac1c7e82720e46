"""``emissions.csv`` with CodeCarbon's columns and units: Monitor(emissions_file=) and
``zeus-async monitor --emissions``."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from zeus_async.carbon import CarbonConfig, ConstantIntensity, footprint_of
from zeus_async.cli import main
from zeus_async.errors import ConfigError
from zeus_async.store.emissions_csv import (
    CODECARBON_COLUMNS,
    RunEnergy,
    append_emissions_row,
    emissions_row,
)

#: CodeCarbon 3.3.2's header, in its order: the fields of ``EmissionsData`` in
#: ``codecarbon/output_methods/emissions_data.py`` (``pip download --no-deps codecarbon``),
#: which ``FileOutput`` writes as the CSV's columns. Units, from ``emissions_tracker.py``:
#: duration s, emissions kg, emissions_rate kg/s, *_power W, *_energy and energy_consumed
#: kWh (PUE applied), ram_total_size GB.
CODECARBON_3_3_HEADER = [
    "timestamp",
    "project_name",
    "run_id",
    "experiment_id",
    "duration",
    "emissions",
    "emissions_rate",
    "cpu_power",
    "gpu_power",
    "ram_power",
    "cpu_energy",
    "gpu_energy",
    "ram_energy",
    "energy_consumed",
    "water_consumed",
    "country_name",
    "country_iso_code",
    "region",
    "cloud_provider",
    "cloud_region",
    "os",
    "python_version",
    "codecarbon_version",
    "cpu_count",
    "cpu_model",
    "gpu_count",
    "gpu_model",
    "longitude",
    "latitude",
    "ram_total_size",
    "tracking_mode",
    "cpu_utilization_percent",
    "gpu_utilization_percent",
    "ram_utilization_percent",
    "ram_used_gb",
    "on_cloud",
    "pue",
    "wue",
]


def test_columns_are_codecarbons() -> None:
    assert list(CODECARBON_COLUMNS) == CODECARBON_3_3_HEADER


def test_row_units(tmp_path: Path) -> None:
    # 3.6 MJ of GPU, 0.72 MJ of CPU, 0.36 MJ of DRAM over 100 s, PUE 1.5, 250 g/kWh.
    energy = 3.6e6 + 0.72e6 + 0.36e6
    fp = footprint_of(energy, 0, 100 * 10**9, ConstantIntensity(250.0, 0.2, "EUR"), pue=1.5)
    run = RunEnergy(100.0, 3.6e6, 0.72e6, 0.36e6, fp, gpu_model=["H100", "H100"])
    row = emissions_row(run, project_name="p", run_id="r1", zone="FR")
    assert row["gpu_energy"] == pytest.approx(1.5)  # kWh, PUE applied (as CodeCarbon)
    assert row["cpu_energy"] == pytest.approx(0.3)
    assert row["ram_energy"] == pytest.approx(0.15)
    assert row["energy_consumed"] == pytest.approx(1.95) == fp.kwh
    assert row["emissions"] == pytest.approx(1.95 * 250 / 1000)  # kg
    assert row["emissions_rate"] == pytest.approx(1.95 * 250 / 1000 / 100)  # kg/s
    assert row["gpu_power"] == pytest.approx(3.6e6 * 1.5 / 100)  # W, PUE applied
    assert row["cpu_power"] == pytest.approx(0.72e6 * 1.5 / 100)
    assert row["ram_power"] == pytest.approx(0.36e6 * 1.5 / 100)
    assert row["duration"] == 100.0 and row["pue"] == 1.5
    assert row["country_iso_code"] == "FR" and row["gpu_count"] == 2
    assert row["gpu_model"] == "2 x H100" and row["run_id"] == "r1"
    out = tmp_path / "emissions.csv"
    append_emissions_row(out, row)
    append_emissions_row(out, {**row, "run_id": "r2"})
    rows = list(csv.DictReader(out.open()))
    assert [r["run_id"] for r in rows] == ["r1", "r2"]  # appended, one header
    assert out.read_text().splitlines()[0].split(",") == CODECARBON_3_3_HEADER


def test_other_header_is_set_aside(tmp_path: Path) -> None:
    out = tmp_path / "emissions.csv"
    out.write_text("a,b\n1,2\n")
    fp = footprint_of(3.6e6, 0, 10**9, ConstantIntensity(100.0))
    append_emissions_row(out, emissions_row(RunEnergy(1.0, 3.6e6, 0, 0, fp)))
    assert (tmp_path / "emissions.csv.bak").read_text() == "a,b\n1,2\n"
    assert out.read_text().splitlines()[0].split(",") == CODECARBON_3_3_HEADER


def test_monitor_appends_a_row_per_run(tmp_path: Path) -> None:
    from zeus_async import Monitor
    from zeus_async.devices.sim import SimConfig
    from zeus_async.devices.sim_workload import ConstantWorkload
    from zeus_async.testing import sim_pynvml

    out = tmp_path / "emissions.csv"
    carbon = CarbonConfig(source="constant", g_per_kwh=300.0, pue=1.25)
    config = SimConfig(num_gpus=1, workload=ConstantWorkload(util=0.5), seed=1)
    try:
        for _ in range(2):
            with Monitor(
                backend="sim",
                sampler="thread",
                cpus=[],
                sim_config=config,
                carbon=carbon,
                emissions_file=out,
            ) as mon:
                with mon.window("w") as w:
                    pass
                assert w.result is not None and w.result.footprint is not None
                assert w.result.footprint.pue == 1.25
    finally:
        sim_pynvml.uninstall()
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 and rows[0]["run_id"] != rows[1]["run_id"]
    for r in rows:
        kwh = float(r["energy_consumed"])
        assert kwh > 0 and float(r["gpu_energy"]) == pytest.approx(kwh)
        assert float(r["emissions"]) == pytest.approx(kwh * 300 / 1000)
        assert float(r["pue"]) == 1.25


def test_monitor_emissions_file_needs_carbon(tmp_path: Path) -> None:
    from zeus_async import Monitor

    with pytest.raises(ConfigError, match="needs carbon"):
        Monitor(backend="sim", emissions_file=tmp_path / "e.csv")


def test_cli_monitor_with_emissions(tmp_path: Path) -> None:
    out = tmp_path / "emissions.csv"
    buf = io.StringIO()
    code = main(
        [
            "monitor",
            "--backend",
            "sim",
            "--cpus",
            "none",
            "--duration",
            "0.6",
            "-q",
            "--carbon",
            '{"source": "constant", "g_per_kwh": 500, "price_per_kwh": 0.3, "currency": "EUR"}',
            "--pue",
            "1.1",
            "--emissions",
            str(out),
        ],
        out=buf,
    )
    assert code == 0
    text = buf.getvalue()
    line = next(line for line in text.splitlines() if line.startswith("carbon"))
    assert "gCO2e" in line and "EUR" in line and "PUE 1.1" in line and "source constant" in line
    (row,) = list(csv.DictReader(out.open()))
    gpu_j = sum(float(line.split()[1]) for line in text.splitlines() if line.startswith("gpu:"))
    assert float(row["energy_consumed"]) == pytest.approx(gpu_j / 3.6e6 * 1.1, rel=1e-3)
    assert float(row["emissions"]) == pytest.approx(float(row["energy_consumed"]) * 0.5, rel=1e-9)
    assert float(row["pue"]) == 1.1


def test_cli_emissions_without_source_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "monitor",
        "--backend",
        "sim",
        "--duration",
        "0.1",
        "--emissions",
        str(tmp_path / "e.csv"),
    ]
    assert main(args, out=io.StringIO()) == 1
    assert "never guessed" in capsys.readouterr().err
    assert not (tmp_path / "e.csv").exists()


def test_cli_inspect_carbon_zone(tmp_path: Path) -> None:
    data = Path(__file__).parent.parent / "data" / "sim_windows.zarc"
    buf = io.StringIO()
    assert main(["inspect", str(data), "--carbon-zone", "FR", "--pue", "1.3"], out=buf) == 0
    lines = [line for line in buf.getvalue().splitlines() if "gCO2e" in line]
    assert lines[0].startswith("carbon") and "table:FR" in lines[0] and "PUE 1.3" in lines[0]
    assert any(line.strip().startswith("gpu:0") for line in lines)
