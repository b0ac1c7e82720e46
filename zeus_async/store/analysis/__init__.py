"""Analysis of recordings: per-device series, energy over any interval, totals and export.

This is the offline counterpart of the live aggregation (the role of AIPowerMeter's
``ExpResults``): :class:`Recording` reads a recording once into arrays, one numpy array per
field of each sample kind (:mod:`zeus_async.store.columns`; :meth:`Recording.tables`,
:meth:`Recording.to_arrow`, :meth:`Recording.to_pandas`). Series are slices of them, and each
energy-measurable device gets, on first use, a
:class:`~zeus_async.aggregate.history.DeviceHistory` built from them
(:meth:`~zeus_async.aggregate.history.DeviceHistory.from_arrays`: the same estimator the
measurement windows use, holding bit for bit what it holds when fed sample by sample), so
energy over any interval is what a window over that interval would have reported.

Naming
------

*Devices* are the keys the live aggregation uses:

* ``gpu:<index>`` — a GPU (:class:`~zeus_async.events.GpuSample`);
* ``cpu:<package>/<domain>`` — one RAPL domain of one CPU package
  (:class:`~zeus_async.events.RaplSample`; domains ``package``, ``core``, ``uncore``, ``dram``,
  ``psys``). Wherever a device name is accepted, ``cpu:<package>`` alone means
  ``cpu:<package>/package``;
* ``proc:<pid>`` — a process (:class:`~zeus_async.events.ProcessSample` without a GPU), and
  ``proc:<pid>/gpu:<index>`` — a process on one GPU.

When the events of a recording come from more than one host, every key gets the host appended
(``gpu:0@node1``); a single-host recording uses the bare keys.

*Metrics* are ``"<kind>.<field>"``: the event tag and a numeric field of that event, e.g.
``gpu.power_w``, ``gpu.energy_j``, ``gpu.temperature_c``, ``rapl.energy_j``, ``rapl.power_w``,
``proc.cpu_frac``, ``proc.attributed_power_w``. Every ``int``/``float`` field of
``GpuSample``, ``RaplSample`` and ``ProcessSample`` is a metric, except the identifying ones
(``gpu``, ``package``, ``pid``); :meth:`Recording.metrics` lists those with at least one value
in the file. A new numeric field in the schema becomes a metric with no change here.

Processes
---------

Recordings of a runtime with process tracking hold :class:`~zeus_async.events.ProcessSample`
events: ``proc.*`` metrics like any other (``total("proc.cpu_power_w")`` integrates a tracked
process's CPU power; ``total("proc.attributed_power_w")`` the GPU power attributed to every
tracked process). :meth:`Recording.totals` adds, per process, the attributed CPU, DRAM and
per-GPU energy from the samples' running totals, and their sums for the experiment.
AIPowerMeter's field names are accepted too, in its units (:mod:`~zeus_async.store.
aipowermeter`: ``total("per_process_cpu_power")``, ``series("nvidia_draw_absolute")``, percent
where it gives percent), and ``print(recording)`` lists them grouped as it does.

Progress
--------

Loading and the exporters take ``progress(done_bytes, total_bytes)``: bytes of the file read so
far and the file size. It is called about every 64k events (:data:`PROGRESS_EVERY`), and once
more with ``done_bytes == total_bytes`` when the pass ends.

Modules
-------

Each part imports only those listed before it:

* :mod:`.results`: :class:`Series`, :class:`DeviceTotal`, :class:`ProcessTotal`,
  :class:`Totals`, what an analysis returns;
* :mod:`.loading`: the load pass, the arrays and each device's estimator (the base of
  :class:`Recording`);
* :mod:`.names`: device and metric names, AIPowerMeter's among them;
* :mod:`.recording`: :class:`Recording`: series, energy over any interval, totals;
* :mod:`.export`: :func:`export_jsonl` and :func:`export_csv`.
"""

from __future__ import annotations

import logging

from ..progress import PROGRESS_EVERY, Progress
from .export import CSV_FIXED, csv_columns, export_csv, export_jsonl
from .names import AIPOWERMETER_METRICS
from .recording import Recording
from .results import DeviceTotal, Emissions, ProcessTotal, Series, Totals

__all__ = [
    "AIPOWERMETER_METRICS",
    "CSV_FIXED",
    "PROGRESS_EVERY",
    "DeviceTotal",
    "Emissions",
    "ProcessTotal",
    "Progress",
    "Recording",
    "Series",
    "Totals",
    "csv_columns",
    "export_csv",
    "export_jsonl",
]

logger = logging.getLogger(__name__)
