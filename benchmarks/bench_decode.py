"""One user, one stream: batch-1 decode on CPU, side by side in one run.

    .venv/bin/python benchmarks/bench_decode.py            # ~12 min on 2 cores
    .venv/bin/python benchmarks/bench_decode.py --quick    # fewer tokens and repeats, no throughput part

Measures, on the default model, each engine both through `AsyncEngine.stream` with its core in a process of its
own (what an application gets) and as the engine core alone on this thread (benchmarks/serving.py):
  1. start-up: a fresh process builds the engine with an empty compile cache, then again with the cache it
     left (the compiled decode path), and once with compile_decode=False;
  2. batch-1 decode ms/token through the stream, the core alone's beside it (128-token prompt, greedy, EOS
     ignored) for tieredkv fp32 and bf16, each with
     the compiled decode path and with the eager forward, int8, int4 and the default model's own Q4_1 file
     (quantization="gguf"), the three again with int8_activations, on the compiled path, and transformers
     fp32, interleaved (fp32 also through the compiled graph with the native step off: where the native
     step takes fp32 weights, the two decode paths side by side); each row with its weight bytes, its floor
     (those bytes over the measured read bandwidth of a 1 GiB tensor) and the time its engine took to build in
     this run; with --llama-bench, llama.cpp's
     llama-bench on the GGUF files given, same run;
     with --engine-gguf, the engine on other GGUF files of the default model too (llama-quantize's presets);
  3. the engine's own cost per decode step outside the forward (scheduler, block moves, sampling, stop rules)
     and the batch preparation inside it (the core alone's steps);
  4. bf16 against fp32: greedy agreement over a set of prompts and the largest next-token logit difference;
  5. mixed 32-request throughput through the stream (bench_engine.py's workload) with and without the compiled
     path, and int4 (with and without int8_activations).
Prints llama.cpp's F32 figure measured on these machines (FACTS) for reference. Ratios are what to
compare: these machines are noisy.

One engine works at a time: the cores alone and transformers on the main thread, the streamed engines' cores in
their processes while this one waits (OpenMP pools that work at once outnumber the cores, and libgomp stops
spin-waiting: see docs/architecture.md, "One worker thread for torch").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tieredkv import EngineConfig
from tieredkv.engine.engine_core import EngineCore

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import hf_decode_ms, load_hf, make_requests  # noqa: E402
from bench_quant_quality import gguf_model_dir  # noqa: E402
from serving import MODES, Served  # noqa: E402

KV_BYTES = 96 << 20

STARTUP = """
import json, sys, time
t0 = time.perf_counter()
from tieredkv.config import EngineConfig
from tieredkv.engine.engine_core import EngineCore
core = EngineCore(EngineConfig(
    compile_in_background=False, kv_cache_bytes={kv}, warm_bytes=0, compile_decode={compiled}))
graphs = getattr(core.runner.compiled, "graphs", 0)  # (the native step compiles none)
print(json.dumps({{"seconds": time.perf_counter() - t0, "graphs": graphs, "path": core.runner.decode_path}}))
"""


def startup_seconds(cache_dir: str, compiled: bool) -> dict:
    """A fresh process's EngineCore start-up with `cache_dir` as its cache (the converted default model
    linked in from the usual cache, so only the compile cache starts empty)."""
    from tieredkv.cache_dir import default_cache_dir

    models = Path(cache_dir) / "models"
    if not models.exists():
        models.symlink_to(default_cache_dir() / "models")
    env = dict(os.environ, TIEREDKV_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", STARTUP.format(kv=KV_BYTES, compiled=compiled)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class StepClock:
    """Wraps an engine core's step, the runner's execute and its prepare to time them."""

    def __init__(self, core):
        self.step, self.execute, self.prepare = [], [], []
        for obj, name, sink in ((core, "step", self.step), (core.runner, "execute", self.execute),
                                (core.runner, "prepare", self.prepare)):
            setattr(obj, name, self._timed(getattr(obj, name), sink))

    @staticmethod
    def _timed(fn, sink):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sink.append(time.perf_counter() - t0)
            return out
        return timed

    def reset(self):
        for sink in (self.step, self.execute, self.prepare):
            sink.clear()


def run(core: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> list:
    """Serves the prompts at once to the end on the engine core alone; returns each one's tokens."""
    return Served("core alone", core=core).serve_sync(list(zip(prompts, max_tokens))).tokens


def decode_ms(core: EngineCore, prompt: list[int], n: int) -> float:
    """served_decode_ms on the engine core alone, for synchronous code."""
    return Served("core alone", core=core).serve_sync([(prompt, n)]).ms_per_token()


async def served_decode_ms(engine: Served, prompt: list[int], n: int) -> float:
    return (await engine.serve([(prompt, n)])).ms_per_token()


async def context_served(prompts: list[list[int]], mode: str = "stream", **config) -> Served:
    """An engine (compiled decode ready) whose pool holds every prompt's blocks at once plus 128 new tokens each,
    warmed on each prompt: the prompts' blocks then stay cached, so decoding after them times the decode alone."""
    longest = max(map(len, prompts)) + 128
    engine = await Served.start(EngineConfig(compile_in_background=False, warm_bytes=0, max_model_len=longest,
                                             num_blocks=len(prompts) * (longest // 16 + 2), **config), mode)
    for prompt in prompts:
        await engine.serve([(prompt, 4)])
    return engine


def context_engine(prompts: list[list[int]], **config) -> EngineCore:
    """context_served's engine core alone, for benchmarks that rebind its kernels."""
    return asyncio.run(context_served(prompts, "core alone", **config)).core


def next_token_logits(core: EngineCore, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The fp32 logits each prompt's prefill produced (one request at a time)."""
    captured = []
    inner = core.runner.execute

    def execute(out):
        logits, sampled = inner(out)
        captured.append(logits[-1].float().clone())
        return logits, sampled

    core.runner.execute = execute
    try:
        for p in prompts:
            run(core, [p], [1])
    finally:
        core.runner.execute = inner
    return captured


def read_bandwidth() -> float:
    """Bytes per second of a plain read of a 1 GiB fp32 tensor (a sum), best of five."""
    big = torch.ones(256 << 20)
    best = min(_timed(big.sum) for _ in range(5))
    del big
    return (1 << 30) / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def llama_bench(binary: str, gguf: str, repeats: int | None = None, depth: int = 0, cache_type: str | None = None) \
        -> float:
    """llama.cpp's batch-1 decode ms/token: llama-bench -t 2 -p 0 -n 128 (-r repeats: its own default, 5; -d depth:
    the new tokens follow that many of context; cache_type: its KV cache's type for K and V, -ctk/-ctv, with
    flash attention on, which a quantized V needs)."""
    more = ([] if repeats is None else ["-r", str(repeats)]) + ([] if not depth else ["-d", str(depth)])
    more += ["-ctk", cache_type, "-ctv", cache_type, "-fa", "1"] if cache_type else []
    out = subprocess.run([binary, "-m", gguf, "-t", "2", "-p", "0", "-n", "128", *more, "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    return 1000.0 / json.loads(out)[0]["avg_ts"]


QUANTIZED = {"int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
             "gguf Q4_1": {"quantization": "gguf"},
             "int8, int8 activations": {"quantization": "int8", "int8_activations": True},
             "int4, int8 activations": {"quantization": "int4", "int8_activations": True},
             "gguf Q4_1, int8 activations": {"quantization": "gguf", "int8_activations": True}}


async def main(args) -> dict:
    from tieredkv.platform.cpu_features import cpu_info

    results: dict = {"machine": cpu_info().describe(torch.get_num_threads())}
    print(f"machine: {results['machine']}", flush=True)
    from tieredkv.models.gguf_convert import default_model_dir

    default_model_dir()  # converted before the start-ups link it in (on a fresh machine it is not there yet)
    with tempfile.TemporaryDirectory() as cache:
        first, second = startup_seconds(cache, True), startup_seconds(cache, True)
        eager = startup_seconds(cache, False)
    results["startup_s"] = {"compiled_first": first["seconds"], "compiled_second": second["seconds"],
                            "eager": eager["seconds"]}
    print(f"start-up: {first['path']} first {first['seconds']:.1f}s ({first['graphs']} graphs compiled), second "
          f"{second['seconds']:.1f}s (from the cache), eager {eager['seconds']:.1f}s", flush=True)

    variants: dict[str, dict[str, Served]] = {}  # name -> mode -> engine
    built: dict[str, float] = {}  # name -> seconds to build its core alone
    configs = {f"{dtype}{'' if compiled else ' eager'}": {"dtype": dtype, "compile_decode": compiled}
               for dtype in ("float32", "bfloat16") for compiled in (True, False)}
    # the compiled graph, where the native step takes fp32 weights by default (AVX-512 builds): both paths side by side
    configs["float32 graph"] = {"dtype": "float32", "compile_decode": True, "native_decode": False}
    configs.update(QUANTIZED)
    links = tempfile.TemporaryDirectory()
    for gguf in args.engine_gguf:  # the engine on other GGUF files of the default model (llama-quantize's presets)
        where = gguf_model_dir(Path(gguf), default_model_dir(), Path(links.name))
        configs[f"gguf {Path(gguf).name}"] = {"quantization": "gguf", "model": str(where)}
    for name, overrides in configs.items():
        config = EngineConfig(compile_in_background=False, kv_cache_bytes=KV_BYTES, warm_bytes=0, **overrides)
        variants[name] = {}
        for mode in MODES:
            t0 = time.perf_counter()
            variants[name][mode] = await Served.start(config, mode)
            if mode == "core alone":
                built[name] = time.perf_counter() - t0
    cores = {name: v["core alone"].core for name, v in variants.items()}  # EngineCore, on this thread
    streams = {name: v["stream"] for name, v in variants.items()}
    bandwidth = read_bandwidth()
    results["read_bandwidth_gb_s"] = bandwidth / 1e9
    fp32 = cores["float32"]
    vocab = fp32.spec.vocab_size
    hf = load_hf(fp32.model_dir)
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab) for _ in range(128)]
    run(fp32, [prompt], [4])  # first touches of every buffer, before anything is timed
    for engine in streams.values():
        await engine.serve([(prompt, 4)])  # the prompt's blocks cached in every engine, as in the cores below
    clocks = {name: StepClock(core) for name, core in cores.items()}
    ms: dict[str, list[float]] = {name: [] for name in [*variants, "transformers"]}
    alone: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved: a drift in machine speed hits every variant alike
        for name in variants:
            ms[name].append(await served_decode_ms(streams[name], prompt, args.tokens))
            alone[name].append(await served_decode_ms(variants[name]["core alone"], prompt, args.tokens))
        ms["transformers"].append(hf_decode_ms(hf, prompt, args.tokens))
    results["decode_ms"] = {name: statistics.median(v) for name, v in ms.items()}  # the stream's; transformers'
    results["decode_ms_core_alone"] = {name: statistics.median(v) for name, v in alone.items()}
    for binary, gguf in ((args.llama_bench, g) for g in args.gguf):
        results["decode_ms"][f"llama.cpp {Path(gguf).name}"] = llama_bench(binary, gguf)
        results.setdefault("llama_gguf_bytes", {})[f"llama.cpp {Path(gguf).name}"] = Path(gguf).stat().st_size
    results["weight_bytes"] = {name: core.stats().weight_bytes for name, core in cores.items()}
    results["weight_bytes"].update(results.get("llama_gguf_bytes", {}))
    results["built_s"] = built
    results["decode_path"] = {name: core.stats().decode_path for name, core in cores.items()}
    for name, clock in clocks.items():
        outside = [s - e for s, e in zip(clock.step, clock.execute)]
        results.setdefault("per_step_ms", {})[name] = {
            "step": statistics.median(clock.step) * 1e3, "outside_forward": statistics.median(outside) * 1e3,
            "prepare": statistics.median(clock.prepare) * 1e3}
    print(f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s (1 GiB tensor, best of 5)")
    print("\n| batch-1 decode | ms/token through the stream | the core alone | vs tieredkv fp32 (compiled) | "
          "weights MB | vs its floor | core built in (s) |\n|---|---|---|---|---|---|---|")
    base = results["decode_ms"]["float32"]
    for name, value in results["decode_ms"].items():
        nbytes = results["weight_bytes"].get(name, results["weight_bytes"]["float32"])
        floor = nbytes / bandwidth * 1e3
        built_s = f"{built[name]:.1f}" if name in built else "-"
        core_ms = results["decode_ms_core_alone"].get(name)
        core_s = f"{core_ms:.1f}" if core_ms else "-"
        print(f"| {name} | {value:.1f} | {core_s} | {value / base:.2f}x | {nbytes / 1e6:.0f} | {value / floor:.2f}x | "
              f"{built_s} |")
    print("\n| per decode step (ms, median) | step | outside the forward | batch preparation |\n|---|---|---|---|")
    for name, row in results["per_step_ms"].items():
        print(f"| {name} | {row['step']:.2f} | {row['outside_forward']:.2f} | {row['prepare']:.2f} |")

    # bf16 against fp32, both compiled: greedy continuations and next-token logits
    prompts = [fp32.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in (
        "What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea.",
        "Explain what a hash table is.", "Give me a recipe for pancakes.", "Why is the sky blue?")]
    prompts += [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 256))] for _ in range(args.prompts - 6)]
    outs = {name: [run(cores[name], [p], [32])[0] for p in prompts] for name in ("float32", "bfloat16")}
    same = sum(a == b for a, b in zip(outs["float32"], outs["bfloat16"]))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(outs["float32"], outs["bfloat16"])]
    l32, l16 = next_token_logits(cores["float32"], prompts), next_token_logits(cores["bfloat16"], prompts)
    diff = max(float((a - b).abs().max()) for a, b in zip(l32, l16))
    top1 = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(l32, l16))
    results["bf16_vs_fp32"] = {"prompts": len(prompts), "identical_32_token_continuations": same,
                               "mean_first_divergence": statistics.mean(first_diff),
                               "next_token_top1_agree": top1, "max_logit_diff": diff}
    print(f"\nbf16 vs fp32 over {len(prompts)} prompts: {same} identical 32-token greedy continuations, "
          f"first divergence at token {statistics.mean(first_diff):.1f} on average, next-token top-1 agrees on "
          f"{top1}, largest next-token logit difference {diff:.3f}", flush=True)

    if not args.quick:  # the mixed workload (bench_engine.py's) through the stream, both ways, A-B-A-B
        requests = make_requests(32, vocab)
        runs: dict[str, list[float]] = {"float32": [], "float32 eager": [], "int4": [], "int4, int8 activations": []}
        for _ in range(2):
            for name in runs:
                await streams[name].clear_cache("all")  # from an empty cache each time
                runs[name].append((await streams[name].serve(requests)).tok_s())
        results["mixed32_tok_s"] = {name: statistics.mean(v) for name, v in runs.items()}
        ratio = results["mixed32_tok_s"]["float32"] / results["mixed32_tok_s"]["float32 eager"]
        print(f"mixed 32 requests: compiled {results['mixed32_tok_s']['float32']:.1f} tok/s, eager "
              f"{results['mixed32_tok_s']['float32 eager']:.1f} tok/s ({ratio:.2f}x), int4 "
              f"{results['mixed32_tok_s']['int4']:.1f} tok/s "
              f"({results['mixed32_tok_s']['int4'] / results['mixed32_tok_s']['float32']:.2f}x fp32), with int8 "
              f"activations {results['mixed32_tok_s']['int4, int8 activations']:.1f} tok/s", flush=True)
    for engines in variants.values():
        for engine in engines.values():
            await engine.close()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--llama-bench", help="path to llama.cpp's llama-bench, run on each --gguf")
    parser.add_argument("--gguf", nargs="*", default=[], help="GGUF files for llama-bench")
    parser.add_argument("--engine-gguf", nargs="*", default=[],
                        help="GGUF files of the default model the engine runs too (quantization=\"gguf\")")
    ns = parser.parse_args()
    ns.tokens, ns.repeats, ns.prompts = (32, 2, 8) if ns.quick else (128, 3, 16)
    res = asyncio.run(main(ns))
    if ns.json:
        ns.json.write_text(json.dumps(res, indent=1))
