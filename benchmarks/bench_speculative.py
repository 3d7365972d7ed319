"""Speculative decoding (prompt lookup) on input-grounded tasks and on open chat, beside plain decoding and
beside llama.cpp's server with and without its own n-gram speculation, on the same file and prompts.

    .venv/bin/python benchmarks/bench_speculative.py [--weights fp32 gguf] [--batch 1 8 32] [--draft]
        [--tasks repeat quote edit answer chat] [--mixed ROUNDS] [--llama-server BIN --gguf FILE ...] [--json F]

Default model, greedy, stopping at EOS (at most --max-tokens). Tasks, each a chat turn built on text of its own:
  - repeat: "Repeat the following text exactly" and a passage (the model copies it nearly word for word);
  - quote: project notes (~1,000 tokens, or --doc-tokens), "copy the lines about projects i..j exactly";
  - edit: a passage with one name to be replaced everywhere;
  - answer: project notes and a question to answer in the document's words;
  - chat: an open question with nothing to copy (speculation must cost little here).
Each engine variant runs every task at batch 1 (one request after another) and at each --batch size above 1
(that many requests of the task at once), through `AsyncEngine.stream` with the core in a process of its own (what
an application gets; benchmarks/serving.py), and reports output tokens a second,
the acceptance, and whether its greedy tokens equal plain decoding's. With --draft, also the default model's own
Q4_1 file as a draft model for its fp32 weights. Engines are built once and alternate per
task (plain, speculative), so the ratios come from one sitting. llama-server runs the same prompts (token ids)
with --parallel 8, plain and with --spec-type ngram-simple / ngram-map-k (n=3, m=8: its best here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_longdoc import document  # noqa: E402
from llama_server import llama_server  # noqa: E402

from serving import Served  # noqa: E402

from tieredkv import EngineConfig  # noqa: E402
from tieredkv.platform.cpu_features import cpu_info  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DRAFT = {"method": "draft", "model": "default", "quantization": "gguf", "num_speculative_tokens": 4}
PASSAGES = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years, presses operated in "
    "more than two hundred cities across Europe, and millions of books had been printed. The spread of printed "
    "material lowered the cost of books, encouraged literacy, and allowed scientific results to be shared and "
    "checked by readers far from their authors.",
    "Bees communicate the location of food through a waggle dance performed on the comb. The angle of the dance "
    "relative to vertical shows the direction of the food relative to the sun, and the length of the waggle run "
    "shows the distance. Other bees follow the dancer, learn the route, and fly out to the flowers themselves. The "
    "dance changes through the day as the sun moves across the sky.",
    "A lighthouse keeper's day started before dawn. The keeper trimmed the wick, polished the lens, and wound the "
    "clockwork that turned the light. Logs recorded the weather, passing ships and every repair. In storms the "
    "keeper stayed awake all night, watching the flame and listening to the sea against the rocks below the tower.",
    "The city library opens at nine on weekdays and at ten on Saturdays. Members may borrow up to twelve books for "
    "three weeks and renew them twice online. Study rooms can be booked a week ahead for up to two hours. The "
    "children's section holds story time every Wednesday afternoon, and the reading garden is open in summer.",
]
CHAT = ["Write a short poem about autumn rain.", "What are three tips for learning to cook?",
        "Describe a dragon who loves tea.", "Why do people enjoy music?"]


def tasks(tokenizer, doc_tokens: int = 1000) -> dict[str, list[list[dict]]]:
    """Each task's chat turns, four of each (different texts, so that batched requests share no answer)."""
    def turn(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]
    notes = [document(tokenizer, doc_tokens, seed=s) for s in range(4)]
    return {
        "repeat": [turn("Repeat the following text exactly, with nothing else:\n\n" + p) for p in PASSAGES],
        "quote": [turn(f"{d}\n\nCopy the lines about projects {3 + i} to {6 + i} exactly, with nothing else.")
                  for i, d in enumerate(notes)],
        "edit": [turn("Rewrite the following text with every 'the' replaced by 'a', changing nothing else:\n\n" + p)
                 for p in PASSAGES],
        "answer": [turn(f"{d}\n\nQuestion: who leads project {5 + i}, where, and with what budget? Answer with the "
                        "document's own words.") for i, d in enumerate(notes)],
        "chat": [turn(q) for q in CHAT],
    }


async def run(engine: Served, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], int, int]:
    """All prompts at once to the end; (output tokens a second, outputs, drafts, accepted drafts)."""
    got = await engine.serve([(p, max_tokens) for p in prompts], ignore_eos=False)
    return (got.tok_s(), got.tokens, sum(u.draft_tokens for u in got.usage),
            sum(u.accepted_draft_tokens for u in got.usage))


async def measure(engines: dict, prompts: dict[str, list[list[int]]], batches: list[int], max_tokens: int) -> dict:
    results: dict = {}
    for task, ps in prompts.items():
        for batch in batches:
            groups = [[p] for p in ps] if batch == 1 else [(ps * batch)[:batch]]
            for name, engine in engines.items():
                for g in groups:  # the prompt computed once before: decode is what is timed
                    await run(engine, g[:1], 1)
                tok_s, outs, drafted, accepted = [], [], 0, 0
                for g in groups:
                    rate, out, d, a = await run(engine, g, max_tokens)
                    tok_s.append(rate)
                    outs.extend(out)
                    drafted, accepted = drafted + d, accepted + a
                row = results.setdefault(f"{task} @ {batch}", {})
                row[name] = {"tok_s": sum(tok_s) / len(tok_s), "tokens": sum(map(len, outs)),
                             "acceptance": accepted / drafted if drafted else None, "outputs": outs}
            base = next(iter(row.values()))
            for name, r in row.items():
                r["same_as_plain"] = r["outputs"] == base["outputs"]
                r["vs_plain"] = r["tok_s"] / base["tok_s"]
            print(f"{task} @ {batch}: " + ", ".join(
                f"{n} {r['tok_s']:.1f} tok/s ({r['vs_plain']:.2f}x" + (f", accept {r['acceptance']:.2f}"
                                                                    if r["acceptance"] is not None else "")
                + ("" if r["same_as_plain"] else ", DIFFERS") + ")" for n, r in row.items()), flush=True)
    for row in results.values():
        for r in row.values():
            del r["outputs"]
    return results


async def run_llama(binary: str, gguf: str, prompts: dict[str, list[list[int]]], batches: list[int],
                    max_tokens: int, spec: list[str]) -> dict:
    """llama.cpp's server on the same prompts (token ids), --parallel 8; spec: its speculation flags."""
    results = {}
    async with llama_server(binary, gguf, *spec, context=8 * 4096) as (session, url):
        async def one(prompt, n):
            body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "cache_prompt": True}
            async with session.post(f"{url}/completion", json=body) as r:
                out = await r.json()
            t = out.get("timings", {})
            return out.get("tokens_predicted", 0), t.get("draft_n", 0), t.get("draft_n_accepted", 0)

        for task, ps in prompts.items():
            for batch in batches:
                groups = [[p] for p in ps] if batch == 1 else [(ps * batch)[:batch]]
                for g in groups:
                    await one(g[0], 1)
                rates, drafted, accepted = [], 0, 0
                for g in groups:
                    t0 = time.perf_counter()
                    got = await asyncio.gather(*(one(p, max_tokens) for p in g))
                    rates.append(sum(x[0] for x in got) / (time.perf_counter() - t0))
                    drafted += sum(x[1] for x in got)
                    accepted += sum(x[2] for x in got)
                results[f"{task} @ {batch}"] = {"tok_s": sum(rates) / len(rates),
                                                "acceptance": accepted / drafted if drafted else None}
    return results


async def mixed(engines: dict, rounds: int) -> dict:
    """bench_engine.py's mixed workload (32 requests at once, prompts of 64-512 random tokens, 16-128 new tokens,
    EOS ignored): nothing to copy, and more sequences than disable_by_batch_size until the batch drains; the
    engines alternate, output tok/s over every round."""
    from bench_engine import make_requests

    reqs = make_requests(32, next(iter(engines.values())).vocab_size)
    rates: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, engine in engines.items():
            rates.setdefault(name, []).append((await engine.serve(reqs)).tok_s())
    base = sum(rates["plain"])
    out = {name: {"tok_s": sum(v) / len(v), "vs_plain": sum(v) / base} for name, v in rates.items()}
    print("mixed 32: " + ", ".join(f"{n} {r['tok_s']:.1f} tok/s ({r['vs_plain']:.2f}x)" for n, r in out.items()),
          flush=True)
    return out


async def main(args) -> dict:
    random.seed(0)
    out = {"machine": cpu_info().describe(torch.get_num_threads()), "speculative": SPEC, "engine": {}}
    if args.draft:
        out["draft"] = DRAFT
    for weights in args.weights:
        quant = {"fp32": {}, "gguf": {"quantization": "gguf"},
                 "gguf-int8act": {"quantization": "gguf", "int8_activations": True}}[weights]
        cfg = dict(compile_in_background=False, warm_bytes=0, max_model_len=8192 if args.doc_tokens > 3000 else 4096,
                   num_blocks=40 * 256 // 16 * 4, max_num_seqs=max(args.batch), **quant)
        engines = {"plain": await Served.start(EngineConfig(**cfg)),
                   "ngram": await Served.start(EngineConfig(**cfg, speculative=SPEC))}
        if args.draft and weights == "fp32":  # the Q4_1 file drafting for its own fp32 weights
            engines["Q4_1 self-draft"] = await Served.start(EngineConfig(**cfg, speculative=DRAFT))
        tok = engines["plain"].tokenizer
        prompts = {t: [tok.apply_chat_template(m) for m in ms] for t, ms in tasks(tok, args.doc_tokens).items()
                   if t in args.tasks}
        print(f"weights {weights}: decode path {engines['plain'].stats().decode_path}", flush=True)
        out["engine"][weights] = await measure(engines, prompts, args.batch, args.max_tokens) if prompts else {}
        if args.mixed:
            out.setdefault("mixed", {})[weights] = await mixed(engines, args.mixed)
        for engine in engines.values():
            await engine.close()
    if args.llama_server:
        out["llama.cpp"] = {}
        for gguf in args.gguf:
            for label, flags in (("plain", []), ("ngram-simple", ["--spec-type", "ngram-simple"]),
                                 ("ngram-map-k n3 m8", ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n",
                                                        "3", "--spec-ngram-map-k-size-m", "8"])):
                name = f"{Path(gguf).name} {label}"
                res = await run_llama(args.llama_server, gguf, prompts, args.batch, args.max_tokens, flags)
                out["llama.cpp"][name] = res
                print(name + ": " + ", ".join(f"{k} {v['tok_s']:.1f}" for k, v in res.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", nargs="+", default=["fp32", "gguf"], choices=["fp32", "gguf", "gguf-int8act"],
                        help="gguf-int8act: the Q4_1 file with int8_activations (VNNI tiles)")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--tasks", nargs="*", default=["repeat", "quote", "edit", "answer", "chat"])
    parser.add_argument("--doc-tokens", type=int, default=1000,
                        help="the project notes' length in the quote and answer tasks (up to ~7,800)")
    parser.add_argument("--draft", action="store_true", help="also a draft-model engine (fp32 weights only)")
    parser.add_argument("--mixed", type=int, default=0, help="also bench_engine.py's mixed 32, this many rounds")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    parser.add_argument("--gguf", nargs="*", default=[], help="GGUF files for llama-server")
    parser.add_argument("--json", help="write the results here")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    asyncio.run(main(parser.parse_args()))
