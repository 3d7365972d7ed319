"""Two source trees of tieredkv side by side on the default model, in one sitting: three workloads users
run, each in a fresh process per tree, the trees alternating (A B A B ...), medians reported as ratios.

    .venv/bin/python benchmarks/bench_ab.py --base /path/to/other/checkout [--repeats 2] [--json out.json]

Workloads (greedy, EOS ignored, compiled decode as the CPU default, compile cache warm):
  mixed:  32 requests at once, prompts of 64-512 tokens, 16-128 new tokens (bench_engine.py's): output tok/s;
  burst:  4 system prompts of 1,024 tokens x 8 conversations (32-token questions, 32 new tokens), all at once
          (bench_cascade.py's): output tok/s;
  longdoc: a 3,000-token document on a 64-block hot pool (older blocks offloaded to warm), then a second
          question about it: first TTFT, decode ms/token, and the second question's TTFT.
Start-up is not timed. The machine should be otherwise idle: quote the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from tieredkv.config import EngineConfig, SamplingParams
try:
    from tieredkv.engine.engine_core import EngineCore
except ImportError:  # a tree from before the layer folders
    from tieredkv.engine_core import EngineCore

def run(core, prompts, max_tokens):
    reqs = [core.factory.make(p, SamplingParams(max_tokens=n, ignore_eos=True), f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    t0, first = time.perf_counter(), {}
    for r in reqs:
        core.add_request(r)
    while core.has_work():
        core.step()
        for r in reqs:
            if r.request_id not in first and r.seqs and r.seqs[0].num_output_tokens:
                first[r.request_id] = time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    return seconds, sum(len(r.seqs[0].output_token_ids) for r in reqs), first

workload = sys.argv[2]
if workload == "longdoc":
    core = EngineCore(EngineConfig(num_blocks=64, warm_bytes=1 << 30, compile_in_background=False))
else:
    core = EngineCore(EngineConfig(kv_cache_bytes=1 << 30, warm_bytes=0, compile_in_background=False))
vocab = core.spec.vocab_size
rng = random.Random(0)
if workload == "mixed":
    reqs = [([rng.randrange(100, vocab) for _ in range(rng.randint(64, 512))], rng.randint(16, 128)) for _ in range(32)]
    seconds, tokens, _ = run(core, [p for p, _ in reqs], [n for _, n in reqs])
    print(json.dumps({"tok_s": tokens / seconds}))
elif workload == "burst":
    systems = [[rng.randrange(100, vocab) for _ in range(1024)] for _ in range(4)]
    convs = [systems[i % 4] + [rng.randrange(100, vocab) for _ in range(32)] for i in range(32)]
    seconds, tokens, _ = run(core, convs, [32] * 32)
    print(json.dumps({"tok_s": tokens / seconds}))
else:
    doc = [rng.randrange(100, vocab) for _ in range(3000)]
    q1, q2 = doc + [rng.randrange(100, vocab) for _ in range(24)], doc + [rng.randrange(100, vocab) for _ in range(24)]
    seconds, tokens, first = run(core, [q1], [64])
    ttft = first["r0"]
    decode_ms = (seconds - ttft) * 1e3 / (tokens - 1)
    _, _, again = run(core, [q2], [8])
    print(json.dumps({"first_ttft_s": ttft, "decode_ms": decode_ms, "second_ttft_s": again["r0"]}))
"""


def measure(tree: str, workload: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_COMPILE")}
    out = subprocess.run([sys.executable, "-c", WORKER, tree, workload], capture_output=True, text=True, env=env,
                         cwd=tree)
    if out.returncode != 0:
        raise RuntimeError(f"{tree} {workload}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args) -> dict:
    trees = {"base": str(Path(args.base).resolve()), "this": str(Path(__file__).resolve().parent.parent)}
    results: dict[str, dict[str, list[dict]]] = {w: {t: [] for t in trees} for w in args.workloads}
    for r in range(args.repeats):
        for workload in args.workloads:
            for name, tree in trees.items():
                got = measure(tree, workload)
                results[workload][name].append(got)
                print(f"[{r + 1}] {workload:8s} {name:5s} {got}", flush=True)
    summary = {}
    for workload, by_tree in results.items():
        for metric in by_tree["this"][0]:
            base = statistics.median(x[metric] for x in by_tree["base"])
            this = statistics.median(x[metric] for x in by_tree["this"])
            summary[f"{workload}.{metric}"] = {"base": base, "this": this, "this/base": this / base}
            print(f"{workload + '.' + metric:22s} base {base:9.3f}  this {this:9.3f}  this/base {this / base:5.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=2))
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the other checkout (its tieredkv/ is imported)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["mixed", "burst", "longdoc"])
    parser.add_argument("--json", help="write the runs and the summary here")
    main(parser.parse_args())
