from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    """A short private directory for ipc socket paths (sun_path is limited to ~107 bytes)."""
    path = tempfile.mkdtemp(prefix="zb-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def ipc_endpoint(ipc_dir: str) -> str:
    return f"ipc://{ipc_dir}/bus.sock"
