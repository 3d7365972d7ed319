"""Block moves: what a step does to block data before its forward, decided by the scheduler as plain data.

The scheduler and the KV manager only change metadata (block tables, ref counts, the hash map, tier
indexes) and append a BlockMove for every byte that has to move. The tier manager carries the list
out in one place before the forward, in the order it was planned. That order is safe because a
block's data is always read before anything is planned into it: an evicted hot block is demoted (and
a preempted one swapped out) when the allocation that frees it is planned, and every write into it
(a promotion, a swap-in, a copy-on-write copy, the forward) is planned after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tieredkv.tiers.base import BlockKey

DEMOTE = "demote"  # hot block -> warm, else cold; keeps the block findable below hot
SWAP_OUT = "swap_out"  # hot block -> a warm slot lent to a preempted sequence
PROMOTE = "promote"  # warm or cold data -> a fresh hot block, registered under `key`
SWAP_IN = "swap_in"  # a lent warm slot -> a fresh hot block; the slot is released
COPY = "copy"  # hot block -> hot block (copy-on-write)


class BlockMove(NamedTuple):
    """One block's move. `src`/`dst` are hot block ids or warm slots, as the kind says; a promotion
    carries its data (a host tensor row, read at lookup time) instead of a source slot."""

    kind: str
    src: int | None
    dst: int | None
    key: BlockKey | None = None  # demote / promote: the block's identity in the tier it goes to
    data: torch.Tensor | None = None  # promote: [layers, 2, block_size, kv_heads, head_dim] on the host
    tier: str | None = None  # promote: where the data came from ("warm" or "cold"), for the counters


def runs(moves: list[BlockMove]) -> list[list[BlockMove]]:
    """Consecutive moves of one kind, batched: each run is carried out with one transfer."""
    out: list[list[BlockMove]] = []
    for move in moves:
        if out and out[-1][0].kind == move.kind:
            out[-1].append(move)
        else:
            out.append([move])
    return out


@dataclass
class Restore:
    """Blocks to write into fresh hot blocks at admission: a promotion or a swap-in."""

    start: int  # index of the first restored block in the sequence's block table
    num_tokens: int  # tokens they hold (full blocks, except a swapped sequence's last one)
    data: torch.Tensor | None  # [n, layers, 2, block_size, kv_heads, head_dim] in host memory; None: swap slots
    keys: list[BlockKey] = field(default_factory=list)  # promotions: to register in the hash map
    by_tier: dict[str, int] = field(default_factory=dict)  # promoted blocks per source tier
    swap_slots: list[int] | None = None  # swap-ins: warm slots to release

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0] if self.data is not None else len(self.swap_slots)
