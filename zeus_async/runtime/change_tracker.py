"""Adaptive reads: skip the ticks on which a field can only repeat its last value.

NVML refreshes power and energy on the driver's own cadence (every 100 ms on H100s), so a
100 Hz poll reads each value about ten times. With adaptive reads on, the sampler keeps one
:class:`ChangeTracker` per power/energy field. The tracker learns the field's refresh period
from what it reads and, once that period is stable, asks for reads only around the expected
refresh: ``guard`` ticks before it, then every tick until the new value shows up.

**Equivalence.** Every change is still seen *bracketed*: the read on the tick just before it
returned the old value, as a read on every tick would have. The skipped reads fall between two
reads of the same value (the field had not refreshed), so a consumer that interpolates linearly
between samples, as the trapezoid rule of windows and live totals does, gets the same energy from
the sparse series as from the full one. Change times are known to one tick, as before.

The tracker locks onto a period once ``lock_after`` successive gaps between bracketed changes
agree to within two ticks (a refresh close to a tick boundary is seen on either side of it from
one period to the next, depending on how late the sampler wakes); it then reads with a guard of
two ticks if the gaps differed. **Anything unexpected is paid for with more reads, never with a
hidden change:**

* a change on the first read after skipped ticks (the refresh came before the guard): that change
  is not bracketed and is counted in :attr:`ChangeTracker.unbracketed`; the guard widens by one
  tick, up to ``max_guard``, beyond which the tracker goes back to reading every tick (the
  *learning* state);
* no change for a whole period past the expected one (the value held still, or the source slowed
  down): back to learning;
* a guard wider than one tick narrows by one again after ``narrow_after`` successive changes
  that the narrower guard would also have bracketed (a one-off stall does not cost an extra read
  per refresh for the rest of the run; a refresh that keeps flipping across a tick boundary
  keeps the wider guard, since its early changes reset the count);
* a refresh period shorter than ``min_period`` ticks, or gaps that differ by more than two ticks:
  nothing is ever skipped for such a field.
"""

from __future__ import annotations

import itertools

__all__ = ["ADAPTIVE_FIELDS", "ChangeTracker"]

#: Fields the sampler tracks with adaptive reads on: those NVML refreshes on the driver's power
#: cadence. Other fields (clocks, memory, temperature, ...) keep their fixed periods.
ADAPTIVE_FIELDS: frozenset[str] = frozenset({"power_w", "avg_power_w", "energy_j"})


class ChangeTracker:
    """Learns when one field refreshes and says which ticks must be read.

    Ticks are the sampler's grid indices. Call :meth:`wants` before a tick and
    :meth:`observe` with every value read.

    Args:
        lock_after: Bracketed intervals of equal length needed before skipping starts.
        min_period: Shortest refresh period (ticks) worth skipping for.
        max_guard: Widest guard (reads before the expected refresh).
        narrow_after: Successive changes a guard one tick narrower would also have bracketed
            before the guard narrows.
    """

    __slots__ = (
        "_changes",
        "_expect",
        "_last_tick",
        "_last_value",
        "_lock_after",
        "_max_guard",
        "_min_period",
        "_narrow_after",
        "_on_time",
        "guard",
        "period",
        "unbracketed",
    )

    def __init__(
        self,
        *,
        lock_after: int = 3,
        min_period: int = 3,
        max_guard: int = 3,
        narrow_after: int = 50,
    ) -> None:
        if lock_after < 1 or min_period < 2 or max_guard < 1 or narrow_after < 1:
            raise ValueError(
                "lock_after >= 1, min_period >= 2, max_guard >= 1 and narrow_after >= 1 "
                "are required"
            )
        self._lock_after = lock_after
        self._min_period = min_period
        self._max_guard = max_guard
        self._narrow_after = narrow_after
        self._on_time = 0  # successive changes a one-tick-narrower guard would have bracketed
        self._last_tick: int | None = None
        self._last_value: object = None
        self._changes: list[int] = []  # ticks of recent bracketed changes
        self._expect = 0
        #: The locked refresh period in ticks; ``None`` while learning (every tick is read).
        self.period: int | None = None
        #: Reads before the expected refresh.
        self.guard = 1
        #: Changes seen after skipped ticks while locked (not bracketed).
        self.unbracketed = 0

    def wants(self, tick: int) -> bool:
        """Whether ``tick`` must be read."""
        return self.period is None or tick >= self._expect - self.guard

    def next_wanted(self, tick: int) -> int:
        """The first tick at or after ``tick`` that must be read."""
        if self.period is None:
            return tick
        return max(tick, self._expect - self.guard)

    def observe(self, tick: int, value: object) -> None:
        """Account the value read on ``tick`` (``None``: the read failed)."""
        prev_tick, prev = self._last_tick, self._last_value
        if value is None:
            self.missed()  # the next change cannot be bracketed
            return
        self._last_tick, self._last_value = tick, value
        if prev_tick is None or value == prev:
            if self.period is not None and tick >= self._expect + self.period:
                self._unlock()  # held still for a whole period past the expected refresh
            return
        if prev_tick != tick - 1:
            self._changes.clear()  # the change's tick is not known to one tick
            if self.period is not None:
                # The refresh came before the guard: that change is not bracketed. Widen the
                # guard and expect the next refresh a period from here; give up the lock once
                # the widest guard is not enough either.
                self.unbracketed += 1
                self._on_time = 0
                if self.guard < self._max_guard:
                    self.guard += 1
                    self._expect = tick + self.period
                else:
                    self._unlock()
            return
        changes = self._changes
        changes.append(tick)
        if self.period is not None:
            if self.guard > 1:
                self._count_on_time(tick)
            self._expect = tick + self.period
            del changes[: -self._lock_after - 1]
            return
        if len(changes) > self._lock_after:
            del changes[: -self._lock_after - 1]
            gaps = [b - a for a, b in itertools.pairwise(changes)]
            # A refresh close to a tick boundary is seen on either side of it from one period
            # to the next: gaps then differ by up to two ticks around the true period.
            if max(gaps) - min(gaps) <= 2:
                period = round(sum(gaps) / len(gaps))
                if period >= self._min_period:
                    self.period = period
                    self._expect = tick + period
                    if max(gaps) != min(gaps):
                        self.guard = max(self.guard, 2)

    def _count_on_time(self, tick: int) -> None:
        """Narrow the guard once enough bracketed changes came late enough for a narrower one.

        With guard ``g`` the reads start at ``expect - g``; a guard of ``g - 1`` brackets a
        change on ``tick`` if its read of ``tick - 1`` is at or after ``expect - g + 1``.
        """
        if tick >= self._expect - self.guard + 2:
            self._on_time += 1
            if self._on_time >= self._narrow_after:
                self.guard -= 1
                self._on_time = 0
        else:
            self._on_time = 0

    def missed(self) -> None:
        """The sampler woke too late for a tick this tracker wanted: the next change cannot be
        bracketed, through no fault of the rule (it is not counted as unbracketed)."""
        self._last_tick = None

    def reset(self) -> None:
        """Forget what was learnt (ticks went unread): read every tick again."""
        self.missed()
        self._unlock()

    def _unlock(self) -> None:
        self.period = None
        self._on_time = 0
        self._changes.clear()
