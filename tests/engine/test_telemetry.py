"""Requests produce an OpenTelemetry span and exact metric counts."""

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from helpers import make_config
from tieredkv import SamplingParams


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


async def test_request_span_and_counters(engines, otel, llama_dir):
    exporter, reader = otel
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64)) as engine:
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


def points(reader) -> dict[str, list]:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


def by_attr(pts, key) -> dict:
    return {p.attributes.get(key): p.value for p in pts}


@pytest.mark.parametrize("core_process", [False, True], ids=["in-process", "core process"])
async def test_a_scripted_scenario_gives_exact_metrics_and_span_events(engines, otel, llama_dir, core_process):
    """The same figures whichever process runs the core (its records reach the application's providers)."""
    import pytest as _pytest

    from tieredkv import RequestError

    exporter, reader = otel
    before = points(reader)
    exporter.clear()
    shared = list(range(3, 3 + 64))  # 64 tokens: 4 full blocks
    cfg = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0, core_process=core_process)
    async with await engines.start(cfg) as engine:
        await engine.generate(shared + [200, 201], SamplingParams(max_tokens=4, ignore_eos=True))
        second = await engine.generate(shared + [300, 301, 302], SamplingParams(max_tokens=6, ignore_eos=True))
        assert second.usage.cached_tokens_by_tier["hot"] == 64
        async for _ in engine.stream(shared + [400], SamplingParams(max_tokens=50, ignore_eos=True),
                                     request_id="left"):
            break
        with _pytest.raises(RequestError):
            engine.stream([], SamplingParams())
        await engine.pins()  # a call after the request: the core's records of it have arrived
        after = points(reader)
        stats = engine.stats()

    def delta(name, key, value):
        old = by_attr(before.get(name, []), key).get(value, 0)
        return by_attr(after[name], key).get(value, 0) - old

    assert delta("tieredkv.prompt_tokens", "source", "hot") == 64
    assert delta("tieredkv.prompt_tokens", "source", "computed") == 66 + 3
    assert delta("tieredkv.requests", "finish_reason", "length") == 2
    assert delta("tieredkv.requests", "finish_reason", "abort") == 1
    assert delta("tieredkv.requests", "finish_reason", "rejected") == 1
    hist = {p.attributes.get("x"): p for p in after["gen_ai.server.time_to_first_token"]}[None]
    old = before.get("gen_ai.server.time_to_first_token")
    assert hist.count - (old[0].count if old else 0) == 3  # every request that produced a token
    assert list(hist.explicit_bounds)[:3] == [0.005, 0.01, 0.025]  # not the SDK's 0, 5, 10 ...
    itl = after["gen_ai.server.time_per_output_token"][0]
    assert itl.count - (before["gen_ai.server.time_per_output_token"][0].count
                        if "gen_ai.server.time_per_output_token" in before else 0) >= 3 + 5
    assert list(after["tieredkv.step.duration"][0].explicit_bounds)[0] == 0.001
    running = after["tieredkv.requests.running"][0].value
    usage = by_attr(after["tieredkv.kv_cache.usage"], "tier")
    assert running == stats.num_running == 0 and 0 < usage["hot"] <= 1
    assert by_attr(after["tieredkv.kv_cache.used_bytes"], "tier")["hot"] == stats.tiers["hot"].used_bytes
    assert by_attr(after["tieredkv.kv_cache.bytes_per_token"], "format") == {"float32": 3 * 2 * 2 * 16 * 4}
    spans = {s.attributes["tieredkv.request_id"]: s for s in exporter.get_finished_spans()
             if s.name == "tieredkv.request"}
    events = [e.name for s in spans.values() if s.attributes.get("tieredkv.completion_tokens") == 6
              for e in s.events]
    assert events[:3] == ["queued", "admitted", "first_token"] and events[-1] == "finished"
    admitted = next(e for s in spans.values() for e in s.events if e.name == "admitted"
                    and e.attributes.get("tieredkv.cached_tokens.hot") == 64)
    assert admitted is not None
    assert spans["left"].attributes["tieredkv.finish_reasons"] == ("abort",)


def test_serve_metrics_is_scrapeable_over_http(llama_dir):
    """In a child process: serve_metrics sets the process's meter provider."""
    import os
    import subprocess
    import sys
    from helpers import ROOT

    code = """
import asyncio, sys, urllib.request
from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.engine.telemetry import serve_metrics

async def main():
    port = serve_metrics(0)
    async with await AsyncEngine.start(EngineConfig(model=sys.argv[1], num_blocks=32, compile_decode=False)) as engine:
        await engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
        await engine.pins()  # a call after the request: the core's records of it have arrived
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
        print(text.decode())

asyncio.run(main())
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, str(llama_dir)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout
    assert 'tieredkv_generated_tokens_total' in text and 'tieredkv_requests_total{' in text
    assert 'gen_ai_server_time_to_first_token_seconds_bucket{' in text
    assert 'tieredkv_kv_cache_usage_ratio{' in text or 'tieredkv_kv_cache_usage{' in text


async def test_a_promotion_is_a_span_event_with_counts(engines, otel, llama_dir):
    exporter, _ = otel
    exporter.clear()
    cfg = make_config(model=str(llama_dir), num_blocks=12, warm_bytes=64 * 3 * 2 * 16 * 2 * 16 * 4)
    prompt = list(range(3, 3 + 64)) + [5]
    async with await engines.start(cfg) as engine:
        await engine.generate(prompt, SamplingParams(max_tokens=1))
        await engine.generate(list(range(100, 290)), SamplingParams(max_tokens=1))  # evicts the prompt to warm
        out = await engine.generate(prompt, SamplingParams(max_tokens=1))
    assert out.usage.cached_tokens_by_tier["warm"] == 64
    promoted = [e for s in exporter.get_finished_spans() for e in s.events if e.name == "promoted"]
    assert [dict(e.attributes) for e in promoted] == [{"tieredkv.promoted_tokens.warm": 64}]


async def test_offloaded_blocks_are_metrics(engines, otel, llama_dir):
    """A prompt of 20 blocks on a pool of 8: its old blocks go to the warm tier, and the counter says how many."""
    _, reader = otel
    before = metric_sums(reader).get("tieredkv.kv_cache.offloaded_blocks", 0)
    cfg = make_config(model=str(llama_dir), num_blocks=8, warm_bytes=64 * 3 * 2 * 16 * 2 * 16 * 4)
    async with await engines.start(cfg) as engine:
        await engine.generate([(7 * i) % 400 + 3 for i in range(320)], SamplingParams(max_tokens=4, ignore_eos=True))
        stats = engine.stats()
        sums = metric_sums(reader)
    assert stats.blocks_offloaded > 0 and sums["tieredkv.kv_cache.far_blocks"] == stats.blocks_far == 0
    assert sums["tieredkv.kv_cache.offloaded_blocks"] - before == stats.blocks_offloaded


async def test_the_remote_tiers_bytes_and_round_trips_are_metrics(engines, otel, llama_dir, valkey_server, fleet_key):
    import asyncio

    _, reader = otel
    cfg = make_config(model=str(llama_dir), num_blocks=64, remote_url=valkey_server.url,
                      cold_secret_path=str(fleet_key), remote_ttl_s=600)
    async with await engines.start(cfg) as engine:
        remote = engine.core.tiers.tier("remote")
        await engine.generate([(11 * i) % 400 + 3 for i in range(70)], SamplingParams(max_tokens=1))
        await asyncio.to_thread(remote.flush_sync)
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=1))  # a step: the stats the metrics read
        live = remote.stats()
        pts = points(reader)
    assert live.demotions == 4 and live.bytes_written > 4 * 3 * 2 * 16 * 2 * 16 * 4 and live.round_trips >= 2
    for name in ("bytes_written", "round_trips", "demotions", "failures"):
        assert by_attr(pts[f"tieredkv.tier.{name}"], "tier")["remote"] == getattr(live, name)


async def test_speculative_decoding_counts_drafts_and_a_draft_models_requests_are_not_counted(engines, otel, llama_dir):
    """vLLM's spec_decode counters by proposer, equal to the engine's stats; the draft model's own engine records
    nothing (its requests are not the application's)."""
    _, reader = otel
    before = metric_sums(reader)
    spec = {"method": "draft", "model": str(llama_dir), "num_speculative_tokens": 3, "adaptive": False}
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64, speculative=spec)) as engine:
        await engine.generate(list(range(3, 40)), SamplingParams(max_tokens=12, ignore_eos=True))
        stats = engine.stats().speculative
    sums = metric_sums(reader)
    grew = {name: sums.get(name, 0) - before.get(name, 0) for name in sums}
    assert grew["tieredkv.requests"] == 1 and grew["tieredkv.generated_tokens"] == 12
    assert grew["tieredkv.spec_decode.num_drafts"] == stats.num_drafts > 0
    assert grew["tieredkv.spec_decode.num_draft_tokens"] == stats.num_draft_tokens
    assert grew["tieredkv.spec_decode.num_accepted_tokens"] == stats.num_accepted_tokens > 0
    drafts = by_attr(points(reader)["tieredkv.spec_decode.num_draft_tokens"], "proposer")
    assert drafts["draft"] >= stats.num_draft_tokens
