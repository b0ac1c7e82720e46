"""Measurement windows: time and energy between two edges, computed off the caller's thread.

An edge (:meth:`WindowTracker.open` / :meth:`WindowTracker.close`) costs the caller a clock read
and a ``deque.append`` — no NVML call, no I/O, no syscall. The runtime's thread keeps a
:class:`~zeus_async.aggregate.history.DeviceHistory` per device and finalizes each closed window
once the data that makes it exact has arrived: an energy-counter update after the window's end
(GPUs since Volta), or a power sample after it (older GPUs). A :class:`WindowResult` is returned
at once and its energy figures resolve within ``finalize_timeout_s`` of the window's end at the
latest (default 0.5 s; with a 100 ms counter and 10 ms sampling, typically ~105 ms); a device that
has not delivered by then is measured from what is there (method ``counter+extrapolated`` or
``integrated``). Values never change once resolved.

In the runtime the tracker is a hub sink, and its pump (publishing queued edges, finalizing
windows) runs only when there is something to do: right after a sample arrives while edges or
closed windows wait (that sample is what can complete a window), at a closed window's deadline,
and otherwise every ``idle_s``. An idle tracker thus costs no wake-ups of its own beyond that
slow poll, whatever the sampling rate.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import ObjectReceiveStream

from ..clock import Clock, FakeClock
from ..events import (
    DeviceFault,
    DeviceInfo,
    Event,
    GpuSample,
    Measurement,
    RaplSample,
    WindowClose,
    WindowOpen,
)
from .board import BoardReader, PowerBoard, provisional_measurement
from .footprints import Carbon, PiecewiseEnergy, energy_pieces, history_energy_between
from .history import (
    DeviceHistory,
    EnergyEstimate,
    add_sample,
    history_key,
    window_measurement,
)

if TYPE_CHECKING:
    from ..carbon import Footprint

__all__ = [
    "EnergyEstimate",
    "ReplayedWindows",
    "WindowResult",
    "WindowTracker",
    "next_window_id",
    "pop_open_window",
]

logger = logging.getLogger(__name__)

_window_ids = itertools.count(1)

#: Counter updates each GPU must show before windows are "primed": anchors on both sides of an
#: early edge, and neighbours for refining the update instants (~0.3 s at 100 ms per update).
_PRIMING_UPDATES = 3

#: Longest interval between two trims of the histories (ns of the tracker's clock).
_TRIM_EVERY_NS = 1_000_000_000


def next_window_id() -> int:
    """A process-unique window id."""
    return next(_window_ids)


def pop_open_window(open_windows: dict[str, tuple[int, int]], name: str) -> tuple[int, int]:
    """Remove and return ``(start_ns, window_id)`` of an open window, or raise a clear error."""
    try:
        return open_windows.pop(name)
    except KeyError:
        known = ", ".join(repr(k) for k in open_windows) or "none"
        raise ValueError(f"no open measurement window {name!r} (open windows: {known})") from None


#: Notified whenever any :class:`WindowResult` resolves; its waiters re-check their own.
_RESOLVED = threading.Condition()


#: Real seconds after which waits bounded on the tracker's clock give up anyway (a fake clock
#: that nothing moves).
_REAL_TIME_GUARD_S = 10.0


class WindowResult:
    """The outcome of one window; the exact energy figures resolve shortly after it ends.

    ``time`` (seconds) is known at once. So are the energy attributes (``gpu_energy``,
    ``total_energy``, ``methods``, ``error_j``...): until the exact, counter-based figures are
    in (~0.1 s after the window's end, bounded by ``finalize_timeout_s``) they return a
    *provisional* figure computed from the power readings the sampler publishes
    (:mod:`~zeus_async.aggregate.board`), and :attr:`provisional` is true; afterwards, the
    exact ones. Reading them never blocks where the sampler publishes readings (every
    ``Monitor`` and runtime with windows); elsewhere they wait for the exact figures.
    :meth:`done` tells whether the exact figures are in, :meth:`wait` / :meth:`wait_async`
    (and :attr:`measurement`) wait for them.

    With a carbon configuration (``Monitor(carbon=...)``, ``Runtime(carbon=...)``),
    :attr:`footprint`, :attr:`co2e_g` and :attr:`cost` give the emissions and cost of the
    window's energy, with the intensity's source, the PUE and the overhead; ``None`` without
    one.
    """

    __slots__ = (
        "_carbon",
        "_cuts",
        "_done",
        "_error",
        "_estimate",
        "_footprints",
        "_measurement",
        "_on_wait",
        "_pieces",
        "_provisional",
        "cancelled",
        "end_ns",
        "name",
        "start_ns",
        "window_id",
    )

    def __init__(self, name: str, window_id: int, start_ns: int, end_ns: int) -> None:
        self.name = name
        self.window_id = window_id
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.cancelled = False
        # Set (under _RESOLVED) once the measurement or the error is in. One condition shared by
        # every result, instead of a threading.Event each: creating a result is on the caller's
        # thread at every window end, and waiting on one is the rare case.
        self._done = False
        self._measurement: Measurement | None = None
        self._error: BaseException | None = None
        # Called once before a reader first blocks on an unresolved result: a producer that
        # defers work nobody is waiting for (the sampler process's parent) hurries it along.
        # Called with this result.
        self._on_wait: Callable[[WindowResult], None] | None = None
        # Computes the provisional figures from the power board (set by whoever can), and
        # what it computed, once.
        self._estimate: Callable[[WindowResult], Measurement | None] | None = None
        self._provisional: Measurement | None = None
        # The carbon configuration its footprint uses (None: no carbon figures), and the
        # footprints of its exact figures, (every device, GPUs only), once known: set by the
        # tracker before it resolves the result where it had the energy timeline, else
        # computed here from the totals.
        self._carbon: Carbon | None = None
        self._footprints: tuple[Footprint, Footprint] | None = None
        # Measured in another process (an agent): where the window was cut for a time-varying
        # intensity (Carbon.cuts, sent with the closing edge), and the agent's joules of each
        # piece between them, (every device, GPUs only).
        self._cuts: list[int] | None = None
        self._pieces: list[tuple[float, float]] | None = None

    @property
    def time(self) -> float:
        """Window duration in seconds."""
        return (self.end_ns - self.start_ns) / 1e9

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> Measurement:
        """Block until finalized; returns the :class:`~zeus_async.events.Measurement` event."""
        self._hurry()
        if not self._done:
            with _RESOLVED:
                _RESOLVED.wait_for(self.done, timeout)
        if not self._done:
            raise TimeoutError(f"window {self.name!r} not finalized within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._measurement is not None
        return self._measurement

    async def wait_async(self) -> Measurement:
        """Wait on the event loop (polls the thread-safe flag; finalization is ≤ 0.5 s away)."""
        self._hurry()
        while not self._done:
            await anyio.sleep(0.005)
        return self.wait(0)

    def _hurry(self) -> None:
        on_wait = self._on_wait
        if on_wait is not None and not self._done:
            self._on_wait = None
            on_wait(self)

    def _resolve(self, measurement: Measurement) -> None:
        with _RESOLVED:
            self._measurement = measurement
            self._done = True
            _RESOLVED.notify_all()

    @classmethod
    def cancelled_result(
        cls, name: str, window_id: int, start_ns: int, end_ns: int, *, host: str = ""
    ) -> WindowResult:
        """An already-resolved, empty result for a cancelled window."""
        result = cls(name, window_id, start_ns, end_ns)
        result.cancelled = True
        result._resolve(Measurement(host, end_ns, name, window_id, start_ns, end_ns, 0.0, {}))
        return result

    def _fail(self, error: BaseException) -> None:
        """The window cannot be measured (the sampler died): readers get ``error``."""
        with _RESOLVED:
            if not self._done:
                self._error = error
                self._done = True
                _RESOLVED.notify_all()

    def _current(self) -> Measurement:
        """The exact figures when in, else the provisional ones (computed once), else the
        exact ones waited for."""
        if not self._done:
            estimate = self._estimate
            if estimate is not None:
                if self._provisional is None:
                    try:
                        self._provisional = estimate(self)
                    except Exception:  # a damaged board: fall back to waiting
                        logger.exception("provisional figures of window %r failed", self.name)
                        self._estimate = None
                if self._provisional is not None and not self._done:
                    return self._provisional
        return self.wait()

    @property
    def provisional(self) -> bool:
        """Whether the energy attributes return provisional figures now (the exact ones are
        not in yet). Never blocks."""
        if self._done:
            return False
        self._current()
        return not self._done and self._provisional is not None

    @property
    def measurement(self) -> Measurement:
        """The exact figures, as a :class:`~zeus_async.events.Measurement` (waits for them)."""
        return self.wait()

    @property
    def gpu_energy(self) -> dict[int, float]:
        """Joules per GPU index (provisional until :meth:`done`)."""
        return self._current().gpu_energy_j

    @property
    def cpu_energy(self) -> dict[int, float] | None:
        """Joules per CPU package (RAPL ``package`` domain), or ``None`` without RAPL."""
        return self._current().cpu_energy_j

    @property
    def dram_energy(self) -> dict[int, float] | None:
        """Joules per CPU package (RAPL ``dram`` domain), or ``None`` when unavailable."""
        return self._current().dram_energy_j

    @property
    def total_energy(self) -> float:
        """GPU + CPU + DRAM joules."""
        m = self._current()
        total = sum(m.gpu_energy_j.values())
        for part in (m.cpu_energy_j, m.dram_energy_j):
            if part:
                total += sum(part.values())
        return total

    @property
    def methods(self) -> dict[str, str]:
        """How each device's figure was obtained (``gpu:0`` → ``counter+interpolated``...;
        provisional figures: ``integrated`` or ``integrated+extrapolated``)."""
        return self._current().methods

    @property
    def error_j(self) -> dict[str, float]:
        """Per device key, what the data around the edges leaves uncertain (J)."""
        return self._current().error_j

    @property
    def lost(self) -> list[str]:
        """Devices that failed during the window (known with the exact figures; waits)."""
        return self.wait().lost

    def _footprint_pair(self) -> tuple[Footprint, Footprint] | None:
        carbon = self._carbon
        if carbon is None or self.cancelled:
            return None
        pair = self._footprints
        if pair is not None:
            return pair
        m = self._current()
        gpu = sum(m.gpu_energy_j.values())
        total = gpu
        for part in (m.cpu_energy_j, m.dram_energy_j):
            if part:
                total += sum(part.values())
        t0, t1 = self.start_ns, self.end_ns
        cuts, pieces = self._cuts, self._pieces
        if m is self._measurement and cuts and pieces and len(pieces) == len(cuts) + 1:
            # Measured by an agent, which split the energy where the intensity changes: the
            # intensity weighted by the energy drawn under it, as in this process.
            points = [t0, *cuts, t1]
            every = PiecewiseEnergy(points, [p[0] for p in pieces], total)
            gpus = PiecewiseEnergy(points, [p[1] for p in pieces], gpu)
            pair = (carbon.between(every, t0, t1), carbon.between(gpus, t0, t1))
        else:
            # Only the totals (provisional figures; one intensity over the whole window,
            # where spreading is exact): the energy spread evenly over the window.
            pair = (carbon.spread(total, t0, t1), carbon.spread(gpu, t0, t1))
        if m is self._measurement:
            self._footprints = pair
        return pair

    @property
    def footprint(self) -> Footprint | None:
        """Emissions and cost of the window's energy, every device measured (GPU + CPU +
        DRAM, as :attr:`total_energy`), with the intensity's source, the PUE and the overhead
        (:class:`~zeus_async.carbon.Footprint`); ``None`` without a carbon configuration or
        for a cancelled window. Provisional while the energy is. A time-varying intensity is
        integrated against the energy timeline, in this process (``sampler="thread"``,
        ``Runtime``) as in another (the default ``sampler="process"``, a node agent: it
        splits the window's energy where the intensity changes)."""
        pair = self._footprint_pair()
        return None if pair is None else pair[0]

    @property
    def gpu_footprint(self) -> Footprint | None:
        """As :attr:`footprint`, for the GPUs' energy only (:func:`~zeus_async.ranks.job_footprint`
        sums it over the ranks, as ``job_energy`` sums GPU joules)."""
        pair = self._footprint_pair()
        return None if pair is None else pair[1]

    @property
    def co2e_g(self) -> float | None:
        """Grams CO2-equivalent of :attr:`footprint` (``None`` without a carbon configuration)."""
        pair = self._footprint_pair()
        return None if pair is None else pair[0].co2e_g

    @property
    def cost(self) -> float | None:
        """Money of :attr:`footprint`, in its ``currency`` (``None`` without a carbon
        configuration, or without a price)."""
        pair = self._footprint_pair()
        return None if pair is None else pair[0].cost

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled else ("exact" if self.done() else "pending")
        return f"WindowResult({self.name!r}, time={self.time:.6f}, {state})"


class _Closed:
    __slots__ = ("deadline_ns", "gpus", "result")

    def __init__(
        self, result: WindowResult, deadline_ns: int, gpus: frozenset[int] | None = None
    ) -> None:
        self.result = result
        self.deadline_ns = deadline_ns
        self.gpus = gpus


class WindowTracker:
    """Keeps device histories from the event stream and finalizes windows.

    Args:
        clock: The runtime's clock (edges are stamped with ``clock.wall_ns()``).
        host: Host id for the events it publishes.
        devices: The runtime's devices (their ``describe()``), to know which exist.
        publish: Non-blocking delivery of an event to the hub, called on the runtime's thread
            (``Runtime.publish_nowait``); window edges and measurements go through it.
        finalize_timeout_s: Bound on the wait for post-edge data.
        history_s: How much history to keep beyond the oldest open window.
        on_result: Called on the runtime's thread with each finished window's measurement
            (the sampler process sends it to the parent this way).
        board: Publish every power reading on a :class:`~zeus_async.aggregate.board.PowerBoard`
            (``True``: an anonymous one, read in this process; a path: a file other
            processes map; ``False``: none), so that closed windows have provisional figures
            at once. :attr:`board` is it; ``None`` when its file could not be created (a full
            or read-only directory: a warning, and the exact figures only).
        carbon: Emissions and cost of every window (:class:`~.footprints.Carbon`, or what
            ``Carbon.of`` takes): a time-varying intensity integrated against the devices'
            energy timeline when the window is finalized. ``None``: no carbon figures.
    """

    def __init__(
        self,
        clock: Clock,
        host: str,
        devices: Sequence[DeviceInfo],
        *,
        publish: Callable[[Event], Any] | None = None,
        finalize_timeout_s: float = 0.5,
        history_s: float = 30.0,
        on_result: Callable[[Measurement], None] | None = None,
        board: bool | str = True,
        carbon: Any = None,
    ) -> None:
        self.clock = clock
        self.carbon = Carbon.of(carbon)
        self.on_result = on_result
        self.host = host
        self._publish = publish
        self._timeout_ns = round(finalize_timeout_s * 1e9)
        self._history_ns = round(history_s * 1e9)
        self.histories: dict[str, DeviceHistory] = {}
        self.gpu_indices: list[int] = []
        self.cpu_packages: list[int] = []
        for info in devices:
            kind, _, num = info.key.partition(":")
            if kind == "gpu":
                self.gpu_indices.append(int(num))
                self.histories[info.key] = DeviceHistory(
                    info.key,
                    reading_lag_s=info.power_reading_lag_s,
                    reading_window_s=info.power_reading_window_s,
                    average_window_s=info.power_average_window_s,
                    average_period_s=info.power_average_period_s,
                    counter_period_s=info.energy_counter_period_s,
                )
            elif kind == "cpu":
                self.cpu_packages.append(int(num))
        self.board: PowerBoard | None = None
        self._board_reader: BoardReader | None = None
        if board is not False:
            keys = [f"gpu:{g}" for g in self.gpu_indices] + [
                f"cpu:{p}/{domain}" for p in self.cpu_packages for domain in ("package", "dram")
            ]
            try:
                self.board = PowerBoard(keys, None if board is True else board)
            except OSError as exc:
                # A full or read-only directory: no provisional figures, and nothing else lost.
                logger.warning(
                    "no power board (%s: %s): clients get no provisional window figures, only "
                    "the exact ones; sampling, windows and restores go on",
                    board,
                    exc.strerror or exc,
                )
            else:
                self._board_reader = self.board.reader()
        # Board keys of the devices a window measures, by its GPUs (None: all).
        self._board_keys: dict[frozenset[int] | None, dict[str, str]] = {}
        self._open: dict[str, tuple[int, int]] = {}
        # Open windows that measure some GPUs only (id -> GPU indices).
        self._gpus: dict[int, frozenset[int]] = {}
        self._open_lock = threading.Lock()
        self._edges: collections.deque[Event] = collections.deque()
        self._closed: list[_Closed] = []
        self._closed_lock = threading.Lock()
        self._short_warned = False
        self._trimmed_ns = clock.wall_ns()
        # Set by run_pump while it sleeps: ends the sleep (runtime thread only).
        self._poke: Callable[[], None] | None = None

    # -- edges (any thread) ---------------------------------------------------------------------

    def open(
        self,
        name: str,
        *,
        restart: bool = False,
        t_ns: int | None = None,
        window_id: int | None = None,
        gpus: frozenset[int] | None = None,
    ) -> int:
        """Open window ``name``; returns its id. Raises ``ValueError`` if already open.

        ``gpus``: the GPUs the window measures (CPU packages always); ``None``: every GPU.
        """
        t = self.clock.wall_ns() if t_ns is None else t_ns
        with self._open_lock:
            if name in self._open:
                if not restart:
                    raise ValueError(
                        f"measurement window {name!r} is already open; end it first, or pass "
                        "restart=True to discard it and start again"
                    )
                _, old_id = self._open.pop(name)
                self._edges.append(WindowClose(self.host, t, name, old_id, cancelled=True))
                logger.info("window %r restarted", name)
            if window_id is None:
                window_id = next(_window_ids)
            self._open[name] = (t, window_id)
            if gpus is not None:
                self._gpus[window_id] = gpus
        self._edges.append(WindowOpen(self.host, t, name, window_id))
        return window_id

    def close(self, name: str, *, cancel: bool = False, t_ns: int | None = None) -> WindowResult:
        """Close window ``name``; the result resolves on the runtime's thread."""
        t = self.clock.wall_ns() if t_ns is None else t_ns
        with self._open_lock:
            start, window_id = pop_open_window(self._open, name)
            gpus = self._gpus.pop(window_id, None) if self._gpus else None
        self._edges.append(WindowClose(self.host, t, name, window_id, cancelled=cancel))
        if cancel:
            return WindowResult.cancelled_result(name, window_id, start, t, host=self.host)
        result = WindowResult(name, window_id, start, t)
        result._carbon = self.carbon
        if self._board_reader is not None:
            result._estimate = functools.partial(self._provisional, self._keys_for(gpus))
        with self._closed_lock:
            self._closed.append(_Closed(result, t + self._timeout_ns, gpus))
        return result

    def _keys_for(self, gpus: frozenset[int] | None) -> dict[str, str]:
        keys = self._board_keys.get(gpus)
        if keys is None:
            assert self.board is not None
            keys = {
                k: k
                for k in self.board.keys
                if gpus is None or not k.startswith("gpu:") or int(k[4:]) in gpus
            }
            self._board_keys[gpus] = keys
        return keys

    def _provisional(self, keys: dict[str, str], result: WindowResult) -> Measurement | None:
        assert self._board_reader is not None
        return provisional_measurement(
            self._board_reader, result, keys, host=self.host, now_ns=self.clock.wall_ns()
        )

    def close_board(self) -> None:
        """Remove the board's file, if it has one (the runtime does it when it stops)."""
        if self.board is not None:
            self.board.close()

    @property
    def open_windows(self) -> list[str]:
        with self._open_lock:
            return list(self._open)

    # -- the runtime side ----------------------------------------------------------------------

    def _history(self, key: str, *, fine: bool = False) -> DeviceHistory:
        history = self.histories.get(key)
        if history is None:
            history = self.histories[key] = DeviceHistory(key, fine_counter=fine)
        return history

    def add(self, event: Event) -> None:
        """Account one event from the stream (runtime thread)."""
        board = self.board
        if isinstance(event, GpuSample):
            if (
                event.power_w is not None
                or event.energy_j is not None
                or event.avg_power_w is not None
            ):
                key = history_key(event)
                history = self._history(key)
                add_sample(history, event)
                if board is not None and event.power_w is not None:
                    board.add(key, event.t_ns, history.fresh_power(event.power_w))
        elif isinstance(event, RaplSample):
            if event.domain in ("package", "dram"):
                key = history_key(event)
                add_sample(self._history(key, fine=True), event)
                if board is not None:
                    board.add(key, event.t_ns, None, event.energy_j)
        elif isinstance(event, DeviceFault) and event.kind == "gpu_lost":
            self._history(event.device).mark_lost(event.t_ns)
        else:
            return
        poke = self._poke
        if poke is not None and (self._closed or self._edges):
            self._poke = None
            poke()

    def pump(self, *, force: bool = False) -> None:
        """Publish queued edge events and finalize every window whose data is complete.

        ``force`` finalizes every closed window now, with whatever data there is (shutdown).
        """
        publish = self._publish
        while self._edges:
            edge = self._edges.popleft()
            if publish is not None:
                publish(edge)
        now = self.clock.wall_ns()
        ready: list[_Closed] = []
        if self._closed:
            with self._closed_lock:
                ready = [
                    c for c in self._closed if force or now >= c.deadline_ns or self._complete(c)
                ]
                if ready:
                    self._closed = [c for c in self._closed if c not in ready]
            for item in ready:
                self._finish(item)
        # Trim after each finished window, and at least every second: with no window closing,
        # the histories would otherwise grow for as long as the runtime runs.
        if ready or now - self._trimmed_ns >= _TRIM_EVERY_NS:
            self._trimmed_ns = now
            self._trim(now)

    def _finish(self, item: _Closed) -> Measurement:
        measurement = self._measure(item.result, item.gpus)
        if self.carbon is not None:
            self._footprints(item, measurement)
        item.result._resolve(measurement)
        if self.on_result is not None:
            self.on_result(measurement)
        if self._publish is not None:
            self._publish(measurement)
        return measurement

    def _footprints(self, item: _Closed, m: Measurement) -> None:
        """The window's footprints (every device, GPUs only), the intensity in force at each
        instant weighted by the energy drawn then, set on its result before it resolves."""
        carbon = self.carbon
        assert carbon is not None
        result = item.result
        t0, t1 = result.start_ns, result.end_ns
        gpu = sum(m.gpu_energy_j.values())
        total = gpu + sum((m.cpu_energy_j or {}).values()) + sum((m.dram_energy_j or {}).values())
        histories = list(self._measured(item.gpus))

        def between(keys: list[Any], whole: float) -> Callable[[int, int], float]:
            pieces = history_energy_between(h for _, h in keys)

            def energy_between(a: int, b: int) -> float:
                # The whole window is the measurement's own figure (one intensity step: no
                # second pass over the histories).
                return whole if (a, b) == (t0, t1) else pieces(a, b)

            return energy_between

        try:
            result._footprints = (
                carbon.between(between(histories, total), t0, t1),
                carbon.between(between([h for h in histories if h[0][:4] == "gpu:"], gpu), t0, t1),
            )
        except Exception:
            # A source that cannot answer (no fallback): the window keeps its energy; reading
            # its footprint tries again and raises there.
            logger.exception("the footprint of window %r failed", result.name)

    def energy_pieces(
        self, points: Sequence[int], gpus: frozenset[int] | None = None
    ) -> list[tuple[float, float]]:
        """Joules between consecutive ``points`` (every device a window on ``gpus`` measures,
        and its GPUs only), from the histories kept: an agent sends them with a window's
        figures so that its client integrates a time-varying intensity (runtime thread)."""
        return energy_pieces(self._measured(gpus), points)

    def finalize(self, window_id: int) -> Measurement | None:
        """Finalize closed window ``window_id`` now, with the data there is (replays use it to
        finalize where the live run did). ``None`` when no such window awaits finalization."""
        with self._closed_lock:
            item = next((c for c in self._closed if c.result.window_id == window_id), None)
            if item is None:
                return None
            self._closed.remove(item)
        return self._finish(item)

    def _measured(self, gpus: frozenset[int] | None) -> Iterator[tuple[str, DeviceHistory]]:
        """The histories a window measures: every one, or ``gpus``' and every CPU's."""
        if gpus is None:
            yield from self.histories.items()
            return
        for key, history in self.histories.items():
            if not key.startswith("gpu:") or int(key[4:]) in gpus:
                yield key, history

    def _complete(self, item: _Closed) -> bool:
        end_ns = item.result.end_ns
        for _, history in self._measured(item.gpus):
            if history.lost_at_ns is not None and history.lost_at_ns <= end_ns:
                continue
            if not history.covers(end_ns):
                return False
        return True

    def _measure(self, result: WindowResult, gpus: frozenset[int] | None = None) -> Measurement:
        t0, t1 = result.start_ns, result.end_ns
        figures: dict[str, EnergyEstimate] = {}
        lost: list[str] = []
        for key, history in self._measured(gpus):
            figures[key] = history.energy(t0, t1)
            if history.lost_at_ns is not None and history.lost_at_ns <= t1:
                lost.append(key)
        if (
            not self._short_warned
            and t1 - t0 < 100_000_000
            and any(f.method.startswith("integrated") for f in figures.values())
        ):
            self._short_warned = True
            logger.warning(
                "window %r (%.1f ms) was measured from power samples only on some devices "
                "(no energy counter there); such figures are less exact than counter-based ones",
                result.name,
                (t1 - t0) / 1e6,
            )
        return window_measurement(
            host=self.host,
            t_ns=self.clock.wall_ns(),
            name=result.name,
            window_id=result.window_id,
            start_ns=t0,
            end_ns=t1,
            figures=figures,
            lost=lost,
        )

    def _trim(self, now_ns: int) -> None:
        with self._open_lock:
            oldest = min((t for t, _ in self._open.values()), default=now_ns)
        with self._closed_lock:
            oldest = min([oldest, *(c.result.start_ns for c in self._closed)])
        keep_from = min(oldest, now_ns - self._history_ns)
        for history in self.histories.values():
            history.trim_before(keep_from)

    def primed(self) -> bool:
        """Every GPU whose samples carry a counter has shown a few updates (interpolation
        anchors), and every other GPU has delivered a power sample."""
        for key, history in self.histories.items():
            if not key.startswith("gpu:") or history.lost_at_ns is not None:
                continue
            if history.last_t_ns is None:
                return False
            if history.has_counter and history.counter_updates < _PRIMING_UPDATES:
                return False
        return True

    async def wait_primed(self, timeout_s: float) -> bool:
        """Wait (bounded) until :meth:`primed`; windows opened before are measured partly
        from power samples. Returns whether priming completed.

        ``timeout_s`` is on the tracker's clock, as the samples are: under a fake clock the
        wait ends at the same stream time in every run, however loaded the machine (a
        real-time bound ended it early under load, and what came after moved with it). A
        real-time guard (:data:`_REAL_TIME_GUARD_S`) still ends it where nothing moves the
        clock."""
        deadline = self.clock.monotonic_ns() + round(timeout_s * 1e9)
        with anyio.move_on_after(max(_REAL_TIME_GUARD_S, 10 * timeout_s)):
            while not self.primed():
                if self.clock.monotonic_ns() >= deadline:
                    break
                await self._sleep(0.005)
            else:
                return True
        logger.info("windows: energy counters not primed within %.2f s", timeout_s)
        return False

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` of the tracker's clock; see :meth:`wait_primed`) until
        every closed window is finalized: before the samplers stop, so that their data still
        completes the last windows."""
        deadline = self.clock.monotonic_ns() + round(timeout_s * 1e9)
        with anyio.move_on_after(max(_REAL_TIME_GUARD_S, 10 * timeout_s)):
            while self._closed and self.clock.monotonic_ns() < deadline:
                await self._sleep(0.005)

    async def run(self, stream: ObjectReceiveStream[Event]) -> None:
        """Consume a stream (for replays and tests; the runtime uses :meth:`add` as a sink)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._tick)
            async for event in stream:
                self.add(event)
                self.pump()
            tg.cancel_scope.cancel()
        self.pump(force=True)

    async def run_pump(self, idle_s: float = 0.1) -> None:
        """Pump until cancelled, then finalize what is left.

        Used with :meth:`add` registered as a hub sink: samples are accounted synchronously
        as they are published (no stream, no task switch per event) and this task publishes
        edges and finished measurements. It sleeps until :meth:`add` accounts a sample while
        edges or closed windows wait, until the earliest closed window's deadline, or for
        ``idle_s`` (edges queued from another thread while no sample arrives), whichever
        comes first.
        """
        if not idle_s > 0:
            raise ValueError(f"idle_s must be positive, got {idle_s!r}")
        idle_ns = round(idle_s * 1e9)
        try:
            while True:
                delay_ns = idle_ns
                if self._closed:
                    with self._closed_lock:
                        first = min((c.deadline_ns for c in self._closed), default=None)
                    if first is not None:
                        delay_ns = max(0, min(delay_ns, first - self.clock.wall_ns()))
                with anyio.CancelScope() as scope:
                    self._poke = scope.cancel
                    await self.clock.sleep_until(self.clock.monotonic_ns() + delay_ns)
                self._poke = None
                self.pump()
        finally:
            self._poke = None
            self.pump(force=True)

    async def _tick(self) -> None:
        # Finalizes windows on their deadline even when no event arrives (no device, GPU lost).
        while True:
            await self._sleep(0.02)
            self.pump()

    async def _sleep(self, seconds: float) -> None:
        # On the tracker's clock: under a fake clock, priming and finalization then happen at
        # the same stream times in every run (a real-time poll would see the fake clock jump
        # by however much it did meanwhile).
        await self.clock.sleep_until(self.clock.monotonic_ns() + round(seconds * 1e9))


class ReplayedWindows:
    """Measures again the windows of a recorded or replayed stream, with the live code.

    Feed it every event of the stream in order (:meth:`add`, or run :meth:`run` as a runtime
    consumer of a replay): samples go to a :class:`WindowTracker` exactly as live, and the
    recorded ``WindowOpen``/``WindowClose`` edges open and close its windows at their recorded
    times. Time is the stream's own (the latest ``t_ns`` seen).

    When a window is finalized:

    * ``follow_recorded=True`` (default): where the stream holds the live ``Measurement`` of the
      window — the live tracker published it right after the last event it had used, so the
      replayed figures use exactly the same data and come out **identical** to the live ones.
      A closed window without a recorded measurement is finalized by :meth:`finish`.
    * ``follow_recorded=False``: by the live rules (data after the edge, or
      ``finalize_timeout_s`` of stream time), for streams whose windows were never measured.

    Args:
        devices: The devices of the recording (``RecordingReader.header.devices``); GPUs not
            listed are picked up from their samples.
        host: Host id of the recomputed measurements (default: that of the edges).
        finalize_timeout_s: As :class:`WindowTracker`.
        follow_recorded: See above.

    Attributes:
        results: Recomputed measurements, in the order they were finalized.
        recorded: The ``Measurement`` events found in the stream (what was measured live).
    """

    def __init__(
        self,
        devices: Sequence[DeviceInfo] = (),
        *,
        host: str | None = None,
        finalize_timeout_s: float = 0.5,
        follow_recorded: bool = True,
    ) -> None:
        self.results: list[Measurement] = []
        self.recorded: list[Measurement] = []
        self.follow_recorded = follow_recorded
        self._host = host
        self._devices = list(devices)
        self._finalize_timeout_s = finalize_timeout_s
        self._clock = FakeClock(wall_start_ns=0)
        # One tracker per host: a window of node1 measures node1's devices only, even where
        # node2 has devices with the same keys (a stream through a proxy).
        self._trackers: dict[str, WindowTracker] = {}

    def _tracker_of(self, host: str) -> WindowTracker:
        tracker = self._trackers.get(host)
        if tracker is None:
            tracker = self._trackers[host] = WindowTracker(
                self._clock,
                self._host if self._host is not None else host,
                self._devices,
                finalize_timeout_s=self._finalize_timeout_s,
                on_result=self.results.append,
                board=False,
            )
        return tracker

    def add(self, event: Event) -> None:
        """Account one event of the stream (in stream order)."""
        if event.t_ns > self._clock.monotonic_ns():
            self._clock.set_ns(event.t_ns)
        tracker = self._tracker_of(event.host)
        if isinstance(event, WindowOpen):
            tracker.open(event.name, t_ns=event.t_ns, window_id=event.window_id, restart=True)
        elif isinstance(event, WindowClose):
            if event.name in tracker.open_windows:
                tracker.close(event.name, cancel=event.cancelled, t_ns=event.t_ns)
        elif isinstance(event, Measurement):
            self.recorded.append(event)
            if self.follow_recorded:
                tracker.finalize(event.window_id)
        else:
            tracker.add(event)
        if not self.follow_recorded:
            for each in self._trackers.values():  # stream time moved for every host
                each.pump()

    def finish(self) -> list[Measurement]:
        """Finalize what is still pending (end of the stream); returns :attr:`results`."""
        for tracker in self._trackers.values():
            tracker.pump(force=True)
        return self.results

    async def run(self, stream: ObjectReceiveStream[Event]) -> None:
        """A runtime consumer: account every event of ``stream``, finish at its end."""
        async for event in stream:
            self.add(event)
        self.finish()
