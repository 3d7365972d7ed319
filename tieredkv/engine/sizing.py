"""How big each part of the cache is: the hot pool's bytes and blocks, the warm tier's blocks and the far blocks'
extent (how attention reaches far blocks is core/far_blocks.py's far_policy). `tieredkv plan` sizes with these same
functions."""

from __future__ import annotations

import os

import torch

from tieredkv.config import EngineConfig
from tieredkv.kernels.kv_format import KVLayout
from tieredkv.models.spec import ModelSpec
from tieredkv.runner.far_stage import pool_share


WARM_CAP = 4 << 30  # the default warm tier's most bytes


CPU_POOL_CAP = 2 << 30  # the default CPU hot pool's most bytes (and at most an eighth of the memory)


def default_warm_bytes() -> int:
    """10% of the memory available now, at most WARM_CAP."""
    return _share_of_memory("SC_AVPHYS_PAGES")


def _share_of_memory(pages: str, part: int = 10) -> int:
    """1/part of the memory sysconf counts in `pages` (available, or physical), at most WARM_CAP."""
    try:
        memory = os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        memory = 8 << 30
    return min(memory // part, WARM_CAP)


def kv_pool_bytes(cfg: EngineConfig, device_type: str, total: int = 0, used: int = 0, token_bytes: int = 0,
                  max_len: int = 0, staged_layers: int = 0) -> int:
    """The hot pool's bytes, for the engine and `tieredkv plan` alike: kv_cache_bytes when given; on CUDA
    gpu_memory_utilization of the device's `total` memory less what is `used` (weights, and what else
    the engine measured or the plan estimated), less the staging buffers when far blocks are staged
    (`staged_layers`: the model's layers; 0 when they are not; runner/far_stage.py's pool_share); elsewhere
    cpu_kv_cache_bytes, or room for max_num_seqs sequences of `max_len` tokens of `token_bytes` each, at most
    CPU_POOL_CAP and an eighth of the memory."""
    if cfg.kv_cache_bytes is not None:
        return cfg.kv_cache_bytes
    if device_type == "cuda":
        return pool_share(int(total * cfg.gpu_memory_utilization) - used, staged_layers)
    if cfg.cpu_kv_cache_bytes is not None:
        return cfg.cpu_kv_cache_bytes
    return min(cfg.max_num_seqs * max_len * token_bytes, CPU_POOL_CAP, _share_of_memory("SC_PHYS_PAGES", 8))


def num_kv_blocks(cfg: EngineConfig, spec: ModelSpec, kv: KVLayout, device: torch.device,
                  max_len: int, staged_layers: int = 0) -> int:
    """num_blocks when given; else the blocks kv_pool_bytes holds, with the device's memory as measured
    now (the weights loaded), and room for staging far blocks of `staged_layers` (kv_pool_bytes)."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    block_bytes = kv_block_bytes(spec, cfg.block_size, kv)
    total = used = 0
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    budget = kv_pool_bytes(cfg, device.type, total, used, kv_token_bytes(spec, kv), max_len, staged_layers)
    num = budget // block_bytes
    if num < 2:
        raise ValueError(f"the KV cache budget ({budget} bytes) holds fewer than 2 blocks of {block_bytes} bytes")
    return num


def kv_token_bytes(spec: ModelSpec, kv: KVLayout) -> int:
    """One token's K and V over every layer and KV head, in the cache's formats (scales included)."""
    return kv.bytes_per_token(spec.num_layers, spec.num_kv_heads)


def kv_block_bytes(spec: ModelSpec, block_size: int, kv: KVLayout) -> int:
    """One block's K and V over every layer, in the cache's formats: the bytes every tier holds for it."""
    return kv_token_bytes(spec, kv) * block_size


def warm_blocks(cfg: EngineConfig, spec: ModelSpec, kv: KVLayout) -> int:
    """Blocks the warm tier's budget holds (warm_bytes, or default_warm_bytes())."""
    warm_bytes = default_warm_bytes() if cfg.warm_bytes is None else cfg.warm_bytes
    return warm_bytes // kv_block_bytes(spec, cfg.block_size, kv)


def far_extent(cfg: EngineConfig, spec: ModelSpec, kv: KVLayout) -> int:
    """Blocks the cache tensor's tail spans where far blocks are read in place: what warm_bytes holds, or
    with the default budget its bound from the machine's total memory (10% of it, at most WARM_CAP), so
    the tensor's shape (and the compiled graph that takes it) does not follow the memory free at start-up.
    The span beyond the warm tier is address space only: its pages are never touched."""
    budget = _share_of_memory("SC_PHYS_PAGES") if cfg.warm_bytes is None else cfg.warm_bytes
    return budget // kv_block_bytes(spec, cfg.block_size, kv)

