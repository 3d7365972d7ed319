"""Pinned prefixes: hot blocks held by a reference of their own, so eviction never takes them, until unpinned or,
with a time to live, until they expire."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tieredkv.core.cache_index import CacheIndex
from tieredkv.errors import RequestError
from tieredkv.hashing import BlockHash, BlockKey, chain_keys
from tieredkv.tiers.block_pool import KVBlock

ANYONE = ""  # the client of pins made without one (requests without a cache_salt share one share)


@dataclass
class Pin:
    blocks: list[KVBlock]
    client: str
    expires: float | None  # time.monotonic() deadline; None: until unpinned


class PinTable:
    """Pinned prefixes -> their full hot blocks, within `budget` blocks, and within `client_budget` blocks for
    each client (a cache salt: a tenant). A block held by several pins takes one reference and counts once, in
    the budget and in each client's share. A pin with a time to live is released when it expires (`expire`,
    called every step); pinning the same prefix again renews it. Blocks pinned are marked for admission to the
    tiers below warm (tiers/policy.py). O(prefix blocks) per pin or unpin."""

    def __init__(self, index: CacheIndex, budget: int, client_budget: int | None = None):
        self.index = index
        self.pool = index.pool
        self.budget = budget
        self.client_budget = budget if client_budget is None else min(client_budget, budget)
        self.pins: dict[tuple[BlockHash | None, tuple[int, ...]], Pin] = {}
        self._held: dict[KVBlock, int] = {}  # block -> pins holding it
        self._by_client: dict[str, dict[KVBlock, int]] = {}
        self._next_expiry: float | None = None

    @property
    def num_blocks(self) -> int:
        """Distinct blocks pinned."""
        return len(self._held)

    def keys(self, token_ids: list[int], root: BlockHash | None) -> list[BlockKey]:
        return chain_keys(root or self.index.root, token_ids, self.index.block_size)

    def check(self, token_ids: list[int], root: BlockHash | None = None, client: str | None = None) -> None:
        """Raises RequestError when pinning this prefix (its blocks computed or not) would exceed the budget or the
        client's share; changes nothing."""
        self.expire()
        key = (root, tuple(token_ids))
        if key in self.pins:
            return
        hashes = [k.block_hash for k in self.keys(token_ids, root)]
        held_hashes = {b.block_hash for b in self._held}
        mine = {b.block_hash for b in self._by_client.get(client or ANYONE, {})}
        self._check_room(sum(h not in held_hashes for h in hashes), sum(h not in mine for h in hashes), client)

    def _check_room(self, new_total: int, new_mine: int, client: str | None) -> None:
        if self.num_blocks + new_total > self.budget:
            raise RequestError(f"pinning {new_total} more blocks would exceed the pinned budget ({self.num_blocks} of "
                               f"{self.budget} blocks in use; see max_pinned_fraction)")
        used = len(self._by_client.get(client or ANYONE, {}))
        if used + new_mine > self.client_budget:
            who = f"client {client!r}" if client else "requests without a cache_salt"
            raise RequestError(f"pinning {new_mine} more blocks would exceed the share of {who} ({used} of "
                               f"{self.client_budget} blocks pinned; see max_pinned_per_client)")

    def pin(self, token_ids: list[int], root: BlockHash | None = None, ttl: float | None = None,
            client: str | None = None) -> int:
        """Pins the cached hot blocks of token_ids' full blocks (chained from `root`, the engine's by default) for
        `ttl` seconds (None: until unpin); returns the tokens pinned. Pinning a prefix already pinned renews it
        (the later expiry wins; None outlasts any). Raises RequestError when the blocks are not all hot or the
        budget or the client's share would be exceeded."""
        key = (root, tuple(token_ids))
        expires = None if ttl is None else time.monotonic() + ttl
        pin = self.pins.get(key)
        if pin is not None:
            if pin.expires is not None:
                pin.expires = None if expires is None else max(pin.expires, expires)
            self._note_expiry(pin.expires)
            return len(pin.blocks) * self.index.block_size
        keys = self.keys(token_ids, root)
        blocks = self.index.hot_prefix(keys)
        if len(blocks) < len(keys):
            raise RequestError("the prefix is not in the hot tier; prefill it first")
        client = client or ANYONE
        mine = self._by_client.get(client, {})
        self._check_room(sum(b not in self._held for b in blocks), sum(b not in mine for b in blocks), client)
        self.pool.touch([b for b in blocks if b not in self._held])
        for block in blocks:
            self._held[block] = self._held.get(block, 0) + 1
            mine[block] = mine.get(block, 0) + 1
        self._by_client[client] = mine
        self.pins[key] = Pin(blocks, client, expires)
        self._note_expiry(expires)
        self.pool.popularity.mark(b.block_hash for b in blocks)
        return len(blocks) * self.index.block_size

    def unpin(self, token_ids: list[int], root: BlockHash | None = None) -> int:
        pin = self.pins.pop((root, tuple(token_ids)), None)
        return 0 if pin is None else self._release(pin)

    def _release(self, pin: Pin) -> int:
        mine = self._by_client[pin.client]
        freed = []
        for block in reversed(pin.blocks):  # tail first: a chain's tail is evicted before its head
            mine[block] -= 1
            if not mine[block]:
                del mine[block]
            self._held[block] -= 1
            if not self._held[block]:
                del self._held[block]
                freed.append(block)
        if not mine:
            del self._by_client[pin.client]
        self.pool.free(freed)
        return len(pin.blocks) * self.index.block_size

    def _note_expiry(self, expires: float | None) -> None:
        if expires is not None and (self._next_expiry is None or expires < self._next_expiry):
            self._next_expiry = expires

    def expire(self, now: float | None = None) -> int:
        """Releases the pins whose time has come; returns how many. O(1) until the earliest one is due."""
        now = time.monotonic() if now is None else now
        if self._next_expiry is None or now < self._next_expiry:
            return 0
        due = [key for key, pin in self.pins.items() if pin.expires is not None and pin.expires <= now]
        for key in due:
            self._release(self.pins.pop(key))
        left = [p.expires for p in self.pins.values() if p.expires is not None]
        self._next_expiry = min(left) if left else None
        return len(due)

    def listing(self) -> list[dict]:
        """The pins: tokens, blocks, client, seconds left (None: until unpinned)."""
        now = time.monotonic()
        self.expire(now)
        return [{"tokens": len(key[1]), "blocks": len(pin.blocks), "client": pin.client or None,
                 "expires_in_s": None if pin.expires is None else max(pin.expires - now, 0.0)}
                for key, pin in self.pins.items()]

    def release_all(self) -> None:
        for pin in list(self.pins.values()):
            self._release(pin)
        self.pins.clear()
        self._next_expiry = None
