"""Prefix lookups below hot: counted now where a tier answers at once, read in a thread where it blocks."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tieredkv.tiers.base import BlockKey, KVTier, SwapSpace
from tieredkv.tiers.moves import Restore, RestorePart

log = logging.getLogger("tieredkv")


@dataclass
class Lookup:
    """A waiting sequence's walk below hot: counts in the non-blocking tiers now (their blocks are
    taken at admission), the blocking tiers' blocks read in the reader thread."""

    start: int  # first block index looked up below hot
    keys: list[BlockKey]
    found: list[tuple[KVTier, int]]  # leading hits per non-blocking tier, in order
    below: Future | None  # -> [(tier name, blocks)] from the blocking tiers
    deadline: float | None = None  # monotonic: past it, a read still in flight is given up and the rest computed
    decision: dict = field(default_factory=dict)  # why the blocking tiers were read or not (explain, the log)
    blocking: str | None = None  # the first blocking tier weighed, by name

    @property
    def late(self) -> bool:
        """The blocking tiers' read is still in flight past its deadline: computing is faster."""
        return (self.below is not None and not self.below.done() and self.deadline is not None
                and time.monotonic() > self.deadline)

    @property
    def ready(self) -> bool:
        return self.below is None or self.below.done() or self.late

    def give_up_below(self) -> None:
        """Stops waiting for the blocking tiers (their read finishes in its thread and is dropped)."""
        self.below = None

    def num_blocks(self) -> int:
        """Blocks the lookup found (once ready); admission may get fewer if some were evicted since."""
        n = sum(count for _, count in self.found)
        if self.below is not None and self.below.done() and self.below.exception() is None:
            n += sum(data.shape[0] for _, data in self.below.result())
        return n


def _read_below(tiers: list[KVTier], keys: list[BlockKey], rates) -> list[tuple[str, torch.Tensor]]:
    out = []
    for tier in tiers:
        t0 = time.monotonic()
        data = tier.get_sync(keys) if keys else None
        rates.read(tier.name, data.shape[0] if data is not None else 0, time.monotonic() - t0)
        if data is None:
            break
        out.append((tier.name, data))
        keys = keys[data.shape[0]:]
    return out


def start_lookup(lower: list[KVTier], reader, rest: list[BlockKey], start: int, rates) -> Lookup | None:
    """Walks `rest` (keys from block `start` on) through the lower tiers, each continuing where the one
    above stopped: non-blocking tiers are counted now, the blocking ones read by `reader` when `rates` (a
    LoadRates) expects the read to beat computing those blocks, with that computing time as its deadline."""
    if not rest or not lower:
        return None
    found, i, tiers = [], 0, list(lower)
    while tiers and not tiers[0].blocking and i < len(rest):
        tier = tiers.pop(0)
        n = tier.contains_sync(rest[i:])
        found.append((tier, n))
        i += n
    below, deadline, decision = None, None, {}
    if tiers and i < len(rest):
        load, compute = rates.estimate([t.name for t in tiers], len(rest) - i)
        decision = {"blocks": len(rest) - i, "read_s": load, "compute_s": compute}
        if rates.skip(load, compute) and not rates.probe_due(tiers[0].name):
            decision["read"] = False  # expected slower than computing: not even tried
            for tier in tiers:
                tier.count(skipped=(len(rest) - i))
        else:
            decision["read"] = True
            below = reader.submit(_read_below, tiers, rest[i:], rates)
            deadline = rates.deadline(compute, known=load is not None and not rates.skip(load, compute))
    return Lookup(start, rest, found, below, deadline, decision, tiers[0].name if decision else None)


def finish_lookup(lookup: Lookup, block_size: int, bottom: KVTier) -> Restore | None:
    """Turns a finished lookup into a promotion: takes the blocks from the non-blocking tiers (lending
    a swap-space tier's slots) and adds the blocking tiers' data. Stops at the first block no longer
    there (evicted since the lookup); None if nothing is left."""
    parts, i, complete = [], 0, True
    for tier, n in lookup.found:
        keys = lookup.keys[i : i + n]
        if isinstance(tier, SwapSpace):
            slots = tier.take(keys)
            part = RestorePart(tier.name, slots, None) if slots else None
        else:
            data = tier.get_sync(keys)
            part = RestorePart(tier.name, None, data) if data is not None else None
        got = part.num_blocks if part else 0
        if part:
            parts.append(part)
        i += got
        if got < n:
            complete = False
            break
    if lookup.late:  # the read would finish after computing the blocks would: they are computed
        log.info("a prefix read below hot passed its deadline (%.3f s to compute %d blocks): computed instead",
                 lookup.decision.get("compute_s") or 0.0, lookup.decision.get("blocks", 0))
        lookup.decision["late"] = True
        lookup.give_up_below()
    if complete and lookup.below is not None:
        try:
            for name, data in lookup.below.result():
                parts.append(RestorePart(name, None, data))
                i += data.shape[0]
        except Exception:
            log.exception("reading a lower tier failed")
            bottom.count(failures=1)
    if not parts:
        return None
    return Restore(lookup.start, i * block_size, lookup.keys[:i], parts)


def describe(decision: dict, tier: str, block_size: int) -> str | None:
    """A lookup's load-or-recompute decision in words, for the request's usage: "recomputed 2,048 tokens: cold
    read 1.9 s > prefill 0.8 s"; None when no blocking tier was weighed."""
    if not decision:
        return None
    tokens, read, compute = decision["blocks"] * block_size, decision.get("read_s"), decision.get("compute_s")
    expected = (f"{tier} read {read:.3g} s" if read is not None else f"{tier} read unmeasured") + \
        (f" vs prefill {compute:.3g} s" if compute is not None else "")
    if decision.get("late"):
        return f"recomputed up to {tokens:,} tokens: the {tier} read passed its deadline ({expected})"
    if not decision.get("read"):
        return f"recomputed up to {tokens:,} tokens: {expected.replace(' vs ', ' > ')}"
    return f"read up to {tokens:,} tokens from {tier} ({expected})"


def count_lookup(tiers: list[KVTier], by_tier: dict[str, int], num_queried_tokens: int, block_size: int) -> None:
    """Records a request's first admission on each tier, top to bottom: the tokens it served (hits), and
    the tokens it was asked for but did not have (misses). by_tier: blocks served per tier name."""
    remaining = num_queried_tokens
    for tier in tiers:
        n = by_tier.get(tier.name, 0) * block_size
        tier.count(hits=n, misses=remaining - n)
        remaining -= n
