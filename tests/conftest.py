from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from zeus_async.testing.replay import ReplayRun, replay_recording


@pytest.fixture(autouse=True)
def private_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test gets its own private directory (``ZEUS_ASYNC_DIR``): agent socket, lease
    journals and simulated node state start empty and are never shared between tests. Child
    processes inherit it. Short (ipc paths are limited to ~107 bytes)."""
    path = tempfile.mkdtemp(prefix="za-")
    monkeypatch.setenv("ZEUS_ASYNC_DIR", path)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


DATA = Path(__file__).parent / "data"


@pytest.fixture
def recordings() -> Path:
    """The committed simulator recordings (see ``tests/data/make_recordings.py``)."""
    return DATA


@pytest.fixture
def replay() -> Callable[..., Awaitable[ReplayRun]]:
    """``await replay(path, speed=1.0, consumers=(), record=None)``: replay a recording into a
    runtime under a fake clock (no real time passes); see ``zeus_async.testing.replay``."""
    return replay_recording


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    """A short private directory for ipc socket paths (sun_path is limited to ~107 bytes)."""
    path = tempfile.mkdtemp(prefix="zb-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def ipc_endpoint(ipc_dir: str) -> str:
    return f"ipc://{ipc_dir}/bus.sock"
