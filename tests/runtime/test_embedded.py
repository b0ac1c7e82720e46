"""EmbeddedRuntime: the runtime on a background thread under synchronous code."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import anyio
import pytest

from zeus_async.clock import RealClock
from zeus_async.errors import ConfigError, sole_exception
from zeus_async.events import Event, GpuSample, WindowOpen
from zeus_async.runtime import EmbeddedRuntime, Runtime
from zeus_async.testing.fakes import ScriptedGpu

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def test_embedded_runtime_runs_on_its_own_thread_and_stops_cleanly() -> None:
    clock = RealClock()
    gpus = [ScriptedGpu(0, clock), ScriptedGpu(1, clock)]
    got: list[Event] = []
    enough = threading.Event()

    async def consumer(stream: anyio.abc.ObjectReceiveStream[Event]) -> None:
        async for e in stream:
            got.append(e)
            if sum(isinstance(x, GpuSample) for x in got) >= 10:
                enough.set()

    rt = EmbeddedRuntime(devices=gpus, host="h", period_s=0.005, consumers=[consumer])
    with rt:
        assert rt.running and rt.runtime is not None
        loop_thread = rt.call(_current_thread_name)
        assert loop_thread != threading.current_thread().name
        rt.publish_soon(WindowOpen("h", 1, "step", 7))
        assert enough.wait(timeout=10)
    assert not rt.running
    rt.stop()  # idempotent
    assert any(isinstance(e, WindowOpen) and e.window_id == 7 for e in got)
    assert {e.gpu for e in got if isinstance(e, GpuSample)} == {0, 1}


async def _current_thread_name() -> str:
    return threading.current_thread().name


def test_embedded_runtime_propagates_startup_errors() -> None:
    rt = EmbeddedRuntime(devices=[], period_s=-1)
    with pytest.raises(ValueError, match="period_s must be positive"):
        rt.start()
    assert not rt.running


def test_runtime_rejects_bad_cpus_argument() -> None:
    with pytest.raises(ValueError, match="cpus must be"):
        Runtime([], cpus="all")


def test_a_malformed_publish_endpoint_fails_at_once() -> None:
    from zeus_async.bus import Publisher

    with pytest.raises(ConfigError, match="transport://address"):
        Publisher("bogus", host="h")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_publisher_that_cannot_start_raises_its_own_error(
    anyio_backend: str, tmp_path: Path
) -> None:
    # The second runtime's publisher fails in its task, before reporting ready: the task group
    # holds that error in a group of one, and the caller must get the ConfigError itself.
    endpoint = f"ipc://{tmp_path / 'bus.sock'}"
    async with Runtime([], cpus=None, publish=endpoint):
        with pytest.raises(ConfigError, match="in use by another process"):
            async with Runtime([], cpus=None, publish=endpoint):
                pass


def test_sole_exception_unwraps_groups_of_one_only() -> None:
    error = ConfigError("x")
    group = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [error])])
    assert sole_exception(group) is error
    assert sole_exception(error) is error
    two = BaseExceptionGroup("two", [error, ValueError("y")])
    assert sole_exception(two) is two
