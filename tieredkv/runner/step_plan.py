"""A step's plan as data, which rank 0 of a tensor-parallel group broadcasts and the other ranks run: the
scheduled sequences reduced to what the model runner reads of them."""

from __future__ import annotations

from typing import Sequence

from tieredkv.core.sequence import step_tokens
from tieredkv.models.lora import LoRAAdapter
from tieredkv.tiers.block_pool import KVBlock


def adapter_of(seq) -> LoRAAdapter | None:
    """The LoRA adapter a sequence's rows take (None: the base model; a warm-up row has none; a tensor-parallel
    rank's stand-in carries its own)."""
    request = getattr(seq, "request", None)
    return getattr(seq, "adapter", None) if request is None else request.adapter


def describe(scheduled: list) -> list[tuple]:
    """A step's plan as data: per scheduled sequence (computed tokens, tokens this step, its length, the step's
    token ids (drafts after its own), its block ids, its LoRA adapter's name or None)."""
    return [(s.num_computed_tokens, n, s.num_tokens, s.step_token_ids(n), [b.block_id for b in s.block_table],
             getattr(adapter_of(s), "name", None)) for s, n in scheduled]


class StandIn:
    """What the model runner reads of a sequence, from plain values (token ids before the step's are never read)."""

    def __init__(self, num_computed: int, num_tokens: int, token_ids: list[int], block_ids: list[int],
                 spec_tokens: Sequence[int] = (), adapter=None):
        self.num_computed_tokens, self.num_tokens, self.token_ids = num_computed, num_tokens, token_ids
        self.block_table = [KVBlock(i) for i in block_ids]
        self.spec_tokens = list(spec_tokens)
        self.adapter = adapter  # this rank's part of the sequence's LoRA adapter (models/lora.py), or None

    def step_token_ids(self, n: int) -> list[int]:
        return step_tokens(self.token_ids, self.spec_tokens, self.num_computed_tokens, n)


def rebuild(plan: list[tuple], adapter=lambda name: None) -> list[tuple[StandIn, int]]:
    """The stand-ins of a plan; `adapter(name)`: this rank's adapter of that name."""
    return [(StandIn(c, t, [0] * c + ids[: t - c], blocks, ids[t - c :], None if a is None else adapter(a)), n)
            for c, n, t, ids, blocks, a in plan]
