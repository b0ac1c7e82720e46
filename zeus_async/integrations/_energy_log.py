"""What both frameworks' energy callbacks share: one window per logging interval."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..ranks import collectives

if TYPE_CHECKING:
    from ..aggregate.windows import WindowResult
    from ..monitor import Monitor

__all__ = ["EnergyCallbackBase", "EnergyLog"]

logger = logging.getLogger(__name__)


class EnergyLog:
    """GPU energy per logging interval of a training run, read without blocking.

    Args:
        monitor: The :class:`~zeus_async.Monitor` to measure with; by default one is made at
            :meth:`start` (this rank's own GPU(s), see :mod:`zeus_async.ranks`) and closed at
            :meth:`finish`.
        job: In a job of several ranks, report the job's figures (summed over the ranks: a
            collective, so every rank must log at the same steps, as the frameworks do);
            ``False``: this rank's.
        prefix: Put before every metric name.

    A monitor made before the launcher said which rank this is (Lightning's ``ddp``) measures
    every GPU until :meth:`resolve` (the callbacks' setup) or the first interval gives it this
    rank's. An ``EnergyLog`` pickles as its arguments (a ``ddp_spawn`` rank unpickles its
    callbacks): the copy starts afresh, with a monitor of its own process.
    """

    def __init__(
        self, monitor: Monitor | None = None, *, job: bool = True, prefix: str = ""
    ) -> None:
        self.monitor = monitor
        self._owns = monitor is None
        self.job = job
        self.prefix = prefix
        self._open = False
        self._done_j = 0.0  # intervals whose exact figures are in
        self._pending: list[WindowResult] = []
        self._time_s = 0.0
        self._window = f"zeus-async/log-interval-{id(self):x}"
        self._rank: tuple[list[int] | None, int | None] = (None, None)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "monitor": None if self._owns else self.monitor,
            "job": self.job,
            "prefix": self.prefix,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["monitor"], job=state["job"], prefix=state["prefix"])  # type: ignore[misc]

    def resolve(self, gpus: Sequence[int] | None = None, local_rank: int | None = None) -> None:
        """The launcher has started the ranks: this rank's GPU (its framework's device, else
        its local rank; see :meth:`Monitor.resolve_gpus <zeus_async.Monitor.resolve_gpus>`),
        for the monitor given or the one :meth:`start` makes."""
        self._rank = (None if gpus is None else list(gpus), local_rank)
        if self.monitor is not None:
            self.monitor.resolve_gpus(gpus, local_rank=local_rank)

    def start(self) -> None:
        """Training starts: open the first interval."""
        if self.monitor is None:
            from ..monitor import Monitor

            gpus, local_rank = self._rank
            self.monitor = Monitor(gpu_indices=gpus)
            if local_rank is not None:
                self.monitor.resolve_gpus(local_rank=local_rank)
        self.monitor.begin_window(self._window, sync_execution=False, restart=True)
        self._open = True

    def _energy(self, result: WindowResult) -> float:
        return sum(result.gpu_energy.values())

    def interval(self, *, reduce: bool = True, again: bool = True) -> dict[str, float]:
        """A logging step: close the interval, open the next, and return its metrics:
        ``gpu_energy_j`` and ``gpu_power_w`` (the interval's; on several ranks the sums over
        the ranks, each rank's power over its own interval), ``gpu_energy_total_j`` (since
        :meth:`start`). ``reduce=False`` leaves the sums to the caller (Lightning's
        ``sync_dist``). Empty before :meth:`start`."""
        if not self._open or self.monitor is None:
            return {}
        result = self.monitor.end_window(self._window, sync_execution=False)
        if again:
            self.monitor.begin_window(self._window, sync_execution=False)
        self._pending.append(result)
        self._time_s += result.time
        energy = self._energy(result)
        done = [r for r in self._pending if r.done()]
        for r in done:
            self._done_j += self._energy(r)
        self._pending = [r for r in self._pending if not r.done()]
        total = self._done_j + sum(self._energy(r) for r in self._pending)
        values = [energy, energy / result.time if result.time > 0 else 0.0, total]
        if reduce:
            values = self._job(values)
        return {
            f"{self.prefix}gpu_energy_j": values[0],
            f"{self.prefix}gpu_power_w": values[1],
            f"{self.prefix}gpu_energy_total_j": values[2],
        }

    def finish(self, *, reduce: bool = True) -> dict[str, float]:
        """Training ends: the run's totals, ``train_gpu_energy_j`` and ``train_gpu_power_w``
        (the last interval's tail provisional, as above); closes a monitor made here."""
        if not self._open or self.monitor is None:
            return {}
        metrics = self.interval(reduce=False, again=False)
        self._open = False
        total = metrics[f"{self.prefix}gpu_energy_total_j"]
        values = [total, total / self._time_s if self._time_s > 0 else 0.0]
        if reduce:
            values = self._job(values)
        if self._owns:
            self.monitor.close()
            self.monitor = None
        return {
            f"{self.prefix}train_gpu_energy_j": values[0],
            f"{self.prefix}train_gpu_power_w": values[1],
        }

    def _job(self, values: list[float]) -> list[float]:
        """Summed over the ranks (energies, and powers each over its rank's own time)."""
        ranks = collectives() if self.job else None
        return values if ranks is None else ranks.sums(values)


class EnergyCallbackBase:
    """What both frameworks' callbacks share: an :class:`EnergyLog` (``.energy``) built from
    the same arguments. A subclass names its framework's callback class after this one and
    sets ``_missing``/``_missing_error`` when that framework is not available."""

    _missing: str = ""
    _missing_error: BaseException | None = None

    def __init__(
        self, monitor: Monitor | None = None, *, job: bool = True, prefix: str = ""
    ) -> None:
        if self._missing:
            raise ImportError(self._missing) from self._missing_error
        super().__init__()
        #: The interval windows behind the figures.
        self.energy = EnergyLog(monitor, job=job, prefix=prefix)
