"""tieredkv vs Hugging Face transformers on the default model, side by side in one run.

    .venv/bin/python benchmarks/bench_engine.py            # the full run (~14 min on 2 cores)
    .venv/bin/python benchmarks/bench_engine.py --quick    # 8 requests instead of 32

Measures, on the same requests (greedy, fixed seed, EOS ignored), the engine as an application gets it: through
`AsyncEngine.stream` with its core in a process of its own (benchmarks/serving.py):
  1. output tokens/s: engine (continuous batching) vs transformers one request at a time, and vs
     transformers in left-padded static batches of 16; the engine runs before and after the
     baselines, each time from an empty cache, and its rate is taken over both runs;
  2. time to first token for a 1,024-token shared prefix + a 32-token question, cold vs warm;
  3. batch-1 decode ms/token vs transformers;
  4. beside them, the engine core alone on this thread (EngineCore.step) on the same requests: its output tokens/s
     and the KV memory waste at the step of peak allocation: (allocated slots - used slots) / allocated slots.
Prints a table of ratios (these machines are noisy: compare within one run).

transformers runs on this process's main thread while the engine's core process waits, as an application's own
torch work would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import sys
from pathlib import Path

import torch

from tieredkv import EngineConfig

sys.path.insert(0, str(Path(__file__).parent))
from serving import Served  # noqa: E402


def make_requests(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(64, 512))], rng.randint(16, 128))
            for _ in range(n)]


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Left-padded batch generate; returns seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def hf_one_at_a_time(model, requests) -> float:
    return sum(hf_generate(model, [p], n) for p, n in requests)


def hf_static_batches(model, requests, batch: int = 16) -> float:
    total = 0.0
    for i in range(0, len(requests), batch):
        chunk = requests[i:i + batch]
        total += hf_generate(model, [p for p, _ in chunk], max(n for _, n in chunk))
    return total


class WasteMeter:
    """KV slot use at the step of peak allocation: `sample` after each step of the engine core."""

    def __init__(self, core):
        self.core = core
        self.peak = (0, 0)

    def sample(self) -> None:
        bs = self.core.block_size
        blocks: dict[int, int] = {}
        for seq in self.core.scheduler.running:
            for i, block in enumerate(seq.block_table):
                filled = max(0, min(bs, seq.num_computed_tokens - i * bs))
                blocks[block.block_id] = max(blocks.get(block.block_id, 0), filled)
        allocated = len(blocks) * bs
        if allocated > self.peak[0]:
            self.peak = (allocated, sum(blocks.values()))

    @property
    def waste(self) -> float:
        allocated, used = self.peak
        return (allocated - used) / allocated if allocated else 0.0


async def engine_throughput(engine: Served, requests) -> float:
    """Output tokens/s of the engine serving all requests at once, from an empty cache (checked)."""
    await engine.clear_cache("all")
    got = await engine.serve(requests)
    assert not any(got.cached), "a prompt was served from cache"
    return got.tok_s()


def hf_decode_ms(model, prompt: list[int], n: int) -> float:
    prefill = hf_generate(model, [prompt], 1)
    return (hf_generate(model, [prompt], n) - prefill) / (n - 1) * 1000


async def main(args) -> dict:
    results: dict = {}
    cfg = EngineConfig(compile_in_background=False, model="default", kv_cache_bytes=args.kv_bytes, max_num_seqs=64)
    engine = await Served.start(cfg, "stream")
    vocab = engine.vocab_size
    requests = make_requests(args.requests, vocab)
    results["requests"] = len(requests)
    out_tokens = sum(n for _, n in requests)
    print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, {out_tokens} output tokens")
    hf = load_hf(engine.model_dir)

    # The engine runs before and after the transformers baselines (A-B-A), so that a drift in machine
    # speed over the baselines' minutes weighs on both sides; its rate is taken over both runs.
    before = await engine_throughput(engine, requests)
    print(f"engine: {before:.1f} tok/s", flush=True)
    results["hf_static16_tok_s"] = out_tokens / hf_static_batches(hf, requests)
    print(f"transformers static batches of 16: {results['hf_static16_tok_s']:.1f} tok/s", flush=True)
    results["hf_single_tok_s"] = out_tokens / hf_one_at_a_time(hf, requests)
    print(f"transformers one at a time: {results['hf_single_tok_s']:.1f} tok/s", flush=True)
    after = await engine_throughput(engine, requests)
    print(f"engine again: {after:.1f} tok/s", flush=True)
    results["engine_tok_s_runs"] = [before, after]
    results["engine_tok_s"] = 2 / (1 / before + 1 / after)  # the rate over both runs' time

    rng = random.Random(1)
    cold, warm = [], []
    for trial in range(3):
        prefix = [rng.randrange(100, vocab) for _ in range(1024)]
        q1 = [rng.randrange(100, vocab) for _ in range(32)]
        q2 = [rng.randrange(100, vocab) for _ in range(32)]
        cold.append((await engine.serve([(prefix + q1, 1)])).ttft())
        warm.append((await engine.serve([(prefix + q2, 1)])).ttft())
    results["ttft_cold_s"] = statistics.median(cold)
    results["ttft_warm_s"] = statistics.median(warm)
    print(f"TTFT 1024+32: cold {results['ttft_cold_s']:.3f}s warm {results['ttft_warm_s']:.3f}s", flush=True)

    prompt = [rng.randrange(100, vocab) for _ in range(128)]
    engine_ms, hf_ms = [], []
    for _ in range(3):  # interleaved, so drifts in machine speed hit both alike
        engine_ms.append((await engine.serve([(prompt, 48)])).ms_per_token())
        hf_ms.append(hf_decode_ms(hf, prompt, 48))
    results["engine_decode_ms"] = statistics.median(engine_ms)
    results["hf_decode_ms"] = statistics.median(hf_ms)
    print(f"batch-1 decode: engine {results['engine_decode_ms']:.1f} ms/token, "
          f"transformers {results['hf_decode_ms']:.1f} ms/token", flush=True)
    await engine.close()

    core = await Served.start(cfg, "core alone")  # the same requests on the engine core alone, its waste measured
    meter = WasteMeter(core.core)
    core.after_step = meter.sample
    results["core_alone_tok_s"] = await engine_throughput(core, requests)
    results["kv_waste_at_peak"] = meter.waste
    await core.close()
    print(f"the core alone: {results['core_alone_tok_s']:.1f} tok/s (the stream "
          f"{results['core_alone_tok_s'] / results['engine_tok_s']:.2f}x its time), peak KV waste {meter.waste:.2%}",
          flush=True)

    ratios = [
        ("throughput vs transformers one-at-a-time", results["engine_tok_s"] / results["hf_single_tok_s"], ">= 5x"),
        ("throughput vs transformers static batch 16", results["engine_tok_s"] / results["hf_static16_tok_s"],
         ">= 1.3x"),
        ("TTFT cold / warm (1024-token shared prefix)", results["ttft_cold_s"] / results["ttft_warm_s"], ">= 8x"),
        ("batch-1 decode speed vs transformers", results["hf_decode_ms"] / results["engine_decode_ms"], ">= 1.0x"),
    ]
    print("\n| measure | ratio | target |\n|---|---|---|")
    for name, ratio, target in ratios:
        print(f"| {name} | {ratio:.2f}x | {target} |")
    print(f"| KV memory waste at peak | {results['kv_waste_at_peak']:.2%} | < 4% |")
    results.update({name: ratio for name, ratio, _ in ratios})
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 requests instead of 32")
    parser.add_argument("--kv-bytes", type=int, default=1 << 30)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    args.requests = 8 if args.quick else 32
    res = asyncio.run(main(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
