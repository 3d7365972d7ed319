"""Continuous batching under a per-step token budget: decodes first, chunked prefill, preemption."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from tieredkv.kv_manager import KVCacheManager
from tieredkv.sequence import Sequence, SeqStatus
from tieredkv.tiers.lookup import Lookup, count_lookup
from tieredkv.tiers.manager import TierManager
from tieredkv.tiers.moves import SWAP_OUT, BlockMove, Restore


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]  # (sequence, number of tokens to compute this step)
    moves: list[BlockMove] = field(default_factory=list)  # block data to move before the forward, in order
    preempted: list[Sequence] = field(default_factory=list)
    waiting_on_disk: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # moved from waiting to running this step

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


_NOT_READY = object()


class Scheduler:
    """FCFS admission from `waiting`; `running` is kept in admission order.

    Each step: running sequences that decode are served first, then running ones mid-prefill, then
    waiting ones, while the token budget and max_num_seqs allow. When the pool runs dry, the most
    recently admitted running sequence not yet scheduled this step is preempted and goes back to the
    front of `waiting`: its blocks are swapped to the warm tier when it has room, else freed and
    recomputed later. A waiting sequence whose prefix is being read from the cold tier is passed
    over until the read finishes, so the disk never holds up a step that has work to compute.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 tiers: TierManager | None = None):
        self.kv = kv
        self.tiers = tiers
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admit_counter = itertools.count()
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions whose blocks went to the warm tier instead of being recomputed
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.stage_cap: int | None = None  # far blocks staged per step, where attention stages them (CUDA)
        # Where far blocks cost nothing to read (CPU), a dry pool offloads old blocks of any running
        # sequence before preempting; where they are staged, preemption comes first and only a sequence
        # that cannot fit beside the others offloads (its own request's blocks).
        self.offload_others = True
        self._step = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins its parent among the running sequences."""
        seq.status = SeqStatus.RUNNING
        seq.admit_order = next(self._admit_counter)
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        staged = _StageBudget(self.stage_cap, self.kv, self._step)
        for seq in staged.order(decoding + prefilling):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this step
                continue
            if not staged.admits(seq):
                continue  # its far blocks wait for a later step (it keeps them)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            fits = self.kv.allocate_slots(seq, n)
            if not fits and self.kv.far is not None and self.offload_others:  # before preempting anyone
                n = self._make_room(seq, n) or n
                fits = self.kv.allocate_slots(seq, n)
            while not fits:
                victim = self._pick_victim(scheduled, seq)
                if victim is seq and self.kv.far is not None and not self.offload_others:
                    fitting = self._make_room(seq, n)  # it cannot fit beside the others: its old blocks go
                    if fitting and self.kv.allocate_slots(seq, fitting):
                        n, fits = fitting, True
                        break
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                fits = self.kv.allocate_slots(seq, n)
            if fits:
                scheduled[seq] = n
                budget -= n
                staged.add(seq)

        on_disk, admitted = [], []
        for seq in list(self.waiting) if not preempted else []:
            if budget == 0:
                break
            forks = seq.request.pending_forks if seq.num_computed_tokens == 0 and seq.index == 0 else 0
            if len(self.running) + 1 + forks > self.max_num_seqs and self.running:
                break
            cached, restore = self._prefix_for(seq)
            if restore is _NOT_READY:
                on_disk.append(seq)
                continue
            bs = self.kv.block_size
            promoting, far = isinstance(restore, Lookup), False
            if promoting:  # room for what it found, before taking anything from the tiers
                found = restore.num_blocks()
                n = min(seq.num_tokens - (len(cached) + found) * bs, budget)
                if not self.kv.can_allocate(seq, n, cached, found, found * bs):
                    far = self._make_room(seq, 1, cached) > 0  # too big for hot: stays below it, in place
                    if not far:
                        break  # the finished lookup stays for the next attempt
                seq.lookup = None
                restore = self.tiers.finish_lookup(restore, len(cached))  # at most what it found
            hits = cached
            if far and restore is not None:
                hits = cached + self.kv.adopt_far(seq, cached, restore)
                cached = []
            num_done = seq.num_computed_tokens + len(cached) * bs + (0 if far or not restore else restore.num_tokens)
            n = min(seq.num_tokens - num_done, budget)
            fits = True
            if (far or restore is None) and not self.kv.can_allocate(seq, n, cached):
                n = self._make_room(seq, n, cached)
                fits = n > 0
            if not fits or not self.kv.allocate_slots(seq, n, cached, None if far else restore):
                if promoting and not far:  # cannot happen after can_allocate; never leak a taken slot
                    self.tiers.drop_restore(restore)
                self.kv.free(seq)  # (holds far blocks only if adopt_far ran; then cannot happen either)
                break  # a swapped sequence keeps its swap slots for the next attempt
            self.waiting.remove(seq)
            seq.swapped = None
            if seq.request.num_cached_tokens is None:
                self._record_hits(seq, hits, restore)
            self.add_running(seq)
            admitted.append(seq)
            scheduled[seq] = n
            budget -= n
        self._step += 1
        return SchedulerOutput(list(scheduled.items()), self.kv.take_moves(), preempted, on_disk, admitted)

    def _prefix_for(self, seq: Sequence) -> tuple[list, "Restore | Lookup | None"]:
        """Hot prefix blocks plus what to restore below them: a swap-in, a finished lookup (its
        promotion), or nothing. Returns _NOT_READY while a blocking tier's read is in flight."""
        if seq.swapped is not None:
            return [], seq.swapped
        cached = self.kv.find_cached_prefix(seq)
        if self.tiers is None or not self.kv.enable_caching:
            return cached, None
        if seq.lookup is None:
            seq.lookup = self.tiers.start_lookup(self.kv.lookup_keys(seq), len(cached))
            if seq.lookup is None:
                return cached, None
        if not seq.lookup.ready:
            return cached, _NOT_READY
        if seq.lookup.start != len(cached):  # hot changed while it waited: look again
            seq.lookup = None
            return self._prefix_for(seq)
        return cached, seq.lookup

    def _record_hits(self, seq: Sequence, hits: list, restore: Restore | None) -> None:
        """A request's first admission: the prompt tokens each tier served, on the request and the tiers."""
        blocks_by_tier = {"hot": 0}
        for hit in hits:
            tier = self.kv.hit_tier(hit)
            blocks_by_tier[tier] = blocks_by_tier.get(tier, 0) + 1
        for name, blocks in (restore.by_tier if restore else {}).items():
            blocks_by_tier[name] = blocks_by_tier.get(name, 0) + blocks
        bs = self.kv.block_size
        if self.tiers is not None:
            count_lookup([self.tiers.hot, *self.tiers.lower], blocks_by_tier, seq.num_prompt_tokens, bs)
        req = seq.request
        req.cached_tokens_by_tier = {name: blocks * bs for name, blocks in blocks_by_tier.items()}
        req.num_cached_tokens = sum(req.cached_tokens_by_tier.values())
        self.prefix_cache_queries += seq.num_prompt_tokens
        self.prefix_cache_hits += req.num_cached_tokens

    def _make_room(self, seq: Sequence, n: int, cached: list = ()) -> int:
        """With far blocks: offloads old blocks of the running sequences (with `offload_others` off, only
        those of seq's own request) until seq's n new tokens fit in the hot pool, or as many as can go;
        returns the new tokens that fit now (at most n)."""
        if self.kv.far is None:
            return 0
        need = self.kv.num_blocks_needed(seq, n, cached) - self.kv.allocatable(cached)
        holders = self.running if self.offload_others else [s for s in self.running if s.request is seq.request]
        self.kv.offload(need, holders if seq in holders else [*holders, seq])
        return min(n, self.kv.max_new_tokens(seq, cached))

    def _pick_victim(self, scheduled: dict[Sequence, int], current: Sequence) -> Sequence:
        candidates = [s for s in self.running if s not in scheduled and s is not current]
        return max(candidates, key=lambda s: s.admit_order) if candidates else current

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        slots = None
        if self.tiers is not None and not any(self.kv.is_far(b) for b in seq.block_table):
            slots = self.tiers.reserve_swap(len(seq.block_table))  # with far blocks: recomputed, from the cache
        if slots is not None:  # the blocks' data is read out before anything is written into them
            self.kv.moves.extend(BlockMove(SWAP_OUT, b.block_id, slot) for b, slot in zip(seq.block_table, slots))
            seq.swapped = Restore(0, seq.num_computed_tokens, swap_slots=slots)
            self.num_swaps += 1
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and free its blocks. Idempotent."""
        if seq.is_finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.free(seq)
        if self.tiers is not None:
            self.tiers.drop_swap(seq.swapped)
        seq.swapped = seq.lookup = None
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason


class _StageBudget:
    """Where far blocks are staged for attention (far_stage.py), bounds the far blocks one step stages
    to `cap` (one sequence always goes, however many it has), so the staging buffer stays bounded.
    Sequences with far blocks take turns: the one that waited longest goes first."""

    def __init__(self, cap: int | None, kv: KVCacheManager, step: int):
        self.cap, self.kv, self.step = cap, kv, step
        self.used = 0

    def _far(self, seq: Sequence) -> int:
        return sum(1 for b in seq.block_table if self.kv.is_far(b))

    def order(self, seqs: list[Sequence]) -> list[Sequence]:
        if self.cap is None:
            return seqs
        return sorted(seqs, key=lambda s: (self._far(s) > 0, s.last_staged_step))  # stable: near ones first

    def admits(self, seq: Sequence) -> bool:
        return self.cap is None or not self.used or self.used + self._far(seq) <= self.cap

    def add(self, seq: Sequence) -> None:
        if self.cap is not None:
            far = self._far(seq)
            self.used += far
            if far:
                seq.last_staged_step = self.step
