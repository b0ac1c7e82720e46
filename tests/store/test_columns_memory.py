"""A columnar load writes each frame into arrays sized once (issue 39): the capacity hint read
from format-3 directories, a load that trims a hint too large and grows past one too small,
and the resident peak of a load within 1.5x its arrays (in a process of its own)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from test_v3 import _DIR_LEN, HEADER, _dir_decoder, _pack, realistic

from zeus_async.events import Event, GpuSample, Measurement, ProcessSample
from zeus_async.store import RecordingReader, write_recording
from zeus_async.store.columns import ColumnarLoad, load_columns
from zeus_async.store.format import PayloadCodec, encode_frame, encode_header, pack_frame_prefix

ROOT = Path(__file__).parents[2]


def _events() -> list[Event]:
    return [
        *realistic(300),
        ProcessSample("node-01", 2**62, 7, 0.5, gpu=1, workload="w"),
        Measurement("node-01", 2, "m", 1, 0, 1, 1e-9, {0: 1.0}),
    ]


def _assert_same(a: ColumnarLoad, b: ColumnarLoad) -> None:
    assert a.counts == b.counts and a.hosts == b.hosts and a.others == b.others
    assert a.tables.keys() == b.tables.keys()
    for kind, ta in a.tables.items():
        tb = b.tables[kind]
        assert ta.devices == tb.devices and ta.categories == tb.categories
        assert np.array_equal(ta.device, tb.device)
        for name, column in ta.columns.items():
            assert column.dtype == tb.columns[name].dtype, (kind, name)
            assert np.array_equal(column, tb.columns[name], equal_nan=True), (kind, name)


def test_column_rows_are_the_rows_a_load_reads(tmp_path: Path) -> None:
    events = _events()
    v2, v3 = tmp_path / "v2.zarc", tmp_path / "v3.zarc"
    write_recording(v2, events, HEADER, 1000, overwrite=True, format_version=2)
    write_recording(v3, events, HEADER, 1000, overwrite=True, format_version=3)
    load = load_columns(RecordingReader(v3))
    rows = RecordingReader(v3).column_rows()
    assert rows == {"gpu": 2400, "rapl": 60, "proc": 1}
    assert rows == {kind: len(table) for kind, table in load.tables.items()}
    assert RecordingReader(v2).column_rows() == {}  # format 2: no hint, the arrays grow
    _assert_same(load_columns(RecordingReader(v2)), load)


def _frames(events: list[Event], per_frame: int) -> list[bytes]:
    codec = PayloadCodec("zstd")
    return [
        encode_frame(events[i : i + per_frame], codec=codec)
        for i in range(0, len(events), per_frame)
    ]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_lying_directory_makes_the_hint_too_large_and_the_load_trims(tmp_path: Path) -> None:
    events = [e for e in realistic(200) if isinstance(e, GpuSample)]
    frames = _frames(events, 400)
    clean = tmp_path / "clean.zarc"
    clean.write_bytes(encode_header(HEADER) + b"".join(frames))
    # A frame whose directory claims 5 M rows (its CRC still checks): decoded, it is refused.
    payload = frames[1][20:]
    (n,) = _DIR_LEN.unpack_from(payload, 0)
    directory = _dir_decoder.decode(payload[4 : 4 + n])
    directory.events = directory.groups[0].rows = 5_000_000
    lie = _pack(directory, payload[4 + n :])
    bad = pack_frame_prefix(len(lie), zlib.crc32(lie), events[400].t_ns) + lie
    path = tmp_path / "lie.zarc"
    path.write_bytes(encode_header(HEADER) + frames[0] + bad + b"".join(frames[2:]))
    reader = RecordingReader(path)
    assert reader.column_rows() == {"gpu": 5_000_000 + 1600 - 400}
    before = _rss_mib()
    load = load_columns(reader)
    assert _rss_mib() - before < 100  # 5 M rows reserved (460 MiB), never touched
    assert len(reader.report.corrupt_frames) == 1
    expected = load_columns(RecordingReader(clean))
    assert len(load.tables["gpu"]) == 1200
    for name, column in load.tables["gpu"].columns.items():
        assert len(column) == 1200  # trimmed to what decoded
        keep = np.r_[0:400, 800:1600]
        assert np.array_equal(column, expected.tables["gpu"].columns[name][keep], equal_nan=True)


@pytest.mark.parametrize("at", [0, 3])
def test_damage_stops_the_hint_short_and_the_load_grows(tmp_path: Path, at: int) -> None:
    events = _events()
    frames = _frames(events, 256)
    clean = tmp_path / "clean.zarc"
    clean.write_bytes(encode_header(HEADER) + b"".join(frames))
    path = tmp_path / "damaged.zarc"
    path.write_bytes(
        encode_header(HEADER) + b"".join(frames[:at]) + b"\x00" * 37 + b"".join(frames[at:])
    )
    reader = RecordingReader(path)
    # The walk stops at the first bad prefix: no hint, or the first frames' rows only.
    assert reader.column_rows() == ({} if at == 0 else {"gpu": 748, "rapl": 20})
    load = load_columns(reader)
    assert len(reader.report.corrupt_frames) == 1
    _assert_same(load, load_columns(RecordingReader(clean)))
    assert len(load.tables["gpu"]) == 2400


# The child's own resident high-water mark (VmHWM: ru_maxrss would carry the test process's
# peak across the exec).
_CHILD = """
import json, sys
import numpy as np
from zeus_async.store import RecordingReader
from zeus_async.store.columns import load_columns
def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
base = hwm()
load = load_columns(RecordingReader(sys.argv[1]), keep_others=False)
peak = hwm() - base
arrays = sum(t.nbytes for t in load.tables.values())
print(json.dumps({"peak": peak, "arrays": arrays, "rows": len(load.tables["gpu"])}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM (Linux)")
def test_a_load_holds_at_most_one_and_a_half_times_its_arrays(tmp_path: Path) -> None:
    path = tmp_path / "big.zarc"
    events = realistic(60_000)  # 480,000 GPU samples, 42 MiB of arrays
    write_recording(path, events, HEADER, overwrite=True, format_version=3)
    del events
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,  # this checkout's package
    )
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["rows"] == 480_000
    assert got["peak"] >= got["arrays"]  # the measure sees the load
    # Resident peak of the load (ru_maxrss): the frames' pieces concatenated at the end held
    # 2.0x; written into arrays sized from the directories, 1.05x.
    assert got["peak"] <= 1.5 * got["arrays"], got["peak"] / got["arrays"]
