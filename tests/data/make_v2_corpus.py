"""Write the small format-2 corpus under ``tests/data/v2`` (deterministic, no clock).

    .venv/bin/python tests/data/make_v2_corpus.py

Written once with the tree of format 2 (before format 3 existed) and kept: readers of later
formats must read these files as they are (``tests/store/test_v3_corpus.py``). Regenerating
them needs a writer of format 2 (``write_recording(..., format_version=2)``).

* ``every_kind.zarc`` — one event of each kind twice, zstd, 5 events per frame;
* ``every_kind_plain.zarc`` — the same, uncompressed frames;
* ``samples.zarc`` — 8 GPUs at 100 Hz for 2 s, every field, RAPL package/DRAM at 10 Hz, a
  process sample per second, windows and their measurements; 512 events per frame;
* ``samples_torn.zarc`` — ``samples.zarc`` cut in the middle of its last frame;
* ``expected.json`` — counts and checksums the test compares with.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import msgspec

from zeus_async.events import (
    ClockChange,
    DeviceFault,
    DeviceInfo,
    Event,
    GpuSample,
    Heartbeat,
    Measurement,
    PowerLimitChange,
    ProcessSample,
    RaplSample,
    StreamInfo,
    WindowClose,
    WindowOpen,
)
from zeus_async.store import RecordingHeader, RecordingReader, write_recording

HERE = Path(__file__).parent / "v2"
T0 = 1_763_000_000_000_000_000
DEVICES = [
    DeviceInfo(key="gpu:0", name="H100", uuid="GPU-1", arch="hopper", has_energy_counter=True),
    DeviceInfo(key="cpu:0", name="Xeon", arch="cpu"),
]


def header(compression: str) -> RecordingHeader:
    return RecordingHeader(
        host="node1",
        start_wall_ns=T0,
        pid=1234,
        argv=["train.py"],
        devices=DEVICES,
        meta={"job": "corpus"},
        compression=compression,
    )


def every_kind(t0: int) -> list[Event]:
    h = "node1"
    return [
        StreamInfo(h, t0, "s1", pid=7, argv=["x"], devices=DEVICES),
        GpuSample(h, t0 + 1, 0, 300.0, 290.0, 1e6, 55.0, 1.98e9, 0.9, 2**40, 700.0),
        GpuSample(h, t0 + 2, 1),
        RaplSample(h, t0 + 3, 0, "dram", 12.5, 30.0),
        RaplSample(h, t0 + 3, 1, "package", 99.5),
        ProcessSample(h, t0 + 4, 42, 0.5, 1, 2, 3, 0, 0.7, 4, 120.0, workload="train"),
        ProcessSample(h, t0 + 4, 43),
        WindowOpen(h, t0 + 5, "step", 1),
        WindowClose(h, t0 + 6, "step", 1, cancelled=True),
        Measurement(
            h,
            t0 + 7,
            "step",
            1,
            t0 + 5,
            t0 + 6,
            1e-9,
            {0: 1.5, 1: 2.5},
            {0: 3.0},
            None,
            {"gpu:0": "counter"},
            ["gpu:1"],
        ),
        PowerLimitChange(h, t0 + 8, 0, 500.0, 700.0, "optimizer"),
        ClockChange(h, t0 + 9, 0, 1e9, 1.5e9, "pfo"),
        DeviceFault(h, t0 + 11, "gpu:1", "gpu_lost", "fell off the bus", None),
        Heartbeat(h, t0 + 12, "s1", 10, 2),
    ]


def samples() -> list[Event]:
    out: list[Event] = [StreamInfo("node1", T0, "s1", pid=7, devices=DEVICES)]
    counters = [1.0e6 + 1000.0 * g for g in range(8)]
    package = dram = 0.0
    for k in range(200):
        t = T0 + k * 10_000_000
        if k % 50 == 0:
            out.append(WindowOpen("node1", t, f"step-{k // 50}", k // 50))
        for g in range(8):
            power = 250.0 + ((k * 7 + g * 13) % 97)
            if k % 10 == 0:
                counters[g] += power * 0.1
            out.append(
                GpuSample(
                    "node1",
                    t + g * 1000,
                    g,
                    power,
                    248.5,
                    counters[g],
                    61.0 + (k % 7),
                    1.98e9,
                    0.97,
                    42_000_000_000 + k,
                    700.0,
                )
            )
        if k % 10 == 0:
            package += 12.0
            dram += 1.5
            out.append(RaplSample("node1", t + 9000, 0, "package", package, 120.0 if k else None))
            out.append(RaplSample("node1", t + 9500, 0, "dram", dram, 15.0 if k else None))
        if k % 100 == 99:
            out.append(ProcessSample("node1", t + 9700, 4242, cpu_frac=1.5, gpu=k % 8))
        if k % 50 == 49:
            i = k // 50
            out.append(WindowClose("node1", t + 9800, f"step-{i}", i))
            energies = {g: 100.0 + g for g in range(8)}
            out.append(
                Measurement(
                    "node1", t + 9900, f"step-{i}", i, t - 490_000_000, t + 9800, 0.5, energies
                )
            )
    return out


def _digest(events: list[Any]) -> str:
    import hashlib

    return hashlib.sha256(msgspec.msgpack.encode(events)).hexdigest()


def main() -> None:
    HERE.mkdir(exist_ok=True)
    kw: dict[str, Any] = {}
    if "format_version" in inspect.signature(write_recording).parameters:
        kw["format_version"] = 2
    kinds = every_kind(T0) + every_kind(T0 + 100)
    write_recording(HERE / "every_kind.zarc", kinds, header("zstd"), 5, overwrite=True, **kw)
    write_recording(HERE / "every_kind_plain.zarc", kinds, header("none"), 5, overwrite=True, **kw)
    events = samples()
    write_recording(HERE / "samples.zarc", events, header("zstd"), 512, overwrite=True, **kw)
    data = (HERE / "samples.zarc").read_bytes()
    index = RecordingReader(HERE / "samples.zarc").frame_index()
    last = index[-1][0]
    (HERE / "samples_torn.zarc").write_bytes(data[: last + (len(data) - last) // 2])
    expected = {}
    for name in ("every_kind", "every_kind_plain", "samples", "samples_torn"):
        reader = RecordingReader(HERE / f"{name}.zarc")
        got = list(reader)
        assert reader.format_version == 2
        expected[name] = {
            "events": len(got),
            "frames": reader.report.frames_ok,
            "sha256": _digest(got),
            "torn_tail_bytes": reader.report.torn_tail_bytes,
        }
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
