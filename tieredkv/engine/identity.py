"""The model fingerprint: everything that changes what a block's bytes mean. It seeds the hash chain and keys
the cold tier, the remote tier and snapshots, so that a block is only served to an engine that computes it
the same."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from tieredkv.kernels.kv_format import KVLayout
from tieredkv.models.digest import weights_digest
from tieredkv.models.loader import QuantSettings, weight_files

KV_LAYOUT = "L2NBHD"  # kv_cache[layer, k|v, block, slot, kv_head, dim]


def model_identity(model_dir: Path, quant: QuantSettings | None = None, cache_dir: Path | None = None) -> str:
    """What the model computes, as 64 hex digits: config.json's bytes (rope parameters, norms, sizes) and a
    digest of every byte of the weights it reads (models/digest.py: hashed once per checkpoint, then
    kept), the GGUF file's too where the weights come from one."""
    files = weight_files(model_dir)
    if quant is not None and quant.gguf_path is not None:
        files = files + [quant.gguf_path]
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    h.update(weights_digest(files, cache_dir).encode())
    return h.hexdigest()


def model_fingerprint(model_dir: Path, dtype: torch.dtype, block_size: int, quant: QuantSettings | None = None,
                      cache_dir: Path | None = None, identity: str | None = None, kv: KVLayout | None = None) -> str:
    """Everything that changes the meaning of a block's bytes: the model's identity (model_identity, unless
    given), dtype, block size, layout, the K/V formats where the cache does not hold the compute dtype (`kv`:
    a block stored at int8 is never served to an engine that stores fp32), and the weights' quantization
    (quantized weights compute other keys and values). Two engines share cold, remote and snapshot entries
    only when their fingerprints match."""
    identity = identity or model_identity(model_dir, quant, cache_dir)
    weights = "" if quant is None else f"|w={quant.fingerprint}"
    formats = "" if kv is None or kv.plain else f"|kv={kv.identity}"
    return f"{identity}|{dtype}|bs={block_size}|{KV_LAYOUT}{formats}{weights}"


def identity_in_background(model_dir: Path, quant: QuantSettings | None, cache_dir: Path | None) -> Future:
    """model_identity on a thread of its own (the first start of a checkpoint reads every byte of its weights,
    which the load reads too, through the same page cache); the future holds it, or its error."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredkv-digest")
    try:
        return pool.submit(model_identity, model_dir, quant, cache_dir)
    finally:
        pool.shutdown(wait=False)
