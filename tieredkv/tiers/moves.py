"""Block moves: what a step does to block data before its forward, decided by the scheduler as plain data.

The scheduler and the KV manager change metadata (block tables, ref counts, the hash map, tier indexes)
and append a BlockMove for every byte that has to move; planning runs no tensor operation
(tests/cache/test_data_path.py records every one while it plans steps that demote, preempt and offload).
The tier manager carries the list out in one place before the forward, in the order it was planned. That
order is safe because a block's data is always read before anything is planned into it: an evicted hot block
is demoted (and a preempted one swapped out) when the allocation that frees it is planned, a warm entry evicted
to lend its slot (a swap-out's reservation, far blocks) is passed down when the lending is planned, and every
write into either (a promotion, an offload, a copy-on-write copy, the forward) is planned after. A swapped-out
sequence comes back as a promotion from the warm slots lent to it (one kind of move for every way back up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable, NamedTuple, TypeVar

import torch

from tieredkv.tiers.base import BlockKey

T = TypeVar("T")

DEMOTE = "demote"  # evicted hot block -> warm, else cold; keeps the block findable below hot
PASS_DOWN = "pass_down"  # an entry `tier` evicted to lend its slot `src` -> the tier below it (read from the slot)
SWAP_OUT = "swap_out"  # hot block -> a warm slot lent to a preempted sequence
OFFLOAD = "offload"  # hot block of a running sequence -> a far block (block_pool.py), which takes its place
PROMOTE = "promote"  # a lent slot or data from below -> a fresh block (hot, or far), registered under `key` if any
COPY = "copy"  # hot block -> hot block (copy-on-write)


class BlockMove(NamedTuple):
    """One block's move. `src`/`dst` are block ids (hot or far: where a block lives is a property of its
    id) or swap-space slots, as the kind says; a promotion reads a lent slot of `tier`, or carries its
    data (a host tensor row) with src None; a pass-down reads the slot `src` of `tier`."""

    kind: str
    src: int | None
    dst: int | None
    key: BlockKey | None = None  # demote / promote: the block's identity in the tier it goes to
    data: torch.Tensor | None = None  # promote without a slot: [layers, 2, block_size, kv_heads, head_dim]
    tier: str | None = None  # promote, pass-down: the source tier (counters; the slot's owner)


def runs(moves: list[T], key: Callable[[T], Any] = attrgetter("kind")) -> list[list[T]]:
    """Consecutive moves (or ids) with the same key (by default, moves of one kind): each run is one transfer."""
    out: list[list[T]] = []
    for move in moves:
        if out and key(out[-1][0]) == key(move):
            out[-1].append(move)
        else:
            out.append([move])
    return out


class RestorePart(NamedTuple):
    """A run of promoted blocks from one tier: lent slots of a swap-space tier, or host data."""

    tier: str
    slots: list[int] | None  # read in place (SwapSpace.to_hot), released once read
    data: torch.Tensor | None  # [n, layers, 2, block_size, kv_heads, head_dim] on the host

    @property
    def num_blocks(self) -> int:
        return len(self.slots) if self.slots is not None else self.data.shape[0]


@dataclass
class Restore:
    """Blocks to promote into fresh hot blocks at admission: a prefix found below hot, or a swapped-out sequence's
    whole table (its blocks in the warm slots lent to it; no keys: they are not registered again)."""

    start: int  # index of the first restored block in the sequence's block table
    num_tokens: int  # tokens they hold (full blocks, except a swapped sequence's last one)
    keys: list[BlockKey] = field(default_factory=list)  # the first len(keys) blocks' identities: registered
    parts: list[RestorePart] = field(default_factory=list)  # where the blocks come from, in order

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.parts)

    @property
    def by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in self.parts:
            out[part.tier] = out.get(part.tier, 0) + part.num_blocks
        return out
