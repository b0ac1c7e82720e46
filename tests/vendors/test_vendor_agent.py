"""The node agent on every vendor's simulator (real processes): it samples the vendor's GPUs for
an attached client, holds a power-cap lease where the vendor has power caps and restores it when
stopped, and refuses one where it has none."""

from __future__ import annotations

import signal
import time

import pytest
from vendor_cases import VendorCase

from zeus_async import Monitor
from zeus_async.devices.sim_workload import ConstantWorkload
from zeus_async.errors import ConfigError
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import sim_env, start_node_agent


def test_agent_samples_and_restores_leases(
    vendor: VendorCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = vendor.config(num_gpus=1, workload=ConstantWorkload(util=0.5), seed=4)
    monkeypatch.setenv("ZEUS_ASYNC_SIM", config.to_json())
    agent = start_node_agent(sim_env(config))
    try:
        with Monitor(gpu_indices=[0], cpu_indices=[]) as mon:
            assert mon._process is not None and mon._process.attached
            [info] = mon.gpu_devices
            assert info.vendor == vendor.device_vendor
            with mon.window("step") as w:
                time.sleep(0.2)
            assert w.result is not None
            energy = w.result.wait(timeout=10).gpu_energy_j[0]
            assert config.idle_w * 0.1 < energy < config.max_w * 0.4  # 0.2 s at idle..max
            if vendor.power_cap:
                capped = config.power_limit_min_w + 50
                mon.set_power_limit(capped).result(timeout=30)
                assert read_sim_node_state(config)[0].power_limit_w == capped
                agent.send_signal(signal.SIGTERM)  # the agent stops: its leases come back
                agent.wait(timeout=20)
                state = read_sim_node_state(config)[0]
                assert state.power_limit_w == config.power_limit_default_w
            else:
                # No power cap: the agent's runtime controls no GPU of this vendor.
                with pytest.raises(ConfigError, match=r"gpu:0 \(.*\) has no settings"):
                    mon.set_power_limit(config.power_limit_min_w).result(timeout=30)
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=20)
