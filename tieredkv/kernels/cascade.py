"""Shared-prefix (cascade) decode attention, plain torch: decode sequences whose block tables start with
the same physical blocks attend to that shared prefix together, reading its K/V once per step for the
whole group (one batched matrix product over every query of the group), then each to its own suffix;
the two halves are merged by log-sum-exp, which equals attention over the whole context up to fp32
rounding."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tieredkv.kernels.kv_format import KVLayout, select_blocks, values

# The rule (benchmarks/bench_cascade.py): grouping pays once a group shares this much, this often.
MIN_GROUP = 2  # sequences
MIN_PREFIX_TOKENS = 64


def shared_prefixes(tables: list[list[int]], lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """(rows, shared full blocks) for the groups of decode rows whose tables start with the same blocks,
    where grouping pays (MIN_GROUP rows sharing MIN_PREFIX_TOKENS). Rows are taken in the order of their
    tables, so rows with long common prefixes are neighbours; a row that would shorten its group's
    prefix below the minimum starts a new group. A shared block is full and computed: the token being
    decoded is never in one (a shared partial block is copied before it is written)."""
    min_blocks = -(-MIN_PREFIX_TOKENS // block_size)
    usable = {r: tables[r][: (lens[r] - 1) // block_size] for r in range(len(tables))}
    groups: list = []
    rows: list[int] = []
    common = 0

    def close():
        if len(rows) >= MIN_GROUP and common >= min_blocks:
            groups.append((sorted(rows), common))

    for r in sorted(usable, key=lambda r: usable[r]):
        if rows:
            first = usable[rows[0]]
            n = 0
            while n < min(common, len(usable[r])) and usable[r][n] == first[n]:
                n += 1
            if n >= min_blocks:
                rows.append(r)
                common = n
                continue
            close()
        rows, common = [r], len(usable[r])
    if rows:
        close()
    return groups


@dataclass
class CascadePlan:
    """Every cascade group of a step, batched: groups padded to the most members and the longest shared
    prefix, members' suffixes padded to the longest; the masks hide the padding."""

    rows: torch.Tensor  # [M] batch positions of all members, group by group
    slots: torch.Tensor  # [M] each member's position in the padded [groups x max members] layout
    members: torch.Tensor  # [groups * max_members] batch rows in that layout (padding repeats a member)
    prefix_ids: torch.Tensor  # [groups * max_prefix_blocks] shared blocks (padding: block 0, masked)
    prefix_mask: torch.Tensor  # [groups, 1, 1, max_prefix] additive
    suffix_ids: torch.Tensor  # [M * max_suffix_blocks] each member's remaining blocks
    suffix_mask: torch.Tensor  # [M, 1, 1, max_suffix] additive
    prefix_runs: list[tuple[int, int] | None]  # per group: (first block, blocks) when its prefix is one run
    prefix_lens: list[int]  # per group: shared tokens
    num_groups: int
    max_members: int
    max_prefix_blocks: int
    suffix_blocks: int
    suffix_len: int


def plan_cascades(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, dtype: torch.dtype,
                  prefixes: list[tuple[list[int], int]], host_lens: list[int] | None = None,
                  host_tables: list[list[int]] | None = None) -> CascadePlan | None:
    if not prefixes:
        return None
    dev, bs = block_tables.device, block_size
    max_members = max(len(rows) for rows, _ in prefixes)
    max_blocks = max(n for _, n in prefixes)
    host_tables = block_tables.tolist() if host_tables is None else host_tables
    host_lens = context_lens.tolist() if host_lens is None else host_lens
    rows, slots, members, prefix_ids, prefix_keep, suffix_starts, runs = [], [], [], [], [], [], []
    for g, (group_rows, n) in enumerate(prefixes):
        ids = list(host_tables[group_rows[0]][:n])
        runs.append((ids[0], n) if ids == list(range(ids[0], ids[0] + n)) else None)
        rows += group_rows
        slots += [g * max_members + i for i in range(len(group_rows))]
        members += group_rows + [group_rows[0]] * (max_members - len(group_rows))
        prefix_ids += ids + [0] * (max_blocks - n)
        prefix_keep.append(n * bs)
        suffix_starts += [n] * len(group_rows)
    idx = torch.tensor(rows, device=dev)
    starts = torch.tensor(suffix_starts, device=dev)
    suffix = context_lens[idx] - starts * bs
    length = max(host_lens[r] - s * bs for r, s in zip(rows, suffix_starts))
    nb = -(-length // bs)
    cols = starts[:, None] + torch.arange(nb, device=dev)[None, :]
    tables = torch.gather(block_tables[idx], 1, cols.clamp(max=block_tables.shape[1] - 1).to(torch.int64))

    def additive(past: torch.Tensor) -> torch.Tensor:
        return torch.zeros(past.shape, dtype=dtype, device=dev).masked_fill_(past, float("-inf"))[:, None, None, :]

    keep = torch.tensor(prefix_keep, device=dev)
    return CascadePlan(
        rows=idx, slots=torch.tensor(slots, device=dev), members=torch.tensor(members, device=dev),
        prefix_ids=torch.tensor(prefix_ids, device=dev),
        prefix_mask=additive(torch.arange(max_blocks * bs, device=dev)[None, :] >= keep[:, None]),
        suffix_ids=tables.reshape(-1),
        suffix_mask=additive(torch.arange(length, device=dev)[None, :] >= suffix[:, None]),
        prefix_runs=runs, prefix_lens=prefix_keep, num_groups=len(prefixes), max_members=max_members,
        max_prefix_blocks=max_blocks, suffix_blocks=nb, suffix_len=length)


def cascade_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, c: CascadePlan,
                      scale: float, kv: KVLayout | None = None) -> torch.Tensor:
    """Decode attention [M, Hq, D] for every cascade member (rows c.rows): each group's shared prefix read
    once for all its queries, each member's suffix apart, the two merged by their log-sum-exps. The
    prefix works in the padded group layout [groups, Hkv, members * G, D]: one attention per group over
    a view of its blocks (no copy when they are one run). With the fused attention (attend_lse), no
    score matrix is materialised; else the matrix-product version below. `kv`: the caches' formats where they
    do not hold the compute dtype (kernels/kv_format.py: what is gathered is dequantized)."""
    if not fused_attention_usable():
        return _cascade_attention_matmul(query, key_cache, value_cache, c, scale, kv)
    hkv, d = key_cache.shape[2], query.shape[2]
    ng, nm, m = c.num_groups, c.max_members, c.rows.shape[0]
    group = query.shape[1] // hkv
    qg = query[c.members].view(ng, nm, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(ng, hkv, nm * group, d)
    kp, vp = _prefix_kv(key_cache, c, kv, 0), _prefix_kv(value_cache, c, kv, 1)  # per group [P_g, Hkv, D]
    op, lp = qg.new_empty(ng, hkv, nm * group, d), qg.new_empty(ng, hkv, nm * group)
    for g in range(ng):
        op[g], lp[g] = attend_lse(qg[g], kp[g].transpose(0, 1), vp[g].transpose(0, 1), scale, None)
    op = op.view(ng, hkv, nm, group, d).transpose(1, 2).reshape(ng * nm, hkv, group, d)[c.slots]  # [M, Hkv, G, D]
    lp = lp.view(ng, hkv, nm, group).transpose(1, 2).reshape(ng * nm, hkv, group)[c.slots]
    q = query[c.rows].view(m, hkv, group, d)
    ks = select_blocks(key_cache, c.suffix_ids, kv, 0).view(m, -1, hkv, d)[:, : c.suffix_len].transpose(1, 2)
    vs = select_blocks(value_cache, c.suffix_ids, kv, 1).view(m, -1, hkv, d)[:, : c.suffix_len].transpose(1, 2)
    os_, ls = attend_lse(q, ks, vs, scale, c.suffix_mask)
    return merge_lse(op, lp, os_, ls).reshape(m, hkv * group, d)


def merge_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets, from each one's output [..., D] and log-sum-exp [...]."""
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top)[..., None], torch.exp(l2 - top)[..., None]
    return (o1 * w1 + o2 * w2) / (w1 + w2)


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """q [..., M, D], k/v [..., L, D] (3 or 4 dims) -> (out [..., M, D], lse [..., M]); `mask` additive,
    broadcast to the scores. Through torch's fused CPU attention (one pass, softmax in registers) where
    fused_attention_usable(), else matrix products."""
    if q.is_cpu and q.dtype == torch.float32 and fused_attention_usable():
        squeeze = q.dim() == 3
        if squeeze:
            q, k, v = q[None], k[None], v[None]
            mask = mask if mask is None or mask.dim() == 2 else mask[None]  # the op takes 2-D or 4-D masks
        out, lse = _FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return (out[0], lse[0]) if squeeze else (out, lse)
    return _attend(q, k, v, scale, mask)


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@functools.cache
def fused_attention_usable() -> bool:
    """True when this torch build has the fused CPU attention that also returns the log-sum-exp (an
    internal op, so used only after it agrees with the matrix-product version here)."""
    if _FLASH is None:
        return False
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen) for n in (5, 7, 7))
    mask = torch.zeros(2, 1, 1, 7).masked_fill_(torch.arange(7) >= 5, float("-inf"))
    try:
        out, lse = _FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=0.3)
    except (RuntimeError, NotImplementedError):
        return False
    want, want_lse = _attend(q, k, v, 0.3, mask)
    return torch.allclose(out, want, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5)


def _cascade_attention_matmul(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              c: CascadePlan, scale: float, kv: KVLayout | None = None) -> torch.Tensor:
    """cascade_attention through plain matrix products: the prefix products per (group, KV head) straight
    on the gathered blocks (a [P, D] slice with a row stride), one softmax over prefix and suffix."""
    hkv, d = key_cache.shape[2], query.shape[2]
    ng, nm, m = c.num_groups, c.max_members, c.rows.shape[0]
    group = query.shape[1] // hkv
    qg = query[c.members].view(ng, nm, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(ng, hkv, nm * group, d)
    kp, vp = _prefix_kv(key_cache, c, kv, 0), _prefix_kv(value_cache, c, kv, 1)  # per group [P_g, Hkv, D]
    sp = qg.new_zeros(ng, hkv, nm * group, c.max_prefix_blocks * key_cache.shape[1])
    for g in range(ng):
        for h in range(hkv):
            torch.mm(qg[g, h], kp[g][:, h].t(), out=sp[g, h, :, : kp[g].shape[0]])
    sp = (sp * scale + c.prefix_mask).view(ng, hkv, nm, group, -1)
    # suffixes, member by member, moved into the group layout (padding members: -inf, weight 0)
    q = query[c.rows].view(m, hkv, group, d)
    ks = select_blocks(key_cache, c.suffix_ids, kv, 0).view(m, -1, hkv, d)[:, : c.suffix_len].transpose(1, 2)
    vs = select_blocks(value_cache, c.suffix_ids, kv, 1).view(m, -1, hkv, d)[:, : c.suffix_len].transpose(1, 2)
    ss = torch.matmul(q, ks.transpose(-1, -2)) * scale + c.suffix_mask  # [M, Hkv, G, Ls]
    ss_g = ss.new_full((ng * nm, hkv, group, c.suffix_len), float("-inf"))
    ss_g[c.slots] = ss
    ss_g = ss_g.view(ng, nm, hkv, group, -1).transpose(1, 2)  # [groups, Hkv, members, G, Ls]
    top = torch.maximum(sp.amax(-1), ss_g.amax(-1))[..., None]
    pp, ps = torch.exp(sp - top), torch.exp(ss_g - top)
    total = pp.sum(-1) + ps.sum(-1)  # [groups, Hkv, members, G]
    out = qg.new_empty(ng, hkv, nm * group, d)
    pp = pp.view(ng, hkv, nm * group, -1)
    for g in range(ng):
        for h in range(hkv):
            torch.mm(pp[g, h, :, : vp[g].shape[0]], vp[g][:, h], out=out[g, h])
    out = out.view(ng, hkv, nm, group, d).transpose(1, 2).reshape(ng * nm, hkv, group, d)[c.slots]
    ps = ps.transpose(1, 2).reshape(ng * nm, hkv, group, -1)[c.slots]  # back to members: [M, Hkv, G, Ls]
    out = out + torch.matmul(ps, vs)
    total = total.transpose(1, 2).reshape(ng * nm, hkv, group)[c.slots]
    return (out / total[..., None]).reshape(m, hkv * group, d)


def _prefix_kv(cache: torch.Tensor, c: CascadePlan, kv: KVLayout | None = None, side: int = 0) -> list[torch.Tensor]:
    """Each group's shared K or V as [P_g, Hkv, D] values: a view of the pool where the blocks are one run (no
    copy at all, for a cache in the compute dtype), else one gather."""
    hkv = cache.shape[2]
    gathered = None
    out = []
    for g, run in enumerate(c.prefix_runs):
        if run is not None:
            out.append(values(cache[run[0] : run[0] + run[1]], kv, side).flatten(0, 1))
            continue
        if gathered is None:
            blocks = select_blocks(cache, c.prefix_ids, kv, side)
            gathered = blocks.view(c.num_groups, -1, hkv, blocks.shape[-1])
        out.append(gathered[g, : c.prefix_lens[g]])
    return out


def prefill_cascade_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              block_tables: torch.Tensor, starts: list[int], lens: list[int], scale: float,
                              rows: list[int], prefix_blocks: int,
                              kv: KVLayout | None = None) -> dict[int, torch.Tensor]:
    """Prefill chunks of several sequences that follow one cached prefix (a burst of new conversations):
    every chunk's queries against the shared prefix in one product (its K/V read once), each chunk
    against its own keys after it (causal), merged by log-sum-exp. Returns {row: [q_len, Hq, D]}."""
    bs, hkv, d = key_cache.shape[1], key_cache.shape[2], query.shape[2]
    p = prefix_blocks * bs
    ids = block_tables[rows[0], :prefix_blocks]
    kp = select_blocks(key_cache, ids, kv, 0).view(p, hkv, d).transpose(0, 1)  # [Hkv, P, D]
    vp = select_blocks(value_cache, ids, kv, 1).view(p, hkv, d).transpose(0, 1)
    chunks = [query[starts[r] : starts[r + 1]] for r in rows]
    group = query.shape[1] // hkv
    qs = torch.cat(chunks).view(-1, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)  # [Hkv, Tq*G, D]
    op, lp = attend_lse(qs, kp, vp, scale, None)
    op = op.view(hkv, -1, group, d).permute(1, 0, 2, 3)  # [Tq, Hkv, G, D]
    lp = lp.view(hkv, -1, group).permute(1, 0, 2)  # [Tq, Hkv, G]
    out, at = {}, 0
    for r, q in zip(rows, chunks):
        q_len, ctx = q.shape[0], lens[r]
        own = ctx - p
        nb = -(-own // bs)
        tbl = block_tables[r, prefix_blocks : prefix_blocks + nb]
        k = select_blocks(key_cache, tbl, kv, 0).view(nb * bs, hkv, d)[:own].transpose(0, 1)  # [Hkv, own, D]
        v = select_blocks(value_cache, tbl, kv, 1).view(nb * bs, hkv, d)[:own].transpose(0, 1)
        pos = torch.arange(q_len, device=q.device)[:, None] + (own - q_len)
        mask = torch.zeros(q_len, own, dtype=q.dtype, device=q.device).masked_fill_(
            torch.arange(own, device=q.device)[None, :] > pos, float("-inf"))
        qh = q.view(q_len, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, q_len * group, d)
        mask = mask[:, None, :].expand(q_len, group, own).reshape(q_len * group, own)
        oo, lo = attend_lse(qh, k, v, scale, mask)
        oo = oo.view(hkv, q_len, group, d).permute(1, 0, 2, 3)
        lo = lo.view(hkv, q_len, group).permute(1, 0, 2)
        out[r] = merge_lse(op[at : at + q_len], lp[at : at + q_len], oo, lo).reshape(q_len, hkv * group, d)
        at += q_len
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """q [..., M, D], k/v [..., L, D] -> (out [..., M, D], lse [..., M])."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse
