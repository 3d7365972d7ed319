"""Batched decode of a few streams on quantized weights: the int8 blocks from the measured row count on
(quant.int8_fewest_rows, the default without speculative decoding) against the one-row kernels' int16 rows up to
their most rows (what every weight took before, and what engines with speculative decoding keep), one engine, the
two alternated per round, default model:

    .venv/bin/python benchmarks/bench_streams.py [--quantization gguf] [--streams 4 8 12 16] [--rounds 3]
        [--int8-from N] [--out F]

Each case: that many requests at once, random 64-token prompts, 64 new tokens each (EOS ignored); output tok/s,
best of the rounds. Prefix caching off. With --int8-from N, a third arm: int8 blocks from N rows whatever was
measured (is the measured count the right one?).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from serving import Served

from tieredkv import EngineConfig
from tieredkv.engine.engine_core import EngineCore
from tieredkv.kernels.quant import QuantizedWeight
from tieredkv.platform.cpu_features import cpu_info

NEW = 64


def output_rate(core: EngineCore, prompts: list[list[int]]) -> float:
    """Output tok/s of the prompts at once on the engine core alone (the kernels' choice is the core's to flip)."""
    return Served("core alone", core=core).serve_sync([(p, NEW) for p in prompts]).tok_s()


def main(args) -> dict:
    core = EngineCore(EngineConfig(model="default", quantization=args.quantization, warm_bytes=0,
                                   compile_in_background=False, enable_prefix_caching=False))
    weights = [m for m in core.model.modules() if isinstance(m, QuantizedWeight)]
    measured = {w: w.int8_rows for w in weights}
    arms = {"as measured": lambda: [setattr(w, "int8_rows", r) for w, r in measured.items()],
            "int16 rows": lambda: [setattr(w, "int8_rows", -1 if r else 0) for w, r in measured.items()]}
    if args.int8_from:
        arms[f"int8 from {args.int8_from} rows"] = lambda: [setattr(w, "int8_rows", args.int8_from if r else 0)
                                                           for w, r in measured.items()]
    label = core.stats().dense_arithmetic.get("gate_up_proj")
    out = {"machine": cpu_info().describe(torch.get_num_threads()), "quantization": args.quantization,
           "as measured": label, "streams": {}}
    print(f"machine: {out['machine']}\nas measured: {label}", flush=True)
    rng = random.Random(0)
    vocab = core.spec.vocab_size
    for n in args.streams:
        prompts = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(n)]
        rates = {arm: [] for arm in arms}
        for r in range(args.rounds):
            for arm in (list(arms) if r % 2 == 0 else list(reversed(arms))):
                arms[arm]()
                rates[arm].append(output_rate(core, prompts))
        best = {arm: max(v) for arm, v in rates.items()}
        out["streams"][n] = {**{arm: round(v, 1) for arm, v in best.items()},
                             "ratio": round(best["as measured"] / best["int16 rows"], 3)}
        print(f"{n:3d} streams: " + ", ".join(f"{arm} {v:.1f} tok/s" for arm, v in best.items())
              + f" (as measured / int16 rows {out['streams'][n]['ratio']:.2f}x)", flush=True)
    arms["as measured"]()
    core.close()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--streams", nargs="+", type=int, default=[4, 8, 12, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--int8-from", type=int, default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    res = main(args)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
