"""The front end's view of the engine cores' results (scheduler hook + RemoteMeter follow):
vLLM's internal request ids mapped back to the client's, :func:`request_energy`."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest

from zeus_async.inference.attribution import Attribution, RequestEnergy
from zeus_async.integrations import vllm as plugin


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (plugin.ENV_METER, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"):
        monkeypatch.delenv(name, raising=False)
    plugin._unfollow()
    yield
    plugin._unfollow()


def _energy(rid: str, joules: float) -> RequestEnergy:
    return RequestEnergy(
        request_id=rid,
        energy_j=joules,
        gpu_energy_j={0: joules},
        prefill_j=None,
        decode_j=None,
        tokens_in=1,
        tokens_out=2,
        time_s=0.1,
        method="equal",
        begin_ns=0,
        end_ns=100,
    )


def test_internal_ids_map_back_to_the_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    ext = plugin.external_id
    assert ext("chatcmpl-3f2a9c0d1e-1a2b3c4d") == "chatcmpl-3f2a9c0d1e"
    assert ext("cmpl-7-ABCDEF12") == "cmpl-7"
    assert ext("my-id-a1b2c3d4") == "my-id"  # dashes of the client's kept
    assert ext("plain") == "plain"  # not an internal id: as it is
    assert ext("x-1234567") == "x-1234567" and ext("x-123456789") == "x-123456789"
    assert ext("x-1234-678") == "x-1234-678"  # not 8 alphanumerics
    assert ext("-12345678") == "-12345678"  # no id before the suffix
    assert ext("r-1a2b3c4d", randomized=False) == "r-1a2b3c4d"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert ext("r-1a2b3c4d") == "r-1a2b3c4d"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0")
    assert ext("r-1a2b3c4d") == "r"


def test_core_results_are_found_by_the_clients_id() -> None:
    assert plugin.core_meter_name(0) == "vllm-core0"
    out = Attribution(0, 100, "equal")
    out.requests = {
        "chatcmpl-a-1a2b3c4d": _energy("chatcmpl-a-1a2b3c4d", 3.0),
        "b-deadbeef": _energy("b-deadbeef", 4.0),
    }
    plugin._followed.take("vllm-core0", out)
    got = plugin.request_energy("chatcmpl-a")
    assert got is not None and got.energy_j == 3.0
    assert got.request_id == "chatcmpl-a-1a2b3c4d"  # vLLM's internal id, as settled
    b = plugin.request_energy("b")
    assert b is not None and b.energy_j == 4.0
    assert plugin.request_energy("chatcmpl-a-1a2b3c4d") is None
    assert plugin.request_energy("nobody") is None


def test_the_index_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "_KEEP_RESULTS", 3)
    for i in range(5):
        out = Attribution(0, 100, "equal")
        out.requests = {f"r{i}-0000000{i}": _energy(f"r{i}-0000000{i}", float(i))}
        plugin._followed.take("vllm-core0", out)
    assert list(plugin._followed.by_id) == ["r2", "r3", "r4"]
    assert plugin.request_energy("r0") is None


def _follower() -> Any:
    return plugin._followed.meter


def test_the_stat_logger_follows_the_cores_when_the_hook_runs(
    monkeypatch: pytest.MonkeyPatch, private_dir: object
) -> None:
    pytest.importorskip("vllm.v1.metrics.loggers")
    cfg = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(scheduler_cls=plugin.SCHEDULER_CLS),
        parallel_config=types.SimpleNamespace(data_parallel_size=2),
    )
    cls = plugin.ZeusStatLogger
    assert cls(cfg, 0).feed is None and _follower() is None  # no remote meter
    monkeypatch.setenv(plugin.ENV_METER, "remote")
    first, second = cls(cfg, 0), cls(cfg, 1)
    meter = _follower()
    assert first.feed is None and second.feed is None and meter is not None
    assert meter.follow == ("vllm-core0", "vllm-core1") and meter.name == "vllm"
    assert plugin.follow_engine_cores(2) is meter  # once per process
