"""Batch-1 decode of the engine and of llama.cpp interleaved in time, for machines whose speed drifts.

    .venv/bin/python benchmarks/bench_interleaved.py --llama-bench PATH --gguf f32.gguf q4_1.gguf [--rounds 5]

bench_decode.py runs every engine variant first and llama-bench after, so a machine that speeds up or slows
down in between (one of ours moved 1.5x within minutes) skews the engine-to-llama.cpp ratios. Here each round
runs every variant once (the engine in fp32, int4 and on the default model's own Q4_1 file, 128 new tokens
after a 128-token prompt; then llama-bench -t 2 -p 0 -n 128 -r 1 on each file), and the ratios come from the
medians over rounds. Set LD_LIBRARY_PATH to llama-bench's directory if its libraries live there.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import decode_ms, llama_bench  # noqa: E402

from tieredkv import EngineConfig  # noqa: E402
from tieredkv.engine_core import EngineCore  # noqa: E402
from tieredkv.runner.cpu_features import cpu_info  # noqa: E402

VARIANTS = {"fp32": {}, "int4": {"quantization": "int4"}, "Q4_1 (gguf)": {"quantization": "gguf"}}


def main(args) -> dict:
    random.seed(0)
    prompt = [random.randrange(100, 40000) for _ in range(128)]
    cores = {}
    for name, kw in VARIANTS.items():
        cores[name] = EngineCore(EngineConfig(compile_in_background=False, kv_cache_bytes=96 << 20, warm_bytes=0,
                                              **kw))
        decode_ms(cores[name], prompt, 16)  # warm
    rounds: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name, core in cores.items():
            rounds.setdefault(name, []).append(decode_ms(core, prompt, 128))
        for gguf in args.gguf:
            rounds.setdefault(f"llama.cpp {Path(gguf).name}", []).append(llama_bench(args.llama_bench, gguf, repeats=1))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rounds.items()), flush=True)
    median = {k: statistics.median(v) for k, v in rounds.items()}
    print("median ms/token: " + ", ".join(f"{k} {v:.2f}" for k, v in median.items()))
    print(f"int4 / fp32: {median['int4'] / median['fp32']:.3f}")
    for name, v in median.items():
        if name.startswith("llama.cpp"):
            print(f"vs {name}: " + ", ".join(f"{k} {median[k] / v:.3f}x" for k in VARIANTS))
    return {"machine": cpu_info().describe(torch.get_num_threads()), "rounds": rounds, "median": median}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-bench", required=True, help="path to llama.cpp's llama-bench")
    parser.add_argument("--gguf", nargs="+", required=True, help="GGUF files of the default model for llama-bench")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    results = main(options)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
