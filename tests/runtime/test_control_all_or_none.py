"""A change asked of several GPUs is all or nothing: every lease is taken (journalled) before
any GPU is changed, so a refusal on one GPU (another client's lease, a journal that cannot be
written) leaves every GPU as it was, and the leases the request took are dropped again."""

from __future__ import annotations

import pytest

from zeus_async.clock import FakeClock
from zeus_async.devices.sim_config import SimConfig
from zeus_async.errors import LeaseConflictError
from zeus_async.runtime import Runtime
from zeus_async.testing import read_sim_node_state, reset_sim_node_state, sim_pynvml

CONFIG = SimConfig(num_gpus=2, seed=41)


@pytest.mark.anyio
@pytest.mark.parametrize("setting", ["sm_clocks", "power_limit"])
async def test_a_refusal_on_one_gpu_changes_none(setting: str) -> None:
    reset_sim_node_state(CONFIG)
    clock = FakeClock()
    try:
        async with Runtime(backend="sim", cpus=None, sim_config=CONFIG, clock=clock) as rt:
            # Another client holds GPU 1's setting.
            if setting == "sm_clocks":
                await rt.set_sm_clocks(1200, [1], holder="other")
            else:
                await rt.set_power_limit(300, [1], holder="other")
            before = read_sim_node_state(CONFIG)
            # This client asks for both GPUs: GPU 1 refuses, so GPU 0 must not change.
            with pytest.raises(LeaseConflictError):
                if setting == "sm_clocks":
                    await rt.set_sm_clocks(990, None, holder="me")
                else:
                    await rt.set_power_limit(250, None, holder="me")
            assert read_sim_node_state(CONFIG) == before
            assert before[0].is_default(CONFIG)
            # And it holds nothing: the lease it took on GPU 0 was dropped again.
            assert rt._held("me", None, None) == []
    finally:
        sim_pynvml.uninstall()
        reset_sim_node_state(CONFIG)
