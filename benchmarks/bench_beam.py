"""Beam search: tieredkv vs transformers' beam search on the default model, side by side in one run.

    .venv/bin/python benchmarks/bench_beam.py             # 4 chats, 4 beams, 32 new tokens (~3 min on 2 cores)
    .venv/bin/python benchmarks/bench_beam.py --beams 8

Measures, on the same chat prompts (greedy beam search, the model's EOS ending beams):
  1. wall time and best-beam output tokens/s: the engine with every request at once, the engine one request
     at a time, transformers `generate(num_beams=k)` one request at a time; and whether the beams match;
  2. KV blocks at the peak of an 8-beam search on a ~1,000-token document, against what 8 independent
     sequences of the same lengths hold (every beam its own copy of the prompt).

The engine runs as an application gets it, through `AsyncEngine` with the core in a process of its own;
transformers on this process's main thread while the core waits.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.core.kv_manager import cdiv
from tieredkv.engine.engine_core import EngineCore
from tieredkv.platform.cpu_features import cpu_info

CHATS = ["Explain in two sentences why the sky is blue.", "Write a short poem about a lighthouse.",
         "Give three tips for learning a new language.", "What is a prime number? Answer briefly."]


def hf_beams(model, ids: list[int], k: int, new: int) -> list[list[int]]:
    with torch.no_grad():
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, num_beams=k,
                           num_return_sequences=k)
    eos = model.generation_config.eos_token_id
    return [s[: s.index(eos) + 1] if eos in s else s for s in y[:, len(ids):].tolist()]


async def throughput(k: int, new: int) -> None:
    from transformers import AutoModelForCausalLM

    # through the stream, the core in a process of its own; transformers on this thread while the core waits
    async with await AsyncEngine.start(EngineConfig(compile_in_background=False, model="default")) as engine:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
        params = SamplingParams(max_tokens=new, beam_width=k, n=k)
        await engine.generate(prompts[0], SamplingParams(max_tokens=2, beam_width=k))  # warm-up
        await engine.clear_cache("all")
        t = time.perf_counter()
        together = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        t_together = time.perf_counter() - t
        await engine.clear_cache("all")
        t = time.perf_counter()
        for p in prompts:
            await engine.generate(p, params)
        t_alone = time.perf_counter() - t
        model = AutoModelForCausalLM.from_pretrained(engine.info.model_dir, dtype=torch.float32).eval()
        t = time.perf_counter()
        expected = [hf_beams(model, p, k, new) for p in prompts]
        t_hf = time.perf_counter() - t
    same = sum([o.token_ids for o in r.outputs] == e for r, e in zip(together, expected))
    tokens = sum(len(r.outputs[0].token_ids) for r in together)
    print(f"beam search, {k} beams, {len(prompts)} chats, up to {new} new tokens ({tokens} best-beam tokens); "
          f"beams identical to transformers: {same}/{len(prompts)}")
    print(f"  {'':32}{'wall s':>8}{'tok/s':>8}{'vs HF':>8}")
    for name, secs in (("tieredkv, all at once", t_together), ("tieredkv, one at a time", t_alone),
                       ("transformers, one at a time", t_hf)):
        print(f"  {name:32}{secs:8.2f}{tokens / secs:8.2f}{t_hf / secs:7.2f}x")


def sharing(k: int, doc_tokens: int, new: int) -> None:
    core = EngineCore(EngineConfig(
        compile_in_background=False, model="default", enable_prefix_caching=False, max_num_seqs=k))
    text = " ".join(f"Line {i}: the {['red', 'blue', 'green'][i % 3]} box {i * 7 % 13}." for i in range(400))
    ids = core.tokenizer.encode(text)[:doc_tokens]
    core.add_request(core.factory.make(ids, SamplingParams(max_tokens=new, beam_width=k, ignore_eos=True), "doc"))
    peak = 0
    while core.has_work():
        core.step()
        peak = max(peak, core.pool.num_blocks - core.pool.num_free)
    bs = core.block_size
    alone = k * cdiv(doc_tokens + new, bs)
    print(f"KV blocks at the peak, {k} beams on a {doc_tokens}-token prompt + {new} tokens: {peak} shared vs "
          f"{alone} for {k} independent sequences: {100 * (1 - peak / alone):.0f}% less")
    core.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    print("machine:", cpu_info().describe(torch.get_num_threads()))
    asyncio.run(throughput(args.beams, args.new))
    sharing(8, 1000, 64)


if __name__ == "__main__":
    main()
