"""Energy per workload: monotonic joule counters per job, pod container or user, per GPU.

The node agent knows which workload holds each GPU (:class:`~.workloads.WorkloadResolver`);
the ledger credits every GPU sample's energy-counter step to the holder of that GPU at that
moment, and publishes the running totals (:class:`~zeus_async.events.WorkloadEnergy`) and the
workloads' starts and ends (:class:`~zeus_async.events.WorkloadChange`) on the agent's bus, where
recordings, Prometheus and OTLP take them like any other event.

**Counters that never go down.** A workload's counter is the sum of the steps of its GPUs'
energy counters while it held them. The ledger is written to disk (atomically, every period
and at close) with each GPU's last counter reading and holder, so an agent that restarts
(a crash, an upgrade) goes on from where it was: the steps its GPUs' counters took while it
was down are credited to the workload that held the GPU before and after, read from the
driver's counter, which kept counting. A Prometheus ``increase()`` over any range therefore
holds across agent restarts and missed scrapes. A GPU whose counter went backwards (the driver
reloaded) starts again from its new reading, crediting nothing for that step.

**Bounded.** A workload's figures are sent while it runs and for as long after it ended as
the resolver remembers it (``expire_s``); then a last ``expired`` change tells exporters to
drop its series and the ledger forgets it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream

from ..clock import Clock, RealClock
from ..events import Event, GpuSample, WorkloadChange, WorkloadEnergy
from .protocol import JobReport
from .workloads import Workload, WorkloadResolver

__all__ = ["LEDGER_FILE", "WorkloadLedger"]

logger = logging.getLogger(__name__)

#: The ledger's file in the agent's state directory.
LEDGER_FILE = "workload-ledger.json"
_VERSION = 1


class WorkloadLedger:
    """Joules per workload and GPU, credited sample by sample (see the module docstring).

    Args:
        resolver: Who holds each GPU.
        host: Host id stamped on the events.
        state_path: The ledger's file (``None``: kept in memory only, lost at a restart).
        period_s: How often :meth:`run` publishes the counters and writes the file.
        clock: Time source for the events' ``t_ns`` where no sample gives one.
    """

    def __init__(
        self,
        resolver: WorkloadResolver,
        *,
        host: str,
        state_path: Path | None = None,
        period_s: float = 1.0,
        clock: Clock | None = None,
    ) -> None:
        self.resolver = resolver
        self.host = host
        self.state_path = state_path
        self.period_s = period_s
        self.clock: Clock = clock if clock is not None else RealClock()
        #: Workload key -> GPU index -> joules.
        self.totals: dict[str, dict[int, float]] = {}
        #: GPU index -> (counter reading in J, t_ns of the sample that first saw it, the
        #: holder then, or "").
        self._last: dict[int, tuple[float, int, str]] = {}
        #: GPU index -> its holder at the last sample, and the changes of holder (t_ns, key)
        #: since the counter last changed.
        self._holder: dict[int, str] = {}
        self._changes: dict[int, list[tuple[int, str]]] = {}
        #: GPU index -> the holder saved by the previous agent (first sample after a restart).
        self._saved_holder: dict[int, str] = {}
        #: Workload key -> when it began to hold a GPU here (wall ns), kept across restarts.
        self._started: dict[str, int] = {}
        #: Workloads announced (key -> the last change sent), so starts and ends are sent once.
        self._announced: dict[str, WorkloadChange] = {}
        self._t_ns = 0
        if state_path is not None:
            self._load(state_path)

    # -- crediting --------------------------------------------------------------------------

    def add(self, events: Iterable[Event]) -> None:
        """Credit each GPU's counter steps to the GPU's holders.

        A step (the counter's change since the sample that first saw its previous value) is
        the energy of the time between those two samples; where the GPU changed hands in
        that time (a job started or ended), it is shared in proportion to each holder's
        part of it, so a job's figure is exact to a sample period, not to a counter period.
        """
        for e in events:
            if type(e) is not GpuSample or e.energy_j is None:
                continue
            gpu, t, counter = e.gpu, e.t_ns, e.energy_j
            holder = self.resolver.for_gpu(gpu)
            key = holder.key if holder is not None else ""
            self._t_ns = max(self._t_ns, t)
            last = self._last.get(gpu)
            if last is None:
                self._last[gpu] = (counter, t, key)
                self._holder[gpu] = key
                if key:
                    self._started.setdefault(key, t)
                continue
            if key != self._holder.get(gpu):
                self._changes.setdefault(gpu, []).append((t, key))
                self._holder[gpu] = key
                if key:
                    self._started.setdefault(key, t)
            step = counter - last[0]
            if step == 0:
                continue
            changes = self._changes.pop(gpu, [])
            saved = self._saved_holder.pop(gpu, None)
            self._last[gpu] = (counter, t, key)
            if step < 0:
                continue  # the counter went back (the driver reloaded): a new start
            if saved is not None:
                # The first step after a restart spans the agent's absence: it is the
                # holder's only if the same workload held the GPU before and after.
                if saved == key and key:
                    self._credit(key, gpu, step)
                elif step > 0:
                    logger.info(
                        "gpu %d: %.1f J drawn while the agent was down not credited: held by "
                        "%s before, %s after",
                        gpu,
                        step,
                        saved or "nobody",
                        key or "nobody",
                    )
                continue
            t0, k0 = last[1], last[2]
            if not changes or t <= t0:
                if key:
                    self._credit(key, gpu, step)
                continue
            bounds = [(t0, k0), *changes, (t, "")]
            for (a, k), (b, _) in itertools.pairwise(bounds):
                if k and b > a:
                    self._credit(k, gpu, step * (b - a) / (t - t0))

    def _credit(self, key: str, gpu: int, joules: float) -> None:
        per_gpu = self.totals.setdefault(key, {})
        per_gpu[gpu] = per_gpu.get(gpu, 0.0) + joules

    # -- what is published ------------------------------------------------------------------

    def events(self) -> list[Event]:
        """Starts, ends and expiries since the last call, then every known workload's counters."""
        t_ns = self._t_ns or self.clock.wall_ns()
        out: list[Event] = []
        known = {w.key: w for w in self.resolver.workloads()}
        gpus_of: dict[str, list[int]] = {}
        for gpu in sorted(self._last):
            holder = self.resolver.for_gpu(gpu)
            if holder is not None:
                gpus_of.setdefault(holder.key, []).append(gpu)
        for key, w in known.items():
            state = "ended" if w.ended_ns is not None else "started"
            change = _change(w, self.host, t_ns, state, gpus_of.get(key, []))
            before = self._announced.get(key)
            if before is None and key not in self.totals and not change.gpus:
                continue  # a user's process that never held a GPU: nothing to account
            if before is None or (before.state, before.gpus) != (change.state, change.gpus):
                out.append(change)
                self._announced[key] = change
                # Its counters start at 0 on every GPU it holds, so a series is seen at 0
                # first and an increase() over it needs no extrapolation at its start.
                per_gpu = self.totals.setdefault(key, {})
                for gpu in change.gpus:
                    per_gpu.setdefault(gpu, 0.0)
        for key in list(self._announced):
            if key not in known:
                gone = self._announced.pop(key)
                out.append(
                    WorkloadChange(
                        host=self.host, t_ns=t_ns, key=key, state="expired", kind=gone.kind
                    )
                )
                self.totals.pop(key, None)
                self._started.pop(key, None)
        for key in self._announced:
            energy = self.totals.get(key)
            if energy:
                out.append(
                    WorkloadEnergy(host=self.host, t_ns=t_ns, key=key, gpu_energy_j=dict(energy))
                )
        return out

    def started_ns(self, w: Workload) -> int | None:
        """When workload ``w`` began to hold a GPU here (the sample from which its energy is
        counted), else when it was first known; kept across agent restarts."""
        return self._started.get(w.key, w.started_ns)

    def settled(self, gpus: Iterable[int], since_ns: int) -> bool:
        """Whether every GPU in ``gpus`` has had a counter update seen after ``since_ns``
        (so the energy up to then is credited, shared at a change of holder)."""
        return all((last := self._last.get(g)) is not None and last[1] > since_ns for g in gpus)

    def reports(self) -> list[JobReport]:
        """Every workload known that held a GPU, with its energy so far (ended ones while
        remembered)."""
        out = []
        gpus_of: dict[str, list[int]] = {}
        for gpu in sorted(self._last):
            holder = self.resolver.for_gpu(gpu)
            if holder is not None:
                gpus_of.setdefault(holder.key, []).append(gpu)
        for w in self.resolver.workloads():
            energy = self.totals.get(w.key, {})
            gpus = gpus_of.get(w.key) or sorted(energy)
            if not gpus and not energy:
                continue
            out.append(
                JobReport(
                    key=w.key,
                    kind=w.kind,
                    gpus=gpus,
                    energy_j=dict(sorted(energy.items())),
                    job_id=w.job_id,
                    user=w.user,
                    uid=w.uid,
                    partition=w.partition,
                    namespace=w.namespace,
                    pod=w.pod,
                    container=w.container,
                    started_ns=self.started_ns(w),
                    ended_ns=w.ended_ns,
                )
            )
        return out

    def energy(self, key: str) -> dict[int, float]:
        """Joules per GPU credited to workload ``key`` so far (``{}`` if none)."""
        return dict(self.totals.get(key, {}))

    async def consume(self, stream: ObjectReceiveStream[Event]) -> None:
        """A runtime consumer: credit every sample until the stream ends."""
        async for event in stream:
            self.add((event,))

    async def tick(self, publish: Callable[[Event], Awaitable[None]]) -> None:
        """Refresh the resolver (in a worker thread: the kubelet may be slow), publish
        :meth:`events` and write the file (in a worker thread)."""
        await anyio.to_thread.run_sync(self.resolver.refresh)
        for out in self.events():
            await publish(out)
        data = self._snapshot()
        await anyio.to_thread.run_sync(self._write, data)

    async def run(self, publish: Callable[[Event], Awaitable[None]]) -> None:
        """:meth:`tick` every ``period_s`` until cancelled; the file is written once more then.

        Run it beside :meth:`consume` (a separate task: publishing from the consumer's own
        task could wait on its own full buffer)."""
        try:
            while True:
                await anyio.sleep(self.period_s)
                await self.tick(publish)
        finally:
            with anyio.CancelScope(shield=True):
                self.save()

    # -- on disk ----------------------------------------------------------------------------

    def save(self) -> None:
        """Write the ledger (atomically: a new file renamed over the old one)."""
        self._write(self._snapshot())

    def _snapshot(self) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "host": self.host,
            "totals": {k: {str(g): j for g, j in v.items()} for k, v in self.totals.items()},
            "gpus": {str(g): [c, t, k] for g, (c, t, k) in self._last.items()},
            "jobs": _registered_jobs(self.resolver),
            "started": dict(self._started),
        }

    def _write(self, data: dict[str, Any]) -> None:
        path = self.state_path
        if path is None:
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("could not write the workload ledger %s: %s", path, exc)
            tmp.unlink(missing_ok=True)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning("workload ledger %s unreadable (%s): starting from zero", path, exc)
            return
        if not isinstance(data, dict) or data.get("version") != _VERSION:
            logger.warning("workload ledger %s has an unknown version: starting from zero", path)
            return
        self.totals = {
            str(k): {int(g): float(j) for g, j in v.items()}
            for k, v in data.get("totals", {}).items()
        }
        self._started = {str(k): int(v) for k, v in data.get("started", {}).items()}
        for g, (counter, t_ns, key) in data.get("gpus", {}).items():
            self._last[int(g)] = (float(counter), int(t_ns), str(key))
            self._saved_holder[int(g)] = str(key)
        slurm = self.resolver.slurm
        for job in data.get("jobs", []):
            if slurm is not None and str(job["job_id"]) not in slurm.registered():
                slurm.register(
                    job["job_id"],
                    gpus=job.get("gpus", ()),
                    user=job.get("user"),
                    uid=job.get("uid"),
                    partition=job.get("partition"),
                    name=job.get("name"),
                )


def _registered_jobs(resolver: WorkloadResolver) -> list[dict[str, Any]]:
    """The jobs a prolog announced, so a restarted agent knows them again."""
    if resolver.slurm is None:
        return []
    return [
        {
            "job_id": job.job_id,
            "gpus": list(job.gpus),
            "user": job.user,
            "uid": job.uid,
            "partition": job.partition,
            "name": job.name,
        }
        for job in resolver.slurm.registered().values()
    ]


def _change(w: Workload, host: str, t_ns: int, state: str, gpus: list[int]) -> WorkloadChange:
    return WorkloadChange(
        host=host,
        t_ns=t_ns,
        key=w.key,
        state=state,  # type: ignore[arg-type]
        kind=w.kind,
        gpus=gpus,
        job_id=w.job_id or "",
        user=w.user or "",
        uid=w.uid if w.uid is not None else -1,
        partition=w.partition or "",
        namespace=w.namespace or "",
        pod=w.pod or "",
        container=w.container or "",
        command=w.command or "",
    )
