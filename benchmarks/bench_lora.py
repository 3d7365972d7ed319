"""LoRA adapters on the default model: 32 mixed requests spread over 1, 4 and 16 adapters against the base model
alone (output tokens/s, the same prompts and lengths), and the time to load an adapter.

The adapters are made here with peft (random low-rank weights of rank --rank on q, k, v, o, gate, up and down),
once, into a temporary folder. Every setup runs in the same engine; --rounds rounds run them all in turn, and each
setup's ratio to the base model is taken within its round (the machine drifts between rounds), then the median.

    .venv/bin/python benchmarks/bench_lora.py [--rank 16] [--requests 32] [--max-tokens 64] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.engine.resolve import resolve_cache_dir, resolve_model_dir

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, out: Path, n: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES,
                                                  init_lora_weights=False))
    paths = []
    for i in range(n):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.01)
        paths.append(out / f"adapter{i}")
        peft_model.save_pretrained(str(paths[-1]))
    return paths


def workload(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("battery charge winter store helmet return policy warranty engine wheel brake light chain "
             "gear saddle frame pedal tire pump lock bell basket").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(40, 200))) for _ in range(n)]


async def run(engine: AsyncEngine, prompts: list[str], adapters: list[str | None], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    await engine.clear_cache("hot")
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params, adapter=a) for p, a in zip(prompts, adapters)))
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": round(seconds, 2), "output_tokens": tokens, "output_tokens_per_s": round(tokens / seconds, 1)}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--spreads", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cfg = EngineConfig(max_loras=max(args.spreads))
    base = resolve_model_dir(cfg.model, resolve_cache_dir(cfg))
    prompts = workload(args.requests, seed=0)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        paths = make_adapters(base, Path(tmp), max(args.spreads), args.rank)
        print(f"made {len(paths)} adapters of rank {args.rank} in {time.perf_counter() - t0:.1f} s")
        async with await AsyncEngine.start(cfg) as engine:
            loads = []
            for i, path in enumerate(paths):
                t0 = time.perf_counter()
                info = await engine.load_adapter(f"a{i}", path)
                loads.append(time.perf_counter() - t0)
            results["adapter_load_seconds_median"] = round(sorted(loads)[len(loads) // 2], 4)
            results["adapter_bytes"] = info["bytes"]
            await run(engine, prompts[:4], [None] * 4, 8)  # warm-up
            setups = {"base model": [None] * len(prompts)}
            setups.update({f"{k} adapters": [f"a{i % k}" for i in range(len(prompts))] for k in args.spreads})
            rounds = []
            for _ in range(args.rounds):
                rounds.append({name: await run(engine, prompts, names, args.max_tokens)
                               for name, names in setups.items()})
    results["rounds"] = rounds
    print(f"{args.requests} requests, {args.max_tokens} output tokens each, default model, rank {args.rank} on "
          f"{len(MODULES)} projections, {os.cpu_count()} CPUs, {args.rounds} rounds")
    print(f"adapter load: {results['adapter_load_seconds_median'] * 1000:.1f} ms (median), "
          f"{results['adapter_bytes'] / 2**20:.1f} MiB each")
    print(f"{'setup':<20} {'output tok/s (rounds)':>28} {'vs base (median)':>17}")
    results["ratios"] = {}
    for name in setups:
        rates = [r[name]["output_tokens_per_s"] for r in rounds]
        ratios = sorted(r[name]["output_tokens_per_s"] / r["base model"]["output_tokens_per_s"] for r in rounds)
        results["ratios"][name] = round(ratios[len(ratios) // 2], 3)
        print(f"{name:<20} {' '.join(f'{x:.1f}' for x in rates):>28} {results['ratios'][name]:>16.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
