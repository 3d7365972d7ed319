"""Batch-1 decode of the engine and of llama.cpp interleaved in time, for machines whose speed drifts.

    .venv/bin/python benchmarks/bench_interleaved.py --llama-bench PATH --gguf f32.gguf q4_1.gguf [--rounds 5]
        [--depth 0 1024 4000]

bench_decode.py runs every engine variant first and llama-bench after, so a machine that speeds up or slows
down in between (one of ours moved 1.5x within minutes) skews the engine-to-llama.cpp ratios. Here each round
runs every variant once (the engine in fp32, int4 and on the default model's own Q4_1 file, 128 new tokens
after a 128-token prompt; then llama-bench -t 2 -p 0 -n 128 -r 1 on each file), and the ratios come from the
medians over rounds. The engine runs through `AsyncEngine.stream` with its core in a process of its own (what an
application gets), each variant also as the engine core alone beside it ("... (core alone)"). With --depth,
each round does so at every depth: the engine's prompt that many tokens long (128 at depth 0), llama-bench -d
depth (the prompt's tokens are random ids; only the context length matters to the time). Set LD_LIBRARY_PATH
to llama-bench's directory if its libraries live there.

With --kv the engine's variants are the default model's Q4_1 file with the KV cache in fp32, int8 and int4
(EngineConfig.kv_cache_dtype), and llama-bench runs each file with each of --llama-kv's cache types (-ctk/-ctv,
flash attention on): the KV formats beside llama.cpp's at each depth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import context_served, llama_bench, served_decode_ms  # noqa: E402
from serving import MODES  # noqa: E402

from tieredkv.platform.cpu_features import cpu_info  # noqa: E402

VARIANTS = {"fp32": {}, "int4": {"quantization": "int4"}, "Q4_1 (gguf)": {"quantization": "gguf"}}
KV_VARIANTS = {"Q4_1, fp32 KV": {"quantization": "gguf"},
               "Q4_1, int8 KV": {"quantization": "gguf", "kv_cache_dtype": "int8"},
               "Q4_1, int4 KV": {"quantization": "gguf", "kv_cache_dtype": "int4"}}


async def main(args) -> dict:
    random.seed(0)
    prompts = {d: [random.randrange(100, 40000) for _ in range(d or 128)] for d in args.depth}
    variants = KV_VARIANTS if args.kv else VARIANTS
    engines = {(name if mode == "stream" else f"{name} (core alone)"): await context_served(list(prompts.values()),
                                                                                          mode, **kw)
               for name, kw in variants.items() for mode in MODES}
    kinds = [(gguf, t) for gguf in args.gguf for t in (args.llama_kv if args.kv else [None])]

    def llama_name(gguf: str, cache_type: str | None) -> str:
        return f"llama.cpp {Path(gguf).name}" + (f" KV {cache_type}" if cache_type else "")
    rounds: dict[str, list[float]] = {}
    at = (lambda name, d: name) if args.depth == [0] else (lambda name, d: f"{name} @ {d}")
    for r in range(args.rounds):
        for d, prompt in prompts.items():
            for name, engine in engines.items():
                rounds.setdefault(at(name, d), []).append(await served_decode_ms(engine, prompt, 128))
            for gguf, cache_type in kinds:
                rounds.setdefault(at(llama_name(gguf, cache_type), d), []).append(
                    llama_bench(args.llama_bench, gguf, repeats=1, depth=d, cache_type=cache_type))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rounds.items()), flush=True)
    median = {k: statistics.median(v) for k, v in rounds.items()}
    print("median ms/token: " + ", ".join(f"{k} {v:.2f}" for k, v in median.items()))
    first, second = list(variants)[0], list(variants)[1:]
    for d in prompts:
        ratios = ", ".join(f"{k} {median[at(k, d)] / median[at(first, d)]:.3f}x" for k in second)
        print(f"{at(f'vs {first}', d)}: {ratios}")
        for gguf, cache_type in kinds:
            ref = median[at(llama_name(gguf, cache_type), d)]
            print(f"vs {at(llama_name(gguf, cache_type), d)}: "
                  + ", ".join(f"{k} {median[at(k, d)] / ref:.3f}x" for k in variants))
        print(f"{at('the stream vs the core alone', d)}: "
              + ", ".join(f"{k} {median[at(k, d)] / median[at(f'{k} (core alone)', d)]:.3f}x" for k in variants))
    for engine in engines.values():
        await engine.close()
    return {"machine": cpu_info().describe(torch.get_num_threads()), "depths": args.depth, "rounds": rounds,
            "median": median}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-bench", required=True, help="path to llama.cpp's llama-bench")
    parser.add_argument("--gguf", nargs="+", required=True, help="GGUF files of the default model for llama-bench")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--depth", type=int, nargs="+", default=[0],
                        help="context lengths the 128 new tokens follow (llama-bench -d; 0: a 128-token prompt)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--kv", action="store_true", help="the KV cache's formats on the Q4_1 file (see above)")
    parser.add_argument("--llama-kv", nargs="*", default=["f16", "q8_0"], help="--kv: llama-bench's cache types")
    options = parser.parse_args()
    results = asyncio.run(main(options))
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
