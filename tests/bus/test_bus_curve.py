"""CURVE: authorized clients receive; unauthorized and plain clients are refused."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from bus_helpers import gpu

from zeus_async.bus import (
    CurveClientKeys,
    CurveServerKeys,
    Publisher,
    Subscriber,
    generate_certificates,
    load_client_keys,
    load_server_keys,
    run_proxy,
)
from zeus_async.errors import ConfigError
from zeus_async.events import GpuSample

pytestmark = pytest.mark.anyio

TIMEOUT = 10


@dataclass
class Keys:
    server: CurveServerKeys
    good: CurveClientKeys
    bad: CurveClientKeys
    server_open: CurveServerKeys  # same key pair, no client allow-list


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    root = tmp_path_factory.mktemp("curve")
    server_public, server_secret = generate_certificates(root / "server", "server")
    good_public, good_secret = generate_certificates(root / "clients", "good")
    _, bad_secret = generate_certificates(root / "clients", "bad")
    allowed = root / "allowed"
    allowed.mkdir()
    shutil.copy(good_public, allowed)
    assert oct(server_secret.stat().st_mode & 0o777) == "0o600"
    return Keys(
        server=load_server_keys(server_secret, allowed_clients_dir=allowed),
        good=load_client_keys(good_secret, server_public_file=server_public),
        bad=load_client_keys(bad_secret, server_public_file=server_public),
        server_open=load_server_keys(server_secret),
    )


@asynccontextmanager
async def running(pub: Publisher) -> AsyncIterator[Publisher]:
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        yield pub
        tg.cancel_scope.cancel()


async def test_only_authorized_clients_receive(keys: Keys) -> None:
    pub = Publisher("tcp://127.0.0.1:*", host="n1", curve=keys.server)
    async with (
        running(pub),
        Subscriber(pub.endpoint, topics=["gpu/"], curve=keys.good) as good,
        Subscriber(pub.endpoint, topics=["gpu/"], curve=keys.bad) as bad,
        Subscriber(pub.endpoint, topics=["gpu/"]) as plain,
    ):
        assert await good.wait_handshake(TIMEOUT) is True
        assert await bad.wait_handshake(TIMEOUT) is False
        assert await plain.wait_handshake(TIMEOUT) is False
        await good.wait_ready(timeout=TIMEOUT)
        pub.publish(gpu(1))
        with anyio.fail_after(TIMEOUT):
            async for event in good:
                assert event == gpu(1)
                break
        for refused in (bad, plain):
            with pytest.raises(TimeoutError, match="handshake failure"):
                await refused.wait_ready(timeout=0.05)
    assert bad.stats.frames_received == plain.stats.frames_received == 0
    assert "authentication refused" in bad.stats.last_handshake_error
    assert plain.stats.last_handshake_error  # mechanism mismatch, or the server hung up first
    assert good.stats.handshake_failures == 0


async def test_without_allow_list_any_curve_client_is_accepted(keys: Keys) -> None:
    pub = Publisher("tcp://127.0.0.1:*", host="n1", curve=keys.server_open)
    async with (
        running(pub),
        Subscriber(pub.endpoint, topics=["gpu/"], curve=keys.bad) as sub,
    ):
        await sub.wait_ready(timeout=TIMEOUT)
        pub.publish(gpu(2))
        with anyio.fail_after(TIMEOUT):
            async for event in sub:
                assert event == gpu(2)
                break


async def test_curve_through_the_proxy(keys: Keys, tmp_path: Path) -> None:
    """Publisher (CURVE) -> proxy (CURVE client upstream, CURVE server downstream) -> client."""
    pub = Publisher("tcp://127.0.0.1:*", host="n1", curve=keys.server)
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        out = await tg.start(
            lambda task_status: run_proxy(
                [pub.endpoint],
                "tcp://0.0.0.0:*",
                curve=keys.server,
                upstream_curve=keys.good,
                require_curve=True,
                task_status=task_status,
            )
        )
        async with Subscriber(out.replace("0.0.0.0", "127.0.0.1"), curve=keys.good) as sub:
            await sub.wait_ready(timeout=TIMEOUT)
            pub.publish(gpu(3))
            with anyio.fail_after(TIMEOUT):
                async for event in sub:
                    if isinstance(event, GpuSample):
                        assert event == gpu(3)
                        break
        tg.cancel_scope.cancel()


def test_key_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        CurveServerKeys(b"short", b"x" * 40)
    with pytest.raises(ConfigError):
        CurveServerKeys(b"x" * 40, b"x" * 40, allowed_clients_dir=tmp_path / "missing")
    with pytest.raises(ConfigError):
        CurveClientKeys(b"x" * 40, b"x" * 40, b"")
    with pytest.raises(ConfigError):
        load_server_keys(tmp_path / "missing.key_secret")
    public, _ = generate_certificates(tmp_path, "only")
    with pytest.raises(ConfigError, match="no secret"):
        load_server_keys(public)
    with pytest.raises(ConfigError, match="server_public"):
        load_client_keys(tmp_path / "only.key_secret")
