"""The CLI's carbon options (``--carbon-zone``, ``--carbon``, ``--pue``, ``--emissions``) and
how a footprint is printed beside the joules (``monitor``, ``inspect``)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..aggregate.live import LiveTotals
    from ..carbon import CarbonConfig, Footprint

__all__ = [
    "add_carbon_args",
    "carbon_energy",
    "carbon_from_args",
    "footprint_line",
    "write_footprint",
]

logger = logging.getLogger(__name__)


def add_carbon_args(parser: argparse.ArgumentParser, *, emissions: bool = False) -> None:
    """Add the carbon options (and ``--emissions FILE`` where a run ends with a row)."""
    parser.add_argument(
        "--carbon-zone",
        metavar="ZONE",
        default=None,
        help="grams CO2e beside the joules, from the offline yearly table of this zone "
        "(ISO country code: FR, DE, US...); never guessed",
    )
    parser.add_argument(
        "--carbon",
        metavar="JSON",
        default=None,
        help="carbon configuration as JSON text or a .json file (CarbonConfig's fields: "
        'source, zone, g_per_kwh, price_per_kwh, currency, file, pue, overhead), e.g. \'{"source": '
        '"file", "file": "grid.csv"}\'',
    )
    parser.add_argument(
        "--pue", type=float, default=None, help="power usage effectiveness of the site (>= 1)"
    )
    if emissions:
        parser.add_argument(
            "--emissions",
            metavar="FILE",
            default=None,
            help="append this run's row to FILE with CodeCarbon's emissions.csv columns "
            "(needs --carbon-zone or --carbon)",
        )


def carbon_from_args(args: argparse.Namespace) -> CarbonConfig | None:
    """The configuration the options give, ``None`` without any.

    Raises:
        ConfigError: Bad JSON, unknown fields, both ``--carbon`` and ``--carbon-zone`` with
            different zones, ``--pue`` or ``--emissions`` without a source.
    """
    import msgspec

    from ..carbon import CarbonConfig

    text: str | None = getattr(args, "carbon", None)
    zone: str | None = getattr(args, "carbon_zone", None)
    pue: float | None = getattr(args, "pue", None)
    fields: dict[str, Any] = {}
    if text is not None:
        raw = text
        if not text.lstrip().startswith("{"):
            try:
                raw = Path(text).read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(f"--carbon: {text}: {exc.strerror or exc}") from None
        try:
            loaded = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--carbon: not JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError("--carbon: a JSON object of CarbonConfig's fields, please")
        fields.update(loaded)
    if zone is not None:
        if fields.get("zone") not in (None, "", zone):
            raise ConfigError(f"--carbon-zone {zone} and --carbon's zone {fields['zone']} differ")
        fields.setdefault("source", "table")
        fields["zone"] = zone
    if pue is not None:
        if not fields:
            raise ConfigError("--pue needs --carbon-zone or --carbon")
        fields["pue"] = pue
    if getattr(args, "emissions", None) is not None and not fields:
        raise ConfigError(
            "--emissions needs --carbon-zone ZONE or --carbon (the grid's intensity is never "
            "guessed)"
        )
    if not fields:
        return None
    try:
        config = msgspec.convert(fields, CarbonConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--carbon: {exc}") from None
    config.open()  # an unknown zone, an unreadable file: said now, before anything starts
    return config


def footprint_line(fp: Footprint) -> str:
    """``12.3 gCO2e, 0.0345 kWh, 0.0086 EUR (380 g/kWh, PUE 1.2, overhead 0; source ...)``."""
    cost = f", {fp.cost:.4g} {fp.currency}".rstrip() if fp.cost is not None else ""
    return (
        f"{fp.co2e_g:.4g} gCO2e, {fp.kwh:.4g} kWh{cost} ({fp.g_per_kwh:.4g} g/kWh, "
        f"PUE {fp.pue:g}, overhead {fp.overhead:g}; source {fp.source})"
    )


def write_footprint(out: TextIO, label: str, fp: Footprint | None) -> None:
    """One summary line per footprint, aligned with the summaries' ``name  value`` lines."""
    if fp is not None:
        out.write(f"{label:<11} {footprint_line(fp)}\n")


def carbon_energy(totals: LiveTotals) -> tuple[float, float, float]:
    """GPU, CPU package and DRAM joules so far (``core``/``uncore``/``psys`` lie inside
    ``package`` and are not added)."""
    gpu = cpu = dram = 0.0
    for name, t in totals.devices.items():
        energy = t.energy_j
        if energy is None:
            continue
        key = name.split("@")[0]
        if key.startswith("gpu:"):
            gpu += energy
        elif key.endswith("/package"):
            cpu += energy
        elif key.endswith("/dram"):
            dram += energy
    return gpu, cpu, dram
