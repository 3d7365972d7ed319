"""Where each block of a chain is now, read-only: the one walk over the pool and the tiers below it."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from tieredkv.hashing import BlockHash, BlockKey, chain_keys
from tieredkv.tiers.base import KVTier
from tieredkv.tiers.block_pool import BlockPool, KVBlock
from tieredkv.tiers.lookup import Lookup
from tieredkv.tiers.manager import TierManager


class CacheIndex:
    """Answers "which tier holds each block of this chain": the pool first (hot blocks, and far blocks of
    running sequences, which live in warm), then each lower tier, top to bottom. The scheduler's prefix
    lookup walks it (`pool_prefix`, then `start_lookup` below the pool, read in the background where a
    tier blocks); explain, snapshots and pins ask it at once (`where`, `hot_prefix`, `read`). Changes
    nothing: no reference taken, no LRU order touched, nothing promoted. O(blocks) per call, plus one
    tier query per block not in the pool.
    """

    def __init__(self, pool: BlockPool, tiers: TierManager, root: BlockHash, block_size: int):
        self.pool = pool
        self.tiers = tiers
        self.root = root
        self.block_size = block_size

    def keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """The chained keys of token_ids' full blocks."""
        return chain_keys(self.root, token_ids, self.block_size)

    def where(self, keys: Sequence[BlockKey], verify: bool = False) -> list[str | None]:
        """Per key, the highest tier holding its block ("hot", "warm", "remote", "cold"), or None. With `verify`, a
        tier that checks entries when reading them (the cold tier's MAC) checks this one too: an entry
        that would fail counts as absent."""
        out: list[str | None] = []
        for key in keys:
            block = self.pool.get_cached(*key)
            if block is not None:
                out.append(self.pool.tier_of(block))
            else:
                out.append(next((t.name for t in self.tiers.lower if _holds(t, key, verify)), None))
        return out

    def pool_prefix(self, keys: Iterable[BlockKey]) -> list[KVBlock]:
        """The pool's blocks of the leading keys (hot ones, and far blocks in use), stopping at the first
        key it does not hold."""
        return self.pool.cached_prefix(keys)

    def start_lookup(self, keys: list[BlockKey], start: int) -> Lookup | None:
        """Looks keys[start:] up in the tiers below the pool, head first; None when none of them holds
        keys[start] (tiers/lookup.py)."""
        return self.tiers.start_lookup(keys, start)

    def hot_prefix(self, keys: Sequence[BlockKey]) -> list[KVBlock]:
        """The hot blocks of the leading keys, stopping at the first key not hot."""
        return self.pool.cached_prefix(keys, hot_only=True)

    def read(self, key: BlockKey) -> torch.Tensor | None:
        """A host copy of the key's block [layers, 2, block_size, kv_heads, head_dim] from the highest tier
        that holds it, or None."""
        block = self.pool.get_cached(*key)
        if block is not None:
            return self.tiers.read_blocks([block.block_id])[0]
        for tier in self.tiers.lower:
            data = tier.get_sync([key])
            if data is not None:
                return data[0]
        return None


def _holds(tier: KVTier, key: BlockKey, verify: bool) -> bool:
    inspect = getattr(tier, "inspect_sync", None)
    if verify and inspect is not None:
        return inspect(key) == "ok"
    return tier.contains_sync([key]) == 1
