"""The HTTP layer's cost: concurrent streaming clients through the OpenAI-compatible server (the official
`openai` client) vs the same requests through the Python API, side by side in one run, with the engine core in a
process of its own (core_process=True, the default) and on a thread of the server's process.

    .venv/bin/python benchmarks/bench_serve.py              # default model, 64 clients, both core modes
    .venv/bin/python benchmarks/bench_serve.py --clients 32 --modes process thread --out docs/bench/serve_zen5.json
    .venv/bin/python benchmarks/bench_serve.py --quick      # 16 clients

Reports output tokens/s and time to first token (p50, p99) for each path and mode, and the throughput overhead
of the HTTP layer (target <= 10%). Each side runs twice, alternating, from an empty cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import openai

from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.serve import ServerSettings, start_server


def workload(n: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [([rng.randrange(100, vocab) for _ in range(rng.randrange(32, 256))], rng.randrange(16, 64))
            for _ in range(n)]


def pct(values: list[float], p: float) -> float:
    return sorted(values)[min(int(len(values) * p), len(values) - 1)]


async def through_api(engine: AsyncEngine, requests) -> tuple[float, list[float], int]:
    async def one(prompt, n):
        t0, first, count = time.perf_counter(), None, 0
        async for chunk in engine.stream(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
            first = first or time.perf_counter() - t0
            count += len(chunk.token_ids)
        return first, count

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p, n) for p, n in requests))
    return time.perf_counter() - t0, [f for f, _ in results], sum(c for _, c in results)


async def through_http(client: openai.AsyncOpenAI, requests) -> tuple[float, list[float], int]:
    async def one(prompt, n):
        t0, first, count = time.perf_counter(), None, 0
        stream = await client.completions.create(model="default", prompt=prompt, max_tokens=n, stream=True,
                                                 extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        async for event in stream:
            if event.choices and first is None:
                first = time.perf_counter() - t0
            if event.usage is not None:
                count = event.usage.completion_tokens
        return first, count

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p, n) for p, n in requests))
    return time.perf_counter() - t0, [f for f, _ in results], sum(c for _, c in results)


async def one_mode(args, core_process: bool) -> dict[str, float]:
    async with await AsyncEngine.start(EngineConfig(
            compile_in_background=False, model="default", max_num_seqs=64, warm_bytes=0,
            core_process=core_process, share_cores=not args.no_share_cores)) as engine:
        runner, port = await start_server(engine, ServerSettings(max_queued=1024), port=0)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                    timeout=3600)
        requests = workload(args.clients, engine.info.vocab_size)
        await through_api(engine, requests[:4])  # warm up both paths
        await through_http(client, requests[:4])
        runs = {"python API": [], "HTTP server": []}
        for _ in range(2):
            for name, fn, target in (("python API", through_api, engine), ("HTTP server", through_http, client)):
                await engine.clear_cache("all")
                runs[name].append(await fn(target, requests))
        mode = "core process" if core_process else "core thread"
        print(f"{mode}: {args.clients} concurrent streaming clients, {sum(n for _, n in requests)} output tokens "
              "each run")
        print(f"{'path':<14}{'tok/s':>10}{'TTFT p50 s':>12}{'TTFT p99 s':>12}")
        rates = {}
        for name, results in runs.items():
            seconds = sum(r[0] for r in results)
            tokens = sum(r[2] for r in results)
            ttfts = [t for r in results for t in r[1]]
            rates[name] = tokens / seconds
            print(f"{name:<14}{rates[name]:>10.1f}{pct(ttfts, 0.5):>12.3f}{pct(ttfts, 0.99):>12.3f}")
        overhead = 1 - rates["HTTP server"] / rates["python API"]
        print(f"HTTP layer throughput overhead: {overhead:.1%} (target <= 10%)")
        await client.close()
        await runner.cleanup()
        return rates


async def main(args) -> None:
    from tieredkv.platform.cpu_features import cpu_info

    results = {mode: await one_mode(args, mode == "process") for mode in args.modes}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": cpu_info().describe(None), "clients": args.clients, "output_tok_s": results}, f,
                      indent=2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clients", type=int, default=None)
    parser.add_argument("--modes", nargs="+", choices=("process", "thread"), default=["process", "thread"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-share-cores", action="store_true", help="every step of the core process on all threads "
                        "however busy the server and its clients keep the cores (EngineConfig.share_cores=False)")
    args = parser.parse_args()
    args.clients = args.clients or (16 if args.quick else 64)
    asyncio.run(main(args))
