"""The command line's inspection and operations commands: chat, plan, explain, cache, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from tieredkv.config import KV_CACHE_DTYPES, SamplingParams
from tieredkv.engine.async_engine import AsyncEngine
from tieredkv.tools.config_flags import add_engine_options, engine_config


async def chat(args: argparse.Namespace) -> None:
    """An interactive conversation, streamed; after each answer, where its prompt came from and the TTFT."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    async with await AsyncEngine.start(engine_config(args)) as engine:
        print("type a message (an empty line or Ctrl-D ends)", flush=True)
        while True:
            try:
                line = await asyncio.to_thread(input, "> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            t0, first, answer, usage = time.perf_counter(), None, [], None
            async with engine.stream(messages, SamplingParams(max_tokens=args.max_tokens)) as stream:
                async for chunk in stream:
                    first = first or time.perf_counter() - t0
                    answer.append(chunk.text)
                    print(chunk.text, end="", flush=True)
                    usage = chunk.usage or usage
            messages.append({"role": "assistant", "content": "".join(answer)})
            tiers = ", ".join(f"{t} {n}" for t, n in usage.cached_tokens_by_tier.items() if n) or "none"
            print(f"\n[{usage.prompt_tokens} prompt tokens, cached: {tiers}; first token after {first:.2f} s; "
                  f"{usage.completion_tokens} tokens]", flush=True)


def plan_command(args: argparse.Namespace) -> None:
    from tieredkv.tools.plan import format_plan, parse_bytes, plan, profile_activations

    activation = None
    if args.profile:
        activation = profile_activations(args.model, args.device, args.dtype, args.max_num_batched_tokens)
    warm = None if args.warm_bytes is None else parse_bytes(args.warm_bytes)  # None: the engine's default
    result = plan(args.model, args.device, parse_bytes(args.device_memory) if args.device_memory else None,
                  args.memory_utilization, args.dtype, args.block_size, args.max_model_len, warm,
                  parse_bytes(args.cold_bytes), args.seq_len, args.shared_prompt_len, args.max_num_batched_tokens,
                  args.max_num_seqs, activation, quantization=args.quantization,
                  quantization_group_size=args.quantization_group_size or 32,
                  tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype)
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_plan(result))


async def explain_command(args: argparse.Namespace) -> None:
    # explain and the cache commands never decode: no decode graph to compile or load (minutes on a first start)
    async with await AsyncEngine.start(engine_config(args, warm_bytes=0, compile_decode=False)) as engine:
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        reports = await engine.explain(prompt)
    print(f"{'block':>5}  {'tokens':>13}  {'from':<6}  why computed")
    for r in reports:
        print(f"{r.index:>5}  {r.start:>6}-{r.end:<6}  {r.source or '-':<6}  {r.reason or ''}")
    served = sum(r.end - r.start for r in reports if r.source)
    print(f"{served} of {reports[-1].end if reports else 0} prompt tokens would be served from the cache")


def _cache_options(p: argparse.ArgumentParser, cold_default, model_default) -> None:
    p.add_argument("--cold-path", default=cold_default, help="the cold folder (required)")
    p.add_argument("--model", default=model_default, help="whose blocks (the model decides the fingerprint)")


async def cache_command(args: argparse.Namespace) -> None:
    """inspect | clear | export FILE | import FILE on a cold folder (the model decides the fingerprint).
    Only import may create the folder: the others on a folder that does not exist say so and stop."""
    if args.cold_path is None:
        sys.exit(f"cache {args.action}: --cold-path is required")
    if args.action != "import" and not Path(args.cold_path).is_dir():
        sys.exit(f"cache {args.action}: there is no cold folder at {args.cold_path}")
    # it reads the cold tier itself: the core in this process (a short command: nothing else runs beside it)
    config = engine_config(args, warm_bytes=0, num_blocks=64, compile_decode=False, core_process=False)
    async with await AsyncEngine.start(config) as engine:
        cold = engine.core.tiers.cold
        if args.action == "inspect":
            s = cold.stats()
            files = sum(f.stat().st_size for f in Path(args.cold_path).glob("*.mdb"))
            print(f"cold folder {args.cold_path}: {s.used_bytes / 2**20:.1f} MiB of {s.capacity_bytes / 2**20:.1f} "
                  f"MiB budget used by this model; files {files / 2**20:.1f} MiB")
            print(f"model fingerprints stored here: {len(cold.known_fingerprints())}")
            for fp in cold.known_fingerprints():
                print(("* " if fp == engine.core.fingerprint else "  ") + fp)
        elif args.action == "clear":
            print(f"removed {await engine.clear_cache('cold')} blocks of this model")
        elif args.action in ("export", "import"):
            with tqdm(unit="block", desc=args.action) as bar:
                if args.action == "export":
                    n = await engine.export_cache(args.file, progress=bar.update)
                    print(f"exported {n} blocks to {args.file}")
                else:
                    report = await engine.import_cache(args.file, progress=bar.update)
                    await engine.run_in_worker(cold.flush_sync)
                    print(f"imported {report['imported']} blocks ({report['corrupt']} damaged skipped"
                          f"{'' if report['complete'] else '; the file is truncated'})")


def bench_command(args: argparse.Namespace) -> None:
    """Runs benchmarks/bench_engine.py (a source checkout), writes its JSON and PNG plots to --out."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_engine.py"
    if not script.exists():
        sys.exit("tieredkv bench runs the benchmarks of a source checkout; none was found beside this package")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(script), "--json", str(out / "bench_engine.json")] + (["--quick"] if args.quick else [])
    subprocess.run(cmd, check=True)
    results = json.loads((out / "bench_engine.json").read_text())
    print(f"results: {out / 'bench_engine.json'}")
    for path in plot_results(results, out):
        print(f"plot: {path}")


def plot_results(results: dict, out: Path) -> list[Path]:
    """Throughput and time to first token against the baselines, as PNG (the `plots` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plots: pip install 'tieredkv[plots]'")
        return []
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["tieredkv", "transformers\nstatic batch 16", "transformers\none at a time"]
    values = [results["engine_tok_s"], results["hf_static16_tok_s"], results["hf_single_tok_s"]]
    a.bar(names, values, color=["tab:blue", "tab:gray", "tab:gray"])
    a.set_ylabel("output tokens / s")
    a.set_title(f"{results['requests']} mixed requests at once" if "requests" in results else "mixed requests at once")
    b.bar(["cold prefix", "cached prefix"], [results["ttft_cold_s"], results["ttft_warm_s"]],
          color=["tab:gray", "tab:blue"])
    b.set_ylabel("time to first token (s)")
    b.set_title("1,024-token shared prefix + 32-token question")
    fig.tight_layout()
    path = out / "bench_engine.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="how much KV each tier holds for a model on a machine")
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="auto", help="cuda or cpu: whose memory to plan for (auto: the engine's)")
    p.add_argument("--device-memory", default=None, help="e.g. 80GiB (default: measured)")
    p.add_argument("--memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", default="auto",
                   help="as the engine: float32 on CPU; bfloat16 on CUDA, float16 below compute capability 8.0")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--warm-bytes", default=None, help="the warm tier's budget (default: the engine's)")
    p.add_argument("--cold-bytes", default="0")
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length for 'sequences before preemption'")
    p.add_argument("--shared-prompt-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="measure one forward instead of estimating")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quantization", "--weights", choices=["int8", "int4", "gguf"], default=None,
                   help="as the engine's --quantization: the weights' bytes in that format")
    p.add_argument("--quantization-group-size", type=int, default=None, help="int4: inputs per scale (default 32)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="as the engine's: the weights and KV heads each of N ranks holds")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="as the engine's: how the cache stores K and V (the bytes of a block in every tier)")
    p.set_defaults(func=plan_command)


def add_parsers(sub) -> None:
    p = sub.add_parser("chat", help="an interactive conversation, streamed")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    add_engine_options(p)
    p.set_defaults(func=chat)
    _add_plan_parser(sub)
    p = sub.add_parser("explain", help="where each block of a prompt would come from, or why it is computed")
    p.add_argument("prompt")
    p.add_argument("--raw", dest="chat", action="store_false", help="no chat template")
    add_engine_options(p)  # --cold-path: the cold folder to look in (hot and warm start empty)
    p.set_defaults(func=explain_command)
    p = sub.add_parser("cache", help="inspect, clear, export or import a cold folder")
    _cache_options(p, None, "default")
    actions = p.add_subparsers(dest="action", required=True, metavar="{inspect,clear,export,import}")
    for name, text in (("inspect", "what the folder holds, by model"), ("clear", "remove this model's blocks"),
                       ("export", "write this model's blocks to a snapshot FILE"),
                       ("import", "read a snapshot FILE into the folder")):
        a = actions.add_parser(name, help=text)
        if name in ("export", "import"):
            a.add_argument("file", help="the snapshot file")
        _cache_options(a, argparse.SUPPRESS, argparse.SUPPRESS)  # also after the action; never overriding
        a.set_defaults(func=cache_command)
    p = sub.add_parser("bench", help="run the engine benchmark; JSON and PNG plots")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=bench_command)
