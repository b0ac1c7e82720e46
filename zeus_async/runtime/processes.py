"""Per-process metrics: CPU, memory and attributed CPU/DRAM/GPU power of tracked pids.

A :class:`ProcessSampler` runs beside the device samplers of a :class:`~.runtime.Runtime`
(``Runtime(processes=ProcessTracking(...))``). Every ``period_s`` (1 s by default) it reads the
tracked processes (psutil, :mod:`zeus_async.devices.processes`) and the per-process view of each
GPU (NVML, :meth:`~zeus_async.devices.base.GpuProcessReader.read_processes`), and publishes
:class:`~zeus_async.events.ProcessSample` events: one per pid, and one per (pid, GPU) the pid
runs on.

Attribution (the arithmetic lives in :class:`ProcessAttributor`, a pure function of its inputs):

* **CPU**: a pid's share of the period's CPU work is its CPU seconds over the busy CPU seconds
  of the whole machine; its CPU power is that share * the RAPL ``package`` power (all
  packages), and its CPU energy the share * the package energy of the period.
* **DRAM**: PSS (RSS when PSS is unknown) over the memory in use, * the RAPL ``dram`` power.
* **GPU**: a pid's share of a GPU's power is its SM utilization over the SM utilization of
  *every* process on that GPU (tracked or not). On a busy GPU (some process ran a kernel in
  the period) the whole power, idle floor included, goes to the processes that used the SMs:
  the floor is what keeping the GPU up for their work costs, and a process at 0 % SM gets 0 W
  however much memory it holds. When no process ran a kernel in the period, the (idle) power
  is split by device memory held, or equally when the driver does not report the memory of
  every process. Either way the shares of the processes on a GPU add up to at most 1 in every
  period (exactly 1 when every process on it is tracked).
* **GPU power and energy**: ``attributed_power_w`` is the share * the GPU's *reported* power
  over the period: its power samples (``gpu.power_w``), each held until the next, averaged over
  the period. It is the figure the GPU's own power is shown with, so a process's power, and the
  sum over the processes on a GPU, never exceed what that GPU is seen drawing. (The energy
  counter's increase over the time between two reads cannot be used for it: the counter
  refreshes on its own cadence, 100 ms on H100s, while the reads are stamped when made, so a
  period of 50 ms, or the sparse reads of adaptive sampling, put up to several refreshes' worth
  of energy over a short read-to-read time: an idle 69 W GPU came out at 316 W.)
  ``attributed_energy_j`` adds the share * the energy counter's increase over the period (or
  the integrated power samples where a GPU has no counter), so the energies of all processes
  on a GPU add up to its counter energy. Where a GPU reports no power samples, the power is
  the counter's increase over the time between the reads that first saw each of its values
  (the times it refreshed, to a tick).

Device power comes from the runtime's own samples (a hub sink keeps each device's running
energy), so attribution costs no extra device reads and uses the same figures as windows.

The tracked set is, by default, the runtime's process and its descendants (refreshed every
``rescan_s``, since listing descendants scans every process of the machine), or an explicit pid
list; ``gpu_all=True`` adds every process found on the sampled GPUs (the machine-wide view).
Pids that exit are dropped (their last cumulative energies stay in the recording).

Given a ``workload_of`` callable (a node agent passes its workload resolver's, see
:mod:`zeus_async.agent.workloads`), every sample names the workload its pid works for
(``ProcessSample.workload``: ``slurm:4711``, ``k8s:<ns>/<pod>/<container>``, ``uid:1001``):
asked once per pid per period, off the event loop, with the GPUs the pid was seen on.

NVML reports host pids: inside a container with its own pid namespace the pids it lists do not
match the container's, so GPU attribution finds no tracked pid there unless the container
shares the host pid namespace (``--pid=host``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

import anyio
import msgspec
from anyio.abc import TaskStatus

from ..clock import Clock
from ..devices.base import GpuProcesses, GpuProcessReader
from ..devices.processes import HostStat, ProcessSource, ProcessStat
from ..errors import ConfigError, DeviceError, NotSupportedError
from ..events import Event, GpuSample, ProcessSample, RaplSample
from .hub import Hub

__all__ = [
    "POWER_HOLD_NS",
    "EnergyMeter",
    "ProcessAttributor",
    "ProcessSampler",
    "ProcessTracking",
    "WorkloadOf",
]

logger = logging.getLogger(__name__)

#: Which workload a process works for: ``workload_of(pid, gpus)`` with the GPUs (indices) the
#: process was seen on in this period, answering the workload's key (``slurm:4711``,
#: ``uid:1001``...; ``""`` when unknown). A node agent passes its resolver's
#: (:meth:`zeus_async.agent.workloads.WorkloadResolver.for_pid`).
WorkloadOf = Callable[[int, Sequence[int]], str]


class ProcessTracking(msgspec.Struct, frozen=True, kw_only=True):
    """Which processes to track, and how often.

    Attributes:
        pids: Exactly these pids; ``None`` = ``root`` and (with ``children``) its descendants.
        root: The process whose tree is tracked; ``None`` = the process running the runtime.
        children: Track ``root``'s descendants too (refreshed every ``rescan_s``).
        exclude: Pids never tracked (a monitor's own sampler process, for instance).
        gpu_all: Also track every process found on the sampled GPUs.
        period_s: Sampling period (seconds).
        rescan_s: How often the descendants of ``root`` are listed again (seconds).
        smaps_s: How often PSS and USS are read (seconds); between reads the last values are
            reported. Reading them makes the kernel walk each process's page tables (~0.1 ms
            a process), the largest cost of a tick; RSS and CPU time are read every period.
    """

    pids: tuple[int, ...] | None = None
    root: int | None = None
    children: bool = True
    exclude: tuple[int, ...] = ()
    gpu_all: bool = False
    period_s: float = 1.0
    rescan_s: float = 5.0
    smaps_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.period_s > 0:
            raise ConfigError(f"process period_s must be positive, got {self.period_s!r}")
        if not self.rescan_s > 0:
            raise ConfigError(f"process rescan_s must be positive, got {self.rescan_s!r}")
        if not self.smaps_s > 0:
            raise ConfigError(f"process smaps_s must be positive, got {self.smaps_s!r}")
        bad = [p for p in (*(self.pids or ()), *self.exclude) if p <= 0]
        if self.root is not None and self.root <= 0:
            bad.append(self.root)
        if bad:
            raise ConfigError(f"pids must be positive integers, got {bad}")


# Energy-meter keys: ("gpu", index), ("gpu_power", index), ("gpu_watts", index),
# ("package", package), ("dram", package).
MeterKey = tuple[str, int]
EnergyReading = tuple[int, float]  # (t_ns of the latest sample, running energy in J)


class EnergyMeter:
    """A hub sink keeping each device's running energy, for attribution.

    GPUs, ``("gpu", index)``: the energy counter when the samples have one, stamped with the
    time of the sample that first showed each value (the counter refreshes on its own cadence:
    a later read of the same value says nothing new about when that energy was spent); else
    the power samples integrated. ``("gpu_power", index)``: the power samples integrated, each
    sample's power held until the next (the GPU's reported power, for attributed power);
    ``("gpu_watts", index)``: the latest power sample, ``(t_ns, W)``. RAPL:
    the ``package`` and ``dram`` domains' unwrapped energy. :meth:`snapshot` is called on the
    event-loop thread, like :meth:`add`.
    """

    __slots__ = ("_counted", "_gpu_power", "_readings")

    def __init__(self) -> None:
        self._readings: dict[MeterKey, EnergyReading] = {}
        self._counted: set[int] = set()  # GPUs whose samples carry the energy counter
        self._gpu_power: dict[int, tuple[int, float]] = {}  # gpu -> (t_ns, W) for integration

    def add(self, event: Event) -> None:
        if isinstance(event, GpuSample):
            gpu = event.gpu
            if event.power_w is not None:
                self._integrate(gpu, event.t_ns, event.power_w)
            if event.energy_j is not None:
                key = ("gpu", gpu)
                last = self._readings.get(key)
                if gpu not in self._counted or last is None or event.energy_j != last[1]:
                    self._readings[key] = (event.t_ns, event.energy_j)
                self._counted.add(gpu)
            elif gpu not in self._counted and ("gpu_power", gpu) in self._readings:
                self._readings[("gpu", gpu)] = self._readings[("gpu_power", gpu)]
        elif isinstance(event, RaplSample) and event.domain in ("package", "dram"):
            self._readings[(event.domain, event.package)] = (event.t_ns, event.energy_j)

    def _integrate(self, gpu: int, t_ns: int, power_w: float) -> None:
        key = ("gpu_power", gpu)
        previous = self._gpu_power.get(gpu)
        if previous is not None and t_ns <= previous[0]:
            return  # a duplicate or late sample: the integral has moved past it
        reading = self._readings.get(key)
        energy = reading[1] if reading is not None else 0.0
        if previous is not None:
            energy += previous[1] * (t_ns - previous[0]) / 1e9
        self._readings[key] = (t_ns, energy)
        self._readings[("gpu_watts", gpu)] = self._gpu_power[gpu] = (t_ns, power_w)

    def snapshot(self) -> dict[MeterKey, EnergyReading]:
        """Every device's latest ``(t_ns, energy_j)``."""
        return dict(self._readings)


class _Delta:
    """Energy and mean power of one meter key over a period (``None``: unknown)."""

    __slots__ = ("energy_j", "power_w")

    def __init__(self, energy_j: float, power_w: float) -> None:
        self.energy_j = energy_j
        self.power_w = power_w


def _deltas(
    previous: Mapping[MeterKey, EnergyReading], current: Mapping[MeterKey, EnergyReading]
) -> dict[MeterKey, _Delta]:
    out: dict[MeterKey, _Delta] = {}
    for key, (t1, e1) in current.items():
        if key[0] == "gpu_watts":
            continue  # a power, not a running total
        before = previous.get(key)
        if before is None or t1 <= before[0]:
            continue
        t0, e0 = before
        energy = max(e1 - e0, 0.0)
        out[key] = _Delta(energy, energy * 1e9 / (t1 - t0))
    return out


def _sum_kind(deltas: Mapping[MeterKey, _Delta], kind: str) -> _Delta | None:
    parts = [d for (k, _), d in deltas.items() if k == kind]
    if not parts:
        return None
    return _Delta(sum(d.energy_j for d in parts), sum(d.power_w for d in parts))


def _clamp(value: float) -> float:
    return min(max(value, 0.0), 1.0)


class _PidState:
    __slots__ = ("cpu_energy_j", "cpu_s", "dram_energy_j", "t_ns")

    def __init__(self, t_ns: int, cpu_s: float) -> None:
        self.t_ns = t_ns
        self.cpu_s = cpu_s
        self.cpu_energy_j = 0.0
        self.dram_energy_j = 0.0


#: How long after its last power sample a GPU's power is held for attribution (ns): past it,
#: a GPU no longer sampled has no attributed power rather than a stale one.
POWER_HOLD_NS = 1_000_000_000


class ProcessAttributor:
    """Turns successive readings into :class:`ProcessSample` events (pure arithmetic, no I/O).

    Call :meth:`tick` once per period with that period's readings; it keeps what it needs from
    one tick to the next (previous counters, running energies).
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self._host_stat: HostStat | None = None
        self._meter: dict[MeterKey, EnergyReading] = {}
        self._pids: dict[int, _PidState] = {}
        self._pairs: dict[tuple[int, int], float] = {}  # (pid, gpu) -> attributed energy (J)

    def tick(
        self,
        t_ns: int,
        host: HostStat,
        procs: Mapping[int, ProcessStat],
        gpus: Mapping[int, GpuProcesses],
        tracked: Sequence[int] | set[int],
        meter: Mapping[MeterKey, EnergyReading],
    ) -> list[ProcessSample]:
        """One period's samples.

        Args:
            t_ns: Wall-clock time of the readings.
            host: Machine-wide counters now.
            procs: Counters of each tracked pid that still exists.
            gpus: Per-process view of each GPU (by index) in this period.
            tracked: The tracked pids (those on a GPU get a per-GPU sample even when their
                host-side counters are unreadable).
            meter: :meth:`EnergyMeter.snapshot` now.

        Returns:
            Host-side samples (pid order), then per-GPU samples (GPU, then pid order).
        """
        deltas = _deltas(self._meter, meter)
        package = _sum_kind(deltas, "package")
        dram = _sum_kind(deltas, "dram")
        has_package = any(k == "package" for k, _ in meter)
        has_dram = any(k == "dram" for k, _ in meter)
        busy = host.cpu_busy_s - self._host_stat.cpu_busy_s if self._host_stat is not None else None
        out: list[ProcessSample] = []
        for pid in sorted(procs):
            stat = procs[pid]
            out.append(
                self._host_sample(t_ns, pid, stat, host, busy, package, dram, has_package, has_dram)
            )
        tracked_set = set(tracked)
        for gpu in sorted(gpus):
            out.extend(
                self._gpu_samples(
                    t_ns,
                    gpu,
                    gpus[gpu],
                    tracked_set,
                    deltas.get(("gpu", gpu)),
                    self._gpu_power_w(t_ns, gpu, deltas, meter),
                    ("gpu", gpu) in meter,
                )
            )
        for pid in set(self._pids) - set(procs):
            del self._pids[pid]
        live_pairs = {(s.pid, s.gpu) for s in out if s.gpu is not None}
        for pair in set(self._pairs) - live_pairs:
            del self._pairs[pair]
        self._host_stat = host
        self._meter = dict(meter)
        return out

    def _gpu_power_w(
        self,
        t_ns: int,
        gpu: int,
        deltas: Mapping[MeterKey, _Delta],
        meter: Mapping[MeterKey, EnergyReading],
    ) -> float | None:
        """The GPU's power over the period: its power samples averaged (each held until the
        next); its last sample's when no newer one came in this period (adaptive reads skip
        only reads that would repeat the value), up to :data:`POWER_HOLD_NS` after it; the
        energy counter's where the GPU reports no power."""
        reading = meter.get(("gpu_power", gpu))
        if reading is None:
            counter = deltas.get(("gpu", gpu))
            return counter.power_w if counter is not None else None
        power = deltas.get(("gpu_power", gpu))
        if power is not None:
            return power.power_w
        last = meter.get(("gpu_watts", gpu))
        if last is not None and t_ns - last[0] <= POWER_HOLD_NS:
            return last[1]
        return None

    def _host_sample(
        self,
        t_ns: int,
        pid: int,
        stat: ProcessStat,
        host: HostStat,
        busy_s: float | None,
        package: _Delta | None,
        dram: _Delta | None,
        has_package: bool,
        has_dram: bool,
    ) -> ProcessSample:
        memory = stat.pss_bytes if stat.pss_bytes is not None else stat.rss_bytes
        memory_frac = (
            _clamp(memory / host.memory_total_bytes)
            if memory is not None and host.memory_total_bytes > 0
            else None
        )
        state = self._pids.get(pid)
        sample = ProcessSample(
            self.host,
            t_ns,
            pid,
            memory_rss_bytes=stat.rss_bytes,
            memory_pss_bytes=stat.pss_bytes,
            memory_uss_bytes=stat.uss_bytes,
            memory_frac=memory_frac,
            cpu_energy_j=0.0 if has_package else None,
            dram_energy_j=0.0 if has_dram else None,
        )
        if state is None or t_ns <= state.t_ns:
            if state is None:
                self._pids[pid] = _PidState(t_ns, stat.cpu_s)
            return sample
        used = max(stat.cpu_s - state.cpu_s, 0.0)
        wall = (t_ns - state.t_ns) / 1e9
        sample.cpu_frac = _clamp(used / (wall * max(host.cpu_count, 1)))
        share = _clamp(used / busy_s) if busy_s is not None and busy_s > 0 else 0.0
        sample.cpu_share_frac = share
        if package is not None:
            state.cpu_energy_j += share * package.energy_j
            sample.cpu_power_w = share * package.power_w
        if dram is not None and memory is not None and host.memory_used_bytes > 0:
            mem_share = _clamp(memory / host.memory_used_bytes)
            state.dram_energy_j += mem_share * dram.energy_j
            sample.dram_power_w = mem_share * dram.power_w
        if has_package:
            sample.cpu_energy_j = state.cpu_energy_j
        if has_dram:
            sample.dram_energy_j = state.dram_energy_j
        state.t_ns = t_ns
        state.cpu_s = stat.cpu_s
        return sample

    def _gpu_samples(
        self,
        t_ns: int,
        gpu: int,
        reading: GpuProcesses,
        tracked: set[int],
        delta: _Delta | None,
        gpu_power_w: float | None,
        has_energy: bool,
    ) -> list[ProcessSample]:
        """Samples of the tracked pids on one GPU. ``delta``: the GPU's energy over the period
        (counter); ``gpu_power_w``: its power over the period (:meth:`_gpu_power_w`)."""
        present = set(reading.memory_bytes) | set(reading.sm_frac)
        mine = sorted(present & tracked)
        if not mine:
            return []
        sm_all = sum(reading.sm_frac.get(p, 0.0) for p in present)
        sm_mine = sum(reading.sm_frac.get(p, 0.0) for p in mine)
        mem_all_known = [reading.memory_bytes.get(p) for p in present]
        mem_all = sum(m for m in mem_all_known if m is not None)
        # Split by memory only when every process's is known: one process without a figure
        # would otherwise get an equal share on top of shares that already add up to 1.
        by_memory = mem_all > 0 and all(m is not None for m in mem_all_known)
        mem_mine_known = [reading.memory_bytes.get(p) for p in mine]
        mem_mine = sum(m for m in mem_mine_known if m is not None)
        out: list[ProcessSample] = []
        for pid in mine:
            sm = reading.sm_frac.get(pid, 0.0)
            mem = reading.memory_bytes.get(pid)
            if sm_all > 0:
                power_share = sm / sm_all
            elif by_memory:
                power_share = (mem or 0) / mem_all
            else:
                power_share = 1.0 / len(present)
            power_share = _clamp(power_share)
            sample = ProcessSample(
                self.host,
                t_ns,
                pid,
                gpu=gpu,
                gpu_sm_frac=_clamp(sm),
                gpu_memory_bytes=mem,
                gpu_sm_share_frac=sm / sm_mine if sm_mine > 0 else None,
                gpu_memory_share_frac=(
                    mem / mem_mine if mem is not None and mem_mine > 0 else None
                ),
                gpu_power_share_frac=power_share,
            )
            key = (pid, gpu)
            energy = self._pairs.get(key)
            if energy is None:
                self._pairs[key] = 0.0
                sample.attributed_energy_j = 0.0 if has_energy else None
            else:
                if delta is not None:
                    energy += power_share * delta.energy_j
                    self._pairs[key] = energy
                if gpu_power_w is not None:
                    sample.attributed_power_w = power_share * gpu_power_w
                sample.attributed_energy_j = energy if has_energy else None
            out.append(sample)
        return out


class ProcessSamplerStats:
    """Counters of a :class:`ProcessSampler` (CPU cost included, for the benchmarks)."""

    __slots__ = ("cpu_ns", "errors", "events", "ticks")

    def __init__(self) -> None:
        self.ticks = 0
        self.events = 0
        self.errors = 0
        self.cpu_ns = 0  # thread CPU time spent in ticks


class ProcessSampler:
    """Samples tracked processes every ``tracking.period_s`` and publishes their samples.

    Args:
        tracking: What to track.
        source: Host-side readings (:class:`~zeus_async.devices.processes.PsutilSource`).
        gpus: GPUs to ask for their processes.
        hub: Where samples go.
        clock: Time source (a fake clock drives it in tests).
        host: Host id stamped on the samples.
        meter: The runtime's :class:`EnergyMeter` (registered as a hub sink by the runtime).
        workload_of: Fills each sample's ``workload`` (:data:`WorkloadOf`): asked once per
            pid per period, in the sampling thread, with the GPUs the pid has samples on, so
            a process of no job holding GPUs counts as its user's. ``None``: left ``""``.
    """

    def __init__(
        self,
        tracking: ProcessTracking,
        source: ProcessSource,
        gpus: Sequence[GpuProcessReader],
        hub: Hub,
        clock: Clock,
        host: str,
        meter: EnergyMeter,
        workload_of: WorkloadOf | None = None,
    ) -> None:
        self.tracking = tracking
        self.workload_of = workload_of
        self._source = source
        self._gpus = list(gpus)
        self._hub = hub
        self._clock = clock
        self._meter = meter
        self._attributor = ProcessAttributor(host)
        self._root = tracking.root if tracking.root is not None else os.getpid()
        self._exclude = set(tracking.exclude)
        self._descendants: list[int] = []
        self._next_scan_ns: int | None = None
        self._next_smaps_ns: int | None = None
        self._last_seen_us: dict[int, int] = {}
        self._gpu_failed: set[int] = set()
        self._gpu_pids: set[int] = set()
        self._known: set[int] = set()
        self._workload_failed = False  # logged once
        self.stats = ProcessSamplerStats()

    def _tracked(self, now_ns: int) -> set[int]:
        tracking = self.tracking
        if tracking.pids is not None:
            pids = set(tracking.pids)
        else:
            pids = {self._root}
            if tracking.children:
                if self._next_scan_ns is None or now_ns >= self._next_scan_ns:
                    self._descendants = self._source.descendants(self._root)
                    self._next_scan_ns = now_ns + round(tracking.rescan_s * 1e9)
                pids.update(self._descendants)
        if tracking.gpu_all:
            pids |= self._gpu_pids
        return pids - self._exclude

    def _read_gpus(self) -> dict[int, GpuProcesses]:
        out: dict[int, GpuProcesses] = {}
        for gpu in self._gpus:
            index = gpu.index
            if index in self._gpu_failed:
                continue
            try:
                reading = gpu.read_processes(self._last_seen_us.get(index, 0))
            except NotSupportedError as exc:
                self._gpu_failed.add(index)
                logger.info("gpu:%d: per-process metrics not available: %s", index, exc)
                continue
            except DeviceError as exc:
                self.stats.errors += 1
                logger.warning("gpu:%d: reading its processes failed: %s", index, exc)
                continue
            self._last_seen_us[index] = reading.last_seen_us
            out[index] = reading
        return out

    def tick(self, t_ns: int, meter: Mapping[MeterKey, EnergyReading]) -> list[ProcessSample]:
        """Read everything once and attribute (blocking; the sampler runs it in a thread)."""
        start = time.thread_time_ns()
        gpus = self._read_gpus()
        self._gpu_pids = {p for r in gpus.values() for p in (*r.memory_bytes, *r.sm_frac)}
        now = self._clock.monotonic_ns()
        tracked = self._tracked(now)
        smaps = self._next_smaps_ns is None or now >= self._next_smaps_ns
        if smaps:
            self._next_smaps_ns = now + round(self.tracking.smaps_s * 1e9)
        host = self._source.host()
        procs: dict[int, ProcessStat] = {}
        for pid in tracked:
            # A pid seen for the first time gets its PSS/USS at once.
            stat = self._source.process(pid, smaps or pid not in self._known)
            if stat is not None:
                procs[pid] = stat
        gone = self._known - set(procs)
        if gone:
            self._source.forget(gone)
        self._known = set(procs)
        samples = self._attributor.tick(t_ns, host, procs, gpus, tracked, meter)
        if self.workload_of is not None and samples:
            self._label(samples, self.workload_of)
        self.stats.ticks += 1
        self.stats.events += len(samples)
        self.stats.cpu_ns += time.thread_time_ns() - start
        return samples

    def _label(self, samples: list[ProcessSample], workload_of: WorkloadOf) -> None:
        """Set each sample's ``workload``: one question per pid (the resolver caches per pid:
        about a microsecond each once a pid is known), with the GPUs it has samples on."""
        on: dict[int, list[int]] = {}
        for s in samples:
            if s.gpu is None:
                on.setdefault(s.pid, [])
            else:
                on.setdefault(s.pid, []).append(s.gpu)
        keys: dict[int, str] = {}
        for pid, gpus in on.items():
            try:
                keys[pid] = workload_of(pid, gpus)
            except Exception:  # a resolver's defect must not stop the sampling
                self.stats.errors += 1
                if not self._workload_failed:
                    logger.exception("finding the workload of process %d failed", pid)
                self._workload_failed = True
                keys[pid] = ""
        for s in samples:
            s.workload = keys[s.pid]

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Sample until cancelled, on a grid of ``period_s`` from the start."""
        clock = self._clock
        period = round(self.tracking.period_s * 1e9)
        start = clock.monotonic_ns()
        tick = 0
        task_status.started()
        while True:
            snapshot = self._meter.snapshot()
            t_ns = clock.wall_ns()
            samples = await anyio.to_thread.run_sync(self.tick, t_ns, snapshot)
            for sample in samples:
                await self._hub.publish(sample)
            tick += 1
            deadline = start + tick * period
            now = clock.monotonic_ns()
            if now >= deadline:
                tick += (now - deadline) // period + 1
                deadline = start + tick * period
            await clock.sleep_until(deadline)
