"""Moves blocks between tiers: demotes on eviction, promotes on a hit, swaps preempted sequences.

Runs on the engine's worker thread, except reads from blocking tiers (cold), which run in a reader
thread and are polled: a request whose prefix is being read from disk waits while the others compute.
Planning (lookups, lent slots) happens while the scheduler decides; the data moves in `execute`, in
one place before the forward. Below hot, every tier is used only through the KVTier contract (plus
SwapSpace for the tier that lends slots), top to bottom.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import torch

from tieredkv.tiers.base import TIER_NAMES, BlockKey, KVTier, SwapSpace, TierStats
from tieredkv.tiers.hot import HotTier
from tieredkv.tiers.lookup import Lookup, finish_lookup, start_lookup
from tieredkv.tiers.moves import (COPY, DEMOTE, OFFLOAD, PASS_DOWN, PROMOTE, SWAP_OUT, BlockMove, Restore,
                                  runs)
from tieredkv.tiers.policy import Admission
from tieredkv.tiers.rates import LoadRates
from tieredkv.tiers.warm import WarmTier

log = logging.getLogger("tieredkv")
_BATCH = 256  # blocks per transfer when a whole tier moves


class TierManager:
    def __init__(self, hot: HotTier, warm: WarmTier | None, cold: KVTier | None, block_size: int,
                 remote: KVTier | None = None, admission: Admission | None = None):
        self.hot, self._warm = hot, warm
        self.io = hot.io  # the bytes of the pool and of the warm slab move as one plane's ops (tiers/block_io.py)
        if warm is not None:
            warm.join(self.io)
        self.lower: list[KVTier] = [t for t in (warm, remote, cold) if t is not None]  # top to bottom
        self.shared = [t for t in self.lower if t.shared]
        self.block_size = block_size
        self.swap: SwapSpace | None = next((t for t in self.lower if isinstance(t, SwapSpace)), None)
        blocking = [t for t in self.lower if t.blocking]
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredkv-tier-read") if blocking else None
        device = hot.kv_cache.device
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._last_copy = None  # CUDA event after the last moves' copies
        self._unreleased: list[tuple[SwapSpace, list[int]]] = []  # slots read by copies maybe still in flight
        self.rates = LoadRates(block_size)  # load or recompute, for the blocking tiers (tiers/rates.py)
        self.admission = admission or Admission(hot.pool.popularity)  # what cold and remote take (tiers/policy.py)

    @property
    def warm(self) -> WarmTier | None:
        return self._warm

    @property
    def cold(self) -> KVTier | None:
        return self.tier("cold")

    def tier(self, name: str) -> KVTier | None:
        return self.hot if name == "hot" else next((t for t in self.lower if t.name == name), None)

    def lender(self, name: str) -> SwapSpace:
        """The tier of that name, one that lends slots (moves and restores that name slots name such a tier)."""
        tier = self.tier(name)
        assert isinstance(tier, SwapSpace), name
        return tier

    def stats(self) -> dict[str, TierStats]:
        """Each present tier's counters, with its current use."""
        return {t.name: t.stats() for t in (self.hot, *self.lower)}

    # -- carrying out a step's moves ----------------------------------------------------------------

    def execute(self, moves: list[BlockMove]) -> None:
        """Carries out the moves in order, each run of one kind as one batched transfer (block ops: under tensor
        parallelism they go to every rank with the step's rows, and run there and here before the forward). On
        CUDA they run on a copy stream that the forward's stream then waits for (H2D from pinned slab views is
        asynchronous; slots read that way are released once the copies are done)."""
        self._settle()
        if not moves:
            return
        with self._on_copy_stream(), self.io.hold():
            for run in runs(moves):
                self._execute_run(run[0].kind, run)
        if self._copy_stream is None:
            self._settle(flush=False)  # (ops held for the step's message read the slots before anything reuses them)

    def _execute_run(self, kind: str, run: list[BlockMove]) -> None:
        hot, dst = self.hot, [m.dst for m in run]
        if kind == DEMOTE:
            self._demote([m.src for m in run], [m.key for m in run])
        elif kind == PASS_DOWN:  # entries the warm tier evicted while planning: read from the slots lent on
            for part in runs(run, lambda m: m.tier):
                lender = self.lender(part[0].tier)
                lender.read_later([m.src for m in part], self._below(lender, [m.key for m in part]))
        elif kind in (SWAP_OUT, OFFLOAD):  # into swap slots, or far blocks' slots
            slots = dst if kind == SWAP_OUT else [self.hot.pool.slot_of(d) for d in dst]
            self.swap.from_hot([m.src for m in run], slots)
            self.swap.count(demotions=len(run))
            self._wait_for_host_copies()
        elif kind == PROMOTE:
            pool = self.hot.pool
            for part in runs(run, lambda m: (m.tier, m.src is None, pool.is_far_id(m.dst))):
                tier, ids = self.tier(part[0].tier), [m.dst for m in part]
                if pool.is_far_id(ids[0]):  # data read from below, into far blocks' warm slots
                    self.swap.write([pool.slot_of(i) for i in ids], torch.stack([m.data for m in part]))
                elif part[0].src is None:
                    hot.scatter(ids, torch.stack([m.data for m in part]))
                else:
                    slots, lender = [m.src for m in part], self.lender(part[0].tier)
                    lender.to_hot(ids, slots)
                    self._unreleased.append((lender, slots))
                tier.count(promotions=len(part))
        elif kind == COPY:
            hot.copy([m.src for m in run], dst)
        else:
            raise ValueError(f"unknown block move {kind!r}")

    @contextlib.contextmanager
    def _on_copy_stream(self):
        stream = self._copy_stream
        if stream is None:
            yield
            return
        compute = torch.cuda.current_stream(stream.device)
        stream.wait_stream(compute)  # the blocks read here were written by earlier forwards
        with torch.cuda.stream(stream):
            yield
        self._last_copy = stream.record_event()
        compute.wait_event(self._last_copy)  # the forward waits for the moves, the host does not

    def _wait_for_host_copies(self) -> None:
        """Device-to-host copies into a slab must land before the host reads the slab."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def _settle(self, flush: bool = True) -> None:
        """Releases slots whose data copies have finished (waiting for the last copies on CUDA); first runs block
        ops still held (`flush`)."""
        if self._last_copy is not None:
            self._last_copy.synchronize()
            self._last_copy = None
        if flush:
            self.io.flush()  # (ops of a step without a forward, under tensor parallelism)
        for tier, slots in self._unreleased:
            tier.release(slots)
        self._unreleased.clear()

    def _demote(self, block_ids: list[int], keys: list[BlockKey]) -> None:
        """Write-back of evicted hot blocks to the first lower tier; its evictions go on down."""
        self.hot.count(evictions=len(block_ids))
        if not self.lower:
            self.hot.note_dropped(k.block_hash for k in keys)
            return
        try:
            top = self.lower[0]
            if top is self.swap:  # warm: from the pool straight into its slots (on every rank, under TP)
                top.count(demotions=top.admit_from_hot(block_ids, keys, lambda k, data: self._admit(1, k, data)))
            else:
                self.io.gather(block_ids, lambda data: self._admit(0, keys, data.cpu()))
            self._wait_for_host_copies()
        except Exception:  # a failed demotion loses cache, never correctness
            log.exception("demotion from hot failed")
            self.hot.count(failures=1)

    def _below(self, tier: KVTier, keys: list[BlockKey]):
        """What takes `keys`' data read from `tier` as the step's ops run: the tiers below it."""
        return lambda data: self._admit(self.lower.index(tier) + 1, keys, data)

    def _admit(self, level: int, keys: list[BlockKey], blocks: torch.Tensor | None) -> None:
        """Stores blocks in self.lower[level], passing what it evicts to the next level down."""
        while level < len(self.lower) and keys:
            tier = self.lower[level]
            try:
                taken, data = self._admitted(tier, keys, blocks)
                stored, victims = tier.admit(taken, data) if taken else (0, ([], None))
                tier.count(demotions=stored)
            except Exception:
                log.exception("demotion to %s failed", tier.name)
                tier.count(failures=1)
                if not tier.shared:
                    return
            else:
                if not tier.shared:  # a shared tier stands beside the next: it gets the blocks too
                    keys, blocks = victims
            level += 1
        if keys and (not self.lower or not self.lower[-1].shared):  # evicted from the bottom tier (or no tier
            # below hot): gone; a shared one holds them
            (self.lower[-1] if self.lower else self.hot).note_dropped(k.block_hash for k in keys)

    def _admitted(self, tier: KVTier, keys: list[BlockKey], blocks: torch.Tensor | None,
                  force: bool = False) -> tuple[list[BlockKey], torch.Tensor | None]:
        """The keys (and their blocks) that `tier` admits: all of them for warm, the ones that have earned it for
        the tiers below (tiers/policy.py Admission); the others are counted refused and dropped there."""
        if force or tier is self.swap or self.admission.admits_all:
            return keys, blocks
        keep = [i for i, k in enumerate(keys) if self.admission.admits(k.block_hash)]
        if len(keep) == len(keys):
            return keys, blocks
        tier.count(refused=len(keys) - len(keep))
        kept = set(keep)
        tier.note_dropped((k.block_hash for i, k in enumerate(keys) if i not in kept), self.admission.why_not)
        if not keep:
            return [], None
        return [keys[i] for i in keep], None if blocks is None else blocks[torch.tensor(keep)]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Host copies [n, layers, 2, block_size, kv_heads, head_dim] of blocks by id, hot or far (a far
        block's data is its warm slot's); each run of hot ids is one gather, each run of far ids one read."""
        pool = self.hot.pool
        out = [self.swap.read([pool.slot_of(i) for i in part]) if pool.is_far_id(part[0])
               else self.hot.gather(part).cpu() for part in runs(block_ids, pool.is_far_id)]
        return torch.cat(out) if out else torch.empty(0)

    def publish(self, blocks: list, force: bool = False) -> None:
        """Offers blocks that just became full of computed tokens (KVBlocks of the pool) to the shared
        tiers, which queue the ones they lack and admit (write-behind; `force`: whatever admission says): other
        engines find them from now on."""
        keys = [BlockKey(b.block_hash, b.token_ids) for b in blocks]
        for tier in self.shared:
            admitted = {k.block_hash for k in self._admitted(tier, keys, None, force)[0]}
            want = [i for i in tier.wanted(keys) if keys[i].block_hash in admitted]
            if not want:
                continue
            try:
                data = self.read_blocks([blocks[i].block_id for i in want])
                stored, _ = tier.admit([keys[i] for i in want], data)
                tier.count(demotions=stored)
            except Exception:  # a block not shared loses cache, never correctness
                log.exception("writing new blocks to %s failed", tier.name)
                tier.count(failures=1)

    def share(self, keys: list[BlockKey]) -> int:
        """Offers the cached blocks of the leading keys (a prompt's, in hot or far blocks) to the shared tiers,
        which queue the ones they lack: a request's write-through, for a replica that reads them next. Returns
        how many leading blocks were found here."""
        blocks = self.hot.pool.cached_prefix(keys)
        if blocks and self.shared:
            self.publish(blocks, force=True)
        return len(blocks)

    # -- promotion --------------------------------------------------------------------------------

    def start_lookup(self, keys: list[BlockKey], start: int) -> Lookup | None:
        """Looks keys[start:] up below hot, head first (see lookup.start_lookup)."""
        return start_lookup(self.lower, self._reader, keys[start:], start, self.rates)

    def wait(self, lookups: list[Lookup], timeout: float) -> None:
        """Blocks until one of the pending reads finishes (used only when nothing can compute)."""
        pending = [lk.below for lk in lookups if lk.below is not None and not lk.below.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def finish_lookup(self, lookup: Lookup, num_hot: int) -> Restore | None:
        """The promotion that continues the hot hits, or None (see lookup.finish_lookup)."""
        if num_hot != lookup.start:  # hot changed while we waited: no gap allowed
            return None
        if lookup.late:
            for tier in self.lower:
                if tier.blocking:
                    tier.count(late=1)
                    break
        return finish_lookup(lookup, self.block_size, self.lower[-1])

    # -- swap -------------------------------------------------------------------------------------

    def drop_restore(self, restore: Restore | None) -> None:
        """Gives back what an unused restore holds: the slots lent to it (a swapped-out sequence's, a promotion's)."""
        for part in restore.parts if restore is not None else ():
            if part.slots:
                self.lender(part.tier).release(part.slots)

    # -- management -------------------------------------------------------------------------------

    def clear(self, tier: str, demote: bool = False) -> int:
        """Empties "hot" (cached free blocks), "warm", "remote" (this model's entries on the shared
        server, for every engine using it), "cold" or "all" (this engine's own tiers: a shared one only
        when named); returns the entries removed. demote=True moves a tier's entries to the next tier
        down instead (not with "all")."""
        if tier not in (*TIER_NAMES, "all"):
            raise ValueError(f"tier must be one of {', '.join(TIER_NAMES)}, all; got {tier!r}")
        if demote and tier == "all":
            raise ValueError('demote=True needs a single tier, not "all"')
        self._settle()
        names = [t for t in TIER_NAMES if not getattr(self.tier(t), "shared", False)] if tier == "all" else [tier]
        return sum(self._clear(t, demote) for t in names)

    def _clear(self, name: str, demote: bool) -> int:
        tier = self.tier(name)
        if tier is None:
            return 0
        if demote:
            level = 0 if tier is self.hot else self.lower.index(tier) + 1
            for keys, data in tier.export_sync(_BATCH):
                self._admit(level, keys, data)
        return tier.clear_sync()

    def import_blocks(self, keys: list[BlockKey], blocks: torch.Tensor) -> None:
        """Stores blocks from outside (a cache snapshot) in the first lower tier, or hot without one."""
        if self.lower:
            self._admit(0, keys, blocks)
        else:
            self.hot.put_sync(keys, blocks)

    def persist(self) -> int:
        """Writes every cached block above the durable tier into it (at shutdown), so that a restarted
        engine finds them. Returns the number of blocks queued."""
        self._settle()
        durable = next((t for t in self.lower if t.durable), None)
        if durable is None:
            return 0
        n = 0
        for tier in (self.hot, *(t for t in self.lower[: self.lower.index(durable)] if not t.shared)):
            for keys, data in tier.export_sync(_BATCH):
                keys, data = self._admitted(durable, keys, data)
                if keys:
                    durable.persist_sync(keys, data)  # waits for room where the tier bounds its queue
                n += len(keys)
        return n

    def close(self) -> None:
        self._settle()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        for tier in self.lower:
            tier.close_sync()
