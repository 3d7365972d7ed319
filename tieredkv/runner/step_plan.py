"""A step's plan as data, which rank 0 of a tensor-parallel group broadcasts and the other ranks run: the
scheduled sequences reduced to what the model runner reads of them."""

from __future__ import annotations

from types import SimpleNamespace

from tieredkv.tiers.block_pool import KVBlock


def describe(scheduled: list) -> list[tuple]:
    """A step's plan as data: per scheduled sequence (computed tokens, tokens this step, its length, the step's
    token ids, its block ids)."""
    return [(s.num_computed_tokens, n, s.num_tokens, s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n],
             [b.block_id for b in s.block_table]) for s, n in scheduled]


def stand_in(num_computed: int, num_tokens: int, token_ids: list[int], block_ids: list[int]) -> SimpleNamespace:
    """What the model runner reads of a sequence, from plain values (token ids before the step's are never read)."""
    return SimpleNamespace(num_computed_tokens=num_computed, num_tokens=num_tokens, token_ids=token_ids,
                           block_table=[KVBlock(i) for i in block_ids])


def rebuild(plan: list[tuple]) -> list[tuple[SimpleNamespace, int]]:
    return [(stand_in(c, t, [0] * c + ids, blocks), n) for c, n, t, ids, blocks in plan]
