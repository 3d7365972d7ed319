"""Hot tier: the accelerator's block pool seen through the storage interface."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from tieredkv.kernels import KernelOps
from tieredkv.tiers.base import BlockKey, KVTier
from tieredkv.tiers.block_io import BlockIO
from tieredkv.tiers.block_pool import BlockPool, KVBlock


class HotTier(KVTier):
    """Cached blocks of the pool (ref_cnt 0 ones are evictable). Its bytes move as block ops (`io`, tiers/block_io.py:
    under tensor parallelism every rank holds its heads of each block, and what comes out or goes in is whole
    blocks, as with one process).

    Besides the tier contract, the tier manager reads and writes it by block id (`gather`, `scatter`, `copy`, or
    the ops themselves): hot is the tier whose index is the block pool itself.
    """

    name = "hot"

    def __init__(self, pool: BlockPool, kv_cache: torch.Tensor, ops: KernelOps, io: BlockIO | None = None):
        self.pool = pool
        self.kv_cache = kv_cache
        self.ops = ops
        self.io = io if io is not None else BlockIO(kv_cache, ops)
        self.block_bytes = self.io.whole_bytes(kv_cache[:, :, 0].numel() * kv_cache.element_size())
        super().__init__(pool.num_blocks * self.block_bytes)

    def lookup(self, keys: Sequence[BlockKey]) -> list[KVBlock]:
        return self.pool.cached_prefix(keys, hot_only=True)

    def contains_sync(self, keys: Sequence[BlockKey]) -> int:
        return len(self.lookup(keys))

    def get_sync(self, keys: Sequence[BlockKey]) -> torch.Tensor | None:
        blocks = self.lookup(keys)
        if not blocks:
            return None
        self.pool.touch(blocks)  # a read makes them the most recently used
        self.pool.free(reversed(blocks))
        return self.gather([b.block_id for b in blocks]).cpu()

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks [n, layers, 2, block_size, kv_heads, head_dim] on the pool's device."""
        return self.io.gather_now(block_ids)

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        self.io.scatter(block_ids, blocks)

    def copy(self, src_ids: list[int], dst_ids: list[int]) -> None:
        self.io.copy(src_ids, dst_ids)

    def put_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        """Writes the blocks into freshly allocated pool blocks, cached and immediately evictable."""
        have = {k.block_hash for k in keys if k.block_hash in self.pool.cached}  # hot, or far (in use)
        new = [i for i, k in enumerate(keys) if k.block_hash not in have]
        new = new[: self.pool.num_free]
        if new:
            fresh, _ = self.pool.allocate(len(new))  # cached blocks evicted here are dropped, not demoted
            self.scatter([b.block_id for b in fresh], blocks[new])
            for i, block in zip(new, fresh):
                self.pool.cache(block, keys[i].block_hash, keys[i].token_ids)
            self.pool.free(reversed(fresh))
        return len(have) + len(new)

    def remove_sync(self, keys: Sequence[BlockKey]) -> int:
        """Forgets the keys whose blocks are not in use."""
        n = 0
        for key in keys:
            block = self.pool.get_cached(key.block_hash, key.token_ids)
            if block is not None and block.ref_cnt == 0:
                self.pool.uncache(block)
                n += 1
        return n

    def clear_sync(self) -> int:
        """Forgets every cached block that is not in use."""
        return self.pool.evict_all_cached()

    def export_sync(self, batch: int) -> Iterator[tuple[list[BlockKey], torch.Tensor]]:
        blocks = [b for b in self.pool.cached.values() if not self.pool.is_far(b)]
        for i in range(0, len(blocks), batch):
            part = blocks[i : i + batch]
            yield [BlockKey(b.block_hash, b.token_ids) for b in part], self.gather([b.block_id for b in part]).cpu()

    def _used_bytes(self) -> int:
        """Blocks holding data, in use by a sequence or cached for reuse."""
        pool = self.pool
        return (pool.num_blocks - pool.num_free + pool.num_cached_free) * self.block_bytes
