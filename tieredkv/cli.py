"""Command line: `python -m tieredkv demo` and `python -m tieredkv generate PROMPT`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from importlib.resources import files

from tieredkv.config import EngineConfig, SamplingParams
from tieredkv.engine import AsyncEngine

DEMO_QUESTIONS = [
    "How long does it take to charge the Volt battery, and how should I store it over winter?",
    "I want to return a helmet I wore once. Is that possible?",
]


async def _stream_answer(engine: AsyncEngine, messages, params: SamplingParams) -> None:
    t0 = time.perf_counter()
    first = None
    async for chunk in engine.stream(messages, params):
        if first is None:
            first = time.perf_counter() - t0
        print(chunk.text, end="", flush=True)
        if chunk.usage is not None:
            u = chunk.usage
            elapsed = time.perf_counter() - t0
            print(f"\n\n[{u.cached_prompt_tokens:,} of {u.prompt_tokens:,} prompt tokens served from cache; "
                  f"first token after {first:.2f} s; {u.completion_tokens} tokens in {elapsed:.2f} s]\n")


async def demo(args: argparse.Namespace) -> None:
    system = files("tieredkv").joinpath("data/demo_system_prompt.txt").read_text()
    config = EngineConfig(model=args.model)
    print(f"starting tieredkv on model={args.model!r}...", flush=True)
    async with await AsyncEngine.start(config) as engine:
        core = engine.core
        print(f"{core.model_dir.name}: {core.dtype} on {core.device}, {core.num_blocks} KV blocks "
              f"of {core.block_size} tokens\n")
        params = SamplingParams(max_tokens=args.max_tokens)
        for question in DEMO_QUESTIONS:
            print(f">>> {question}\n")
            await _stream_answer(engine, [{"role": "system", "content": system},
                                          {"role": "user", "content": question}], params)
        s = engine.stats()
        print(f"prefix cache: {s.prefix_cache_hits:,} of {s.prefix_cache_queries:,} prompt tokens hit; "
              f"{s.blocks_cached} blocks cached of {s.blocks_total}")


async def generate(args: argparse.Namespace) -> None:
    async with await AsyncEngine.start(EngineConfig(model=args.model)) as engine:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        await _stream_answer(engine, prompt, params)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tieredkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="stream two answers that share a long system prompt")
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=96)
    p.set_defaults(func=demo)
    p = sub.add_parser("generate", help="stream one answer")
    p.add_argument("prompt")
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", dest="chat", action="store_false", help="no chat template")
    p.set_defaults(func=generate)
    args = parser.parse_args(argv)
    try:
        asyncio.run(args.func(args))
    except KeyboardInterrupt:
        sys.exit(130)
