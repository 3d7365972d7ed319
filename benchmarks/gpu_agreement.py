"""The engine on a GPU against transformers on the same GPU, greedy, on the default model (needs CUDA).

    .venv/bin/python benchmarks/gpu_agreement.py [--max-tokens 64]

fp32: the engine (Triton kernels) must give transformers' fp32 tokens exactly (exit status 1 otherwise).
bf16: the engine in bf16 against transformers in fp32; rounding makes greedy paths part sooner or later,
so the figure is the share of generated tokens before each answer's first divergence, and how many
answers agree throughout. Prints one line per check and a last summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import torch

PROMPTS = ["What is the capital of France? Answer in one sentence.", "Name three primary colours.",
           "Explain in two sentences why the sky is blue.", "Write a haiku about autumn leaves.",
           "How many legs does a spider have, and why?", "Give me a short recipe for pancakes."]


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out.append(y[0, len(ids):].tolist())
    return out


async def engine_greedy(dtype: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from tieredkv import AsyncEngine, EngineConfig, SamplingParams

    cfg = EngineConfig(model="default", device="cuda", dtype=dtype, attention_backend="triton",
                       kv_cache_bytes=2 << 30)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async with await AsyncEngine.start(cfg) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [o.outputs[0].token_ids for o in outs]


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, int]:
    """Share of tokens before each pair's first difference, and the pairs equal throughout."""
    before, equal = 0, 0
    for g, w in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        before += n
        equal += g == w
    return before / sum(len(w) for w in want), equal


async def main(args) -> int:
    from tieredkv.engine.resolve import resolve_model_dir
    from tieredkv.models.tokenizer import Tokenizer

    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    model_dir = resolve_model_dir("default")
    tok = Tokenizer(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    want = hf_greedy(model_dir, prompts, args.max_tokens)
    fp32 = await engine_greedy("float32", prompts, args.max_tokens)
    bf16 = await engine_greedy("bfloat16", prompts, args.max_tokens)
    share32, same32 = agreement(fp32, want)
    share16, same16 = agreement(bf16, want)
    print(f"fp32 engine vs fp32 transformers: {same32}/{len(want)} answers token-identical")
    print(f"bf16 engine vs fp32 transformers: {share16:.1%} of tokens before the first divergence, "
          f"{same16}/{len(want)} answers identical")
    print(f"summary: fp32 identical {same32}/{len(want)}; bf16 agreement {share16:.1%}")
    return 0 if same32 == len(want) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    sys.exit(asyncio.run(main(parser.parse_args())))
