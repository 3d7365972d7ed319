"""Warm tier: KV blocks in host memory (pinned when CUDA is available), one slab allocated up front."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from tieredkv.hashing import BlockHash
from tieredkv.tiers.base import BlockKey, KVTier, TierStats


Victims = tuple[list[BlockKey], "torch.Tensor | None"]  # evicted entries: keys and their blocks (a copy)


class WarmTier(KVTier):
    """A slab [capacity, layers, 2, block_size, kv_heads, head_dim] with a slot allocator and an LRU.

    `entries` maps a block hash to its slot in LRU order (oldest first); `free_slots` holds the rest,
    except the slots lent out by `reserve` (preemption swap space). Putting into a full tier evicts the
    oldest entries: `admit` and `reserve` return them (keys, blocks copied out of the slab) for the
    caller to pass on. All operations are O(1) per block.
    """

    name = "warm"

    def __init__(self, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        self.capacity = capacity_blocks
        self.slab = torch.empty((capacity_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.block_bytes = self.slab[0].numel() * self.slab.element_size() if capacity_blocks else 0
        self.entries: OrderedDict[BlockHash, tuple[int, tuple[int, ...]]] = OrderedDict()
        self.free_slots = list(range(capacity_blocks - 1, -1, -1))
        self.counters = TierStats("warm", capacity_blocks * self.block_bytes)

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
        return [self.entries[k.block_hash][0] for k in keys[:n]]

    def get_sync(self, keys: Sequence[BlockKey]) -> torch.Tensor | None:
        slots = self.slots_of(keys)
        if not slots:
            return None
        return self.slab[torch.tensor(slots)]

    def put_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        """Stores the blocks; entries evicted to make room are dropped (see `admit` to keep them)."""
        return self.admit(keys, blocks)[0]

    def admit(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> tuple[int, Victims]:
        """put_sync that also returns the entries it evicted, for the next tier down."""
        assert blocks.shape[0] == len(keys) and blocks.shape[1:] == self.slab.shape[1:], blocks.shape
        new = [i for i, k in enumerate(keys) if k.block_hash not in self.entries]
        stored = len(keys) - len(new)
        new = new[: self.capacity]
        if not new:
            return stored, ([], None)
        victims = self._make_room(len(new))
        new = new[: len(self.free_slots)]  # slots lent to swap space cannot be taken back
        if not new:
            return stored, victims
        slots = [self.free_slots.pop() for _ in new]
        self.write(slots, blocks[torch.tensor(new, device=blocks.device)])
        for i, slot in zip(new, slots):
            self.entries[keys[i].block_hash] = (slot, keys[i].token_ids)
        self.counters.used_bytes = len(self.entries) * self.block_bytes
        return stored + len(new), victims

    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Copies blocks [len(slots), ...] (any device) into the slab's slots."""
        self.slab[torch.tensor(slots)] = blocks.to("cpu", self.slab.dtype)

    def read(self, slots: list[int]) -> torch.Tensor:
        """A copy of the slots' blocks [len(slots), ...]."""
        return self.slab[torch.tensor(slots)]

    def _make_room(self, n: int) -> Victims:
        """Evicts the oldest entries until n slots are free (or nothing is left to evict)."""
        victims = []
        while len(self.free_slots) + len(victims) < n and self.entries:
            block_hash, (slot, tokens) = self.entries.popitem(last=False)
            victims.append((BlockKey(block_hash, tokens), slot))
        if not victims:
            return [], None
        data = self.read([s for _, s in victims])
        self.free_slots.extend(s for _, s in victims)
        self.counters.evictions += len(victims)
        return [k for k, _ in victims], data

    def remove_sync(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            entry = self.entries.pop(key.block_hash, None)
            if entry is not None:
                self.free_slots.append(entry[0])
                n += 1
        self.counters.used_bytes = len(self.entries) * self.block_bytes
        return n

    def clear(self) -> int:
        n = len(self.entries)
        self.free_slots.extend(slot for slot, _ in self.entries.values())
        self.entries.clear()
        self.counters.used_bytes = 0
        return n

    # -- swap space for preempted sequences --------------------------------------------------------

    def reserve(self, n: int) -> tuple[list[int] | None, Victims]:
        """Lends n slots outside the LRU (evicting cached entries to make room; they are returned);
        None for the slots if impossible."""
        if n > self.capacity // 2:  # keep at least half of the tier for cached prefixes
            return None, ([], None)
        victims = self._make_room(n)
        if len(self.free_slots) < n:
            return None, victims
        return [self.free_slots.pop() for _ in range(n)], victims

    def release(self, slots: list[int]) -> None:
        self.free_slots.extend(slots)

    def stats(self) -> TierStats:
        return self.counters
