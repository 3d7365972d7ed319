"""The memory tiers on the default model, in one run.

    .venv/bin/python benchmarks/bench_tiers.py            # full run (~10 min on 2 cores)
    .venv/bin/python benchmarks/bench_tiers.py --quick    # smaller rotating workload

1. Time to first token for a 4,096-token prefix + a 32-token question: recomputed vs restored from
   the warm tier, from the cold tier with the file in the page cache, and from the cold tier with
   its pages dropped (posix_fadvise DONTNEED).
2. A rotating system-prompt chatbot: 16 system prompts of 1,024 tokens, 8 questions each, shuffled,
   with a hot pool that holds 4 of the prompts: prefix hit rate per tier and throughput, tiers on vs
   hot only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from tieredkv import AsyncEngine, EngineConfig, SamplingParams

BLOCK = 16


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


async def ttft(engine: AsyncEngine, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    async for chunk in engine.stream(prompt, SamplingParams(max_tokens=1)):
        return time.perf_counter() - t0, chunk.usage.cached_tokens_by_tier
    raise RuntimeError("no token")


def drop_page_cache(cold_dir: Path) -> None:
    for f in cold_dir.glob("*.mdb"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def restore_ttft(trials: int) -> dict[str, float]:
    """Warm is measured in one engine; cold in restarted engines on the same path (warm off), once with
    the LMDB file in the page cache and once after dropping it (with no engine holding it mapped)."""
    cold_dir = Path(tempfile.mkdtemp(prefix="tieredkv-bench-cold-"))
    results: dict[str, list[float]] = {"recompute": [], "warm": [], "cold (page cache)": [], "cold (dropped)": []}
    rng = random.Random(0)
    cfg = EngineConfig(
        compile_in_background=False, model="default", kv_cache_bytes=1 << 30, warm_bytes=1 << 30,
        cold_path=str(cold_dir))
    async with await AsyncEngine.start(cfg) as engine:
        vocab = engine.info.vocab_size
        prefixes = [ids(rng, 4096, vocab) for _ in range(trials)]
        for prefix in prefixes:
            t, tiers = await ttft(engine, prefix + ids(rng, 32, vocab))
            assert sum(tiers.values()) == 0
            results["recompute"].append(t)
            await engine.clear_cache("hot", demote=True)
            t, tiers = await ttft(engine, prefix + ids(rng, 32, vocab))
            assert tiers["warm"] == 4096, tiers
            results["warm"].append(t)
    # closing wrote every cached block to the cold tier
    for label in ("cold (page cache)", "cold (dropped)"):
        if label == "cold (dropped)":
            drop_page_cache(cold_dir)
        cfg = EngineConfig(
            compile_in_background=False, model="default", kv_cache_bytes=1 << 30, warm_bytes=0, cold_path=str(cold_dir))
        async with await AsyncEngine.start(cfg) as engine:
            for prefix in prefixes:
                t, tiers = await ttft(engine, prefix + ids(rng, 32, vocab))
                assert tiers["cold"] == 4096, tiers
                results[label].append(t)
    return {k: statistics.median(v) for k, v in results.items()}


async def rotating_chatbot(tiers_on: bool, systems: int, questions: int, concurrency: int) -> dict:
    prompt_blocks = 1024 // BLOCK
    hot_blocks = 4 * prompt_blocks + concurrency * 8  # 4 system prompts plus room for the running requests
    cfg = EngineConfig(
        compile_in_background=False, model="default", num_blocks=hot_blocks,
        warm_bytes=(2 << 30) if tiers_on else 0, cold_path=None)
    async with await AsyncEngine.start(cfg) as engine:
        vocab = engine.info.vocab_size
        rng = random.Random(1)
        prompts = [ids(rng, 1024, vocab) for _ in range(systems)]
        work = [(s, ids(rng, 32, vocab)) for s in range(systems) for _ in range(questions)]
        rng.shuffle(work)
        gate = asyncio.Semaphore(concurrency)
        params = SamplingParams(max_tokens=16, ignore_eos=True)

        async def one(system: int, question: list[int]):
            async with gate:
                return await engine.generate(prompts[system] + question, params)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(s, q) for s, q in work))
        elapsed = time.perf_counter() - t0
        stats = engine.stats()
    prompt_tokens = sum(o.usage.prompt_tokens for o in outs)
    by_tier = {t: sum(o.usage.cached_tokens_by_tier[t] for o in outs) / prompt_tokens for t in ("hot", "warm", "cold")}
    return {"requests/s": len(outs) / elapsed, "seconds": elapsed, "hit_rate": by_tier,
            "output tok/s": sum(o.usage.completion_tokens for o in outs) / elapsed,
            "preemptions": stats.num_preemptions}


async def main(args) -> dict:
    out: dict = {}
    if args.part in ("all", "restore"):
        print("## restoring a 4,096-token prefix (time to first token, median of", args.trials, "trials)")
        ttfts = out["restore_ttft_s"] = await restore_ttft(args.trials)
        base = ttfts["recompute"]
        print("| source | TTFT s | speed-up vs recompute |\n|---|---|---|")
        for name, t in ttfts.items():
            print(f"| {name} | {t:.3f} | {base / t:.1f}x |")
    if args.part == "restore":
        return out

    print(f"\n## rotating chatbot: {args.systems} system prompts x {args.questions} questions, hot pool holds 4")
    on = await rotating_chatbot(True, args.systems, args.questions, args.concurrency)
    off = await rotating_chatbot(False, args.systems, args.questions, args.concurrency)
    print("| run | hot hits | warm hits | cold hits | requests/s | seconds |\n|---|---|---|---|---|---|")
    for name, r in (("tiers on", on), ("hot only", off)):
        h = r["hit_rate"]
        print(f"| {name} | {h['hot']:.1%} | {h['warm']:.1%} | {h['cold']:.1%} | {r['requests/s']:.2f} | "
              f"{r['seconds']:.1f} |")
    print(f"\nthroughput, tiers on / hot only: {on['requests/s'] / off['requests/s']:.2f}x")
    out["rotating"] = {"tiers on": on, "hot only": off}
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--part", choices=["all", "restore", "rotating"], default="all")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.trials = 1 if args.quick else 3
    args.systems, args.questions = (8, 4) if args.quick else (16, 8)
    results = asyncio.run(main(args))
    if args.json:
        from tieredkv.platform.cpu_features import cpu_info

        Path(args.json).write_text(json.dumps({"machine": cpu_info().describe(None), **results}, indent=1))
