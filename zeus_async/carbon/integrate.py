"""Integration of a time-varying carbon intensity (and price) against measured energy."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ._types import J_PER_KWH, Footprint, Intensity, IntensitySource

logger = logging.getLogger(__name__)

__all__ = ["MAX_CUTS", "check_factors", "footprint", "footprint_of", "step_cuts"]

#: Most step boundaries :func:`step_cuts` returns for one interval; beyond, none (the caller
#: then spreads the energy evenly, said in the log once).
MAX_CUTS = 10_000

_warned_many_cuts = False


def check_factors(pue: float, overhead: float) -> None:
    """Raise :class:`ConfigError` unless ``pue >= 1`` and ``overhead >= 0`` (both finite)."""
    if not (math.isfinite(pue) and pue >= 1.0):
        raise ConfigError(f"carbon: pue must be a finite number >= 1.0, not {pue!r}")
    if not (math.isfinite(overhead) and overhead >= 0.0):
        raise ConfigError(f"carbon: overhead must be a finite number >= 0.0, not {overhead!r}")


def step_cuts(source: IntensitySource, t0_ns: int, t1_ns: int) -> list[int]:
    """The instants strictly inside ``(t0_ns, t1_ns)`` where ``source``'s intensity (or price)
    may change: where an energy timeline must be cut for :func:`footprint` to be exact.

    A source with a ``cuts(t0_ns, t1_ns)`` method answers it without the network (Electricity
    Maps: its hour boundaries); any other, from its :meth:`~IntensitySource.steps`. A source
    that cannot answer gives none (the footprint, computed later, says why). More than
    :data:`MAX_CUTS`: none either (a warning, once).
    """
    global _warned_many_cuts
    if t1_ns <= t0_ns:
        return []
    own = getattr(source, "cuts", None)
    try:
        if callable(own):
            out = [int(t) for t in own(t0_ns, t1_ns)]
        else:
            out = [s.start_ns for s in source.steps(t0_ns, t1_ns) if t0_ns < s.start_ns < t1_ns]
    except Exception as exc:
        logger.debug(
            "carbon source %s gave no steps for [%d, %d]: %s", source.name, t0_ns, t1_ns, exc
        )
        return []
    if len(out) > MAX_CUTS:
        if not _warned_many_cuts:
            _warned_many_cuts = True
            logger.warning(
                "carbon source %s changes %d times in one interval (more than %d): that "
                "interval's energy is spread evenly over it",
                source.name,
                len(out),
                MAX_CUTS,
            )
        return []
    return out


def _steps_and_name(source: IntensitySource, t0_ns: int, t1_ns: int) -> tuple[list[Intensity], str]:
    with_source = getattr(source, "steps_with_source", None)
    if callable(with_source):
        steps, name = with_source(t0_ns, t1_ns)
    else:
        steps, name = source.steps(t0_ns, t1_ns), source.name
    if not steps:
        raise ConfigError(f"carbon source {name} gave no intensity for [{t0_ns}, {t1_ns}]")
    if steps[0].start_ns > t0_ns:
        raise ConfigError(
            f"carbon source {name} starts at {steps[0].start_ns} ns, after the interval's "
            f"start {t0_ns} ns"
        )
    return steps, name


def footprint(
    energy_between: Callable[[int, int], float],
    t0_ns: int,
    t1_ns: int,
    source: IntensitySource,
    *,
    pue: float = 1.0,
    overhead: float = 0.0,
) -> Footprint:
    """Emissions and cost of the energy drawn over ``[t0_ns, t1_ns]``.

    The interval is cut at the source's step boundaries and each piece ``[a, b]`` is weighted
    by its own energy ``energy_between(a, b)`` (joules), not by its duration: a job that drew
    most of its energy while the grid was dirty is charged the dirty intensity. With one
    step (a constant or a yearly table) this is ``energy * intensity``.

    Args:
        energy_between: Energy (J) drawn over ``[a, b]`` (wall-clock ns), e.g. from a power
            timeline or a recording; called once per piece.
        t0_ns: Start of the interval (wall-clock ns).
        t1_ns: End of the interval, ``>= t0_ns``.
        source: Where the intensity comes from (:class:`IntensitySource`).
        pue: Power usage effectiveness of the site, ``>= 1`` (1.0: none applied).
        overhead: Further fraction on top of the PUE (``0.1``: 10 % more), ``>= 0``.

    Returns:
        The :class:`Footprint`, which states the source, PUE and overhead used.

    Raises:
        ConfigError: ``t1_ns < t0_ns``, a bad PUE or overhead, a source that does not cover the
            interval, or prices in more than one currency.
    """
    check_factors(pue, overhead)
    if t1_ns < t0_ns:
        raise ConfigError(f"carbon: interval ends ({t1_ns}) before it starts ({t0_ns})")
    steps, name = _steps_and_name(source, t0_ns, t1_ns)
    energy = 0.0  # J
    weighted = 0.0  # J * g/kWh
    paid: float | None = 0.0  # J * price/kWh
    currency = ""
    used: list[Intensity] = []  # the steps under which energy was drawn
    for i, step in enumerate(steps):
        a = max(t0_ns, step.start_ns)
        b = t1_ns if i + 1 == len(steps) else min(t1_ns, steps[i + 1].start_ns)
        if b <= a:
            continue
        e = float(energy_between(a, b))
        if e == 0.0:
            continue
        energy += e
        weighted += e * step.g_per_kwh
        used.append(step)
        if step.price_per_kwh is None or paid is None:
            paid = None
            continue
        if currency and step.currency and step.currency != currency:
            raise ConfigError(f"carbon source {name} prices in both {currency} and {step.currency}")
        currency = currency or step.currency
        paid += e * step.price_per_kwh
    scale = pue * (1.0 + overhead)
    kwh = energy / J_PER_KWH * scale
    co2e = weighted / J_PER_KWH * scale
    if not used:  # nothing drawn: the intensity (and a zero cost) of the interval's start
        first = next((s for s in reversed(steps) if s.start_ns <= t0_ns), steps[0])
        g_per_kwh = first.g_per_kwh
        cost = None if first.price_per_kwh is None else 0.0
        currency = first.currency if cost is not None else ""
    else:
        distinct = {s.g_per_kwh for s in used}
        g_per_kwh = used[0].g_per_kwh if len(distinct) == 1 else weighted / energy
        cost = None if paid is None else paid / J_PER_KWH * scale
        if cost is None:
            currency = ""
    return Footprint(
        energy_j=energy,
        kwh=kwh,
        co2e_g=co2e,
        cost=cost,
        currency=currency,
        g_per_kwh=g_per_kwh,
        source=name,
        pue=pue,
        overhead=overhead,
    )


def footprint_of(
    energy_j: float, t0_ns: int, t1_ns: int, source: IntensitySource, **kw: Any
) -> Footprint:
    """:func:`footprint` of ``energy_j`` joules assumed drawn *uniformly in time* over
    ``[t0_ns, t1_ns]``, for when no power timeline is known (a total from a counter).

    Each step's piece then weighs by its duration: with a time-varying source this is a
    time-average, exact only if the power was constant. Prefer :func:`footprint` with the
    energy timeline when there is one. ``t0_ns == t1_ns`` charges all of ``energy_j`` at the
    intensity in force at ``t0_ns``. Keyword arguments (``pue``, ``overhead``) go to
    :func:`footprint`.
    """
    span = t1_ns - t0_ns

    def between(a: int, b: int) -> float:
        if span <= 0:
            return float(energy_j)
        return float(energy_j) * (b - a) / span

    if span <= 0 and t1_ns == t0_ns:
        return _instant(energy_j, t0_ns, source, **kw)
    return footprint(between, t0_ns, t1_ns, source, **kw)


def _instant(energy_j: float, t_ns: int, source: IntensitySource, **kw: Any) -> Footprint:
    pue = float(kw.get("pue", 1.0))
    overhead = float(kw.get("overhead", 0.0))
    check_factors(pue, overhead)
    steps, name = _steps_and_name(source, t_ns, t_ns)
    step = next(s for s in reversed(steps) if s.start_ns <= t_ns)
    kwh = float(energy_j) * pue * (1.0 + overhead) / J_PER_KWH
    cost = None if step.price_per_kwh is None else kwh * step.price_per_kwh
    return Footprint(
        energy_j=float(energy_j),
        kwh=kwh,
        co2e_g=kwh * step.g_per_kwh,
        cost=cost,
        currency=step.currency if cost is not None else "",
        g_per_kwh=step.g_per_kwh,
        source=name,
        pue=pue,
        overhead=overhead,
    )
