"""Paged attention for decode: one query token per sequence, K/V read through block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tieredkv.kernels.calls import record
from tieredkv.kernels.cascade import CascadePlan, cascade_attention, plan_cascades
from tieredkv.kernels.kv_format import CPU_FORMATS, KVLayout, select_blocks

# One more group (two gathers and an SDPA call per layer) costs about as much as attending this many
# extra key positions in one sequence, on CPU (tens of microseconds of call overhead per group vs
# about half a microsecond per key position for 9 heads of 64); 64 to 512 measured alike here.
GROUP_CALL_COST = 256


def length_groups(lens: tuple[int, ...], block_size: int) -> tuple[tuple[int, ...], ...]:
    """Split a batch into groups attended together, each padded to its longest member.

    Padding every sequence to the batch's longest context wastes up to most of the work when lengths
    spread widely (a 64-token and a 640-token sequence decode side by side). Sequences are sorted by
    length and cut into consecutive runs that minimise sum(group size * group max length) plus
    GROUP_CALL_COST per group, by dynamic programming over the distinct lengths in blocks. Returns the
    groups as tuples of batch positions, in ascending length. Called once per step (see plan_decode).
    """
    order = sorted(range(len(lens)), key=lens.__getitem__)
    padded = [-(-lens[i] // block_size) * block_size for i in order]
    cuts = [i for i in range(1, len(padded)) if padded[i] != padded[i - 1]] + [len(padded)]  # run ends
    best = [0.0] + [float("inf")] * len(cuts)  # best[j]: cost of covering the first j runs
    prev = [0] * (len(cuts) + 1)
    for j in range(1, len(cuts) + 1):
        end, width = cuts[j - 1], padded[cuts[j - 1] - 1]
        for i in range(j):
            start = cuts[i - 1] if i else 0
            cost = best[i] + GROUP_CALL_COST + (end - start) * width
            if cost < best[j]:
                best[j], prev[j] = cost, i
    groups, j = [], len(cuts)
    while j:
        i = prev[j]
        start = cuts[i - 1] if i else 0
        groups.append(tuple(order[start : cuts[j - 1]]))
        j = i
    return tuple(reversed(groups))


@dataclass
class _Group:
    rows: slice | torch.Tensor  # batch positions of the group
    ids: torch.Tensor  # [n * num_blocks] block ids to gather
    num_blocks: int
    length: int  # keys attended: the group's longest context
    mask: torch.Tensor | None  # [n, 1, 1, length] additive (0 or -inf), None when all contexts in the group are equal


@dataclass
class DecodePlanRef:
    """One step's decode attention plan: length groups of the sequences attended alone, and cascade
    groups of sequences that share a prefix (see kernels/cascade.py)."""

    groups: list[_Group]
    cascades: CascadePlan | None
    alone: torch.Tensor | None = None  # with cascades: the batch positions of the other rows (the groups' rows)


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, dtype: torch.dtype,
                prefixes: list[tuple[list[int], int]] | None = None, host_lens: list[int] | None = None,
                host_tables: list[list[int]] | None = None) -> DecodePlanRef:
    """The groups, gather ids and masks of one step's decode batch, made once (ModelRunner.prepare puts it
    in the batch) and shared by its layers. Masks are additive in the query's dtype: SDPA would
    otherwise convert a boolean mask in every layer. `prefixes` (cascade.shared_prefixes) are attended
    as cascades; the other rows by length group. `host_lens` / `host_tables`: the same as host lists, when
    the caller has them (nothing is then read back from the device)."""
    cascades = plan_cascades(block_tables, context_lens, block_size, dtype, prefixes, host_lens,
                             host_tables) if prefixes else None
    in_cascade = {r for rows, _ in prefixes or () for r in rows}
    lens = context_lens.tolist() if host_lens is None else list(host_lens)
    alone = [i for i in range(len(lens)) if i not in in_cascade]
    plan = []
    for members in length_groups(tuple(lens[i] for i in alone), block_size) if alone else ():
        group = tuple(alone[j] for j in members)
        first, last_row = group[0], group[-1]
        if list(group) == list(range(first, last_row + 1)):  # a run of the batch (the runner sorts by length)
            rows: slice | torch.Tensor = slice(first, last_row + 1)
        else:
            rows = torch.tensor(group, device=block_tables.device)
        group_lens = [lens[i] for i in group]
        length = max(group_lens)
        num_blocks = -(-length // block_size)
        mask = None
        if min(group_lens) != length:
            positions = torch.arange(length, device=context_lens.device)
            past = positions[None, :] >= context_lens[rows][:, None].to(positions.dtype)
            mask = torch.zeros(past.shape, dtype=dtype, device=past.device).masked_fill_(past, float("-inf"))
            mask = mask[:, None, None, :]
        plan.append(_Group(rows, block_tables[rows, :num_blocks].reshape(-1), num_blocks, length, mask))
    return DecodePlanRef(plan, cascades, torch.tensor(alone, device=block_tables.device) if cascades else None)


def _gather(cache: torch.Tensor, ids: torch.Tensor, batch: int, num_blocks: int, length: int,
            kv: KVLayout | None = None, side: int = 0) -> torch.Tensor:
    """[num_blocks, bs, H, row] cache -> [batch, H, length, D] values (a strided view of one gathered copy)."""
    gathered = select_blocks(cache, ids, kv, side)  # [batch * nb, bs, H, D]
    return gathered.view(batch, num_blocks * cache.shape[1], *gathered.shape[2:])[:, :length].transpose(1, 2)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int, kv: KVLayout | None = None,
              side: int = 0) -> torch.Tensor:
    """[num_blocks, bs, H, row] cache, [B, max_blocks] tables -> [B, H, length, D] K (side 0) or V (side 1)
    values (a strided view)."""
    num_blocks = -(-length // cache.shape[1])
    ids = block_tables[:, :num_blocks].reshape(-1)
    return _gather(cache, ids, block_tables.shape[0], num_blocks, length, kv, side)


def decode_attention_ref(
    query: torch.Tensor,  # [B, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int, >= 1
    scale: float,
    max_context_len: int | None = None,
    plan: DecodePlanRef | None = None,
    kv: KVLayout | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Plain-torch reference: the query attends to the first context_lens[b] cached tokens of its sequence.
    Sequences of similar length are attended together (see length_groups), as `plan` (plan_decode's,
    made here when None) says; `max_context_len` is a hint the Triton kernel uses and this reference
    does not need. `kv`: the caches' formats where they do not hold the compute dtype (rows of
    kernels/kv_format.py: gathered, then dequantized)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if plan is None:
        plan = plan_decode(block_tables, context_lens, key_cache.shape[1], query.dtype)
    record("decode attention", "torch reference")
    whole = plan.cascades is None and len(plan.groups) == 1 and isinstance(plan.groups[0].rows, slice)  # in order
    out = None if whole else torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if plan.cascades is not None:
        record("decode attention", "cascade")
        out[plan.cascades.rows] = cascade_attention(query, key_cache, value_cache, plan.cascades, scale, kv)
    for g in plan.groups:
        q = query[g.rows]
        n = q.shape[0]
        k = _gather(key_cache, g.ids, n, g.num_blocks, g.length, kv, 0)  # [n, Hkv, L, D]
        v = _gather(value_cache, g.ids, n, g.num_blocks, g.length, kv, 1)
        q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # query heads grouped by KV head
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale).reshape(n, num_heads, head_dim)
        if out is None:
            return o
        out[g.rows] = o
    return out


def decode_attention_dense(
    query: torch.Tensor,  # [B, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int: every row's first W blocks (padding entries may be any valid block)
    context_lens: torch.Tensor,  # [B] int, >= 1
    scale: float,
    max_context_len: int | None = None,
    plan: object = None,
    kv: KVLayout | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """The same attention as decode_attention_ref written without a Python decision that depends on the
    data: every row attends over its table's W blocks with the positions at or past its length masked.
    It traces into one graph whatever the batch and the table width (the compiled decode path,
    compiled_decode.py), and costs B * W * block_size key positions, so it suits small batches."""
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = block_tables.shape[1], key_cache.shape[1], key_cache.shape[2]
    record("decode attention", "dense (masked)")
    ids = block_tables.reshape(-1).to(torch.int64)
    k = select_blocks(key_cache, ids, kv, 0).view(batch, num_blocks * block_size, num_kv_heads, head_dim)
    v = select_blocks(value_cache, ids, kv, 1).view(batch, num_blocks * block_size, num_kv_heads, head_dim)
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    # both products as broadcast multiplies and sums rather than einsum's batched matmuls: inductor fuses them
    # with the gather above into its own loops, where each bmm was a library call costing more than its few
    # thousand multiply-adds (AMD EPYC, default model, compiled decode: fp32 56.9 -> 53.0 ms/token at 128
    # tokens of context, 80.7 -> 73.1 at 2,000; int4 20.8 -> 19.2)
    scores = (q[:, :, :, None, :] * k.float().permute(0, 2, 1, 3)[:, :, None]).sum(-1) * scale  # [B, Hkv, G, N]
    past = torch.arange(num_blocks * block_size, device=query.device)[None, :] >= context_lens[:, None]
    scores = scores.masked_fill(past[:, None, None, :], float("-inf"))
    out = (scores.softmax(dim=-1)[..., None] * v.float().permute(0, 2, 1, 3)[:, :, None]).sum(-2)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def paged_decode_usable(query: torch.Tensor, key_cache: torch.Tensor, kv: KVLayout | None = None) -> bool:
    """True where the CPU kernel (attention_cpu.c, as torch.ops.tieredkv.paged_decode) takes this attention:
    caches on CPU, contiguous, in a format it reads (every one but fp8), shapes within its limits, and the
    operator bound (at start, or by the compiled decode path before its trace; kernels/quant_cpu.py: CpuLibrary)."""
    from tieredkv.kernels.quant_cpu import CPU

    return (key_cache.device.type == "cpu" and key_cache.dtype in PAGED_DTYPES
            and (kv is None or max(kv.codes) <= CPU_FORMATS) and key_cache.is_contiguous()
            and cpu_attention_fits(query.shape[1], key_cache.shape[2], query.shape[2]) and CPU.operators_bound)


PAGED_MAX_GROUP, PAGED_MAX_HEAD_DIM = 32, 256  # attention_cpu.c: ATT_MAX_G, ATT_MAX_D


def cpu_attention_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """The CPU attention kernels take these heads (attention_cpu.c: tkv_attention_fits): whole groups of at most
    PAGED_MAX_GROUP query heads a KV head, head dims up to PAGED_MAX_HEAD_DIM."""
    return heads % kv_heads == 0 and heads // kv_heads <= PAGED_MAX_GROUP and head_dim <= PAGED_MAX_HEAD_DIM
PAGED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)


def _formats(kv: KVLayout | None) -> tuple[int, int]:
    """paged_decode's k_format, v_format (-1: from the caches' dtype)."""
    return (-1, -1) if kv is None else kv.kernel_codes


def decode_attention_compiled(query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len=None,
                              plan=None, kv: KVLayout | None = None) -> torch.Tensor:
    """The compiled decode path's attention: the CPU kernel where it serves (one call a layer from the graph's
    C++ wrapper: each position read once, where it lies), else decode_attention_dense. Decided as the graph
    is traced. The scale multiplies the query in the graph (what the kernel does first): a float argument to
    the operator would be a symbolic float that dynamo can only specialize by tracing again."""
    if paged_decode_usable(query, key_cache, kv):
        record("decode attention", "CPU kernel")
        q = query.float() * scale  # fp32, as the kernel would scale it
        out = torch.ops.tieredkv.paged_decode(q, key_cache, value_cache, block_tables, context_lens, 1.0,
                                              *_formats(kv))
        return out.to(query.dtype)
    return decode_attention_dense(query, key_cache, value_cache, block_tables, context_lens, scale, kv=kv)


def decode_attention_cpu(query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len=None,
                         plan: DecodePlanRef | None = None, kv: KVLayout | None = None) -> torch.Tensor:
    """decode_attention_ref's contract on CPU: the rows that share a prefix as cascades (the plan's), the others
    in one call of the CPU kernel, with no gather and no padding; decode_attention_ref where the kernel does not
    serve."""
    if not paged_decode_usable(query, key_cache, kv):
        return decode_attention_ref(query, key_cache, value_cache, block_tables, context_lens, scale,
                                    max_context_len, plan, kv)
    formats = _formats(kv)
    paged = torch.ops.tieredkv.paged_decode
    if plan is None or plan.cascades is None:
        record("decode attention", "CPU kernel")
        return paged(query, key_cache, value_cache, block_tables, context_lens, scale, *formats)
    record("decode attention", "cascade")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    out[plan.cascades.rows] = cascade_attention(query, key_cache, value_cache, plan.cascades, scale, kv)
    rows = plan.alone
    if rows.numel():
        record("decode attention", "CPU kernel")
        out[rows] = paged(query[rows], key_cache, value_cache, block_tables[rows], context_lens[rows], scale,
                          *formats)
    return out
