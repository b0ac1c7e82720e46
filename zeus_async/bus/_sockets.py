"""Typed accessors for the ZeroMQ socket options the bus reads (pyzmq types them loosely)."""

from __future__ import annotations

import logging
from typing import Any, cast

import zmq

__all__ = ["last_endpoint", "poll_in", "socket_fd"]

logger = logging.getLogger(__name__)


def poll_in(sock: zmq.Socket[Any]) -> bool:
    """Whether a message can be received now. Reading ``ZMQ_EVENTS`` also re-arms ``ZMQ_FD``."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def socket_fd(sock: zmq.Socket[Any]) -> int:
    """The socket's ``ZMQ_FD``: readable (edge-triggered) when its events may have changed."""
    return cast(int, sock.getsockopt(zmq.FD))


def last_endpoint(sock: zmq.Socket[Any]) -> str:
    """The endpoint the socket last bound, with the real port of a ``*``/``0`` port."""
    return cast(bytes, sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
