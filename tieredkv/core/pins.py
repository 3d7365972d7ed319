"""Pinned prefixes: hot blocks held by a reference of their own, so eviction never takes them."""

from __future__ import annotations

from tieredkv.core.cache_index import CacheIndex
from tieredkv.errors import RequestError
from tieredkv.tiers.block_pool import KVBlock


class PinTable:
    """Token ids of a pinned prefix -> its full hot blocks (each holding one reference), within `budget`
    blocks. O(prefix blocks) per pin or unpin."""

    def __init__(self, index: CacheIndex, budget: int):
        self.index = index
        self.pool = index.pool
        self.budget = budget
        self.pins: dict[tuple[int, ...], list[KVBlock]] = {}
        self.num_blocks = 0

    def pin(self, token_ids: list[int]) -> int:
        """Pins the cached hot blocks of token_ids' full blocks; returns the tokens pinned. Raises
        RequestError when they are not all cached or the budget would be exceeded."""
        key = tuple(token_ids)
        if key in self.pins:
            return len(self.pins[key]) * self.index.block_size
        keys = self.index.keys(token_ids)
        blocks = self.index.hot_prefix(keys)
        if len(blocks) < len(keys):
            raise RequestError("the prefix is not in the hot tier; prefill it first")
        if self.num_blocks + len(blocks) > self.budget:
            raise RequestError(f"pinning {len(blocks)} blocks would exceed the pinned budget "
                               f"({self.num_blocks} of {self.budget} blocks in use; see max_pinned_fraction)")
        self.pool.touch(blocks)
        self.pins[key] = blocks
        self.num_blocks += len(blocks)
        return len(blocks) * self.index.block_size

    def unpin(self, token_ids: list[int]) -> int:
        blocks = self.pins.pop(tuple(token_ids), [])
        self.pool.free(reversed(blocks))
        self.num_blocks -= len(blocks)
        return len(blocks) * self.index.block_size

    def release_all(self) -> None:
        for key in list(self.pins):
            self.unpin(list(key))
