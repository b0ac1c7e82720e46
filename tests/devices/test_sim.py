"""The simulator's physical model: exact ground truth, driver-side views, settings, determinism."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeus_async.clock import FakeClock
from zeus_async.devices.sim import (
    ConstantWorkload,
    GpuOverride,
    RandomWorkload,
    SimConfig,
    SimNode,
    SquareWorkload,
    TraceWorkload,
    load_sim_config,
)
from zeus_async.devices.sim_workload import build_profile
from zeus_async.errors import ConfigError

NS = 1_000_000_000
E0 = 1_700_000_000 * NS  # FakeClock's default wall start; used as epoch and counter origin


def make(**kwargs: object) -> tuple[SimNode, FakeClock]:
    clock = FakeClock(E0)
    config = SimConfig(epoch_ns=E0, counter_origin_ns=E0, **kwargs)  # type: ignore[arg-type]
    return SimNode(config, clock), clock


def at(seconds: float) -> int:
    return E0 + round(seconds * NS)


# -- ground truth -------------------------------------------------------------------------------


def test_constant_workload_power_and_energy() -> None:
    node, _ = make(workload=ConstantWorkload(util=0.5))
    # 70 W idle + 630 W dynamic * 0.5 utilization
    assert node.truth_power_w(0, at(3.3)) == 385.0
    assert node.truth_energy_j(0, at(0), at(2)) == 770.0
    assert node.truth_energy_j(0, at(1.25), at(1.5)) == pytest.approx(96.25, abs=1e-12)
    assert node.truth_energy_j(0, at(2), at(0)) == -770.0


def test_square_workload_exact_integrals() -> None:
    # 0.5 s at 700 W, 1.5 s at 70 W, period 2 s: 455 J per period
    node, _ = make(workload=SquareWorkload(period_s=2.0, duty=0.25))
    assert node.truth_power_w(0, at(0.0)) == 700.0
    assert node.truth_power_w(0, at(0.4999)) == 700.0
    assert node.truth_power_w(0, at(0.5)) == 70.0
    assert node.truth_energy_j(0, at(0), at(4)) == pytest.approx(910.0, rel=1e-15)
    # 0.25 s high + 1.5 s low + 0.5 s high + 0.25 s low
    assert node.truth_energy_j(0, at(0.25), at(2.75)) == pytest.approx(647.5, rel=1e-15)
    # a whole day is a closed form: 43 200 periods
    assert node.truth_energy_j(0, at(0), at(86_400)) == pytest.approx(43_200 * 455.0, rel=1e-12)


def test_square_phase_and_levels() -> None:
    node, _ = make(workload=SquareWorkload(period_s=1.0, duty=0.5, high=0.8, low=0.2, phase_s=0.5))
    assert node.truth_power_w(0, at(0.1)) == pytest.approx(70 + 630 * 0.2)
    assert node.truth_power_w(0, at(0.6)) == pytest.approx(70 + 630 * 0.8)
    assert node.gpus[0].util_at(at(0.6)) == 0.8


def test_trace_workload_and_overrides_per_gpu() -> None:
    node, _ = make(
        num_gpus=2,
        workload=ConstantWorkload(util=1.0),
        gpus=(GpuOverride(workload=TraceWorkload(segments=((1.0, 0.0), (3.0, 1.0)))),),
    )
    assert node.truth_energy_j(0, at(0), at(4)) == pytest.approx(70.0 + 3 * 700.0)
    assert node.truth_energy_j(1, at(0), at(4)) == 2800.0


def test_random_workload_is_piecewise_and_periodic() -> None:
    wl = RandomWorkload(levels=(0.0, 0.5, 1.0), seg_min_s=0.2, seg_max_s=0.4, repeat_s=60.0)
    prof = build_profile(wl, seed=3, gpu_index=0)
    assert prof.period_ns == 60 * NS
    assert set(prof.utils) <= {0.0, 0.5, 1.0}
    node, _ = make(workload=wl, seed=3)
    g = node.gpus[0]
    assert g.util_at(at(12.345)) == g.util_at(at(72.345)) == g.util_at(at(12.345 + 6000))
    # energy over one repetition equals the sum over its segments
    ends = [*prof.offsets_ns[1:], prof.period_ns]
    expected = sum(
        (70 + 630 * u) * (e - s) / NS
        for u, s, e in zip(prof.utils, prof.offsets_ns, ends, strict=True)
    )
    assert node.truth_energy_j(0, at(0), at(60)) == pytest.approx(expected, rel=1e-12)
    assert node.truth_energy_j(0, at(0), at(600)) == pytest.approx(10 * expected, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    a=st.integers(0, 200 * NS),
    d1=st.integers(0, 50 * NS),
    d2=st.integers(0, 50 * NS),
    limit=st.sampled_from([200, 350, 450, 700]),
    lock=st.sampled_from([None, 990, 1500]),
    change=st.integers(0, 300 * NS),
)
def test_energy_is_additive(
    a: int, d1: int, d2: int, limit: int, lock: int | None, change: int
) -> None:
    node, _ = make(workload=RandomWorkload(seg_min_s=0.01, seg_max_s=2.0, repeat_s=120.0), seed=11)
    g = node.gpus[0]
    g.set_power_limit_w(limit, E0 + change)
    if lock is not None:
        g.lock_sm_clocks_mhz(lock, lock, E0 + change + NS)
    b, c = a + d1, a + d1 + d2
    whole = node.truth_energy_j(0, E0 + a, E0 + c)
    parts = node.truth_energy_j(0, E0 + a, E0 + b) + node.truth_energy_j(0, E0 + b, E0 + c)
    assert whole == pytest.approx(parts, rel=1e-9, abs=1e-9)
    assert whole >= 70.0 * (c - a) / NS - 1e-9  # never below idle


# -- what the driver reports --------------------------------------------------------------------


def test_energy_counter_updates_only_on_period_boundaries() -> None:
    node, _ = make(workload=ConstantWorkload(util=0.5))
    g = node.gpus[0]
    assert g.energy_counter_mj(at(0.0)) == 0
    assert g.energy_counter_mj(at(0.0999)) == 0
    assert g.energy_counter_mj(at(0.1)) == 38_500  # 385 W * 0.1 s
    assert g.energy_counter_mj(at(0.1999)) == 38_500
    assert g.energy_counter_mj(at(0.2)) == 77_000
    assert g.energy_counter_mj(at(10.05)) == 3_850_000
    assert g.energy_counter_mj(E0 - NS) == 0  # before the counter origin


def test_default_counter_origin_is_midnight_utc() -> None:
    clock = FakeClock(E0)
    node = SimNode(SimConfig(workload=ConstantWorkload(util=0.0)), clock)
    midnight = E0 - E0 % (86_400 * NS)
    assert node.counter_origin_ns == midnight
    assert node.gpus[0].energy_counter_mj(E0) == (E0 - midnight) // NS * 70_000


def test_instant_and_average_windows() -> None:
    # a 10 ms pulse at 700 W every 100 ms, 70 W otherwise
    node, _ = make(workload=TraceWorkload(segments=((0.01, 1.0), (0.09, 0.0))))
    g = node.gpus[0]
    # instant: first 25 ms of the last completed 100 ms period = 10 ms @700 + 15 ms @70
    assert g.instant_power_mw(at(1.05)) == 322_000
    # average: the last full second = 10 pulses of 7 J + 10 * 6.3 J
    assert g.average_power_mw(at(1.05)) == 133_000
    assert node.truth_power_w(0, at(1.005)) == 700.0


def test_average_power_refreshes_every_100ms() -> None:
    node, _ = make(workload=SquareWorkload(period_s=10.0, duty=0.5))  # 5 s @700, 5 s @70
    g = node.gpus[0]
    assert g.average_power_mw(at(5.0)) == 700_000
    assert g.average_power_mw(at(5.0999)) == 700_000  # not refreshed yet
    assert g.average_power_mw(at(5.1)) == 637_000  # 0.9 s @700 + 0.1 s @70
    assert g.instant_power_mw(at(5.1)) == 70_000  # window [5.0, 5.025)
    assert g.instant_power_mw(at(5.0999)) == 700_000  # window [4.9, 4.925)


def test_temperature_utilization_memory() -> None:
    node, _ = make(workload=ConstantWorkload(util=0.5), thermal_tau_s=10.0)
    g = node.gpus[0]
    assert g.temperature_c(at(20)) == pytest.approx(30.0 + 0.06 * 385.0)
    assert g.utilization_pct(at(20)) == (50, 15)  # memory: util * memory_bound_frac (0.3)
    assert g.memory_power_mw(at(20)) == round((20 + 60 * 0.5) * 1000)
    procs = g.processes
    assert len(procs) == 2
    assert sum(p.sm_share for p in procs) == pytest.approx(1.0)
    assert g.memory_used_bytes == 536_870_912 + sum(p.memory_bytes for p in procs)


# -- settings -----------------------------------------------------------------------------------


def test_power_limit_caps_power_and_lowers_clock_and_throughput() -> None:
    node, _ = make(workload=ConstantWorkload(util=1.0))
    g = node.gpus[0]
    assert g.throughput(at(0.5)) == 1.0
    g.set_power_limit_w(350, at(1.0))
    r = (280 / 630) ** (1 / 3)  # clock ratio with 70 + 630 r^3 == 350
    assert node.truth_power_w(0, at(0.9)) == 700.0
    assert node.truth_power_w(0, at(1.5)) == 350.0
    assert g.sm_clock_mhz(at(1.5)) == pytest.approx(1980 * r)
    assert g.throughput(at(1.5)) == pytest.approx(0.3 + 0.7 * r)
    assert node.truth_energy_j(0, at(0), at(2)) == 1050.0
    assert g.energy_counter_mj(at(2.0)) == 1_050_000
    assert g.power_limit_w == 350.0
    with pytest.raises(ConfigError, match="outside"):
        g.set_power_limit_w(100)


def test_power_limit_does_not_touch_light_load() -> None:
    node, _ = make(workload=ConstantWorkload(util=0.3))  # 259 W uncapped
    g = node.gpus[0]
    g.set_power_limit_w(300, at(0))
    assert node.truth_power_w(0, at(1)) == pytest.approx(259.0)
    assert g.throughput(at(1)) == 1.0


def test_power_cap_never_drops_below_min_clock() -> None:
    node, _ = make(workload=ConstantWorkload(util=1.0), min_sm_clock_mhz=1485)
    g = node.gpus[0]
    g.set_power_limit_w(200, at(0))
    r_min = 1485 / 1980
    assert node.truth_power_w(0, at(1)) == pytest.approx(70 + 630 * r_min**3)
    assert g.sm_clock_mhz(at(1)) == pytest.approx(1485)


def test_locked_clocks_and_reset() -> None:
    node, _ = make(workload=ConstantWorkload(util=1.0))
    g = node.gpus[0]
    g.lock_sm_clocks_mhz(990, 990, at(1))
    assert g.locked_sm_clocks_mhz == (990, 990)
    assert node.truth_power_w(0, at(1.5)) == pytest.approx(70 + 630 * 0.125)
    assert g.sm_clock_mhz(at(1.5)) == pytest.approx(990)
    assert g.throughput(at(1.5)) == pytest.approx(0.65)
    g.reset_sm_clocks(at(2))
    assert g.locked_sm_clocks_mhz is None
    assert node.truth_power_w(0, at(2.5)) == 700.0
    assert node.truth_energy_j(0, at(0), at(3)) == pytest.approx(700 + 148.75 + 700)
    g.lock_sm_clocks_mhz(100, 99_999, at(4))  # clamped to the supported range
    assert g.locked_sm_clocks_mhz == (345, 1980)
    with pytest.raises(ConfigError):
        g.lock_sm_clocks_mhz(1000, 900)


def test_idle_clock_and_supported_clocks() -> None:
    node, _ = make()
    g = node.gpus[0]
    assert g.sm_clock_mhz(at(1)) == 345
    clocks = g.supported_sm_clocks_mhz()
    assert clocks[0] == 1980 and clocks[-1] == 345 and len(clocks) == 110


def test_work_duration_tracks_throughput() -> None:
    node, clock = make(workload=ConstantWorkload(util=1.0))
    assert node.work_duration_s(0, 10.0, at(0)) == pytest.approx(10.0)
    g = node.gpus[0]
    g.set_power_limit_w(350, at(1))
    thru = 0.3 + 0.7 * (280 / 630) ** (1 / 3)
    # 1 unit done before the cap at t=1 s, the rest at the capped speed
    assert node.work_duration_s(0, 2.0, at(0)) == pytest.approx(1 + 1 / thru, rel=1e-9)
    clock.set_ns(5 * NS)
    assert node.work_duration_s(0, 3.0) == pytest.approx(3 / thru, rel=1e-9)
    assert node.work_duration_s(0, 0.0) == 0.0
    # lower limit: more time, less energy for the same work
    t_full = 1.0
    t_cap = 1 / thru
    assert 700 * t_full > 350 * t_cap and t_cap > t_full


def test_work_duration_over_square_workload() -> None:
    node, _ = make(workload=SquareWorkload(period_s=1.0, duty=0.5), num_gpus=1)
    g = node.gpus[0]
    g.set_power_limit_w(350, at(0))
    thru = 0.3 + 0.7 * (280 / 630) ** (1 / 3)
    # each period: 0.5 s busy (capped) + 0.5 s idle (work would run at full clocks)
    per_period = 0.5 * thru + 0.5
    assert node.work_duration_s(0, 3 * per_period, at(0)) == pytest.approx(3.0, rel=1e-9)


# -- per-GPU properties -------------------------------------------------------------------------


def test_pre_volta_lost_and_flags() -> None:
    node, _ = make(
        num_gpus=3,
        gpus=(
            GpuOverride(pre_volta=True),
            GpuOverride(lost_at_s=5.0, no_permission=True),
            GpuOverride(arch="volta", unsupported=("energy",)),
        ),
    )
    a, b, c = node.gpus
    assert (a.arch, a.arch_code, a.has_energy_counter) == ("pascal", 4, False)
    assert not b.is_lost(at(4.999)) and b.is_lost(at(5.0)) and b.no_permission
    assert c.arch == "volta" and not c.has_energy_counter


def test_same_config_same_node_across_instances() -> None:
    cfg = SimConfig(num_gpus=3, seed=42, workload=RandomWorkload(), counter_origin_ns=E0)
    n1 = SimNode(cfg, FakeClock(E0))
    n2 = SimNode(SimConfig.from_json(cfg.to_json()), FakeClock(E0 + 123 * NS))
    for gpu in range(3):
        assert n1.gpus[gpu].uuid == n2.gpus[gpu].uuid
        assert n1.gpus[gpu].processes == n2.gpus[gpu].processes
        for k in range(50):
            t = E0 + k * 7_919_000_000
            assert n1.truth_power_w(gpu, t) == n2.truth_power_w(gpu, t)
            assert n1.gpus[gpu].energy_counter_mj(t) == n2.gpus[gpu].energy_counter_mj(t)
    n3 = SimNode(msgspec.structs.replace(cfg, seed=43), FakeClock(E0))
    traces = [[n.gpus[0].util_at(E0 + k * NS) for k in range(200)] for n in (n1, n3)]
    assert traces[0] != traces[1]
    assert len({g.uuid for g in n1.gpus}) == 3


def test_call_latency_spins() -> None:
    node, _ = make(call_latency_s=0.002)
    start = time.perf_counter()
    node.spin()
    assert time.perf_counter() - start >= 0.002


# -- configuration ------------------------------------------------------------------------------


def test_config_json_roundtrip_and_env(tmp_path: Path) -> None:
    cfg = SimConfig(
        num_gpus=2,
        workload=SquareWorkload(period_s=3.0),
        gpus=(GpuOverride(unsupported=("temperature",), lost_at_s=9.0),),
    )
    text = cfg.to_json()
    assert json.loads(text)["workload"]["kind"] == "square"
    assert SimConfig.from_json(text) == cfg
    path = tmp_path / "sim.json"
    path.write_text(text)
    assert load_sim_config(str(path)) == cfg
    node = SimNode.from_env({"ZEUS_ASYNC_SIM": text}, FakeClock(E0))
    assert node.config == cfg
    assert SimNode.from_env({}, FakeClock(E0)).config == SimConfig()


@pytest.mark.parametrize(
    "text",
    [
        '{"num_gpus": -1}',
        '{"bogus": 1}',
        '{"workload": {"kind": "sawtooth"}}',
        '{"power_limit_min_w": 800}',
        '{"idle_w": 900}',
        '{"workload": {"kind": "random", "seg_min_s": 5, "seg_max_s": 1}}',
        '{"num_gpus": 1, "gpus": [{}, {}]}',
        '{"gpus": [{"unsupported": ["warp_drive"]}]}',
        "not json",
    ],
)
def test_invalid_config_is_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        SimConfig.from_json(text)


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_sim_config("/nonexistent/sim.json")


def test_long_span_counter_is_cheap() -> None:
    node, _ = make(workload=RandomWorkload(seg_min_s=0.001, seg_max_s=0.002, repeat_s=60.0))
    g = node.gpus[0]
    assert len(g.profile.utils) > 10_000
    start = time.perf_counter()
    value = g.energy_counter_mj(at(86_400))  # a day of ~1.5 ms segments: 1440 repetitions
    assert time.perf_counter() - start < 0.05
    per_period = node.truth_energy_j(0, at(0), at(60))
    assert math.isclose(value / 1000, per_period * 1440, rel_tol=1e-9)


def test_power_noise_is_bounded_deterministic_and_spares_the_truth() -> None:
    node, _ = make(workload=ConstantWorkload(util=0.5), power_noise_w=5.0, seed=1)
    twin, _ = make(workload=ConstantWorkload(util=0.5), power_noise_w=5.0, seed=1)
    g, h = node.gpus[0], twin.gpus[0]
    readings = [g.instant_power_mw(at(k / 10)) for k in range(1, 200)]
    assert readings == [h.instant_power_mw(at(k / 10)) for k in range(1, 200)]
    assert all(380_000 <= r <= 390_000 for r in readings)
    assert len(set(readings)) > 100
    assert g.average_power_mw(at(5)) != g.instant_power_mw(at(5))
    assert g.energy_counter_mj(at(2)) == 770_000 and node.truth_power_w(0, at(1)) == 385.0


def test_a_load_set_by_the_program_replaces_the_trace_and_integrates_exactly() -> None:
    cfg = SimConfig(num_gpus=1, workload=ConstantWorkload(util=1.0), epoch_ns=E0)
    node = SimNode(cfg, FakeClock(E0), shared_state=False)
    gpu = node.gpus[0]
    t0 = E0 + 10 * NS
    gpu.set_load(0.0, t0)  # the program waits on another rank
    gpu.set_load(1.0, t0 + NS)  # its kernels run again
    assert gpu.power_w(t0 + NS // 2) == pytest.approx(cfg.idle_w)
    assert gpu.util_at(t0 + NS // 2) == 0.0
    assert gpu.power_w(t0 + 3 * NS // 2) == pytest.approx(cfg.max_w)
    # One second idle, one at full power: the energy integrates both exactly.
    assert gpu.energy_j(t0, t0 + 2 * NS) == pytest.approx(cfg.idle_w + cfg.max_w, rel=1e-9)
    gpu.set_load(None, t0 + 3 * NS)  # back to the trace
    assert gpu.util_at(t0 + 4 * NS) == 1.0
    with pytest.raises(ConfigError, match=r"within 0\.\.1"):
        gpu.set_load(1.5)
