"""A recording loaded for analysis: series, energy over any interval and totals.

:class:`Recording` is the class users hold; the load pass and the arrays are its base
(:mod:`.loading`), the device and metric names the layer above (:mod:`.names`). Here: a
metric's :meth:`~Recording.series`, a device's :meth:`~Recording.energy` over an interval,
:meth:`~Recording.total` of a metric, and the per-device and per-process
:meth:`~Recording.totals`.
"""

from __future__ import annotations

import logging
from typing import Any

from ...aggregate.history import DeviceHistory, EnergyEstimate
from ...errors import ConfigError
from .. import aipowermeter as aipm
from ..progress import Progress
from .loading import _PathLike
from .names import _Named
from .results import DeviceTotal, Emissions, ProcessTotal, Series, Totals

logger = logging.getLogger(__name__)


def _energy_field(metric: str) -> bool:
    return metric.rpartition(".")[2].endswith("energy_j")


def _power_field(metric: str) -> bool:
    return metric.rpartition(".")[2].endswith("power_w")


class Recording(_Named):
    """A recording loaded for analysis (one pass over the file, see the package docstring).

    Args:
        path: The recording file.
        progress: Optional ``progress(done_bytes, total_bytes)`` callback for the load pass.

    Attributes:
        path: The recording file.
        header: Run metadata (:class:`~zeus_async.store.RecordingHeader`).
        part_of: Given a later part of a rotated recording (``run.3.zarc``), which part of
            which recording it is (:class:`~zeus_async.store.reader.PartOf`): its figures are
            that part's only. ``None`` otherwise.
        report: What the load pass found (torn tail, corrupt frames); damage is reported,
            every complete frame is analyzed.
        start_ns: Time of the earliest event (``header.start_wall_ns`` for an empty file).
        end_ns: Time of the latest event (``start_ns`` for an empty file).

    Raises:
        NotARecordingError, SchemaVersionError, CodecError: Not a readable recording.
        OSError: The file cannot be read.
    """

    @classmethod
    def load(cls, path: _PathLike, progress: Progress | None = None) -> Recording:
        """Same as ``Recording(path, progress=progress)``."""
        return cls(path, progress=progress)

    # -- data ----------------------------------------------------------------------------------

    def series(self, metric: str, device: str | None = None) -> Series:
        """The values of ``metric`` for ``device``.

        ``metric`` may be one of AIPowerMeter's names (:mod:`~zeus_async.store.aipowermeter`):
        its values are then in AIPowerMeter's units (percent where it gives percent), and an
        experiment-wide name (``nvidia_draw_absolute``, ``intel_power``) is one series over
        every device it covers, with ``device`` ``"all"``, with points only where every one of
        those devices has a reading (:func:`~zeus_async.store.aipowermeter.combine`).

        Args:
            metric: The metric.
            device: The device; may be left out when only one device has the metric.

        Raises:
            ConfigError: Unknown metric, a device without values of it, or an experiment-wide
                name whose devices have no instant in common.
        """
        field = aipm.FIELDS.get(metric)
        if field is not None:
            return self._aipm_series(field, device)
        metric = self._check_metric(metric)
        if device is None:
            device = self._pick(metric, None, self.devices(metric))
        key = self._resolve(device, self.devices(metric))
        t, v = self._values(key, metric)
        return Series(metric, key, t, v, self.start_ns)

    def energy(
        self, device: str, t0_ns: int | None = None, t1_ns: int | None = None
    ) -> EnergyEstimate:
        """Energy of a GPU or RAPL domain over ``[t0_ns, t1_ns]``, and how it was obtained.

        Computed by :class:`~zeus_async.aggregate.history.DeviceHistory` (the estimator of the
        measurement windows): energy counter with interpolation inside counter periods where it
        covers the interval, power at the ends where it covers part of it
        (``counter+extrapolated``), integrated power samples for GPUs without a counter
        (``integrated``). ``None`` bounds are the device's first and last sample (with power
        or energy); with both ``None`` this is the device's total, the same figure, to the
        last bit, as ``monitor``/``replay`` give for the same samples (``docs/energy-methods.md``).

        An interval that reaches past the device's samples on either side (the recording's
        own ``[start_ns, end_ns]``, a window cut by a crash) is **clamped** to them: the energy
        is that of the part with samples, and the method says so (``counter+interpolated,
        clamped``). Energy where there are no samples is unknown, never extrapolated.

        Raises:
            ConfigError: Not a GPU or RAPL device of this recording, ``t1_ns < t0_ns``, or an
                interval entirely outside the device's samples.
        """
        key = self._resolve(device, self._history_keys)
        if t0_ns is None and t1_ns is None:
            return self._history(key).span_energy()
        first, last = self._span(key)
        t0 = first if t0_ns is None else t0_ns
        t1 = last if t1_ns is None else t1_ns
        if t1 < t0:
            raise ConfigError(f"interval ends before it starts: [{t0}, {t1}]")
        if t1 < first or t0 > last or (t0 == t1 and not first <= t0 <= last):
            raise ConfigError(
                f"interval [{t0}, {t1}] lies outside the samples of {key} "
                f"([{first}, {last}], {(last - first) / 1e9:.3f} s): energy there is unknown"
            )
        if t0 >= first and t1 <= last:
            return self._history(key).energy(t0, t1)
        estimate = self._history(key).energy(max(t0, first), min(t1, last))
        return EnergyEstimate(estimate.energy_j, f"{estimate.method}, clamped")

    def totals(self) -> Totals:
        """Energy, mean power and duration of every GPU and RAPL domain over its span in the
        recording, and the experiment's GPU, CPU (``package``), DRAM and overall sums."""
        devices: dict[str, DeviceTotal] = {}
        for key in self._history_keys:
            first, last = self._span(key)
            estimate = self.energy(key)
            duration = (last - first) / 1e9
            mean = (
                estimate.energy_j / duration
                if estimate.energy_j is not None and duration > 0
                else None
            )
            devices[key] = DeviceTotal(
                key, estimate.energy_j, estimate.method, first, last, duration, mean
            )

        def domain_sum(domain: str) -> float | None:
            parts = [
                d.energy_j
                for k, d in devices.items()
                if k.startswith("cpu:") and k.split("@")[0].endswith(f"/{domain}")
            ]
            return sum(p for p in parts if p is not None) if parts else None

        gpu = sum(
            d.energy_j
            for k, d in devices.items()
            if k.startswith("gpu:") and d.energy_j is not None
        )
        cpu, dram = domain_sum("package"), domain_sum("dram")
        processes = self._process_totals()

        def process_sum(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return sum(known) if known else None

        return Totals(
            devices=devices,
            gpu_energy_j=gpu,
            cpu_energy_j=cpu,
            dram_energy_j=dram,
            total_energy_j=gpu + (cpu or 0.0) + (dram or 0.0),
            duration_s=self.duration_s,
            processes=processes,
            process_cpu_energy_j=process_sum([p.cpu_energy_j for p in processes.values()]),
            process_dram_energy_j=process_sum([p.dram_energy_j for p in processes.values()]),
            process_gpu_energy_j=process_sum(
                [e for p in processes.values() for e in p.gpu_energy_j.values()]
            ),
        )

    def emissions(
        self, carbon: Any, t0_ns: int | None = None, t1_ns: int | None = None
    ) -> Emissions:
        """Grams CO2e, kWh and cost of every GPU and RAPL domain, and their sums, over
        ``[t0_ns, t1_ns]`` (default: the whole recording).

        ``carbon`` is a :class:`~zeus_async.carbon.CarbonConfig` (or an opened intensity
        source). A time-varying intensity is integrated against each device's recorded energy
        timeline (:meth:`energy` between the source's step boundaries), not averaged; each
        device's interval is clamped to its samples, as :meth:`energy` clamps. The sum of the
        recording's windows' footprints, for windows that tile the interval, is this figure.

        Raises:
            ConfigError: A bad configuration, or a source with no intensity for part of the
                interval (a file that starts later).
        """
        from ...aggregate.footprints import Carbon, sum_footprints

        opened = Carbon.of(carbon)
        if opened is None:
            raise ConfigError("emissions need a carbon configuration (CarbonConfig(zone=...))")
        lo = self.start_ns if t0_ns is None else t0_ns
        hi = self.end_ns if t1_ns is None else t1_ns
        if hi < lo:
            raise ConfigError(f"interval ends before it starts: [{lo}, {hi}]")
        devices = {}
        for key in self._history_keys:
            first, last = self._span(key)
            a, b = max(lo, first), min(hi, last)
            if b <= a:
                continue
            history = self._history(key)

            def energy_between(x: int, y: int, history: DeviceHistory = history) -> float:
                joules = history.energy(x, y).energy_j
                return 0.0 if joules is None else joules

            devices[key] = opened.between(energy_between, a, b)

        def part(match: str) -> Any:
            return sum_footprints(
                [fp for k, fp in devices.items() if k.split("@")[0].startswith("gpu:")]
                if match == "gpu"
                else [
                    fp
                    for k, fp in devices.items()
                    if k.startswith("cpu:") and k.split("@")[0].endswith(f"/{match}")
                ]
            )

        gpu, cpu, dram = part("gpu"), part("package"), part("dram")
        total = sum_footprints([p for p in (gpu, cpu, dram) if p is not None])
        return Emissions(devices, gpu, cpu, dram, total, lo, hi)

    def _counter_span(self, key: str, metric: str) -> tuple[float, int, int] | None:
        """(last - first value, first t, last t) of a running-total column, if any."""
        if metric not in self._metrics_of(key):
            return None
        t, v = self._running(key, metric)
        if not len(t):
            return None
        return float(v[-1] - v[0]), int(t[0]), int(t[-1])

    def _process_totals(self) -> dict[str, ProcessTotal]:
        found: dict[str, dict[str, Any]] = {}
        for key in self._where:
            if not key.startswith("proc:"):
                continue
            base, _, host = key.partition("@")
            pid_part, _, gpu_part = base.partition("/")
            pid = pid_part.removeprefix("proc:") + (f"@{host}" if host else "")
            entry = found.setdefault(
                pid, {"cpu": None, "dram": None, "gpu": {}, "t0": None, "t1": None}
            )
            spans = []
            if gpu_part:
                got = self._counter_span(key, "proc.attributed_energy_j")
                if got is not None:
                    entry["gpu"][int(gpu_part.removeprefix("gpu:"))] = got[0]
                    spans.append(got)
            else:
                for metric, slot in (("proc.cpu_energy_j", "cpu"), ("proc.dram_energy_j", "dram")):
                    got = self._counter_span(key, metric)
                    if got is not None:
                        entry[slot] = got[0]
                        spans.append(got)
            for metric in self._metrics_of(key):
                t, _ = self._running(key, metric)
                if len(t):
                    spans.append((0.0, int(t[0]), int(t[-1])))
            for _, t0, t1 in spans:
                entry["t0"] = t0 if entry["t0"] is None else min(entry["t0"], t0)
                entry["t1"] = t1 if entry["t1"] is None else max(entry["t1"], t1)
        out: dict[str, ProcessTotal] = {}
        for pid, e in found.items():
            if e["t0"] is None:
                continue
            out[pid] = ProcessTotal(
                pid,
                e["cpu"],
                e["dram"],
                dict(sorted(e["gpu"].items())),
                e["t0"],
                e["t1"],
                (e["t1"] - e["t0"]) / 1e9,
            )
        return out

    def total(self, metric: str, device: str | None = None) -> float:
        """Joules of an energy or power metric over the whole recording, summed over devices.

        * ``*energy_j`` metrics (``gpu.energy_j``, ``rapl.energy_j``): the :meth:`energy` of
          each device over its span (counter-based). GPUs without the counter (pre-Volta) have
          no ``gpu.energy_j`` and are not included; :meth:`totals` includes them.
        * ``*power_w`` metrics (``gpu.power_w``, ``gpu.avg_power_w``, ``rapl.power_w``,
          ``proc.attributed_power_w``): the power samples of each device integrated over time
          (trapezoid rule, by :class:`DeviceHistory`) from its first to its last value of that
          metric.

        Args:
            metric: The metric.
            device: One device; by default every device with values of ``metric`` — for
                ``rapl.*`` metrics only the ``package`` and ``dram`` domains, which do not
                overlap (``core``/``uncore`` lie inside ``package``, ``psys`` contains it).

        Raises:
            ConfigError: Unknown metric or device, or a metric that is neither energy nor power.
        """
        field = aipm.FIELDS.get(metric)
        if field is not None:
            return self._aipm_total(field, device)
        metric = self._check_metric(metric)
        if not (_energy_field(metric) or _power_field(metric)):
            raise ConfigError(
                f"total() needs an energy (*energy_j) or power (*power_w) metric, not "
                f"{metric!r}; use series() for the values"
            )
        with_metric = self.devices(metric)
        if device is not None:
            keys = [self._resolve(device, with_metric)]
        elif metric.startswith("rapl."):
            keys = [k for k in with_metric if k.split("@")[0].endswith(("/package", "/dram"))]
            if not keys:
                raise ConfigError(
                    f"no package or dram domain has {metric!r}; pass one device of: "
                    f"{', '.join(with_metric)}"
                )
        else:
            keys = with_metric
        joules = 0.0
        for key in keys:
            if _energy_field(metric) and key in self._history_keys:
                estimate = self.energy(key)
            else:
                estimate = self._integrate(key, metric)
            if estimate.energy_j is not None:
                joules += estimate.energy_j
        return joules

    def _aipm_total(self, field: aipm.AipmField, device: str | None) -> float:
        """Joules of an AIPowerMeter power name: each covered RAPL domain from its counter,
        other devices' power integrated, summed."""
        if field.unit != "W":
            raise ConfigError(
                f"total() needs a power name; {field.name!r} is in {field.unit} "
                f"({field.description}): use series()"
            )
        keys = self._aipm_devices(field)
        if device is not None and device != "all":
            if field.scope == "all":
                raise ConfigError(f"{field.name!r} covers every device; call it without one")
            if field.scope == "per-gpu":
                groups = self._per_gpu(keys)
                keys = groups[self._resolve(device, groups)]
            else:
                keys = [self._resolve(device, keys)]
        joules = 0.0
        for key in keys:
            if key.startswith("cpu:"):
                estimate = self.energy(key)
            else:
                estimate = self._integrate(key, field.metric)
            if estimate.energy_j is not None:
                joules += estimate.energy_j
        return joules

    def _integrate(self, key: str, metric: str) -> EnergyEstimate:
        """A series through a fresh :class:`DeviceHistory`: power integrated, or a counter."""
        t, v = self._running(key, metric)
        counter = _energy_field(metric)
        history = DeviceHistory.from_arrays(
            f"{key} {metric}", t, None if counter else v, v if counter else None, fine_counter=True
        )
        return history.energy(int(t[0]), int(t[-1]))
