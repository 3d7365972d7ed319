"""A remote tier that turns slow: time to first token with it against without any remote tier, and with it fast.

A writer engine computes --prompts prompts of --tokens tokens each (distinct documents) and leaves them on a local
Valkey server. Then, one after another in one run, fresh engines of the default model ask each prompt once:
without a remote tier (everything computed), with the remote tier as it is (fast, on loopback), and with every
read of it delayed by --delay seconds (injected in the tier's read: a loaded server, a slow link). Load or
recompute (tiers/rates.py) should keep the slow case near the no-tier case and the fast case below it.

    .venv/bin/python benchmarks/bench_slow_tier.py [--prompts 8] [--tokens 1024] [--delay 1.0] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.tools.local_valkey import LocalValkey


def documents(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 40000) for _ in range(tokens)] for _ in range(n)]


async def ttfts(cfg: EngineConfig, prompts: list[list[int]], delay: float | None = None) -> dict:
    async with await AsyncEngine.start(cfg) as engine:
        tier = engine.core.tiers.tier("remote")
        if delay is not None:
            fast = tier.get_sync

            def slow(keys):
                time.sleep(delay)
                return fast(keys)

            tier.get_sync = slow
        out = []
        for p in prompts:
            t0 = time.perf_counter()
            async for _ in engine.stream(p, SamplingParams(max_tokens=1)):
                break
            out.append(time.perf_counter() - t0)
        stats = tier.stats() if tier is not None else None
    result = {"ttft_mean_s": round(statistics.mean(out), 3), "ttft_max_s": round(max(out), 3),
              "ttfts_s": [round(x, 3) for x in out]}
    if stats is not None:
        result.update(remote_hit_tokens=stats.hits, skipped_blocks=stats.skipped, late_reads=stats.late)
    return result


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--delay", type=float, default=1.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    prompts = documents(args.prompts, args.tokens, seed=0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalValkey(Path(tmp) / "valkey", maxmemory="2gb", maxmemory_policy="allkeys-lru").start()
        try:
            remote = dict(core_process=False, remote_url=server.url, cold_secret_path=str(Path(tmp) / "key"),
                          warm_bytes=0)
            async with await AsyncEngine.start(EngineConfig(**remote)) as writer:
                for q in prompts:
                    await writer.generate(q, SamplingParams(max_tokens=1))
                await asyncio.to_thread(writer.core.tiers.tier("remote").flush_sync)
            results["no remote tier"] = await ttfts(EngineConfig(warm_bytes=0, core_process=False), prompts)
            results["remote tier"] = await ttfts(EngineConfig(**remote), prompts)
            results[f"remote tier, reads +{args.delay:g} s"] = await ttfts(EngineConfig(**remote), prompts,
                                                                           args.delay)
        finally:
            server.stop()
    base = results["no remote tier"]["ttft_mean_s"]
    print(f"{args.prompts} prompts of {args.tokens} tokens, default model, each asked once (first token)")
    print(f"{'setup':<28} {'TTFT mean':>10} {'max':>7} {'vs no tier':>11}  remote hits / skipped / late")
    for name, r in results.items():
        extra = (f"  {r['remote_hit_tokens']} tokens / {r['skipped_blocks']} blocks / {r['late_reads']}"
                 if "late_reads" in r else "")
        print(f"{name:<28} {r['ttft_mean_s']:>9.3f}s {r['ttft_max_s']:>6.3f}s {r['ttft_mean_s'] / base:>10.2f}x{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
