"""Regenerate ``intensity.json``, the yearly carbon intensity per country/region shipped with
zeus_async, from the public figures packaged in CodeCarbon's wheel.

Usage (a maintainer's tool, not run at install time)::

    pip download --no-deps codecarbon -d /tmp/cc
    pip download --no-deps pycountry -d /tmp/pyc          # ISO 3166 alpha-3 -> alpha-2
    python zeus_async/carbon/data/build_table.py /tmp/cc/codecarbon-*.whl \
        --pycountry /tmp/pyc/pycountry-*.whl

Only figures are taken (no code): per-country intensity (Our World in Data's energy data set,
from Ember and the Energy Institute, CC BY 4.0), per-US-state eGRID rates (US EPA, public
domain) and per-Chinese-province factors (China's MEE/NBS, CO2 only). The world row is the
generation-weighted mean of the countries.
"""

from __future__ import annotations

import argparse
import json
import logging
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LB_PER_MWH_TO_G_PER_KWH = 0.45359237  # 1 lb = 453.59237 g; 1 MWh = 1000 kWh

SOURCES: dict[str, dict[str, str]] = {
    "owid": {
        "short": "Ember / Our World in Data",
        "name": "Our World in Data, energy data set (carbon_intensity_elec), from Ember and the "
        "Energy Institute Statistical Review of World Energy; lifecycle gCO2e/kWh of generation",
        "url": "https://github.com/owid/energy-data",
        "licence": "CC BY 4.0",
    },
    "owid-world": {
        "short": "Ember / Our World in Data, generation-weighted world mean",
        "name": "Mean of the 'owid' country figures weighted by each country's generation "
        "(total_TWh), computed by build_table.py",
        "url": "https://github.com/owid/energy-data",
        "licence": "CC BY 4.0",
    },
    "egrid": {
        "short": "US EPA eGRID2023",
        "name": "US EPA eGRID2023, state annual CO2-equivalent total output emission rate "
        "(STC2ERTA), converted from lb/MWh",
        "url": "https://www.epa.gov/egrid/download-data",
        "licence": "public domain (US government work)",
    },
    "mee": {
        "short": "China MEE/NBS 2023, CO2 only",
        "name": "Ministry of Ecology and Environment and National Bureau of Statistics of China, "
        "Announcement 2025 No. 47, provincial average electricity CO2 emission factors 2023 "
        "(CO2 only, not CO2e)",
        "url": "https://www.mee.gov.cn/xxgk2018/xxgk/xxgk01/202512/t20251231_1139517.html",
        "licence": "official publication",
    },
}


def _open_wheel(path: Path) -> dict[str, Any]:
    """The JSON files we read, from a wheel or an unpacked wheel directory."""
    base = "codecarbon/data/private_infra/"
    names = {
        "countries": base + "global_energy_mix.json",
        "usa": base + "2023/usa_emissions.json",
        "china": base + "2023/china_provincial_emissions.json",
    }
    out: dict[str, Any] = {}
    if path.is_dir():
        for key, name in names.items():
            out[key] = json.loads((path / name).read_text("utf-8"))
    else:
        with zipfile.ZipFile(path) as wheel:
            for key, name in names.items():
                out[key] = json.loads(wheel.read(name))
    return out


def _alpha2(pycountry_wheel: Path) -> dict[str, str]:
    """ISO 3166-1 alpha-3 -> alpha-2, from the data file inside pycountry's wheel."""
    with zipfile.ZipFile(pycountry_wheel) as wheel:
        doc = json.loads(wheel.read("pycountry/databases/iso3166-1.json"))
    return {c["alpha_3"]: c["alpha_2"] for c in doc["3166-1"]}


def build(wheel: Path, pycountry_wheel: Path) -> dict[str, Any]:
    data = _open_wheel(wheel)
    alpha2 = _alpha2(pycountry_wheel)
    rows: list[dict[str, Any]] = []
    weighted = 0.0
    total = 0.0
    years: Counter[int] = Counter()
    for iso3, row in sorted(data["countries"].items()):
        code = alpha2.get(iso3)
        if code is None:
            logger.warning("no ISO alpha-2 code for %s (%s); skipped", iso3, row["country_name"])
            continue
        g = float(row["carbon_intensity"])
        rows.append(
            {
                "zone": code,
                "name": row["country_name"],
                "g_per_kwh": round(g, 3),
                "year": int(row["year"]),
                "source": "owid",
                "aliases": [iso3],
            }
        )
        twh = float(row.get("total_TWh") or 0.0)
        weighted += g * twh
        total += twh
        years[int(row["year"])] += 1
    rows.append(
        {
            "zone": "WORLD",
            "name": "World (generation-weighted mean of the countries)",
            "g_per_kwh": round(weighted / total, 3),
            "year": years.most_common(1)[0][0],
            "source": "owid-world",
            "aliases": [],
        }
    )
    usa = data["usa"]
    year = int(usa["_source"]["year"])
    for state, row in sorted(usa.items()):
        if state.startswith("_"):
            continue
        rows.append(
            {
                "zone": "US-" + row["regionCode"],
                "name": state.title(),
                "g_per_kwh": round(float(row["emissions"]) * LB_PER_MWH_TO_G_PER_KWH, 3),
                "year": year,
                "source": "egrid",
                "aliases": [],
            }
        )
    for code, row in sorted(data["china"]["data"].items()):
        rows.append(
            {
                "zone": code,
                "name": row["description"],
                "g_per_kwh": float(row["emission_factor"]),
                "year": int(row["year"]),
                "source": "mee",
                "aliases": [],
            }
        )
    rows.sort(key=lambda r: r["zone"])
    return {
        "about": {
            "what": "Yearly average carbon intensity of electricity per country/region, "
            "gCO2e/kWh (CO2 only where the source says so)",
            "built_by": "zeus_async/carbon/data/build_table.py",
            "from": f"figures packaged in {wheel.name} (CodeCarbon, MIT licence); "
            "each row names its original source below",
        },
        "sources": SOURCES,
        "zones": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="codecarbon wheel or unpacked directory")
    parser.add_argument(
        "--pycountry", type=Path, required=True, help="pycountry wheel (for its ISO 3166 data)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("intensity.json"), help="output"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    doc = build(args.wheel, args.pycountry)
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    logger.info("wrote %d zones to %s", len(doc["zones"]), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
