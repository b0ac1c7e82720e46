"""No command or API writes over a recording it reads, or over an existing file unasked."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_helpers import run_cli

from zeus_async import Monitor
from zeus_async.devices.sim_config import SimConfig
from zeus_async.errors import ConfigError
from zeus_async.store import Recorder, RecordingReader
from zeus_async.store.outputs import claim_output


@pytest.fixture
def rec(recordings: Path, tmp_path: Path) -> Path:
    """A private copy of a committed recording, with a rotated part beside it."""
    path = tmp_path / "run.zarc"
    shutil.copy(recordings / "sim_windows.zarc", path)
    shutil.copy(recordings / "sim_windows.zarc", tmp_path / "run.1.zarc")
    return path


def _unchanged(path: Path, before: bytes) -> None:
    assert path.read_bytes() == before, f"{path} was modified"


@pytest.mark.parametrize(
    "args",
    [
        ["export", "{rec}", "--format", "csv", "-o", "{rec}", "--force"],
        ["export", "{rec}", "--format", "jsonl", "-o", "{part}", "--force"],
        ["replay", "{rec}", "--speed", "max", "--record", "{rec}", "--force"],
        ["replay", "{rec}", "--speed", "max", "--record", "{link}"],
        ["plot", "{rec}", "-o", "{rec}", "--force"],
    ],
)
def test_an_input_is_never_an_output(args: list[str], rec: Path) -> None:
    part = rec.with_name("run.1.zarc")
    link = rec.with_name("alias.zarc")
    link.symlink_to(rec)
    before, before_part = rec.read_bytes(), part.read_bytes()
    argv = [a.format(rec=rec, part=part, link=link) for a in args]
    proc = run_cli(*argv)
    assert proc.returncode == 1, proc
    (line,) = proc.stderr.strip().splitlines()
    assert f"zeus-async {args[0]}: refusing to write" in line
    assert "it is the input" in line or "it is part 1 of the input" in line
    _unchanged(rec, before)
    _unchanged(part, before_part)


def test_existing_outputs_need_force(rec: Path, tmp_path: Path) -> None:
    out = tmp_path / "events.csv"
    out.write_text("yesterday's export\n")
    proc = run_cli("export", str(rec), "--format", "csv", "-o", str(out))
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"zeus-async export: {out}: export exists; refusing to overwrite it (--force replaces it)"
    )
    assert out.read_text() == "yesterday's export\n"
    proc = run_cli("export", str(rec), "--format", "csv", "-o", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().startswith("kind,")

    old = tmp_path / "old.zarc"
    shutil.copy(rec, old)
    before = old.read_bytes()
    for argv in (
        ["replay", str(rec), "--speed", "max", "--record", str(old)],
        ["record", "tcp://127.0.0.1:9", "-o", str(old), "--wait", "30"],
        ["monitor", "--backend", "sim", "--duration", "0.2", "--record", str(old)],
    ):
        proc = run_cli(*argv)
        assert proc.returncode == 1, (argv, proc)
        assert "recording exists; refusing to overwrite it (--force replaces it)" in proc.stderr
        _unchanged(old, before)


def test_replaced_recording_loses_its_old_parts(rec: Path, tmp_path: Path) -> None:
    old = tmp_path / "old.zarc"
    shutil.copy(rec, old)
    stale = tmp_path / "old.1.zarc"
    shutil.copy(rec, stale)
    proc = run_cli("replay", str(rec), "--speed", "max", "--record", str(old), "--force")
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists()  # would read as the continuation of the new recording
    assert RecordingReader(old).header.meta.get("part") is None


def test_plot_names_the_file_it_writes(rec: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "power"
    proc = run_cli("plot", str(rec), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {out}.png"
    assert (tmp_path / "power.png").stat().st_size > 0
    proc = run_cli("plot", str(rec), "-o", str(out))
    assert proc.returncode == 1
    assert "power.png: image exists; refusing to overwrite it" in proc.stderr
    proc = run_cli("plot", str(rec), "-o", str(tmp_path / "power.docx"))
    assert proc.returncode == 1 and "unknown image format '.docx'" in proc.stderr


def test_api_refuses_too(rec: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError) as info:
        Recorder(rec)
    assert info.value.filename == str(rec)
    assert "overwrite=True replaces it" in str(info.value)
    config = SimConfig(num_gpus=1, seed=2)
    with pytest.raises(FileExistsError):
        Monitor(backend="sim", cpu_indices=[], sim_config=config, record=rec)
    with Monitor(backend="sim", cpu_indices=[], sim_config=config, record=rec, overwrite=True):
        pass
    assert not rec.with_name("run.1.zarc").exists()
    assert RecordingReader(rec).header.devices[0].key == "gpu:0"
    # Pipes and devices are targets, not data: no overwrite needed.
    assert claim_output("/dev/null", recording=True) == Path("/dev/null")
    with pytest.raises(ConfigError, match="it is the input"):
        claim_output(tmp_path / "." / rec.name, inputs=[rec])
