"""A burst of conversations on shared system prompts, as a chatbot meets it, default model, one run:
4 system prompts of about 1,000 tokens, 8 conversations on each with a question of about 30 tokens,
all 32 arriving at once in a shuffled order, 32 output tokens each (greedy, EOS ignored).

    .venv/bin/python benchmarks/bench_burst.py [--no-hf] [--llama-server BIN --gguf FILE ...] [--json out.json]

For each runner: output tok/s over the whole burst, prompt tokens computed against the necessary ones
(each system prompt once, then what follows its full blocks), and time to first token p50 / p99 counted
from the burst's start (queueing included). The engine's "prefill work" is the necessary tokens at its
own prefill rate, measured in the same run on a fresh 1,024-token prompt: the p99 TTFT is compared
with it. transformers serves the 32 one at a time; llama.cpp's server (when given) with 8 slots and
its prompt cache, over HTTP, once per GGUF file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llama_server import llama_server  # noqa: E402

from serving import Served  # noqa: E402

from tieredkv import EngineConfig  # noqa: E402
from tieredkv.platform.cpu_features import cpu_info  # noqa: E402

NEW_TOKENS, BS = 32, 16


def workload(vocab: int) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """The system prompts, and the 32 conversations (system index, prompt ids) in arrival order."""
    rng = random.Random(0)
    systems = [[rng.randrange(100, vocab) for _ in range(rng.randint(960, 1040))] for _ in range(4)]
    convs = [(i % 4, systems[i % 4] + [rng.randrange(100, vocab) for _ in range(rng.randint(24, 36))])
             for i in range(32)]
    rng.shuffle(convs)
    return systems, convs


def necessary_tokens(systems: list[list[int]], convs: list[tuple[int, list[int]]]) -> int:
    """Each system prompt computed once, with its first conversation; the others from its last full block."""
    seen, total = set(), 0
    for s, prompt in convs:
        total += len(prompt) if s not in seen else len(prompt) - len(systems[s]) // BS * BS
        seen.add(s)
    return total


def percentiles(ttfts: list[float]) -> dict:
    q = statistics.quantiles(ttfts, n=100, method="inclusive")
    return {"ttft_p50": statistics.median(ttfts), "ttft_p99": q[98]}


async def run_engine(name: str, **overrides) -> dict:
    """The engine through the stream, the core in a process of its own (benchmarks/serving.py)."""
    cfg = EngineConfig(model="default", max_num_seqs=64, warm_bytes=0, compile_in_background=False, **overrides)
    engine = await Served.start(cfg, "stream")
    try:
        vocab = engine.vocab_size
        rng = random.Random(1)
        await engine.serve([([rng.randrange(100, vocab) for _ in range(64)], 4)])
        fresh = [rng.randrange(100, vocab) for _ in range(1024)]
        prefill_rate = 1024 / (await engine.serve([(fresh, 1)])).ttft()
        systems, convs = workload(vocab)
        before = engine.stats()
        got = await engine.serve([(p, NEW_TOKENS) for _, p in convs])
        after = engine.stats()
    finally:
        await engine.close()
    tokens, seconds, ttfts = sum(map(len, got.tokens)), max(s[-1] for s in got.stamps) - got.t0, got.ttfts()
    necessary = necessary_tokens(systems, convs)
    return {"name": name, "tok_s": tokens / seconds, "seconds": seconds,
            "computed": after.prompt_tokens_computed - before.prompt_tokens_computed, "necessary": necessary,
            "joined_blocks": after.prefix_blocks_joined - before.prefix_blocks_joined,
            "prefill_rate": prefill_rate, "prefill_work_s": necessary / prefill_rate, **percentiles(ttfts)}


def run_hf() -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from tieredkv.models.gguf_convert import default_model_dir

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.at = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first put is the prompt
                self.at = time.perf_counter()

        def end(self):
            pass

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32).eval()
    systems, convs = workload(model.config.vocab_size)
    t0, ttfts = time.perf_counter(), []
    with torch.no_grad():
        for _, prompt in convs:
            x, streamer = torch.tensor([prompt]), FirstToken()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0, streamer=streamer)
            ttfts.append(streamer.at - t0)
    seconds = time.perf_counter() - t0
    return {"name": "transformers, one at a time", "tok_s": NEW_TOKENS * len(convs) / seconds, "seconds": seconds,
            "computed": sum(len(p) for _, p in convs), "necessary": necessary_tokens(systems, convs),
            **percentiles(ttfts)}


async def run_llama(binary: str, gguf: str, vocab: int) -> dict:
    """llama.cpp's server with 8 slots and its prompt cache; prompts sent as token ids."""
    async with llama_server(binary, gguf, "--cache-reuse", "0") as (session, url):
        systems, convs = workload(vocab)
        t0, ttfts, computed = time.perf_counter(), [], []

        async def one(prompt):
            body = {"prompt": prompt, "n_predict": NEW_TOKENS, "ignore_eos": True, "temperature": 0.0,
                    "stream": True, "cache_prompt": True}
            first, n = None, 0
            async with session.post(f"{url}/completion", json=body) as r:
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    event = json.loads(line[6:])
                    if event.get("content") is not None and not event.get("stop"):
                        first, n = first or time.perf_counter() - t0, n + 1
                    if event.get("stop"):
                        computed.append(event.get("timings", {}).get("prompt_n", 0))
            ttfts.append(first)
            return n

        tokens = sum(await asyncio.gather(*(one(p) for _, p in convs)))
        seconds = time.perf_counter() - t0
    return {"name": f"llama.cpp server 8 slots, {os.path.basename(gguf)}", "tok_s": tokens / seconds,
            "seconds": seconds, "computed": sum(computed), "necessary": necessary_tokens(systems, convs),
            **percentiles(ttfts)}


def report(results: list[dict]) -> None:
    print(f"{'runner':<44}{'tok/s':>7}{'s':>7}{'computed/necessary':>20}{'TTFT p50':>10}{'p99':>7}")
    for r in results:
        print(f"{r['name']:<44}{r['tok_s']:>7.1f}{r['seconds']:>7.1f}"
              f"{r['computed']:>10,}/{r['necessary']:<9,}{r['ttft_p50']:>8.1f} s{r['ttft_p99']:>6.1f} s")
    engine, base = results[0], next((r for r in results if r["name"].startswith("transformers")), None)
    print(f"\n{engine['name']}: computed {engine['computed'] / engine['necessary']:.3f}x the necessary prompt tokens "
          f"({engine['joined_blocks']} blocks joined in flight); prefill work {engine['prefill_work_s']:.1f} s at "
          f"{engine['prefill_rate']:.0f} tok/s, p99 TTFT {engine['ttft_p99'] / engine['prefill_work_s']:.2f}x it")
    for r in results[1:]:
        print(f"{engine['name']} / {r['name']}: {engine['tok_s'] / r['tok_s']:.2f}x output tok/s")
    if base is None:
        print("(transformers not run)")


async def main(args) -> None:
    torch.set_num_threads(args.threads)
    print("machine:", cpu_info().describe(args.threads))
    results = [await run_engine("tieredkv")]
    if args.variants:
        results.append(await run_engine("tieredkv, cascade attention off", cascade_attention=False))
        results.append(await run_engine("tieredkv, first come first served", scheduling_policy="fcfs"))
    if args.hf:
        results.append(run_hf())
    for gguf in args.gguf:
        from tieredkv.models.gguf_convert import default_model_dir

        vocab = json.loads((default_model_dir() / "config.json").read_text())["vocab_size"]
        results.append(await run_llama(args.llama_server, gguf, vocab))
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_info().describe(args.threads), "results": results}, f, indent=2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-hf", dest="hf", action="store_false")
    parser.add_argument("--variants", action="store_true", help="also the engine with cascade attention off, and fcfs")
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server")
    parser.add_argument("--gguf", nargs="*", default=[], help="GGUF files for llama-server")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json")
    asyncio.run(main(parser.parse_args()))
