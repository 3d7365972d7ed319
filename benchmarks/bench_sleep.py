"""Sleep and wake on the default model: resident memory awake, asleep at level 1 and 2, and the time from a
request to its first token when it wakes the engine, against the same request on an awake engine.

Per setup (warm tier on, its default size; or no warm tier and a cold tier in a temporary directory), one
process: the RSS with torch imported and nothing loaded (the runtime), then an engine that answers --prompts
documents of --tokens tokens; RSS awake (idle, the heap trimmed), after sleep(1), after a request wakes it, after
sleep(2) and after a request wakes it again. "over runtime + weights" is RSS minus the runtime's and the weights'
bytes: what the engine still holds beyond its weights.

    .venv/bin/python benchmarks/bench_sleep.py [--prompts 4] [--tokens 1024] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time

from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.platform.malloc_tuning import process_status_bytes, release_free_memory

MB = 1 << 20


def rss() -> int:
    release_free_memory()
    return process_status_bytes("VmRSS")


async def ttft(engine: AsyncEngine, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    async for chunk in engine.stream(prompt, SamplingParams(max_tokens=1)):
        first = time.perf_counter() - t0
        usage = chunk.usage
    return first, {k: v for k, v in usage.cached_tokens_by_tier.items() if v}


async def run(cfg: EngineConfig, prompts: list[list[int]], runtime: int) -> dict:
    out = {"runtime_rss_mb": round(runtime / MB)}
    async with await AsyncEngine.start(cfg) as engine:
        for p in prompts:
            await engine.generate(p, SamplingParams(max_tokens=1))
        weights = engine.stats().weight_bytes
        out["weights_mb"] = round(weights / MB)
        awake_ttft, _ = await ttft(engine, prompts[0])
        await asyncio.sleep(0.2)
        out["awake_rss_mb"] = round(rss() / MB)
        out["awake_hot_hit_ttft_s"] = round(awake_ttft, 4)
        for level in (1, 2):
            released = await engine.sleep(level)
            out[f"level{level}"] = {
                "released": {k: v for k, v in released.items() if k != "asleep_since"},
                "asleep_rss_mb": round(rss() / MB),
                "over_runtime_and_weights_mb": round((rss() - runtime - (weights if level == 1 else 0)) / MB)}
            first, tiers = await ttft(engine, prompts[level])  # wakes it
            out[f"level{level}"].update(wake_to_first_token_s=round(first, 4), prefix_from=tiers,
                                        awake_again_rss_mb=round(rss() / MB))
        compute_ttft, _ = await ttft(engine, [random.Random(9).randrange(200, 40000) for _ in range(len(prompts[0]))])
        out["computed_ttft_s"] = round(compute_ttft, 4)
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(200, 40000) for _ in range(args.tokens)] for _ in range(max(args.prompts, 3))]
    runtime = rss()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["warm tier (default size)"] = await run(EngineConfig(), prompts, runtime)
        results["no warm, cold tier"] = await run(EngineConfig(warm_bytes=0, cold_path=f"{tmp}/cold"), prompts,
                                                  runtime)
    for name, r in results.items():
        print(f"{name}: runtime {r['runtime_rss_mb']} MB, weights {r['weights_mb']} MB, awake {r['awake_rss_mb']} MB"
              f" (hot-hit TTFT {r['awake_hot_hit_ttft_s']} s, computed {r['computed_ttft_s']} s)")
        for level in (1, 2):
            x = r[f"level{level}"]
            print(f"  level {level}: asleep {x['asleep_rss_mb']} MB ({x['over_runtime_and_weights_mb']} MB over runtime"
                  f"{' + weights' if level == 1 else ''}), wake to first token {x['wake_to_first_token_s']} s "
                  f"(prefix from {x['prefix_from']}), awake again {x['awake_again_rss_mb']} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
