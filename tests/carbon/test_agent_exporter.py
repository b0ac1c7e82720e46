"""CO2e and cost series from the exporter a private agent runs for
``Monitor(sampler="process", prometheus_port=...)`` (a real agent process on the simulator);
a node agent keeps no carbon configuration."""

from __future__ import annotations

import logging
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zeus_async import Monitor
from zeus_async.agent.protocol import AgentConfig
from zeus_async.agent.server import _carbon
from zeus_async.carbon import CarbonConfig
from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload

G, PRICE = 400.0, 0.2
CONFIG = CarbonConfig(source="constant", g_per_kwh=G, price_per_kwh=PRICE, currency="EUR", pue=1.2)

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Series:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def named(values: Series, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in values.items() if n == name}


def test_a_private_agents_exporter_has_the_co2e_series() -> None:
    sim = SimConfig(num_gpus=1, workload=ConstantWorkload(util=0.5))
    with Monitor(
        backend="sim",
        sim_config=sim,
        cpu_indices=[],
        sampler="process",
        prometheus_port=0,
        carbon=CONFIG,
    ) as mon:
        port = mon.prometheus_port
        assert port is not None
        mon.begin_window("w")
        time.sleep(0.3)
        result = mon.end_window("w")
        deadline = time.monotonic() + 20
        while True:
            values = scrape(port)
            windows = named(values, "zeus_window_co2e_grams_total")
            if windows or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    (gpu_labels, grams), *rest = named(values, "zeus_gpu_co2e_grams_total").items()
    assert not rest and grams > 0
    assert dict(gpu_labels)["source"] == "constant"
    ((cost_labels, cost),) = named(values, "zeus_gpu_energy_cost_total").items()
    assert dict(cost_labels)["currency"] == "EUR"
    assert cost == pytest.approx(grams / G * PRICE, rel=1e-9)  # one energy, two rates
    # The window, as the agent's exporter counts it and as the client computed it.
    ((window_labels, window_grams),) = windows.items()
    assert dict(window_labels)["window"] == "w" and dict(window_labels)["source"] == "constant"
    assert result.co2e_g is not None and result.co2e_g > 0
    assert window_grams == pytest.approx(result.co2e_g, rel=1e-9)
    assert result.footprint is not None
    assert window_grams == pytest.approx(result.footprint.energy_j * 1.2 * G / 3.6e6, rel=1e-9)


def test_a_node_agent_keeps_no_carbon_configuration(caplog: pytest.LogCaptureFixture) -> None:
    private = AgentConfig(endpoint="ipc:///x", owner_pid=123, carbon=CONFIG)
    assert _carbon(private) == CONFIG
    assert _carbon(AgentConfig(endpoint="ipc:///x", owner_pid=123)) is None
    with caplog.at_level(logging.WARNING):
        assert _carbon(AgentConfig(endpoint="ipc:///x", carbon=CONFIG)) is None
    assert "node agent keeps no carbon configuration" in caplog.text
    # It travels on the agent's command line as JSON.
    import msgspec

    assert msgspec.json.decode(msgspec.json.encode(private), type=AgentConfig).carbon == CONFIG
