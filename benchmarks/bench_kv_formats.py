"""The KV cache's formats (EngineConfig.kv_cache_dtype) on the default model, in one run:

    .venv/bin/python benchmarks/bench_kv_formats.py [--trials 3] [--json out.json]

1. Bytes per token in each tier and the tokens each tier holds under the default budgets (the hot pool, the
   warm tier, a 16 GiB cold tier, and a 1 GiB remote server), from `tieredkv plan`'s arithmetic, with the
   cold and remote entry sizes (header, MAC and payload) of one block; the longest document the default hot
   pool holds without far blocks.
2. Restoring a 4,096-token prefix plus a 32-token question from warm (one engine), from cold (a restarted
   engine, LMDB pages dropped from the page cache) and from remote (a fresh engine on a Valkey server on
   loopback): time to first token (median of --trials) and the bytes each restore moved, per format, beside
   recomputing it.
3. Throughput with int8 KV against fp32 KV: mixed 32 (bench_engine.py's 32 requests of 64-512 prompt tokens and
   16-128 new, all at once, output tok/s) and the burst (bench_burst.py: 32 conversations on 4 shared ~1,000-token
   system prompts), the two formats alternated over --rounds, so that a drifting machine weighs on both.

Quality (perplexity, KL, agreement) is bench_quant_quality.py --kv; decode at depth bench_interleaved.py --kv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_burst import run_engine  # noqa: E402
from bench_engine import engine_throughput, make_requests  # noqa: E402
from bench_tiers import drop_page_cache, ids, ttft  # noqa: E402

from tieredkv import AsyncEngine, EngineConfig  # noqa: E402
from tieredkv.engine.identity import model_fingerprint  # noqa: E402
from tieredkv.engine.resolve import resolve_kv_layout, resolve_model_dir  # noqa: E402
from tieredkv.models.spec import ModelSpec  # noqa: E402
from tieredkv.platform.cpu_features import cpu_info  # noqa: E402
from tieredkv.tiers.cold_format import ColdFormat  # noqa: E402
from tieredkv.tools.plan import plan  # noqa: E402

FORMATS = ["auto", "bfloat16", "int8", "int4"]
PREFIX = 4096
REMOTE_BUDGET = 1 << 30


def sizes(fmt: str) -> dict:
    """What one format takes in each tier, by the engine's own sizing (tools/plan.py, cold_format.py)."""
    p = plan("default", device="cpu", kv_cache_dtype=fmt, cold_bytes=16 << 30)
    model_dir = resolve_model_dir("default")
    spec = ModelSpec.from_file(model_dir / "config.json")
    cfg = EngineConfig(kv_cache_dtype=fmt)
    kv = resolve_kv_layout(cfg, spec, torch.float32, torch.device("cpu"))
    shape = (spec.num_layers, 2, p.block_size, spec.num_kv_heads, kv.row)
    fingerprint = model_fingerprint(model_dir, torch.float32, p.block_size, None, identity="0" * 64, kv=kv)
    entry = ColdFormat.entry_bytes(shape, kv.storage_dtype, fingerprint, p.block_size)
    return {"format": p.kv_format, "bytes_per_token": p.kv_bytes_per_token, "block_bytes": p.kv_bytes_per_block,
            "entry_bytes": entry, "hot_tokens": p.tokens["hot"], "warm_tokens": p.tokens["warm"],
            "cold_tokens": p.tokens["cold"], "remote_tokens": REMOTE_BUDGET // entry * p.block_size,
            "longest_document": min(p.tokens["hot"], p.max_model_len), "max_model_len": p.max_model_len}


async def restore(fmt: str, trials: int, server_url: str, key: Path) -> dict:
    """TTFT of a 4,096-token prefix recomputed and restored from each tier, and the bytes each restore moved."""
    rng = random.Random(1)
    cold_dir = Path(tempfile.mkdtemp(prefix="tieredkv-bench-kv-cold-"))
    base = dict(core_process=False, compile_in_background=False, model="default", kv_cache_bytes=1 << 30,
                kv_cache_dtype=fmt, cold_secret_path=str(key))
    times: dict[str, list[float]] = {"recompute": [], "warm": [], "cold (dropped)": [], "remote": []}
    moved: dict[str, int] = {}
    async with await AsyncEngine.start(EngineConfig(**base, warm_bytes=1 << 30, cold_path=str(cold_dir),
                                                    remote_url=server_url)) as engine:
        vocab = engine.info.vocab_size
        prefixes = [ids(rng, PREFIX, vocab) for _ in range(trials)]
        before = engine.stats().tiers["warm"]
        for prefix in prefixes:
            t, tiers = await ttft(engine, prefix + ids(rng, 32, vocab))
            assert sum(tiers.values()) == 0, tiers
            times["recompute"].append(t)
            await engine.clear_cache("hot", demote=True)
            t, tiers = await ttft(engine, prefix + ids(rng, 32, vocab))
            assert tiers["warm"] == PREFIX, tiers
            times["warm"].append(t)
        block = engine.core.tiers.warm.block_bytes
        moved["warm"] = block * (engine.stats().tiers["warm"].promotions - before.promotions) // trials
        remote = next(t for t in engine.core.tiers.lower if t.name == "remote")
        await engine.run_in_worker(remote.flush_sync)
    drop_page_cache(cold_dir)  # closing wrote every cached block to the cold tier
    async with await AsyncEngine.start(EngineConfig(**base, warm_bytes=0, cold_path=str(cold_dir))) as engine:
        for prefix in prefixes:
            t, tiers = await ttft(engine, prefix + ids(rng, 32, vocab))
            assert tiers["cold"] == PREFIX, tiers
            times["cold (dropped)"].append(t)
        moved["cold (dropped)"] = engine.core.tiers.cold.payload_bytes * engine.stats().tiers["cold"].promotions \
            // trials
    async with await AsyncEngine.start(EngineConfig(**base, warm_bytes=0, remote_url=server_url)) as engine:
        for prefix in prefixes:
            t, tiers = await ttft(engine, prefix + ids(rng, 32, vocab))
            assert tiers["remote"] == PREFIX, tiers
            times["remote"].append(t)
        moved["remote"] = engine.stats().tiers["remote"].bytes_read // trials
    return {"ttft_s": {k: statistics.median(v) for k, v in times.items()}, "bytes_moved": moved}


async def throughput(rounds: int) -> dict:
    """Output tok/s of mixed 32 and of the burst, fp32 KV and int8 KV alternated, every round's."""
    got: dict[str, list[float]] = {}
    engines = {fmt: await AsyncEngine.start(EngineConfig(compile_in_background=False, model="default",
                                                         kv_cache_bytes=1 << 30, max_num_seqs=64, kv_cache_dtype=fmt))
               for fmt in ("auto", "int8")}
    try:
        requests = make_requests(32, engines["auto"].info.vocab_size)
        out_tokens = sum(n for _, n in requests)
        for _ in range(rounds):
            for fmt, engine in engines.items():
                got.setdefault(f"mixed 32, {fmt}", []).append(out_tokens / await engine_throughput(engine, requests))
    finally:
        for engine in engines.values():
            await engine.close()
    for _ in range(rounds):
        for fmt in ("auto", "int8"):
            got.setdefault(f"burst, {fmt}", []).append((await run_engine(fmt, kv_cache_dtype=fmt))["tok_s"])
    print("throughput rounds:", {k: [round(x, 1) for x in v] for k, v in got.items()}, flush=True)
    return {k: statistics.median(v) for k, v in got.items()}


async def main(args) -> dict:
    from tieredkv.tools.local_valkey import LocalValkey

    out: dict = {"machine": cpu_info().describe(torch.get_num_threads()), "sizes": {}, "restore": {}}
    print(f"machine: {out['machine']}", flush=True)
    if args.part in ("all", "throughput"):
        out["throughput"] = t = await throughput(args.rounds)
        print("\n| workload | fp32 KV tok/s | int8 KV tok/s | int8 / fp32 |\n|---|---|---|---|")
        for work in ("mixed 32", "burst"):
            print(f"| {work} | {t[f'{work}, auto']:.1f} | {t[f'{work}, int8']:.1f} | "
                  f"{t[f'{work}, int8'] / t[f'{work}, auto']:.2f}x |")
        if args.part == "throughput":
            return out
    for fmt in FORMATS:
        out["sizes"][fmt] = sizes(fmt)
    print("\n| KV format | bytes/token | block | cold/remote entry | hot tokens | warm tokens | cold tokens (16 GiB) | "
          "remote tokens (1 GiB) | longest document in the default hot pool |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in out["sizes"].values():
        print(f"| {s['format']} | {s['bytes_per_token']:,} | {s['block_bytes']:,} | {s['entry_bytes']:,} | "
              f"{s['hot_tokens']:,} | {s['warm_tokens']:,} | {s['cold_tokens']:,} | {s['remote_tokens']:,} | "
              f"{s['longest_document']:,} (pool {s['hot_tokens']:,}, max_model_len {s['max_model_len']:,}) |")
    key = Path(tempfile.mkdtemp(prefix="tieredkv-bench-key-")) / "fleet.key"
    server = LocalValkey(Path(tempfile.mkdtemp(prefix="tieredkv-bench-valkey-")), maxmemory="2gb",
                         maxmemory_policy="allkeys-lru").start()
    try:
        for fmt in FORMATS:
            out["restore"][fmt] = await restore(fmt, args.trials, server.url, key)
            print(f"{fmt}: {out['restore'][fmt]}", flush=True)
    finally:
        server.stop()
    fp32 = out["restore"]["auto"]
    print(f"\n## restoring a {PREFIX:,}-token prefix + 32 tokens (median of {args.trials}; bytes moved per restore)")
    print("| KV format | recompute s | warm s | cold (pages dropped) s | remote s | MB moved (warm / cold / remote) | "
          "vs fp32 bytes |")
    print("|---|---|---|---|---|---|---|")
    for fmt, r in out["restore"].items():
        t, m = r["ttft_s"], r["bytes_moved"]
        print(f"| {out['sizes'][fmt]['format']} | {t['recompute']:.3f} | {t['warm']:.3f} | {t['cold (dropped)']:.3f} | "
              f"{t['remote']:.3f} | {m['warm'] / 1e6:.0f} / {m['cold (dropped)'] / 1e6:.0f} / {m['remote'] / 1e6:.0f} "
              f"| {m['remote'] / fp32['bytes_moved']['remote']:.2f}x |")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (each format once a round)")
    parser.add_argument("--part", choices=["all", "throughput", "tiers"], default="all")
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    result = asyncio.run(main(ns))
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=1))
