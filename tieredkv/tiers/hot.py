"""Hot tier: the accelerator's block pool seen through the storage interface."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from tieredkv.kernels import KernelOps
from tieredkv.tiers.base import BlockKey, KVTier
from tieredkv.tiers.block_pool import BlockPool, KVBlock


class HotTier(KVTier):
    """Cached blocks of the pool (ref_cnt 0 ones are evictable). Data moves with the pool's kernels.

    Besides the tier contract, the tier manager reads and writes it by block id (`gather`, `scatter`,
    `scatter_runs`, `copy`): hot is the tier whose index is the block pool itself.
    """

    name = "hot"

    def __init__(self, pool: BlockPool, kv_cache: torch.Tensor, ops: KernelOps):
        self.pool = pool
        self.kv_cache = kv_cache
        self.ops = ops
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
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
        """[n, layers, 2, block_size, kv_heads, head_dim] on the pool's device."""
        return gather_blocks(self.kv_cache, self.ops, block_ids)

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        scatter_blocks(self.kv_cache, self.ops, block_ids, blocks)

    def scatter_runs(self, block_ids: list[int], runs: list[tuple[int, torch.Tensor]]) -> None:
        """Writes host views (SwapSpace.read_runs: (offset in block_ids, [n, ...] view)) into the blocks;
        from pinned memory each run is one asynchronous host-to-device copy on the current stream."""
        for offset, view in runs:
            self.scatter(block_ids[offset : offset + view.shape[0]], view)

    def copy(self, src_ids: list[int], dst_ids: list[int]) -> None:
        copy_blocks(self.kv_cache, self.ops, src_ids, dst_ids)

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


class ShardedHotTier(HotTier):
    """Rank 0's hot tier under tensor parallelism: every rank holds its heads of each block id
    (engine/ranks.py); a gather brings whole blocks to rank 0, a scatter sends each rank its heads, a copy
    runs on every rank. So the tiers below hold whole blocks, as with one process."""

    def __init__(self, pool: BlockPool, kv_cache: torch.Tensor, ops: KernelOps, leader, kv_heads: list[int]):
        self.leader, self.kv_heads = leader, kv_heads
        super().__init__(pool, kv_cache, ops)
        self.block_bytes = self.block_bytes * sum(kv_heads) // kv_heads[0]  # whole blocks, every rank's heads

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        self.leader.command("gather", block_ids)
        return self.leader.gather_heads(super().gather(block_ids), self.kv_heads)

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        self.leader.command("scatter", block_ids)
        mine = self.leader.scatter_heads(blocks, self.kv_heads, block_buffer(self.kv_cache, len(block_ids)))
        super().scatter(block_ids, mine)

    def copy(self, src_ids: list[int], dst_ids: list[int]) -> None:
        self.leader.command("copy", src_ids, dst_ids)
        super().copy(src_ids, dst_ids)

    def local_gather(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's heads of the blocks (the other ranks do the same on a command of their own)."""
        return HotTier.gather(self, block_ids)

    def local_scatter_runs(self, block_ids: list[int], runs: list[tuple[int, torch.Tensor]]) -> None:
        scatter_block_runs(self.kv_cache, self.ops, block_ids, runs)


def block_buffer(kv: torch.Tensor, n: int) -> torch.Tensor:
    """An uninitialised [n, layers, 2, block_size, kv_heads, head_dim] of kv's dtype and device."""
    return torch.empty((n, kv.shape[0], 2, *kv.shape[3:]), dtype=kv.dtype, device=kv.device)


def gather_blocks(kv: torch.Tensor, ops: KernelOps, block_ids: list[int]) -> torch.Tensor:
    """The blocks' data [n, layers, 2, block_size, kv_heads, head_dim], on kv's device."""
    out = block_buffer(kv, len(block_ids))
    ops.gather_blocks(kv, torch.tensor(block_ids, device=kv.device), out)
    return out


def scatter_blocks(kv: torch.Tensor, ops: KernelOps, block_ids: list[int], blocks: torch.Tensor) -> None:
    src = blocks.to(kv.device, kv.dtype, non_blocking=True).contiguous()
    ops.scatter_blocks(kv, torch.tensor(block_ids, device=kv.device), src)


def scatter_block_runs(kv: torch.Tensor, ops: KernelOps, block_ids: list[int],
                       runs: list[tuple[int, torch.Tensor]]) -> None:
    """scatter_blocks of each (offset in block_ids, [n, ...] view) run (SwapSpace.read_runs)."""
    for offset, view in runs:
        scatter_blocks(kv, ops, block_ids[offset : offset + view.shape[0]], view)


def copy_blocks(kv: torch.Tensor, ops: KernelOps, src_ids: list[int], dst_ids: list[int]) -> None:
    ops.copy_blocks(kv, torch.tensor(src_ids, device=kv.device), torch.tensor(dst_ids, device=kv.device))
