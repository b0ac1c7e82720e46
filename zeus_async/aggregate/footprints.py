"""Emissions and cost beside the joules: a carbon configuration opened once, applied to windows.

:class:`Carbon` is what every measuring part holds (window trackers, monitors, the request
meter, the CLI): the intensity source of a :class:`~zeus_async.carbon.CarbonConfig`, opened
once, with the PUE and overhead the config states. Where the energy timeline is at hand
(:meth:`DeviceHistory.energy <zeus_async.aggregate.history.DeviceHistory.energy>` between any
two instants), a time-varying intensity is integrated against it (:meth:`Carbon.between`);
where only a total is known, the energy is spread evenly over the interval
(:meth:`Carbon.spread`). Every :class:`~zeus_async.carbon.Footprint` carries its source, PUE
and overhead.

Without a configuration there are no carbon figures: the location is never guessed.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..carbon import CarbonConfig, Footprint, IntensitySource

__all__ = [
    "Carbon",
    "CarbonSpec",
    "PiecewiseEnergy",
    "RunningFootprint",
    "energy_pieces",
    "sum_footprints",
]

logger = logging.getLogger(__name__)

#: What every ``carbon=`` option takes: a config (opened once), an opened source (PUE 1, no
#: overhead), a :class:`Carbon`, or ``None`` (no carbon figures).
CarbonSpec = Any


class Carbon:
    """An opened carbon configuration: its intensity source, PUE and overhead.

    Args:
        source: Where intensity (and price) come from.
        pue: Power usage effectiveness applied to the measured energy.
        overhead: Further fraction on top of the PUE (cooling, distribution losses).
        config: The configuration it was opened from, when it was (pickles as it).
    """

    __slots__ = ("config", "overhead", "pue", "source")

    def __init__(
        self,
        source: IntensitySource,
        *,
        pue: float = 1.0,
        overhead: float = 0.0,
        config: CarbonConfig | None = None,
    ) -> None:
        self.source = source
        self.pue = pue
        self.overhead = overhead
        self.config = config

    @classmethod
    def of(cls, spec: CarbonSpec) -> Carbon | None:
        """The opened form of a ``carbon=`` option (see :data:`CarbonSpec`); ``None`` for
        ``None``.

        Raises:
            ConfigError: Whatever the config's ``open()`` refuses (a table source without a
                zone, an unknown zone, an unreadable file...).
            TypeError: Something else.
        """
        if spec is None or isinstance(spec, Carbon):
            return spec
        from ..carbon import CarbonConfig, IntensitySource

        if isinstance(spec, CarbonConfig):
            return cls(spec.open(), pue=spec.pue, overhead=spec.overhead, config=spec)
        if isinstance(spec, IntensitySource):
            return cls(spec)
        raise TypeError(
            f"carbon must be a CarbonConfig, an intensity source or None, not {type(spec).__name__}"
        )

    @property
    def name(self) -> str:
        """The source's name (``table:FR:2023 (...)``, ``constant``, ``file:x.csv``...)."""
        return str(self.source.name)

    def between(
        self, energy_between: Callable[[int, int], float], t0_ns: int, t1_ns: int
    ) -> Footprint:
        """The footprint of ``[t0_ns, t1_ns]``, the intensity in force at each instant
        weighted by the energy drawn then (``energy_between(a, b)``: joules over ``[a, b]``)."""
        from ..carbon import footprint

        return footprint(
            energy_between, t0_ns, t1_ns, self.source, pue=self.pue, overhead=self.overhead
        )

    def cuts(self, t0_ns: int, t1_ns: int) -> list[int]:
        """Where the intensity may change strictly inside ``(t0_ns, t1_ns)``: the instants at
        which a window's energy must be split for :meth:`between` to be exact
        (:func:`~zeus_async.carbon.step_cuts`; no network asked)."""
        from ..carbon import step_cuts

        return step_cuts(self.source, t0_ns, t1_ns)

    def spread(self, energy_j: float, t0_ns: int, t1_ns: int) -> Footprint:
        """The footprint of ``energy_j`` drawn evenly over ``[t0_ns, t1_ns]`` (where only the
        total is known)."""
        from ..carbon import footprint_of

        return footprint_of(
            energy_j, t0_ns, t1_ns, self.source, pue=self.pue, overhead=self.overhead
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # A config pickles as itself and is opened again where it lands (its source may hold
        # a cache, a lock, an HTTP client); a bare source pickles as it is.
        if self.config is not None:
            return (Carbon.of, (self.config,))
        return (Carbon, (self.source,), {"pue": self.pue, "overhead": self.overhead})

    def __setstate__(self, state: dict[str, float]) -> None:
        self.pue = state["pue"]
        self.overhead = state["overhead"]
        self.config = None

    def __repr__(self) -> str:
        return f"Carbon({self.name!r}, pue={self.pue!r}, overhead={self.overhead!r})"


def history_energy_between(histories: Iterable[Any]) -> Callable[[int, int], float]:
    """``energy_between(a, b)``: the joules of every one of ``histories``
    (:class:`~zeus_async.aggregate.history.DeviceHistory`) over ``[a, b]``, summed (a device
    without a figure there counts 0)."""
    kept = list(histories)

    def energy_between(t0_ns: int, t1_ns: int) -> float:
        total = 0.0
        for history in kept:
            joules = history.energy(t0_ns, t1_ns).energy_j
            if joules is not None:
                total += joules
        return total

    return energy_between


class PiecewiseEnergy:
    """``energy_between(a, b)`` of an interval known as pieces: ``joules[i]`` drawn over
    ``[points[i], points[i + 1]]``. Exact between any two of ``points``; inside a piece, its
    energy is taken as drawn evenly. ``whole`` (when given) is the answer for the whole
    interval (a window's own figure, as the thread sampler's footprint uses it).

    What a client of an agent integrates: the agent splits the window's energy at the
    intensity's step boundaries the client sent (:meth:`Carbon.cuts`), and the client's
    :meth:`Carbon.between` asks for exactly those pieces.
    """

    __slots__ = ("_cum", "_points", "_whole")

    def __init__(
        self, points: Sequence[int], joules: Sequence[float], whole: float | None = None
    ) -> None:
        if len(points) != len(joules) + 1 or len(points) < 2:
            raise ValueError(f"{len(points)} points for {len(joules)} pieces")
        self._points = list(points)
        cum = [0.0]
        for e in joules:
            cum.append(cum[-1] + float(e))
        self._cum = cum
        self._whole = whole

    def _at(self, t: int) -> float:
        points, cum = self._points, self._cum
        if t <= points[0]:
            return 0.0
        if t >= points[-1]:
            return cum[-1]
        i = bisect.bisect_right(points, t) - 1
        a, b = points[i], points[i + 1]
        return cum[i] + (cum[i + 1] - cum[i]) * (t - a) / (b - a)

    def __call__(self, t0_ns: int, t1_ns: int) -> float:
        if self._whole is not None and t0_ns <= self._points[0] and t1_ns >= self._points[-1]:
            return self._whole
        return self._at(t1_ns) - self._at(t0_ns)


def energy_pieces(
    histories: Iterable[tuple[str, Any]], points: Sequence[int]
) -> list[tuple[float, float]]:
    """Per piece ``[points[i], points[i + 1]]``: the joules of every one of ``histories``
    (``(key, DeviceHistory)``) and of the GPUs among them (keys ``gpu:...``), from the
    histories as :meth:`WindowTracker._footprints
    <zeus_async.aggregate.windows.WindowTracker>` integrates them (a device without a figure
    there counts 0)."""
    kept = list(histories)
    every = history_energy_between(h for _, h in kept)
    gpus = history_energy_between(h for k, h in kept if k.startswith("gpu:"))
    return [(every(a, b), gpus(a, b)) for a, b in itertools.pairwise(points)]


def sum_footprints(parts: Sequence[Footprint]) -> Footprint | None:
    """The footprint of several intervals or devices together (``None`` for none): energy,
    kWh, grams and cost summed (cost ``None`` when one part has none, or when currencies
    differ), the energy-weighted intensity, the sources named once each in order, and the
    PUE and overhead of the parts (the first part's where they differ, said in the log)."""
    if not parts:
        return None
    import msgspec

    first = parts[0]
    kwh = sum(p.kwh for p in parts)
    co2e = sum(p.co2e_g for p in parts)
    currencies = {p.currency for p in parts if p.cost is not None}
    cost: float | None = None
    currency = ""
    if all(p.cost is not None for p in parts) and len(currencies) <= 1:
        cost = sum(p.cost for p in parts if p.cost is not None)
        currency = next(iter(currencies), "")
    if any(p.pue != first.pue or p.overhead != first.overhead for p in parts):
        logger.warning("footprints with different PUE or overhead summed; stating the first's")
    sources = list(dict.fromkeys(p.source for p in parts))
    return msgspec.structs.replace(
        first,
        energy_j=sum(p.energy_j for p in parts),
        kwh=kwh,
        co2e_g=co2e,
        cost=cost,
        currency=currency,
        g_per_kwh=co2e / kwh if kwh > 0 else first.g_per_kwh,
        source="; ".join(sources),
    )


class RunningFootprint:
    """A footprint accumulated along a stream whose energy is known as a running total (the
    ``monitor`` command's device totals): each :meth:`advance` charges the energy drawn since
    the previous one, spread over that stretch of time, at the intensity then in force. The
    energy adds up to the last total exactly; the intensity is resolved to the stretch
    between two calls (the CLI's refresh, 0.5 s, against intensities that change hourly).
    """

    def __init__(self, carbon: Carbon) -> None:
        self.carbon = carbon
        self._parts: list[Footprint] = []
        self._energy_j = 0.0
        self._t_ns: int | None = None

    def advance(self, energy_j: float, t_ns: int, *, since_ns: int | None = None) -> None:
        """The running total is ``energy_j`` at ``t_ns``; on the first call, counted from
        ``since_ns`` (the first sample; ``t_ns`` when not given)."""
        if self._t_ns is None:
            self._t_ns = t_ns if since_ns is None else since_ns
        delta = energy_j - self._energy_j
        if delta == 0 and t_ns <= self._t_ns:
            return
        t1 = max(t_ns, self._t_ns + 1)
        part = self.carbon.spread(delta, self._t_ns, t1)
        # Merged as it goes: one footprint, not one per refresh.
        merged = sum_footprints([*self._parts, part])
        assert merged is not None
        self._parts = [merged]
        self._energy_j, self._t_ns = energy_j, t1

    @property
    def footprint(self) -> Footprint | None:
        """What was charged so far (``None`` before any energy)."""
        return self._parts[0] if self._parts else None
