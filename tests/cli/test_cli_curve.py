"""CURVE from the command line: `curve-keys` makes the certificates; every command that binds or
connects a ZeroMQ endpoint takes them; a client without the right keys gets nothing; options
that cannot work are one-line errors. Real processes throughout."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from cli_helpers import free_port, popen, run_cli


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    for name, where in (("server", d), ("client", d / "clients"), ("stranger", d / "others")):
        proc = run_cli("curve-keys", str(where), name)
        assert proc.returncode == 0, proc.stderr
        assert f"public certificate {where / (name + '.key')}" in proc.stdout
    return d


def test_curve_keys_writes_a_private_secret_and_never_replaces_one(keys: Path) -> None:
    secret = keys / "server.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    before = secret.read_bytes()
    again = run_cli("curve-keys", str(keys), "server")
    assert again.returncode == 1
    assert again.stderr.strip() == (
        f"zeus-async curve-keys: {secret.with_suffix('.key')} exists (--force replaces the key "
        "pair)"
    )
    assert secret.read_bytes() == before
    bad = run_cli("curve-keys", str(keys), "a/b")
    assert bad.returncode == 1 and "plain file name" in bad.stderr


def _monitor(endpoint: str, keys: Path, *extra: str) -> subprocess.Popen[str]:
    proc = popen(
        "monitor", "--backend", "sim", "--sim-config", json.dumps({"num_gpus": 1}),
        "--duration", "30", "--quiet", "--publish", endpoint,
        "--curve-secret", str(keys / "server.key_secret"), *extra,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "(CURVE)" in line, line + (proc.stderr.read() if proc.stderr else "")
    return proc


def _subscribe(endpoint: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("subscribe", endpoint, "--count", "3", "--wait", "3", "--json", *extra)


def _client(keys: Path, name: str = "client", folder: str = "clients") -> tuple[str, ...]:
    return (
        "--curve-secret", str(keys / folder / f"{name}.key_secret"),
        "--curve-server", str(keys / "server.key"),
    )  # fmt: skip


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.communicate(timeout=30)
    assert proc.returncode == 143  # stopped by SIGTERM, cleanly: 128 + 15


def test_monitor_publishes_to_allowed_clients_only(keys: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    monitor = _monitor(endpoint, keys, "--curve-allow", str(keys / "clients"))
    try:
        ok = _subscribe(endpoint, *_client(keys))
        assert ok.returncode == 0, ok.stderr
        assert len(ok.stdout.splitlines()) == 3
        assert json.loads(ok.stdout.splitlines()[0])["kind"] == "stream"
        plain = _subscribe(endpoint)  # no keys: the handshake never completes
        assert plain.returncode == 1
        assert "no publisher answered" in plain.stderr
        stranger = _subscribe(endpoint, *_client(keys, "stranger", "others"))
        assert stranger.returncode == 1 and "no publisher answered" in stranger.stderr
    finally:
        _stop(monitor)


def test_proxy_and_record_over_curve(keys: Path, tmp_path: Path) -> None:
    upstream = f"tcp://127.0.0.1:{free_port()}"
    downstream = f"tcp://127.0.0.1:{free_port()}"
    monitor = _monitor(upstream, keys)  # no allow list: any client with the server's key
    proxy = popen(
        "proxy", "--in", upstream, "--out", downstream, "--duration", "30",
        "--curve-secret", str(keys / "server.key_secret"),
        "--in-curve-secret", str(keys / "clients" / "client.key_secret"),
        "--in-curve-server", str(keys / "server.key"),
    )  # fmt: skip
    try:
        assert proxy.stdout is not None and "(CURVE)" in proxy.stdout.readline()
        out = tmp_path / "run.zarc"
        rec = run_cli(
            "record", downstream, "-o", str(out), "--count", "50", "--wait", "10",
            *_client(keys),
        )  # fmt: skip
        assert rec.returncode == 0, rec.stderr
        assert "recorded 50 events" in rec.stdout
        inspect = run_cli("inspect", str(out))
        assert "gpu:0" in inspect.stdout
        assert _subscribe(downstream).returncode == 1  # the proxy's side is encrypted too
    finally:
        _stop(proxy)
        _stop(monitor)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["monitor", "--duration", "1", "--curve-allow", "."],
            "--curve-allow needs --curve-secret (the endpoint's own keys)",
        ),
        (
            ["monitor", "--duration", "1", "--curve-secret", "server.key_secret"],
            "--curve-secret needs --publish (there is no endpoint to encrypt)",
        ),
        (
            [
                "monitor",
                "--duration",
                "1",
                "--publish",
                "tcp://127.0.0.1:0",
                "--curve-secret",
                "missing.key_secret",
            ],
            "cannot load CURVE certificate missing.key_secret",
        ),
        (
            [
                "monitor",
                "--duration",
                "1",
                "--publish",
                "tcp://127.0.0.1:0",
                "--curve-secret",
                "server.key",
            ],
            "server.key holds no secret key",
        ),
        (
            ["subscribe", "tcp://127.0.0.1:9", "--curve-secret", "clients/client.key_secret"],
            "--curve-secret and --curve-server go together",
        ),
        (
            [
                "proxy",
                "--in",
                "tcp://127.0.0.1:9",
                "--out",
                "tcp://127.0.0.1:0",
                "--in-curve-server",
                "server.key",
            ],
            "--in-curve-secret and --in-curve-server go together",
        ),
        (
            [
                "exporter",
                "--port",
                "0",
                "--curve-secret",
                "clients/client.key_secret",
                "--curve-server",
                "server.key",
            ],
            "the CURVE options are for --connect",
        ),
        (
            ["agent", "--curve-secret", "server.key_secret"],
            "--curve-secret needs --publish",
        ),
    ],
)
def test_curve_options_that_cannot_work_are_one_line_errors(
    keys: Path, args: list[str], message: str
) -> None:
    cwd = os.getcwd()
    os.chdir(keys)
    try:
        proc = run_cli(*args, timeout=30)
    finally:
        os.chdir(cwd)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert lines[0].startswith(f"zeus-async {args[0]}: ")
