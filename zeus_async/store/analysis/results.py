"""What an analysis returns: series of values, per-device and per-process totals.

:class:`Series` (one metric of one device), :class:`DeviceTotal`, :class:`ProcessTotal` and
:class:`Totals` (:meth:`~zeus_async.store.analysis.Recording.totals`): plain values, holding
no reference to the recording they come from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ...carbon import Footprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Series:
    """Values of one metric of one device, in file order (time order for one recorder).

    Series compare by identity (their arrays have no single truth value); compare
    ``t_ns``/``values`` with ``numpy.array_equal``.

    Attributes:
        metric: ``"<kind>.<field>"``.
        device: Device key.
        t_ns: Time of each value (wall-clock ns), an ``int64`` array.
        values: The values, a ``float64`` array (samples where the field was ``None`` are left
            out).
        start_ns: Start of the recording, the origin of :meth:`seconds`.
    """

    metric: str
    device: str
    t_ns: npt.NDArray[np.int64]
    values: npt.NDArray[np.float64]
    start_ns: int

    def seconds(self) -> npt.NDArray[np.float64]:
        """Time of each value in seconds since the start of the recording."""
        return (self.t_ns - self.start_ns) / 1e9

    def __len__(self) -> int:
        return len(self.t_ns)


@dataclass(frozen=True)
class DeviceTotal:
    """Energy of one device over its whole span in the recording.

    Attributes:
        device: Device key.
        energy_j: Joules, or ``None`` when the device's data cannot give it.
        method: How it was obtained (the :class:`DeviceHistory` method: ``counter+interpolated``,
            ``counter+extrapolated``, ``integrated``, ``unavailable``).
        start_ns: First sample of the device.
        end_ns: Last sample of the device.
        duration_s: ``end_ns - start_ns`` in seconds.
        mean_power_w: ``energy_j / duration_s``, or ``None`` (no energy or zero duration).
    """

    device: str
    energy_j: float | None
    method: str
    start_ns: int
    end_ns: int
    duration_s: float
    mean_power_w: float | None


@dataclass(frozen=True)
class ProcessTotal:
    """Attributed energy of one tracked process over the recording (from its
    :class:`~zeus_async.events.ProcessSample` running totals).

    Attributes:
        pid: Process id (with ``@host`` appended in multi-host recordings, as device keys are).
        cpu_energy_j: Share of the RAPL package energy, or ``None`` without RAPL.
        dram_energy_j: Share of the RAPL DRAM energy, or ``None`` without a DRAM domain.
        gpu_energy_j: GPU index to the energy attributed on that GPU.
        start_ns: First sample of the process.
        end_ns: Last sample of the process.
        duration_s: ``end_ns - start_ns`` in seconds.
    """

    pid: str
    cpu_energy_j: float | None
    dram_energy_j: float | None
    gpu_energy_j: dict[int, float]
    start_ns: int
    end_ns: int
    duration_s: float

    @property
    def total_energy_j(self) -> float:
        """CPU + DRAM + every GPU."""
        return (
            (self.cpu_energy_j or 0.0)
            + (self.dram_energy_j or 0.0)
            + sum(self.gpu_energy_j.values())
        )


@dataclass(frozen=True)
class Totals:
    """Per-device and experiment totals of a recording (see :meth:`Recording.totals`).

    Attributes:
        devices: Device key to its :class:`DeviceTotal`, for every GPU and RAPL domain.
        gpu_energy_j: Sum over GPUs.
        cpu_energy_j: Sum over the RAPL ``package`` domains, or ``None`` without any.
        dram_energy_j: Sum over the RAPL ``dram`` domains, or ``None`` without any.
        total_energy_j: GPU + CPU + DRAM (the ``core``/``uncore`` domains lie inside
            ``package`` and ``psys`` contains it, so they are not added).
        duration_s: Duration of the recording.
        processes: Per tracked process, its attributed energy (empty without process
            tracking).
        process_cpu_energy_j, process_dram_energy_j, process_gpu_energy_j: The experiment's
            share: sums over the tracked processes (``None`` when nothing was attributed).
    """

    devices: dict[str, DeviceTotal]
    gpu_energy_j: float
    cpu_energy_j: float | None
    dram_energy_j: float | None
    total_energy_j: float
    duration_s: float
    processes: dict[str, ProcessTotal] = field(default_factory=dict)
    process_cpu_energy_j: float | None = None
    process_dram_energy_j: float | None = None
    process_gpu_energy_j: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of everything here."""
        return {
            "devices": {k: dict(vars(v)) for k, v in self.devices.items()},
            "gpu_energy_j": self.gpu_energy_j,
            "cpu_energy_j": self.cpu_energy_j,
            "dram_energy_j": self.dram_energy_j,
            "total_energy_j": self.total_energy_j,
            "duration_s": self.duration_s,
            "processes": {
                k: {**vars(v), "total_energy_j": v.total_energy_j}
                for k, v in self.processes.items()
            },
            "process_cpu_energy_j": self.process_cpu_energy_j,
            "process_dram_energy_j": self.process_dram_energy_j,
            "process_gpu_energy_j": self.process_gpu_energy_j,
        }


@dataclass(frozen=True)
class Emissions:
    """Emissions and cost of a recording (see :meth:`Recording.emissions`): a
    :class:`~zeus_async.carbon.Footprint` per GPU and RAPL domain, and their sums.

    Attributes:
        devices: Device key to its footprint over its samples inside the interval.
        gpu: Sum over GPUs (``None`` without any).
        cpu: Sum over the RAPL ``package`` domains (``None`` without any).
        dram: Sum over the RAPL ``dram`` domains (``None`` without any).
        total: GPU + CPU + DRAM (the ``core``/``uncore``/``psys`` domains are not added, as in
            :class:`Totals`); ``None`` when nothing had energy there.
        t0_ns, t1_ns: The interval asked for (the recording's span by default).
    """

    devices: dict[str, Footprint]
    gpu: Footprint | None
    cpu: Footprint | None
    dram: Footprint | None
    total: Footprint | None
    t0_ns: int
    t1_ns: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of everything here."""
        import msgspec

        def one(fp: Footprint | None) -> dict[str, Any] | None:
            return None if fp is None else msgspec.structs.asdict(fp)

        return {
            "devices": {k: one(v) for k, v in self.devices.items()},
            "gpu": one(self.gpu),
            "cpu": one(self.cpu),
            "dram": one(self.dram),
            "total": one(self.total),
            "t0_ns": self.t0_ns,
            "t1_ns": self.t1_ns,
        }
