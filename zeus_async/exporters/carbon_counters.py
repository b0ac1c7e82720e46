"""Emissions and cost counters beside the energy counters, for the Prometheus and OTLP exporters.

:class:`CarbonCounters` follows the GPU samples of a stream: each GPU's energy drawn since the
previous sample is charged at the intensity (and price) in force then, with the PUE and
overhead of the runtime's carbon configuration, into two counters per GPU (grams CO2e, money).
Samples come every few milliseconds and intensities change hourly, so the charge follows the
power timeline; a sample interval that straddles a step boundary is split there
(:meth:`~zeus_async.aggregate.footprints.Carbon.spread` over it).

A finished window (a :class:`~zeus_async.events.Measurement`) is charged its own energy, with
the intensity weighted by the host's GPU energy timeline that the samples drew (checkpoints
every ``checkpoint_s`` and at every step boundary): exact where the intensity is one value over
the window, and energy-weighted, not time-averaged, where it changes inside it.

The series are labelled with the configured source's name (``table:FR:2023 (...)``,
``file:grid.csv``, ``electricitymaps:FR``): one value per exporter, never a per-step or
per-fallback text, so the label set stays bounded.
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from ..aggregate.footprints import Carbon, PiecewiseEnergy
from ..carbon import J_PER_KWH
from ..events import Measurement, window_energies

if TYPE_CHECKING:
    from ..carbon import Footprint

__all__ = ["CarbonCounters", "GpuCharge"]

logger = logging.getLogger(__name__)

_NS = 1_000_000_000
#: How far ahead a looked-up step is trusted when the source names no next boundary: the
#: source is asked again after that (Electricity Maps' latest figure may change).
_HORIZON_NS = 60 * _NS


class _Step(NamedTuple):
    start_ns: int
    until_ns: int
    g_per_kwh: float
    price_per_kwh: float | None
    currency: str


class GpuCharge:
    """One GPU's counters: grams CO2e and money charged since the exporter started."""

    __slots__ = ("cost", "currency", "energy_j", "grams", "t_ns")

    def __init__(self) -> None:
        self.grams = 0.0
        #: Money, ``None`` until a priced step charged anything.
        self.cost: float | None = None
        self.currency = ""
        self.t_ns: int | None = None
        self.energy_j: float | None = None


class CarbonCounters:
    """Running emissions and cost of a stream's GPUs and windows (see the module docstring).

    Args:
        carbon: The runtime's opened carbon configuration (or what ``Carbon.of`` takes).
        checkpoint_s: Spacing of the host energy timeline windows are weighted with.
        keep_s: How much of that timeline is kept (a longer window is weighted with what is
            left, the rest spread evenly).
    """

    def __init__(self, carbon: Any, *, checkpoint_s: float = 1.0, keep_s: float = 7200.0) -> None:
        opened = Carbon.of(carbon)
        if opened is None:
            raise ValueError("CarbonCounters needs a carbon configuration")
        self.carbon: Carbon = opened
        #: The label value of every series (the configured source's name).
        self.source = opened.name
        self._scale = opened.pue * (1.0 + opened.overhead)
        self._step: _Step | None = None
        self._checkpoint_ns = round(checkpoint_s * _NS)
        self._keep_ns = round(keep_s * _NS)
        self.gpus: dict[tuple[str, int], GpuCharge] = {}
        # host -> checkpoints (t_ns, GPU energy of the host since the first sample).
        self._timelines: dict[str, collections.deque[tuple[int, float]]] = {}
        self._host_energy: dict[str, float] = {}
        self._failed = False

    # -- intensity -------------------------------------------------------------------------

    def _lookup(self, t_ns: int) -> _Step:
        steps = self.carbon.source.steps(t_ns, t_ns)
        step = next((s for s in reversed(steps) if s.start_ns <= t_ns), steps[0])
        cuts = self.carbon.cuts(t_ns, t_ns + _HORIZON_NS)
        until = cuts[0] if cuts else t_ns + _HORIZON_NS
        return _Step(t_ns, until, step.g_per_kwh, step.price_per_kwh, step.currency)

    def _charge(self, charge: GpuCharge, joules: float, t0: int, t1: int) -> bool:
        """Charge ``joules`` drawn over ``[t0, t1]``; whether the step changed."""
        step = self._step
        changed = False
        if step is None or t0 < step.start_ns or t1 > step.until_ns:
            changed = True
            try:
                if step is not None and t0 < step.until_ns < t1:
                    # Straddles a boundary: split there, as footprint() does.
                    fp = self.carbon.spread(joules, t0, t1)
                    self._add(charge, fp.co2e_g, fp.cost, fp.currency)
                    self._step = self._lookup(t1)
                    return True
                step = self._step = self._lookup(t0)
            except Exception as exc:
                if not self._failed:
                    self._failed = True
                    logger.warning("carbon source %s did not answer (%s): those joules are "
                                   "not charged", self.source, exc)  # fmt: skip
                return False
        kwh = joules / J_PER_KWH * self._scale
        cost = None if step.price_per_kwh is None else kwh * step.price_per_kwh
        self._add(charge, kwh * step.g_per_kwh, cost, step.currency)
        return changed

    @staticmethod
    def _add(charge: GpuCharge, grams: float, cost: float | None, currency: str) -> None:
        charge.grams += grams
        if cost is not None:
            charge.cost = (charge.cost or 0.0) + cost
            charge.currency = charge.currency or currency

    # -- the stream --------------------------------------------------------------------------

    def gpu_sample(
        self, host: str, gpu: int, t_ns: int, energy_j: float | None, power_w: float | None
    ) -> None:
        """Charge the energy GPU ``gpu`` of ``host`` drew since its previous sample (its
        counter's difference; power times the interval where it has no counter)."""
        key = (host, gpu)
        charge = self.gpus.get(key)
        if charge is None:
            charge = self.gpus[key] = GpuCharge()
        last_t, last_e = charge.t_ns, charge.energy_j
        charge.t_ns = t_ns
        if energy_j is not None:
            charge.energy_j = energy_j
        if last_t is None or t_ns <= last_t:
            self._checkpoint(host, t_ns, 0.0)
            return
        if energy_j is not None and last_e is not None:
            joules = energy_j - last_e
            if joules < 0:  # the counter went back (driver reload): nothing known
                return
        elif power_w is not None:
            joules = power_w * (t_ns - last_t) / _NS
        else:
            return
        changed = self._charge(charge, joules, last_t, t_ns)
        self._checkpoint(host, t_ns, joules, force=changed)

    def _checkpoint(self, host: str, t_ns: int, joules: float, *, force: bool = False) -> None:
        total = self._host_energy.get(host, 0.0) + joules
        self._host_energy[host] = total
        points = self._timelines.get(host)
        if points is None:
            points = self._timelines[host] = collections.deque()
        if not points or force or t_ns - points[-1][0] >= self._checkpoint_ns:
            if points and t_ns <= points[-1][0]:
                return
            points.append((t_ns, total))
            while len(points) > 2 and t_ns - points[0][0] > self._keep_ns:
                points.popleft()

    def window(self, m: Measurement) -> Footprint | None:
        """The footprint of a finished window's energy (every device it measured), the
        intensity weighted by the host's GPU energy over the window; ``None`` when the source
        cannot answer."""
        energy = sum(joules for _, joules in window_energies(m))
        t0, t1 = m.start_ns, m.end_ns
        points = self._timelines.get(m.host)
        try:
            if points and len(points) >= 2 and t1 > t0:
                times = [t for t, _ in points]
                # The host's energy up to now, beyond the last checkpoint.
                last = self._host_energy.get(m.host, points[-1][1])
                ends = [e for _, e in points]
                if last > ends[-1]:
                    latest = max(c.t_ns or 0 for k, c in self.gpus.items() if k[0] == m.host)
                    if latest > times[-1]:
                        times.append(latest)
                        ends.append(last)
                pieces = [b - a for a, b in itertools.pairwise(ends)]
                timeline = PiecewiseEnergy(times, pieces)
                host = timeline(t0, t1)
                if host > 0:
                    scale = energy / host
                    return self.carbon.between(lambda a, b: timeline(a, b) * scale, t0, t1)
            return self.carbon.spread(energy, t0, t1)
        except Exception as exc:
            if not self._failed:
                self._failed = True
                logger.warning("carbon source %s did not answer (%s)", self.source, exc)
            return None
