"""The cost of metrics and tracing: the engine benchmark's mixed workload (32 requests at once, default
model) with OpenTelemetry's SDK providers installed (an in-memory metric reader, every span recorded)
against the no-op API, alternating in child processes, in one run.

    .venv/bin/python benchmarks/bench_telemetry.py            # 2 runs each
    .venv/bin/python benchmarks/bench_telemetry.py --runs 3

Target: throughput with telemetry on within 3% of off.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import asyncio, json, sys, time
sys.path.insert(0, "benchmarks")
from bench_engine import make_requests
from tieredkv import AsyncEngine, EngineConfig, SamplingParams

if sys.argv[1] == "on":
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    reader, exporter = InMemoryMetricReader(), InMemorySpanExporter()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

async def main():
    async with await AsyncEngine.start(EngineConfig(
        compile_in_background=False, model="default", max_num_seqs=64)) as engine:
        requests = make_requests(32, engine.info.vocab_size)
        await engine.generate(requests[0][0], SamplingParams(max_tokens=2))
        await engine.clear_cache("all")
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))
                                      for p, n in requests))
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        extra = {}
        if sys.argv[1] == "on":
            extra["spans"] = len(exporter.get_finished_spans())
            extra["metrics"] = sum(len(sm.metrics) for rm in reader.get_metrics_data().resource_metrics
                                   for sm in rm.scope_metrics)
        print(json.dumps({"tok_s": tokens / seconds, **extra}))

asyncio.run(main())
"""


def run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    rates = {"off": [], "on": []}
    for _ in range(args.runs):
        for mode in ("off", "on"):
            result = run(mode)
            rates[mode].append(result["tok_s"])
            print(f"telemetry {mode}: {result['tok_s']:.1f} tok/s"
                  + (f" ({result['spans']} spans, {result['metrics']} metrics)" if mode == "on" else ""), flush=True)
    off, on = sum(rates["off"]) / len(rates["off"]), sum(rates["on"]) / len(rates["on"])
    print(f"on / off throughput: {on / off:.3f} ({(1 - on / off):+.1%} cost; target within 3%)")


if __name__ == "__main__":
    main()
