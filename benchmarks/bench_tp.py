"""Tensor parallelism: the same workload at tensor_parallel_size 1 and N (default 2), in one run: batch-1 decode
ms/token, batched throughput, each rank's weight bytes and resident growth over the load, and the all-reduce
time per step (rank 0's wall time inside the collectives, which on CPU includes waiting for the slower rank).

    .venv/bin/python benchmarks/bench_tp.py                       # CPU, gloo: N=1 and N=2
    .venv/bin/python benchmarks/bench_tp.py --device cuda --dtype bfloat16   # a machine with 2 GPUs: NCCL

The speed figures are the stream's (`AsyncEngine.stream`, the core in a process of its own, which starts the ranks:
what an application gets), the core alone's beside them (benchmarks/serving.py); the rest are the core alone's.

On a CPU every rank shares the same cores: on 2 cores, N=2 runs one thread per rank against 2 threads at N=1, so
it is not expected to be faster; what it shows is the per-rank memory and the cost of the all-reduces (two per
layer, one for the embedding) on this machine. On GPUs each rank has a device of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tieredkv import EngineConfig
from tieredkv.platform.cpu_features import cpu_info

sys.path.insert(0, str(Path(__file__).parent))
from serving import Served  # noqa: E402


async def measure(world: int, args, mode: str) -> dict:
    """One row: batch-1 decode and batched throughput at tensor_parallel_size `world`, in `mode`; the core alone
    adds the all-reduces' time, rank 0's messages, and each rank's weight bytes and resident growth."""
    threads = args.threads if args.threads else max(1, (os.cpu_count() or 1) // world)
    cfg = EngineConfig(model=args.model, tensor_parallel_size=world, device=args.device, dtype=args.dtype,
                       num_threads=threads, compile_decode=False, warm_bytes=args.warm_bytes,
                       num_blocks=args.num_blocks, offload="off")
    t0 = time.perf_counter()
    engine = await Served.start(cfg, mode)
    start_s = time.perf_counter() - t0
    try:
        vocab = engine.vocab_size
        prompts = [[(i * 7919 + j * 104729) % (vocab - 10) + 5 for j in range(args.prompt_len)]
                   for i in range(args.batch)]
        await engine.serve([(prompts[0], 4)])  # warm-up: first-use allocations, oneDNN's primitive caches
        one = await engine.serve([(prompts[0], args.new)])
        core, steps = engine.core, [0]
        row = {"mode": mode, "tensor_parallel_size": world, "threads_per_rank": threads, "start_s": round(start_s, 2),
               "decode_ms_per_token": round(one.ms_per_token(skip=0), 2)}
        if core is None:
            row["batch_output_tok_s"] = round((await engine.serve([(p, args.new) for p in prompts])).tok_s(), 1)
            return row
        tp = core.tp

        def count() -> None:
            steps[0] += 1

        engine.after_step = count
        r0, n0, m0, s0 = tp.reduce_s, tp.reduces, _messages(tp), core.stats().num_swaps
        row["batch_output_tok_s"] = round((await engine.serve([(p, args.new) for p in prompts])).tok_s(), 1)
        memory = core.memory if isinstance(core.memory, list) else [core.memory]
        return row | {
            "batch_steps": steps[0],
            "allreduce_ms_per_step": round(1000 * (tp.reduce_s - r0) / steps[0], 2),
            "allreduces_per_step": round((tp.reduces - n0) / steps[0], 1),
            "messages_per_step": round((_messages(tp) - m0) / steps[0], 2),  # rank 0 to the others
            "swaps": core.stats().num_swaps - s0,
            "rank_weight_bytes": [m.weight_bytes for m in memory],
            "rank_resident_growth_bytes": [m.resident_growth for m in memory],
        }
    finally:
        await engine.close()


def _messages(tp) -> int:
    """Messages rank 0 has sent the other ranks (0 at one rank; `commands`: how trees before one step message
    counted theirs, for A/B runs against them)."""
    sent = getattr(tp, "messages", None)
    if sent is None:
        sent = getattr(tp, "commands", {})
    return sum(sent.values())


def measure_fresh(world: int) -> dict:
    """measure(world) in a process of its own, so that the resident-memory growth starts from a clean heap: the
    core alone, then through the stream (the speed figures)."""
    out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", str(world)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


async def measure_modes(world: int, args) -> dict:
    alone = await measure(world, args, "core alone")
    stream = await measure(world, args, "stream")
    speed = ("decode_ms_per_token", "batch_output_tok_s")
    return alone | {key: stream[key] for key in speed} | {"mode": "stream (the rest: the core alone)",
                                                           "core_alone": {key: alone[key] for key in speed}}


def main(args) -> dict:
    cpu = cpu_info()
    rows = [measure_fresh(1), measure_fresh(args.tp)]
    one, many = rows
    report = {
        "machine": cpu.describe(), "device": args.device, "model": args.model,
        "workload": f"batch-1 decode of {args.new} tokens; {args.batch} prompts of {args.prompt_len} tokens, "
                    f"a pool of {args.num_blocks} blocks, warm {args.warm_bytes} bytes, "
                    f"{args.new} new tokens each, at once",
        "rows": rows,
        "ratios": {
            "decode_ms_N_over_1": round(many["decode_ms_per_token"] / one["decode_ms_per_token"], 2),
            "throughput_N_over_1": round(many["batch_output_tok_s"] / one["batch_output_tok_s"], 2),
            "rank_weights_over_1": [round(w / one["rank_weight_bytes"][0], 3) for w in many["rank_weight_bytes"]],
            "rank_resident_over_1": [round(w / one["rank_resident_growth_bytes"][0], 3)
                                     for w in many["rank_resident_growth_bytes"]],
        },
    }
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with 1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="per rank (default: the cores / N)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=512,
                   help="the hot pool; with a small one and --warm-bytes the batch is preempted and swapped")
    p.add_argument("--warm-bytes", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the report here (JSON)")
    p.add_argument("--only", type=int, default=None, help=argparse.SUPPRESS)  # one row, in this process
    args = p.parse_args()
    if args.only is not None:
        print(json.dumps(asyncio.run(measure_modes(args.only, args))))
        sys.exit(0)
    result = main(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.exit(0)
