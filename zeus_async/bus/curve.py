"""CURVE security for bus sockets, built on :mod:`zmq.auth`.

CURVE (CurveZMQ) encrypts and authenticates a ZeroMQ connection with Curve25519 key pairs. The
server side (the publisher, the proxy's downstream socket) holds a key pair; every client holds
its own key pair and knows the server's public key. The server accepts:

* any client that completes the CURVE handshake, when ``allowed_clients_dir`` is ``None``
  (the connection is still encrypted, and a client must know the server's public key);
* only clients whose public key is in a certificate file of ``allowed_clients_dir``, checked by a
  ZAP authenticator (:func:`start_authenticator`) running on the server's context.

Keys are the 40-character Z85 text that ``zmq.auth`` writes to certificate files
(``<name>.key`` holds the public key, ``<name>.key_secret`` both).

Typical setup::

    server_pub, server_sec = generate_certificates(keys_dir, "server")
    client_pub, client_sec = generate_certificates(keys_dir / "clients", "dashboard")
    server = load_server_keys(server_sec, allowed_clients_dir=keys_dir / "clients")
    client = load_client_keys(client_sec, server_public_file=server_pub)
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from ..errors import ConfigError

__all__ = [
    "CurveClientKeys",
    "CurveServerKeys",
    "apply_client_keys",
    "apply_server_keys",
    "generate_certificates",
    "load_client_keys",
    "load_server_keys",
    "start_authenticator",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurveServerKeys:
    """Key material of a CURVE server socket.

    Attributes:
        public: Server public key (Z85, 40 bytes).
        secret: Server secret key (Z85, 40 bytes).
        allowed_clients_dir: Directory of client public certificates allowed to connect, or
            ``None`` to accept every client that completes the CURVE handshake.
    """

    public: bytes
    secret: bytes
    allowed_clients_dir: Path | None = None

    def __post_init__(self) -> None:
        _check_key(self.public, "server public")
        _check_key(self.secret, "server secret")
        if self.allowed_clients_dir is not None and not Path(self.allowed_clients_dir).is_dir():
            raise ConfigError(f"allowed_clients_dir {self.allowed_clients_dir} is not a directory")


@dataclass(frozen=True)
class CurveClientKeys:
    """Key material of a CURVE client socket.

    Attributes:
        public: Client public key (Z85, 40 bytes).
        secret: Client secret key (Z85, 40 bytes).
        server_public: Public key of the server to connect to (Z85, 40 bytes).
    """

    public: bytes
    secret: bytes
    server_public: bytes

    def __post_init__(self) -> None:
        _check_key(self.public, "client public")
        _check_key(self.secret, "client secret")
        _check_key(self.server_public, "server public")


def _check_key(key: bytes, what: str) -> None:
    if not isinstance(key, bytes) or len(key) != 40:
        raise ConfigError(f"{what} key must be 40 bytes of Z85 text")


def generate_certificates(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Create a key pair as certificate files ``<name>.key`` and ``<name>.key_secret``.

    The directory is created (mode 0700) if missing; the secret file is readable by its owner
    only.

    Returns:
        (public certificate path, secret certificate path).
    """
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(d), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load CURVE certificate {path}: {exc}") from exc
    return public, secret


def load_server_keys(
    secret_file: str | os.PathLike[str],
    *,
    allowed_clients_dir: str | os.PathLike[str] | None = None,
) -> CurveServerKeys:
    """Load a server key pair from its secret certificate file.

    Raises:
        ConfigError: Missing or invalid file, or a public-only certificate.
    """
    public, secret = _load(secret_file)
    if secret is None:
        raise ConfigError(f"{secret_file} holds no secret key")
    allowed = Path(allowed_clients_dir) if allowed_clients_dir is not None else None
    return CurveServerKeys(public, secret, allowed)


def load_client_keys(
    secret_file: str | os.PathLike[str],
    *,
    server_public_file: str | os.PathLike[str] | None = None,
    server_public: bytes | None = None,
) -> CurveClientKeys:
    """Load a client key pair and the server's public key (from a file or given directly).

    Raises:
        ConfigError: Missing or invalid file, or no server public key given.
    """
    public, secret = _load(secret_file)
    if secret is None:
        raise ConfigError(f"{secret_file} holds no secret key")
    if server_public is None:
        if server_public_file is None:
            raise ConfigError("give server_public_file or server_public")
        server_public, _ = _load(server_public_file)
    return CurveClientKeys(public, secret, server_public)


def apply_server_keys(sock: zmq.Socket[Any], keys: CurveServerKeys) -> None:
    """Make ``sock`` a CURVE server (call before bind)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def apply_client_keys(sock: zmq.Socket[Any], keys: CurveClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is in ``keys`` (before
    connect)."""
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)


def start_authenticator(
    context: zmq.Context[Any], keys: CurveServerKeys
) -> zmq.auth.Authenticator | None:
    """Start a ZAP authenticator on ``context`` allowing the clients in
    ``keys.allowed_clients_dir``.

    On asyncio this is :class:`zmq.auth.asyncio.AsyncioAuthenticator` (a task of the running
    loop); on other backends (trio) :class:`zmq.auth.thread.ThreadAuthenticator`. Only one
    authenticator can run per context; stop it with ``.stop()`` before closing the context.

    Returns:
        The started authenticator, or ``None`` when every CURVE client is allowed
        (``allowed_clients_dir`` is ``None``) and no authenticator is needed.
    """
    if keys.allowed_clients_dir is None:
        return None
    auth: zmq.auth.Authenticator
    try:
        asyncio.get_running_loop()
        on_asyncio = True
    except RuntimeError:
        on_asyncio = False
    if on_asyncio:
        from zmq.auth.asyncio import AsyncioAuthenticator

        auth = AsyncioAuthenticator(context, log=logger)
    else:
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(context, log=logger)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.allowed_clients_dir))
    return auth
