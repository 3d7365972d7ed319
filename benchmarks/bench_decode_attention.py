"""Decode attention on CPU: the project's kernel (kernels/attention_cpu.c) against what served before it, in one
process, variants alternating round by round.

    .venv/bin/python benchmarks/bench_decode_attention.py [--quantization int4] [--rounds 3] [--json PATH]

1. batch-1 decode through the compiled graph, ms/token after 128, 1,024 and 4,000 tokens of context: one
   engine whose graph calls the kernel, one traced with the kernel unavailable (inductor's loops over
   decode_attention_dense);
2. the mixed 32-request workload (bench_engine.py's), output tokens/s: its batched steps' attention through
   the kernel, then through the torch reference (gathers + SDPA per length group), on one engine.
Default model; `--quantization` as EngineConfig's (none: fp32).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import context_engine, decode_ms, run  # noqa: E402
from bench_engine import make_requests  # noqa: E402

from tieredkv.kernels import decode_attention  # noqa: E402
from tieredkv.platform.cpu_features import cpu_info  # noqa: E402

CONTEXTS = (128, 1024, 4000)


_USABLE = decode_attention.paged_decode_usable


def _kernel(on: bool) -> None:
    """Makes the kernel available or not to what is traced or run next (decode_attention.paged_decode_usable)."""
    decode_attention.paged_decode_usable = _USABLE if on else (lambda *a: False)


def main(args) -> dict:
    quant = {"quantization": args.quantization} if args.quantization else {}
    random.seed(0)
    prompts = {n: [random.randrange(100, 40000) for _ in range(n)] for n in CONTEXTS}
    cores = {}
    for name in ("kernel", "inductor"):
        _kernel(name == "kernel")  # the graph is traced at start
        cores[name] = context_engine(list(prompts.values()), **quant)
    _kernel(True)
    batch1: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for n, prompt in prompts.items():
            for name, core in cores.items():
                batch1.setdefault(f"{name} @ {n}", []).append(decode_ms(core, prompt, 64))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in batch1.items()), flush=True)
    for n in CONTEXTS:
        a, b = statistics.median(batch1[f"kernel @ {n}"]), statistics.median(batch1[f"inductor @ {n}"])
        print(f"batch-1 decode after {n} tokens: kernel {a:.2f} ms/token, inductor {b:.2f}: {a / b:.3f}x the time")
    cores.pop("inductor").close()
    core = cores["kernel"]
    requests = make_requests(32, core.spec.vocab_size)
    out_tokens = sum(k for _, k in requests)
    mixed: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name in ("kernel", "torch"):
            _kernel(name == "kernel")  # the eager forward asks at every layer
            core.tiers.clear("all")
            t0 = time.perf_counter()
            run(core, [p for p, _ in requests], [k for _, k in requests])
            mixed.setdefault(name, []).append(out_tokens / (time.perf_counter() - t0))
        print(f"mixed round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in mixed.items()), flush=True)
    _kernel(True)
    a, b = statistics.median(mixed["kernel"]), statistics.median(mixed["torch"])
    print(f"mixed 32 requests: kernel {a:.1f} tok/s, torch reference {b:.1f}: {a / b:.3f}x")
    core.close()
    return {"machine": cpu_info().describe(torch.get_num_threads()), "quantization": args.quantization,
            "batch1_ms": batch1, "mixed32_tok_s": mixed}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    results = main(options)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
