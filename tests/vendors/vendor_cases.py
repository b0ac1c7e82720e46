"""Each GPU vendor on its simulator, beneath its real API (issue 37).

The ``vendor`` fixture (``conftest.py``) runs a test once per vendor (``nvidia``, ``amd``,
``jetson``, ``apple``) and gets a :class:`VendorCase`: the backend that serves it (``sim``,
``sim-amd``, ...), its preset (:func:`~zeus_async.devices.sim_config.sim_preset`) and what its
devices can do. A pending vendor whose simulated backend does not open and sample yet is
skipped, with the reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from zeus_async.devices.sim_config import SimConfig, sim_preset

VENDORS = ("nvidia", "amd", "jetson", "apple")
T0 = 1_760_000_000_000_000_000


@dataclass(frozen=True)
class VendorCase:
    """One vendor on its simulator, and what its devices say and can do."""

    vendor: str
    #: The backend serving it (``sim`` is NVIDIA's, beneath ``pynvml``).
    backend: str
    #: ``DeviceInfo.vendor`` of its GPUs.
    device_vendor: str
    #: A hardware energy counter (``DeviceInfo.energy_method == "counter"``).
    energy_counter: bool
    #: Power limit / power cap settable (``Capabilities.power_cap``).
    power_cap: bool
    #: GPUs in the preset (a Jetson module and an Apple chip have one).
    num_gpus: int
    #: What one window edge can get wrong, in seconds of the power swing: the counter's
    #: update period (NVIDIA: 100 ms), else the sampling period (10 ms) a 1 ms counter is read
    #: at (AMD) or an Apple counter's 10 ms, or a Jetson rail's cycle plus a sampling period.
    edge_s: float

    def config(self, **overrides: object) -> SimConfig:
        """This vendor's preset with ``overrides``."""
        return sim_preset(self.vendor, **overrides)

    def __str__(self) -> str:
        return self.vendor


CASES: dict[str, VendorCase] = {
    "nvidia": VendorCase("nvidia", "sim", "nvidia", True, True, 4, 0.1),
    "amd": VendorCase("amd", "sim-amd", "amd", True, True, 4, 0.01),
    "jetson": VendorCase("jetson", "sim-jetson", "nvidia-jetson", False, False, 1, 0.0166),
    "apple": VendorCase("apple", "sim-apple", "apple", True, False, 1, 0.01),
}

#: Vendors whose backends were being finished when these tests were written: skipped (with the
#: reason) while their simulated backend does not open and sample; they run once it does.
PENDING = ("jetson", "apple")


@functools.cache
def not_ready(vendor: str) -> str | None:
    """Why ``vendor``'s simulated backend cannot be tested yet (``None``: it can)."""
    from zeus_async.clock import FakeClock
    from zeus_async.devices import open_devices

    case = CASES[vendor]
    try:
        opened = open_devices(
            case.backend, cpus=None, clock=FakeClock(wall_start_ns=T0), sim_config=case.config()
        )
        try:
            for gpu in opened.gpus:
                gpu.describe()
                gpu.read(gpu.fields, "probe", T0)
        finally:
            for gpu in opened.gpus:
                gpu.close()
    except Exception as exc:
        return f"backend {case.backend} not ready yet ({type(exc).__name__}: {exc})"
    return None
