"""XSUB → XPUB forwarder: one endpoint that relays many node publishers to many subscribers.

The proxy connects an XSUB socket to every node publisher and binds an XPUB socket for the
subscribers. Frames travel downstream byte for byte (stream ids and sequence numbers are
preserved end to end, so a subscriber behind the proxy detects gaps exactly as if connected
directly); subscription messages travel upstream. The XPUB socket is ``XPUB_VERBOSE``, so every
subscriber's subscription reaches the publishers, which answer each one with their StreamInfo:
the readiness handshake works through the proxy.

A frame the proxy drops (a slow downstream subscriber at its high-water mark) is a gap in the
sequence numbers like any other. The forwarding loop is libzmq's ``zmq_proxy_steerable`` running
in a worker thread, stopped through its control socket when the calling task is cancelled.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread
import zmq
from anyio.abc import TaskStatus

from ..errors import ConfigError
from ._endpoints import check_bind_endpoint
from ._sockets import last_endpoint
from .curve import (
    CurveClientKeys,
    CurveServerKeys,
    apply_client_keys,
    apply_server_keys,
    start_authenticator,
)

__all__ = ["run_proxy"]

logger = logging.getLogger(__name__)


async def run_proxy(
    in_endpoints: Sequence[str],
    out_endpoint: str,
    *,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
    curve: CurveServerKeys | None = None,
    upstream_curve: CurveClientKeys | Mapping[str, CurveClientKeys] | None = None,
    require_curve: bool = False,
    hwm: int = 10_000,
    linger_s: float = 0.25,
    context: zmq.Context[Any] | None = None,
) -> None:
    """Forward frames from node publishers to subscribers until cancelled.

    Use ``endpoint = await task_group.start(run_proxy, [...], "tcp://127.0.0.1:*")``: the
    task reports the resolved downstream endpoint once bound and connected.

    Args:
        in_endpoints: Publisher endpoints to connect to (upstream).
        out_endpoint: Endpoint to bind for subscribers (downstream); same security policy as
            the publisher's.
        task_status: Receives the resolved ``out_endpoint``.
        curve: Server keys for the downstream socket.
        upstream_curve: Client keys to connect to CURVE publishers: one set for all, or a
            mapping from endpoint to keys (endpoints absent from it connect without CURVE).
        require_curve: Refuse to bind a non-local ``out_endpoint`` without CURVE.
        hwm: High-water mark of both sockets, in frames.
        linger_s: Linger of both sockets on close.
        context: ZeroMQ context; by default the proxy creates and terminates its own.

    Raises:
        ConfigError: No upstream endpoint, bad or insecure endpoint, bind/connect failure.
    """
    if isinstance(in_endpoints, str):
        in_endpoints = [in_endpoints]
    if not in_endpoints:
        raise ConfigError("run_proxy needs at least one upstream endpoint")
    check_bind_endpoint(
        out_endpoint, curve=curve is not None, require_curve=require_curve, what="proxy"
    )
    linger_ms = round(linger_s * 1000)
    own_context = context is None
    ctx: zmq.Context[Any] = zmq.Context() if context is None else context
    frontend: zmq.Socket[Any] = ctx.socket(zmq.XSUB, socket_class=zmq.Socket)
    backend: zmq.Socket[Any] = ctx.socket(zmq.XPUB, socket_class=zmq.Socket)
    control: zmq.Socket[Any] = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
    control_peer: zmq.Socket[Any] = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
    auth = None
    try:
        for s in (frontend, backend, control, control_peer):
            s.setsockopt(zmq.LINGER, linger_ms)
        frontend.setsockopt(zmq.RCVHWM, hwm)
        backend.setsockopt(zmq.SNDHWM, hwm)
        backend.setsockopt(zmq.XPUB_VERBOSE, 1)
        if curve is not None:
            auth = start_authenticator(ctx, curve)
            apply_server_keys(backend, curve)
        try:
            backend.bind(out_endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"proxy cannot bind {out_endpoint!r}: {exc}") from exc
        resolved = last_endpoint(backend)
        plan = [
            (ep, upstream_curve.get(ep) if isinstance(upstream_curve, Mapping) else upstream_curve)
            for ep in in_endpoints
        ]
        # Each connect snapshots the socket's security options: plain connections first, then
        # each CURVE one with its own server key.
        plan.sort(key=lambda item: item[1] is not None)
        for ep, keys in plan:
            if keys is not None:
                apply_client_keys(frontend, keys)
            try:
                frontend.connect(ep)
            except zmq.ZMQError as exc:
                raise ConfigError(f"proxy cannot connect to {ep!r}: {exc}") from exc
        control_addr = f"inproc://zeus-async-proxy-{uuid.uuid4()}"
        control.bind(control_addr)
        control_peer.connect(control_addr)

        def forward() -> None:
            # The sockets were created on the loop thread; starting and joining this thread are
            # the full memory barriers ZeroMQ requires to migrate them.
            try:
                zmq.proxy_steerable(frontend, backend, None, control_peer)
            except zmq.ContextTerminated:  # pragma: no cover - context closed under us
                pass

        logger.info("proxy %s -> %s running", ", ".join(in_endpoints), resolved)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, forward)
            task_status.started(resolved)
            try:
                await anyio.sleep_forever()
            finally:
                # Stops the forwarding thread; the task group then waits for it to return.
                control.send(b"TERMINATE")
    finally:
        for s in (frontend, backend, control, control_peer):
            s.close(linger=linger_ms)
        if auth is not None:
            auth.stop()
        if own_context:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(ctx.term)
        logger.info("proxy to %s stopped", out_endpoint)
