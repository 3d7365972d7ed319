"""Far blocks, planned in one place: full blocks of a running sequence's table that live in warm slots the warm tier
lends (tiers/block_pool.py), so that a sequence larger than the hot pool still runs. Only the blocks a sequence writes
must be hot. Two things put a block there: an offload (old full blocks of running sequences move down when the hot
pool runs dry) and an adoption in place (a prefix found below hot that hot cannot hold stays where the lookup found it,
or is read into lent slots).

How attention reaches far blocks decides when to offload, one policy per mode (config `offload`, resolved by
far_policy), each a class here:
- `FarInPlace` ("in_place", CPU: the warm slab is the cache tensor's tail and attention reads a far block as cheaply
  as a hot one): old blocks of any running sequence move down before anyone is preempted.
- `FarStaged` ("staged", CUDA: the runner copies a step's far blocks to the device, runner/far_stage.py): preemption
  comes first; only a sequence that cannot fit beside the others, or whose victim holds far blocks (a preempted
  sequence with far blocks is recomputed, never swapped), moves its own request's old blocks down.
- `Room` itself ("off"): no room below hot; a dry pool preempts.

The scheduler asks its policy for room at these points and never branches on far blocks itself. The engine's
assembly asks the same class what the mode means for the parts it builds (the block pool's lender, the cache
tensor's tail, the staging the runner does, how much of a request must be hot): class methods, asked before any KV
manager exists. Every slot is lent through KVCacheManager.lend_slots (the one way KV leaves the hot pool while
planning, a swap-out's too), and every move is recorded on the KV manager's list: nothing here touches a tensor.
"""

from __future__ import annotations

import torch

from tieredkv.core.kv_manager import Blocks, KVCacheManager
from tieredkv.core.sequence import Sequence
from tieredkv.hashing import BlockHash
from tieredkv.tiers.base import BlockKey, SwapSpace
from tieredkv.tiers.block_pool import KVBlock
from tieredkv.tiers.moves import OFFLOAD, PROMOTE, BlockMove, Restore
from tieredkv.tiers.warm import WarmTier


class Room:
    """Where a dry hot pool may make room without preempting, as the scheduler asks for it. This base is far blocks
    off: no room is ever made below hot, and a preempted sequence may always be swapped."""

    mode = "off"  # config `offload`'s name for it (what rank 0 tells the other ranks)

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.offloaded_blocks = 0  # hot blocks of running sequences moved to far blocks

    # -- what the mode means for the engine's parts (engine/build.py, engine/rank_build.py, tools/plan.py) --------

    @classmethod
    def far_blocks(cls, num_warm: int) -> int:
        """How many of the warm tier's `num_warm` blocks a sequence may keep its older KV in."""
        return 0

    @classmethod
    def lender(cls, warm: SwapSpace | None) -> SwapSpace | None:
        """The tier the block pool lends far blocks from (tiers/block_pool.py), or None."""
        return None

    @classmethod
    def tail(cls, extent: int) -> int:
        """Blocks the cache tensor spans beyond the pool for the warm slab (`extent`: sizing.far_extent)."""
        return 0

    @classmethod
    def staged_layers(cls, num_layers: int) -> int:
        """Layers whose far blocks a step stages into buffers beside the hot pool (sizing.kv_pool_bytes)."""
        return 0

    @classmethod
    def stage_from(cls, num_blocks: int, warm: WarmTier | None) -> tuple[int, torch.Tensor] | None:
        """What the runner stages far blocks from (runner/far_stage.py): (the first far block id, warm's slab)."""
        return None

    @classmethod
    def refusal(cls, needed: int, num_seqs: int, hot: int, num_warm: int) -> str | None:
        """Why a request whose KV takes up to `needed` blocks over `num_seqs` sequences cannot run beside the
        others' pins (`hot`: the pool's blocks not pinned; `num_warm`: the warm tier's), or None: every block hot."""
        return f"up to {needed} KV blocks" if needed > hot else None

    # -- what the scheduler asks ----------------------------------------------------------------------------------

    def make_room(self, seq: Sequence, n: int, running: list[Sequence], cached: Blocks = ()) -> int:
        """Moves old blocks down until seq's n new tokens (after `cached`) fit in the hot pool, or as many as can
        go; returns the new tokens that fit now (at most n). 0: no room was made."""
        return 0

    def before_preempting(self, seq: Sequence, n: int, running: list[Sequence]) -> int:
        """make_room, where this policy makes room before anyone is preempted for seq; else 0."""
        return 0

    def instead_of_preempting(self, seq: Sequence, victim: Sequence, n: int, running: list[Sequence]) -> int:
        """make_room, where this policy makes room rather than preempt victim (seq itself, when it cannot fit
        beside the others); else 0."""
        return 0

    def swappable(self, seq: Sequence) -> bool:
        """Whether a preempted seq may be swapped out whole (one holding far blocks is recomputed)."""
        return True

    def take_found(self, seq: Sequence, cached: list[KVBlock], found: Restore | None,
                   below: bool) -> tuple[list[KVBlock], list[KVBlock], Restore | None]:
        """What seq's admission takes of its prefix: `cached` hot blocks, then what a lookup `found` below hot (or
        a swapped-out table), `below` when make_room made room for its first chunk but not for what was found.
        Returns (its hits, the hot blocks it allocates after, what to restore into hot). Off: all of it to hot."""
        return cached, cached, found


class FarBlocks(Room):
    """Far blocks on; the subclasses say when room is made."""

    @classmethod
    def far_blocks(cls, num_warm: int) -> int:
        return num_warm

    @classmethod
    def lender(cls, warm: SwapSpace | None) -> SwapSpace | None:
        return warm

    @classmethod
    def refusal(cls, needed: int, num_seqs: int, hot: int, num_warm: int) -> str | None:
        """Far blocks count, but each sequence's last block must be hot, and one more for the block a step starts
        before an older one moves down."""
        if needed > hot + num_warm:
            return f"up to {needed} KV blocks"
        at_once = min(needed, num_seqs + 1)
        return f"{at_once} KV blocks in the pool at once" if at_once > hot else None

    def take_found(self, seq: Sequence, cached: list[KVBlock], found: Restore | None,
                   below: bool) -> tuple[list[KVBlock], list[KVBlock], Restore | None]:
        """Where hot cannot hold what was found, it is adopted in place below hot (adopt)."""
        if not below or found is None:
            return cached, cached, found
        return cached + self.adopt(seq, cached, found), [], None

    def _holders(self, seq: Sequence, running: list[Sequence]) -> list[Sequence]:
        """Whose old blocks may move down for seq."""
        raise NotImplementedError

    def make_room(self, seq: Sequence, n: int, running: list[Sequence], cached: Blocks = ()) -> int:
        kv = self.kv
        need = kv.num_blocks_needed(seq, n, cached) - kv.allocatable(cached)
        holders = self._holders(seq, running)
        self.offload(need, holders if seq in holders else [*holders, seq])
        return min(n, kv.max_new_tokens(seq, cached))

    def swappable(self, seq: Sequence) -> bool:
        return not any(self.kv.pool.is_far(b) for b in seq.block_table)

    def offload(self, n: int, seqs: list[Sequence]) -> int:
        """Frees up to n hot blocks by moving old full blocks of `seqs` to far blocks (lowest positions first, so
        a sequence keeps its latest blocks hot). A block qualifies when every reference to it comes from `seqs` and
        it is computed in all of them. Returns the number of hot blocks freed."""
        pool, bs = self.kv.pool, self.kv.block_size
        if n <= 0:
            return 0
        holders: dict[KVBlock, list[tuple[Sequence, int]]] = {}
        for seq in seqs:
            for i in range(seq.num_computed_tokens // bs):
                block = seq.block_table[i]
                if not pool.is_far(block):
                    holders.setdefault(block, []).append((seq, i))
        ready = [block for block, refs in holders.items() if len(refs) == block.ref_cnt]
        ready.sort(key=lambda block: holders[block][0][1])
        chosen = ready[: min(n, pool.num_far_available)]
        fars = self._lend(len(chosen)) if chosen else None
        if not fars:
            return 0
        for hot, far in zip(chosen, fars):
            refs = holders[hot]
            self.kv.moves.append(BlockMove(OFFLOAD, hot.block_id, far.block_id))
            if hot.block_hash is not None:
                key, parent = BlockKey(hot.block_hash, hot.token_ids), hot.parent
                pool.uncache(hot)
                pool.cache(far, key.block_hash, key.token_ids, parent)
            far.ref_cnt = len(refs)
            for seq, i in refs:
                seq.block_table[i] = far
            pool.free([hot] * len(refs))
        self.offloaded_blocks += len(chosen)
        return len(chosen)

    def adopt(self, seq: Sequence, cached: list[KVBlock], restore: Restore) -> list[KVBlock]:
        """Takes the cached blocks, then the restored ones as far blocks, in place: nothing is copied into hot (for a
        prefix larger than what hot can hold). Some restored blocks may be lost if warm has no room left for data
        read from below; they are recomputed. Then continues the prefix with cached blocks after them (a document's
        last blocks often stay hot) and returns those."""
        kv, pool = self.kv, self.kv.pool
        pool.touch(cached)
        seq.block_table.extend(cached)
        seq.block_table.extend(self._place(restore, seq.block_table[-1].block_hash if seq.block_table else None))
        more = pool.cached_prefix(kv.lookup_keys(seq)[len(seq.block_table) :])
        pool.touch(more)
        pool.popularity.use(b.block_hash for b in seq.block_table if b.block_hash is not None)
        seq.block_table.extend(more)
        seq.num_computed_tokens = len(seq.block_table) * kv.block_size
        seq.num_cached_blocks = len(seq.block_table)
        return more

    def _place(self, restore: Restore, parent: BlockHash | None) -> list[KVBlock]:
        """Far blocks over a finished lookup's blocks, registered under its keys, in order: lent warm slots are kept
        where they are; data read from a lower tier goes into newly lent ones (a PROMOTE move each). Stops early
        (releasing what is left) when warm cannot lend more."""
        pool = self.kv.pool
        blocks: list[KVBlock] = []
        for i, part in enumerate(restore.parts):
            if part.slots is not None:
                blocks.extend(pool.far_block(slot) for slot in part.slots)
                continue
            fresh = self._lend(part.num_blocks)
            if fresh is None:  # warm is full of blocks in use: the rest is recomputed
                for rest in restore.parts[i + 1 :]:
                    if rest.slots is not None:
                        pool.lender.release(rest.slots)
                break
            keys = restore.keys[len(blocks) : len(blocks) + len(fresh)]
            self.kv.moves.extend(BlockMove(PROMOTE, None, b.block_id, key, part.data[j], part.tier)
                                 for j, (b, key) in enumerate(zip(fresh, keys)))
            blocks.extend(fresh)
        for block, key in zip(blocks, restore.keys):
            pool.cache(block, key.block_hash, key.token_ids, parent)
            parent = key.block_hash
        return blocks

    def _lend(self, n: int) -> list[KVBlock] | None:
        """n far blocks over lent warm slots (KVCacheManager.lend_slots)."""
        slots = self.kv.lend_slots(n)
        return None if slots is None else [self.kv.pool.far_block(slot) for slot in slots]


class FarInPlace(FarBlocks):
    """Far blocks read in place, as cheaply as hot ones: any running sequence's old blocks move down before anyone
    is preempted."""

    mode = "in_place"

    @classmethod
    def tail(cls, extent: int) -> int:
        return extent

    def _holders(self, seq: Sequence, running: list[Sequence]) -> list[Sequence]:
        return running

    def before_preempting(self, seq: Sequence, n: int, running: list[Sequence]) -> int:
        return self.make_room(seq, n, running)


class FarStaged(FarBlocks):
    """Far blocks staged for each step that reads them: preemption first, but seq's own request's old blocks move
    down when seq cannot fit beside the others or its victim holds far blocks (and so would be recomputed)."""

    mode = "staged"

    @classmethod
    def staged_layers(cls, num_layers: int) -> int:
        return num_layers

    @classmethod
    def stage_from(cls, num_blocks: int, warm: WarmTier | None) -> tuple[int, torch.Tensor] | None:
        assert warm is not None, "far blocks are staged from the warm tier's slab"
        return num_blocks, warm.slab

    def _holders(self, seq: Sequence, running: list[Sequence]) -> list[Sequence]:
        return [s for s in running if s.request is seq.request]

    def instead_of_preempting(self, seq: Sequence, victim: Sequence, n: int, running: list[Sequence]) -> int:
        return self.make_room(seq, n, running) if victim is seq or not self.swappable(victim) else 0


# the policy for each far mode, by config `offload`'s names ("auto" resolved by far_policy)
FAR_POLICY: dict[str, type[Room]] = {cls.mode: cls for cls in (Room, FarInPlace, FarStaged)}


def far_policy(offload: str, device_type: str, num_warm: int) -> type[Room]:
    """The policy for config `offload` on a device: on CPU "auto" reads far blocks in place, where the warm slab can
    be the tail of the cache tensor, and "staged" stages them (it runs the CUDA path's logic); on CUDA, where the
    slab is pinned host memory the kernels cannot index, far blocks are always staged (runner/far_stage.py). Off
    without a warm block to lend."""
    if offload == "off" or num_warm <= 0:
        return Room
    if device_type != "cpu":
        return FarStaged
    return FAR_POLICY["in_place" if offload == "auto" else offload]
