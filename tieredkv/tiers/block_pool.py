"""Every KV block a block table can name, in one id space: hot blocks, then warm slots lent as far blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

from tieredkv.hashing import BlockHash, BlockKey
from tieredkv.tiers.policy import LFUQueue, Popularity, check_eviction

MEDIUM_HOT = "GPU"  # the pool's name in KV events: vLLM's for the pool the model computes from, on every device

if TYPE_CHECKING:
    from tieredkv.tiers.base import SwapSpace


class Evicted(NamedTuple):
    """A cached block that `allocate` reused: where its data still is, and what it was."""

    block_id: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]


class KVBlock:
    """Metadata of one block of the pool; the K/V bytes live in the engine's cache tensor at `block_id`."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "parent", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # set with block_hash, compared on every hit
        self.parent: BlockHash | None = None  # the previous block's hash in its chain, where known (KV events)
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_cnt 0, in eviction order: the head is reused first.

    popleft, append and remove are O(1). A deque would make `remove` O(n), and remove is the hot
    operation: every prefix-cache hit on a freed block takes it out of the middle of the queue.
    Invariant: a block is linked here iff its ref_cnt is 0.
    """

    def __init__(self, blocks: Iterable[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        self._link(self._tail.prev_free, block, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """At the head: reused before every other free block."""
        self._link(self._head, block, self._head.next_free)

    def _link(self, before: KVBlock, block: KVBlock, after: KVBlock) -> None:
        before.next_free, block.prev_free, block.next_free, after.prev_free = block, before, after, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class LFUFreeQueue:
    """FreeBlockQueue's interface in LFU-DA order (tiers/policy.py): blocks without a hash first, then cached
    ones by their uses plus the clock when freed. O(log n) per operation."""

    _UNCACHED = -(1 << 40)

    def __init__(self, blocks: Iterable[KVBlock], popularity: Popularity):
        self.popularity = popularity
        self._queue: LFUQueue[KVBlock] = LFUQueue(self._weight)
        for block in blocks:
            self.append(block)

    def _weight(self, block: KVBlock) -> int:
        return self._UNCACHED if block.block_hash is None else self.popularity.uses(block.block_hash)

    @property
    def num_free(self) -> int:
        return len(self._queue)

    def popleft(self) -> KVBlock:
        try:
            return self._queue.pop()
        except IndexError:
            raise IndexError("no free block") from None

    def append(self, block: KVBlock) -> None:
        self._queue.push(block)

    appendleft = append  # (a block without a hash ranks first already)

    def remove(self, block: KVBlock) -> None:
        self._queue.discard(block)

    def __iter__(self):
        return iter(self._queue)


class BlockPool:
    """All blocks a block table can hold, in one id space with one reference count and one hash map.

    Ids [0, num_blocks) are hot: allocated up front, in the accelerator's cache tensor. Ids from
    `far_base` (= num_blocks) on are far: block `far_base + s` lives in slot s of the warm tier
    (`lender`), lent while a sequence holds it. Where a block lives is a property of its id
    (`is_far`), read by the runner and the tiers; everything here treats both ranges alike, except
    what happens when the last reference goes: a hot block joins the LRU free queue (still cached,
    revived by `touch` on a prefix hit); a far block gives its slot back to the warm tier, as a cached
    warm entry when it has a hash.

    A hot block is in exactly one state: in use (ref_cnt > 0, not in the free queue), or free
    (ref_cnt 0, in the free queue). A far block exists only while in use. `cached` maps a hash to its
    block: any cached hot block, and far blocks in use. Reusing cached free hot blocks evicts their
    hashes: `allocate` returns them, and lending slots (the warm tier's `lend`, a `far_block` over each slot)
    returns what the warm tier evicted; the caller (the KV manager) turns both into block moves. Every method only
    changes metadata, O(1) per block (O(log n) under "lfu").

    `eviction` orders the free hot blocks: "lru" (the least recently freed first) or "lfu" (LFU with dynamic
    aging over `popularity`'s use counts: tiers/policy.py).
    """

    def __init__(self, num_blocks: int, lender: "SwapSpace | None" = None, eviction: str = "lru",
                 popularity: Popularity | None = None):
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.popularity = popularity or Popularity(16 * num_blocks)
        check_eviction(eviction)
        self.eviction = eviction
        self.free_queue = (FreeBlockQueue(self.blocks) if eviction == "lru"
                           else LFUFreeQueue(self.blocks, self.popularity))
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_cached_free = 0  # cached blocks with ref_cnt 0 (kept in step, so stats are O(1))
        self.lender = lender  # the warm tier, when far blocks are on
        self.num_far = 0  # far blocks in use
        self.num_cached_far = 0  # of which in the hash map
        self.new_cached: list[KVBlock] | None = None  # a list: `cache` records each block it registers there
        self.events: Any = None  # an EventRecorder (engine/kv_events.py): blocks cached and uncached are reported

    @property
    def num_blocks(self) -> int:
        """Hot blocks."""
        return len(self.blocks)

    @property
    def far_base(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Free hot blocks."""
        return self.free_queue.num_free

    @property
    def num_far_available(self) -> int:
        """Far blocks the lender could lend now (0 without a lender)."""
        return self.lender.num_lendable if self.lender is not None else 0

    def is_far(self, block: KVBlock) -> bool:
        return self.is_far_id(block.block_id)

    def is_far_id(self, block_id: int) -> bool:
        return block_id >= self.far_base

    def slot_of(self, far_id: int) -> int:
        """The warm slot a far block id names."""
        return far_id - self.far_base

    def tier_of(self, block: KVBlock) -> str:
        return "warm" if self.is_far(block) else "hot"

    def get_cached(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cached_prefix(self, keys: Iterable[tuple[BlockHash, tuple[int, ...]]], hot_only: bool = False) -> list[KVBlock]:
        """The cached blocks of the leading (hash, token ids) keys, stopping at the first miss (or, with
        hot_only, at the first far block)."""
        hits = []
        for block_hash, token_ids in keys:
            block = self.get_cached(block_hash, token_ids)
            if block is None or (hot_only and self.is_far(block)):
                break
            hits.append(block)
        return hits

    def allocate(self, n: int) -> tuple[list[KVBlock], list[Evicted]]:
        """n fresh hot blocks with ref_cnt 1, taken from the LRU head, and the cached ones among them that
        were evicted to make them. Raises MemoryError if fewer than n are free."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} blocks, {self.num_free} free")
        out = [self.free_queue.popleft() for _ in range(n)]
        evicted = [Evicted(b.block_id, b.block_hash, b.token_ids) for b in out if b.block_hash is not None]
        for block in out:
            if block.block_hash is not None:
                self.uncache(block)
            block.ref_cnt = 1
        return out, evicted

    def far_block(self, slot: int) -> KVBlock:
        """A far block with ref_cnt 1 over a slot already lent by the warm tier."""
        block = KVBlock(self.far_base + slot)
        block.ref_cnt = 1
        self.num_far += 1
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block, reviving free cached hot ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free -= block.block_hash is not None
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block, in the order given: of the cached ones, the first freed is evicted
        first. A block with no hash (a partial block, a prompt's blocks with prefix caching off: nothing anyone can
        find) goes to the queue's head, so that it is reused before any cached block is evicted, the last freed
        first (its memory the most likely still in the processor's caches, its pages mapped)."""
        for block in blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            if self.is_far(block):
                self._return_far(block)
            elif block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)
                self.num_cached_free += 1

    def _return_far(self, block: KVBlock) -> None:
        self.num_far -= 1
        slot = self.slot_of(block.block_id)
        if block.block_hash is None:
            self.lender.release([slot])
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self.num_cached_far -= 1
            if self.events is not None:  # the warm tier reports it again as its entry
                self.events.removed([block.block_hash], self.lender.medium)
        self.lender.keep(slot, BlockKey(block.block_hash, block.token_ids))

    def cache(self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...],
              parent: BlockHash | None = None) -> None:
        """Register a full block under its hash (`parent`: its chain's previous block, None for the first or
        where unknown); a hash already held by another block stays with that one."""
        if block_hash in self.cached or block.block_hash is not None:
            return
        block.block_hash, block.token_ids, block.parent = block_hash, token_ids, parent
        self.cached[block_hash] = block
        self.num_cached_free += block.ref_cnt == 0
        if block.ref_cnt == 0:  # ranked again as the cached block it is now (not at the head with the empty ones)
            if self.eviction != "lfu":
                self.free_queue.remove(block)
            self.free_queue.append(block)
        far = self.is_far(block)
        self.num_cached_far += far
        if self.new_cached is not None:
            self.new_cached.append(block)
        if self.events is not None:
            self.events.stored(block_hash, parent, token_ids, self.lender.medium if far else MEDIUM_HOT)

    def evict_all_cached(self) -> int:
        """Forget every free cached block (in use ones keep their hash), without demotion."""
        victims = [b for b in self.free_queue if b.block_hash is not None]
        for block in victims:
            self.uncache(block)
        return len(victims)

    def uncache(self, block: KVBlock) -> None:
        """Drop the block's hash from the map; its data is no longer findable."""
        del self.cached[block.block_hash]
        far = self.is_far(block)
        if self.events is not None:
            self.events.removed([block.block_hash], self.lender.medium if far else MEDIUM_HOT)
        block.block_hash = block.token_ids = block.parent = None
        self.num_cached_free -= block.ref_cnt == 0
        self.num_cached_far -= far
