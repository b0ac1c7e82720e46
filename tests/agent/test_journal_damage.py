"""Damaged lease journals are recovered as far as their records go, and the rest is said.

The journal under test is a real one: a node agent (a real process) takes three leases for a
client — gpu 0's power limit (400 W before), gpu 1's (300 W before), gpu 0's clocks — and
its journal's bytes are copied. Each test then damages a copy (cut, flipped bytes, garbage),
leaves it where a dead process would have, puts the simulated node in the state the dead
process left (250 W, 250 W, clocks locked) and recovers; the node is read back the way a
driver would show it (the simulator's node-wide state file).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import pytest

from zeus_async import Monitor
from zeus_async.agent.journal import JournalDoc, LeaseEntry, journal_dir
from zeus_async.agent.leases import recover_orphans
from zeus_async.devices.sim import SimNode
from zeus_async.devices.sim_config import SimConfig
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import sim_env, start_node_agent

if TYPE_CHECKING:
    from zeus_async.agent.leases import Recovery

CONFIG = SimConfig(num_gpus=2, seed=7)

#: The settings the dead process changed, and the value before (None: clocks not locked).
ORIGINAL: dict[str, float | None] = {"pl0": 400.0, "pl1": 300.0, "sm0": None}
CHANGED: dict[str, float | tuple[int, int]] = {"pl0": 250.0, "pl1": 250.0, "sm0": (1200, 1200)}
#: What each record of the real journal holds (a lease taken per record).
HELD = [{"pl0"}, {"pl0", "pl1"}, {"pl0", "pl1", "sm0"}]
KEYS = {"pl0": (0, "power_limit"), "pl1": (1, "power_limit"), "sm0": (0, "sm_clocks")}

CLIENT = """
import sys, time
from zeus_async import Monitor
from zeus_async.devices.sim import SimNode
node = SimNode.from_env()
node.gpus[0].set_power_limit_w(400)
node.gpus[1].set_power_limit_w(300)
m = Monitor(cpu_indices=[])
assert m._process is not None and m._process.attached, "not attached"
m.set_power_limit(250, [0]).result(timeout=30)
m.set_power_limit(250, [1]).result(timeout=30)
m.set_sm_clocks(1200, [0]).result(timeout=30)
print("held", flush=True)
time.sleep(120)
"""


class Real(NamedTuple):
    """The bytes of a real agent's journal, and where its records are."""

    data: bytes
    pid: int
    records: list[tuple[int, int, dict[str, Any]]]  # start, end, decoded payload
    uuids: dict[int, str]  # gpu index -> uuid


def _records(data: bytes) -> list[tuple[int, int, dict[str, Any]]]:
    """The records, read by the documented framing (magic, length, CRC32, JSON)."""
    out = []
    pos = 0
    while pos < len(data):
        assert data[pos : pos + 4] == b"\xa7ZJ2"
        (length,) = struct.unpack_from("<I", data, pos + 4)
        end = pos + 12 + length
        out.append((pos, end, msgspec.json.decode(data[pos + 12 : end])))
        pos = end
    return out


@pytest.fixture(scope="module")
def real() -> Iterator[Real]:
    base = tempfile.mkdtemp(prefix="za-")
    env = dict(sim_env(CONFIG), ZEUS_ASYNC_DIR=base)
    agent = start_node_agent(env)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline() == "held\n"
        (path,) = Path(base, "leases").glob("*.journal")
        data = path.read_bytes()
    finally:
        client.kill()
        client.communicate(timeout=20)
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=20)
        shutil.rmtree(base, ignore_errors=True)
    records = _records(data)
    assert [len(r[2]["entries"]) for r in records] == [1, 2, 3]
    uuids = {e["gpu"]: e["uuid"] for e in records[-1][2]["entries"]}
    yield Real(data, agent.pid, records, uuids)


def _entry_text(real: Real, key: str) -> bytes:
    gpu, setting = KEYS[key]
    return f'"uuid":"{real.uuids[gpu]}","gpu":{gpu},"setting":"{setting}"'.encode()


def _leave(real: Real, data: bytes, suffix: str = ".journal") -> Path:
    """``data`` as the journal of the dead agent, and the node as the agent left it."""
    path = journal_dir() / f"{real.pid}-0badf00d{suffix}"
    path.write_bytes(data)
    node = SimNode(CONFIG)
    node.gpus[0].set_power_limit_w(250)
    node.gpus[1].set_power_limit_w(250)
    node.gpus[0].lock_sm_clocks_mhz(1200, 1200)
    return path


def _node() -> dict[str, Any]:
    g0, g1 = read_sim_node_state(CONFIG)
    return {"pl0": g0.power_limit_w, "pl1": g1.power_limit_w, "sm0": g0.locked_sm_clocks_mhz}


def _expected(restored: set[str]) -> dict[str, Any]:
    return {k: ORIGINAL[k] if k in restored else CHANGED[k] for k in ORIGINAL}


def _claimed(rec: Recovery) -> set[str]:
    """The settings the recovery says it restored."""
    names = {v: k for k, v in KEYS.items()}
    return {names[(r.entry.gpu, r.entry.setting)] for r in rec.restored if not r.error}


def _check(
    real: Real, path: Path, rec: Recovery, restored: set[str], *, kept: bool, lost: bool
) -> None:
    assert _node() == _expected(restored)
    assert _claimed(rec) == restored  # no restore claimed that did not happen
    assert not rec.failed
    assert bool(rec.lost) == lost and rec.complete == (not lost)
    assert not path.exists() and not path.with_suffix(".lock").exists()
    damaged = path.with_name(path.name + ".damaged")
    assert rec.kept == ([damaged] if kept else [])
    assert damaged.exists() == kept
    for item in rec.lost:
        assert item.journal == damaged and item.owner_pid == real.pid
    assert list(journal_dir().glob("*.journal")) == []  # not read again


def _expected_named(real: Real, data: bytes, start: int, held: set[str]) -> list[str]:
    """Settings whose entry text is whole in the damaged bytes ``data[start:]`` and not held
    by the last intact record."""
    return [
        k for k in ("pl0", "pl1", "sm0") if k not in held and _entry_text(real, k) in data[start:]
    ]


# -- a cut at every offset ---------------------------------------------------------------------


def test_a_cut_at_every_offset_reads_back_every_intact_record(real: Real, tmp_path: Path) -> None:
    from zeus_async.agent.journal import read_journal

    names = {v: k for k, v in KEYS.items()}
    ends = [end for _, end, _ in real.records]
    for cut in range(len(real.data) + 1):
        data = real.data[:cut]
        path = tmp_path / f"{real.pid}-0badf00d.journal"
        path.write_bytes(data)
        read = read_journal(path)
        assert read is not None and read.pid == real.pid
        whole = sum(1 for end in ends if end <= cut)
        held = HELD[whole - 1] if whole else set()
        got = set() if read.doc is None else {names[(e.gpu, e.setting)] for e in read.doc.entries}
        assert got == held, cut
        if read.doc is not None:
            want = {
                (e["gpu"], e["setting"]): e["original_w"] for e in real.records[-1][2]["entries"]
            }
            assert all(want[(e.gpu, e.setting)] == e.original_w for e in read.doc.entries)
        start = ends[whole - 1] if whole else 0
        if cut == 0:
            assert read.lost == [(0, 0)]
        elif cut in ends:  # a cut between records leaves a shorter, valid journal
            assert read.lost == [] and not read.damaged, cut
        else:
            assert read.lost == [(start, cut)], cut
        assert read.superseded == []
        named = [names[(g, s)] for _, g, s in read.named]
        assert named == _expected_named(real, data, start, held), cut


@pytest.mark.slow
def test_a_cut_journal_restores_what_its_intact_records_hold(
    real: Real, caplog: pytest.LogCaptureFixture
) -> None:
    offsets = {0, len(real.data)}
    for start, end, _ in real.records:
        offsets |= {start + 1, start + 4, start + 8, start + 12, (start + end) // 2, end - 1, end}
    ends = [end for _, end, _ in real.records]
    for cut in sorted(offsets):
        caplog.clear()
        path = _leave(real, real.data[:cut])
        with caplog.at_level(logging.WARNING, logger="zeus_async.agent"):
            rec = recover_orphans()
        whole = sum(1 for end in ends if end <= cut)
        restored = HELD[whole - 1] if whole else set()
        damaged = cut == 0 or cut not in ends
        _check(real, path, rec, restored, kept=damaged, lost=damaged)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        if damaged:
            (error,) = errors
            assert str(path) in error and f"process {real.pid}" in error, error
            for item in rec.lost:
                if item.uuid is not None:
                    assert item.uuid in error
        else:
            assert errors == []
        for p in journal_dir().glob("*.damaged"):
            p.unlink()


# -- flipped bytes, garbage --------------------------------------------------------------------


def _flip(data: bytes, *positions: int) -> bytes:
    out = bytearray(data)
    for p in positions:
        out[p] ^= 0xFF
    return bytes(out)


@pytest.mark.slow
def test_a_flipped_byte_in_each_record_loses_only_what_that_record_alone_held(
    real: Real, caplog: pytest.LogCaptureFixture
) -> None:
    last = len(real.records) - 1
    for i, (start, end, _) in enumerate(real.records):
        # magic, length, CRC, first and last payload byte: the entry texts stay readable
        for pos in (start, start + 5, start + 9, start + 12, end - 1):
            caplog.clear()
            path = _leave(real, _flip(real.data, pos))
            with caplog.at_level(logging.WARNING, logger="zeus_async.agent"):
                rec = recover_orphans()
            if i < last:  # the last record holds every lease: nothing is lost
                _check(real, path, rec, HELD[-1], kept=True, lost=False)
                assert [r.levelno for r in caplog.records if "damaged" in r.getMessage()] == [
                    logging.WARNING
                ]
            else:  # gpu 0's clock lock was only in the last record: named, not restored
                _check(real, path, rec, HELD[-2], kept=True, lost=True)
                (lost,) = rec.lost
                assert (lost.uuid, lost.gpu, lost.setting) == (real.uuids[0], 0, "sm_clocks")
                assert lost.detail == f"bytes {start}-{len(real.data)} unreadable"
                (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
                message = error.getMessage()
                assert str(path) in message and real.uuids[0] in message
                assert "locked SM clocks" in message and f"dead process {real.pid}" in message
            path.with_name(path.name + ".damaged").unlink()


@pytest.mark.slow
def test_an_unreadable_entry_in_the_last_record_is_reported_as_unknown(real: Real) -> None:
    start, _, _ = real.records[-1]
    at = real.data.index(_entry_text(real, "sm0"), start) + 10  # inside the uuid
    path = _leave(real, _flip(real.data, at))
    rec = recover_orphans()
    _check(real, path, rec, HELD[-2], kept=True, lost=True)
    (lost,) = rec.lost
    assert (lost.uuid, lost.setting, lost.owner_pid) == (None, None, real.pid)
    assert lost.describe() == (
        f"the lease journal of process {real.pid} is unreadable (bytes {start}-"
        f"{len(real.data)} unreadable): whatever it held there is unknown; kept as "
        f"{path}.damaged"
    )


@pytest.mark.slow
def test_garbage_after_the_last_record_restores_everything_and_is_reported(real: Real) -> None:
    garbage = bytes(range(256))
    path = _leave(real, real.data + garbage)
    rec = recover_orphans()
    _check(real, path, rec, HELD[-1], kept=True, lost=True)
    (lost,) = rec.lost
    n = len(real.data)
    assert lost.uuid is None and lost.detail == f"bytes {n}-{n + 256} unreadable"


@pytest.mark.slow
def test_damage_in_two_records_restores_from_the_last_intact_one(real: Real) -> None:
    (s0, _, _), _, (_, e2, _) = real.records
    path = _leave(real, _flip(real.data, s0 + 20)[: e2 - 3])
    rec = recover_orphans()
    _check(real, path, rec, HELD[1], kept=True, lost=True)
    (lost,) = rec.lost
    assert (lost.uuid, lost.setting) == (real.uuids[0], "sm_clocks")


# -- the old format ----------------------------------------------------------------------------


def _version_1(pid: int) -> tuple[Real, bytes]:
    """A journal as version 1 wrote it (one JSON document), for process ``pid``."""
    uuids = {g.index: g.uuid for g in SimNode(CONFIG).gpus}
    entries = [
        LeaseEntry(uuid=uuids[0], gpu=0, setting="power_limit", original_w=400.0, pid=pid),
        LeaseEntry(uuid=uuids[1], gpu=1, setting="power_limit", original_w=300.0, pid=pid),
        LeaseEntry(uuid=uuids[0], gpu=0, setting="sm_clocks", pid=pid),
    ]
    doc = JournalDoc(
        pid=pid, host="node", backend="sim", sim_config=CONFIG.to_json(), entries=entries
    )
    data = msgspec.json.encode(doc)
    assert data.startswith(b'{"version":1,')
    return Real(b"", pid, [], uuids), data


@pytest.mark.slow
def test_version_1_journals_still_recover_and_a_damaged_one_is_kept_and_reported() -> None:
    dead = _dead_pid()
    real, data = _version_1(dead)
    path = _leave(real, data[:-40], ".json")  # cut: nothing in it can be trusted
    out = _restore_cli()
    assert out.returncode == 1, out
    assert _node() == _expected(set())
    damaged = path.with_name(path.name + ".damaged")
    assert damaged.exists() and not path.exists()
    u0, u1 = real.uuids[0], real.uuids[1]
    detail = f"damaged bytes (bytes 0-{len(data) - 40} unreadable) of {damaged}"
    assert out.stdout.splitlines() == [
        f"NOT RECOVERED: gpu:0 ({u0}) power limit, changed by process {dead}: its original "
        f"value is in {detail}",
        f"NOT RECOVERED: gpu:1 ({u1}) power limit, changed by process {dead}: its original "
        f"value is in {detail}",
        f"NOT RECOVERED: gpu:0 ({u0}) locked SM clocks, changed by process {dead}: its "
        f"original value is in {detail}",
        f"damaged journal kept as {damaged}",
        "0 setting(s) found to restore, 0 restored; 3 could not be recovered from damaged journals",
    ]

    damaged.unlink()
    path = _leave(real, data, ".json")
    rec = recover_orphans()
    _check(real, path, rec, HELD[-1], kept=False, lost=False)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# -- zeus-async agent --restore ------------------------------------------------------------------


def _restore_cli() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zeus_async", "agent", "--restore"],
        env=sim_env(CONFIG),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_restore_command_exits_nonzero_and_says_what_it_could_not_restore(real: Real) -> None:
    path = _leave(real, real.data[:-7])  # the last record cut short
    out = _restore_cli()
    assert out.returncode == 1, out
    assert _node() == _expected({"pl0", "pl1"})
    lines = out.stdout.splitlines()
    p = real.pid
    u0, u1 = real.uuids[0], real.uuids[1]
    damaged = path.with_name(path.name + ".damaged")
    start = real.records[-1][0]
    assert lines == [
        f"gpu:0 ({u0}) power limit, left by process {p}: restored to 400 W",
        f"gpu:1 ({u1}) power limit, left by process {p}: restored to 300 W",
        f"NOT RECOVERED: gpu:0 ({u0}) locked SM clocks, changed by process {p}: its original "
        f"value is in damaged bytes (bytes {start}-{len(real.data) - 7} unreadable) of "
        f"{damaged}",
        f"damaged journal kept as {damaged}",
        "2 setting(s) found to restore, 2 restored; 1 could not be recovered from damaged journals",
    ]
    assert damaged.exists()
    again = _restore_cli()  # the damaged journal is not read again
    assert again.returncode == 0 and again.stdout == "0 setting(s) found to restore, 0 restored\n"


@pytest.mark.slow
def test_restore_command_says_whose_unreadable_journal_it_was(real: Real) -> None:
    path = _leave(real, real.data[:30])
    out = _restore_cli()
    assert out.returncode == 1, out
    assert _node() == _expected(set())
    damaged = path.with_name(path.name + ".damaged")
    assert out.stdout.splitlines() == [
        f"NOT RECOVERED: the lease journal of process {real.pid} is unreadable (bytes 0-30 "
        f"unreadable): whatever it held there is unknown; kept as {damaged}",
        f"damaged journal kept as {damaged}",
        "0 setting(s) found to restore, 0 restored; 1 could not be recovered from damaged journals",
    ]
    assert f"{path}" in out.stderr and "is damaged" in out.stderr  # the ERROR log


@pytest.mark.slow
def test_restore_command_exits_zero_when_everything_was_restored(real: Real) -> None:
    (_, _, _), (s1, _, _), _ = real.records
    path = _leave(real, _flip(real.data, s1 + 5))  # a superseded record: nothing lost
    out = _restore_cli()
    assert out.returncode == 0, out
    assert _node() == _expected({"pl0", "pl1", "sm0"})
    assert out.stdout.splitlines()[-1] == "3 setting(s) found to restore, 3 restored"
    assert path.with_name(path.name + ".damaged").exists()


# -- what a client of a dead agent says ----------------------------------------------------------


@pytest.fixture
def node_agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[str]]:
    monkeypatch.setenv("ZEUS_ASYNC_SIM", CONFIG.to_json())
    proc = start_node_agent(sim_env(CONFIG))
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=20)


def _agent_death_message(mon: Monitor, agent: subprocess.Popen[str]) -> str:
    mon.begin_window("in flight")
    agent.kill()  # SIGKILL: the agent restores nothing itself
    agent.wait(timeout=20)
    with pytest.raises(RuntimeError, match=r"the agent \(pid \d+\) exited") as info:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            mon.end_window("in flight").wait(timeout=1)
            mon.begin_window("in flight")
    return str(info.value)


def _hold_three(mon: Monitor) -> None:
    node = SimNode(CONFIG)
    node.gpus[0].set_power_limit_w(400)
    node.gpus[1].set_power_limit_w(300)
    mon.set_power_limit(250, [0]).result(timeout=30)
    mon.set_power_limit(250, [1]).result(timeout=30)
    mon.set_sm_clocks(1200, [0]).result(timeout=30)


def _only_journal() -> Path:
    (path,) = [p for p in journal_dir().iterdir() if p.suffix in (".journal", ".json")]
    return path


@pytest.mark.slow
def test_a_client_of_a_killed_agent_says_what_its_damaged_journal_lost(
    node_agent: subprocess.Popen[str],
) -> None:
    with Monitor(cpu_indices=[]) as mon:
        _hold_three(mon)
        path = _only_journal()
        data = path.read_bytes()
        path.write_bytes(_flip(data, len(data) - 10))  # the last record damaged
        message = _agent_death_message(mon, node_agent)
        damaged = path.with_name(path.name + ".damaged")
        assert _node() == _expected({"pl0", "pl1"})  # the clock lock is not restored
    assert "were restored from its journal (see" not in message, message
    assert "2 setting(s) it held were restored from its journal; NOT restored: gpu:0 (" in message
    assert "locked SM clocks" in message and str(damaged) in message, message
    assert damaged.exists() and not path.exists()


@pytest.mark.slow
def test_a_client_of_a_killed_agent_that_held_nothing_says_so(
    node_agent: subprocess.Popen[str],
) -> None:
    with Monitor(cpu_indices=[]) as mon:
        message = _agent_death_message(mon, node_agent)
    assert message.endswith(
        "windows in flight are lost; it held no hardware settings (it left no journal) "
        "(see docs/agent.md)"
    ), message


WATCHER = """
import time
from zeus_async import Monitor
m = Monitor(cpu_indices=[])
print("attached", flush=True)
try:
    while True:
        with m.window("w"):
            time.sleep(0.01)
except RuntimeError as exc:
    print(exc, flush=True)
"""


@pytest.mark.slow
def test_two_clients_of_a_killed_agent_one_restores_the_other_says_who(
    node_agent: subprocess.Popen[str],
) -> None:
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCHER], env=sim_env(CONFIG), stdout=subprocess.PIPE, text=True
    )
    try:
        assert watcher.stdout is not None
        assert watcher.stdout.readline() == "attached\n"
        with Monitor(cpu_indices=[]) as mon:
            _hold_three(mon)
            ours = _agent_death_message(mon, node_agent)
            theirs, _ = watcher.communicate(timeout=30)
        assert _node() == _expected({"pl0", "pl1", "sm0"})
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate()
    restored = "the 3 setting(s) it held were restored from its journal (see docs/agent.md)"
    if restored in ours:  # this process won the directory lock
        assert f"process {os.getpid()} restored the 3 setting(s) it held" in theirs, theirs
    else:
        assert restored in theirs, theirs
        assert f"process {watcher.pid} restored the 3 setting(s) it held (see" in ours, ours


# -- the writer --------------------------------------------------------------------------------


def test_a_long_lived_journal_is_compacted_and_keeps_the_original_values(tmp_path: Path) -> None:
    from zeus_async.agent.journal import COMPACT_AT, Journal, read_journal

    journal = Journal(tmp_path, "sim", CONFIG.to_json())
    first = LeaseEntry(uuid="GPU-0", gpu=0, setting="power_limit", original_w=400.0)
    sizes = []
    for i in range(200):  # a lease held throughout, another taken and released again
        other = LeaseEntry(uuid="GPU-1", gpu=1, setting="power_limit", original_w=float(i))
        journal.write([first, other] if i % 2 else [first])
        sizes.append(journal.path.stat().st_size)
    assert max(sizes) <= COMPACT_AT
    assert sum(1 for a, b in itertools.pairwise(sizes) if b < a) > 1  # rewritten
    read = read_journal(journal.path)
    assert read is not None and not read.damaged and read.doc is not None
    assert read.doc.entries == [
        first,
        LeaseEntry(uuid="GPU-1", gpu=1, setting="power_limit", original_w=199.0),
    ]
    assert read.doc.seq == 200
    journal.close()
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_journal_whose_restore_fails_keeps_what_failed_for_the_next_try() -> None:
    from zeus_async.agent.journal import encode_record, read_journal

    dead = _dead_pid()
    entry = LeaseEntry(uuid="GPU-0", gpu=0, setting="power_limit", original_w=400.0, pid=dead)
    doc = JournalDoc(version=2, pid=dead, host="node", backend="sim", sim_config="{bad", seq=1)
    doc.entries = [entry]
    path = journal_dir() / f"{dead}-0badf00d.journal"
    path.write_bytes(encode_record(doc) + b"garbage")
    rec = recover_orphans()
    (failed,) = rec.failed
    assert failed.entry == entry and failed.owner_pid == dead
    assert rec.kept == [path.with_name(path.name + ".damaged")] and len(rec.lost) == 1
    again = read_journal(path)  # a clean journal with what failed, for the next try
    assert again is not None and not again.damaged and again.doc is not None
    assert again.doc.entries == [entry] and again.doc.sim_config == "{bad"
    rec = recover_orphans()
    assert [r.entry for r in rec.failed] == [entry] and rec.lost == [] and rec.kept == []
    assert path.exists()
