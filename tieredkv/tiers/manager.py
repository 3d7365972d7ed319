"""Moves blocks between tiers: demotes on eviction, promotes on a hit, swaps preempted sequences.

Runs on the engine's worker thread, except cold-tier reads, which run in a reader thread and are
polled: a request whose prefix is being read from disk waits while the others compute. Planning
(lookups, swap slots) happens while the scheduler decides; the data moves in `execute`, in one place
before the forward.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tieredkv.tiers.base import TIER_NAMES, BlockKey, TierStats
from tieredkv.tiers.hot import HotTier
from tieredkv.tiers.moves import COPY, DEMOTE, PROMOTE, SWAP_IN, SWAP_OUT, BlockMove, Restore, runs
from tieredkv.tiers.warm import WarmTier

if TYPE_CHECKING:
    from tieredkv.tiers.cold import ColdTier

log = logging.getLogger("tieredkv")
_BATCH = 256  # blocks per transfer when a whole tier moves


def _batches(items: list) -> list[list]:
    return [items[i : i + _BATCH] for i in range(0, len(items), _BATCH)]


@dataclass
class Lookup:
    """A waiting sequence's walk below hot: warm hits at once, cold hits when the read finishes."""

    start: int  # first block index looked up below hot
    keys: list[BlockKey]
    warm: torch.Tensor | None
    cold: Future | None

    @property
    def ready(self) -> bool:
        return self.cold is None or self.cold.done()


class TierManager:
    def __init__(self, hot: HotTier, warm: WarmTier | None, cold: "ColdTier | None", block_size: int):
        self.hot = hot
        self.warm = warm
        self.cold = cold
        self.block_size = block_size
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredkv-cold-read") if cold else None

    def _present(self) -> dict[str, object]:
        return {name: t for name, t in (("hot", self.hot), ("warm", self.warm), ("cold", self.cold)) if t is not None}

    def tiers(self) -> dict[str, TierStats]:
        """Each present tier's counters, with its current use."""
        return {name: t.stats() for name, t in self._present().items()}

    # -- carrying out a step's moves ----------------------------------------------------------------

    def execute(self, moves: list[BlockMove]) -> None:
        """Carries out the moves in order, each run of one kind as one batched transfer."""
        hot, warm = self.hot, self.warm
        for run in runs(moves):
            kind = run[0].kind
            if kind == DEMOTE:
                self._demote([m.src for m in run], [m.key for m in run])
            elif kind == SWAP_OUT:
                warm.write([m.dst for m in run], hot.gather([m.src for m in run]))
                warm.counters.demotions += len(run)
            elif kind == SWAP_IN:
                slots = [m.src for m in run]
                hot.scatter([m.dst for m in run], warm.read(slots))
                warm.release(slots)
            elif kind == PROMOTE:
                hot.scatter([m.dst for m in run], torch.stack([m.data for m in run]))
                for m in run:
                    self._present()[m.tier].counters.promotions += 1
            elif kind == COPY:
                hot.copy([m.src for m in run], [m.dst for m in run])
            else:
                raise ValueError(f"unknown block move {kind!r}")

    def _demote(self, block_ids: list[int], keys: list[BlockKey]) -> None:
        """Write-back of evicted hot blocks: to warm (whose own evictions go on to cold), else to cold."""
        self.hot.counters.evictions += len(block_ids)
        if self.warm is None and self.cold is None:
            return
        try:
            data = self.hot.gather(block_ids)
            if self.warm is not None and self.warm.capacity:
                stored, victims = self.warm.admit(keys, data)
                self.warm.counters.demotions += stored
                self._to_cold(*victims)
            else:
                self._to_cold(keys, data.cpu())
        except Exception:  # a failed demotion loses cache, never correctness
            log.exception("demotion from hot failed")
            self.hot.counters.failures += 1

    def _to_cold(self, keys: list[BlockKey], blocks: torch.Tensor | None) -> None:
        """Queues blocks (on the host, never changed afterwards) for the cold tier's writer."""
        if self.cold is None or not keys:
            return
        try:
            self.cold.put_nowait(keys, blocks)
            self.cold.counters.demotions += len(keys)
        except Exception:
            log.exception("demotion to cold failed")
            self.cold.counters.failures += 1

    # -- promotion --------------------------------------------------------------------------------

    def start_lookup(self, keys: list[BlockKey], start: int) -> Lookup | None:
        """Looks keys[start:] up in warm (now) and cold (in the reader thread), head first."""
        rest = keys[start:]
        if not rest or (self.warm is None and self.cold is None):
            return None
        warm = self.warm.get_sync(rest) if self.warm is not None else None
        n_warm = 0 if warm is None else warm.shape[0]
        cold = None
        if self.cold is not None and n_warm < len(rest):
            cold = self._reader.submit(self.cold.get_sync, rest[n_warm:])
        return Lookup(start, rest, warm, cold)

    def wait(self, lookups: list[Lookup], timeout: float) -> None:
        """Blocks until one of the pending cold reads finishes (used only when nothing can compute)."""
        pending = [lk.cold for lk in lookups if lk.cold is not None and not lk.cold.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def finish_lookup(self, lookup: Lookup, num_hot: int) -> Restore | None:
        """Turns a finished lookup into a promotion that continues the hot hits; None if it cannot."""
        parts, by_tier = [], {}
        if lookup.warm is not None:
            parts.append(lookup.warm)
            by_tier["warm"] = lookup.warm.shape[0]
        cold = None
        if lookup.cold is not None:
            try:
                cold = lookup.cold.result()
            except Exception:
                log.exception("cold read failed")
                self.cold.counters.failures += 1
        if cold is not None:
            parts.append(cold)
            by_tier["cold"] = cold.shape[0]
        if not parts or num_hot != lookup.start:  # hot changed while we waited: no gap allowed
            return None
        data = torch.cat(parts) if len(parts) > 1 else parts[0]
        n = data.shape[0]
        return Restore(lookup.start, n * self.block_size, data, lookup.keys[:n], by_tier)

    def count_lookup(self, num_hot: int, by_tier: dict[str, int], num_queried_tokens: int) -> None:
        """Records a request's first admission: hits per tier, and misses of what each tier was asked."""
        bs = self.block_size
        remaining = num_queried_tokens
        for name, n in (("hot", num_hot), ("warm", by_tier.get("warm", 0)), ("cold", by_tier.get("cold", 0))):
            tier = self._present().get(name)
            if tier is None:
                continue
            tier.counters.hits += n * bs
            tier.counters.misses += remaining - n * bs
            remaining -= n * bs

    # -- swap -------------------------------------------------------------------------------------

    def reserve_swap(self, n: int) -> list[int] | None:
        """n warm slots for a preempted sequence's blocks (SWAP_OUT moves fill them); None: no room.
        Cached warm entries evicted to make room go on to cold now."""
        if self.warm is None or n == 0:
            return None
        slots, victims = self.warm.reserve(n)
        self._to_cold(*victims)
        return slots

    def drop_swap(self, restore: Restore | None) -> None:
        if restore is not None and restore.swap_slots is not None:
            self.warm.release(restore.swap_slots)
            restore.swap_slots = None

    # -- management -------------------------------------------------------------------------------

    def clear(self, tier: str, demote: bool = False) -> int:
        """Empties "hot" (cached free blocks), "warm", "cold" or "all"; returns the entries removed.
        demote=True moves hot or warm entries to the next tier down instead (not with "all")."""
        if tier not in (*TIER_NAMES, "all"):
            raise ValueError(f"tier must be one of hot, warm, cold, all; got {tier!r}")
        if demote and tier == "all":
            raise ValueError('demote=True needs a single tier, not "all"')
        return sum(self._clear(t, demote) for t in (TIER_NAMES if tier == "all" else (tier,)))

    def _clear(self, tier: str, demote: bool) -> int:
        if tier == "hot":
            if demote:
                for part in _batches([b for b in self.hot.pool.free_queue if b.block_hash is not None]):
                    self._demote([b.block_id for b in part], [BlockKey(b.block_hash, b.token_ids) for b in part])
            return self.hot.pool.evict_all_cached()
        if tier == "warm" and self.warm is not None:
            if demote:
                for keys, data in self._warm_batches():
                    self._to_cold(keys, data)
            return self.warm.clear()
        if tier == "cold" and self.cold is not None:
            return self.cold.clear()
        return 0

    def persist(self) -> int:
        """Writes every cached hot and warm block to the cold tier (at shutdown), so that a restarted
        engine on the same cold_path finds them. Returns the number of blocks queued."""
        if self.cold is None:
            return 0
        n = 0
        for part in _batches(list(self.hot.pool.cached.values())):
            self.cold.put_nowait([BlockKey(b.block_hash, b.token_ids) for b in part],
                                 self.hot.gather([b.block_id for b in part]).cpu())
            n += len(part)
        for keys, data in self._warm_batches():
            self.cold.put_nowait(keys, data)
            n += len(keys)
        return n

    def _warm_batches(self):
        """(keys, data copied out of the slab) for every warm entry, in batches."""
        if self.warm is None:
            return
        for part in _batches(list(self.warm.entries.items())):
            slots = torch.tensor([slot for _, (slot, _) in part])
            yield [BlockKey(h, tokens) for h, (_, tokens) in part], self.warm.slab[slots]

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self.cold is not None:
            self.cold.close_sync()
