"""Energy figures with what their edges leave open, and a window's measurement built from them.

:class:`EnergyEstimate` is what every estimator of
:class:`~zeus_async.aggregate.history.DeviceHistory` returns; :func:`window_measurement` turns
one figure per device into a window's :class:`~zeus_async.events.Measurement` (the exact
figures of :mod:`.windows`, the provisional ones of :mod:`.board`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..events import Measurement

__all__ = ["EnergyEstimate", "window_measurement"]

logger = logging.getLogger(__name__)


class EnergyEstimate:
    """Energy over an interval, how it was obtained, and what its edges leave uncertain.

    ``error_j`` (windows only; 0 elsewhere) bounds what the data around the interval's two
    edges leaves open, assuming power moves monotonically between two readings: an edge
    between readings ``p_a`` and ``p_b`` contributes ``|p_b - p_a|`` times the part of their
    gap inside the interval; an edge past the last reading, that reading's power times the
    stretch extrapolated; an edge inside counter periods whose update instants are unknown
    (late samples, see :meth:`DeviceHistory.energy`), the difference between splitting their
    energy by time and by power. Exact counter periods between the edges add nothing.
    """

    __slots__ = ("energy_j", "error_j", "method")

    def __init__(self, energy_j: float | None, method: str, error_j: float = 0.0) -> None:
        self.energy_j = energy_j
        self.method = method
        self.error_j = error_j

    def __repr__(self) -> str:
        return f"EnergyEstimate({self.energy_j!r}, {self.method!r}, error_j={self.error_j!r})"


def window_measurement(
    *,
    host: str,
    t_ns: int,
    name: str,
    window_id: int,
    start_ns: int,
    end_ns: int,
    figures: Mapping[str, EnergyEstimate],
    lost: list[str] | None = None,
) -> Measurement:
    """A window's :class:`~zeus_async.events.Measurement` from one figure per device key
    (``gpu:0``, ``cpu:0/package``, ``cpu:0/dram``): a GPU's method is kept even without a
    figure (``unavailable``); a CPU domain without one is left out."""
    gpu: dict[int, float] = {}
    cpu: dict[int, float] = {}
    dram: dict[int, float] = {}
    methods: dict[str, str] = {}
    errors: dict[str, float] = {}
    for key, estimate in figures.items():
        energy = estimate.energy_j
        if key.startswith("gpu:"):
            methods[key] = estimate.method
            if energy is not None:
                gpu[int(key[4:])] = energy
        elif energy is not None:
            package, _, domain = key.partition("/")
            (cpu if domain == "package" else dram)[int(package[4:])] = energy
            methods[key] = estimate.method
        if energy is not None:
            errors[key] = estimate.error_j
    return Measurement(
        host=host,
        t_ns=t_ns,
        name=name,
        window_id=window_id,
        start_ns=start_ns,
        end_ns=end_ns,
        time_s=(end_ns - start_ns) / 1e9,
        gpu_energy_j=gpu,
        cpu_energy_j=cpu or None,
        dram_energy_j=dram or None,
        methods=methods,
        lost=lost or [],
        error_j=errors,
    )
