"""Far blocks: blocks of running sequences that live in the warm tier's slab instead of the hot pool."""

from __future__ import annotations

from typing import Iterable

from tieredkv.block_pool import KVBlock
from tieredkv.hashing import BlockHash
from tieredkv.tiers.base import BlockKey
from tieredkv.tiers.moves import Restore
from tieredkv.tiers.warm import WarmTier


class FarBlocks:
    """Lends warm slots to sequences whose KV outgrows the hot pool, as blocks of their block tables.

    A far block is a KVBlock whose `block_id` is `base + slot` (base: the hot pool's size). On CPU the
    engine makes the warm slab the tail of the cache tensor, layer-major, so the attention kernels read
    a far block in place by that id, exactly like a hot one; nothing is copied to attend to it. On CUDA
    the slab is pinned host memory and a step stages the far blocks it reads (far_stage.py).

    Far blocks have reference counts like hot ones (forks and other requests share them). In use, a
    slot is lent (the warm tier cannot evict it); a full block registered under its hash is findable
    through `by_hash`. When its last reference goes, the slot becomes a cached warm entry again (or
    free, without a hash), so a later request finds it below hot. Every method is O(1) per block.
    """

    def __init__(self, warm: WarmTier, base: int, pass_down):
        self.warm = warm
        self.base = base
        self._pass_down = pass_down  # (tier, victims): what the warm tier evicts goes on down
        self.by_hash: dict[BlockHash, KVBlock] = {}
        self.num_in_use = 0

    def is_far(self, block: KVBlock) -> bool:
        return block.block_id >= self.base

    @property
    def num_available(self) -> int:
        return self.warm.num_lendable

    def lend(self, n: int) -> list[KVBlock] | None:
        """n fresh far blocks with ref_cnt 1, or None when the warm tier cannot lend that many."""
        slots = self.lend_slots(n)
        return None if slots is None else [self._new(slot) for slot in slots]

    def _new(self, slot: int) -> KVBlock:
        block = KVBlock(self.base + slot)
        block.ref_cnt = 1
        self.num_in_use += 1
        return block

    def register(self, block: KVBlock, key: BlockKey) -> None:
        """Gives a full far block its hash; a hash already held by another far block stays with that one."""
        if block.block_hash is None and key.block_hash not in self.by_hash:
            block.block_hash, block.token_ids = key.block_hash, key.token_ids
            self.by_hash[key.block_hash] = block

    def find(self, key: BlockKey) -> KVBlock | None:
        """The far block in use under key, or None. Changes nothing."""
        block = self.by_hash.get(key.block_hash)
        return block if block is not None and block.token_ids == key.token_ids else None

    def place(self, restore: Restore) -> list[KVBlock]:
        """Far blocks over a finished lookup's blocks, registered under its keys, in order: lent warm
        slots are kept where they are; data read from a lower tier is written into newly lent slots.
        Stops early (releasing what is left) when warm cannot lend more."""
        blocks: list[KVBlock] = []
        for i, part in enumerate(restore.parts):
            slots = part.slots if part.slots is not None else self.lend_slots(part.num_blocks)
            if slots is None:  # warm is full of blocks in use: the rest is recomputed
                for rest in restore.parts[i + 1 :]:
                    if rest.slots is not None:
                        self.warm.release(rest.slots)
                break
            if part.slots is None:
                self.warm.write(slots, part.data)
            blocks.extend(self._new(slot) for slot in slots)
        for block, key in zip(blocks, restore.keys):
            self.register(block, key)
        return blocks

    def lend_slots(self, n: int) -> list[int] | None:
        slots, victims = self.warm.lend(n)
        self._pass_down(self.warm, victims)
        return slots

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops a reference on each; a block's last one gives its slot back to the warm tier, cached
        under its hash when it has one (in the order given: the first is evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            self.num_in_use -= 1
            slot = block.block_id - self.base
            if block.block_hash is None:
                self.warm.release([slot])
                continue
            if self.by_hash.get(block.block_hash) is block:
                del self.by_hash[block.block_hash]
            self.warm.keep(slot, BlockKey(block.block_hash, block.token_ids))
