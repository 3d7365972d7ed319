"""Copy whole KV blocks: inside the pool (copy-on-write) and between the pool and a staging buffer."""

from __future__ import annotations

import torch


def copy_blocks_ref(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache [L, 2, num_blocks, ...]: block dst[i] <- block src[i] in every layer, for K and V."""
    kv_cache[:, :, dst] = kv_cache[:, :, src]


def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [n, L, 2, block_size, H, D] <- the blocks block_ids of kv_cache [L, 2, num_blocks, block_size, H, D]."""
    out.copy_(kv_cache[:, :, block_ids].permute(2, 0, 1, 3, 4, 5))


def scatter_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Inverse of gather: kv_cache blocks block_ids <- src [n, L, 2, block_size, H, D]."""
    kv_cache[:, :, block_ids] = src.permute(1, 2, 0, 3, 4, 5).to(kv_cache.device, kv_cache.dtype)
