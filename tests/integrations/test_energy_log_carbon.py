"""Which carbon configuration an energy callback's figures use, and what it refuses (no
framework needed: the callbacks' shared part, with monitor stand-ins)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from zeus_async.aggregate.footprints import Carbon
from zeus_async.carbon import CarbonConfig, ConstantIntensity
from zeus_async.errors import ConfigError
from zeus_async.integrations import EnergyLog

FR = CarbonConfig(zone="FR")
CONSTANT = CarbonConfig(source="constant", g_per_kwh=100.0)


class StandIn:
    """What an EnergyLog reads of a monitor before it starts: its carbon configuration."""

    def __init__(self, carbon: Any) -> None:
        self.carbon = Carbon.of(carbon)


def test_the_monitors_configuration_by_default() -> None:
    monitor = StandIn(FR)
    log = EnergyLog(monitor)  # type: ignore[arg-type]
    assert log.carbon is monitor.carbon
    assert EnergyLog(StandIn(None)).carbon is None  # type: ignore[arg-type]
    assert EnergyLog().carbon is None


def test_the_callbacks_own_configuration_for_the_monitor_it_makes() -> None:
    log = EnergyLog(carbon=CONSTANT, emissions_file="emissions.csv")
    assert log.carbon is not None and log.carbon.config == CONSTANT
    copy = pickle.loads(pickle.dumps(log))  # a ddp_spawn rank
    assert copy.carbon is not None and copy.carbon.config == CONSTANT
    assert copy._emissions_file == "emissions.csv"
    source = ConstantIntensity(50.0)
    assert EnergyLog(carbon=source).carbon.source is source  # type: ignore[union-attr]


def test_the_same_configuration_as_the_monitors_is_accepted() -> None:
    monitor = StandIn(FR)
    assert EnergyLog(monitor, carbon=FR).carbon is monitor.carbon  # type: ignore[arg-type]


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="give it to the monitor"):
        EnergyLog(StandIn(None), carbon=FR)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="differs from the monitor's"):
        EnergyLog(StandIn(FR), carbon=CONSTANT)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs carbon"):
        EnergyLog(emissions_file="emissions.csv")
    with pytest.raises(ConfigError, match="with a monitor of your own"):
        EnergyLog(StandIn(FR), emissions_file="emissions.csv")  # type: ignore[arg-type]
