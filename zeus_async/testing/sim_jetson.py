"""A simulated Jetson sysfs tree (INA3221 rails) served by the GPU simulator (issue 37).

:func:`install` builds a :class:`SimJetsonFs`: a virtual filesystem that answers the small
:class:`~zeus_async.devices.jetson.SysFs` protocol (read a text file, list a directory, test a
path) the Jetson backend reads the real sysfs through, so ``open_jetson_gpus(fs=...)`` runs the
backend's own discovery and reading code on it. Its rail files are computed from the physical
model (:class:`~zeus_async.devices.sim.SimNode`, GPU 0) at read time, as the INA3221 reports
them:

* a reading is the mean power over the last completed conversion cycle
  (``JetsonSim.update_period_s``, on a grid anchored at the node's counter origin) and stays
  the same until the next cycle completes;
* values are integers: mW (``in_power<N>_input``, legacy), mV (bus voltage), mA (current, the
  power divided by the rail's voltage, so V x I is off by at most half a mA times the voltage).

The GPU rail is the model's GPU power; the other rails follow ``JetsonSim.rails``
(``idle_w + dyn_w * u``, ``u`` the GPU's utilization); an input rail (``JetsonSim.input_rail``)
carries all of them plus ``input_overhead_w``. :func:`rail_truth_energy_j` is each rail's exact
energy. Readings carry ``SimConfig.power_noise_w`` of uniform noise, deterministic per
conversion cycle (the truth never does). The layout (``hwmon`` or ``legacy``) is
``JetsonSim.layout``. A GPU lost at
``lost_at_s`` makes its rail files fail with ``ENODEV``.

:func:`write_tree` writes a snapshot of the tree (every file's text at one instant) under a
directory, for tests of the real-filesystem path (``open_jetson_gpus(root=...)``).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..clock import Clock, FakeClock
from ..devices.sim import NS, SimGpu, SimNode
from ..devices.sim_config import JetsonRail, SimConfig, sim_preset
from ..devices.sim_workload import stable_hash

__all__ = [
    "SimJetsonFs",
    "current_fs",
    "install",
    "rail_truth_energy_j",
    "uninstall",
    "write_tree",
]

logger = logging.getLogger(__name__)

_CHANNELS: Final = 3  # per INA3221 chip
_FIRST_ADDRESS: Final = 0x40

_lock = threading.Lock()
_fs: SimJetsonFs | None = None


@dataclass(frozen=True)
class _SimRail:
    """One simulated channel: its label, voltage and what it carries."""

    name: str
    voltage_v: float
    kind: str  # "gpu", "rail" (idle/dyn), "input" (everything + overhead), "nc"
    idle_w: float = 0.0
    dyn_w: float = 0.0


def _rails(config: SimConfig) -> list[_SimRail]:
    """The channels in order: the input rail (if any), the GPU rail, then the others."""
    j = config.jetson
    out: list[_SimRail] = []
    if j.input_rail is not None:
        out.append(_SimRail(j.input_rail, 5.0, "input", idle_w=j.input_overhead_w))
    out.append(_SimRail(j.gpu_rail, j.gpu_voltage_v, "gpu"))
    for r in j.rails:
        kind = "nc" if r.name.upper() in ("NC", "N/C") else "rail"
        out.append(_SimRail(r.name, r.voltage_v, kind, r.idle_w, r.dyn_w))
    while len(out) % _CHANNELS:
        out.append(_SimRail("NC", 5.0, "nc"))
    return out


def _other_energy_j(gpu: SimGpu, rail: JetsonRail | _SimRail, t0_ns: int, t1_ns: int) -> float:
    dt = (t1_ns - t0_ns) / NS
    if dt <= 0:
        return 0.0
    return rail.idle_w * dt + rail.dyn_w * gpu.mean_util(t0_ns, t1_ns) * dt


def _energy_j(node: SimNode, rail: _SimRail, t0_ns: int, t1_ns: int) -> float:
    gpu = node.gpus[0]
    if rail.kind == "gpu":
        return gpu.energy_j(t0_ns, t1_ns)
    if rail.kind == "rail":
        return _other_energy_j(gpu, rail, t0_ns, t1_ns)
    if rail.kind == "input":
        total = gpu.energy_j(t0_ns, t1_ns) + rail.idle_w * (t1_ns - t0_ns) / NS
        for r in node.config.jetson.rails:
            total += _other_energy_j(gpu, r, t0_ns, t1_ns)
        return total
    return 0.0


def rail_truth_energy_j(node: SimNode, rail: str, t0_ns: int, t1_ns: int) -> float:
    """Exact energy (J) of the rail labelled ``rail`` over ``[t0_ns, t1_ns]`` on ``node``;
    ``"module"`` is the sum of every rail (what the module scope reads without an input rail).

    Raises:
        KeyError: No such rail.
    """
    rails = _rails(node.config)
    if rail == "module":
        return sum(_energy_j(node, r, t0_ns, t1_ns) for r in rails)
    for r in rails:
        if r.name == rail:
            return _energy_j(node, r, t0_ns, t1_ns)
    raise KeyError(rail)


class SimJetsonFs:
    """The virtual sysfs of one simulated Jetson module (see the module docstring).

    Args:
        node: The physical model (its GPU 0 is the module's GPU).

    Attributes:
        node: That model.
        config: Its configuration.
    """

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self.config = node.config
        self._files: dict[str, str | Callable[[], str]] = {}
        self._dirs: dict[str, set[str]] = {"/": set()}
        self._period_ns = max(1, round(self.config.jetson.update_period_s * NS))
        self._memo: dict[int, tuple[int, float]] = {}  # channel id -> (grid, mean W)
        self._memo_lock = threading.Lock()
        self._build()

    # -- the tree ---------------------------------------------------------------------------

    def _add(self, path: str, content: str | Callable[[], str]) -> None:
        parts = path.strip("/").split("/")
        parent = "/"
        for part in parts[:-1]:
            child = parent.rstrip("/") + "/" + part
            self._dirs[parent].add(part)
            self._dirs.setdefault(child, set())
            parent = child
        self._dirs[parent].add(parts[-1])
        self._files[path] = content

    def _build(self) -> None:
        cfg, j = self.config, self.config.jetson
        legacy = j.layout == "legacy"
        driver = "/sys/bus/i2c/drivers/" + ("ina3221x" if legacy else "ina3221")
        for name in ("bind", "unbind", "uevent"):
            self._add(f"{driver}/{name}", "")
        rails = _rails(cfg)
        for chip in range(len(rails) // _CHANNELS):
            base = f"{driver}/1-{_FIRST_ADDRESS + chip:04x}"
            self._add(f"{base}/name", "ina3221x\n" if legacy else "ina3221\n")
            if legacy:
                directory = f"{base}/iio:device{chip}"
            else:
                directory = f"{base}/hwmon/hwmon{chip + 1}"
                self._add(f"{directory}/name", "ina3221\n")
            for ch in range(_CHANNELS):
                rid = chip * _CHANNELS + ch
                rail = rails[rid]
                if legacy:
                    self._add(f"{directory}/rail_name_{ch}", f"{rail.name}\n")
                    self._add(f"{directory}/in_power{ch}_input", self._reader(rid, rail, "mw"))
                    self._add(f"{directory}/in_voltage{ch}_input", self._reader(rid, rail, "mv"))
                    self._add(f"{directory}/in_current{ch}_input", self._reader(rid, rail, "ma"))
                else:
                    n = ch + 1
                    self._add(f"{directory}/in{n}_label", f"{rail.name}\n")
                    self._add(f"{directory}/in{n}_enable", "0\n" if rail.kind == "nc" else "1\n")
                    self._add(f"{directory}/in{n}_input", self._reader(rid, rail, "mv"))
                    self._add(f"{directory}/curr{n}_input", self._reader(rid, rail, "ma"))
                    # The shunt-voltage channel (µV): no label, no current; not a rail.
                    self._add(f"{directory}/in{n + 3}_input", self._reader(rid, rail, "shunt"))
        self._add("/etc/nv_tegra_release", "# R36 (release), REVISION: 4.3 (simulated)\n")
        self._add("/proc/device-tree/model", f"{cfg.name} (simulated)\x00")
        serial = f"{stable_hash(cfg.seed, 'jetson-serial') % 10**7:07d}51515151"
        self._add("/sys/firmware/devicetree/base/serial-number", serial + "\x00")
        if j.gpu_load:
            gpu = self.node.gpus[0]
            self._add(
                "/sys/devices/gpu.0/load", self._extra(lambda t: gpu.utilization_pct(t)[0] * 10)
            )
            self._add(
                "/sys/class/devfreq/17000000.gpu/cur_freq",
                self._extra(lambda t: round(gpu.sm_clock_mhz(t)) * 1_000_000),
            )
            self._add("/sys/class/thermal/thermal_zone0/type", "CPU-therm\n")
            self._add("/sys/class/thermal/thermal_zone0/temp", f"{round(cfg.ambient_c * 1000)}\n")
            self._add("/sys/class/thermal/thermal_zone1/type", "GPU-therm\n")
            self._add(
                "/sys/class/thermal/thermal_zone1/temp",
                self._extra(lambda t: round(gpu.temperature_c(t) * 1000)),
            )

    def _extra(self, value: Callable[[int], int]) -> Callable[[], str]:
        def read() -> str:
            t = self.node.now_ns()
            self._check_lost(t)
            return f"{value(t)}\n"

        return read

    def _check_lost(self, t_ns: int) -> None:
        if self.node.gpus[0].is_lost(t_ns):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))

    def _mean_w(self, rid: int, rail: _SimRail, t_ns: int) -> float:
        """Mean power over the last completed conversion cycle before ``t_ns``."""
        origin, period = self.node.counter_origin_ns, self._period_ns
        grid = origin + (t_ns - origin) // period * period
        with self._memo_lock:
            memo = self._memo.get(rid)
            if memo is not None and memo[0] == grid:
                return memo[1]
        watts = _energy_j(self.node, rail, grid - period, grid) * NS / period
        noise = self.config.power_noise_w
        if noise and rail.kind != "nc":  # the sensor's noise: deterministic per reading
            u = stable_hash(self.config.seed, "jetson", rid, grid) / 2.0**64
            watts = max(0.0, watts + noise * (2.0 * u - 1.0))
        with self._memo_lock:
            self._memo[rid] = (grid, watts)
        return watts

    def _reader(self, rid: int, rail: _SimRail, unit: str) -> Callable[[], str]:
        mv = round(rail.voltage_v * 1000)

        def read() -> str:
            t = self.node.now_ns()
            if rail.kind != "nc":
                self._check_lost(t)
            watts = 0.0 if rail.kind == "nc" else self._mean_w(rid, rail, t)
            if unit == "mw":
                value = round(watts * 1000)
            elif unit == "mv":
                value = mv if rail.kind != "nc" else 0
            elif unit == "ma":
                value = round(watts * 1e6 / mv)
            else:  # shunt voltage, µV, across a 5 mΩ shunt
                value = round(watts / rail.voltage_v * 0.005 * 1e6)
            return f"{value}\n"

        return read

    # -- the SysFs protocol -----------------------------------------------------------------

    def read_text(self, path: str) -> str:
        content = self._files.get(path)
        if content is None:
            if path.rstrip("/") in self._dirs or path == "/":
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return content() if callable(content) else content

    def listdir(self, path: str) -> list[str]:
        key = path.rstrip("/") or "/"
        entries = self._dirs.get(key)
        if entries is None:
            if key in self._files:
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return sorted(entries)

    def exists(self, path: str) -> bool:
        key = path.rstrip("/") or "/"
        return key in self._files or key in self._dirs

    def paths(self) -> list[str]:
        """Every file's path."""
        return sorted(self._files)

    def snapshot(self, root: str | Path) -> Path:
        """Write every file's text as of now under ``root`` (standing for ``/``)."""
        base = Path(root)
        for path in self._files:
            target = base / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(self.read_text(path))
        return base

    def __repr__(self) -> str:
        return f"SimJetsonFs({self.config.name!r}, {self.config.jetson.layout})"


def install(
    node: SimNode | None = None, *, config: SimConfig | None = None, clock: Clock | None = None
) -> SimJetsonFs:
    """Serve ``node`` (or a new node from ``config``, else the ``jetson`` preset, on
    ``clock``) as a Jetson sysfs tree; it becomes :func:`current_fs`.

    The node keeps its settings in the process (``shared_state=False``): a Jetson has nothing
    the backend sets.
    """
    global _fs
    if node is None:
        node = SimNode(config or sim_preset("jetson"), clock, shared_state=False)
    fs = SimJetsonFs(node)
    with _lock:
        _fs = fs
    return fs


def current_fs() -> SimJetsonFs | None:
    """The tree :func:`install` made last, if any."""
    return _fs


def uninstall() -> None:
    """Forget the installed tree."""
    global _fs
    with _lock:
        _fs = None


def write_tree(
    root: str | Path,
    config: SimConfig | None = None,
    *,
    at_ns: int = 1_760_000_000 * NS,
) -> SimJetsonFs:
    """Write a static snapshot of a simulated Jetson's sysfs (``config``, default the
    ``jetson`` preset) as of wall time ``at_ns`` under ``root``; returns the tree it came from
    (its node on a clock stopped at ``at_ns``)."""
    node = SimNode(
        config or sim_preset("jetson"), FakeClock(wall_start_ns=at_ns), shared_state=False
    )
    fs = SimJetsonFs(node)
    fs.snapshot(root)
    return fs
