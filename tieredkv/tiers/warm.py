"""Warm tier: KV blocks in host memory (pinned when CUDA is available), one slab allocated up front."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Iterator, Sequence

import torch

from tieredkv.hashing import BlockHash
from tieredkv.tiers.base import NO_LENT, BlockKey, Lent, SwapSpace, Victims
from tieredkv.tiers.block_io import BlockIO, Slab
from tieredkv.tiers.policy import LFUQueue, Popularity, check_eviction


class WarmTier(SwapSpace):
    """A slab of `capacity` blocks with a slot allocator and an LRU.

    The slab is block-major, [capacity, layers, 2, block_size, kv_heads, head_dim], unless one is given:
    on CPU the engine passes the tail of its cache tensor, layer-major [layers, 2, capacity, ...], so
    that slot s is block `base + s` of that tensor and attention reads a slot in place (far blocks: see
    tiers/block_pool.py).

    `entries` maps a block hash to its slot in LRU order (oldest first); `free_slots` holds the rest,
    except the slots lent out by `reserve` (preemption swap space). Putting into a full tier evicts the
    oldest entries: `admit` returns them (keys, blocks copied out of the slab) for the caller to pass
    on; `admit_from_hot` hands them to a callback as their data is read; `reserve` and `lend` return their keys and
    slots, read later by the step's moves. Slots are handed out lowest first, so consecutive blocks tend to sit in
    consecutive slots, which move as views of the slab (pinned on CUDA: a device copy from there is a real
    asynchronous transfer). All operations are O(1) per block.

    The slab's bytes move as block ops (`io`, tiers/block_io.py), with the hot pool's when the tier manager joins
    them: under tensor parallelism the index is rank 0's alone and every rank holds its heads of each slot, so
    `block_shape` is the whole model's and the slab a rank's share.
    """

    name = "warm"
    medium = "CPU"  # vLLM's name for host memory (its CPU offloading tier)

    @classmethod
    def over_cache(cls, num_warm_blocks: int, kv_cache: torch.Tensor, num_blocks: int,
                   block_shape: tuple[int, ...] | None = None) -> WarmTier | None:
        """The warm tier beside a process's cache tensor: its slab is the tensor's tail when the tensor has room
        beyond the pool and the scratch block (far blocks read in place), else a slab of its own (pinned on CUDA);
        None without a budget. `block_shape`: the blocks it takes and gives, whole ones under tensor parallelism
        (the slab's by default)."""
        if num_warm_blocks <= 0:
            return None
        local, pin = (kv_cache.shape[0], 2, *kv_cache.shape[3:]), kv_cache.device.type == "cuda"
        beyond = kv_cache.shape[2] > num_blocks + 1  # room past the pool and the scratch block: the slab is the tail
        slab = kv_cache[:, :, num_blocks : num_blocks + num_warm_blocks] if beyond else \
            torch.empty((num_warm_blocks, *local), dtype=kv_cache.dtype, pin_memory=pin)
        return cls(num_warm_blocks, block_shape or local, kv_cache.dtype, pin, slab=slab, layer_major=beyond)

    def __init__(self, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
                 slab: torch.Tensor | None = None, layer_major: bool | None = None, eviction: str = "lru",
                 popularity: Popularity | None = None, io: BlockIO | None = None):
        self.capacity = capacity_blocks
        self.layer_major = slab is not None if layer_major is None else layer_major
        if slab is None:
            slab = torch.empty((capacity_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        assert slab.shape[2 if self.layer_major else 0] == capacity_blocks, slab.shape
        self.slab = slab
        self.store = Slab(slab, self.layer_major)
        self.io = io if io is not None else BlockIO(None, None, self.store)
        self.block_shape = tuple(block_shape)
        self.block_bytes = math.prod(block_shape) * slab.element_size()
        super().__init__(capacity_blocks * self.block_bytes)
        self.entries: OrderedDict[BlockHash, tuple[int, tuple[int, ...]]] = OrderedDict()
        self.free_slots = list(range(capacity_blocks - 1, -1, -1))  # popped from the end: lowest first
        self.set_eviction(eviction, popularity)

    def set_eviction(self, eviction: str, popularity: Popularity | None) -> None:
        """How entries leave: "lru" in LRU order (`entries` is kept in it); "lfu": by LFU-DA over `popularity`'s use
        counts (tiers/policy.py)."""
        check_eviction(eviction)
        self.lfu: LFUQueue[BlockHash] | None = None
        if eviction == "lfu":
            self.lfu = LFUQueue(popularity.uses)
            for block_hash in self.entries:
                self.lfu.push(block_hash)

    def _used_bytes(self) -> int:
        """Cached entries and lent slots (swap space, far blocks of running sequences)."""
        return (self.capacity - len(self.free_slots)) * self.block_bytes

    def contains_sync(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            entry = self.entries.get(key.block_hash)
            if entry is None or entry[1] != key.token_ids:
                break
            n += 1
        return n

    def slots_of(self, keys: Sequence[BlockKey]) -> list[int]:
        """Slots of the leading present keys, which become the most recently used."""
        n = self.contains_sync(keys)
        for key in keys[:n]:
            self.entries.move_to_end(key.block_hash)
            if self.lfu is not None:
                self.lfu.push(key.block_hash)
        return [self.entries[k.block_hash][0] for k in keys[:n]]

    def get_sync(self, keys: Sequence[BlockKey]) -> torch.Tensor | None:
        slots = self.slots_of(keys)
        return self.read(slots) if slots else None

    def take(self, keys: Sequence[BlockKey]) -> list[int]:
        """Removes the leading present keys from the cache and lends their slots (release them when
        their data has been read): promotion moves a block up rather than copying it."""
        slots = self.slots_of(keys)
        for key in keys[: len(slots)]:
            self._forget(key.block_hash)
        self.report_removed(k.block_hash for k in keys[: len(slots)])
        return slots

    def put_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        """Stores the blocks; entries evicted to make room are dropped (see `admit` to keep them)."""
        return self.admit(keys, blocks)[0]

    def admit(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> tuple[int, Victims]:
        """put_sync that returns what does not stay: the entries evicted to make room, and the blocks
        of this batch that find no slot (the earliest ones, when the batch outgrows the tier)."""
        assert blocks.shape[0] == len(keys) and blocks.shape[1:] == self.block_shape, blocks.shape
        present, new, slots, overflow, (victim_keys, victim_slots) = self._place(keys)
        victim_data = self.read(victim_slots) if victim_slots else None  # before any slot is written
        if new:
            self.write(slots, blocks if len(new) == len(keys) else blocks[torch.tensor(new, device=blocks.device)])
        if overflow:
            picked = blocks[torch.tensor(overflow, device=blocks.device)].to("cpu", self.slab.dtype)
            victim_keys = victim_keys + [keys[i] for i in overflow]
            victim_data = picked if victim_data is None else torch.cat([victim_data, picked])
        return present + len(new), (victim_keys, victim_data)

    def admit_from_hot(self, block_ids: list[int], keys: Sequence[BlockKey],
                       below: Callable[[list[BlockKey], torch.Tensor], None]) -> int:
        """admit() of hot blocks by id: those that find a slot are copied from the pool straight into it (under
        tensor parallelism each rank copies its own heads); the entries evicted to make room, and the blocks
        that find no slot, go to `below` (keys, whole blocks on the host) as their data is read."""
        present, new, slots, overflow, (victim_keys, victim_slots) = self._place(keys)
        if victim_slots:
            self.read_later(victim_slots, lambda data: below(victim_keys, data))
        self.from_hot([block_ids[i] for i in new], slots)
        if overflow:
            self.io.gather([block_ids[i] for i in overflow],
                           lambda data: below([keys[i] for i in overflow], data.to("cpu", self.slab.dtype)))
        return present + len(new)

    def _place(self, keys: Sequence[BlockKey]) -> tuple[int, list[int], list[int], list[int], Lent]:
        """Where admitting keys puts them: (how many are present already, the indices of new keys that get a
        slot, their slots, the indices of new keys that find none, the entries evicted to make room with their
        slots, released: the caller reads them before it writes any slot). The new keys' entries are made."""
        new = [i for i, k in enumerate(keys) if k.block_hash not in self.entries]
        victims = self._evict(min(len(new), self.capacity))
        self.release(victims[1])
        cut = max(len(new) - len(self.free_slots), 0)  # slots lent to swap space cannot be taken back
        overflow, new = new[:cut], new[cut:]
        slots = [self.free_slots.pop() for _ in new]
        for i, slot in zip(new, slots):
            self._enter(keys[i], slot)
        self.report_stored([keys[i] for i in new])
        return len(keys) - len(new) - len(overflow), new, slots, overflow, victims

    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Copies whole blocks [len(slots), ...] from any device into the slots (from CUDA: asynchronous on the
        current stream; the caller synchronizes before the host reads)."""
        self.io.write(slots, blocks)

    def read(self, slots: list[int]) -> torch.Tensor:
        """A copy of the slots' whole blocks [len(slots), ...]."""
        return self.io.read_now(slots)

    def read_later(self, slots: list[int], then: Callable[[torch.Tensor], None]) -> None:
        """`read`, its result to `then` when the op runs (at once, or with the step's message)."""
        self.io.read(slots, then)

    def from_hot(self, block_ids: list[int], slots: list[int]) -> None:
        """Copies hot blocks into lent slots (a swap-out, an offload): on every rank, its own heads."""
        self.io.hot_to_slab(block_ids, slots)

    def to_hot(self, block_ids: list[int], slots: list[int]) -> None:
        """Copies slots into hot blocks (a promotion: a prefix found in warm, a swapped-out sequence's return), from
        views of the slots: on every rank."""
        self.io.slab_to_hot(block_ids, slots)

    def join(self, io: BlockIO) -> None:
        """Moves this tier's bytes with the hot pool's ops (the tier manager: one data plane over both)."""
        assert io.slab is None or io.slab.tensor is self.slab, "another slab's data plane"
        io.slab, self.io = self.store, io

    def _evict(self, n: int) -> Lent:
        """Removes the oldest entries from the cache until n slots are free or theirs (or nothing is left to
        evict): their keys and slots, neither read nor released."""
        keys: list[BlockKey] = []
        slots: list[int] = []
        while len(self.free_slots) + len(slots) < n and self.entries:
            if self.lfu is None:
                block_hash, (slot, tokens) = self.entries.popitem(last=False)
            else:
                block_hash = self.lfu.pop()
                slot, tokens = self.entries.pop(block_hash)
            keys.append(BlockKey(block_hash, tokens))
            slots.append(slot)
        if keys:
            self.report_removed(k.block_hash for k in keys)
            self.count(evictions=len(keys))
        return keys, slots

    def remove_sync(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            entry = self._forget(key.block_hash)
            if entry is not None:
                self.release([entry[0]])
                self.report_removed([key.block_hash])
                n += 1
        return n

    def clear_sync(self) -> int:
        n = len(self.entries)
        self.release([slot for slot, _ in self.entries.values()])
        self.report_removed(list(self.entries))
        self.entries.clear()
        if self.lfu is not None:
            self.lfu = LFUQueue(self.lfu.weight)
        return n

    def _enter(self, key: BlockKey, slot: int) -> None:
        self.entries[key.block_hash] = (slot, key.token_ids)
        if self.lfu is not None:
            self.lfu.push(key.block_hash)

    def _forget(self, block_hash: BlockHash) -> tuple[int, tuple[int, ...]] | None:
        if self.lfu is not None:
            self.lfu.discard(block_hash)
        return self.entries.pop(block_hash, None)

    def export_sync(self, batch: int) -> Iterator[tuple[list[BlockKey], torch.Tensor]]:
        items = list(self.entries.items())
        for i in range(0, len(items), batch):
            part = items[i : i + batch]
            yield [BlockKey(h, tokens) for h, (_, tokens) in part], self.read([slot for _, (slot, _) in part])

    # -- swap space for preempted sequences --------------------------------------------------------

    def reserve(self, n: int) -> tuple[list[int] | None, Lent]:
        if n > self.capacity // 2:  # keep at least half of the tier for cached prefixes
            return None, NO_LENT
        return self.lend(n)

    def lend(self, n: int) -> tuple[list[int] | None, Lent]:
        """n slots for blocks of running sequences (far blocks, a swap-out), evicting cached entries for room
        (returned with their slots, which are among the n: see SwapSpace.reserve); None, evicting nothing, when
        lent slots fill too much of the tier."""
        if self.num_lendable < n:
            return None, NO_LENT
        evicted = self._evict(n)
        return evicted[1] + [self.free_slots.pop() for _ in range(n - len(evicted[1]))], evicted

    @property
    def num_lendable(self) -> int:
        """Slots that `lend` can hand out: free ones and those of cached entries."""
        return len(self.free_slots) + len(self.entries)

    def keep(self, slot: int, key: BlockKey) -> None:
        """A lent slot whose block is no longer in use becomes a cached entry (the most recent), unless
        the key is cached already; then the slot is released."""
        if key.block_hash in self.entries:
            self.release([slot])
        else:
            self._enter(key, slot)
            self.report_stored([key])

    def release(self, slots: list[int]) -> None:
        self.free_slots.extend(sorted(slots, reverse=True))
