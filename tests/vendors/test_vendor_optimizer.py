"""The power-limit optimizer on every vendor's simulator: it profiles and chooses a limit where
the GPUs have a power limit or cap (NVIDIA, AMD), restoring the maximum when closed, and refuses
at construction, saying why and touching nothing, where they have none (Jetson, Apple)."""

from __future__ import annotations

import time

import pytest
from vendor_cases import VendorCase

from zeus_async import Monitor
from zeus_async.devices.sim_workload import ConstantWorkload
from zeus_async.errors import ConfigError
from zeus_async.optimizer import GlobalPowerLimitOptimizer
from zeus_async.testing import read_sim_node_state


def test_the_optimizer_chooses_a_limit_or_refuses(vendor: VendorCase) -> None:
    config = vendor.config(num_gpus=1, workload=ConstantWorkload(util=0.9), seed=2)
    with Monitor(
        backend=vendor.backend,
        cpu_indices=[],
        sim_config=config,
        sampler="thread",
        sync_execution_with=None,
    ) as mon:
        if not vendor.power_cap:
            with pytest.raises(ConfigError) as info:
                GlobalPowerLimitOptimizer(mon, restore_on_signals=False)
            message = str(info.value)
            assert "no power cap to tune" in message
            assert "gpu:0" in message and vendor.device_vendor in message
            assert "power_cap is False" in message
            return
        opt = GlobalPowerLimitOptimizer(
            mon,
            wait_steps=0,
            warmup_steps=0,
            profile_steps=1,
            pl_step=100,
            restore_on_signals=False,
        )
        try:
            hi, lo = int(config.power_limit_max_w), int(config.power_limit_min_w)
            assert opt.power_limits == list(range(hi, lo - 1, -100))
            assert read_sim_node_state(config)[0].power_limit_w == hi  # starts at the maximum
            for _ in range(4 * len(opt.power_limits)):
                opt.on_step_begin()
                time.sleep(0.01)
                if opt.optimal_power_limit is not None:
                    break
            chosen = opt.wait_done(timeout=10)
            assert chosen in opt.power_limits
            assert [m.power_limit for m in opt.measurements] == opt.power_limits
            assert all(m.energy > 0 and m.time > 0 for m in opt.measurements)
            deadline = time.monotonic() + 5
            while read_sim_node_state(config)[0].power_limit_w != chosen:
                assert time.monotonic() < deadline, read_sim_node_state(config)
                time.sleep(0.01)
        finally:
            opt.close()
        assert read_sim_node_state(config)[0].power_limit_w == hi  # restored when closed
