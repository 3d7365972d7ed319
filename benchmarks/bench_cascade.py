"""Shared-prefix (cascade) decode attention on the chatbot pattern, default model, one run side by side:
4 system prompts of 1,024 tokens x 8 conversations (32-token questions, 32 output tokens), all at once.

    .venv/bin/python benchmarks/bench_cascade.py            # with transformers one at a time (~5 min more)
    .venv/bin/python benchmarks/bench_cascade.py --no-hf [--json F]

Reports output tok/s and median TTFT for the engine with grouping on and off (and transformers one
request at a time), and the median interval between a conversation's tokens while all 32 decode (one decode step
of the 32 sequences, as the application sees it). The engine runs as an application gets it: through
`AsyncEngine.stream` with its core in a process of its own (benchmarks/serving.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from tieredkv import EngineConfig

sys.path.insert(0, str(Path(__file__).parent))
from serving import Served  # noqa: E402


def workload(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    systems = [[rng.randrange(100, vocab) for _ in range(1024)] for _ in range(4)]
    convs = [systems[i % 4] + [rng.randrange(100, vocab) for _ in range(32)] for i in range(32)]
    return systems, convs


async def run_engine(cascade: bool) -> dict:
    cfg = EngineConfig(compile_in_background=False, model="default", max_num_seqs=64, cascade_attention=cascade,
                       warm_bytes=0)
    engine = await Served.start(cfg, "stream")
    try:
        systems, convs = workload(engine.vocab_size)
        await engine.serve([(s + [5], 1) for s in systems])  # the system prompts are cached, as a chatbot's are
        got = await engine.serve([(c, 32) for c in convs])
    finally:
        await engine.close()
    # all 32 decode from the last first token on until the first conversation ends
    gaps = got.gaps_ms(max(got.ttfts()) + got.t0, min(s[-1] for s in got.stamps))
    return {"tok_s": got.tok_s(), "ttft": statistics.median(got.ttfts()),
            "step_ms": statistics.median(gaps) if gaps else float("nan"), "steps": len(gaps) // len(convs)}


def run_hf() -> dict:
    from transformers import AutoModelForCausalLM

    from tieredkv.models.gguf_convert import default_model_dir

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32).eval()
    _, convs = workload(model.config.vocab_size)
    t0, ttfts = time.perf_counter(), []
    with torch.no_grad():
        for c in convs:
            x = torch.tensor([c])
            t1 = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=0)
            ttfts.append(time.perf_counter() - t1)
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - t0 - sum(ttfts)
    return {"tok_s": 32 * len(convs) / seconds, "ttft": statistics.median(ttfts)}


async def main(args) -> None:
    results = {"engine, grouping on": await run_engine(True), "engine, grouping off": await run_engine(False)}
    if args.hf:
        results["transformers one at a time"] = run_hf()
    print(f"{'run':<30}{'tok/s':>9}{'TTFT p50 s':>12}{'32-seq token interval ms':>27}")
    for name, r in results.items():
        print(f"{name:<30}{r['tok_s']:>9.1f}{r['ttft']:>12.3f}{r.get('step_ms', float('nan')):>27.1f}")
    on, off = results["engine, grouping on"], results["engine, grouping off"]
    print(f"grouping on / off: throughput {on['tok_s'] / off['tok_s']:.2f}x, "
          f"decode step {off['step_ms'] / on['step_ms']:.2f}x faster")
    if args.hf:
        print(f"vs transformers one at a time: {on['tok_s'] / results['transformers one at a time']['tok_s']:.2f}x")
    if args.json:
        from tieredkv.platform.cpu_features import cpu_info

        Path(args.json).write_text(json.dumps({"machine": cpu_info().describe(None), "results": results}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-hf", dest="hf", action="store_false")
    parser.add_argument("--json", help="write the results here")
    asyncio.run(main(parser.parse_args()))
