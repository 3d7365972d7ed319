"""Keys stored less their mean: what lets 4-bit keys keep attention's answers.

Softmax does not change when every score of one query moves by the same amount, and a query's scores over keys
k_i - mu move by exactly q . mu: so any vector mu may be taken from every key of a layer's KV head before it is
stored, and attention reads the stored keys as they are, in every path (decode, prefill, cascade, far blocks,
the native step), with nothing added back. Llama-family keys carry a large mean in a few channels (the same sign
at nearly every token: the slow rotary pairs), which sets each row's range at 4 bits and leaves the varying part
a few codes; less the mean, the codes go to what varies. Measured on the default model (int4 KV over its Q4_1
weights, 4,096 tokens of Python's documentation, benchmarks/bench_quant_quality.py's text, Q4_0's levels):
perplexity +8.5% of fp32 KV's unshifted, +2.4% shifted; KL to fp32 KV's distribution 0.053 -> 0.032
(docs/guide/kv-cache.md, Quality).

The mean is the model's, per layer, KV head and channel, measured once at start: the keys of CALIBRATION_TOKENS
tokens of English prose (the Python documentation's topics, which every Python carries, read from the end so that
the quality benchmark's text is not among them), computed in the compute dtype over a scratch cache that holds
it (no codes) and rounded to fp16, then kept under the cache directory (shift_file: the model's identity, its
quantization, the compute dtype and device, the rank), so that a restart reads it (the default model's
measurement takes ~1.5 s on 2 cores) and stores its keys as the last run did. Engines on other machines shift by
the same vector up to the last bits of their arithmetic (another thread count, another processor), which moves a
query's scores over another engine's blocks by q . (mu - mu'), far below the codes' own error: a block stored by
one engine is read by another (the model fingerprint names the shift, kv_format.KVLayout.identity). Under tensor
parallelism each rank measures its own heads in one forward all ranks take together."""

from __future__ import annotations

import hashlib
import logging
import os
import random
from dataclasses import replace
from pathlib import Path

import torch

from tieredkv.models.llama import LlamaModel

log = logging.getLogger(__name__)

VERSION = 1  # of the calibration (its text, tokens and passages): a new one measures again
CALIBRATION_TOKENS = 1024
PASSAGE = 512  # calibration tokens a sequence: positions 0-511, as the perplexity runs score


def calibration_text() -> str:
    """English prose every Python install carries: the documentation's topics, last first."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python without its documentation data: calibration_ids falls back to random ids
        return ""
    parts: list[str] = []
    for key in sorted(topics, reverse=True):
        parts.append(topics[key])
        if sum(map(len, parts)) > 8 * CALIBRATION_TOKENS:  # more characters than the tokens take
            break
    return "\n\n".join(parts)


def calibration_ids(encode, vocab_size: int) -> list[int]:
    """CALIBRATION_TOKENS token ids of calibration_text (`encode`: the tokenizer's), or of a seeded random draw where
    that text is missing."""
    text = calibration_text()
    ids = encode(text)[:CALIBRATION_TOKENS] if text else []
    if len(ids) < CALIBRATION_TOKENS // 2:
        rng = random.Random(0)
        ids = [rng.randrange(vocab_size) for _ in range(CALIBRATION_TOKENS)]
    return ids


def measure_key_shift(model: LlamaModel, ops, block_size: int, ids: list[int], dtype: torch.dtype,
                      device: torch.device) -> None:
    """Sets each attention layer's `k_shift` [kv_heads, head_dim] to the mean of its keys over `ids` (one
    forward at the compute dtype `dtype` over a scratch cache on `device`; `ops`: the kernel set for a cache that
    holds that dtype), in passages of PASSAGE tokens. Every rank of a tensor-parallel group calls it with the same
    ids, at the same point of its start."""
    from tieredkv.runner.model_runner import ModelRunner
    from tieredkv.runner.step_plan import StandIn

    attn = [layer.self_attn for layer in model.layers]
    seqs = [ids[i:i + PASSAGE] for i in range(0, len(ids), PASSAGE)]
    per = -(-PASSAGE // block_size)
    blocks = per * len(seqs)
    cache = torch.zeros((len(attn), 2, blocks + 1, block_size, attn[0].num_kv_heads, attn[0].head_dim),
                        dtype=dtype, device=device)
    sums: list[torch.Tensor] = []

    def store_kv(k, v, layer_cache, slots, **kw):
        sums.append(k.float().sum(0))
        ops.store_kv(k, v, layer_cache, slots, **kw)

    for a in attn:
        a.k_shift = None
    runner = ModelRunner(model, cache, block_size, replace(ops, store_kv=store_kv), cascade=False)
    with torch.inference_mode():
        runner.forward_rows([(StandIn(0, len(c), c, list(range(i * per, (i + 1) * per))), len(c))
                             for i, c in enumerate(seqs)])
    for a, total in zip(attn, sums):
        a.k_shift = (total / len(ids)).half().to(dtype)
    log.info("int4 keys: each layer's key mean over %d tokens taken from every key stored", len(ids))


def shift_key(identity: str, quant: str | None, dtype: torch.dtype, device: torch.device) -> str:
    """What a measured shift depends on: the model (model_identity), its weights' quantization, the compute dtype
    and the device type, and this calibration."""
    text = f"{identity}|{quant}|{dtype}|{device.type}|v{VERSION}/{CALIBRATION_TOKENS}/{PASSAGE}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def shift_file(cache_dir: Path, key: str, rank: int, world: int) -> Path:
    return cache_dir / "key-shift" / f"{key}-rank{rank}of{world}.pt"


def save_key_shift(model: LlamaModel, path: Path) -> None:
    """Each layer's shift to `path` (written beside it, then renamed into place: a reader never sees half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save([layer.self_attn.k_shift.cpu() for layer in model.layers], tmp)
    os.replace(tmp, path)


def load_key_shift(model: LlamaModel, path: Path, dtype: torch.dtype, device: torch.device) -> None:
    """Each layer's shift as save_key_shift kept it; ValueError where the file does not fit the model."""
    shifts = torch.load(path, weights_only=True)
    layers = [layer.self_attn for layer in model.layers]
    if len(shifts) != len(layers) or any(s.shape != (a.num_kv_heads, a.head_dim) for s, a in zip(shifts, layers)):
        raise ValueError(f"{path} holds key shifts of another shape than this model's")
    for a, shift in zip(layers, shifts):
        a.k_shift = shift.to(device, dtype)
