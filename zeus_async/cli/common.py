"""Pieces shared by the CLI's command modules: running a command under signal handling,
argument types, exit codes and the one-line error. Imports no other CLI module."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

import anyio
import anyio.abc
import msgspec

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..bus import Subscriber

__all__ = [
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_USAGE",
    "CliError",
    "Command",
    "Interrupted",
    "describe_error",
    "positive_float",
    "run_command",
    "stop_on_signals",
    "until_stopped",
    "wait_for_publisher",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """An error to report as one line on stderr."""


def service_backend(backend: str, command: str) -> str:
    """The backend a long-running service (``agent``, ``exporter``) samples: ``auto`` is NVML,
    and on a machine with no NVIDIA driver an error asking for ``--backend sim`` — a service
    must never serve simulated GPUs to a fleet without being told to (``monitor``, the demo,
    falls back and says so in its banner).

    Raises:
        CliError: ``auto`` and no NVIDIA driver here.
        DeviceError: ``auto`` and a driver that is installed but fails (typed).
    """
    from ..devices import auto_backend, is_simulated

    if backend != "auto":
        return backend
    chosen = auto_backend()
    if is_simulated(chosen):
        raise CliError(
            f"no NVIDIA driver on this machine; {command} serves real GPUs only unless told "
            "otherwise: run it with --backend sim to serve simulated ones"
        )
    return chosen


# -- argument helpers ---------------------------------------------------------------------------


def backend_arg(text: str) -> str:
    """``--backend``: one of the backends of :mod:`zeus_async.devices`, or real ones joined by
    ``+`` (``nvml+amd``)."""
    from ..devices import resolve_backend

    if text == "auto":
        return text
    try:
        return resolve_backend(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


BACKEND_HELP = (
    "auto (every GPU vendor present, else simulated NVIDIA GPUs), nvml, amd, jetson, apple, "
    "sim (simulated NVIDIA), sim-amd, sim-jetson, sim-apple, or real ones joined by + "
    "(nvml+amd)"
)


#: ``--power-scope``'s choices (:data:`zeus_async.devices.nvml.POWER_SCOPES`).
POWER_SCOPE_CHOICES = ("gpu", "module", "auto")


def add_power_scope_arg(parser: argparse.ArgumentParser) -> None:
    """``--power-scope`` (NVIDIA GPUs' power scope; see :mod:`zeus_async.devices.nvml`)."""
    parser.add_argument(
        "--power-scope",
        choices=POWER_SCOPE_CHOICES,
        default="gpu",
        help="NVIDIA power scope: gpu (the GPU alone, its energy counter), module (a Grace "
        "superchip's GPU + CPU + memory, integrated power; refused on other GPUs) or auto "
        "(gpu where answered, else module)",
    )


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 0,1 — got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one index, like 0 or 0,1")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"indices must be >= 0, got {text!r}")
    return values


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _seconds_at_least(what: str, minimum: float, shown: str) -> Callable[[str], float]:
    """argparse type: a positive number of seconds, at least ``minimum`` (``shown`` in the
    message: ``1 ms``, ``0.05 s``)."""

    def parse(text: str) -> float:
        value = positive_float(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"a {what} of {text} s is below the {shown} minimum")
        return value

    return parse


#: The shortest sampling period the CLI accepts (s): one NVML read takes tens of µs, and
#: the driver refreshes power every few ms at best.
MIN_PERIOD_S = 0.001
period = _seconds_at_least("sampling period", MIN_PERIOD_S, "1 ms")

#: The fastest table refresh the CLI accepts (s): faster flickers, and costs CPU for nothing.
MIN_REFRESH_S = 0.05
refresh = _seconds_at_least("refresh", MIN_REFRESH_S, "0.05 s")


def sim_config(text: str | None) -> Any:
    if text is None:
        return None
    from ..devices.sim import SimConfig

    raw = Path(text).read_bytes() if not text.lstrip().startswith("{") else text.encode()
    try:
        return msgspec.json.decode(raw, type=SimConfig)
    except msgspec.DecodeError as exc:
        raise CliError(f"invalid --sim-config: {exc}") from None


#: A command: ``(args, out) -> exit status``, run by :func:`run_command`.
Command = Callable[[argparse.Namespace, TextIO], Coroutine[Any, Any, int]]


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: its exit code, or 128 + N when signal N killed
    it (Popen's ``-N``; a Ctrl-C in a terminal reaches the command too: 130)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_error(exc: BaseException) -> str:
    """One line for the user: ``path: reason`` for a file error, else the message."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


#: Set on the first SIGINT/SIGTERM while a command runs under :func:`run_command`.
_stop_requested: ContextVar[anyio.Event | None] = ContextVar("_stop_requested", default=None)
#: The number of that signal (one slot, filled by the watcher).
_stop_signal: ContextVar[list[int] | None] = ContextVar("_stop_signal", default=None)


async def _watch_signals(
    stop: anyio.Event, received: list[int], *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    """Set ``stop`` on the first SIGINT or SIGTERM, then give the handlers back (a second
    Ctrl-C interrupts as usual)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            received.append(int(signum))
            stop.set()
            return


def stop_signal() -> int | None:
    """The signal that stopped the running command (SIGINT, SIGTERM), if one did."""
    received = _stop_signal.get()
    return received[0] if received else None


async def run_command(
    command: Callable[[argparse.Namespace, TextIO], Awaitable[int]],
    args: argparse.Namespace,
    out: TextIO,
) -> int:
    """Run one CLI command with SIGINT/SIGTERM caught before it starts; its exit status (128 +
    the signal's number when a signal stopped a command that would have returned 0).

    A command prints its ready line (an endpoint, "Ctrl-C to stop") before it enters
    :func:`until_stopped`; a signal sent as soon as that line is read must still end the
    command cleanly rather than interrupt it with exit status 130.
    """
    stop = anyio.Event()
    received: list[int] = []
    token = _stop_requested.set(stop)
    signal_token = _stop_signal.set(received)
    error: BaseException | None = None
    code = 1
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(_watch_signals, stop, received)
            try:
                code = await command(args, out)
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:  # re-raised as itself, not in a task group's group
                error = exc
            tg.cancel_scope.cancel()
    finally:
        _stop_requested.reset(token)
        _stop_signal.reset(signal_token)
    if error is not None:
        raise error
    if received and code == EXIT_OK:
        # Stopped by Ctrl-C or SIGTERM: the status of a process that signal killed (130,
        # 143), as a shell, top or nvitop report it — on every command, not success.
        return 128 + received[0]
    return code


async def stop_on_signals(scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` on the first SIGINT or SIGTERM (Ctrl-C ends a command cleanly).

    The signal is caught by :func:`run_command`, and may have come already, before the body
    started.
    """
    stop = _stop_requested.get()
    if stop is None:
        raise RuntimeError("until_stopped() runs only inside run_command()")
    await stop.wait()
    scope.cancel()


@asynccontextmanager
async def until_stopped(duration: float | None = None) -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group for a command's body: cancelled after ``duration`` seconds (when given) or
    on the first SIGINT/SIGTERM, and ended (with the tasks the body started) when the body
    returns."""
    with anyio.CancelScope() as scope:
        if duration is not None:
            scope.deadline = anyio.current_time() + duration
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, scope)
            yield tg
            tg.cancel_scope.cancel()


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (counts such as ``--count``)."""
    return _whole_number(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _whole_number(text, 0)


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) stopped the command before it got anywhere: one line, and the exit
    status of a process that signal killed (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        #: The signal (taken when raised, while the command's context knows it).
        self.signum = stop_signal() or signal.SIGINT

    @property
    def status(self) -> int:
        return 128 + int(self.signum)


async def wait_for_publisher(sub: Subscriber, endpoints: Sequence[str], timeout: float) -> None:
    """Wait for one stream's handshake; a clear error when nobody answers in time, and
    :class:`Interrupted` on Ctrl-C meanwhile."""
    stop = _stop_requested.get()
    timed_out = False
    async with anyio.create_task_group() as tg:
        if stop is not None:

            async def cancel_on_stop() -> None:
                await stop.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_on_stop)
        try:
            await sub.wait_ready(streams=1, timeout=timeout)
        except TimeoutError:
            timed_out = True
        tg.cancel_scope.cancel()
    if stop is not None and stop.is_set():
        raise Interrupted(f"interrupted before a publisher answered at {', '.join(endpoints)}")
    if timed_out:
        raise ConfigError(f"no publisher answered at {', '.join(endpoints)} within {timeout:g} s")


async def in_thread_until_stopped(fn: Callable[[], T], stop: threading.Event) -> T:
    """Run ``fn`` in a worker thread, setting ``stop`` on SIGINT/SIGTERM (``fn`` watches it and
    returns or raises soon after): a long computation that Ctrl-C ends within its own
    polling interval, not only at its end."""
    requested = _stop_requested.get()
    outcome: list[Any] = []
    async with anyio.create_task_group() as tg:
        if requested is not None:

            async def relay() -> None:
                await requested.wait()
                stop.set()

            tg.start_soon(relay)
        try:
            outcome.append(await anyio.to_thread.run_sync(fn))
        except Exception as exc:  # raised as itself below, not in the task group's group
            outcome.append(exc)
        tg.cancel_scope.cancel()
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return typing.cast("T", outcome[0])


def fmt_cell(value: float | int | None, scale: float = 1.0, digits: int = 1) -> str:
    """A table cell: ``value / scale`` with ``digits`` decimals, ``-`` when unknown."""
    if value is None:
        return "-"
    return f"{value / scale:.{digits}f}"


def streams_ended(stats: Any, now: float | None = None) -> bool:
    """Every stream seen so far has sent its end (FINAL) or gone silent (no frame for
    :data:`~zeus_async.bus.subscriber.SILENT_AFTER_S`: killed, or cut off); at least one was
    seen. What ``--until-end`` waits for."""
    now = time.monotonic() if now is None else now
    return bool(stats.streams) and all(
        st.finished or st.silent(now) for st in stats.streams.values()
    )


async def stop_when_streams_end(stats: Any, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` once :func:`streams_ended` (checked as frames arrive, and here for a
    stream that goes silent: no frame wakes a receiving loop then)."""
    while not streams_ended(stats):
        await anyio.sleep(0.25)
    scope.cancel()


def report_streams(stats: Any) -> None:
    """On stderr, one line per stream that lost frames or whose tail is not known."""
    now = time.monotonic()
    for st in stats.streams.values():
        if st.frames_lost or not st.finished:
            sys.stderr.write(f"zeus-async: {st.describe(now)}\n")
