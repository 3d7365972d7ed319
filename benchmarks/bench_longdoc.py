"""One long document, several questions about it: a hot pool far smaller than its KV against one that
holds everything, side by side in one run.

    .venv/bin/python benchmarks/bench_longdoc.py                  # ~6 min on 2 cores
    .venv/bin/python benchmarks/bench_longdoc.py --tokens 2000    # a shorter document

Default model, greedy, EOS ignored. A ~6,000-token document and 5 questions, each asked as one chat
turn (document, then question), one after the other. Engines:
  - "offloaded": a hot pool of 64 blocks (1,024 tokens) and a warm tier: the document's older blocks
    live in warm as far blocks, read in place by attention, and later questions find them there;
  - "unconstrained": a pool that holds everything (no warm tier);
  - with --staged, also "offloaded, staged": the offloaded engine with offload="staged", the
    path CUDA takes (far blocks staged per layer into a buffer instead of read in place), to show what
    those copies cost here.
For each: time to first token of the first question and of the later ones, decode ms/token, bytes moved
per tier, the most hot blocks in use at once, and whether the two engines' answers agree. The engines
alternate (A B A B) and each figure is the median over the repeats; ratios are what to compare.

The engines run as an application gets them, through `AsyncEngine.stream` with the core in a process of its own;
one more run of each, the engine core alone on this thread (benchmarks/serving.py), gives the most hot blocks in use
at any step and its own times beside the stream's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path

from tieredkv import EngineConfig

sys.path.insert(0, str(Path(__file__).parent))
from serving import Served  # noqa: E402

QUESTIONS = ["Which city hosts the most projects?", "Summarise the budget of project 12.",
             "Who leads project 40?", "List three projects that started before 2001.",
             "Which project has the smallest team?"]
PEOPLE = ["Ana", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
TOPICS = ["bridge repair", "water meters", "school meals", "bus routes", "solar roofs", "library hours",
          "street lights", "tree planting", "flood maps", "bike lanes", "clinic software", "market stalls"]
CITIES = ["Porto", "Bergen", "Cusco", "Aswan", "Darwin", "Cuenca", "Tartu", "Hue", "Thies", "Boise"]


def document(tokenizer, target_tokens: int, seed: int = 7) -> str:
    """Project notes, every line different, grown until the chat turn is about target_tokens long."""
    rng = random.Random(seed)
    lines, i = ["Notes on the city's projects."], 0
    while True:
        i += 1
        lines.append(f"Project {i}: {rng.choice(TOPICS)} in {rng.choice(CITIES)}, led by {rng.choice(PEOPLE)} "
                     f"since {rng.randrange(1990, 2024)}, team of {rng.randrange(2, 40)}, budget "
                     f"{rng.randrange(10, 900)} thousand.")
        if i % 5 == 0 and len(tokenizer.apply_chat_template(chat("\n".join(lines), ""))) >= target_tokens:
            return "\n".join(lines)


def chat(doc: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]


async def run(label: str, cfg: EngineConfig, prompts: list[list[int]], max_tokens: int, mode: str) -> dict:
    """The questions one after the other on a fresh engine; each one's TTFT, decode ms/token, tokens and cached
    tokens by tier, the bytes each tier moved and (the core alone) the most hot blocks in use at any step."""
    engine = await Served.start(cfg, mode)
    peak = [0]
    if engine.core is not None:
        pool = engine.core.pool

        def watch() -> None:
            peak[0] = max(peak[0], pool.num_blocks - pool.num_free)

        engine.after_step = watch
    try:
        answers = []
        for prompt in prompts:
            got = await engine.serve([(prompt, max_tokens)])
            answers.append({"ttft_s": got.ttft(), "decode_ms": got.ms_per_token(skip=0), "tokens": got.tokens[0],
                            "cached": {k: v for k, v in got.usage[0].cached_tokens_by_tier.items() if v}})
        stats = engine.stats()
    finally:
        await engine.close()
    block_bytes = stats.kv_bytes_per_token * cfg.block_size
    moved = {name: {"demoted_MB": t.demotions * block_bytes / 1e6, "promoted_MB": t.promotions * block_bytes / 1e6}
             for name, t in stats.tiers.items()}
    return {"label": label, "answers": answers, "moved": moved, "peak_hot_blocks": peak[0] or None,
            "hot_blocks": stats.blocks_total, "blocks_offloaded": stats.blocks_offloaded,
            "preemptions": stats.num_preemptions}


async def main(args) -> dict:
    configs = {
        "offloaded": EngineConfig(compile_in_background=False, num_blocks=64, warm_bytes=1 << 30),
        "unconstrained": EngineConfig(compile_in_background=False, kv_cache_bytes=1 << 30, warm_bytes=0),
    }
    if args.staged:
        configs["offloaded, staged"] = configs["offloaded"].model_copy(update={"offload": "staged"})
    from tieredkv.models.gguf_convert import default_model_dir
    from tieredkv.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_dir())
    doc = document(tokenizer, args.tokens)
    prompts = [tokenizer.apply_chat_template(chat(doc, q)) for q in QUESTIONS[: args.questions]]
    print(f"document + question: {len(prompts[0])} tokens; {len(prompts)} questions; {args.max_tokens} new each")
    runs: dict[str, list[dict]] = {name: [] for name in configs}  # through the stream
    alone: dict[str, dict] = {}  # the core alone, once each
    for r in range(args.repeats + 1):
        mode = "stream" if r < args.repeats else "core alone"
        for name, cfg in configs.items():
            res = await run(name, cfg, prompts, args.max_tokens, mode)
            if mode == "stream":
                runs[name].append(res)
            else:
                alone[name] = res
            a = res["answers"]
            print(f"  [{mode}] {name:17s} first TTFT {a[0]['ttft_s']:6.2f} s, later TTFT "
                  f"{statistics.median(x['ttft_s'] for x in a[1:]):6.3f} s, decode "
                  f"{statistics.median(x['decode_ms'] for x in a):5.1f} ms/token, peak hot blocks "
                  f"{res['peak_hot_blocks']}/{res['hot_blocks']}", flush=True)
    out = {"prompt_tokens": len(prompts[0]), "questions": len(prompts), "max_tokens": args.max_tokens}
    for name, results in runs.items():
        out[name] = {
            "first_ttft_s": statistics.median(r["answers"][0]["ttft_s"] for r in results),
            "later_ttft_s": statistics.median(x["ttft_s"] for r in results for x in r["answers"][1:]),
            "decode_ms_per_token": statistics.median(x["decode_ms"] for r in results for x in r["answers"]),
            "moved": results[-1]["moved"], "peak_hot_blocks": alone[name]["peak_hot_blocks"],
            "hot_blocks": results[-1]["hot_blocks"], "blocks_offloaded": results[-1]["blocks_offloaded"],
            "preemptions": results[-1]["preemptions"],
            "cached_tokens_by_tier": [x["cached"] for x in results[-1]["answers"]],
            "core_alone": {"first_ttft_s": alone[name]["answers"][0]["ttft_s"],
                           "later_ttft_s": statistics.median(x["ttft_s"] for x in alone[name]["answers"][1:]),
                           "decode_ms_per_token": statistics.median(x["decode_ms"] for x in alone[name]["answers"])},
        }
    off, big = out["offloaded"], out["unconstrained"]
    every = {name: [*runs[name], alone[name]] for name in configs}
    out["same_answers"] = all(a["tokens"] == b["tokens"] for name in configs if name != "unconstrained"
                              for ra, rb in zip(every[name], every["unconstrained"])
                              for a, b in zip(ra["answers"], rb["answers"]))
    out["ratios"] = {
        "decode_offloaded_vs_unconstrained": off["decode_ms_per_token"] / big["decode_ms_per_token"],
        "first_ttft_offloaded_vs_unconstrained": off["first_ttft_s"] / big["first_ttft_s"],
        "later_vs_first_ttft_speedup_offloaded": off["first_ttft_s"] / off["later_ttft_s"],
        "later_vs_first_ttft_speedup_unconstrained": big["first_ttft_s"] / big["later_ttft_s"],
    }
    if args.staged:
        staged = out["offloaded, staged"]
        out["ratios"]["decode_staged_vs_unconstrained"] = staged["decode_ms_per_token"] / big["decode_ms_per_token"]
        out["ratios"]["first_ttft_staged_vs_unconstrained"] = staged["first_ttft_s"] / big["first_ttft_s"]
    print(json.dumps(out["ratios"], indent=2), "\nsame answers:", out["same_answers"])
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=6000, help="document length (tokens, with the chat turn)")
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--staged", action="store_true", help="also run the staged far-block path (CUDA's)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
