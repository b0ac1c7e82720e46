"""Endpoint policy: default endpoint, loopback detection, the secure-by-default bind check."""

from __future__ import annotations

import ipaddress
import logging
import socket
from pathlib import Path

from .._paths import private_dir
from ..errors import ConfigError

__all__ = ["check_bind_endpoint", "default_endpoint", "is_local_endpoint"]

logger = logging.getLogger(__name__)

_LOOPBACK_NAMES = frozenset({"localhost", "lo", "lo0", "ip6-localhost", "ip6-loopback"})


def default_endpoint() -> str:
    """The default publisher endpoint: ``bus.sock`` in the per-user private directory.

    The directory (:func:`zeus_async._paths.private_dir`: ``$XDG_RUNTIME_DIR/zeus-async`` or
    ``<tmp>/zeus-async-<uid>``) is created with mode 0700 and checked for owner and mode, so
    only the owning user can connect, and a directory another user made first is refused.

    Raises:
        ConfigError: The private directory is not safe to use.
    """
    return f"ipc://{private_dir() / 'bus.sock'}"


def _tcp_host(endpoint: str) -> str:
    rest = endpoint.split("://", 1)[1]
    # tcp://[iface;]host:port, host may be [v6]; the part after ';' is the bind address.
    if ";" in rest:
        rest = rest.split(";", 1)[1]
    rest = rest.split("/", 1)[0]  # ws://host:port/path
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise ConfigError(f"tcp endpoint without a port: {endpoint!r}")
    if port != "*" and not (port.isdigit() and int(port) <= 65535):
        # libzmq would take 99999 modulo 65536 and bind another port without a word.
        raise ConfigError(f"tcp port must be 0..65535 or '*', got {port!r} in {endpoint!r}")
    return host.strip("[]")


def is_local_endpoint(endpoint: str) -> bool:
    """Whether binding ``endpoint`` keeps the socket on this host (ipc, inproc or loopback tcp).

    Raises:
        ConfigError: The endpoint is not of the form ``transport://address``.
    """
    if "://" not in endpoint:
        raise ConfigError(f"endpoint must look like transport://address, got {endpoint!r}")
    transport = endpoint.split("://", 1)[0].lower()
    if transport in ("ipc", "inproc"):
        return True
    if transport not in ("tcp", "ws", "wss"):
        return False
    host = _tcp_host(endpoint)
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: may leave the host


def check_bind_endpoint(endpoint: str, *, curve: bool, require_curve: bool, what: str) -> None:
    """Apply the secure-by-default policy before binding ``endpoint``.

    A socket that may be reached from other hosts without CURVE logs a warning, or raises when
    ``require_curve`` is set. An ipc path that another live process is listening on raises
    (libzmq would silently take the path over).

    Raises:
        ConfigError: Policy violated, or the ipc endpoint is in use.
    """
    if not is_local_endpoint(endpoint):  # (which also checks the endpoint's form)
        if require_curve and not curve:  # an unknown transport too: refusing is safe
            raise ConfigError(
                f"{what}: endpoint {endpoint!r} may be reachable from other hosts and "
                "require_curve=True, but no CURVE keys were given"
            )
        if not curve and endpoint.lower().startswith(_NETWORK_SCHEMES):
            logger.warning(
                "%s: binding %s without CURVE: anyone who can reach this host can connect "
                "(give CURVE keys to encrypt and authenticate)",
                what,
                endpoint,
            )
    if endpoint.startswith("ipc://"):
        _check_ipc_path(endpoint[len("ipc://") :], what)


#: Transports that other hosts can reach: every libzmq transport but ipc and inproc (an
#: unknown one fails to bind, and says so).
_NETWORK_SCHEMES = (
    "tcp://", "ws://", "wss://", "udp://", "pgm://", "epgm://", "norm://", "tipc://", "vmci://",
)  # fmt: skip


def _check_ipc_path(path: str, what: str) -> None:
    if not path or path.startswith("@") or path == "*":
        return  # abstract namespace or a random path: nothing on disk
    p = Path(path)
    if p.parent and not p.parent.exists():
        try:
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{what}: cannot create directory for {path!r}: {exc}") from exc
    if not p.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(p))
    except OSError:
        return  # stale socket file: libzmq replaces it
    finally:
        probe.close()
    raise ConfigError(f"{what}: ipc endpoint {path!r} is in use by another process")
