"""Carbon intensity from the Electricity Maps API (v3), cached, rate-limit aware, falling back
to the shipped table when it cannot answer.

Endpoints used (documented at https://docs.electricitymaps.com/):

* ``GET /v3/carbon-intensity/past-range?zone=XX&start=ISO&end=ISO`` -> ``{"zone": ...,
  "data": [{"datetime": ISO, "carbonIntensity": g}, ...]}``, hourly, at most 10 days a call;
* ``GET /v3/carbon-intensity/latest?zone=XX`` -> ``{"zone": ..., "carbonIntensity": g,
  "datetime": ISO}``, for the hour not yet in the past range.

The token goes in the ``auth-token`` header. Nothing is requested unless the user chose this
source; the zone comes from configuration and is never guessed from the network.
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import json
import logging
import math
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ..clock import Clock, RealClock
from ..errors import ConfigError
from ._types import Intensity, IntensitySource, IntensityUnavailableError
from .sources import TableIntensity, parse_timestamp

logger = logging.getLogger(__name__)

__all__ = ["TOKEN_ENV_VAR", "ElectricityMapsIntensity", "default_cache_dir"]

#: Environment variable holding the Electricity Maps API token.
TOKEN_ENV_VAR = "ELECTRICITYMAPS_TOKEN"

_NS = 1_000_000_000
HOUR_NS = 3600 * _NS
#: Longest span one past-range request may ask for (the API's limit for hourly data).
MAX_RANGE_NS = 10 * 24 * HOUR_NS
#: How long the latest figure, and the knowledge that an hour is not published yet, are kept.
LATEST_TTL_NS = 5 * 60 * _NS
#: Wait after a 429 without a usable Retry-After.
DEFAULT_RETRY_AFTER_S = 60.0
#: Wait after a network failure or a server error before the next request.
FAILURE_BACKOFF_S = 60.0
#: Wait after the token was refused (401/403): it will not become good by itself.
REFUSED_BACKOFF_S = 3600.0


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/zeus_async/electricitymaps`` (``~/.cache/...`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zeus_async" / "electricitymaps"


class _Failure(Exception):
    """A request that did not give usable data; ``reason`` is said in the Footprint."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _iso(ns: int) -> str:
    return _dt.datetime.fromtimestamp(ns // _NS, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_DEFAULT_FALLBACK: Any = object()


class ElectricityMapsIntensity:
    """Hourly carbon intensity of a zone from Electricity Maps.

    Answers are cached in memory and on disk (one JSON file per zone under ``cache_dir``;
    published hours do not change, so they are asked once). After HTTP 429 no request is sent
    before the ``Retry-After`` time. Any failure (no token, token refused, rate limited,
    network, bad JSON) makes the whole answer come from ``fallback`` and the source's name in
    the :class:`~zeus_async.carbon.Footprint` says so:
    ``"electricitymaps:FR (fallback: HTTP 429, retry after 30 s) -> table:FR:2023 (...)"``.

    Hours missing inside an answered range (not yet published, a gap) take the hour before
    (a step is in force until the next one); the hour not yet in the past range takes the
    ``latest`` figure when it is newer.

    Args:
        zone: Electricity Maps zone (``"FR"``, ``"DE"``, ``"US-CAL-CISO"``); from
            configuration, never guessed.
        token: API token; ``None`` reads :data:`TOKEN_ENV_VAR`.
        base_url: API root (tests point it at a local server).
        cache_dir: Where answers are kept (default :func:`default_cache_dir`); ``None``: memory
            only.
        fallback: Source used when the API cannot answer; default ``TableIntensity(zone)`` (or
            the table's world figure when the zone is not a table zone); ``None`` raises
            :class:`IntensityUnavailableError` instead.
        timeout_s: Timeout of one request.
        clock: Wall clock (tests give a fake one).
    """

    def __init__(
        self,
        zone: str,
        token: str | None = None,
        base_url: str = "https://api.electricitymap.org",
        cache_dir: str | os.PathLike[str] | None = _DEFAULT_FALLBACK,
        fallback: IntensitySource | None = _DEFAULT_FALLBACK,
        *,
        timeout_s: float = 5.0,
        clock: Clock | None = None,
    ) -> None:
        zone = zone.strip()
        if not zone:
            raise ConfigError(
                "carbon: the Electricity Maps source needs a zone (e.g. 'FR', 'DE', "
                "'US-CAL-CISO'; see https://app.electricitymaps.com/map), it is never guessed"
            )
        self.zone = zone
        self.name = f"electricitymaps:{zone}"
        self.token = token if token is not None else os.environ.get(TOKEN_ENV_VAR) or None
        self.base_url = base_url.rstrip("/")
        if cache_dir is _DEFAULT_FALLBACK:
            cache_dir = default_cache_dir()
        self.cache_path: Path | None = (
            None if cache_dir is None else Path(cache_dir) / f"{_safe(zone)}.json"
        )
        if fallback is _DEFAULT_FALLBACK:
            try:
                fallback = TableIntensity(zone.split("-")[0] if "-" in zone else zone)
            except ConfigError:
                fallback = TableIntensity("")
        self.fallback: IntensitySource | None = fallback
        self.timeout_s = timeout_s
        self.clock: Clock = clock if clock is not None else RealClock()
        self._lock = threading.Lock()
        self._hours: dict[int, float] = {}  # hour start ns -> gCO2e/kWh, published
        self._absent: dict[int, int] = {}  # hour start ns -> wall ns when found unpublished
        self._latest: tuple[int, Intensity] | None = None  # (fetched at, figure)
        self._blocked_until_ns = 0
        self._blocked_reason = ""
        self._dirty = False  # hours learnt since the last write to disk
        #: Requests sent (for tests and diagnostics).
        self.requests = 0
        self._load_disk()

    # --- the IntensitySource interface ----------------------------------------------------

    def steps(self, t0_ns: int, t1_ns: int) -> list[Intensity]:
        return self.steps_with_source(t0_ns, t1_ns)[0]

    def steps_with_source(self, t0_ns: int, t1_ns: int) -> tuple[list[Intensity], str]:
        """The steps covering ``[t0_ns, t1_ns]`` and the name of what answered."""
        with self._lock:
            try:
                return self._steps(t0_ns, t1_ns), self.name
            except _Failure as failure:
                reason = failure.reason
        if self.fallback is None:
            raise IntensityUnavailableError(f"{self.name}: {reason}")
        logger.info("%s: %s; using %s", self.name, reason, self.fallback.name)
        with_source = getattr(self.fallback, "steps_with_source", None)
        if callable(with_source):
            steps, inner = with_source(t0_ns, t1_ns)
        else:
            steps, inner = self.fallback.steps(t0_ns, t1_ns), self.fallback.name
        return steps, f"{self.name} (fallback: {reason}) -> {inner}"

    def cuts(self, t0_ns: int, t1_ns: int) -> list[int]:
        """The hour boundaries strictly inside ``(t0_ns, t1_ns)``, where the hourly data may
        change (asks nothing of the network: a window's edges are cut there before its
        intensity is known)."""
        first = t0_ns - t0_ns % HOUR_NS + HOUR_NS
        return list(range(first, t1_ns, HOUR_NS))

    # --- internals ------------------------------------------------------------------------

    def _steps(self, t0_ns: int, t1_ns: int) -> list[Intensity]:
        now = self.clock.wall_ns()
        first = t0_ns - t0_ns % HOUR_NS
        last = min(t1_ns, now)
        last -= last % HOUR_NS
        wanted = range(first, max(first, last) + 1, HOUR_NS)
        missing = [
            h
            for h in wanted
            if h not in self._hours and now - self._absent.get(h, -LATEST_TTL_NS) >= LATEST_TTL_NS
        ]
        if missing:
            self._fetch_range(missing[0], missing[-1] + HOUR_NS, now)
        known = sorted(h for h in self._hours if h <= t1_ns)
        steps: list[Intensity] = []
        # the last published hour at or before t0, then every published hour up to t1
        before = [h for h in known if h <= first]
        inside = [h for h in known if first < h <= t1_ns]
        if before:
            steps.append(Intensity(before[-1], self._hours[before[-1]]))
        for h in inside:
            steps.append(Intensity(h, self._hours[h]))
        if t1_ns >= now - 2 * HOUR_NS and (not steps or steps[-1].start_ns < last):
            try:
                latest = self._latest_figure(now)
            except _Failure:
                if not steps:
                    raise
                latest = None  # the last published hour stays in force
            if latest is not None and (not steps or latest.start_ns > steps[-1].start_ns):
                steps.append(Intensity(max(latest.start_ns, first), latest.g_per_kwh))
        if not steps:
            raise _Failure(f"no data for {_iso(t0_ns)} .. {_iso(t1_ns)}")
        if steps[0].start_ns > t0_ns:
            head = steps[0]
            steps[0] = Intensity(first, head.g_per_kwh)
        return steps

    def _fetch_range(self, start_ns: int, end_ns: int, now: int) -> None:
        try:
            self._fetch_chunks(start_ns, end_ns, now)
        finally:
            if self._dirty:
                self._save_disk()

    def _fetch_chunks(self, start_ns: int, end_ns: int, now: int) -> None:
        for a in range(start_ns, end_ns, MAX_RANGE_NS):
            b = min(end_ns, a + MAX_RANGE_NS)
            doc = self._get(
                "/v3/carbon-intensity/past-range",
                {"zone": self.zone, "start": _iso(a), "end": _iso(b)},
            )
            data = doc.get("data") if isinstance(doc, dict) else None
            if not isinstance(data, list):
                raise _Failure("bad answer from past-range (no 'data' list)")
            for h in range(a, b, HOUR_NS):
                self._absent[h] = now
            for point in data:
                hour, g = _point(point)
                if g is not None:
                    self._hours[hour - hour % HOUR_NS] = g
                    self._absent.pop(hour - hour % HOUR_NS, None)
                    self._dirty = True

    def _latest_figure(self, now: int) -> Intensity | None:
        if self._latest is not None and now - self._latest[0] < LATEST_TTL_NS:
            return self._latest[1]
        doc = self._get("/v3/carbon-intensity/latest", {"zone": self.zone})
        hour, g = _point(doc)
        if g is None:
            raise _Failure("bad answer from latest (no carbonIntensity)")
        figure = Intensity(hour - hour % HOUR_NS, g)
        self._latest = (now, figure)
        return figure

    def _get(self, path: str, query: dict[str, str]) -> Any:
        now = self.clock.wall_ns()
        if now < self._blocked_until_ns:
            left = (self._blocked_until_ns - now) / _NS
            raise _Failure(f"{self._blocked_reason}, no request for {left:.0f} s more")
        if not self.token:
            raise _Failure(f"no token (set {TOKEN_ENV_VAR})")
        url = f"{self.base_url}{path}?{urllib.parse.urlencode(query)}"
        request = urllib.request.Request(
            url, headers={"auth-token": self.token, "Accept": "application/json"}
        )
        self.requests += 1
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                body = answer.read()
        except urllib.error.HTTPError as exc:
            code = exc.code
            if code == 429:
                wait = _retry_after(exc.headers.get("Retry-After"), now)
                self._block(now, wait, "HTTP 429 (rate limited)")
                raise _Failure(f"HTTP 429 (rate limited), retry after {wait:.0f} s") from exc
            if code in (401, 403):
                self._block(now, REFUSED_BACKOFF_S, f"token refused (HTTP {code})")
                raise _Failure(f"token refused (HTTP {code})") from exc
            if code >= 500:
                self._block(now, FAILURE_BACKOFF_S, f"HTTP {code}")
            raise _Failure(f"HTTP {code} from {path}") from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            self._block(now, FAILURE_BACKOFF_S, f"network error ({reason})")
            raise _Failure(f"network error ({reason})") from exc
        try:
            return json.loads(body)
        except ValueError as exc:
            raise _Failure(f"bad JSON from {path}") from exc

    def _block(self, now: int, seconds: float, reason: str) -> None:
        self._blocked_until_ns = max(self._blocked_until_ns, now + round(seconds * _NS))
        self._blocked_reason = reason
        logger.warning("%s: %s; no request for %.0f s", self.name, reason, seconds)

    def _load_disk(self) -> None:
        if self.cache_path is None:
            return
        try:
            doc = json.loads(self.cache_path.read_text("utf-8"))
            hours = {int(k): float(v) for k, v in doc["hours"].items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("%s: ignoring unreadable cache %s: %s", self.name, self.cache_path, exc)
            return
        self._hours.update(hours)

    def _save_disk(self) -> None:
        path = self.cache_path
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(
                json.dumps(
                    {
                        "zone": self.zone,
                        "hours": {str(k): v for k, v in sorted(self._hours.items())},
                    }
                ),
                encoding="utf-8",
            )
            os.replace(tmp, path)
            self._dirty = False
        except OSError as exc:
            logger.warning("%s: cannot write cache %s: %s", self.name, path, exc)

    def __repr__(self) -> str:
        return f"ElectricityMapsIntensity({self.zone!r}, base_url={self.base_url!r})"


def _safe(zone: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in zone)


def _point(point: Any) -> tuple[int, float | None]:
    """(time ns, gCO2e/kWh or None) of one API record."""
    if not isinstance(point, dict):
        return 0, None
    g = point.get("carbonIntensity")
    when = point.get("datetime")
    if not isinstance(g, (int, float)) or isinstance(g, bool) or not math.isfinite(g) or g < 0:
        return 0, None
    if not isinstance(when, str):
        return 0, None
    try:
        return parse_timestamp(when), float(g)
    except ValueError:
        return 0, None


def _retry_after(value: str | None, now_ns: int) -> float:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date)."""
    if value:
        value = value.strip()
        try:
            seconds = float(value)
        except ValueError:
            try:
                moment = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError):
                return DEFAULT_RETRY_AFTER_S
            seconds = moment.timestamp() - now_ns / _NS
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return DEFAULT_RETRY_AFTER_S
