"""``emissions.csv`` as CodeCarbon writes it: one row per run, appended.

CodeCarbon users keep their dashboards and scripts: ``Monitor(emissions_file="emissions.csv")``
and ``zeus-async monitor --emissions emissions.csv`` append a row per run with CodeCarbon's
columns, in its order and its units (CodeCarbon 3.3's ``EmissionsData``,
``codecarbon/output_methods/emissions_data.py``): ``duration`` in s, ``emissions`` in kg CO2e,
``emissions_rate`` in kg/s, ``cpu_power``/``gpu_power``/``ram_power`` in W, the ``*_energy``
and ``energy_consumed`` columns in kWh, ``ram_total_size`` in GB. As CodeCarbon does, the PUE
multiplies the energies and powers written (and here the overhead too: the kWh charged to the
grid, :attr:`Footprint.kwh <zeus_async.carbon.Footprint.kwh>`). ``ram_energy`` is the RAPL
DRAM domain (measured, where CodeCarbon estimates it); water is not tracked (0).

A file whose header is not these columns is never appended to: it is set aside as
``<name>.bak`` first (CodeCarbon backs such a file up too).
"""

from __future__ import annotations

import csv
import datetime
import logging
import os
import platform
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..carbon import Footprint

__all__ = ["CODECARBON_COLUMNS", "RunEnergy", "append_emissions_row", "emissions_row"]

logger = logging.getLogger(__name__)

#: CodeCarbon's columns, in its order (``EmissionsData`` of CodeCarbon 3.3.2).
CODECARBON_COLUMNS: tuple[str, ...] = (
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
)

_J_PER_KWH = 3.6e6


@dataclass
class RunEnergy:
    """What one run measured, for its row.

    Attributes:
        duration_s: The run's length.
        gpu_j, cpu_j, dram_j: Measured joules of the GPUs, the CPU packages and DRAM.
        footprint: The footprint of all of it (its PUE, overhead, source and grams).
        gpu_model: The GPUs' model names.
        started: When the run began (the row's timestamp is its end, as CodeCarbon's).
    """

    duration_s: float
    gpu_j: float
    cpu_j: float
    dram_j: float
    footprint: Footprint
    gpu_model: Sequence[str] = ()
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 0)


def _zone_columns(source: str, zone: str) -> tuple[str, str, str]:
    """``country_name``, ``country_iso_code``, ``region`` from the configured zone
    (``FR``, ``US-CAL-CISO``: country, then region)."""
    if not zone:
        return "", "", ""
    country, _, region = zone.partition("-")
    return "", country.upper(), region.lower()


def _ram_gb() -> float:
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0.0
    return pages * size / 1024**3


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def emissions_row(
    run: RunEnergy,
    *,
    project_name: str = "zeus_async",
    run_id: str | None = None,
    experiment_id: str = "",
    zone: str = "",
    tracking_mode: str = "machine",
    now: datetime.datetime | None = None,
) -> dict[str, Any]:
    """One row of CodeCarbon's ``emissions.csv`` (:data:`CODECARBON_COLUMNS`) for ``run``."""
    fp = run.footprint
    scale = fp.pue * (1.0 + fp.overhead) / _J_PER_KWH  # J -> charged kWh
    duration = run.duration_s
    kg = fp.co2e_g / 1000.0
    country_name, iso, region = _zone_columns(fp.source, zone)
    stamp = (now or datetime.datetime.now()).strftime("%Y-%m-%dT%H:%M:%S")

    def watts(joules: float) -> float:
        return joules * scale * _J_PER_KWH / duration if duration > 0 else 0.0

    models = list(dict.fromkeys(run.gpu_model))
    row: dict[str, Any] = {
        "timestamp": stamp,
        "project_name": project_name,
        "run_id": run_id or str(uuid.uuid4()),
        "experiment_id": experiment_id,
        "duration": duration,
        "emissions": kg,
        "emissions_rate": kg / duration if duration > 0 else 0.0,
        "cpu_power": watts(run.cpu_j),
        "gpu_power": watts(run.gpu_j),
        "ram_power": watts(run.dram_j),
        "cpu_energy": run.cpu_j * scale,
        "gpu_energy": run.gpu_j * scale,
        "ram_energy": run.dram_j * scale,
        "energy_consumed": fp.kwh,
        "water_consumed": 0.0,
        "country_name": country_name,
        "country_iso_code": iso,
        "region": region,
        "cloud_provider": "",
        "cloud_region": "",
        "os": platform.platform(),
        "python_version": platform.python_version(),
        "codecarbon_version": "",
        "cpu_count": run.cpu_count,
        "cpu_model": _cpu_model(),
        "gpu_count": len(run.gpu_model),
        "gpu_model": " , ".join(f"{run.gpu_model.count(m)} x {m}" for m in models),
        "longitude": "",
        "latitude": "",
        "ram_total_size": _ram_gb(),
        "tracking_mode": tracking_mode,
        "cpu_utilization_percent": 0.0,
        "gpu_utilization_percent": 0.0,
        "ram_utilization_percent": 0.0,
        "ram_used_gb": 0.0,
        "on_cloud": "N",
        "pue": fp.pue,
        "wue": 0.0,
    }
    assert tuple(row) == CODECARBON_COLUMNS
    return row


def append_emissions_row(path: str | os.PathLike[str], row: Mapping[str, Any]) -> Path:
    """Append ``row`` to the CSV at ``path``, writing the header first when the file is new
    or empty; a file with another header is renamed ``<path>.bak`` first (said in the log).
    Returns the path."""
    out = Path(path)
    header: list[str] | None = None
    if out.exists() and out.stat().st_size > 0:
        with out.open(newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
        if header is not None and tuple(header) != CODECARBON_COLUMNS:
            backup = out.with_name(out.name + ".bak")
            logger.warning(
                "%s has other columns than CodeCarbon's: moved to %s, a new file started",
                out,
                backup,
            )
            out.replace(backup)
            header = None
    with out.open("a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if header is None:
            writer.writerow(CODECARBON_COLUMNS)
        writer.writerow([row.get(c, "") for c in CODECARBON_COLUMNS])
    return out
