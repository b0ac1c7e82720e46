"""Injectable clocks.

All time-dependent code in zeus_async (sampler cadence, window math, the simulator, timeouts)
reads time and sleeps through a :class:`Clock`, so tests can run a :class:`FakeClock` and the
simulator can run faster than real time.

Two time scales are kept apart on purpose:

* ``monotonic_ns()`` for intervals and deadlines inside one process;
* ``wall_ns()`` (``time.time_ns()``-like) stamped on events so they compare across hosts.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Protocol, runtime_checkable

import anyio
import anyio.to_thread

from ._threads import DaemonExecutor

__all__ = ["Clock", "FakeClock", "RealClock"]


@runtime_checkable
class Clock(Protocol):
    """Source of time and of sleeping."""

    def monotonic_ns(self) -> int:
        """Monotonic nanoseconds, for intervals within a process."""
        ...

    def wall_ns(self) -> int:
        """Wall-clock nanoseconds since the Unix epoch."""
        ...

    async def sleep_until(self, monotonic_ns: int) -> None:
        """Sleep until ``monotonic_ns()`` reaches the deadline (return at once if past)."""
        ...


def _worker_threads_busy() -> bool:
    """Whether work handed to anyio's worker threads (compression, offloaded reads) or to a
    :class:`~zeus_async._threads.DaemonExecutor` (file writes) is still running. It takes
    real time, and whoever waits for it is not among the sleepers, so an autojump meanwhile
    would skip past deadlines they would have met."""
    return (
        anyio.to_thread.current_default_thread_limiter().borrowed_tokens > 0
        or DaemonExecutor.in_flight > 0
    )


class RealClock:
    """The process's real clocks."""

    __slots__ = ()

    def monotonic_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns()

    async def sleep_until(self, monotonic_ns: int) -> None:
        delay = (monotonic_ns - time.monotonic_ns()) / 1e9
        await anyio.sleep(delay if delay > 0 else 0)


class FakeClock:
    """A clock that moves only when told to (or automatically when every sleeper waits).

    Args:
        wall_start_ns: Wall-clock value at fake monotonic time 0.
        autojump: When true, a waiting sleeper makes the clock jump straight to the earliest
            deadline once the event loop has had ``settle_yields`` turns to run other work.
            Use :meth:`advance` for full manual control instead.
        settle_yields: Loop turns to let ready tasks run before an autojump.

    The fake monotonic time starts at 0; ``wall_ns() == wall_start_ns + monotonic_ns()``.
    Synchronous code (the simulator) may read the clock from any thread.
    """

    def __init__(
        self,
        wall_start_ns: int = 1_700_000_000 * 10**9,
        *,
        autojump: bool = True,
        settle_yields: int = 8,
    ) -> None:
        self._now = 0
        self._wall_start = wall_start_ns
        self._autojump = autojump
        self._settle = settle_yields
        self._heap: list[tuple[int, int, anyio.Event]] = []
        self._seq = itertools.count()
        self._epoch = 0

    def monotonic_ns(self) -> int:
        return self._now

    def wall_ns(self) -> int:
        return self._wall_start + self._now

    def set_ns(self, monotonic_ns: int) -> None:
        """Move the clock (forward only) without waking sleepers; for synchronous tests."""
        if monotonic_ns < self._now:
            raise ValueError("FakeClock cannot go backwards")
        self._now = monotonic_ns

    def advance_sync(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` without waking sleepers (synchronous code)."""
        self.set_ns(self._now + round(seconds * 1e9))

    async def sleep_until(self, monotonic_ns: int) -> None:
        if monotonic_ns <= self._now:
            await anyio.lowlevel.checkpoint()
            return
        event = anyio.Event()
        heapq.heappush(self._heap, (monotonic_ns, next(self._seq), event))
        self._epoch += 1
        if not self._autojump:
            await event.wait()
            return
        # Autojump: every sleeper polls; whoever sees no activity for `settle` loop turns
        # moves the clock to the earliest deadline. Activity = a new sleeper or a wake-up.
        quiet = 0
        seen = self._epoch
        while not event.is_set():
            await anyio.lowlevel.checkpoint()
            if self._epoch != seen:
                seen = self._epoch
                quiet = 0
                continue
            quiet += 1
            if quiet >= self._settle and self._heap and not _worker_threads_busy():
                self._wake_until(self._heap[0][0])
                quiet = 0
                seen = self._epoch

    def _wake_until(self, monotonic_ns: int) -> None:
        if monotonic_ns > self._now:
            self._now = monotonic_ns
        while self._heap and self._heap[0][0] <= self._now:
            _, _, event = heapq.heappop(self._heap)
            event.set()
            self._epoch += 1

    async def advance(self, seconds: float) -> None:
        """Move forward by ``seconds``, waking every sleeper whose deadline passes, in order."""
        target = self._now + round(seconds * 1e9)
        while self._heap and self._heap[0][0] <= target:
            self._wake_until(self._heap[0][0])
            for _ in range(self._settle):
                await anyio.lowlevel.checkpoint()
        self._now = max(self._now, target)
        await anyio.lowlevel.checkpoint()

    @property
    def sleepers(self) -> int:
        """Number of tasks currently sleeping on this clock."""
        return len(self._heap)
