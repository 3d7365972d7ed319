"""Sleep and wake on the default model: resident memory awake, asleep at level 1 and 2, and the time from a
request to its first token when it wakes the engine, against the same request on an awake engine.

Each setup runs in a process of its own (warm tier at its default size with a cold tier beside it; warm alone; no
warm and a cold tier): RSS with tieredkv imported (the runtime), once the engine has started (weights loaded,
its decode graph compiled, no request yet), after --prompts documents of --tokens tokens (awake, idle, the heap
trimmed), after sleep(1), after a request wakes it, after sleep(2), and after a request wakes it again. RSS here
is anonymous resident memory (RssAnon): file pages mapped (the cold tier's LMDB file) are the page cache's.
"KV held" is RSS minus the started engine's: what sleep is for.

    .venv/bin/python benchmarks/bench_sleep.py [--prompts 4] [--tokens 1024] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time

from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.platform.malloc_tuning import process_status_bytes, release_free_memory

MB = 1 << 20


def rss() -> int:
    """Anonymous resident memory: what the process holds (file pages mapped, the cold tier's LMDB file among them,
    count in VmRSS too but belong to the page cache, which the kernel takes back at will)."""
    release_free_memory()
    return process_status_bytes("RssAnon")


async def ttft(engine: AsyncEngine, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    async for chunk in engine.stream(prompt, SamplingParams(max_tokens=1)):
        first = time.perf_counter() - t0
        usage = chunk.usage
    return first, {k: v for k, v in usage.cached_tokens_by_tier.items() if v}


async def run(cfg: EngineConfig, prompts: list[list[int]]) -> dict:
    out = {"runtime_rss_mb": round(rss() / MB)}
    async with await AsyncEngine.start(cfg) as engine:
        compiled = engine.core.runner.compiled
        if compiled is not None and hasattr(compiled, "wait_ready"):
            await asyncio.to_thread(compiled.wait_ready)  # the decode graph's background compile takes memory too
        started = rss()
        out["started_rss_mb"], out["weights_mb"] = round(started / MB), round(engine.stats().weight_bytes / MB)
        for p in prompts:
            await engine.generate(p, SamplingParams(max_tokens=1))
        awake_ttft, _ = await ttft(engine, prompts[0])
        await asyncio.sleep(0.2)
        out["awake_rss_mb"], out["awake_kv_held_mb"] = round(rss() / MB), round((rss() - started) / MB)
        out["awake_hot_hit_ttft_s"] = round(awake_ttft, 4)
        for level in (1, 2):
            released = await engine.sleep(level)
            asleep = rss()
            out[f"level{level}"] = {"released": {k: v for k, v in released.items() if k != "asleep_since"},
                                    "asleep_rss_mb": round(asleep / MB),
                                    "vs_started_mb": round((asleep - started) / MB)}
            first, tiers = await ttft(engine, prompts[level])  # wakes it
            out[f"level{level}"].update(wake_to_first_token_s=round(first, 4), prefix_from=tiers,
                                        awake_again_rss_mb=round(rss() / MB))
        fresh = [random.Random(9).randrange(200, 40000) for _ in range(len(prompts[0]))]
        out["computed_ttft_s"] = round((await ttft(engine, fresh))[0], 4)
    return out


SETUPS = {"warm + cold": {"cold": True}, "warm only": {}, "no warm, cold": {"warm_bytes": 0, "cold": True}}


async def one(name: str, args) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(200, 40000) for _ in range(args.tokens)] for _ in range(max(args.prompts, 3))]
    fields = dict(SETUPS[name], core_process=False)  # the memory of the process that holds the core
    with tempfile.TemporaryDirectory() as tmp:
        if fields.pop("cold", False):
            fields["cold_path"] = f"{tmp}/cold"
        return await run(EngineConfig(**fields), prompts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--setup", default=None, help=argparse.SUPPRESS)  # one setup, in this process
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.setup:
        print(json.dumps(asyncio.run(one(args.setup, args))))
        return
    results = {}
    for name in SETUPS:
        done = subprocess.run([sys.executable, __file__, "--setup", name, "--prompts", str(args.prompts),
                               "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    for name, r in results.items():
        print(f"{name}: runtime {r['runtime_rss_mb']} MB, started {r['started_rss_mb']} MB (weights "
              f"{r['weights_mb']} MB), awake {r['awake_rss_mb']} MB (KV held {r['awake_kv_held_mb']} MB; hot-hit "
              f"TTFT {r['awake_hot_hit_ttft_s']} s, computed {r['computed_ttft_s']} s)")
        for level in (1, 2):
            x = r[f"level{level}"]
            print(f"  level {level}: asleep {x['asleep_rss_mb']} MB ({x['vs_started_mb']:+} MB vs started), wake to "
                  f"first token {x['wake_to_first_token_s']} s (prefix from {x['prefix_from']}), awake again "
                  f"{x['awake_again_rss_mb']} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
