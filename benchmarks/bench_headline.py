"""The README's headline workloads as an application runs them, through `AsyncEngine.stream` with the engine core
in a process of its own (the default), beside the same workload on the engine core alone (EngineCore.step on the
main thread: what most other benchmarks time), default model, one sitting:

    .venv/bin/python benchmarks/bench_headline.py [--rounds 3] [--out docs/bench/headline_zen5.json]

Workloads (greedy, EOS ignored, compiled decode as the CPU default, compile finished before timing):
  decode fp32     batch-1 decode after a 128-token prompt, 48 timed tokens: ms/token
  decode bf16, int8, int4, Q4_1   the same with dtype="bfloat16", quantization="int8", "int4", and the default
                  model's own Q4_1 weights (quantization="gguf")
  mixed 32        32 requests at once, prompts of 64-512 tokens, 16-128 new tokens (bench_engine.py's): output tok/s
  burst           4 system prompts of ~1,000 tokens x 8 conversations, all at once, 32 new tokens each
                  (bench_burst.py's): output tok/s
Each (workload, mode) runs in a fresh process; modes alternate within a round and rounds alternate their order;
ratios of medians. Quote the ratios: the machine's speed drifts between sittings.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from child import report, run_child, save  # noqa: E402
from serving import MODES, Served, Timings  # noqa: E402

WORKLOADS = ["decode fp32", "decode bf16", "decode int8", "decode int4", "decode Q4_1", "mixed 32", "burst"]
DECODE_WEIGHTS = {"decode fp32": {}, "decode bf16": {"dtype": "bfloat16"}, "decode int8": {"quantization": "int8"},
                  "decode int4": {"quantization": "int4"}, "decode Q4_1": {"quantization": "gguf"}}
DECODE_TOKENS = 48
WARM = [11 + 3 * i for i in range(64)]  # a first request that shares nothing with the workloads' prompts


def _config(workload: str):
    from tieredkv import EngineConfig

    extra = DECODE_WEIGHTS.get(workload, {})
    return EngineConfig(model="default", compile_in_background=False, warm_bytes=0,
                        max_num_seqs=64, enable_prefix_caching=workload == "burst", **extra)


def _requests(workload: str, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, new tokens) of the workload, in arrival order."""
    import random

    if workload.startswith("decode"):
        rng = random.Random(1)
        return [([rng.randrange(100, vocab) for _ in range(128)], DECODE_TOKENS + 4)]
    if workload == "mixed 32":
        from bench_engine import make_requests

        return make_requests(32, vocab)
    from bench_burst import NEW_TOKENS, workload as burst

    return [(prompt, NEW_TOKENS) for _, prompt in burst(vocab)[1]]


def _summary(workload: str, got: Timings) -> dict:
    if workload.startswith("decode"):
        return {"ms_per_token": got.ms_per_token(skip=4)}  # after the prompt and the first tokens
    return {"tok_s": got.tok_s()}


async def _run(workload: str, mode: str) -> dict:
    engine = await Served.start(_config(workload), mode)
    try:
        await engine.serve([(WARM, 8)])
        return _summary(workload, await engine.serve(_requests(workload, engine.vocab_size)))
    finally:
        await engine.close()


def main(args) -> dict:
    from tieredkv.platform.cpu_features import cpu_info

    runs = [(w, m) for w in args.workloads for m in MODES]
    raw: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for workload, mode in runs if r % 2 == 0 else reversed(runs):
            got = run_child(__file__, ["--workload", workload, "--mode", mode], timeout=900)
            raw.setdefault(f"{workload} | {mode}", []).append(got)
            print(f"round {r}: {workload:12s} {mode:10s} {got}", flush=True)
    table = {}
    for workload in args.workloads:
        field = "ms_per_token" if workload.startswith("decode") else "tok_s"
        got = {m: statistics.median(g[field] for g in raw[f"{workload} | {m}"]) for m in MODES}
        # a ratio above 1 is the stream slower: more ms a token, or fewer tokens a second
        slower = got["stream"] / got["core alone"] if field == "ms_per_token" else got["core alone"] / got["stream"]
        table[workload] = {field: got, "stream_time_vs_core_alone": slower}
        print(f"| {workload} | {field} | stream {got['stream']:.2f} | core alone {got['core alone']:.2f} | "
              f"{slower:.3f}x the time |", flush=True)
    result = {"machine": cpu_info().describe(None), "rounds": args.rounds, "workloads": table, "raw": raw}
    return save(result, args.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS,
                   default=["decode fp32", "decode Q4_1", "mixed 32", "burst"])
    p.add_argument("--out", default=None)
    p.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workload:
        report(asyncio.run(_run(args.workload, args.mode)))
    else:
        main(args)
