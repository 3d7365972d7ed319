"""Paged attention for prefill chunks: each chunk attends causally to its cached prefix and to itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tieredkv.kernels.calls import record
from tieredkv.kernels.cascade import prefill_cascade_attention
from tieredkv.kernels.decode_attention import gather_kv
from tieredkv.kernels.kv_format import KVLayout


def prefill_attention_ref(
    query: torch.Tensor,  # [T, Hq, D], sequences packed back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], already holding this chunk's K
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B + 1] int32 offsets into T
    context_lens: torch.Tensor,  # [B] int32 totals: cached prefix + this chunk
    scale: float,
    max_query_len: int | None = None,
    plan: list[tuple[list[int], int]] | None = None,
    kv: KVLayout | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Plain-torch reference. Query j of a chunk of length q sits at position context_len - q + j.
    `plan` lists groups of chunks that follow the same cached blocks (cascade.shared_prefixes): their
    queries meet the shared prefix in one product (cascade.prefill_cascade_attention). `kv`: the caches'
    formats where they do not hold the compute dtype (kernels/kv_format.py)."""
    record("prefill attention", "torch reference")
    out = torch.empty_like(query)
    query_start_loc = query_start_loc.tolist()
    lens = context_lens.tolist()
    grouped = set()
    if plan:
        record("prefill attention", "cascade")
    for rows, blocks in plan or ():
        parts = prefill_cascade_attention(query, key_cache, value_cache, block_tables, query_start_loc, lens, scale,
                                          rows, blocks, kv)
        for r, o in parts.items():
            out[query_start_loc[r] : query_start_loc[r + 1]] = o
        grouped.update(rows)
    for i, ctx in enumerate(lens):
        if i in grouped:
            continue
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        k = gather_kv(key_cache, block_tables[i : i + 1], ctx, kv, 0)  # [1, Hkv, ctx, D]
        v = gather_kv(value_cache, block_tables[i : i + 1], ctx, kv, 1)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if ctx == q_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            rows = torch.arange(q_len, device=query.device)[:, None] + (ctx - q_len)
            mask = torch.arange(ctx, device=query.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out
