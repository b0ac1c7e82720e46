"""RAPL backend against a fake powercap tree (zeus_async.testing.fake_sysfs)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeus_async.devices import rapl
from zeus_async.devices.base import Device
from zeus_async.devices.rapl import (
    RaplPackage,
    find_rapl_zones,
    open_rapl_packages,
    rapl_available,
    unwrap_delta_uj,
)
from zeus_async.errors import (
    DeviceError,
    DeviceLostError,
    DeviceNotFoundError,
    NoPermissionError,
    ZeusAsyncError,
)
from zeus_async.events import Capabilities, DeviceInfo, RaplSample
from zeus_async.testing.fake_sysfs import DEFAULT_RANGE_UJ, FakePowercap

HOST = "node0"
T0 = 1_700_000_000 * 10**9
SEC = 10**9


@pytest.fixture
def fake(tmp_path: Path) -> FakePowercap:
    return FakePowercap(tmp_path / "powercap")


@contextlib.contextmanager
def opened(root: Path, **kwargs: object) -> Iterator[list[RaplPackage]]:
    devices = open_rapl_packages(root, **kwargs)  # type: ignore[arg-type]
    try:
        yield devices
    finally:
        for device in devices:
            device.close()


def samples(
    device: RaplPackage, t_ns: int, fields: tuple[str, ...] | None = None
) -> dict[str, RaplSample]:
    out = device.read(device.fields if fields is None else fields, HOST, t_ns)
    result: dict[str, RaplSample] = {}
    for event in out:
        assert isinstance(event, RaplSample)
        result[event.domain] = event
    return result


# -- discovery ----------------------------------------------------------------------------------


def test_discovers_package_core_dram_psys(fake: FakePowercap) -> None:
    fake.add_package(0, ("core", "dram"))
    fake.add_psys()
    with opened(fake.root) as devices:
        assert len(devices) == 1
        (dev,) = devices
        assert isinstance(dev, Device)
        assert dev.key == "cpu:0"
        assert dev.package == 0
        assert dev.fields == ("package", "core", "dram", "psys")
        info = dev.describe()
        assert info == DeviceInfo(
            key="cpu:0",
            name="CPU package 0 (RAPL)",
            arch="cpu",
            has_energy_counter=True,
            energy_method="counter",
            capabilities=Capabilities(energy_counter=True),
        )
        assert dev.max_energy_range_uj("core") == DEFAULT_RANGE_UJ
        with pytest.raises(KeyError):
            dev.max_energy_range_uj("uncore")


def test_zones_identified_by_name_not_index(fake: FakePowercap) -> None:
    # Server layout: dram is the first (and only) sub-zone.
    fake.add_package(0, ("dram",))
    zones = find_rapl_zones(fake.root)
    assert [(z.package, z.domain, z.zone) for z in zones] == [
        (0, "package", "intel-rapl:0"),
        (0, "dram", "intel-rapl:0:0"),
    ]


def test_missing_domains_absent_and_logged(
    fake: FakePowercap, caplog: pytest.LogCaptureFixture
) -> None:
    fake.add_package(0, ())
    with (
        caplog.at_level(logging.INFO, logger="zeus_async.devices.rapl"),
        opened(fake.root) as (dev,),
    ):
        assert dev.fields == ("package",)
        assert set(samples(dev, T0)) == {"package"}
        # Domains the package lacks are ignored, not faked.
        assert set(samples(dev, T0 + SEC, ("package", "dram", "bogus"))) == {"package"}
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "package 0: domains package (not present: core, uncore, dram, psys)" in m for m in messages
    )


def test_multiple_packages_and_selection(fake: FakePowercap) -> None:
    fake.add_package(0, ("core", "uncore", "dram"))
    fake.add_package(1, ("core", "dram"))
    with opened(fake.root) as devices:
        assert [d.key for d in devices] == ["cpu:0", "cpu:1"]
        assert devices[0].fields == ("package", "core", "uncore", "dram")
        assert devices[1].fields == ("package", "core", "dram")
    with opened(fake.root, packages=[1]) as devices:
        assert [d.key for d in devices] == ["cpu:1"]
    with pytest.raises(DeviceNotFoundError, match=r"package\(s\) \[3\] not found.*\[0, 1\]"):
        open_rapl_packages(fake.root, packages=[0, 3])


def test_packages_are_independent(fake: FakePowercap) -> None:
    fake.add_package(0, ())
    fake.add_package(1, ())
    with opened(fake.root) as (p0, p1):
        samples(p0, T0)
        samples(p1, T0)
        fake.add_energy_j(1, "package", 7.0)
        assert samples(p0, T0 + SEC)["package"].energy_j == 0.0
        s1 = samples(p1, T0 + SEC)["package"]
        assert (s1.package, s1.energy_j, s1.power_w) == (1, 7.0, 7.0)


def test_mmio_duplicate_and_unknown_zones_skipped(
    fake: FakePowercap, caplog: pytest.LogCaptureFixture
) -> None:
    fake.add_package(0, ("core",))
    fake.add_package(0, (), prefix="intel-rapl-mmio")
    fake.add_zone("intel-rapl:7", "mystery")
    with caplog.at_level(logging.INFO, logger="zeus_async.devices.rapl"):
        zones = find_rapl_zones(fake.root)
    assert [(z.domain, z.zone) for z in zones] == [
        ("package", "intel-rapl:0"),
        ("core", "intel-rapl:0:0"),
    ]
    text = caplog.text
    assert "intel-rapl-mmio:0" in text and "already read from intel-rapl:0" in text
    assert "intel-rapl:7" in text and "mystery" in text


def test_mmio_and_amd_used_when_alone(fake: FakePowercap) -> None:
    fake.add_package(0, ("core",), prefix="amd-rapl")
    fake.add_package(1, (), prefix="intel-rapl-mmio")
    with opened(fake.root) as (p0, p1):
        assert p0.fields == ("package", "core")
        assert p1.fields == ("package",)
        samples(p1, T0)
        fake.add_energy_uj(1, "intel-rapl-mmio/package", 2_500_000)
        assert samples(p1, T0 + SEC)["package"].energy_j == 2.5


def test_root_can_be_a_control_type_dir(fake: FakePowercap) -> None:
    fake.add_package(0, ("dram",))
    zones = find_rapl_zones(fake.root / "intel-rapl")
    assert [z.domain for z in zones] == ["package", "dram"]


def test_missing_powercap(tmp_path: Path) -> None:
    for root in (tmp_path / "nope", tmp_path):
        with pytest.raises(DeviceNotFoundError) as info:
            open_rapl_packages(root)
        message = str(info.value)
        assert f"no RAPL powercap zones under {root}" in message
        assert "intel_rapl kernel module loaded" in message
        assert info.value.kind == "not_found"
        assert not rapl_available(root)


def test_rapl_available(fake: FakePowercap) -> None:
    fake.add_package(0, ())
    assert rapl_available(fake.root)
    fake.restrict()
    with fake.unprivileged():
        assert not rapl_available(fake.root)


# -- readings -----------------------------------------------------------------------------------


def test_first_read_is_zero_and_power_from_t_ns(fake: FakePowercap) -> None:
    fake.add_package(0, ("dram",), energy_uj={"package": 123_456_789, "dram": 5})
    with opened(fake.root) as (dev,):
        first = samples(dev, T0)
        assert first["package"] == RaplSample(HOST, T0, 0, "package", 0.0, None)
        assert first["dram"].energy_j == 0.0 and first["dram"].power_w is None
        fake.add_energy_j(0, "package", 30.0)
        fake.add_energy_j(0, "dram", 4.5)
        second = samples(dev, T0 + SEC // 2)  # half a second later, by the injected clock
        assert second["package"].energy_j == 30.0
        assert second["package"].power_w == pytest.approx(60.0)
        assert second["dram"].power_w == pytest.approx(9.0)
        assert second["package"].t_ns == T0 + SEC // 2 and second["package"].host == HOST
        fake.add_energy_j(0, "package", 1.0)
        third = samples(dev, T0 + SEC // 2 + 10**7)  # 10 ms
        assert third["package"].energy_j == 31.0
        assert third["package"].power_w == pytest.approx(100.0)


def test_power_none_when_time_does_not_advance(fake: FakePowercap) -> None:
    fake.add_package(0, ())
    with opened(fake.root) as (dev,):
        samples(dev, T0)
        fake.add_energy_j(0, "package", 1.0)
        again = samples(dev, T0)["package"]
        assert again.energy_j == 1.0 and again.power_w is None
        fake.add_energy_j(0, "package", 1.0)
        back = samples(dev, T0 - SEC)["package"]  # wall clock stepped back
        assert back.energy_j == 2.0 and back.power_w is None


def test_power_is_per_domain_since_its_own_previous_read(fake: FakePowercap) -> None:
    fake.add_package(0, ("dram",))
    with opened(fake.root) as (dev,):
        samples(dev, T0)
        fake.add_energy_j(0, "dram", 2.0)
        samples(dev, T0 + SEC, ("package",))  # dram not read here
        fake.add_energy_j(0, "dram", 2.0)
        dram = samples(dev, T0 + 2 * SEC, ("dram",))["dram"]
        assert dram.energy_j == 4.0
        assert dram.power_w == pytest.approx(2.0)  # 4 J over 2 s


def test_single_wrap(fake: FakePowercap) -> None:
    rng = 1_000_000  # 1 J range, to wrap quickly
    fake.add_package(0, (), max_energy_range_uj=rng, energy_uj=900_000)
    with opened(fake.root) as (dev,):
        samples(dev, T0)
        fake.add_energy_uj(0, "package", 250_000)  # 900_000 -> 150_000
        assert fake.energy_uj(0, "package") == 150_000
        s = samples(dev, T0 + SEC)["package"]
        assert s.energy_j == 0.25
        assert s.power_w == pytest.approx(0.25)


def test_several_wraps_over_a_sequence(fake: FakePowercap) -> None:
    rng = DEFAULT_RANGE_UJ
    fake.add_package(0, ("core",), energy_uj=rng - 10)
    steps = [rng - 1, 7, rng // 2, rng // 2 + 3, 0, rng - 100, 12_345]
    with opened(fake.root) as (dev,):
        samples(dev, T0)
        total = 0
        for i, step in enumerate(steps, start=1):
            fake.add_energy_uj(0, "package", step)
            total += step
            s = samples(dev, T0 + i * SEC)["package"]
            assert s.energy_j == total / 1e6
        assert total > 3 * rng  # the counter wrapped several times


def test_counter_at_exact_range_and_zero(fake: FakePowercap) -> None:
    rng = 1000
    fake.add_package(0, (), max_energy_range_uj=rng, energy_uj=rng)
    with opened(fake.root) as (dev,):
        samples(dev, T0)
        fake.set_energy_uj(0, "package", 0)  # a wrap from the very top
        assert samples(dev, T0 + 1)["package"].energy_j == 0.0
        fake.set_energy_uj(0, "package", 400)
        assert samples(dev, T0 + 2)["package"].energy_j == 400 / 1e6


def test_unwrap_delta() -> None:
    assert unwrap_delta_uj(10, 25, 100) == 15
    assert unwrap_delta_uj(90, 5, 100) == 15
    assert unwrap_delta_uj(42, 42, 100) == 0


@settings(max_examples=60, deadline=None)
@given(
    rng=st.integers(min_value=1, max_value=2**40),
    start_frac=st.floats(min_value=0.0, max_value=1.0),
    steps=st.lists(st.floats(min_value=0.0, max_value=1.0, exclude_max=True), max_size=40),
)
def test_unwrapped_total_equals_sum_of_increments(
    rng: int, start_frac: float, steps: list[float]
) -> None:
    increments = [min(int(f * rng), rng - 1) for f in steps]
    with tempfile.TemporaryDirectory() as tmp:
        fake = FakePowercap(Path(tmp) / "powercap")
        fake.add_package(0, (), max_energy_range_uj=rng, energy_uj=min(int(start_frac * rng), rng))
        with opened(fake.root) as (dev,):
            assert samples(dev, T0)["package"].energy_j == 0.0
            for i, inc in enumerate(increments, start=1):
                fake.add_energy_uj(0, "package", inc)
                dev.read(("package",), HOST, T0 + i * SEC)
            total = sum(increments)
            final = samples(dev, T0 + (len(increments) + 1) * SEC)["package"]
            assert final.energy_j == total / 1e6


def test_read_state_unchanged_when_one_domain_fails(fake: FakePowercap) -> None:
    fake.add_package(0, ("dram",))
    with opened(fake.root) as (dev,):
        samples(dev, T0)
        fake.add_energy_j(0, "package", 3.0)
        fake.write_raw(0, "dram", "garbage\n")
        with pytest.raises(DeviceError):
            dev.read(dev.fields, HOST, T0 + SEC)
        fake.set_energy_uj(0, "dram", 0)
        s = samples(dev, T0 + 2 * SEC)
        assert s["package"].energy_j == 3.0
        assert s["package"].power_w == pytest.approx(1.5)  # since the last *successful* read


def test_close_is_idempotent_and_read_after_close_raises(fake: FakePowercap) -> None:
    fake.add_package(0, ())
    (dev,) = open_rapl_packages(fake.root)
    dev.close()
    dev.close()
    with pytest.raises(DeviceError, match="closed"):
        dev.read(dev.fields, HOST, T0)
    with RaplPackage(0, find_rapl_zones(fake.root), fake.root) as dev2:
        assert dev2.read(dev2.fields, HOST, T0)


def test_pread_rereads_in_place_updates(fake: FakePowercap) -> None:
    """A kept-open fd re-read at offset 0 sees in-place rewrites, even to shorter values."""
    fake.add_package(0, (), energy_uj=123_456_789)
    with opened(fake.root) as (dev,):
        samples(dev, T0)
        fake.set_energy_uj(0, "package", 123_456_790)
        assert samples(dev, T0 + 1)["package"].energy_j == 1e-6
        fake.set_energy_uj(0, "package", 5)  # shorter text: wrap
        s = samples(dev, T0 + 2)["package"]
        assert s.energy_j == (DEFAULT_RANGE_UJ - 123_456_790 + 5 + 1) / 1e6


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content", ["", "\n", "abc\n", "-5\n", "1.5\n", "1_000\n", "12 34\n", "9" * 30 + "\n"]
)
def test_malformed_counter_is_a_device_error(fake: FakePowercap, content: str) -> None:
    fake.add_package(0, ())
    with opened(fake.root) as (dev,):
        samples(dev, T0)
        fake.write_raw(0, "package", content)
        with pytest.raises(DeviceError, match="malformed RAPL counter") as info:
            dev.read(dev.fields, HOST, T0 + SEC)
        assert not isinstance(info.value, ValueError)
        assert info.value.device == "cpu:0"
        assert "energy_uj" in str(info.value)


def test_malformed_at_open(fake: FakePowercap) -> None:
    fake.add_package(0, ("dram",))
    fake.write_raw(0, "dram", "oops")
    with pytest.raises(DeviceError, match=r"malformed RAPL counter .*intel-rapl:0:0.*energy_uj"):
        open_rapl_packages(fake.root)
    fake.set_energy_uj(0, "dram", 1)
    fake.write_raw(0, "dram", "x\n", file="max_energy_range_uj")
    with pytest.raises(DeviceError, match=r"malformed RAPL counter .*max_energy_range_uj"):
        open_rapl_packages(fake.root)
    fake.write_raw(0, "dram", "0\n", file="max_energy_range_uj")
    with pytest.raises(DeviceError, match="invalid RAPL counter range"):
        open_rapl_packages(fake.root)


def test_counter_above_range_is_a_device_error(fake: FakePowercap) -> None:
    fake.add_package(0, (), max_energy_range_uj=1000)
    with opened(fake.root) as (dev,):
        samples(dev, T0)
        fake.write_raw(0, "package", "1001\n")
        with pytest.raises(DeviceError, match="above its range"):
            dev.read(dev.fields, HOST, T0 + SEC)


def test_permission_denied_is_no_permission_error(fake: FakePowercap) -> None:
    fake.add_package(0, ("core",))
    fake.restrict(0, "core")
    with fake.unprivileged(), pytest.raises(NoPermissionError) as info:
        open_rapl_packages(fake.root)
    err = info.value
    message = str(err)
    assert err.kind == "no_permission" and err.device == "cpu:0"
    assert isinstance(err, ZeusAsyncError)
    assert "intel-rapl:0:0/energy_uj" in message
    assert "root" in message
    assert f"sudo chmod o+r {fake.root}/intel-rapl:*/energy_uj" in message
    assert "udev" in message
    # Outside the emulation (and for readable files) the same tree opens fine.
    with opened(fake.root) as (dev,):
        assert dev.fields == ("package", "core")


def test_read_error_mapping(fake: FakePowercap, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    fake.add_package(0, ())
    with opened(fake.root) as (dev,):

        def fail(fd: int) -> bytes:
            raise OSError(errno.ENODEV, "No such device")

        monkeypatch.setattr(rapl, "_read_fd", fail)
        with pytest.raises(DeviceLostError, match="disappeared"):
            dev.read(dev.fields, HOST, T0)


def _nobody_ids() -> tuple[int, int] | None:
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
    except (ImportError, KeyError):
        return None
    return entry.pw_uid, entry.pw_gid


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0 or _nobody_ids() is None,
    reason="needs root on Linux to drop privileges in a forked child",
)
def test_real_permission_denied_as_unprivileged_user() -> None:
    """No emulation: a forked child drops to ``nobody`` and the kernel refuses the open."""
    ids = _nobody_ids()
    assert ids is not None
    uid, gid = ids
    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o755)
        fake = FakePowercap(base / "powercap")
        fake.add_package(0, ())
        fake.restrict()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: report the outcome through the pipe, always _exit
            outcome = b"?"
            try:
                os.close(read_end)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                try:
                    open_rapl_packages(fake.root)
                    outcome = b"opened"
                except NoPermissionError as exc:
                    outcome = b"no_permission:" + str(exc).encode()
                except BaseException as exc:
                    outcome = b"other:" + repr(exc).encode()
                os.write(write_end, outcome)
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            result = pipe.read().decode()
        os.waitpid(pid, 0)
        assert result.startswith("no_permission:"), result
        assert "sudo chmod o+r" in result
    finally:
        shutil.rmtree(base)
