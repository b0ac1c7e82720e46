"""What both frameworks' energy callbacks share: one window per logging interval."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..ranks import collectives

if TYPE_CHECKING:
    from ..aggregate.footprints import Carbon
    from ..aggregate.windows import WindowResult
    from ..carbon import Footprint
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
        carbon: Grams CO2e (and cost, where priced) beside the joules: a
            :class:`~zeus_async.carbon.CarbonConfig` or an intensity source, given to the
            monitor made here. By default, the given monitor's (``Monitor(carbon=...)``); none:
            no carbon figures. A monitor given without one, or with another, is refused
            (``ConfigError``): the figures are the monitor's windows'.
        emissions_file: CodeCarbon's ``emissions.csv``, one row for the run, written by the
            monitor made here (``Monitor(emissions_file=...)``, needs ``carbon``); refused with
            a monitor given (give it to that monitor).

    With a carbon configuration the metrics also have ``gpu_co2e_g`` (the interval's),
    ``gpu_co2e_total_g`` and ``train_gpu_co2e_g``, and, when every interval is priced,
    ``gpu_cost``, ``gpu_cost_total`` and ``train_gpu_cost`` (in the configuration's
    currency): the GPUs' energy of each interval with the intensity in force when it was
    drawn (the windows' :attr:`~zeus_async.aggregate.WindowResult.gpu_footprint`).

    A monitor made before the launcher said which rank this is (Lightning's ``ddp``) measures
    every GPU until :meth:`resolve` (the callbacks' setup) or the first interval gives it this
    rank's. An ``EnergyLog`` pickles as its arguments (a ``ddp_spawn`` rank unpickles its
    callbacks): the copy starts afresh, with a monitor of its own process.
    """

    def __init__(
        self,
        monitor: Monitor | None = None,
        *,
        job: bool = True,
        prefix: str = "",
        carbon: Any = None,
        emissions_file: str | None = None,
    ) -> None:
        self.monitor = monitor
        self._owns = monitor is None
        self.job = job
        self.prefix = prefix
        self._carbon_arg = carbon
        self._emissions_file = emissions_file
        if emissions_file is not None and (monitor is not None or carbon is None):
            raise ConfigError(
                "emissions_file is for the monitor the callback makes, and needs carbon=; "
                "with a monitor of your own, give it Monitor(carbon=..., emissions_file=...)"
            )
        #: The carbon configuration of the figures (``None``: none).
        self.carbon: Carbon | None = _carbon_of(monitor, carbon)
        self._open = False
        self._done_j = 0.0  # intervals whose exact figures are in
        self._done_g = 0.0
        self._done_cost: float | None = 0.0
        self._pending: list[WindowResult] = []
        self._time_s = 0.0
        self._window = f"zeus-async/log-interval-{id(self):x}"
        self._rank: tuple[list[int] | None, int | None] = (None, None)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "monitor": None if self._owns else self.monitor,
            "job": self.job,
            "prefix": self.prefix,
            "carbon": self._carbon_arg,
            "emissions_file": self._emissions_file,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["monitor"],
            job=state["job"],
            prefix=state["prefix"],
            carbon=state.get("carbon"),
            emissions_file=state.get("emissions_file"),
        )

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
            self.monitor = Monitor(
                gpu_indices=gpus, carbon=self.carbon, emissions_file=self._emissions_file
            )
            if local_rank is not None:
                self.monitor.resolve_gpus(local_rank=local_rank)
        self.monitor.begin_window(self._window, sync_execution=False, restart=True)
        self._open = True

    def _energy(self, result: WindowResult) -> float:
        return sum(result.gpu_energy.values())

    def _footprint(self, result: WindowResult) -> Footprint | None:
        return result.gpu_footprint if self.carbon is not None else None

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
            fp = self._footprint(r)
            if fp is not None:
                self._done_g += fp.co2e_g
                self._done_cost = _add(self._done_cost, fp.cost)
        self._pending = [r for r in self._pending if not r.done()]
        total = self._done_j + sum(self._energy(r) for r in self._pending)
        values = [energy, energy / result.time if result.time > 0 else 0.0, total]
        names = ["gpu_energy_j", "gpu_power_w", "gpu_energy_total_j"]
        fp = self._footprint(result)
        if fp is not None:
            pending = [f for f in map(self._footprint, self._pending) if f is not None]
            values += [fp.co2e_g, self._done_g + sum(f.co2e_g for f in pending)]
            names += ["gpu_co2e_g", "gpu_co2e_total_g"]
            cost_total = self._done_cost
            for f in pending:
                cost_total = _add(cost_total, f.cost)
            if fp.cost is not None and cost_total is not None:
                values += [fp.cost, cost_total]
                names += ["gpu_cost", "gpu_cost_total"]
        if reduce:
            values = self._job(values)
        return {f"{self.prefix}{n}": v for n, v in zip(names, values, strict=True)}

    def finish(self, *, reduce: bool = True) -> dict[str, float]:
        """Training ends: the run's totals, ``train_gpu_energy_j`` and ``train_gpu_power_w``
        (the last interval's tail provisional, as above); closes a monitor made here."""
        if not self._open or self.monitor is None:
            return {}
        metrics = self.interval(reduce=False, again=False)
        self._open = False
        total = metrics[f"{self.prefix}gpu_energy_total_j"]
        values = [total, total / self._time_s if self._time_s > 0 else 0.0]
        names = ["train_gpu_energy_j", "train_gpu_power_w"]
        for name in ("gpu_co2e_total_g", "gpu_cost_total"):
            if f"{self.prefix}{name}" in metrics:
                values.append(metrics[f"{self.prefix}{name}"])
                names.append("train_" + name.replace("_total", ""))
        if reduce:
            values = self._job(values)
        if self._owns:
            self.monitor.close()
            self.monitor = None
        return {f"{self.prefix}{n}": v for n, v in zip(names, values, strict=True)}

    def _job(self, values: list[float]) -> list[float]:
        """Summed over the ranks (energies, and powers each over its rank's own time)."""
        ranks = collectives() if self.job else None
        return values if ranks is None else ranks.sums(values)


def _add(total: float | None, part: float | None) -> float | None:
    return None if total is None or part is None else total + part


def _carbon_of(monitor: Monitor | None, carbon: Any) -> Carbon | None:
    """The carbon configuration of an :class:`EnergyLog`'s figures (see its ``carbon``)."""
    from ..aggregate.footprints import Carbon

    if monitor is None:
        return Carbon.of(carbon)
    own = monitor.carbon
    if carbon is None:
        return own
    if own is None:
        raise ConfigError(
            "carbon= with a monitor of your own: give it to the monitor instead, "
            "Monitor(carbon=...); the figures are its windows'"
        )
    if carbon is not own and carbon != own.config and carbon is not own.source:
        raise ConfigError(
            f"carbon={carbon!r} differs from the monitor's ({own!r}); the figures are the "
            "monitor's windows': leave carbon out"
        )
    return own


class EnergyCallbackBase:
    """What both frameworks' callbacks share: an :class:`EnergyLog` (``.energy``) built from
    the same arguments. A subclass names its framework's callback class after this one and
    sets ``_missing``/``_missing_error`` when that framework is not available."""

    _missing: str = ""
    _missing_error: BaseException | None = None

    def __init__(
        self,
        monitor: Monitor | None = None,
        *,
        job: bool = True,
        prefix: str = "",
        carbon: Any = None,
        emissions_file: str | None = None,
    ) -> None:
        if self._missing:
            raise ImportError(self._missing) from self._missing_error
        super().__init__()
        #: The interval windows behind the figures.
        self.energy = EnergyLog(
            monitor, job=job, prefix=prefix, carbon=carbon, emissions_file=emissions_file
        )
