"""Paged attention for decode: one query token per sequence, K/V read through block tables."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] cache, [B, max_blocks] tables -> [B, H, length, D] contiguous K or V."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    batch = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1)
    gathered = torch.index_select(cache, 0, ids)  # [B * nb, bs, H, D]; faster than cache[ids] on CPU
    h, d = cache.shape[2], cache.shape[3]
    return gathered.view(batch, num_blocks * block_size, h, d)[:, :length].transpose(1, 2)


def decode_attention_ref(
    query: torch.Tensor,  # [B, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int, >= 1
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Plain-torch reference: the query attends to the first context_lens[b] cached tokens of its sequence."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    length = int(context_lens.max()) if max_context_len is None else max_context_len
    k = gather_kv(key_cache, block_tables, length)  # [B, Hkv, L, D]
    v = gather_kv(value_cache, block_tables, length)
    q = query.view(batch, num_kv_heads, group, head_dim)  # query heads grouped by their KV head
    mask = None  # one sequence attends to all `length` keys
    if batch > 1:
        positions = torch.arange(length, device=query.device)
        mask = (positions[None, :] < context_lens[:, None].to(positions.dtype))[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim)
