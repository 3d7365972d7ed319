"""The storage interface every KV tier implements: batched, async first, one contract for all."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Sequence

import torch

from tieredkv.hashing import BlockHash

TIER_NAMES = ("hot", "warm", "cold")  # top to bottom


class BlockKey(NamedTuple):
    """A full block's chained hash and its token ids (compared on every hit)."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]


@dataclass
class TierStats:
    """Counters of one tier. hits and misses count tokens; the rest count blocks."""

    name: str
    capacity_bytes: int
    used_bytes: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    failures: int = 0  # read errors, checksum or header mismatches: each served as a miss


class KVTier(ABC):
    """A store of KV blocks keyed by BlockKey; values are tensors [n, layers, 2, block_size, kv_heads, head_dim].

    The async methods are the interface; implementations provide their synchronous batch versions,
    which a tier that does blocking I/O (`blocking = True`) runs in a worker thread.
    Every method takes a batch: one call moves many blocks. `counters` is the tier's live TierStats;
    `stats()` returns it with the current use filled in.
    """

    counters: TierStats

    name: ClassVar[str]
    blocking: ClassVar[bool] = False

    async def contains(self, keys: Sequence[BlockKey]) -> int:
        """How many leading keys are present, stopping at the first miss."""
        return await self._call(self.contains_sync, keys)

    async def get(self, keys: Sequence[BlockKey]) -> torch.Tensor | None:
        """The blocks of the leading present keys, [n, ...] on CPU (n may be 0), or None for no hit."""
        return await self._call(self.get_sync, keys)

    async def put(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        """Stores blocks [len(keys), ...]; returns how many were stored (present ones count)."""
        return await self._call(self.put_sync, keys, blocks)

    async def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drops the keys; returns how many were present."""
        return await self._call(self.remove_sync, keys)

    async def close(self) -> None:
        await self._call(self.close_sync)

    async def _call(self, fn, *args):
        if self.blocking:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    @abstractmethod
    def contains_sync(self, keys: Sequence[BlockKey]) -> int: ...

    @abstractmethod
    def get_sync(self, keys: Sequence[BlockKey]) -> torch.Tensor | None: ...

    @abstractmethod
    def put_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int: ...

    @abstractmethod
    def remove_sync(self, keys: Sequence[BlockKey]) -> int: ...

    def close_sync(self) -> None:
        return None

    @abstractmethod
    def stats(self) -> TierStats: ...
