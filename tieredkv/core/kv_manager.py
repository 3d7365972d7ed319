"""Block tables, prefix-cache lookups and copy-on-write for sequences, on top of the block pool."""

from __future__ import annotations

import typing

from tieredkv.core.sequence import Sequence
from tieredkv.hashing import BlockHash, chain_keys, hash_block
from tieredkv.tiers.base import BlockKey, Lent, SwapSpace
from tieredkv.tiers.block_pool import BlockPool, KVBlock
from tieredkv.tiers.moves import COPY, DEMOTE, PASS_DOWN, PROMOTE, SWAP_OUT, BlockMove, Restore, RestorePart


Blocks = typing.Sequence[KVBlock]  # cached prefix blocks, in order (a list, or () for none)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives each sequence the blocks it needs, sharing cached prefix blocks and forked prompt blocks.

    The only writes into the cache happen at positions >= a sequence's num_computed_tokens, so only
    its last, partially filled block can be written while shared; that block is copied first
    (copy-on-write). Every data movement this implies (demoting evicted blocks, promoted or swapped-in
    data, swapped-out blocks, copy-on-write copies) is appended to `moves` in a safe order (see
    tiers/moves.py) for the step to carry out before its forward; this class itself only changes
    metadata (block tables, the pool, and the warm tier's slot index through `lend_slots`). Blocks of
    running sequences that move below hot are planned by core/far_blocks.py, on this class's moves.
    """

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool, root: BlockHash,
                 swap: SwapSpace | None = None):
        self.pool = pool
        self.swap = swap  # the tier that lends warm slots (lend_slots)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.root = root
        self.moves: list[BlockMove] = []
        self.cow_copies = 0

    # -- hashing ---------------------------------------------------------------------------------

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _extend_hashes(self, seq: Sequence, num_full: int) -> None:
        hashes = seq.block_hashes
        while len(hashes) < num_full:
            parent = hashes[-1] if hashes else (seq.request.root or self.root)
            hashes.append(hash_block(parent, self._block_tokens(seq, len(hashes))))

    def chain_keys(self, token_ids: list[int], root: BlockHash | None = None) -> list[BlockKey]:
        """Keys of every full block of token_ids, hashed from `root` (the engine's by default)."""
        return chain_keys(root or self.root, token_ids, self.block_size)

    # -- prefix cache ----------------------------------------------------------------------------

    def lookup_keys(self, seq: Sequence) -> list[BlockKey]:
        """Keys of the full blocks a prefix lookup may cover (never the last token)."""
        n = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, n)
        return [BlockKey(seq.block_hashes[i], self._block_tokens(seq, i)) for i in range(n)]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens since the last call."""
        if not self.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq, num_full)
        prompt_blocks = seq.num_prompt_tokens // self.block_size
        for i in range(seq.num_cached_blocks, num_full):
            self.pool.cache(seq.block_table[i], seq.block_hashes[i], self._block_tokens(seq, i),
                            seq.block_hashes[i - 1] if i else None)
            self.pool.popularity.computed(seq.block_hashes[i], output=i >= prompt_blocks)
        seq.num_cached_blocks = num_full

    # -- allocation ------------------------------------------------------------------------------

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: Blocks = (),
                          restore_blocks: int = 0, restore_tokens: int = 0) -> int:
        """Fresh blocks that allocate_slots would take from the pool, copy-on-write included."""
        num_computed = seq.num_computed_tokens + len(cached) * self.block_size + restore_tokens
        have = len(seq.block_table) + len(cached) + restore_blocks
        need = cdiv(num_computed + num_new_tokens, self.block_size) - have
        return max(need, 0) + int(self._needs_cow(seq)) + restore_blocks

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: Blocks = (),
                     restore_blocks: int = 0, restore_tokens: int = 0) -> bool:
        """Whether allocate_slots with these arguments (a restore of that size) would succeed."""
        need = self.num_blocks_needed(seq, num_new_tokens, cached, restore_blocks, restore_tokens)
        return need <= self.allocatable(cached)

    def allocatable(self, cached: Blocks = ()) -> int:
        """Blocks allocate() can supply once `cached` hits are taken."""
        reviving = sum(1 for b in cached if b.ref_cnt == 0)  # free until touched
        return self.pool.num_free - reviving

    def max_new_tokens(self, seq: Sequence, cached: Blocks = ()) -> int:
        """The most new tokens allocate_slots(seq, n, cached) can take from the free blocks now."""
        have = len(seq.block_table) + len(cached) + self.allocatable(cached) - int(self._needs_cow(seq))
        return max(have * self.block_size - seq.num_computed_tokens - len(cached) * self.block_size, 0)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: Blocks = (),
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
            self.pool.touch(cached)
            self.pool.popularity.use(b.block_hash for b in cached)
            seq.block_table.extend(cached)
            seq.num_computed_tokens += len(cached) * self.block_size
            seq.num_cached_blocks = len(seq.block_table)
        if restore is not None:
            parent = seq.block_table[-1].block_hash if seq.block_table else None
            fresh = self.allocate(restore.num_blocks)
            seq.block_table.extend(fresh)
            seq.num_computed_tokens += restore.num_tokens
            self._plan_restore(restore, fresh, parent)
            self.pool.popularity.use(k.block_hash for k in restore.keys)
            if restore.keys:  # promoted full blocks are findable from now: their data lands before the forward
                seq.num_cached_blocks = len(seq.block_table)
        if self._needs_cow(seq):
            self._copy_on_write(seq)
        need = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.allocate(need))
        return True

    def lend_slots(self, n: int, whole_sequence: bool = False) -> list[int] | None:
        """The one way KV leaves the hot pool while planning: n warm slots lent to blocks of one sequence, for
        blocks of running sequences kept below hot (core/far_blocks.py: an offload, an adoption in place) or for a
        preempted sequence's whole table (a swap-out, under the swap space's cap: SwapSpace.reserve); what the
        warm tier evicts for them goes on down first (PASS_DOWN moves). None: no room."""
        if self.swap is None or n == 0:
            return None
        slots, evicted = self.swap.reserve(n) if whole_sequence else self.swap.lend(n)
        self.pass_down(evicted)
        return slots

    def pass_down(self, evicted: Lent) -> None:
        """Moves for entries the warm tier evicted to lend their slots: each is read from its slot, and goes to the
        tier below, before the moves planned after it write into the slot. The one route down from warm while
        planning (lend_slots); nothing is read until the moves run."""
        self.moves.extend(BlockMove(PASS_DOWN, slot, None, key, None, "warm") for key, slot in zip(*evicted))

    def allocate(self, n: int) -> list[KVBlock]:
        """n fresh blocks; the cached blocks evicted for them are demoted first (see tiers/moves.py)."""
        blocks, evicted = self.pool.allocate(n)
        self.moves.extend(BlockMove(DEMOTE, e.block_id, None, BlockKey(e.block_hash, e.token_ids))
                          for e in evicted)
        return blocks

    def _plan_restore(self, restore: Restore, fresh: list[KVBlock], parent: BlockHash | None) -> None:
        """A promotion move a block, from its lent slot or its data; the blocks the restore has keys for are
        registered in the hash map (their data lands before the forward)."""
        blocks, keys = iter(fresh), restore.keys
        i = 0
        for part in restore.parts:
            for j in range(part.num_blocks):
                block, key = next(blocks), keys[i] if i < len(keys) else None
                if key is not None:
                    self.pool.cache(block, key.block_hash, key.token_ids, keys[i - 1].block_hash if i else parent)
                src, data = (part.slots[j], None) if part.slots is not None else (None, part.data[j])
                self.moves.append(BlockMove(PROMOTE, src, block.block_id, key, data, part.tier))
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

    def swap_out(self, seq: Sequence) -> Restore | None:
        """Offloads a preempted sequence whole: SWAP_OUT moves of its blocks into lent warm slots (read out before
        anything is written into the blocks), and the restore that promotes them back from those slots; None when
        warm has no room. The caller frees seq's blocks."""
        slots = self.lend_slots(len(seq.block_table), whole_sequence=True)
        if slots is None:
            return None
        self.moves.extend(BlockMove(SWAP_OUT, b.block_id, slot) for b, slot in zip(seq.block_table, slots))
        return Restore(0, seq.num_computed_tokens, parts=[RestorePart(self.swap.name, slots, None)])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (ref_cnt + 1 each) and its computed state."""
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def trim(self, seq: Sequence) -> None:
        """Frees the blocks past seq's computed tokens: those a speculative step took for drafts that were
        rejected (fresh blocks, never hashed: a block is cached only once full of computed tokens)."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        extra = seq.block_table[keep:]
        if extra:
            del seq.block_table[keep:]
            self.pool.free(reversed(extra))

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks tail-first, so a chain's tail is evicted before its head."""
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_computed_tokens = 0
