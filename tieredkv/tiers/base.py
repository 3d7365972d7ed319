"""The storage interface every KV tier implements: every method takes a batch; the synchronous methods are the
implementation, and async ones run them on a worker thread for a tier that blocks; one contract for all."""

from __future__ import annotations

import asyncio
import queue
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from collections import OrderedDict
from typing import Any, Callable, ClassVar, Iterable, Iterator, Sequence

import torch

from tieredkv.hashing import BlockHash, BlockKey

TIER_NAMES = ("hot", "warm", "remote", "cold")  # top to bottom (remote, when shared, is written beside cold)


@dataclass
class TierStats:
    """Counters of one tier: `hits` and `misses` count prompt tokens, the moves count blocks.

    Attributes:
        name: "hot", "warm", "remote" or "cold".
        capacity_bytes: the tier's budget.
        used_bytes: what its entries take now.
        hits: prompt tokens served from this tier.
        misses: prompt tokens looked up here and not found (the lookup went on below, or computed them).
        promotions: blocks brought up from this tier (into the hot pool, or into warm slots a long document
            reads in place).
        demotions: blocks written into this tier from the tier above.
        evictions: blocks this tier dropped to make room (passed on below when there is a tier below).
        failures: reads that failed: read errors, failed authentication or header mismatches, each served
            as a miss; for the remote tier also failed or dropped writes (server down, slow or full).
        bytes_read: bytes a tier that moves data over a network (remote) received.
        bytes_written: bytes such a tier sent.
        round_trips: its requests to the server (a pipelined batch is one).
        skipped: blocks of prompts this blocking tier held (or might) that were computed instead of read, because
            reading them was expected to take longer than computing them (tiers/rates.py).
        late: reads of this tier given up at their deadline (the time computing the blocks takes).
        refused: blocks that would have been written here that admission kept out (cold and remote: not used
            admit_min_uses times, or an output block with admit_output_blocks off; tiers/policy.py).
    """

    name: str
    capacity_bytes: int
    used_bytes: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    failures: int = 0  # read errors, failed authentication or header mismatches: each served as a miss
    bytes_read: int = 0
    bytes_written: int = 0
    round_trips: int = 0
    skipped: int = 0
    late: int = 0
    refused: int = 0


def next_batch(ops: "queue.Queue", first, limit: int) -> list:
    """`first` and the operations queued behind it, up to `limit`, for a writer thread to apply as one
    batch. The stop marker (None) is left in the queue, for the writer's next get."""
    batch = [first]
    while len(batch) < limit:
        try:
            op = ops.get_nowait()
        except queue.Empty:
            break
        if op is None:
            ops.put(None)
            break
        batch.append(op)
    return batch


Victims = tuple[list[BlockKey], "torch.Tensor | None"]  # entries a tier evicted: keys, blocks (a copy)
NO_VICTIMS: Victims = ([], None)
# entries a tier evicted while a step was planned, to lend their slots: keys and the slots, whose data a PASS_DOWN
# move reads when the step's moves run, before any later move writes into them (tiers/moves.py)
Lent = tuple[list[BlockKey], list[int]]
NO_LENT: Lent = ([], [])


class KVTier(ABC):
    """A store of KV blocks keyed by BlockKey; blocks are tensors [n, layers, 2, block_size, kv_heads, head_dim].

    This is all the tier manager uses of a lower tier (hot, the pool itself, is the one tier it also
    reads by block id; the one that lends slots, warm, is a SwapSpace as well), so a new tier is one subclass
    that passes tests/cache/test_tier_contract.py. Every
    method takes a batch. The synchronous methods are the implementation; the async ones run them in a
    worker thread when the tier does blocking I/O (`blocking = True`).

    Counters: `count(field=n, ...)` adds under a lock (a tier may be used from several threads), and
    `stats()` returns a copy of them with the current use filled in (`_used_bytes`).
    """

    name: ClassVar[str]
    blocking: ClassVar[bool] = False
    durable: ClassVar[bool] = False  # outlives the process: the tier manager persists into it at close
    # shared with other engines (remote): written as blocks are computed (`wanted` says which it lacks),
    # what it admits goes on to the tier below as well, and neither persist nor a snapshot copies it
    shared: ClassVar[bool] = False
    medium: ClassVar[str | None] = None  # the tier's name in KV events (vLLM's media): None, not reported
    events: Any = None  # an EventRecorder (engine/kv_events.py) when KV events are on and the tier has a medium

    DROPPED_LOG = 1 << 16  # how many dropped block hashes a tier remembers, for explain()

    def __init__(self, capacity_bytes: int):
        self._counters = TierStats(self.name, capacity_bytes)
        self._counter_lock = threading.Lock()
        self._dropped: OrderedDict[bytes, str | None] = OrderedDict()

    def note_dropped(self, hashes: Iterable[BlockHash], refused: Callable[[BlockHash], str] | None = None) -> None:
        """Remembers (the last DROPPED_LOG) blocks this tier let go for good: no tier below kept them; with
        `refused` (a block's hash -> why), blocks this tier did not admit."""
        with self._counter_lock:
            for h in hashes:
                self._dropped[h] = None if refused is None else refused(h)
                self._dropped.move_to_end(h)
            while len(self._dropped) > self.DROPPED_LOG:
                self._dropped.popitem(last=False)

    def dropped(self, block_hash: bytes) -> bool:
        """Whether this tier let the block go for good, among the last DROPPED_LOG it dropped."""
        with self._counter_lock:
            return block_hash in self._dropped

    def refused_why(self, block_hash: bytes) -> str | None:
        """Why this tier did not admit the block, when that is how it let it go."""
        with self._counter_lock:
            return self._dropped.get(block_hash)

    def report_stored(self, keys: Sequence[BlockKey]) -> None:
        """KV events: these blocks entered the tier."""
        if self.events is not None and keys:
            self.events.stored_below(keys, self.medium)

    def report_removed(self, hashes: Iterable[bytes]) -> None:
        """KV events: these blocks left the tier."""
        if self.events is not None:
            hashes = list(hashes)
            if hashes:
                self.events.removed(hashes, self.medium)

    def count(self, **deltas: int) -> None:
        """Adds to the counters, thread-safely: `count(hits=16, promotions=1)`."""
        with self._counter_lock:
            for name, n in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + n)

    def stats(self) -> TierStats:
        """A copy of the counters, with the current use filled in."""
        with self._counter_lock:
            return replace(self._counters, used_bytes=self._used_bytes())

    @abstractmethod
    def _used_bytes(self) -> int: ...

    # -- the synchronous interface ---------------------------------------------------------------

    @abstractmethod
    def contains_sync(self, keys: Sequence[BlockKey]) -> int:
        """How many leading keys are present, stopping at the first miss."""

    @abstractmethod
    def get_sync(self, keys: Sequence[BlockKey]) -> torch.Tensor | None:
        """The blocks of the leading present keys, [n, ...] on the host, or None for no hit; they
        become the most recently used."""

    @abstractmethod
    def put_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        """Stores blocks [len(keys), ...] (evicting the least recently used to make room); returns how
        many are stored (present ones count). Visible to every later call when it returns."""

    def admit(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> tuple[int, Victims]:
        """Write-back from the tier above: like put_sync, but it may return before the write lands
        (`flush_sync` waits), and it returns the entries it evicted for the tier below. `blocks` must
        not change afterwards."""
        return self.put_sync(keys, blocks), NO_VICTIMS

    def persist_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        """Write-back at shutdown (the tier manager's `persist`): like admit, but a tier that bounds the writes
        waiting for it waits for room rather than dropping blocks, as nothing is served meanwhile. Returns how many
        are stored or queued (present ones count)."""
        return self.admit(keys, blocks)[0]

    def wanted(self, keys: Sequence[BlockKey]) -> list[int]:
        """Indices of the keys a shared tier would store if offered (it may skip those it knows it holds);
        cheap, no I/O."""
        return list(range(len(keys)))

    @abstractmethod
    def remove_sync(self, keys: Sequence[BlockKey]) -> int:
        """Drops the keys; returns how many were present."""

    @abstractmethod
    def clear_sync(self) -> int:
        """Drops every entry; returns how many there were."""

    @abstractmethod
    def export_sync(self, batch: int) -> Iterator[tuple[list[BlockKey], torch.Tensor]]:
        """Every entry, as (keys, blocks) batches of at most `batch` blocks copied to the host."""

    def flush_sync(self) -> None:
        """Waits until every admitted block is stored."""

    def close_sync(self) -> None:
        """Releases the tier's resources; nothing is lost that a durable tier stored."""

    # -- the async interface ---------------------------------------------------------------------

    async def contains(self, keys: Sequence[BlockKey]) -> int:
        """`contains_sync`, off the event loop when the tier blocks."""
        return await self._call(self.contains_sync, keys)

    async def get(self, keys: Sequence[BlockKey]) -> torch.Tensor | None:
        """`get_sync`, off the event loop when the tier blocks."""
        return await self._call(self.get_sync, keys)

    async def put(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        """`put_sync`, off the event loop when the tier blocks."""
        return await self._call(self.put_sync, keys, blocks)

    async def remove(self, keys: Sequence[BlockKey]) -> int:
        """`remove_sync`, off the event loop when the tier blocks."""
        return await self._call(self.remove_sync, keys)

    async def clear(self) -> int:
        """`clear_sync`, off the event loop when the tier blocks."""
        return await self._call(self.clear_sync)

    async def flush(self) -> None:
        """`flush_sync`, off the event loop when the tier blocks."""
        await self._call(self.flush_sync)

    async def close(self) -> None:
        """`close_sync`, off the event loop when the tier blocks."""
        await self._call(self.close_sync)

    async def _call(self, fn, *args):
        if self.blocking:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)


class SwapSpace(KVTier):
    """A KVTier of slots that can also be lent out, outside its cache: swap space for preempted sequences, far
    blocks, and promotion in place (the warm tier is one). A lent slot is the borrower's until released."""

    @abstractmethod
    def take(self, keys: Sequence[BlockKey]) -> list[int]:
        """Removes the leading present keys from the cache and lends their slots (read, then release)."""

    @abstractmethod
    def reserve(self, n: int) -> tuple[list[int] | None, Lent]:
        """n slots, or None. Cached entries evicted to make room are returned with their slots (among the n):
        their data is read when the step's moves run (PASS_DOWN), for the tier below; nothing is read now."""

    @abstractmethod
    def lend(self, n: int) -> tuple[list[int] | None, Lent]:
        """As `reserve`, for far blocks: n slots evicting cached entries for room, or None, evicting nothing."""

    @property
    @abstractmethod
    def num_lendable(self) -> int:
        """Slots that `lend` can hand out now."""

    @abstractmethod
    def keep(self, slot: int, key: BlockKey) -> None:
        """A lent slot whose block is no longer in use becomes a cached entry under `key` (or is released)."""

    @abstractmethod
    def admit_from_hot(self, block_ids: list[int], keys: Sequence[BlockKey],
                       below: Callable[[list[BlockKey], torch.Tensor], None]) -> int:
        """admit() of hot blocks by id, copied from the pool straight into the slots they take; what it evicts, and
        what finds no slot, goes to `below` with its data. Returns the blocks stored."""

    @abstractmethod
    def read(self, slots: list[int]) -> torch.Tensor:
        """A copy of the slots' blocks [len(slots), ...]."""

    @abstractmethod
    def read_later(self, slots: list[int], then: Callable[[torch.Tensor], None]) -> None:
        """`read`, its result to `then` when the step's block ops run (tiers/block_io.py)."""

    @abstractmethod
    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Copies blocks [len(slots), ...] from any device into the slots."""

    @abstractmethod
    def release(self, slots: list[int]) -> None:
        """Gives lent slots back to the tier as free slots (their data is not cached)."""

    @abstractmethod
    def from_hot(self, block_ids: list[int], slots: list[int]) -> None:
        """Copies hot blocks into lent slots: a swap-out, an offload."""

    @abstractmethod
    def to_hot(self, block_ids: list[int], slots: list[int]) -> None:
        """Copies slots into hot blocks: a promotion (a prefix found here, a swapped-out sequence's return)."""
