"""Continuous batching under a per-step token budget: decodes first, chunked prefill, preemption."""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from tieredkv.core.cache_index import CacheIndex
from tieredkv.core.far_blocks import Room
from tieredkv.core.kv_manager import KVCacheManager
from tieredkv.core.sequence import Sequence, SeqStatus
from tieredkv.hashing import BlockHash
from tieredkv.tiers.lookup import Lookup, count_lookup, describe
from tieredkv.tiers.manager import TierManager
from tieredkv.tiers.moves import BlockMove, Restore


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


class _Wait(enum.Enum):
    """Why a waiting sequence's prefix is not ready to be admitted this step."""

    NOT_READY = "a blocking tier's read is in flight"
    JOINING = "another sequence is computing its next block"


@dataclass
class _Step:
    """What one schedule() call has decided so far."""

    budget: int
    scheduled: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    on_disk: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.scheduled[seq] = n
        self.budget -= n


class Scheduler:
    """Admission from `waiting` in `policy`'s order ("shortest_prefill": the least prompt left to compute first,
    a preempted sequence first, none overtaken more than 2 x max_num_seqs times; "fcfs": arrival order);
    `running` is kept in admission order.

    Each step: running sequences that decode are served first, then running ones mid-prefill, then
    waiting ones, while the token budget and max_num_seqs allow. When the pool runs dry, the most
    recently admitted running sequence not yet scheduled this step is preempted (with its beams, for a
    beam search) and goes back to the front of `waiting`: its blocks are swapped to the warm tier when it
    has room, else freed and recomputed later. A waiting sequence whose prefix is being read from the
    cold tier is passed over until the read finishes, so the disk never holds up a step that has work
    to compute. So is one whose next prompt block a running sequence is computing now (in-flight prefix
    sharing): it is admitted once those blocks are cached, so a prefix that several requests bring at
    once is computed by the first of them only.

    `room` is where a dry pool may make room without preempting (core/far_blocks.py: old blocks of running
    sequences moved below hot, before or instead of a preemption, as its policy says), and where a prefix found
    below hot that hot cannot hold is adopted in place; without one, a dry pool preempts.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, tiers: TierManager,
                 index: CacheIndex, room: Room | None = None,
                 policy: Literal["shortest_prefill", "fcfs"] = "fcfs"):
        self.kv = kv
        self.tiers = tiers
        self.index = index  # where a waiting sequence's prefix is: the pool, then the tiers below
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.room = room or Room(kv)
        self.policy = policy
        self.max_draft_rows: int | None = None  # the most rows a step with drafts may compute (_fit_draft_rows)
        self.admit_window = 2 * max_num_seqs  # waiting sequences the policy orders (the rest follow in arrival order)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admit_counter = itertools.count()
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions whose blocks went to the warm tier instead of being recomputed
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_computed = 0  # prompt tokens scheduled for a forward (recomputation included)
        self.prefix_blocks_joined = 0  # prompt blocks a sequence took from the cache after waiting for them
        self._computing: dict[BlockHash, Sequence] = {}  # prompt blocks of running sequences, by hash

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
        """This step's sequences and token counts, and the block moves to carry out before its forward."""
        step = _Step(self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._admit_waiting(step)
        self._fit_draft_rows(step)
        if not step.scheduled and not step.preempted and self.waiting and self.running:
            self._unpark(step)
        self.prompt_tokens_computed += sum(min(n, max(s.num_prompt_tokens - s.num_computed_tokens, 0))
                                           for s, n in step.scheduled.items())
        return SchedulerOutput(list(step.scheduled.items()), self.kv.take_moves(), step.preempted, step.on_disk,
                               step.admitted)

    # -- running sequences ------------------------------------------------------------------------

    def _schedule_running(self, step: _Step) -> None:
        """Decodes first, then prefill chunks, each given its blocks (offloading or preempting for them)."""
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decoding + prefilling:
            if step.budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this step
                continue
            if seq.spec_tokens and self._fit_drafts(seq, step.budget):
                step.add(seq, 1 + len(seq.spec_tokens))
                continue
            n = self._fit_running(seq, min(seq.num_tokens - seq.num_computed_tokens, step.budget), step)
            if n:
                step.add(seq, n)

    def _fit_drafts(self, seq: Sequence, budget: int) -> bool:
        """Blocks for a decoding sequence's token and its drafts (engine/speculative.py), as many drafts as the
        budget leaves room for. Drafts never offload or preempt anything: where they do not fit from free blocks,
        they are dropped and the sequence decodes as usual."""
        del seq.spec_tokens[max(budget - 1, 0) :]
        if seq.spec_tokens and self.kv.allocate_slots(seq, 1 + len(seq.spec_tokens)):
            return True
        seq.spec_tokens = []
        return False

    def _fit_running(self, seq: Sequence, n: int, step: _Step) -> int:
        """Allocates blocks for n new tokens of seq; returns how many fit (0: seq itself was preempted)."""
        if self.kv.allocate_slots(seq, n):
            return n
        fitting = self.room.before_preempting(seq, n, self.running)
        if fitting and self.kv.allocate_slots(seq, fitting):
            return fitting
        while True:
            victim = self._pick_victim(step.scheduled, seq)
            fitting = self.room.instead_of_preempting(seq, victim, n, self.running)
            if fitting and self.kv.allocate_slots(seq, fitting):
                return fitting
            for s in self._group(victim, step):
                self._preempt(s)
                step.preempted.append(s)
            if seq.status is not SeqStatus.RUNNING:  # seq was the victim, or one of its beams
                return 0
            if self.kv.allocate_slots(seq, n):
                return n

    def _fit_draft_rows(self, step: _Step) -> None:
        """With `max_draft_rows` (quantized weights on CPU: the most rows their integer kernels take, more going
        through a dequantized fp32 product; the native step's rows, where it serves), drafts never carry a step
        past it: the step's rows then go through the kernels a step without drafts would use, so the tokens come
        out as plain decoding's. Drafts are cut from the last sequences first; the blocks they took are freed after
        the step (KVCacheManager.trim)."""
        if self.max_draft_rows is None:
            return
        total = sum(step.scheduled.values())
        drafts = sum(len(s.spec_tokens) for s in step.scheduled)
        if not drafts or total <= self.max_draft_rows or total - drafts > self.max_draft_rows:
            return
        over = total - self.max_draft_rows
        for seq in reversed(list(step.scheduled)):
            cut = min(over, len(seq.spec_tokens))
            if cut:
                del seq.spec_tokens[len(seq.spec_tokens) - cut :]
                step.scheduled[seq] -= cut
                step.budget += cut
                over -= cut
            if not over:
                return

    # -- waiting sequences ------------------------------------------------------------------------

    def _admit_waiting(self, step: _Step) -> None:
        """Admits waiting sequences in order while they fit; one whose cold read is in flight is passed over."""
        for seq in self._admission_order():
            if step.budget == 0:
                break
            forks = seq.request.pending_forks if seq.num_computed_tokens == 0 and seq.index == 0 else 0
            if len(self.running) + 1 + forks > self.max_num_seqs and self.running:
                break
            cached, restore = self._prefix_for(seq)
            if restore is _Wait.NOT_READY:
                step.on_disk.append(seq)
                continue
            if restore is _Wait.JOINING:
                if seq.joined_from is None:
                    seq.joined_from = len(cached)
                continue
            if not self._admit(seq, cached, restore, step):
                break

    def _admission_order(self) -> list[Sequence]:
        """The order admission tries the waiting sequences in. "fcfs": arrival (a preempted sequence is back
        at the front). "shortest_prefill": within the first admit_window, those that ran before (decoded or
        swapped out) and those overtaken by admit_window later arrivals first, then the least prompt left to
        compute, arrival order among equals: requests on a cached prefix start at once, beside a long
        new prompt rather than behind it. Either way a beam search's waiting beams follow its first one (a
        search steps when all its beams run: two searches' beams interleaved could each hold half the pool)."""
        order = list(self.waiting)
        if self.policy != "fcfs" and len(order) > 1:
            window = order[: self.admit_window]
            window.sort(key=lambda s: (0, 0) if s.swapped is not None or s.num_output_tokens
                        or s.passed_over >= self.admit_window else (1, self._prefill_left(s)))
            order[: self.admit_window] = window
        groups: dict[int, list[Sequence]] = {}
        for seq in order:
            groups.setdefault(id(seq.request) if seq.request.beam is not None else id(seq), []).append(seq)
        return order if len(groups) == len(order) else [s for group in groups.values() for s in group]

    def _prefill_left(self, seq: Sequence) -> int:
        """Tokens seq would compute after its prefix in the pool, counting blocks being computed as cached."""
        if not self.kv.enable_caching:
            return seq.num_tokens - seq.num_computed_tokens
        n = len(self.index.pool_prefix(self.kv.lookup_keys(seq)))
        while self._being_computed(seq, n):
            n += 1
        return seq.num_tokens - n * self.kv.block_size

    def _admit(self, seq: Sequence, cached: list, restore: "Restore | Lookup | None", step: _Step) -> bool:
        """Gives seq its cached prefix, what a finished lookup found below hot (promoted into hot, or taken where it
        is when hot cannot hold it: self.room.take_found) or its swapped blocks, and blocks for its first chunk.
        Returns False, holding nothing, when it does not fit now."""
        promoting, below = isinstance(restore, Lookup), False
        if isinstance(restore, Lookup):  # room for what it found, before taking anything from the tiers
            fits_hot = self._lookup_fits(seq, cached, restore, step.budget)
            if fits_hot is None:
                return False  # the finished lookup stays for the next attempt
            below = not fits_hot
            seq.lookup = None
            taken = self.tiers.finish_lookup(restore, len(cached))  # at most what it found (and how it was read)
            if seq.request.cache_decision is None:
                seq.request.cache_decision = describe(restore.decision, restore.blocking, self.kv.block_size)
        else:
            taken = restore
        hits, cached, into_hot = self.room.take_found(seq, cached, taken, below)
        n = self._fit_waiting(seq, cached, into_hot, step.budget)
        if n is None:
            if promoting:  # cannot happen after can_allocate; never leak a taken slot
                self.tiers.drop_restore(into_hot)
            self.kv.free(seq)  # (holds blocks taken below hot only if the room took them; then cannot happen either)
            return False  # a swapped sequence keeps its swap slots for the next attempt
        self.waiting.remove(seq)
        seq.swapped = None
        if seq.request.num_cached_tokens is None:
            self._record_hits(seq, hits, taken)
        if seq.joined_from is not None:
            self.prefix_blocks_joined += max(len(hits) - seq.joined_from, 0)
            seq.joined_from = None
        self.add_running(seq)
        self._claim(seq)
        if self.policy != "fcfs":
            for other in itertools.islice(self.waiting, self.admit_window):
                other.passed_over += other.seq_id < seq.seq_id
        step.admitted.append(seq)
        step.add(seq, n)
        return True

    def _lookup_fits(self, seq: Sequence, cached: list, lookup: Lookup, budget: int) -> bool | None:
        """Whether the blocks a finished lookup found fit in hot beside seq's first chunk. False: they do
        not, and stay below hot in place (room was made for the chunk); None: neither fits now."""
        bs, found = self.kv.block_size, lookup.num_blocks()
        n = min(seq.num_tokens - (len(cached) + found) * bs, budget)
        if self.kv.can_allocate(seq, n, cached, found, found * bs):
            return True
        return False if self.room.make_room(seq, 1, self.running, cached) > 0 else None

    def _fit_waiting(self, seq: Sequence, cached: list, restore: Restore | None, budget: int) -> int | None:
        """Allocates seq's first chunk after its prefix; returns its tokens, or None when it does not fit."""
        done = seq.num_computed_tokens + len(cached) * self.kv.block_size + (restore.num_tokens if restore else 0)
        n = min(seq.num_tokens - done, budget)
        if restore is None and not self.kv.can_allocate(seq, n, cached):
            n = self.room.make_room(seq, n, self.running, cached)
            if n == 0:
                return None
        return n if self.kv.allocate_slots(seq, n, cached, restore) else None

    def _prefix_for(self, seq: Sequence) -> tuple[list, Restore | Lookup | _Wait | None]:
        """Hot prefix blocks plus what to restore below them: a swapped-out sequence's table, a finished lookup's
        promotion, or nothing. Returns _Wait.NOT_READY while a blocking tier's read is in flight."""
        if seq.swapped is not None:
            return [], seq.swapped
        if not self.kv.enable_caching:
            return [], None
        keys = self.kv.lookup_keys(seq)
        cached = self.index.pool_prefix(keys)
        if seq.lookup is None:
            if self._being_computed(seq, len(cached)):
                return cached, _Wait.JOINING
            seq.lookup = self.index.start_lookup(keys, len(cached))
            if seq.lookup is None:
                return cached, None
        if not seq.lookup.ready:
            return cached, _Wait.NOT_READY
        if seq.lookup.start != len(cached):  # hot changed while it waited: look again
            seq.lookup = None
            return self._prefix_for(seq)
        return cached, seq.lookup

    # -- in-flight prefix sharing -----------------------------------------------------------------

    def _claim(self, seq: Sequence) -> None:
        """Registers the prompt blocks seq will compute (its hashed full blocks past the computed ones),
        unless another running sequence computes them already."""
        for i in range(seq.num_computed_tokens // self.kv.block_size, len(seq.block_hashes)):
            h = seq.block_hashes[i]
            if not self._computes(self._computing.get(h), i, h):
                self._computing[h] = seq

    def _computes(self, sharer: Sequence | None, i: int, h: BlockHash) -> bool:
        """Whether sharer is running and has block i (hashed h) still to compute."""
        return (sharer is not None and sharer.status is SeqStatus.RUNNING and i < len(sharer.block_hashes)
                and sharer.block_hashes[i] == h and sharer.num_computed_tokens < (i + 1) * self.kv.block_size)

    def _being_computed(self, seq: Sequence, i: int) -> bool:
        """Whether seq's prompt block i, the first its cached prefix lacks, is being computed by a running
        sequence (whose blocks seq will then find cached)."""
        if self.kv.block_size * (i + 1) > seq.num_prompt_tokens or i >= len(seq.block_hashes):
            return False
        h = seq.block_hashes[i]
        return self._computes(self._computing.get(h), i, h)

    def _release(self, seq: Sequence) -> None:
        """seq stops running: the blocks it claimed are no longer in flight."""
        for h in seq.block_hashes:
            if self._computing.get(h) is seq:
                del self._computing[h]

    def _record_hits(self, seq: Sequence, hits: list, restore: Restore | None) -> None:
        """A request's first admission: the prompt tokens each tier served, on the request and the tiers."""
        blocks_by_tier = {"hot": 0}
        for hit in hits:
            tier = self.kv.pool.tier_of(hit)
            blocks_by_tier[tier] = blocks_by_tier.get(tier, 0) + 1
        for name, blocks in (restore.by_tier if restore else {}).items():
            blocks_by_tier[name] = blocks_by_tier.get(name, 0) + blocks
        bs = self.kv.block_size
        count_lookup([self.tiers.hot, *self.tiers.lower], blocks_by_tier, seq.num_prompt_tokens, bs)
        req = seq.request
        req.cached_tokens_by_tier = {name: blocks * bs for name, blocks in blocks_by_tier.items()}
        req.num_cached_tokens = sum(req.cached_tokens_by_tier.values())
        self.prefix_cache_queries += seq.num_prompt_tokens
        self.prefix_cache_hits += req.num_cached_tokens

    def _pick_victim(self, scheduled: dict[Sequence, int], current: Sequence) -> Sequence:
        candidates = [s for s in self.running if s not in scheduled and s is not current]
        return max(candidates, key=lambda s: s.admit_order) if candidates else current

    def _unpark(self, step: _Step) -> None:
        """Nothing could run: every running sequence is a beam that waits for a sibling the pool cannot
        admit beside them. They step back to be recomputed (their blocks stay cached), so the group can
        be admitted together."""
        for seq in [s for s in self.running if s.parked]:
            self._preempt(seq)
            step.preempted.append(seq)

    def _group(self, victim: Sequence, step: _Step) -> list[Sequence]:
        """What preempting victim takes: with beam search, its running beams too (a search advances only
        when all its beams have run), except those this step already scheduled."""
        if victim.request.beam is None:
            return [victim]
        return [victim] + [s for s in victim.request.seqs if s is not victim and s.status is SeqStatus.RUNNING
                           and s not in step.scheduled]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_tokens = []
        self._release(seq)
        # one the room's policy cannot swap, or a beam waiting for its siblings (nothing left to compute): recomputed,
        # from the cache
        if self.room.swappable(seq) and not seq.parked:
            seq.swapped = self.kv.swap_out(seq)
            if seq.swapped is not None:
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
            self._release(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.free(seq)
        self.tiers.drop_restore(seq.swapped)
        seq.swapped = seq.lookup = None
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
