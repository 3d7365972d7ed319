"""Continuous batching under a per-step token budget: decodes first, chunked prefill, preemption."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from tieredkv.kv_manager import BlockCopy, KVCacheManager
from tieredkv.sequence import Sequence, SeqStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]  # (sequence, number of tokens to compute this step)
    block_copies: list[BlockCopy]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """FCFS admission from `waiting`; `running` is kept in admission order.

    Each step: running sequences that decode are served first, then running ones mid-prefill, then
    waiting ones, while the token budget and max_num_seqs allow. When the pool runs dry, the most
    recently admitted running sequence not yet scheduled this step is preempted (its blocks freed,
    recomputed later) and goes back to the front of `waiting`.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admit_counter = itertools.count()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this step
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self._pick_victim(scheduled, seq)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled[seq] = n
                budget -= n

        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            forks = seq.request.pending_forks if seq.num_computed_tokens == 0 and seq.index == 0 else 0
            if len(self.running) + 1 + forks > self.max_num_seqs and self.running:
                break
            cached = self.kv.find_cached_prefix(seq)
            num_cached = len(cached) * self.kv.block_size
            n = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq, n, cached):
                break
            self.waiting.popleft()
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = num_cached
                self.prefix_cache_queries += seq.num_prompt_tokens
                self.prefix_cache_hits += num_cached
            self.add_running(seq)
            scheduled[seq] = n
            budget -= n
        return SchedulerOutput(list(scheduled.items()), self.kv.take_copies(), preempted)

    def _pick_victim(self, scheduled: dict[Sequence, int], current: Sequence) -> Sequence:
        candidates = [s for s in self.running if s not in scheduled and s is not current]
        return max(candidates, key=lambda s: s.admit_order) if candidates else current

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
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
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
