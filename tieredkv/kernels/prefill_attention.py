"""Paged attention for prefill chunks: each chunk attends causally to its cached prefix and to itself."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from tieredkv.kernels.calls import record
from tieredkv.kernels.cascade import prefill_cascade_attention
from tieredkv.kernels.decode_attention import cpu_attention_fits, gather_kv
from tieredkv.kernels.kv_format import CPU_FORMATS, FLOAT_FORMATS, KVLayout, rotates


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
    return _attend(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, plan, kv,
                   _alone_ref)


def prefill_attention_cpu(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                          max_query_len=None, plan=None, kv: KVLayout | None = None) -> torch.Tensor:
    """prefill_attention_ref's contract on CPU: the chunks that share cached blocks (the plan's) as cascades, the
    others in one call of the CPU kernel (attention_cpu.c: tkv_prefill_attention, each sequence's keys and values
    read from their blocks once per KV head and met by tiles of the chunk's queries as small matrix products);
    the reference where the kernel does not take the shapes or the caches' formats (int4's turned rows)."""
    if not prefill_kernel_takes(query, key_cache, kv):
        return prefill_attention_ref(query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                                     scale, max_query_len, plan, kv)
    return _attend(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, plan, kv,
                   _alone_cpu)


def prefill_kernel_takes(query: torch.Tensor, key_cache: torch.Tensor, kv: KVLayout | None) -> bool:
    """The CPU kernel serves: caches on CPU, contiguous, in a format it reads (not fp8, not int4's turned rows),
    shapes within its limits, the kernels loaded."""
    from tieredkv.kernels.quant_cpu import CPU

    heads, kv_heads, dim = query.shape[1], key_cache.shape[2], query.shape[2]
    if CPU.lib is None or key_cache.device.type != "cpu" or not key_cache.is_contiguous() or dim % PREFILL_WIDTH:
        return False
    if kv is not None and key_cache.dtype == torch.uint8:
        if max(kv.codes) > CPU_FORMATS or rotates(kv.k, dim) or rotates(kv.v, dim):
            return False
    elif key_cache.dtype not in FLOAT_FORMATS:
        return False
    return cpu_attention_fits(heads, kv_heads, dim)


PREFILL_WIDTH = 16  # the head dims the kernel takes are whole vectors of its widest build (attention_cpu.c: PF_W)


def _attend(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, plan, kv,
            alone) -> torch.Tensor:
    """The plan's groups as cascades, then `alone` for the other sequences (their indices)."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    grouped: set[int] = set()
    if plan:
        record("prefill attention", "cascade")
    for rows, blocks in plan or ():
        parts = prefill_cascade_attention(query, key_cache, value_cache, block_tables, starts, lens, scale,
                                          rows, blocks, kv)
        for r, o in parts.items():
            out[starts[r] : starts[r + 1]] = o
        grouped.update(rows)
    rest = [i for i in range(len(lens)) if i not in grouped]
    if rest:
        alone(query, key_cache, value_cache, block_tables, starts, lens, scale, kv, rest, out)
    return out


def _alone_ref(query, key_cache, value_cache, block_tables, starts, lens, scale, kv, rows, out) -> None:
    for i in rows:
        ctx, start, end = lens[i], starts[i], starts[i + 1]
        q_len = end - start
        k = gather_kv(key_cache, block_tables[i : i + 1], ctx, kv, 0)  # [1, Hkv, ctx, D]
        v = gather_kv(value_cache, block_tables[i : i + 1], ctx, kv, 1)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if ctx == q_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            pos = torch.arange(q_len, device=query.device)[:, None] + (ctx - q_len)
            mask = torch.arange(ctx, device=query.device)[None, :] <= pos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)


def _alone_cpu(query, key_cache, value_cache, block_tables, starts, lens, scale, kv, rows, out) -> None:
    """The sequences `rows` in one call of tkv_prefill_attention, which checks every block id it will read first."""
    from tieredkv.kernels.quant_cpu import CPU

    record("prefill attention", "CPU kernel")
    every = rows == list(range(len(lens)))
    tables = (block_tables if every else block_tables[rows]).to(torch.int32).contiguous()
    spans = [(starts[i], starts[i + 1]) for i in rows]
    q = (query if every else torch.cat([query[a:b] for a, b in spans])).float().contiguous()
    qstart = torch.tensor([0, *itertools.accumulate(b - a for a, b in spans)], dtype=torch.int32)
    seq_lens = torch.tensor([lens[i] for i in rows], dtype=torch.int32)
    formats = kv.codes if kv is not None and key_cache.dtype == torch.uint8 else (FLOAT_FORMATS[key_cache.dtype],) * 2
    direct = every and out.dtype == torch.float32 and out.is_contiguous()
    res = out if direct else torch.empty_like(q)
    status = CPU.lib.tkv_prefill_attention(
        q.data_ptr(), q.shape[1], q.shape[2], key_cache.data_ptr(), value_cache.data_ptr(),
        formats[0] | formats[1] << 4, key_cache.shape[3] * key_cache.element_size(), key_cache.shape[1],
        key_cache.shape[2], key_cache.shape[0], len(rows), tables.data_ptr(), tables.shape[1], qstart.data_ptr(),
        seq_lens.data_ptr(), scale, res.data_ptr())
    if status == -2:
        raise IndexError(f"prefill attention: a context reaches outside its block table or the cache's "
                         f"{key_cache.shape[0]} blocks")
    if status != 0:
        raise MemoryError("prefill attention: no memory for the keys and values laid out")
    if direct:
        return
    if every:
        out.copy_(res)
        return
    for (a, b), lo in zip(spans, qstart.tolist()):
        out[a:b] = res[lo : lo + b - a]
