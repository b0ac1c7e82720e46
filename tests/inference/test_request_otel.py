"""A settled request's energy as OpenTelemetry span attributes (issue 38, item 4), on a span of
the SDK, exported by its in-memory exporter, beside the ``gen_ai.*`` attributes a server sets.
The request is settled by a real meter (fake clock, readings every 10 ms, a carbon intensity)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from zeus_async.carbon import CarbonConfig
from zeus_async.events import GpuSample
from zeus_async.inference import RequestEnergy, RequestMeter
from zeus_async.inference.otel import energy_attributes, set_energy_attributes

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def settled(carbon: bool, tokens_out: int = 8) -> RequestEnergy:
    now = [T0]
    meter = RequestMeter(
        "tokens",
        gpus=[0],
        clock=lambda: now[0],
        lag_s=0.02,
        carbon=CarbonConfig(source="constant", g_per_kwh=400.0) if carbon else None,
    )
    joules = 0.0
    for k in range(60):  # 600 ms at 300 W
        meter.add(GpuSample("h", T0 + k * 10 * MS, 0, power_w=300.0, energy_j=joules))
        joules += 3.0
        now[0] = T0 + k * 10 * MS
        if k == 10:
            meter.begin("r1")
        elif k == 20:
            meter.phase("r1", "decode")
        elif k == 40:
            meter.end("r1", tokens_in=100, tokens_out=tokens_out, model="m")
    meter.settle()
    got = meter.settled("r1")
    assert got is not None
    return got


def test_energy_attributes_sit_beside_gen_ai_ones_on_an_sdk_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    energy = settled(carbon=True)
    with tracer.start_as_current_span("chat m") as span:
        span.set_attribute("gen_ai.usage.input_tokens", 100)
        span.set_attribute("gen_ai.usage.output_tokens", 8)
        set_energy_attributes(span, energy)
    (done,) = exporter.get_finished_spans()
    attrs: dict[str, Any] = dict(done.attributes or {})
    assert attrs["gen_ai.usage.input_tokens"] == 100
    # 300 W over [100 ms, 400 ms], alone on the GPU: 90 J, 30 before the first token
    assert attrs["zeus.energy.joules"] == pytest.approx(90.0, rel=1e-5)
    assert attrs["zeus.energy.prefill_joules"] == pytest.approx(30.0, rel=1e-5)
    assert attrs["zeus.energy.decode_joules"] == pytest.approx(60.0, rel=1e-5)
    assert attrs["zeus.energy.joules"] == energy.energy_j
    assert attrs["zeus.energy.joules_per_output_token"] == energy.energy_j / 8
    assert attrs["zeus.energy.error_joules"] == energy.error_j
    assert attrs["zeus.energy.method"] == energy.method and energy.method.startswith("tokens")
    assert attrs["zeus.energy.finish_reason"] == "completed"
    assert tuple(attrs["zeus.energy.gpus"]) == (0,)
    assert attrs["zeus.co2e.grams"] == pytest.approx(energy.energy_j / 3.6e6 * 400.0, rel=1e-9)
    assert set(attrs) == {"gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"} | set(
        energy_attributes(energy)
    )


def test_what_is_unknown_is_left_out_and_a_failing_span_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    energy = settled(carbon=False, tokens_out=0)
    attrs = energy_attributes(energy)
    assert "zeus.co2e.grams" not in attrs  # no carbon configuration
    assert "zeus.energy.joules_per_output_token" not in attrs  # no output tokens
    assert attrs["zeus.energy.joules"] == pytest.approx(90.0, rel=1e-5)

    class Broken:
        def set_attribute(self, key: str, value: Any) -> None:
            raise ValueError("closed")

    set_energy_attributes(Broken(), energy)
    assert "energy attributes not set on the span of r1" in caplog.text
