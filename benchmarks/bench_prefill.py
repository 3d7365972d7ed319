"""Compute-bound work per weight format, default model, one sitting: a roofline of this processor's products, the
prefill rate of each format against it, and a mixed batch of many streams.

    .venv/bin/python benchmarks/bench_prefill.py [--rounds 3] [--mixed] [--burst] [--formats ...]
        [--llama-server BIN --gguf F32.gguf Q4_1.gguf] [--out FILE.json]

  roofline   the products' peak here, 2 threads, large shapes (2048 x 2048 x 2048 and the default model's 512-row
             ones): fp32 and bf16 through oneDNN (bf16 where oneDNN's bf16 product checks out on this torch), int8
             x q4 and int8 x q8 on the project's many-row kernel (gemm_cpu.c; ops counted as 2 x M x N x K)
  prefill    one 512-token prompt (prefix caching off), whole, 1 new token: prompt tok/s, best of the rounds, through
             the stream and on the core alone; the core's as a fraction of its arithmetic's peak (2 x the dense
             layers' weights a token, attention excluded)
  mixed 32   (--mixed) 32 requests at once, prompts of 64-512 tokens, 16-128 new tokens (bench_engine.py's):
             output tok/s, best of the rounds (not bf16); with --llama-server, llama.cpp's server on each --gguf
             file (8 slots, its own best, prompts as token ids, nothing cached between rounds) in the same sitting
  burst      (--burst) 4 system prompts of ~1,000 tokens x 8 conversations at once, 32 new tokens each
             (bench_burst.py's), prefix caching on, a fresh engine per format and round: output tok/s, best
Formats: fp32, bf16 (dtype="bfloat16"), int8 and int4 (quantization=...), the default model's own Q4_1 file
(quantization="gguf"); each quantized one with its default arithmetic (int8_activations=None: int8 blocks past
the one-row kernels' rows, where the CPU can) and with int8_activations=False (the dequantized fp32 product) in
the same rounds. Formats alternate within a round, every engine kept; ratios come from the same sitting.
Throughput and prefill rates are taken as an application gets them, through `AsyncEngine.stream` with the core in
a process of its own; the prefill rate also on the engine core alone, whose products the roofline bounds
(benchmarks/serving.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch

from tieredkv import EngineConfig
from tieredkv.engine.engine_core import EngineCore
from tieredkv.platform.cpu_features import cpu_info

sys.path.insert(0, str(Path(__file__).parent))
from serving import MODES, Served  # noqa: E402

FORMATS = {
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int8 (fp32 products)": {"quantization": "int8", "int8_activations": False},
    "int4": {"quantization": "int4"},
    "int4 (fp32 products)": {"quantization": "int4", "int8_activations": False},
    "Q4_1": {"quantization": "gguf"},
    "Q4_1 (fp32 products)": {"quantization": "gguf", "int8_activations": False},
}
PROMPT = 512


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def roofline() -> dict:
    """GFLOP/s of the products on this processor (2 x M x N x K a call), best of five, per shape and the best."""
    from tieredkv.cache_dir import default_cache_dir
    from tieredkv.kernels.linear import onednn_linear, onednn_linear_usable, pack_onednn_weight
    from tieredkv.kernels.quant import many_rows_int8, quant_linear, quantize_int4, quantize_int8
    from tieredkv.kernels.quant_cpu import CPU

    CPU.use(default_cache_dir())

    shapes = [(2048, 2048, 2048), (512, 576, 1536), (512, 1536, 576)]
    out: dict = {}
    for m, k, n in shapes:
        x, w = torch.randn(m, k), torch.randn(n, k)
        flops = 2 * m * n * k / 1e9
        packed = pack_onednn_weight(w)  # as the engine holds fp32 weights (the faster of oneDNN's two)
        row = {"fp32": flops / best_seconds(lambda: onednn_linear(x, packed))}
        if onednn_linear_usable(torch.bfloat16):
            xb, wb = x.bfloat16(), pack_onednn_weight(w.bfloat16())
            row["bf16"] = flops / best_seconds(lambda: onednn_linear(xb, wb))
        for key, qw in (("int8 x q4", quantize_int4(w, 32)), ("int8 x q8", quantize_int8(w))):
            if many_rows_int8(qw.codes, qw.group_size):
                row[key] = flops / best_seconds(lambda: quant_linear(x, qw))
        out[f"{m}x{k}x{n}"] = {key: round(v, 1) for key, v in row.items()}
    keys = ("fp32", "bf16", "int8 x q4", "int8 x q8")
    out["peak"] = {key: max(r[key] for r in out.values() if key in r) for key in keys
                   if any(key in r for r in out.values())}
    return out


async def engine(config: dict, mode: str) -> Served:
    return await Served.start(EngineConfig(enable_prefix_caching=False, warm_bytes=0, compile_in_background=False,
                                           max_num_batched_tokens=2048, **config), mode)


def dense_flops_per_token(core: EngineCore) -> float:
    """2 x the layers' dense weights: a prompt token's products (the LM head runs for the last token only)."""
    from tieredkv.models.llama import Projection

    return 2.0 * sum(m.format.in_features * m.format.out_features for m in core.model.layers.modules()
                     if isinstance(m, Projection))


def mixed_workload(vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(64, 512))] for _ in range(32)]
    return prompts, [rng.randint(16, 128) for _ in range(32)]


async def burst_tok_s(config: dict) -> float:
    """bench_burst.py's burst on a fresh engine with prefix caching, through the stream: output tok/s."""
    from bench_burst import NEW_TOKENS, workload

    engine = await Served.start(EngineConfig(warm_bytes=0, compile_in_background=False, max_num_seqs=64, **config))
    try:
        return (await engine.serve([(p, NEW_TOKENS) for _, p in workload(engine.vocab_size)[1]])).tok_s()
    finally:
        await engine.close()


async def llama_server_mixed(binary: str, gguf: str, prompts: list[list[int]], new: list[int], rounds: int) -> float:
    """Output tok/s of the mixed workload through llama.cpp's server on `gguf` (8 slots), best of the rounds."""
    from llama_server import complete, llama_server

    async with llama_server(binary, gguf) as (session, url):
        await complete(session, url, prompts[0][:64], 4)  # the weights paged in
        best = 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            got = await asyncio.gather(*(complete(session, url, p, n) for p, n in zip(prompts, new)))
            best = max(best, sum(g["tokens_predicted"] for g in got) / (time.perf_counter() - t0))
        return best


def peak_for(name: str, core: EngineCore, peaks: dict) -> float | None:
    arithmetic = " ".join(core.model.dense_arithmetic().values())
    if "int8 blocks" in arithmetic and "fp32 products" not in name:
        return peaks.get("int8 x q4" if "x q4 (" in arithmetic else "int8 x q8")
    return peaks.get("bf16" if name == "bf16" and "widened" not in arithmetic else "fp32")


async def main(args) -> dict:
    torch.manual_seed(0)
    results: dict = {"machine": cpu_info().describe(torch.get_num_threads()), "roofline_gflops": roofline()}
    print(f"machine: {results['machine']}\nroofline GFLOP/s: {results['roofline_gflops']}", flush=True)
    names = ["fp32", *[n for n in args.formats or list(FORMATS) if n != "fp32"]]
    served = {name: {mode: await engine(FORMATS[name], mode) for mode in MODES} for name in names}
    cores = {name: s["core alone"].core for name, s in served.items()}  # EngineCore, on this thread
    vocab = next(iter(cores.values())).spec.vocab_size
    rng = random.Random(1)
    prompt = [rng.randrange(100, vocab) for _ in range(PROMPT)]
    mixed = list(zip(*mixed_workload(vocab)))
    prefill: dict[str, list[float]] = {name: [] for name in cores}  # through the stream
    prefill_core: dict[str, list[float]] = {name: [] for name in cores}  # the core alone
    output: dict[str, list[float]] = {name: [] for name in cores}
    for r in range(args.rounds):
        order = list(cores) if r % 2 == 0 else list(reversed(cores))
        for name in order:
            prefill[name].append(PROMPT / (await served[name]["stream"].serve([(prompt, 1)])).ttft())
            prefill_core[name].append(PROMPT / (await served[name]["core alone"].serve([(prompt, 1)])).ttft())
            if args.mixed and name != "bf16":  # (bf16 without bf16 units: F.linear at a sixth of fp32's rate)
                output[name].append((await served[name]["stream"].serve(mixed)).tok_s())
        print(f"round {r + 1}: " + ", ".join(f"{n} {prefill[n][-1]:.0f} ({prefill_core[n][-1]:.0f} the core alone)"
                                             for n in order), flush=True)
    peaks = results["roofline_gflops"]["peak"]
    results["rounds"] = {"prefill": prefill, "prefill_core_alone": prefill_core,
                         "mixed": output if args.mixed else None}
    table = {}
    for name, core in cores.items():
        rate, rate_core = max(prefill[name]), max(prefill_core[name])
        peak = peak_for(name, core, peaks)
        table[name] = {"prefill_tok_s": round(rate, 1), "vs_fp32": round(rate / max(prefill["fp32"]), 3),
                       "prefill_tok_s_core_alone": round(rate_core, 1),
                       "vs_fp32_core_alone": round(rate_core / max(prefill_core["fp32"]), 3),
                       "arithmetic": core.stats().dense_arithmetic.get("gate_up_proj"),
                       "fraction_of_peak": None if peak is None else
                       round(rate_core * dense_flops_per_token(core) / 1e9 / peak, 3)}
        if output[name]:
            table[name]["mixed32_out_tok_s"] = round(max(output[name]), 1)
            table[name]["mixed32_vs_fp32"] = round(max(output[name]) / max(output["fp32"]), 3)
        print(f"{name:22s} {json.dumps(table[name])}", flush=True)
    if args.burst:
        burst = {name: [] for name in cores}
        for r in range(args.rounds):
            for name in (list(cores) if r % 2 == 0 else list(reversed(cores))):
                burst[name].append(await burst_tok_s(FORMATS[name]))
        for name in cores:
            table[name]["burst_out_tok_s"] = round(max(burst[name]), 1)
            table[name]["burst_vs_fp32"] = round(max(burst[name]) / max(burst["fp32"]), 3)
            print(f"burst {name:16s} {max(burst[name]):.1f} out tok/s ({table[name]['burst_vs_fp32']:.2f}x fp32)")
        results["rounds"]["burst"] = burst
    if args.mixed and args.llama_server:
        results["llama_server_mixed32"] = {}
        for gguf in args.gguf:
            rate = await llama_server_mixed(args.llama_server, gguf, *zip(*mixed), args.rounds)
            results["llama_server_mixed32"][Path(gguf).name] = round(rate, 1)
            print(f"llama-server {Path(gguf).name}: mixed 32 {rate:.1f} out tok/s; the engine's fp32 "
                  f"{max(output['fp32']) / rate:.2f}x it" + "".join(
                      f", {n} {max(output[n]) / rate:.2f}x" for n in cores if n != "fp32" and output[n]))
    results["formats"] = table
    for engines in served.values():
        for e in engines.values():
            await e.close()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mixed", action="store_true", help="the mixed 32 workload too")
    parser.add_argument("--burst", action="store_true", help="the burst on shared system prompts too")
    parser.add_argument("--llama-server", help="with --mixed: llama.cpp's llama-server, run on each --gguf")
    parser.add_argument("--gguf", nargs="*", default=[], help="GGUF files for llama-server (F32, the Q4_1 file)")
    parser.add_argument("--formats", nargs="*", choices=list(FORMATS), help="these formats only (fp32 always)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    res = asyncio.run(main(args))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    sys.exit(0)
