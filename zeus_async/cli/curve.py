"""CURVE options of the CLI (:mod:`zeus_async.bus.curve`) and ``zeus-async curve-keys``.

A command that binds a ZeroMQ endpoint (``monitor --publish``, ``agent --publish``,
``replay --publish``, ``proxy --out``) takes the server side::

    --curve-secret FILE   this endpoint's secret certificate (from `zeus-async curve-keys`)
    --curve-allow DIR     accept only the clients whose public certificates are in DIR

A command that connects (``subscribe``, ``record``, ``exporter --connect``, ``proxy --in``)
takes the client side::

    --curve-secret FILE   this client's secret certificate
    --curve-server FILE   the server's public certificate (its ``.key`` file)

(``proxy`` connects and binds: its upstream options are ``--in-curve-secret`` and
``--in-curve-server``.) Keys travel as certificate files only, never on the command line,
where other users could read them in the process list.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, TextIO

from ..bus.curve import (
    CurveClientKeys,
    CurveServerKeys,
    generate_certificates,
    load_client_keys,
    load_server_keys,
)
from .common import CliError, Command

__all__ = [
    "COMMANDS",
    "add_client_curve_args",
    "add_parsers",
    "add_server_curve_args",
    "client_curve_from_args",
    "server_curve_from_args",
]

logger = logging.getLogger(__name__)


def add_server_curve_args(parser: Any, *, what: str = "--publish") -> None:
    """``--curve-secret FILE`` and ``--curve-allow DIR`` for the endpoint this command binds."""
    parser.add_argument(
        "--curve-secret",
        metavar="FILE",
        default=None,
        help=f"encrypt {what} with CURVE: this endpoint's secret certificate "
        "(made by `zeus-async curve-keys`)",
    )
    parser.add_argument(
        "--curve-allow",
        metavar="DIR",
        default=None,
        help="with --curve-secret: accept only clients whose public certificates are in DIR "
        "(default: any client that knows this endpoint's public key)",
    )


def add_client_curve_args(parser: Any, *, prefix: str = "--", what: str = "the endpoints") -> None:
    """``--curve-secret FILE`` and ``--curve-server FILE`` to connect to CURVE servers
    (``prefix`` ``--in-`` gives ``--in-curve-secret``...)."""
    parser.add_argument(
        f"{prefix}curve-secret",
        metavar="FILE",
        default=None,
        help=f"connect to {what} with CURVE: this client's secret certificate",
    )
    parser.add_argument(
        f"{prefix}curve-server",
        metavar="FILE",
        default=None,
        help="with the secret: the server's public certificate (its .key file)",
    )


def server_curve_from_args(
    args: argparse.Namespace, option: str, endpoint: str | None
) -> CurveServerKeys | None:
    """The server keys the options name, or ``None``; a :class:`CliError` for options that
    cannot be used (no endpoint to bind, a missing file, ``--curve-allow`` alone)."""
    secret, allow = args.curve_secret, args.curve_allow
    if secret is None:
        if allow is not None:
            raise CliError("--curve-allow needs --curve-secret (the endpoint's own keys)")
        return None
    if endpoint is None:
        raise CliError(f"--curve-secret needs {option} (there is no endpoint to encrypt)")
    return load_server_keys(secret, allowed_clients_dir=allow)


def client_curve_from_args(args: argparse.Namespace, *, prefix: str = "") -> CurveClientKeys | None:
    """The client keys the options name (``prefix`` ``in_`` for ``--in-curve-*``), or
    ``None``; a :class:`CliError` when only one of the two is given."""
    secret = getattr(args, f"{prefix}curve_secret")
    server = getattr(args, f"{prefix}curve_server")
    flag = f"--{prefix.replace('_', '-')}curve"
    if secret is None and server is None:
        return None
    if secret is None or server is None:
        raise CliError(
            f"{flag}-secret and {flag}-server go together (this client's keys and the "
            "server's public certificate)"
        )
    return load_client_keys(secret, server_public_file=server)


def add_parsers(sub: Any) -> None:
    """Add ``curve-keys`` to the CLI's subparsers."""
    keys = sub.add_parser(
        "curve-keys",
        help="make a CURVE key pair (certificate files) for encrypted streams",
        description="Write DIR/NAME.key (the public certificate, to give to the other side) "
        "and DIR/NAME.key_secret (readable by you only). A server (--publish, proxy --out) "
        "uses its secret with --curve-secret; a client uses its own secret with "
        "--curve-secret and the server's .key with --curve-server; a server that only "
        "accepts known clients keeps their .key files in the directory of --curve-allow.",
    )
    keys.add_argument("directory", metavar="DIR")
    keys.add_argument("name", metavar="NAME")
    keys.add_argument("--force", action="store_true", help="replace an existing key pair")


async def _curve_keys(args: argparse.Namespace, out: TextIO) -> int:
    if "/" in args.name or args.name in ("", ".", ".."):
        raise CliError(f"NAME must be a plain file name, got {args.name!r}")
    directory = Path(args.directory)
    existing = [
        p
        for p in (directory / f"{args.name}.key", directory / f"{args.name}.key_secret")
        if p.exists()
    ]
    if existing and not args.force:
        raise CliError(f"{existing[0]} exists (--force replaces the key pair)")
    public, secret = generate_certificates(directory, args.name)
    out.write(f"public certificate {public}\nsecret certificate {secret} (mode 0600)\n")
    return 0


COMMANDS: dict[str, Command] = {"curve-keys": _curve_keys}
