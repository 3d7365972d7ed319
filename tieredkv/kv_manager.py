"""Block tables, prefix-cache lookups and copy-on-write for sequences, on top of the block pool."""

from __future__ import annotations

from tieredkv.block_pool import BlockPool, KVBlock
from tieredkv.far_blocks import FarBlocks
from tieredkv.hashing import BlockHash, hash_block
from tieredkv.sequence import Sequence
from tieredkv.tiers.base import BlockKey
from tieredkv.tiers.moves import COPY, DEMOTE, PROMOTE, SWAP_IN, SWAP_OUT, BlockMove, Restore


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives each sequence the blocks it needs, sharing cached prefix blocks and forked prompt blocks.

    The only writes into the cache happen at positions >= a sequence's num_computed_tokens, so only
    its last, partially filled block can be written while shared; that block is copied first
    (copy-on-write). Every data movement this implies (demoting evicted blocks, promoted or swapped-in
    data, copy-on-write copies) is appended to `moves` in a safe order (see tiers/moves.py) for the
    step to carry out before its forward; this class itself only changes metadata.

    With `far` (far_blocks.py), a block table may also hold far blocks: full blocks that live in the
    warm tier. `offload` moves old full blocks there when the hot pool runs dry, and a prefix found
    below hot that hot cannot hold is adopted in place (`adopt_far`); only the blocks a sequence
    writes must be hot.
    """

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool, root: BlockHash):
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.root = root
        self.moves: list[BlockMove] = []
        self.cow_copies = 0
        self.far: FarBlocks | None = None
        self.offloaded_blocks = 0  # hot blocks of running sequences moved to far blocks

    # -- hashing ---------------------------------------------------------------------------------

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _extend_hashes(self, seq: Sequence, num_full: int) -> None:
        hashes = seq.block_hashes
        while len(hashes) < num_full:
            parent = hashes[-1] if hashes else self.root
            hashes.append(hash_block(parent, self._block_tokens(seq, len(hashes))))

    def chain_keys(self, token_ids: list[int]) -> list[BlockKey]:
        """Keys of every full block of token_ids, hashed from the root."""
        keys: list[BlockKey] = []
        for i in range(len(token_ids) // self.block_size):
            block = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            keys.append(BlockKey(hash_block(keys[-1].block_hash if keys else self.root, block), block))
        return keys

    # -- prefix cache ----------------------------------------------------------------------------

    def lookup_keys(self, seq: Sequence) -> list[BlockKey]:
        """Keys of the full blocks a prefix lookup may cover (never the last token)."""
        return list(self._iter_lookup_keys(seq))

    def _iter_lookup_keys(self, seq: Sequence):
        n = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, n)
        return (BlockKey(seq.block_hashes[i], self._block_tokens(seq, i)) for i in range(n))

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """Leading full blocks of seq found in the cache, stopping at the first miss: hot blocks, and
        far blocks in use (by another sequence of the same document). The lower tiers are looked up
        after this (TierManager.start_lookup).

        Never covers the last token: its logits must be computed. Mutates only seq.block_hashes.
        """
        if not self.enable_caching:
            return []
        if self.far is None:
            return self.pool.cached_prefix(self._iter_lookup_keys(seq))  # lazy: stops at the first miss
        return self._hits(self._iter_lookup_keys(seq))

    def _hits(self, keys) -> list[KVBlock]:
        hits: list[KVBlock] = []
        for key in keys:
            hit = self.pool.get_cached(*key) or self.far.find(key)
            if hit is None:
                break
            hits.append(hit)
        return hits

    def hit_tier(self, hit: KVBlock) -> str:
        return "warm" if self.is_far(hit) else "hot"

    def is_far(self, block: KVBlock) -> bool:
        return self.far is not None and self.far.is_far(block)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens since the last call."""
        if not self.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            block, key = seq.block_table[i], BlockKey(seq.block_hashes[i], self._block_tokens(seq, i))
            if self.is_far(block):
                self.far.register(block, key)
            else:
                self.pool.cache(block, *key)
        seq.num_cached_blocks = num_full

    # -- allocation ------------------------------------------------------------------------------

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] = (),
                          restore_blocks: int = 0, restore_tokens: int = 0) -> int:
        """Fresh blocks that allocate_slots would take from the pool, copy-on-write included."""
        num_computed = seq.num_computed_tokens + len(cached) * self.block_size + restore_tokens
        have = len(seq.block_table) + len(cached) + restore_blocks
        need = cdiv(num_computed + num_new_tokens, self.block_size) - have
        return max(need, 0) + int(self._needs_cow(seq)) + restore_blocks

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] = (),
                     restore_blocks: int = 0, restore_tokens: int = 0) -> bool:
        """Whether allocate_slots with these arguments (a restore of that size) would succeed."""
        need = self.num_blocks_needed(seq, num_new_tokens, cached, restore_blocks, restore_tokens)
        return need <= self.allocatable(cached)

    def allocatable(self, cached: list[KVBlock] = ()) -> int:
        """Blocks allocate() can supply once `cached` hits are taken."""
        reviving = sum(1 for b in cached if b.ref_cnt == 0)  # free until touched
        return self.pool.num_free - reviving

    def max_new_tokens(self, seq: Sequence, cached: list[KVBlock] = ()) -> int:
        """The most new tokens allocate_slots(seq, n, cached) can take from the free blocks now."""
        have = len(seq.block_table) + len(cached) + self.allocatable(cached) - int(self._needs_cow(seq))
        return max(have * self.block_size - seq.num_computed_tokens - len(cached) * self.block_size, 0)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: list[KVBlock] = (),
                       restore: Restore | None = None) -> bool:
        """Make room for num_new_tokens after the computed ones, first adopting `cached` prefix blocks
        and then fresh blocks for `restore` (promoted or swapped-in data, written before the forward).

        Returns False, changing nothing, when the pool cannot supply the blocks. Cached blocks that
        are free count as free until touched, so they are excluded from what can be allocated.
        """
        restore_blocks, restore_tokens = (restore.num_blocks, restore.num_tokens) if restore else (0, 0)
        if not self.can_allocate(seq, num_new_tokens, cached, restore_blocks, restore_tokens):
            return False
        if cached:
            self._touch(cached)
            seq.block_table.extend(cached)
            seq.num_computed_tokens += len(cached) * self.block_size
            seq.num_cached_blocks = len(seq.block_table)
        if restore is not None:
            fresh = self.allocate(restore.num_blocks)
            seq.block_table.extend(fresh)
            seq.num_computed_tokens += restore.num_tokens
            self._plan_restore(restore, fresh)
            if restore.keys:  # promoted full blocks are findable from now: their data lands before the forward
                seq.num_cached_blocks = len(seq.block_table)
        if self._needs_cow(seq):
            self._copy_on_write(seq)
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.allocate(need))
        return True

    def adopt_far(self, seq: Sequence, cached: list[KVBlock], restore: Restore) -> list[KVBlock]:
        """Takes the cached blocks, then the restored ones as far blocks, in place: nothing is copied
        into hot (for a prefix larger than what hot can hold). Some restored blocks may be lost if warm
        has no room left for data read from below; they are recomputed. Then continues the prefix with
        cached blocks after them (a document's last blocks often stay hot) and returns those."""
        self._touch(cached)
        seq.block_table.extend(cached)
        seq.block_table.extend(self.far.place(restore))
        more = self._hits(self.lookup_keys(seq)[len(seq.block_table) :])
        self._touch(more)
        seq.block_table.extend(more)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_cached_blocks = len(seq.block_table)
        return more

    def allocate(self, n: int) -> list[KVBlock]:
        """n fresh blocks; the cached blocks evicted for them are demoted first (see tiers/moves.py)."""
        blocks, evicted = self.pool.allocate(n)
        self.moves.extend(BlockMove(DEMOTE, e.block_id, None, BlockKey(e.block_hash, e.token_ids))
                          for e in evicted)
        return blocks

    def _plan_restore(self, restore: Restore, fresh: list[KVBlock]) -> None:
        if restore.swap_slots is not None:
            self.moves.extend(BlockMove(SWAP_IN, slot, b.block_id) for slot, b in zip(restore.swap_slots, fresh))
            restore.swap_slots = None  # released by the move
            return
        i = 0
        for part in restore.parts:
            for j in range(part.num_blocks):
                block, key = fresh[i], restore.keys[i]
                self.pool.cache(block, key.block_hash, key.token_ids)
                if part.slots is not None:
                    self.moves.append(BlockMove(PROMOTE, part.slots[j], block.block_id, key, None, part.tier))
                else:
                    self.moves.append(BlockMove(PROMOTE, None, block.block_id, key, part.data[j], part.tier))
                i += 1

    def _needs_cow(self, seq: Sequence) -> bool:
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_table) and seq.block_table[i].ref_cnt > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        i = seq.num_computed_tokens // self.block_size
        old = seq.block_table[i]
        (new,) = self.allocate(1)
        self.pool.free([old])
        seq.block_table[i] = new
        self.moves.append(BlockMove(COPY, old.block_id, new.block_id))
        self.cow_copies += 1

    def take_moves(self) -> list[BlockMove]:
        moves, self.moves = self.moves, []
        return moves

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (ref_cnt + 1 each) and its computed state."""
        self._touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks tail-first, so a chain's tail is evicted before its head."""
        self._free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_computed_tokens = 0

    def _touch(self, blocks) -> None:
        for block in blocks:
            (self.far if self.is_far(block) else self.pool).touch([block])

    def _free(self, blocks) -> None:
        for block in blocks:
            (self.far if self.is_far(block) else self.pool).free([block])

    # -- offloading --------------------------------------------------------------------------------

    def offload(self, n: int, seqs: list[Sequence]) -> int:
        """Frees up to n hot blocks by moving old full blocks of `seqs` to far blocks (lowest positions
        first, so a sequence keeps its latest blocks hot). A block qualifies when every reference to it
        comes from `seqs` and it is computed in all of them. Returns the number of hot blocks freed."""
        if self.far is None or n <= 0:
            return 0
        holders: dict[KVBlock, list[tuple[Sequence, int]]] = {}
        for seq in seqs:
            for i in range(seq.num_computed_tokens // self.block_size):
                block = seq.block_table[i]
                if not self.is_far(block):
                    holders.setdefault(block, []).append((seq, i))
        ready = [block for block, refs in holders.items() if len(refs) == block.ref_cnt]
        ready.sort(key=lambda block: holders[block][0][1])
        chosen = ready[: min(n, self.far.num_available)]
        fars = self.far.lend(len(chosen)) if chosen else None
        if not fars:
            return 0
        for hot, far in zip(chosen, fars):
            refs = holders[hot]
            self.moves.append(BlockMove(SWAP_OUT, hot.block_id, far.block_id - self.far.base))
            if hot.block_hash is not None:
                key = BlockKey(hot.block_hash, hot.token_ids)
                self.pool.uncache(hot)
                self.far.register(far, key)
            far.ref_cnt = len(refs)
            for seq, i in refs:
                seq.block_table[i] = far
            self.pool.free([hot] * len(refs))
        self.offloaded_blocks += len(chosen)
        return len(chosen)
