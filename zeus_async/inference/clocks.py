"""Map an engine's own clock onto the request meter's (wall-clock ns).

An inference engine stamps what it saw with its own clock, most often ``time.monotonic()`` or
``time.perf_counter()`` seconds; :class:`~.meter.RequestMeter` wants wall-clock ns, the clock
the runtime stamps GPU readings with (``time.time_ns``)::

    clocks = ClockMap.monotonic()
    meter.begin(rid, at_ns=clocks.ns(stats.arrival_time))

The map is ``wall_ns = offset_ns + t * unit_s * 1e9``. The offset is fitted by sampling: each
sample reads the wall clock, the engine's clock, and the wall clock again; the engine's
reading is taken to lie at the middle of that bracket, and of several samples the one with
the tightest bracket is kept (a sample the scheduler interrupted has a wide one), so the
offset is off by at most half that bracket (:attr:`ClockMap.bracket_ns`, typically well under
a microsecond). The wall clock can be slewed or stepped (NTP) while the engine's does not
move with it: call :meth:`ClockMap.refresh` now and then (e.g. once a minute).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import ConfigError

__all__ = ["ClockMap"]

logger = logging.getLogger(__name__)

#: Samples per fit: the tightest bracket of these is kept.
_SAMPLES = 16


class ClockMap:
    """A linear map from an engine's clock to wall-clock ns (see the module docstring).

    Args:
        now: The engine's clock (a number of ``unit_s`` units).
        unit_s: Its unit in seconds (1.0 for seconds, 1e-9 for ns).
        wall: The meter's clock (wall-clock ns).
        samples: Samples per fit.

    Raises:
        ConfigError: A unit that is not positive, or fewer than one sample.
    """

    def __init__(
        self,
        now: Callable[[], float],
        unit_s: float = 1.0,
        *,
        wall: Callable[[], int] = time.time_ns,
        samples: int = _SAMPLES,
    ) -> None:
        if not unit_s > 0 or samples < 1:
            raise ConfigError("unit_s must be > 0 and samples >= 1")
        self._now = now
        self._wall = wall
        self._scale = unit_s * 1e9
        self._samples = samples
        self._lock = threading.Lock()
        #: ``wall_ns - t * unit_s * 1e9``, fitted (int: wall ns need more digits than floats).
        self.offset_ns = 0
        #: The tightest bracket of the last fit (ns): the offset is within half of it.
        self.bracket_ns = 0
        self.refresh()

    @classmethod
    def of(
        cls,
        now: Callable[[], float],
        unit_s: float = 1.0,
        *,
        wall: Callable[[], int] = time.time_ns,
        samples: int = _SAMPLES,
    ) -> ClockMap:
        """The map of any clock ``now`` counting ``unit_s`` seconds."""
        return cls(now, unit_s, wall=wall, samples=samples)

    @classmethod
    def monotonic(cls) -> ClockMap:
        """For ``time.monotonic()`` seconds (vLLM's stats, asyncio's loop time)."""
        return cls(time.monotonic, 1.0)

    @classmethod
    def perf_counter(cls) -> ClockMap:
        """For ``time.perf_counter()`` seconds."""
        return cls(time.perf_counter, 1.0)

    def refresh(self) -> int:
        """Fit the offset again; returns how far it moved (ns)."""
        with self._lock:
            best: tuple[int, int] | None = None  # (bracket, offset)
            for _ in range(self._samples):
                w0 = self._wall()
                t = self._now()
                w1 = self._wall()
                bracket = w1 - w0
                if bracket < 0:  # the wall clock stepped back in between: no sample
                    continue
                offset = (w0 + w1) // 2 - round(t * self._scale)
                if best is None or bracket < best[0]:
                    best = (bracket, offset)
            if best is None:
                logger.warning("clock map: the wall clock went back in every sample; kept")
                return 0
            moved = best[1] - self.offset_ns
            self.bracket_ns, self.offset_ns = best
            return moved

    def ns(self, t: float) -> int:
        """The engine's time ``t`` as wall-clock ns."""
        return self.offset_ns + round(t * self._scale)
