"""What a speculative verification costs at a context depth: one sequence decoding after a prompt of N tokens,
plain steps (one row) against steps that verify k drafts (k + 1 rows), ms a step, median over the steps, on the
default model's Q4_1 file (the native step verifies there). The drafts are a fixed token, never accepted, so every
verification step carries all k (non-adaptive): the figure is the step's cost, not a speed-up.

    .venv/bin/python benchmarks/bench_verify_depth.py [--depths 1000 4000 8000] [--drafts 8] [--json PATH]

The ratio `verify / plain` says how many plain steps one verification costs: drafts pay where the expected
accepted tokens plus one exceed it. Run the script from two trees (PYTHONPATH=<tree>) for a before/after.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from tieredkv import EngineConfig, SamplingParams
from tieredkv.engine.engine_core import EngineCore
from tieredkv.platform.cpu_features import cpu_info


class FixedDrafts:
    """Proposes the same token k times (the drafts are rejected at once: each verification holds all k)."""

    name = "fixed"
    free = True

    def __init__(self, k: int):
        self.k = k

    def propose(self, seqs, lengths):
        return [[101] * min(self.k, n) for n in lengths]


def step_ms(depth: int, drafts: int, new: int = 40) -> float:
    core = EngineCore(EngineConfig(model="default", quantization="gguf", max_model_len=min(depth + new + 64, 8192),
                                   num_blocks=(depth + new + 160) // 16, warm_bytes=0, compile_in_background=False,
                                   speculative={"method": "ngram", "num_speculative_tokens": max(drafts, 1),
                                                "adaptive": False}))
    try:
        core.parts.speculator.proposer = FixedDrafts(drafts)
        rng = random.Random(depth)
        prompt = [rng.randrange(100, 40000) for _ in range(depth)]
        core.add_request(core.factory.make(prompt, SamplingParams(max_tokens=new, ignore_eos=True)))
        core.step()  # the prompt
        times = []
        while core.has_work():
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]) * 1000
    finally:
        core.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[1000, 4000, 8000])
    parser.add_argument("--drafts", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    out = {"machine": cpu_info().describe(torch.get_num_threads()), "drafts": args.drafts, "rows": {}}
    for depth in args.depths:
        plain, verify = step_ms(depth, 0), step_ms(depth, args.drafts)
        out["rows"][depth] = {"plain_ms": plain, "verify_ms": verify, "ratio": verify / plain}
        print(f"depth {depth}: plain {plain:.1f} ms, verifying {args.drafts} drafts {verify:.1f} ms "
              f"({verify / plain:.2f} plain steps)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
