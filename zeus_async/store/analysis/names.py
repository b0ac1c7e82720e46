"""Device and metric names of a recording, AIPowerMeter's names among them.

:class:`_Named` (the layer of :class:`~zeus_async.store.analysis.Recording` above the arrays)
lists the devices and metrics a recording holds, resolves a device or metric given by the
user (``cpu:0`` for ``cpu:0/package``; an AIPowerMeter field name for the metric it reads,
:data:`AIPOWERMETER_METRICS`) and builds the series of AIPowerMeter's names
(:mod:`zeus_async.store.aipowermeter`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Final

import numpy as np
import numpy.typing as npt

from ...errors import ConfigError
from .. import aipowermeter as aipm
from .loading import _SPECS, _Loaded
from .results import Series

logger = logging.getLogger(__name__)


#: AIPowerMeter's field names and the metric each reads (:mod:`zeus_async.store.aipowermeter`
#: has their units and scopes), accepted wherever a metric is (``total("per_process_cpu_power")``).
AIPOWERMETER_METRICS: Final = {name: f.metric for name, f in aipm.FIELDS.items()}


class _Named(_Loaded):
    """Device and metric names of a loaded recording (see :mod:`.names`)."""

    def __str__(self) -> str:
        """What the recording holds: duration with start and end, which part of which
        recording it is when it is a later part of a rotated one read alone, devices, then the
        metrics available, AIPowerMeter's names grouped as it groups them (CPU, GPU,
        Experiments)."""
        seconds, start, end = self.get_duration()
        lines = [
            f"Recording {self.path}: {seconds:.3f} s, "
            f"{start.isoformat(timespec='milliseconds')} to "
            f"{end.isoformat(timespec='milliseconds')}",
            *([f"This file is {self.part_of}"] if self.part_of is not None else []),
            f"Hosts: {', '.join(self.hosts) or '-'}",
            f"Devices: {', '.join(self.devices()) or '-'}",
            "Available metrics :",
        ]
        names = self.aipowermeter_metrics()
        for group in aipm.GROUPS:
            lines.append(group)
            lines.append(
                "  " + (",".join(n for n in names if aipm.FIELDS[n].group == group) or "-")
            )
        lines.append("zeus_async")
        lines.append("  " + (",".join(self.metrics()) or "-"))
        return "\n".join(lines)

    # -- names ---------------------------------------------------------------------------------

    def devices(self, metric: str | None = None) -> list[str]:
        """Device keys with data (GPUs, then RAPL domains, then processes), optionally only
        those with values of ``metric``."""
        if metric is None:
            return list(self._where)
        field = aipm.FIELDS.get(metric)
        if field is not None:
            keys = self._aipm_devices(field)
            return list(self._per_gpu(keys)) if field.scope == "per-gpu" else keys
        metric = self._check_metric(metric)
        return [d for d in self._where if metric in self._metrics_of(d)]

    def metrics(self, device: str | None = None) -> list[str]:
        """Metrics with at least one value (of ``device``, if given), in schema order."""
        if device is None:
            present = {m for key in self._where for m in self._metrics_of(key)}
        else:
            present = set(self._metrics_of(self._resolve(device)))
        return [m for _, fields in _SPECS.values() for _, m in fields if m in present]

    def aipowermeter_metrics(self) -> list[str]:
        """AIPowerMeter's names with data in this recording (:mod:`~zeus_async.store.
        aipowermeter`), in its order."""
        return [name for name, f in aipm.FIELDS.items() if self._aipm_devices(f, strict=False)]

    def _rapl_domains(self, device: str) -> list[str]:
        """The RAPL domains of the package (and host) of a ``cpu:P/domain`` key."""
        base, _, host = device.partition("@")
        package = base.rpartition("/")[0]
        return [
            k.split("@")[0].rpartition("/")[2]
            for k in self._where
            if k.split("@")[0].startswith(package + "/") and k.partition("@")[2] == host
        ]

    def _aipm_devices(self, field: aipm.AipmField, *, strict: bool = True) -> list[str]:
        """The devices with values of ``field``'s metric that it covers."""
        if field.metric not in self.metrics():
            if not strict:
                return []
            raise ConfigError(
                f"{field.name!r} ({field.description}) reads {field.metric}, which "
                f"{self.path} does not hold" + aipm.why_absent(field.metric, self.metrics())
            )
        keys = [k for k in self.devices(field.metric) if aipm.covers(field, k, self._rapl_domains)]
        if strict and not keys:
            raise ConfigError(
                f"{field.name!r} ({field.description}) covers no device of {self.path}"
            )
        return keys

    def _aipm_series(self, field: aipm.AipmField, device: str | None) -> Series:
        keys = self._aipm_devices(field)
        if field.scope == "all":
            if device not in (None, "all"):
                raise ConfigError(
                    f"{field.name!r} is one series over every device it covers; "
                    f"call series({field.name!r}) without a device"
                )
            t, v = aipm.combine(self._aipm_parts(field, keys))
            if not len(t):
                raise ConfigError(
                    f"{field.name!r} sums {', '.join(keys)}, which have no instant where "
                    f"every one has a reading; read them one by one"
                )
            return Series(field.name, "all", t, v * field.scale, self.start_ns)
        if field.scope == "per-gpu":
            groups = self._per_gpu(keys)
            key = self._pick(field.name, device, list(groups))
            t, v = aipm.combine(self._aipm_parts(field, groups[key]))
            return Series(field.name, key, t, v * field.scale, self.start_ns)
        key = self._pick(field.name, device, keys)
        t, v = self._values(key, field.metric)
        return Series(field.name, key, t, v * field.scale, self.start_ns)

    def _aipm_parts(
        self, field: aipm.AipmField, keys: list[str]
    ) -> list[tuple[str, npt.NDArray[np.int64], npt.NDArray[np.float64]]]:
        """``(source, t_ns, values)`` of each key, for :func:`~.aipowermeter.combine`."""
        return [(aipm.source_of(field, k), *self._values(k, field.metric)) for k in keys]

    @staticmethod
    def _per_gpu(keys: list[str]) -> dict[str, list[str]]:
        """``proc:P/gpu:N[@host]`` keys grouped by their ``gpu:N[@host]``."""
        groups: dict[str, list[str]] = {}
        for k in keys:
            base, _, host = k.partition("@")
            gpu = base.partition("/")[2] + (f"@{host}" if host else "")
            groups.setdefault(gpu, []).append(k)
        return groups

    def _pick(self, name: str, device: str | None, keys: list[str]) -> str:
        if device is None:
            if len(keys) == 1:
                return keys[0]
            raise ConfigError(f"{name!r} has a series per device; pass one of: {', '.join(keys)}")
        return self._resolve(device, keys)

    def _check_metric(self, metric: str) -> str:
        """``metric`` (an AIPowerMeter name mapped to ours) if present, else ConfigError."""
        metric = AIPOWERMETER_METRICS.get(metric, metric)
        if metric not in self.metrics():
            raise ConfigError(
                f"unknown metric {metric!r} in {self.path}"
                f"{aipm.why_absent(metric, self.metrics())}; available: "
                f"{', '.join(self.metrics()) or 'none'}"
            )
        return metric

    def _resolve(self, device: str, within: Collection[str] | None = None) -> str:
        keys = self._where if within is None else within
        if device in keys:
            return device
        if f"{device}/package" in keys:
            return f"{device}/package"
        raise ConfigError(
            f"unknown device {device!r} in {self.path}; available: {', '.join(keys) or 'none'}"
        )
