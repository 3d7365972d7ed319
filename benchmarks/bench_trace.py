"""A trace replay for the tiers' policies: chat requests over tens of system prompts with Zipf popularity, a working
set larger than the hot pool; hit rate per tier and mean / p99 time to first token for no lower tiers, LRU with
warm and cold, and the policies (LFU with dynamic aging, admission below warm), one after another in one run.

The trace is a function of its seed (`make_trace`): anyone can replay the same requests. Each request is one of
--systems system prompts of --system-tokens tokens, picked with Zipf(--zipf) popularity, then a question of its
own (--question-tokens), generating --max-tokens tokens, one request at a time (TTFT is its first token's wait).
The hot pool holds --hot-prompts system prompts' worth of blocks, warm --warm-prompts; cold is LMDB in a
temporary directory.

    .venv/bin/python benchmarks/bench_trace.py [--requests 2000] [--seed 0] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.tiers.base import TIER_NAMES


def make_trace(seed: int, requests: int, systems: int, system_tokens: int, question_tokens: int,
               zipf: float) -> tuple[list[list[int]], list[int]]:
    """The requests' prompts (token ids): system prompt k (k drawn with weight 1 / (k + 1) ** zipf) + a question
    of its own; and each request's k."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(200, 40000) for _ in range(system_tokens)] for _ in range(systems)]
    weights = [1 / (k + 1) ** zipf for k in range(systems)]
    picks = rng.choices(range(systems), weights, k=requests)
    return [prompts[k] + [rng.randrange(200, 40000) for _ in range(question_tokens)] for k in picks], picks


def source(usage, system_tokens: int) -> str:
    """Where a request's system prompt came from: the tier that gave most of its cached tokens, or "computed"
    where less than half of the system prompt was cached."""
    tier, n = max(usage.cached_tokens_by_tier.items(), key=lambda kv: kv[1])
    return tier if n >= system_tokens // 2 else "computed"


def static_bound(picks: list[int], hot: int, warm: int, cost: dict[str, float]) -> float:
    """The mean TTFT of the best any eviction policy can do with these tiers' measured costs (`cost`: mean TTFT by
    source): under independent Zipf picks the most popular system prompts held for good, the first `hot` in hot,
    the next `warm` in warm, the rest read from cold, each prompt computed at its first request."""
    rank = {k: i for i, (k, _) in enumerate(sorted(Counter(picks).items(), key=lambda kv: -kv[1]))}
    seen, total = set(), 0.0
    for k in picks:
        where = "computed" if k not in seen else "hot" if rank[k] < hot else "warm" if rank[k] < hot + warm else "cold"
        seen.add(k)
        total += cost.get(where, cost["computed"])
    return total / len(picks)


async def replay(cfg: EngineConfig, trace: list[list[int]], max_tokens: int, system_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ttfts, by_tier, prompt_tokens = [], dict.fromkeys(TIER_NAMES, 0), 0
    by_source: dict[str, list[float]] = {}
    async with await AsyncEngine.start(cfg) as engine:
        t_start = time.perf_counter()
        for prompt in trace:
            t0, first = time.perf_counter(), None
            async for chunk in engine.stream(prompt, params):
                if first is None:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    usage = chunk.usage
            ttfts.append(first)
            by_source.setdefault(source(usage, system_tokens), []).append(first)
            prompt_tokens += usage.prompt_tokens
            for name, n in usage.cached_tokens_by_tier.items():
                by_tier[name] += n
        wall = time.perf_counter() - t_start
        stats = engine.stats()
    ttfts.sort()
    tiers = {name: {k: getattr(st, k) for k in ("hits", "demotions", "evictions", "refused", "promotions")}
             for name, st in stats.tiers.items()}
    return {"ttft_mean_s": round(statistics.mean(ttfts), 4), "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4),
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))], 4),
            "hit_rate": round(sum(by_tier.values()) / prompt_tokens, 4),
            "hit_rate_by_tier": {k: round(v / prompt_tokens, 4) for k, v in by_tier.items() if v},
            "wall_s": round(wall, 1), "tiers": tiers,
            "ttft_by_source": {k: {"requests": len(v), "mean_s": round(statistics.mean(v), 4)}
                               for k, v in sorted(by_source.items())}}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", type=int, default=40)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--hot-prompts", type=float, default=8, help="the hot pool's blocks, in system prompts")
    p.add_argument("--warm-prompts", type=float, default=8, help="the warm tier's blocks, in system prompts")
    p.add_argument("--only", default=None, help="run only the setups whose names contain one of these "
                   "(separated by ';')")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    trace, picks = make_trace(args.seed, args.requests, args.systems, args.system_tokens, args.question_tokens,
                              args.zipf)
    block = 16
    hot = int(args.hot_prompts * args.system_tokens / block)
    async with await AsyncEngine.start(EngineConfig(num_blocks=64, warm_bytes=0)) as probe:
        block_bytes = probe.stats().kv_bytes_per_token * block
    warm = int(args.warm_prompts * args.system_tokens / block) * block_bytes
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        setups = {
            "no lower tiers (LRU)": EngineConfig(num_blocks=hot, warm_bytes=0),
            "LRU, warm only": EngineConfig(num_blocks=hot, warm_bytes=warm),  # a deployment with no disk tier
            "LFU, warm only": EngineConfig(num_blocks=hot, warm_bytes=warm, eviction_policy="lfu"),
            "LRU, warm + cold": EngineConfig(num_blocks=hot, warm_bytes=warm, cold_path=str(Path(tmp) / "lru")),
            "LFU, warm + cold": EngineConfig(num_blocks=hot, warm_bytes=warm, cold_path=str(Path(tmp) / "lfu1"),
                                             eviction_policy="lfu"),
            "LFU + admission, warm + cold": EngineConfig(
                num_blocks=hot, warm_bytes=warm, cold_path=str(Path(tmp) / "lfu"), eviction_policy="lfu",
                admit_min_uses=2, admit_output_blocks=False),
        }
        for name, cfg in setups.items():
            if args.only and not any(part in name for part in args.only.split(";")):
                continue
            results[name] = await replay(cfg, trace, args.max_tokens, args.system_tokens)
            r = results[name]
            print(f"{name:<30} TTFT mean {r['ttft_mean_s']:.4f}s p99 {r['ttft_p99_s']:.4f}s hit {r['hit_rate']:.3f} "
                  f"{r['hit_rate_by_tier']} ({r['wall_s']} s)", flush=True)
    base = results.get("LRU, warm + cold")
    print(f"\n{args.requests} requests over {args.systems} system prompts of {args.system_tokens} tokens "
          f"(Zipf {args.zipf}), hot {hot} blocks, warm {warm // block_bytes} blocks, default model")
    print(f"{'setup':<30} {'TTFT mean':>10} {'p99':>8} {'hit rate':>9} {'vs LRU':>7}  by tier")
    for name, r in results.items():
        ratio = f"{r['ttft_mean_s'] / base['ttft_mean_s']:>6.2f}x" if base else "      -"
        print(f"{name:<30} {r['ttft_mean_s']:>9.4f}s {r['ttft_p99_s']:>7.4f}s {r['hit_rate']:>9.3f} {ratio}  "
              f"{r['hit_rate_by_tier']}")
    if base:  # the costs LRU's run measured, each source's mean TTFT, placed as the best static policy places them
        cost = {k: v["mean_s"] for k, v in base["ttft_by_source"].items()}
        bound = static_bound(picks, int(args.hot_prompts), int(args.warm_prompts), cost)
        results["best static placement (bound)"] = {"ttft_mean_s": round(bound, 4), "costs_s": cost}
        print(f"TTFT by source in LRU's run: {cost}; the most popular prompts held for good, at those costs: mean "
              f"{bound:.4f}s ({bound / base['ttft_mean_s']:.2f}x LRU): what no eviction policy can beat here")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "hot_blocks": hot, "warm_blocks": warm // block_bytes,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
