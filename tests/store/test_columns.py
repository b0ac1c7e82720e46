"""Recordings as arrays: the columns equal the struct reader's values, the estimator fed from
arrays equals the one fed sample by sample (bit for bit), Arrow/pandas/Parquet forms."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_analysis import HEADER, hand_events

import zeus_async.store.columns as columns_module
from zeus_async.aggregate.history import DeviceHistory, add_sample, history_key
from zeus_async.errors import ConfigError
from zeus_async.events import Event, GpuSample, Measurement, ProcessSample, RaplSample
from zeus_async.store import RecordingReader, write_recording
from zeus_async.store.analysis import Recording
from zeus_async.store.columns import LAYOUTS, export_parquet, load_columns

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pd = pytest.importorskip("pandas")

DATA = Path(__file__).parent.parent / "data"
T0 = 1_700_000_000_000_000_000

_STATE = ("_pt", "_pw", "_pc", "_ct", "_cb", "_ce", "_cp")
_SCALARS = (
    "dropped",
    "first_t_ns",
    "last_t_ns",
    "has_counter",
    "counter_updates",
    "power_changes",
    "power_changes_with_counter",
    "_last_power",
    "_last_counter",
    "_last_counter_t",
    "_first_reading",
    "_ct_first",
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def assert_same_history(a: DeviceHistory, b: DeviceHistory) -> None:
    for name in _STATE:
        x, y = getattr(a, name), getattr(b, name)
        assert len(x) == len(y), name
        assert all(_same(p, q) for p, q in zip(x, y, strict=True)), name
    for name in _SCALARS:
        assert _same(getattr(a, name), getattr(b, name)) or getattr(a, name) == getattr(b, name), (
            name
        )


def sequential(samples: list[tuple[int, float | None, float | None]], fine: bool) -> DeviceHistory:
    history = DeviceHistory("d", fine_counter=fine)
    for t, p, c in samples:
        if p is not None or c is not None:
            history.add(t, p, c)
    return history


def from_arrays(samples: list[tuple[int, float | None, float | None]], fine: bool) -> DeviceHistory:
    t = np.array([s[0] for s in samples], dtype=np.int64)
    p = np.array([s[1] for s in samples], dtype=np.float64)
    c = np.array([s[2] for s in samples], dtype=np.float64)
    return DeviceHistory.from_arrays("d", t, p, c, fine_counter=fine)


_sample = st.tuples(
    st.integers(0, 40),  # time step (0: a duplicate)
    st.one_of(st.none(), st.sampled_from([100.0, 150.5, 200.0, 333.25])),
    st.one_of(st.none(), st.booleans()),  # None: no counter; True: the counter moves
    st.booleans(),  # out of order
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_sample, max_size=80), st.booleans())
def test_from_arrays_equals_sample_by_sample(raw: list[Any], fine: bool) -> None:
    samples: list[tuple[int, float | None, float | None]] = []
    t, counter = 1_000_000_000, 5000.0
    for step, power, moves, back in raw:
        t += step * 7_000_000
        if moves:
            counter += 1.25
        samples.append((t - 30_000_000 if back else t, power, None if moves is None else counter))
    a, b = sequential(samples, fine), from_arrays(samples, fine)
    assert_same_history(a, b)
    if a.first_t_ns is not None and a.last_t_ns is not None:
        lo, hi = a.first_t_ns, a.last_t_ns
        for k in range(5):
            t0 = lo + (hi - lo) * k // 7
            t1 = hi - (hi - lo) * k // 11
            if t1 >= t0:
                ea, eb = a.energy(t0, t1), b.energy(t0, t1)
                assert _same(ea.energy_j, eb.energy_j) and ea.method == eb.method
        sa, sb = a.span_energy(), b.span_energy()
        assert _same(sa.energy_j, sb.energy_j) and sa.method == sb.method


def generated_events(hosts: int = 1, n: int = 600) -> list[Event]:
    rng = random.Random(7)
    events: list[Event] = []
    energy = [[1e6 * (g + 1) for g in range(3)] for _ in range(hosts)]
    for k in range(n):
        for h in range(hosts):
            host = f"node{h}"
            t = T0 + k * 10_000_000 + h * 1000
            for g in range(3):
                if k % 10 == 0:
                    energy[h][g] += rng.uniform(10, 40)
                events.append(
                    GpuSample(
                        host,
                        t + g,
                        g,
                        power_w=None if k % 17 == 5 else rng.uniform(100, 400),
                        avg_power_w=rng.uniform(100, 400),
                        energy_j=None if g == 2 else energy[h][g],
                        temperature_c=50.0 if k % 3 == 0 else None,
                        memory_used_bytes=None if k % 4 else 80_000_000_000 + k,
                    )
                )
            if k % 5 == 0:
                for domain in ("package", "dram", "core"):
                    events.append(RaplSample(host, t + 9, 0, domain, k * 1.5, 20.0 if k else None))
                events.append(ProcessSample(host, t + 11, 4242, cpu_frac=0.5, memory_pss_bytes=k))
                events.append(ProcessSample(host, t + 11, 4242, gpu=1, attributed_power_w=7.5))
            if k == 300:
                events.append(
                    Measurement(
                        host, t, "w", 1, T0, t, 3.0, {0: 1.0}, {0: 2.0}, {}, {"gpu:0": "x"}, []
                    )
                )
    # a duplicate and an out-of-order sample
    events.append(GpuSample("node0", T0 + 5 * 10_000_000, 0, power_w=1.0, energy_j=0.0))
    return events


def recordings(tmp_path: Path) -> list[Path]:
    paths = [DATA / "sim_windows.zarc", DATA / "sim_windows_torn.zarc"]
    hand = tmp_path / "hand.zarc"
    write_recording(hand, hand_events(), HEADER, events_per_frame=16)
    one = tmp_path / "gen1.zarc"
    write_recording(one, generated_events(1), events_per_frame=97)
    two = tmp_path / "gen2.zarc"
    write_recording(two, generated_events(2), events_per_frame=1000)
    return [*paths, hand, one, two]


def test_columns_equal_the_struct_readers_values(tmp_path: Path) -> None:
    for path in recordings(tmp_path):
        load = load_columns(RecordingReader(path))
        events = list(RecordingReader(path))
        for kind, table in load.tables.items():
            cls = {"gpu": GpuSample, "rapl": RaplSample, "proc": ProcessSample}[kind]
            mine = [e for e in events if type(e) is cls]
            assert len(table) == len(mine)
            for name, storage in LAYOUTS[kind]:
                column = table.columns[name]
                want = [getattr(e, name) for e in mine]
                if storage == "cat":
                    got: list[Any] = [table.categories[name][c] for c in column.tolist()]
                    assert got == want, (path, name)
                elif storage == "int":
                    assert column.dtype == np.int64 and column.tolist() == want, (path, name)
                else:
                    assert column.dtype == np.float64
                    got = [None if math.isnan(v) else v for v in column.tolist()]
                    assert got == want, (path, name)
            several = len({e.host for e in events if hasattr(e, "host")} - {""}) > 1
            keys = [table.devices[c] for c in table.device.tolist()]
            for event, key in zip(mine, keys, strict=True):
                base = key.split("@")[0]
                if kind == "proc":
                    assert isinstance(event, ProcessSample)
                    want_key = f"proc:{event.pid}" + (
                        "" if event.gpu is None else f"/gpu:{event.gpu}"
                    )
                else:
                    assert isinstance(event, (GpuSample, RaplSample))
                    want_key = history_key(event)
                assert base == want_key
                assert ("@" in key) == several


def test_recording_figures_equal_the_live_estimators(tmp_path: Path) -> None:
    """Every device's total and interval energies from the arrays are those of a history fed
    sample by sample, as the live aggregation feeds it."""
    for path in recordings(tmp_path):
        rec = Recording(path)
        live: dict[str, DeviceHistory] = {}
        several = len(rec.hosts) > 1
        for event in RecordingReader(path):
            if isinstance(event, (GpuSample, RaplSample)):
                key = history_key(event) + (f"@{event.host}" if several else "")
                history = live.get(key)
                if history is None:
                    history = live[key] = DeviceHistory(
                        key, fine_counter=isinstance(event, RaplSample)
                    )
                add_sample(history, event)
        totals = rec.totals()
        with_samples = {k for k, h in live.items() if h.first_t_ns is not None}
        assert set(totals.devices) == with_samples
        for key in with_samples:
            want = live[key].span_energy()
            assert totals.devices[key].energy_j == want.energy_j, (path, key)
            assert totals.devices[key].method == want.method
            first, last = live[key].first_t_ns, live[key].last_t_ns
            assert first is not None and last is not None
            for k in range(1, 6):
                t0, t1 = first + (last - first) * k // 13, last - (last - first) * k // 17
                assert rec.energy(key, t0, t1).energy_j == live[key].energy(t0, t1).energy_j


def test_to_arrow_and_pandas(tmp_path: Path) -> None:
    path = tmp_path / "gen2.zarc"
    events = generated_events(2, n=310)
    write_recording(path, events, events_per_frame=64)
    rec = Recording(path)
    tables = rec.to_arrow()
    assert set(tables) >= {"gpu", "rapl", "proc", "measurement"}
    gpu = tables["gpu"]
    samples = [e for e in events if isinstance(e, GpuSample)]
    assert gpu.num_rows == len(samples)
    assert gpu.column_names == ["time", *(n for n, _ in LAYOUTS["gpu"]), "device"]
    assert pa.types.is_dictionary(gpu.schema.field("host").type)
    assert pa.types.is_dictionary(gpu.schema.field("device").type)
    assert gpu.schema.field("memory_used_bytes").type == pa.int64()
    assert gpu.schema.field("time").type == pa.timestamp("ns", tz="UTC")
    assert gpu.column("memory_used_bytes").to_pylist() == [e.memory_used_bytes for e in samples]
    assert gpu.column("power_w").to_pylist() == [e.power_w for e in samples]
    assert gpu.column("host").to_pylist() == [e.host for e in samples]
    assert gpu.column("device").to_pylist() == [f"gpu:{e.gpu}" for e in samples]
    rapl = tables["rapl"]
    assert set(rapl.column("device").to_pylist()) == {"cpu:0/package", "cpu:0/dram", "cpu:0/core"}
    measurement = tables["measurement"]
    assert measurement.column("name").to_pylist() == ["w", "w"]
    assert measurement.column("gpu_energy_j").to_pylist() == ['{"0":1.0}'] * 2
    frames = rec.to_pandas()
    df = frames["gpu"]
    assert isinstance(df["host"].dtype, pd.CategoricalDtype)
    assert isinstance(df["device"].dtype, pd.CategoricalDtype)
    assert str(df["time"].dtype) == "datetime64[ns, UTC]"
    assert str(df["memory_used_bytes"].dtype) == "Int64"
    assert df["power_w"].isna().sum() == sum(e.power_w is None for e in samples)
    assert df.groupby("device", observed=True).size().to_dict() == {
        f"gpu:{g}": len([e for e in samples if e.gpu == g]) for g in range(3)
    }


@pytest.mark.parametrize("chunk", [None, 500])
def test_parquet_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    if chunk is not None:
        monkeypatch.setattr(columns_module, "PARQUET_CHUNK", chunk)
    path = tmp_path / "gen.zarc"
    write_recording(path, generated_events(2, n=200), events_per_frame=64)
    seen: list[tuple[int, int]] = []
    written = export_parquet(path, tmp_path / "out", progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1]
    tables = Recording(path).to_arrow()
    assert written == {k: t.num_rows for k, t in sorted(tables.items())}
    for kind, table in tables.items():
        back = pq.read_table(tmp_path / "out" / f"{kind}.parquet")
        assert back.column_names == table.column_names
        for name in table.column_names:
            assert back.column(name).to_pylist() == table.column(name).to_pylist(), (kind, name)
    # one kind to one file
    single = tmp_path / "gpu.parquet"
    assert export_parquet(path, single, kinds="gpu") == {"gpu": tables["gpu"].num_rows}
    gpu = tables["gpu"]
    assert pd.read_parquet(single)["power_w"].count() == gpu.num_rows - gpu["power_w"].null_count


def test_parquet_export_refuses_bad_output(tmp_path: Path) -> None:
    path = tmp_path / "gen.zarc"
    write_recording(path, generated_events(1, n=20))
    with pytest.raises(ConfigError, match="unknown event kind"):
        export_parquet(path, tmp_path / "x", kinds=["gpu", "nope"])
    with pytest.raises(ConfigError):
        export_parquet(path, path, kinds="gpu")  # the recording itself
    out = tmp_path / "once.parquet"
    export_parquet(path, out, kinds="gpu", overwrite=False)
    with pytest.raises(FileExistsError):
        export_parquet(path, out, kinds="gpu", overwrite=False)


def test_hosts_and_categories_in_order_of_first_appearance(tmp_path: Path) -> None:
    """Several new hosts (and domains) in one frame keep the order they came in, whatever the
    hash seed (a set's order would not)."""
    events: list[Event] = []
    for k in range(3):
        for host in ("zeta", "alpha", "mid"):
            events.append(GpuSample(host, T0 + k * 1000 + ord(host[0]), 0, power_w=1.0))
            events.append(RaplSample(host, T0 + k * 1000 + 500, 0, "uncore", k * 1.0))
            events.append(RaplSample(host, T0 + k * 1000 + 501, 0, "dram", k * 1.0))
    path = tmp_path / "hosts.zarc"
    write_recording(path, events)
    load = load_columns(RecordingReader(path))
    assert load.hosts == ["zeta", "alpha", "mid"]
    assert load.tables["rapl"].categories["domain"] == ["uncore", "dram"]
    assert Recording(path).hosts == ["zeta", "alpha", "mid"]


def test_device_values_of_any_size_keep_their_own_keys(tmp_path: Path) -> None:
    events: list[Event] = [
        GpuSample("h", T0, -1, power_w=1.0),
        GpuSample("h", T0 + 1, 2**41, power_w=2.0),
        ProcessSample("h", T0 + 2, 7, cpu_frac=0.5),
        ProcessSample("h", T0 + 3, 7, gpu=65535, attributed_power_w=3.0),
        ProcessSample("h", T0 + 4, 2**33, cpu_frac=0.25),
        RaplSample("h", T0 + 5, 2**30, "package", 1.0),
    ]
    path = tmp_path / "odd.zarc"
    write_recording(path, events)
    rec = Recording(path)
    assert sorted(rec.devices()) == sorted(
        ["gpu:-1", f"gpu:{2**41}", "proc:7", "proc:7/gpu:65535", f"proc:{2**33}",
         f"cpu:{2**30}/package"]
    )  # fmt: skip
    assert rec.series("proc.attributed_power_w", "proc:7/gpu:65535").values.tolist() == [3.0]


def test_nan_readings_count_as_missing_in_both_paths(tmp_path: Path) -> None:
    nan = float("nan")
    events: list[Event] = [
        GpuSample("h", T0 + k * 10_000_000, 0, power_w=nan if k == 3 else 100.0) for k in range(10)
    ]
    path = tmp_path / "nan.zarc"
    write_recording(path, events)
    live = DeviceHistory("gpu:0")
    for event in events:
        assert isinstance(event, GpuSample)
        add_sample(live, event)
    energy = Recording(path).energy("gpu:0")
    assert energy.energy_j == live.span_energy().energy_j
    assert energy.energy_j == pytest.approx(100.0 * 0.09)


def test_series_compare_by_identity(tmp_path: Path) -> None:
    path = tmp_path / "gen.zarc"
    write_recording(path, generated_events(1, n=20))
    rec = Recording(path)
    a, b = rec.series("gpu.power_w", "gpu:0"), rec.series("gpu.power_w", "gpu:0")
    assert a != b and a == a  # no "truth value of an array is ambiguous"
    assert np.array_equal(a.values, b.values)


def test_parquet_claims_every_output_first(tmp_path: Path) -> None:
    path = tmp_path / "gen.zarc"
    write_recording(path, generated_events(1, n=40))
    out = tmp_path / "out"
    out.mkdir()
    (out / "rapl.parquet").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        export_parquet(path, out, overwrite=False)
    assert sorted(p.name for p in out.iterdir()) == ["rapl.parquet"]  # nothing written
    (out / "fault.parquet").write_bytes(b"stale, from another recording")
    written = export_parquet(path, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{k}.parquet" for k in written)
    # one kind with no events: an empty, typed table
    empty = tmp_path / "faults.parquet"
    assert export_parquet(path, empty, kinds="fault") == {"fault": 0}
    table = pq.read_table(empty)
    assert table.num_rows == 0 and "time" in table.column_names


def test_to_pandas_keeps_plain_int_columns_plain(tmp_path: Path) -> None:
    path = tmp_path / "gen.zarc"
    write_recording(path, generated_events(1, n=20))
    df = Recording(path).to_pandas()["gpu"]
    assert str(df["t_ns"].dtype) == "int64" and str(df["gpu"].dtype) == "int64"
    assert str(df["memory_used_bytes"].dtype) == "Int64"
