"""Load or recompute: the measured rates that decide whether a prefix found in a blocking tier (cold, remote) is
read or computed again.

Each blocking tier's seconds per block are measured as it serves reads that find blocks (an exponential average),
and the engine's prefill rate as it computes (tokens per second of forward). A lookup reads a tier only
where the read is expected to beat computing the same blocks, and gives the read a deadline of that computing
time (half of it while the tier's cost is not known: its first read, a probe): a read still in flight then is
dropped and the blocks are computed, so a tier that turns slow costs at most one request that much. A tier not
read for `probe_s` is read again (with the deadline), so that one that recovers is used again. Before a request's
forward is measured, one of RATE_TOKENS tokens is timed at start (ModelRunner.time_prefill).
Below `floor_s` nothing is decided: a read expected to take less than that is always tried, and a read always has
at least that long (a few tens of milliseconds of TTFT are not worth a wrong guess from a noisy estimate)."""

from __future__ import annotations

import threading
import time

_ALPHA = 0.3  # weight of the newest measurement
RATE_TOKENS = 256  # forwards of fewer tokens do not inform the prefill rate: their fixed costs would make it low


class LoadRates:
    def __init__(self, block_size: int, probe_s: float = 30.0, floor_s: float = 0.05):
        self.block_size, self.probe_s, self.floor_s = block_size, probe_s, floor_s
        self.prefill_tokens_per_s: float | None = None
        self.seconds_per_block: dict[str, float] = {}
        self.last_read: dict[str, float] = {}
        self._lock = threading.Lock()

    def prefill(self, tokens: int, seconds: float) -> None:
        """A forward computed `tokens` in `seconds` (only forwards of RATE_TOKENS or more inform the rate: the
        prefixes worth deciding about are long, and a short forward's fixed costs would understate the rate)."""
        if tokens < RATE_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if old is None else old + _ALPHA * (rate - old)

    def read(self, tier: str, blocks: int, seconds: float) -> None:
        """A read of `tier` returned `blocks` in `seconds` (a miss, 0 blocks, says nothing of a block's cost)."""
        with self._lock:
            self.last_read[tier] = time.monotonic()
            if not blocks:
                return
            per = seconds / blocks
            old = self.seconds_per_block.get(tier)
            self.seconds_per_block[tier] = per if old is None else old + _ALPHA * (per - old)

    def estimate(self, tiers: list[str], blocks: int) -> tuple[float | None, float | None]:
        """(seconds to read `blocks` from the first of `tiers`, seconds to compute them); None where unmeasured."""
        with self._lock:
            per = self.seconds_per_block.get(tiers[0]) if tiers else None
            rate = self.prefill_tokens_per_s
        return (None if per is None else per * blocks,
                None if rate is None else blocks * self.block_size / rate)

    def skip(self, load: float | None, compute: float | None) -> bool:
        """Whether a read expected to take `load` seconds should not even start, computing taking `compute`."""
        return load is not None and compute is not None and load > max(compute, self.floor_s)

    def deadline(self, compute: float | None, known: bool = True) -> float | None:
        """When a read started now stops being worth waiting for (None: no estimate yet, wait for it): computing's
        time where the read is expected to beat it (`known`); half of it for a read whose cost is not known (a
        tier's first read, or a probe of one measured slower), so such a read costs a request at most 1.5 times
        its computing."""
        if compute is None:
            return None
        return time.monotonic() + max(compute if known else compute / 2, self.floor_s)

    def probe_due(self, tier: str) -> bool:
        """Whether `tier` has gone unread for probe_s: read it (with a deadline) to measure it again."""
        with self._lock:
            return time.monotonic() - self.last_read.get(tier, 0.0) > self.probe_s
