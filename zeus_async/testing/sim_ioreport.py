"""A ``zeus_apple_silicon`` stand-in served by the GPU simulator (:mod:`zeus_async.devices.sim`).

Same interface as the ``zeus-apple-silicon`` package (1.1.0) that Zeus 0.16 and
:mod:`zeus_async.devices.apple` use: ``AppleEnergyMonitor()`` (``RuntimeError`` when the
IOReport subscription cannot be made), its ``get_cumulative_energy()``,
``begin_window(key, restart=False)`` (``RuntimeError`` for a key in use) and
``end_window(key)`` (``RuntimeError`` for an unknown key), and ``AppleEnergyMetrics`` with the
library's fields, every one ``None`` unless the chip has that channel, in whole mJ.

What the channels hold (:class:`~zeus_async.devices.sim_config.AppleSim`): GPU 0 of the
simulated node is the chip's GPU; its true energy is split between "GPU Energy" and
"GPU SRAM"; CPU, DRAM and ANE draw ``idle_w + share * GPU power`` each; the CPU's energy is
shared out over its clusters and cores. Each channel is an integer count in the chip's unit
(``AppleSim.unit``) of the energy since the counter origin, as of the last update on a grid of
``update_period_s``; the library turns each count into mJ with an integer division, before
(``get_cumulative_energy``) or after (``end_window``: the delta of two raw samples)
differencing, as ``IOReportCreateSamplesDelta`` does.

Ways to use it:

* ``source = install(config=..., clock=...)`` then ``open_apple_gpus(source=source)`` (what
  ``backend="sim-apple"`` does): ``source`` is this module;
* :func:`shim_env`: environment for a *subprocess* whose ``import zeus_apple_silicon`` must
  get the simulator (``PYTHONPATH`` gains a directory holding a ``zeus_apple_silicon``
  package), with the node configuration in ``ZEUS_ASYNC_SIM``. (Zeus 0.16 also checks
  ``sys.platform == "darwin"`` before it uses the package; a bench must patch that.)

Which node is served: the one :func:`install` made; otherwise the first monitor builds one from
``ZEUS_ASYNC_SIM`` (as an apple node) or the apple preset, on the real clock.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Final

import msgspec

from ..clock import Clock
from ..devices.sim import SIM_ENV_VAR, SimConfig, SimNode
from ..devices.sim_config import sim_config_for, sim_preset

logger = logging.getLogger(__name__)

__all__ = [
    "SHIM_DIR",
    "AppleEnergyMetrics",
    "AppleEnergyMonitor",
    "current_node",
    "install",
    "shim_env",
    "uninstall",
    "zeus_async_platform",
]

#: Marks this module (and the shim) as the simulator, not the real bindings.
__zeus_async_sim__ = True

#: Directory holding a ``zeus_apple_silicon`` package that re-exports this module (put it first
#: on ``PYTHONPATH``).
SHIM_DIR: Final = Path(__file__).resolve().parent / "_ioreport_shim"

_NS: Final = 1_000_000_000
#: nJ in one count of each unit.
_UNIT_NJ: Final = {"mJ": 1_000_000, "uJ": 1_000, "nJ": 1}
_METRIC_FIELDS: Final = (
    "cpu_total_mj",
    "efficiency_cores_mj",
    "performance_cores_mj",
    "efficiency_cluster_mj",
    "performance_cluster_mj",
    "efficiency_core_manager_mj",
    "performance_core_manager_mj",
    "dram_mj",
    "gpu_mj",
    "gpu_sram_mj",
    "ane_mj",
)
#: Share of a cluster's energy its cores get (the rest: the cluster's L2 and fabric).
_CORE_SHARE: Final = 0.9

_lock = threading.RLock()
_node: SimNode | None = None


# -- installation -----------------------------------------------------------------------------


def install(
    node: SimNode | None = None, *, config: SimConfig | None = None, clock: Clock | None = None
) -> ModuleType:
    """Serve ``node`` (or a new node from ``config``, else ``ZEUS_ASYNC_SIM``, else the apple
    preset, on ``clock``); returns this module, the ``source`` for
    :func:`~zeus_async.devices.apple.open_apple_gpus`."""
    global _node
    with _lock:
        if node is None:
            node = SimNode(sim_config_for("apple", config), clock, shared_state=False)
        _node = node
    return sys.modules[__name__]


def uninstall() -> None:
    """Forget the installed node (the next monitor builds one from the environment)."""
    global _node
    with _lock:
        _node = None


def current_node() -> SimNode | None:
    """The node served, if one is installed or was built."""
    return _node


def _serving() -> SimNode:
    global _node
    with _lock:
        if _node is None:
            _node = SimNode(sim_config_for("apple", None), shared_state=False)
        return _node


def shim_env(config: SimConfig | None = None) -> dict[str, str]:
    """``PYTHONPATH`` and ``ZEUS_ASYNC_SIM`` for a subprocess whose ``import
    zeus_apple_silicon`` must get this simulator.

    Merge into the child's environment: ``env={**os.environ, **shim_env(cfg)}``. Without
    ``config``, the installed node's (with its counter origin pinned, so the child counts from
    the same origin), else the apple preset.
    """
    if config is None:
        node = _node
        if node is not None:
            config = msgspec.structs.replace(node.config, counter_origin_ns=node.counter_origin_ns)
        else:
            config = sim_preset("apple")
    path = os.environ.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": str(SHIM_DIR) + (os.pathsep + path if path else ""),
        SIM_ENV_VAR: config.to_json(),
    }


def zeus_async_platform() -> tuple[str, str]:
    """What a Mac's ``sysctl machdep.cpu.brand_string`` and ``gethostuuid`` would say: the
    chip (``AppleSim.chip``) and a host UUID from the seed, marked as simulated
    (``...-515151515151``, like the simulated NVIDIA GPUs' UUIDs)."""
    node = _serving()
    cfg = node.config
    host = node.gpus[0].uuid[4:] if node.gpus else ""
    return f"{cfg.apple.chip} (simulated)", host  # a simulated chip says so in its name


# -- the channels -----------------------------------------------------------------------------


class _Raw:
    """One IOReport sample: every channel's integer count in the chip's unit."""

    __slots__ = ("channels",)

    def __init__(self, channels: dict[str, int | list[int]]) -> None:
        self.channels = channels


def _sample(node: SimNode) -> _Raw:
    """The counts of every channel as of the last update ``<= now``."""
    cfg = node.config
    apple = cfg.apple
    node.spin()
    now = node.now_ns()
    origin = node.counter_origin_ns
    period = max(1, round(apple.update_period_s * _NS))
    b = origin + max(0, now - origin) // period * period
    gpu_j = node.gpus[0].energy_j(origin, b) if node.gpus else 0.0
    span_s = (b - origin) / _NS
    unit_nj = _UNIT_NJ[apple.unit]
    missing = set(apple.missing)

    def count(joules: float) -> int:
        return int(joules * 1e9 + 1e-3) // unit_nj

    cpu_j = apple.cpu_idle_w * span_s + apple.cpu_share * gpu_j
    channels: dict[str, int | list[int]] = {"cpu_total_mj": count(cpu_j)}
    if "gpu" not in missing:
        sram = apple.gpu_sram_frac if "gpu_sram" not in missing else 0.0
        channels["gpu_mj"] = count(gpu_j * (1.0 - sram))
        if "gpu_sram" not in missing:
            channels["gpu_sram_mj"] = count(gpu_j * sram)
    if "dram" not in missing:
        channels["dram_mj"] = count(apple.dram_idle_w * span_s + apple.dram_share * gpu_j)
    if "ane" not in missing:
        channels["ane_mj"] = count(apple.ane_idle_w * span_s + apple.ane_share * gpu_j)
    cores = apple.efficiency_cores + apple.performance_cores
    if "cores" not in missing and cores:
        # One cluster per kind, the CPU's energy shared in proportion to its cores.
        for kind, n in (
            ("efficiency", apple.efficiency_cores),
            ("performance", apple.performance_cores),
        ):
            if not n:
                continue
            cluster_j = cpu_j * n / cores
            channels[f"{kind}_cluster_mj"] = [count(cluster_j)]
            channels[f"{kind}_cores_mj"] = [count(cluster_j * _CORE_SHARE / n)] * n
    return _Raw(channels)


def _to_mj(value: int, unit_nj: int) -> int:
    """The library's conversion: C++ integer division (truncation towards zero)."""
    mj = abs(value) * unit_nj // 1_000_000
    return mj if value >= 0 else -mj


def _metrics(raw: _Raw, unit: str) -> AppleEnergyMetrics:
    unit_nj = _UNIT_NJ[unit]
    out = AppleEnergyMetrics()
    for name, value in raw.channels.items():
        if isinstance(value, list):
            setattr(out, name, [_to_mj(v, unit_nj) for v in value])
        else:
            setattr(out, name, _to_mj(value, unit_nj))
    return out


def _delta(a: _Raw, b: _Raw) -> _Raw:
    out: dict[str, int | list[int]] = {}
    for name, after in b.channels.items():
        before = a.channels.get(name)
        if before is None:
            continue
        if isinstance(after, list) and isinstance(before, list):
            out[name] = [x - y for x, y in zip(after, before, strict=False)]
        elif isinstance(after, int) and isinstance(before, int):
            out[name] = after - before
    return _Raw(out)


# -- the library's classes --------------------------------------------------------------------


class AppleEnergyMetrics:
    """One parsed measurement, in mJ; a field is ``None`` where the chip has no such channel
    (the library's ``AppleEnergyMetrics``)."""

    __slots__ = _METRIC_FIELDS

    cpu_total_mj: int | None
    efficiency_cores_mj: list[int] | None
    performance_cores_mj: list[int] | None
    efficiency_cluster_mj: list[int] | None
    performance_cluster_mj: list[int] | None
    efficiency_core_manager_mj: int | None
    performance_core_manager_mj: int | None
    dram_mj: int | None
    gpu_mj: int | None
    gpu_sram_mj: int | None
    ane_mj: int | None

    def __init__(self) -> None:
        for name in _METRIC_FIELDS:
            setattr(self, name, None)

    def __repr__(self) -> str:
        def show(value: object) -> str:
            if value is None:
                return "None (unavailable)"
            if isinstance(value, list):
                return "  ".join(f"{v} mJ" for v in value)
            return f"{value} mJ"

        labels = (
            ("CPU Total", "cpu_total_mj"),
            ("Efficiency cores", "efficiency_cores_mj"),
            ("Performance cores", "performance_cores_mj"),
            ("Efficiency cluster", "efficiency_cluster_mj"),
            ("Performance cluster", "performance_cluster_mj"),
            ("Efficiency core manager", "efficiency_core_manager_mj"),
            ("Performance core manager", "performance_core_manager_mj"),
            ("DRAM", "dram_mj"),
            ("GPU", "gpu_mj"),
            ("GPU SRAM", "gpu_sram_mj"),
            ("ANE", "ane_mj"),
        )
        return "".join(f"{label}: {show(getattr(self, name))}\n" for label, name in labels)


class AppleEnergyMonitor:
    """An IOReport subscription to the "Energy Model" group (the library's
    ``AppleEnergyMonitor``).

    Raises:
        RuntimeError: The subscription cannot be made (``AppleSim.subscription_fails``).
    """

    def __init__(self) -> None:
        self._node = _serving()
        if self._node.config.apple.subscription_fails:
            raise RuntimeError("Failed to create IOReport subscription.")
        self._unit: str = self._node.config.apple.unit
        self._begin: dict[str, _Raw] = {}

    def get_cumulative_energy(self) -> AppleEnergyMetrics:
        """Every channel's energy since the counter origin, in whole mJ."""
        return _metrics(_sample(self._node), self._unit)

    def begin_window(self, key: str, restart: bool = False) -> None:
        """Start window ``key``; ``RuntimeError`` if it is open, unless ``restart``."""
        if key in self._begin and not restart:
            raise RuntimeError("Measurement with specified key already exists.")
        self._begin[key] = _sample(self._node)

    def end_window(self, key: str) -> AppleEnergyMetrics:
        """The energy of every channel since ``begin_window(key)``, in whole mJ."""
        start = self._begin.pop(key, None)
        if start is None:
            raise RuntimeError("No measurement with provided key had been started.")
        return _metrics(_delta(start, _sample(self._node)), self._unit)
