"""ElectricityMapsIntensity against a real HTTP server speaking the documented v3 endpoints
(latest and past-range), with errors and rate limiting; time comes from a fake clock."""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from zeus_async.carbon import (
    ElectricityMapsIntensity,
    Intensity,
    IntensityUnavailableError,
    TableIntensity,
    footprint,
)
from zeus_async.clock import FakeClock

S = 1_000_000_000
H = 3600 * S
T0 = 1_700_006_400 * S  # 2023-11-15T00:00:00Z, on the hour
TOKEN = "secret-token"
TABLE_FR = "table:FR:2023 (Ember / Our World in Data)"


def iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / S, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


class FakeApi:
    """The API's state: hourly figures, what the next answers should be, what was asked."""

    def __init__(self) -> None:
        self.hours: dict[int, float] = {T0 + k * H: 100.0 + 10 * k for k in range(48)}
        self.latest: tuple[int, float] = (T0 + 48 * H, 999.0)
        self.queue: list[tuple[int, dict[str, str], bytes]] = []  # forced answers, in order
        self.requests: list[tuple[str, dict[str, str], str | None]] = []
        self.hang = threading.Event()

    def answer(
        self, path: str, query: dict[str, str], token: str | None
    ) -> tuple[int, dict[str, str], bytes]:
        self.requests.append((path, query, token))
        if self.queue:
            return self.queue.pop(0)
        if token != TOKEN:
            return 401, {}, b'{"error": "unauthorized"}'
        if path == "/v3/carbon-intensity/latest":
            t, g = self.latest
            body = {"zone": query["zone"], "carbonIntensity": g, "datetime": iso(t)}
        elif path == "/v3/carbon-intensity/past-range":
            start = _parse(query["start"])
            end = _parse(query["end"])
            data = [
                {
                    "zone": query["zone"],
                    "carbonIntensity": g,
                    "datetime": iso(t),
                    "isEstimated": False,
                }
                for t, g in sorted(self.hours.items())
                if start <= t < end
            ]
            body = {"zone": query["zone"], "data": data}
        else:
            return 404, {}, b"{}"
        return 200, {}, json.dumps(body).encode()


def _parse(text: str) -> int:
    return int(dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()) * S


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    state = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            if state.hang.is_set():
                state.requests.append((url.path, query, self.headers.get("auth-token")))
                state.hang.wait(2.0)  # longer than the client's timeout
                return
            code, headers, body = state.answer(url.path, query, self.headers.get("auth-token"))
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        state.hang.clear()
        server.shutdown()
        server.server_close()
        thread.join()


def source(url: str, tmp_path: Path, clock: FakeClock, **kw: Any) -> ElectricityMapsIntensity:
    kw.setdefault("token", TOKEN)
    kw.setdefault("cache_dir", tmp_path / "cache")
    return ElectricityMapsIntensity("FR", base_url=url, clock=clock, timeout_s=0.5, **kw)


def test_past_range_steps_cached_in_memory_and_on_disk(
    api: tuple[FakeApi, str], tmp_path: Path
) -> None:
    state, url = api
    clock = FakeClock(wall_start_ns=T0 + 40 * H)
    em = source(url, tmp_path, clock)
    steps, name = em.steps_with_source(T0 + 2 * H + 5 * S, T0 + 5 * H - S)
    assert name == "electricitymaps:FR"
    assert steps == [Intensity(T0 + k * H, 100.0 + 10 * k) for k in (2, 3, 4)]
    assert state.requests == [
        (
            "/v3/carbon-intensity/past-range",
            {"zone": "FR", "start": "2023-11-15T02:00:00Z", "end": "2023-11-15T05:00:00Z"},
            TOKEN,
        )
    ]
    # Asked again: from memory, no request.
    assert em.steps(T0 + 3 * H, T0 + 4 * H) == steps[1:]
    assert len(state.requests) == 1
    # A new source object (another process) reads the disk cache, without token even.
    again = source(url, tmp_path, clock, token="")
    assert again.steps_with_source(T0 + 2 * H, T0 + 4 * H) == (steps, "electricitymaps:FR")
    assert len(state.requests) == 1
    assert json.loads((tmp_path / "cache" / "FR.json").read_text())["zone"] == "FR"


def test_footprint_integrates_hourly_intensity(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    _, url = api
    em = source(url, tmp_path, FakeClock(wall_start_ns=T0 + 40 * H))
    # 1 kW for 30 min under hour 0 (100 g), 2 kW for the next hour under hour 1 (110 g),
    # 30 min of which are in hour 2 (120 g).

    def between(a: int, b: int) -> float:
        def power(t: int) -> float:
            return 1000.0 if t < T0 + H // 2 else 2000.0

        total, t = 0.0, a
        for cut in sorted({a, b, T0 + H // 2, T0 + H, T0 + 2 * H}):
            if a < cut <= b:
                total += power(t) * (cut - t) / S
                t = cut
        return total

    fp = footprint(between, T0, T0 + 2 * H - H // 2, em)
    expected = (1000 * 1800 * 100 + 2000 * 1800 * 100 + 2000 * 1800 * 110) / 3.6e6
    assert fp.co2e_g == pytest.approx(expected, rel=1e-12)
    assert fp.source == "electricitymaps:FR"


def test_latest_covers_the_hour_not_yet_published(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    state, url = api
    clock = FakeClock(wall_start_ns=T0 + 48 * H + 20 * 60 * S)  # 20 min into hour 48
    em = source(url, tmp_path, clock)
    steps = em.steps(T0 + 47 * H, clock.wall_ns())
    assert steps == [Intensity(T0 + 47 * H, 570.0), Intensity(T0 + 48 * H, 999.0)]
    paths = [p for p, _, _ in state.requests]
    assert paths == ["/v3/carbon-intensity/past-range", "/v3/carbon-intensity/latest"]
    # Within 5 minutes, neither the unpublished hour nor latest is asked again.
    clock.set_ns(clock.monotonic_ns() + 4 * 60 * S)
    assert em.steps(T0 + 47 * H, clock.wall_ns()) == steps
    assert len(state.requests) == 2
    clock.set_ns(clock.monotonic_ns() + 2 * 60 * S)
    em.steps(T0 + 47 * H, clock.wall_ns())
    assert [p for p, _, _ in state.requests[2:]] == paths


def test_rate_limited_respects_retry_after(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    state, url = api
    clock = FakeClock(wall_start_ns=T0 + 40 * H)
    em = source(url, tmp_path, clock)
    state.queue.append((429, {"Retry-After": "120"}, b'{"message": "too many"}'))
    fp = footprint(lambda a, b: 3.6e6, T0, T0 + H, em)
    assert fp.source == (
        f"electricitymaps:FR (fallback: HTTP 429 (rate limited), retry after 120 s) -> {TABLE_FR}"
    )
    assert fp.g_per_kwh == 56.039
    assert len(state.requests) == 1
    # Before Retry-After has passed: no request at all, still the table.
    clock.set_ns(119 * S)
    steps, name = em.steps_with_source(T0, T0 + H)
    assert name == (
        "electricitymaps:FR (fallback: HTTP 429 (rate limited), no request for 1 s more) -> "
        + TABLE_FR
    )
    assert steps == TableIntensity("FR").steps(T0, T0 + H)
    assert len(state.requests) == 1
    # After it, the API is asked again and answers.
    clock.set_ns(120 * S)
    assert em.steps_with_source(T0, T0 + H) == (
        [Intensity(T0, 100.0), Intensity(T0 + H, 110.0)],
        "electricitymaps:FR",
    )
    assert len(state.requests) == 2


def test_retry_after_as_http_date(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    state, url = api
    clock = FakeClock(wall_start_ns=T0 + 40 * H)
    em = source(url, tmp_path, clock)
    when = dt.datetime.fromtimestamp((T0 + 40 * H) / S + 30, dt.timezone.utc)
    state.queue.append((429, {"Retry-After": when.strftime("%a, %d %b %Y %H:%M:%S GMT")}, b""))
    assert "retry after 30 s" in em.steps_with_source(T0, T0 + H)[1]
    clock.set_ns(29 * S)
    em.steps(T0, T0 + H)
    assert len(state.requests) == 1
    clock.set_ns(30 * S)
    assert em.steps_with_source(T0, T0 + H)[1] == "electricitymaps:FR"


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ((500, {}, b"oops"), "HTTP 500 from /v3/carbon-intensity/past-range"),
        ((200, {}, b"not json"), "bad JSON from /v3/carbon-intensity/past-range"),
        ((200, {}, b'{"zone": "FR"}'), "bad answer from past-range (no 'data' list)"),
        ((404, {}, b"{}"), "HTTP 404 from /v3/carbon-intensity/past-range"),
    ],
)
def test_errors_fall_back_to_the_table(
    api: tuple[FakeApi, str], tmp_path: Path, answer: tuple[int, dict[str, str], bytes], reason: str
) -> None:
    state, url = api
    em = source(url, tmp_path, FakeClock(wall_start_ns=T0 + 40 * H))
    state.queue.append(answer)
    fp = footprint(lambda a, b: 3.6e6, T0, T0 + H, em)
    assert fp.source == f"electricitymaps:FR (fallback: {reason}) -> {TABLE_FR}"
    assert fp.co2e_g == 56.039


def test_refused_token_then_no_more_requests(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    state, url = api
    clock = FakeClock(wall_start_ns=T0 + 40 * H)
    em = source(url, tmp_path, clock, token="wrong")
    assert em.steps_with_source(T0, T0 + H)[1] == (
        f"electricitymaps:FR (fallback: token refused (HTTP 401)) -> {TABLE_FR}"
    )
    assert state.requests[0][2] == "wrong"
    clock.set_ns(600 * S)
    assert (
        "token refused (HTTP 401), no request for 3000 s more"
        in em.steps_with_source(T0, T0 + H)[1]
    )
    assert len(state.requests) == 1


def test_no_token_sends_nothing(
    api: tuple[FakeApi, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, url = api
    monkeypatch.delenv("ELECTRICITYMAPS_TOKEN", raising=False)
    em = source(url, tmp_path, FakeClock(wall_start_ns=T0 + 40 * H), token=None)
    assert em.steps_with_source(T0, T0 + H)[1] == (
        f"electricitymaps:FR (fallback: no token (set ELECTRICITYMAPS_TOKEN)) -> {TABLE_FR}"
    )
    assert state.requests == []
    monkeypatch.setenv("ELECTRICITYMAPS_TOKEN", TOKEN)
    em = source(url, tmp_path, FakeClock(wall_start_ns=T0 + 40 * H), token=None)
    assert em.steps_with_source(T0, T0 + H)[1] == "electricitymaps:FR"
    assert state.requests[0][2] == TOKEN


def test_network_failures(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    state, url = api
    clock = FakeClock(wall_start_ns=T0 + 40 * H)
    state.hang.set()
    em = source(url, tmp_path, clock)
    name = em.steps_with_source(T0, T0 + H)[1]
    assert name.startswith("electricitymaps:FR (fallback: network error (")
    assert name.endswith(f") -> {TABLE_FR}")
    state.hang.clear()
    # backs off for a minute, then asks again
    assert "no request for 60 s more" in em.steps_with_source(T0, T0 + H)[1]
    clock.set_ns(60 * S)
    assert em.steps_with_source(T0, T0 + H)[1] == "electricitymaps:FR"
    # nothing listening at all
    closed = ElectricityMapsIntensity(
        "FR", token=TOKEN, base_url="http://127.0.0.1:9", cache_dir=None, clock=clock, timeout_s=0.5
    )
    assert "fallback: network error" in closed.steps_with_source(T0, T0 + H)[1]


def test_without_fallback_raises(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    state, url = api
    em = source(url, tmp_path, FakeClock(wall_start_ns=T0 + 40 * H), fallback=None)
    state.queue.append((503, {}, b""))
    with pytest.raises(IntensityUnavailableError, match="electricitymaps:FR: HTTP 503"):
        em.steps(T0, T0 + H)


def test_long_ranges_are_split_into_ten_day_requests(
    api: tuple[FakeApi, str], tmp_path: Path
) -> None:
    state, url = api
    clock = FakeClock(wall_start_ns=T0 + 30 * 24 * H)
    em = source(url, tmp_path, clock)
    steps = em.steps(T0, T0 + 25 * 24 * H)
    assert [s.start_ns for s in steps] == [T0 + k * H for k in range(48)]
    ranges = [(q["start"], q["end"]) for _, q, _ in state.requests]
    assert ranges == [
        ("2023-11-15T00:00:00Z", "2023-11-25T00:00:00Z"),
        ("2023-11-25T00:00:00Z", "2023-12-05T00:00:00Z"),
        ("2023-12-05T00:00:00Z", "2023-12-10T01:00:00Z"),
    ]


def test_unusable_disk_cache_is_ignored(api: tuple[FakeApi, str], tmp_path: Path) -> None:
    _, url = api
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "FR.json").write_text("{broken")
    em = source(url, tmp_path, FakeClock(wall_start_ns=T0 + 40 * H))
    assert em.steps(T0, T0) == [Intensity(T0, 100.0)]
