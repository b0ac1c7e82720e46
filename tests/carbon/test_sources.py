"""The offline sources (constant, table, file) and CarbonConfig."""

from __future__ import annotations

import json
import zipfile
from importlib import resources
from pathlib import Path

import msgspec
import pytest

from zeus_async.carbon import (
    CarbonConfig,
    ConstantIntensity,
    ElectricityMapsIntensity,
    FileIntensity,
    Intensity,
    IntensitySource,
    PricedIntensity,
    TableIntensity,
    footprint_of,
    table_about,
    zones,
)
from zeus_async.errors import ConfigError

S = 1_000_000_000
T0 = 1_700_000_000 * S
COLUMNS = "timestamp, g_per_kwh, price_per_kwh, currency"


# --- the table -------------------------------------------------------------------------------


def test_table_lookups() -> None:
    fr = TableIntensity("FR")
    assert fr.name == "table:FR:2023 (Ember / Our World in Data)"
    assert fr.g_per_kwh == 56.039
    assert fr.steps(T0, T0 + S) == [Intensity(T0, 56.039)]
    assert TableIntensity("fra").name == fr.name  # alpha-3, any case
    assert TableIntensity(" fr ").g_per_kwh == 56.039
    assert TableIntensity("US-CA").name == "table:US-CA:2023 (US EPA eGRID2023)"
    assert TableIntensity("US-CA").g_per_kwh == round(394.769 * 0.45359237, 3)  # 394.769 lb/MWh
    assert TableIntensity("CN-BJ").name == "table:CN-BJ:2023 (China MEE/NBS 2023, CO2 only)"
    world = TableIntensity("")
    assert world.zone == "WORLD" and world.name.startswith("table:WORLD:")
    assert 400 < world.g_per_kwh < 550
    assert isinstance(fr, IntensitySource)


def test_unknown_zone_says_how_to_find_codes() -> None:
    with pytest.raises(ConfigError) as info:
        TableIntensity("XX")
    message = str(info.value)
    assert "unknown zone 'XX'" in message
    assert "ISO 3166-1 alpha-2" in message
    assert "zones()" in message and "docs/carbon.md" in message
    assert "constant" in message


def test_table_listing_and_provenance() -> None:
    listed = zones()
    codes = [z.zone for z in listed]
    assert codes == sorted(codes) and len(codes) == len(set(codes))
    assert {"FR", "DE", "US", "IN", "CN", "WORLD", "US-TX", "CN-GD"} <= set(codes)
    assert all(0 <= z.g_per_kwh < 1500 and 2000 <= z.year <= 2030 for z in listed)
    about = table_about()
    assert about["built_by"] == "zeus_async/carbon/data/build_table.py"
    doc = json.loads(
        resources.files("zeus_async.carbon").joinpath("data/intensity.json").read_text("utf-8")
    )
    assert doc["sources"]["owid"]["licence"] == "CC BY 4.0"
    assert {row["source"] for row in doc["zones"]} <= set(doc["sources"])


def test_table_data_is_package_data() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text("utf-8")
    assert '"carbon/data/*.json"' in pyproject


def test_build_table_script(tmp_path: Path) -> None:
    """The build script turns CodeCarbon's layout into our table (a tiny synthetic copy)."""
    from zeus_async.carbon.data import build_table

    base = tmp_path / "cc" / "codecarbon" / "data" / "private_infra"
    (base / "2023").mkdir(parents=True)
    (base / "global_energy_mix.json").write_text(
        json.dumps(
            {
                "FRA": {
                    "carbon_intensity": 50.0,
                    "country_name": "France",
                    "year": 2023,
                    "total_TWh": 100.0,
                },
                "DEU": {
                    "carbon_intensity": 400.0,
                    "country_name": "Germany",
                    "year": 2023,
                    "total_TWh": 300.0,
                },
            }
        )
    )
    (base / "2023" / "usa_emissions.json").write_text(
        json.dumps({"_source": {"year": 2023}, "texas": {"emissions": 1000.0, "regionCode": "TX"}})
    )
    (base / "2023" / "china_provincial_emissions.json").write_text(
        json.dumps(
            {"data": {"CN-BJ": {"emission_factor": 555.4, "description": "Beijing", "year": 2023}}}
        )
    )
    wheel = tmp_path / "pycountry.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "pycountry/databases/iso3166-1.json",
            json.dumps(
                {
                    "3166-1": [
                        {"alpha_2": "FR", "alpha_3": "FRA"},
                        {"alpha_2": "DE", "alpha_3": "DEU"},
                    ]
                }
            ),
        )
    doc = build_table.build(tmp_path / "cc", wheel)
    rows = {r["zone"]: r for r in doc["zones"]}
    assert list(rows) == ["CN-BJ", "DE", "FR", "US-TX", "WORLD"]
    assert rows["FR"]["aliases"] == ["FRA"] and rows["FR"]["source"] == "owid"
    assert rows["WORLD"]["g_per_kwh"] == (50.0 * 100 + 400.0 * 300) / 400
    assert rows["US-TX"]["g_per_kwh"] == 453.592  # 1000 lb/MWh
    assert rows["CN-BJ"]["g_per_kwh"] == 555.4


# --- constant and priced ---------------------------------------------------------------------


def test_constant_and_priced() -> None:
    c = ConstantIntensity(123.0, 0.2, "usd")
    assert c.steps(T0, T0 + S) == [Intensity(T0, 123.0, 0.2, "USD")]
    assert c.name == "constant"
    with pytest.raises(ConfigError, match="g_per_kwh"):
        ConstantIntensity(-1.0)
    with pytest.raises(ConfigError, match="ISO 4217"):
        ConstantIntensity(1.0, 0.1, "euro")
    priced = PricedIntensity(TableIntensity("DE"), 0.3, "EUR")
    (step,) = priced.steps(T0, T0 + S)
    assert (step.price_per_kwh, step.currency) == (0.3, "EUR")
    assert priced.name == TableIntensity("DE").name


# --- the CSV file ----------------------------------------------------------------------------


def test_file_source(tmp_path: Path) -> None:
    path = tmp_path / "prices.csv"
    path.write_text(
        "timestamp,g_per_kwh,price_per_kwh,currency\n"
        "# a comment\n"
        "2023-11-14T22:13:20Z,100,0.10,EUR\n"
        "\n"
        f"{1_700_000_000 + 3600},200.5,,\n"  # epoch seconds, no price
        "2023-11-15T00:13:20+01:00,300\n".replace(  # same instant as +3600 s? no: 23:13:20Z = +3600
            "2023-11-15T00:13:20+01:00", "2023-11-15T01:13:20+01:00"
        ),
        encoding="utf-8",
    )
    source = FileIntensity(path)
    assert source.name == "file:prices.csv"
    assert source.steps(T0, T0 + 10 * 3600 * S) == [
        Intensity(T0, 100.0, 0.10, "EUR"),
        Intensity(T0 + 3600 * S, 200.5, None, ""),
        Intensity(T0 + 7200 * S, 300.0, None, ""),
    ]
    assert source.steps(T0 + 3600 * S + 5, T0 + 3600 * S + 9) == [
        Intensity(T0 + 3600 * S, 200.5, None, "")
    ]
    assert source.steps(T0 + 10 * 3600 * S, T0 + 11 * 3600 * S) == [
        Intensity(T0 + 7200 * S, 300.0, None, "")
    ]
    with pytest.raises(ConfigError, match="starts at 2023-11-14T22:13:20"):
        source.steps(T0 - 1, T0 + S)
    # no header, naive ISO is UTC
    bare = tmp_path / "bare.csv"
    bare.write_text("2023-11-14T22:13:20,42\n", encoding="utf-8")
    assert FileIntensity(bare).steps(T0, T0) == [Intensity(T0, 42.0)]


def test_file_bad_rows_reported_by_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(
        "timestamp,g_per_kwh\n"  # 1
        "2023-11-14T22:13:20Z,100\n"  # 2
        "yesterday,100\n"  # 3
        "2023-11-14T23:13:20Z,lots\n"  # 4
        "2023-11-14T23:13:20Z,-5\n"  # 5
        "2023-11-14T23:13:20Z,5,cheap\n"  # 6
        "2023-11-14T23:13:20Z,5,0.1,euros\n"  # 7
        "2023-11-14T21:00:00Z,5\n"  # 8 not after line 2
        "2023-11-15T00:00:00Z\n"  # 9
        "2023-11-15T01:00:00Z,5,1,EUR,extra\n",  # 10
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as info:
        FileIntensity(path)
    lines = str(info.value).splitlines()
    assert lines[0] == f"carbon: bad intensity file {path} (8 bad rows):"
    assert lines[1:] == [
        "bad.csv:3: timestamp 'yesterday' is neither ISO 8601 nor seconds since the epoch",
        "bad.csv:4: g_per_kwh 'lots' is not a number",
        "bad.csv:5: g_per_kwh '-5' must be >= 0",
        "bad.csv:6: price_per_kwh 'cheap' is not a number",
        "bad.csv:7: currency 'euros' is not an ISO 4217 code such as EUR",
        "bad.csv:8: timestamp '2023-11-14T21:00:00Z' is not after the previous row's",
        f"bad.csv:9: expected 2 to 4 columns ({COLUMNS}), found 1",
        f"bad.csv:10: expected 2 to 4 columns ({COLUMNS}), found 5",
    ]


def test_file_bad_header_empty_and_missing(tmp_path: Path) -> None:
    header = tmp_path / "h.csv"
    header.write_text("timestamp,price\n2023-11-14T22:13:20Z,1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"h.csv:1: columns must be timestamp, g_per_kwh"):
        FileIntensity(header)
    empty = tmp_path / "e.csv"
    empty.write_text("timestamp,g_per_kwh\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"e\.csv: no rows"):
        FileIntensity(empty)
    with pytest.raises(ConfigError, match="cannot read intensity file"):
        FileIntensity(tmp_path / "absent.csv")


# --- CarbonConfig ----------------------------------------------------------------------------


def test_config_opens_each_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert CarbonConfig().open().name.startswith("table:WORLD:")
    assert CarbonConfig(zone="FR").open().name == "table:FR:2023 (Ember / Our World in Data)"
    const = CarbonConfig(source="constant", g_per_kwh=10.0, price_per_kwh=0.5, currency="EUR")
    assert const.open().steps(T0, T0) == [Intensity(T0, 10.0, 0.5, "EUR")]
    csv_path = tmp_path / "i.csv"
    csv_path.write_text("2023-11-14T22:13:20Z,7\n", encoding="utf-8")
    assert CarbonConfig(source="file", file=str(csv_path)).open().name == "file:i.csv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    em = CarbonConfig(source="electricitymaps", zone="DE").open()
    assert isinstance(em, ElectricityMapsIntensity) and em.name == "electricitymaps:DE"
    priced = CarbonConfig(zone="DE", price_per_kwh=0.3, currency="EUR").open()
    fp = footprint_of(3.6e6, T0, T0 + S, priced)
    assert fp.cost == pytest.approx(0.3) and fp.currency == "EUR"


def test_config_from_mapping_and_validation() -> None:
    cfg = msgspec.convert(
        {"source": "table", "zone": "FR", "pue": 1.2, "overhead": 0.05}, CarbonConfig
    )
    fp = cfg.footprint_of(3.6e6, T0, T0 + S)
    assert (fp.pue, fp.overhead) == (1.2, 0.05)
    assert fp.kwh == pytest.approx(1.2 * 1.05, rel=1e-15)
    assert fp.co2e_g == pytest.approx(1.2 * 1.05 * 56.039, rel=1e-12)
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=CarbonConfig) == cfg
    for kwargs, match in [
        ({"source": "solar"}, "unknown source 'solar'"),
        ({"source": "constant"}, "needs g_per_kwh"),
        ({"source": "file"}, "needs file"),
        ({"source": "electricitymaps"}, "needs zone"),
        ({"g_per_kwh": 5.0}, "only for source 'constant'"),
        ({"pue": 0.8}, "pue"),
        ({"overhead": -1.0}, "overhead"),
    ]:
        with pytest.raises(ConfigError, match=match):
            CarbonConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"source": "table", "zones": "FR"}, CarbonConfig)
    with pytest.raises(ConfigError, match="unknown zone 'ZZ'"):
        CarbonConfig(zone="ZZ").open()
