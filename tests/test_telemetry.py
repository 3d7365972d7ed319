"""Requests produce an OpenTelemetry span and exact metric counts."""

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tieredkv import AsyncEngine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def otel():
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        pytest.fail("another test installed a global tracer provider first")
    return exporter, reader


def metric_sums(reader) -> dict[str, int]:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if hasattr(m.data, "data_points") and m.data.data_points and hasattr(m.data.data_points[0], "value"):
                    out[m.name] = sum(p.value for p in m.data.data_points)
    return out


async def test_request_span_and_counters(otel, llama_dir):
    exporter, reader = otel
    async with await AsyncEngine.start(EngineConfig(model=str(llama_dir), num_blocks=64)) as engine:
        prompt = list(range(3, 40))
        await engine.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        await engine.generate(prompt, SamplingParams(max_tokens=3, n=2, ignore_eos=True))
    spans = [s for s in exporter.get_finished_spans() if s.name == "tieredkv.request"]
    assert len(spans) == 2
    assert spans[0].attributes["tieredkv.prompt_tokens"] == 37
    assert spans[0].attributes["tieredkv.completion_tokens"] == 5
    assert spans[1].attributes["tieredkv.completion_tokens"] == 6
    assert spans[1].attributes["tieredkv.cached_prompt_tokens"] == 32
    assert list(spans[1].attributes["tieredkv.finish_reasons"]) == ["length", "length"]
    sums = metric_sums(reader)
    assert sums["tieredkv.requests"] == 2
    assert sums["tieredkv.generated_tokens"] == 11
    assert sums["tieredkv.prompt_tokens"] == 74
    assert sums["tieredkv.cached_prompt_tokens"] == 32
