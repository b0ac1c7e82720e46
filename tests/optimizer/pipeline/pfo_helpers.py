"""Test helpers: a PFO server on a background event loop, and synthetic profiling results."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from zeus_async.optimizer.pipeline import (
    FrequencySchedule,
    PfoClient,
    PfoServer,
    PfoSettings,
    ProfilingResult,
)
from zeus_async.optimizer.pipeline.schedulers import PointSolution

T = TypeVar("T")


class GatedPointSolution(PointSolution):
    """``PointSolution`` that plans (builds) only once :attr:`GATE` is set: a job "planning"
    for as long as a test needs (``scheduler="pfo_helpers:GatedPointSolution"``)."""

    GATE = threading.Event()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.GATE.wait(60)
        super().__init__(*args, **kwargs)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ServerUnderTest(PfoServer):
    """A server whose event loop runs in a portal; ``call`` runs code on that loop."""

    portal: BlockingPortal

    def call(self, func: Callable[[], T]) -> T:
        return self.portal.call(_sync, func)


async def _sync(func: Callable[[], T]) -> T:
    return func()


@contextmanager
def running_server(
    tmp_path: Path,
    clock: FakeClock | None = None,
    *,
    endpoint: str = "tcp://127.0.0.1:*",
    **settings: Any,
) -> Iterator[tuple[ServerUnderTest, str]]:
    settings.setdefault("dump_dir", str(tmp_path / "dump"))
    settings.setdefault("admin_token", ADMIN)
    server = ServerUnderTest(
        PfoSettings(**settings),
        endpoint,
        clock=clock or FakeClock(),
        evict_period_s=3600,
    )
    endpoint = server.bind()
    with start_blocking_portal("asyncio") as portal:
        server.portal = portal
        future = portal.start_task_soon(server.serve)
        try:
            yield server, endpoint
        finally:
            future.cancel()


def result_for(
    schedule: FrequencySchedule, *, iters: int = 2, base: float = 0.01
) -> ProfilingResult:
    """A result whose instruction times/energies are a function of the clock (faster = more J)."""
    t_b: dict[str, list[list[float]]] = {}
    e_b: dict[str, list[list[float]]] = {}
    for _ in range(iters):
        per_t: dict[str, list[float]] = {}
        per_e: dict[str, list[float]] = {}
        for name, mhz in schedule.frequencies:
            scale = 2.0 if name == "backward" else 1.0
            t = scale * base * (0.3 + 0.7 * 1980 / mhz)
            # power: 60 W idle + cubic dynamic part
            e = t * (60.0 + 240.0 * (mhz / 1980) ** 3)
            per_t.setdefault(name, []).append(t)
            per_e.setdefault(name, []).append(e)
        for k in per_t:
            t_b.setdefault(k, []).append(per_t[k])
            e_b.setdefault(k, []).append(per_e[k])
    busy = sum(sum(v) for vs in t_b.values() for v in vs) / iters
    busy_e = sum(sum(v) for vs in e_b.values() for v in vs) / iters
    return ProfilingResult(
        rank=schedule.rank,
        iter_time=[busy + 0.005] * iters,
        iter_energy=[busy_e + 0.005 * 50.0] * iters,  # 50 W while blocked
        time_breakdown=t_b,
        energy_breakdown=e_b,
    )


#: The admin token of the servers these tests start.
ADMIN = "test-admin-token"


def clients(endpoint: str, n: int, *, admin: bool = True) -> list[PfoClient]:
    """``n`` clients acting as the ranks of one training job: they share the tokens of the
    jobs any of them registers (as rank 0 shares its token with the others). With ``admin``,
    their ``info()`` lists every job."""
    made = [
        PfoClient(endpoint, timeout_s=10.0, admin_token=ADMIN if admin else "") for _ in range(n)
    ]
    for c in made[1:]:
        c.tokens = made[0].tokens
    return made
