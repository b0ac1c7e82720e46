"""Offline intensity sources: a constant, the shipped per-country table, a CSV time series."""

from __future__ import annotations

import bisect
import csv
import datetime as _dt
import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ._types import Intensity, IntensitySource

logger = logging.getLogger(__name__)

__all__ = [
    "ConstantIntensity",
    "FileIntensity",
    "PricedIntensity",
    "TableIntensity",
    "TableZone",
    "table_about",
    "zones",
]

#: Zone of the table's world figure, used when no zone is configured.
WORLD = "WORLD"

_NS = 1_000_000_000


def _check_intensity(value: float, what: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
        raise ConfigError(f"carbon: {what} must be a finite number >= 0, not {value!r}")
    return float(value)


def _check_currency(price: float | None, currency: str) -> str:
    if price is None:
        return ""
    currency = currency.strip().upper()
    if currency and not (len(currency) == 3 and currency.isalpha()):
        raise ConfigError(
            f"carbon: currency must be an ISO 4217 code such as EUR, not {currency!r}"
        )
    return currency


class ConstantIntensity:
    """One intensity (and price) for all time, given by the user.

    Args:
        g_per_kwh: Grid carbon intensity, gCO2e/kWh (``>= 0``).
        price_per_kwh: Price of one kWh, or ``None``.
        currency: ISO 4217 code of the price (``""`` when there is none).
    """

    def __init__(
        self, g_per_kwh: float, price_per_kwh: float | None = None, currency: str = ""
    ) -> None:
        self.g_per_kwh = _check_intensity(g_per_kwh, "g_per_kwh")
        self.price_per_kwh = (
            None if price_per_kwh is None else _check_intensity(price_per_kwh, "price_per_kwh")
        )
        self.currency = _check_currency(self.price_per_kwh, currency)
        self.name = "constant"

    def steps(self, t0_ns: int, t1_ns: int) -> list[Intensity]:
        return [Intensity(t0_ns, self.g_per_kwh, self.price_per_kwh, self.currency)]

    def __repr__(self) -> str:
        return f"ConstantIntensity({self.g_per_kwh!r}, {self.price_per_kwh!r}, {self.currency!r})"


# --- the shipped table -------------------------------------------------------------------


@dataclass(frozen=True)
class TableZone:
    """One row of the shipped table."""

    zone: str
    name: str
    g_per_kwh: float
    year: int
    source: str  # short name of the data's origin, e.g. "Ember / Our World in Data"


@functools.lru_cache(maxsize=1)
def _table() -> tuple[dict[str, TableZone], dict[str, str], dict[str, Any]]:
    """(zone -> row, alias -> zone, the file's "about") from ``data/intensity.json``."""
    text = resources.files(__package__).joinpath("data/intensity.json").read_text("utf-8")
    doc = json.loads(text)
    origins = doc["sources"]
    rows: dict[str, TableZone] = {}
    aliases: dict[str, str] = {}
    for row in doc["zones"]:
        zone = row["zone"]
        rows[zone] = TableZone(
            zone=zone,
            name=row.get("name", ""),
            g_per_kwh=float(row["g_per_kwh"]),
            year=int(row["year"]),
            source=origins[row["source"]]["short"],
        )
        for alias in row.get("aliases", []):
            aliases[alias.upper()] = zone
    return rows, aliases, doc["about"]


def zones() -> list[TableZone]:
    """Every zone of the shipped table, sorted by code."""
    rows = _table()[0]
    return [rows[z] for z in sorted(rows)]


def table_about() -> dict[str, Any]:
    """The table's provenance: sources, licences, how it was built."""
    return dict(_table()[2])


def _lookup(zone: str) -> TableZone:
    rows, aliases, _ = _table()
    key = zone.strip().upper() or WORLD
    key = aliases.get(key, key)
    row = rows.get(key)
    if row is None:
        examples = ", ".join(z for z in ("FR", "DE", "US", "IN", "US-CA", "SE-SE3") if z in rows)
        raise ConfigError(
            f"carbon: unknown zone {zone!r}: the table shipped with zeus_async has {len(rows)} "
            f"zones, named by ISO 3166-1 alpha-2 country codes (alpha-3 also accepted) and a "
            f"few regions ({examples}, ...); list them with "
            f"`python -c 'from zeus_async.carbon import zones; print(*zones(), sep=chr(10))'` "
            f"or see docs/carbon.md; or set the intensity yourself (source 'constant', g_per_kwh)"
        )
    return row


class TableIntensity:
    """The yearly average intensity of a country or region, from the table shipped with the
    package (offline; see ``docs/carbon.md`` for its sources, years and licences).

    Args:
        zone: ISO 3166-1 alpha-2 country code (``"FR"``; alpha-3 ``"FRA"`` accepted), or a
            region of the table (``"US-CA"``, ``"SE-SE3"``, ``"CN-BJ"``); ``""`` for the
            world average (:data:`WORLD`). Case does not matter.

    Raises:
        ConfigError: The zone is not in the table; the message says how to list the codes.
    """

    def __init__(self, zone: str) -> None:
        self.row = _lookup(zone)
        self.zone = self.row.zone
        self.g_per_kwh = self.row.g_per_kwh
        self.name = f"table:{self.zone}:{self.row.year} ({self.row.source})"

    def steps(self, t0_ns: int, t1_ns: int) -> list[Intensity]:
        return [Intensity(t0_ns, self.g_per_kwh)]

    def __repr__(self) -> str:
        return f"TableIntensity({self.zone!r})"


class PricedIntensity:
    """Another source's intensity with a fixed price added to the steps that have none (the
    table and Electricity Maps give no price; the user's tariff goes here)."""

    def __init__(self, inner: IntensitySource, price_per_kwh: float, currency: str = "") -> None:
        self.inner = inner
        self.price_per_kwh = _check_intensity(price_per_kwh, "price_per_kwh")
        self.currency = _check_currency(self.price_per_kwh, currency)
        self.name = inner.name

    def _priced(self, steps: list[Intensity]) -> list[Intensity]:
        return [
            s
            if s.price_per_kwh is not None
            else Intensity(s.start_ns, s.g_per_kwh, self.price_per_kwh, self.currency)
            for s in steps
        ]

    def steps(self, t0_ns: int, t1_ns: int) -> list[Intensity]:
        return self._priced(self.inner.steps(t0_ns, t1_ns))

    def cuts(self, t0_ns: int, t1_ns: int) -> list[int]:
        """The inner source's step boundaries (a fixed price changes nothing)."""
        from .integrate import step_cuts

        return step_cuts(self.inner, t0_ns, t1_ns)

    def steps_with_source(self, t0_ns: int, t1_ns: int) -> tuple[list[Intensity], str]:
        with_source = getattr(self.inner, "steps_with_source", None)
        if callable(with_source):
            steps, name = with_source(t0_ns, t1_ns)
        else:
            steps, name = self.inner.steps(t0_ns, t1_ns), self.inner.name
        return self._priced(steps), name


# --- a CSV time series -------------------------------------------------------------------


def parse_timestamp(text: str) -> int:
    """Wall-clock ns of an ISO 8601 time (``Z`` or an offset; none means UTC) or of a number
    of seconds since the epoch. Raises :class:`ValueError`."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise ValueError(f"not a time: {text!r}")
        return round(seconds * _NS)
    iso = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    moment = _dt.datetime.fromisoformat(iso)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_dt.timezone.utc)
    delta = moment - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * _NS + delta.microseconds * 1_000


_HEADER = ("timestamp", "g_per_kwh", "price_per_kwh", "currency")


class FileIntensity:
    """A time series of intensity (and price) from a CSV file, for what-if analysis.

    Columns, in this order: ``timestamp`` (ISO 8601, UTC when it has no offset, or seconds
    since the epoch), ``g_per_kwh``, and optionally ``price_per_kwh`` (empty: no price) and
    ``currency`` (ISO 4217). A first line naming the columns is optional; blank lines and lines
    starting with ``#`` are skipped. Each row is in force from its timestamp until the next
    row's; timestamps must increase. The whole file is read at construction.

    Raises:
        ConfigError: The file cannot be read, or has bad rows: the message names each bad line
            (``prices.csv:7: g_per_kwh 'x' is not a number``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = f"file:{self.path.name}"
        self._steps = self._read()
        self._starts = [s.start_ns for s in self._steps]

    def _read(self) -> list[Intensity]:
        try:
            text = self.path.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"carbon: cannot read intensity file {self.path}: {exc}") from exc
        steps: list[Intensity] = []
        errors: list[str] = []
        where = self.path.name
        for lineno, row in enumerate(csv.reader(text.splitlines()), start=1):
            cells = [c.strip() for c in row]
            if not any(cells) or cells[0].startswith("#"):
                continue
            if not steps and not errors and cells[0].lower() == "timestamp":
                if tuple(c.lower() for c in cells) != _HEADER[: len(cells)]:
                    errors.append(
                        f"{where}:{lineno}: columns must be {', '.join(_HEADER)} "
                        f"(the last two optional), not {', '.join(cells)}"
                    )
                continue
            step, error = self._row(cells)
            if error:
                errors.append(f"{where}:{lineno}: {error}")
            elif step is not None:
                if steps and step.start_ns <= steps[-1].start_ns:
                    errors.append(
                        f"{where}:{lineno}: timestamp {cells[0]!r} is not after the previous row's"
                    )
                else:
                    steps.append(step)
        if not steps and not errors:
            errors.append(f"{where}: no rows")
        if errors:
            shown = errors[:20]
            more = f"\n... and {len(errors) - 20} more" if len(errors) > 20 else ""
            raise ConfigError(
                f"carbon: bad intensity file {self.path} ({len(errors)} bad rows):\n"
                + "\n".join(shown)
                + more
            )
        return steps

    @staticmethod
    def _row(cells: list[str]) -> tuple[Intensity | None, str]:
        if not 2 <= len(cells) <= 4:
            return None, f"expected 2 to 4 columns ({', '.join(_HEADER)}), found {len(cells)}"
        try:
            start = parse_timestamp(cells[0])
        except (ValueError, OverflowError):
            return None, f"timestamp {cells[0]!r} is neither ISO 8601 nor seconds since the epoch"
        try:
            g = float(cells[1])
        except ValueError:
            return None, f"g_per_kwh {cells[1]!r} is not a number"
        if not (math.isfinite(g) and g >= 0):
            return None, f"g_per_kwh {cells[1]!r} must be >= 0"
        price: float | None = None
        if len(cells) >= 3 and cells[2]:
            try:
                price = float(cells[2])
            except ValueError:
                return None, f"price_per_kwh {cells[2]!r} is not a number"
            if not (math.isfinite(price) and price >= 0):
                return None, f"price_per_kwh {cells[2]!r} must be >= 0"
        currency = cells[3].upper() if len(cells) == 4 and price is not None else ""
        if currency and not (len(currency) == 3 and currency.isalpha()):
            return None, f"currency {cells[3]!r} is not an ISO 4217 code such as EUR"
        return Intensity(start, g, price, currency), ""

    def steps(self, t0_ns: int, t1_ns: int) -> list[Intensity]:
        """The rows in force over ``[t0_ns, t1_ns]``.

        Raises:
            ConfigError: ``t0_ns`` is before the file's first row.
        """
        if t0_ns < self._starts[0]:
            first = _dt.datetime.fromtimestamp(self._starts[0] / _NS, _dt.timezone.utc)
            when = _dt.datetime.fromtimestamp(t0_ns / _NS, _dt.timezone.utc)
            raise ConfigError(
                f"carbon: intensity file {self.path} starts at {first.isoformat()}, after the "
                f"interval's start {when.isoformat()}"
            )
        i = bisect.bisect_right(self._starts, t0_ns) - 1
        j = bisect.bisect_right(self._starts, t1_ns)
        return self._steps[i : max(j, i + 1)]

    def __repr__(self) -> str:
        return f"FileIntensity({str(self.path)!r})"
