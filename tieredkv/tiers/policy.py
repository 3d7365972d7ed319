"""What the tiers keep: how often each block is used, the eviction order of hot and warm (LRU, or LFU with
dynamic aging), and which blocks the tiers below warm (cold, remote) admit.

One `Popularity` table serves every decision. It counts the uses of each block hash (computed once, found in
the cache by a prompt each time after), halving every count once they add up to `window` (TinyLFU's reset),
so a prefix popular an hour ago loses its weight and the table holds at most about `window` hashes. It also
remembers which blocks held generated tokens (output blocks) and which a client marked (pinned prefixes,
`cache_control`, `prompt_cache_key`).

LFU with dynamic aging (LFU-DA): a block's priority is its use count plus the clock, the priority of the last
block evicted; the lowest priority goes first, equal priorities in the order they came (a chain's tail is freed
before its head, and never has more uses than its head, so the tail-first rule holds). The clock lets a new
block outrank old ones that were popular long ago. Every operation is O(log n): a heap with lazy deletion.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Generic, Hashable, Iterable, Iterator, TypeVar

from tieredkv.hashing import BlockHash

EVICTION_POLICIES = ("lru", "lfu")


def check_eviction(eviction: str) -> None:
    if eviction not in EVICTION_POLICIES:
        raise ValueError(f'eviction must be "lru" or "lfu", got {eviction!r}')
_OUTPUT, _MARKED = 1, 2

T = TypeVar("T", bound=Hashable)


class Popularity:
    """Uses and flags of block hashes, aged (see the module's docstring)."""

    def __init__(self, window: int, active: bool = True):
        self.window = max(window, 64)
        self.active = active  # off where nothing reads the counts (LRU, every block admitted): nothing is counted
        self._uses: dict[BlockHash, int] = {}
        self._flags: dict[BlockHash, int] = {}
        self._total = 0

    def uses(self, block_hash: BlockHash | None) -> int:
        return self._uses.get(block_hash, 0) if block_hash is not None else 0

    def use(self, hashes: Iterable[BlockHash]) -> None:
        """One more use of each block, found in the cache by a prompt (which makes it a prompt block)."""
        if self.active:
            for h in hashes:
                self._count(h, output=False)

    def computed(self, block_hash: BlockHash, output: bool) -> None:
        """A block that became full of computed tokens: one use; `output`: it holds generated tokens."""
        if self.active:
            self._count(block_hash, output)

    def _count(self, block_hash: BlockHash, output: bool) -> None:
        self._uses[block_hash] = self._uses.get(block_hash, 0) + 1
        self._total += 1
        flags = self._flags.get(block_hash, 0)
        if bool(flags & _OUTPUT) != output:
            self._set(block_hash, flags ^ _OUTPUT)
        if self._total >= self.window:
            self._age()

    def _age(self) -> None:
        self._uses = {h: n // 2 for h, n in self._uses.items() if n > 1}
        self._flags = {h: f for h, f in self._flags.items() if h in self._uses}  # marks age out with their uses
        self._total = sum(self._uses.values())

    def _set(self, block_hash: BlockHash, flags: int) -> None:
        if flags:
            self._flags[block_hash] = flags
        else:
            self._flags.pop(block_hash, None)

    def mark(self, hashes: Iterable[BlockHash], marked: bool = True) -> None:
        """A client asked to keep these blocks (a pin, cache_control, prompt_cache_key): admitted below warm
        whatever their uses; `marked=False` takes the mark away."""
        if not self.active:
            return
        for h in hashes:
            flags = self._flags.get(h, 0)
            self._set(h, flags | _MARKED if marked else flags & ~_MARKED)

    def is_output(self, block_hash: BlockHash) -> bool:
        return bool(self._flags.get(block_hash, 0) & _OUTPUT)

    def is_marked(self, block_hash: BlockHash) -> bool:
        return bool(self._flags.get(block_hash, 0) & _MARKED)


class Admission:
    """Which blocks the tiers below warm take: marked ones always; others once used `min_uses` times, and
    output blocks only with `output_blocks`. The defaults (1, True) admit every block."""

    def __init__(self, popularity: Popularity, min_uses: int = 1, output_blocks: bool = True):
        self.popularity, self.min_uses, self.output_blocks = popularity, min_uses, output_blocks

    @property
    def admits_all(self) -> bool:
        return self.min_uses <= 1 and self.output_blocks

    def admits(self, block_hash: BlockHash) -> bool:
        pop = self.popularity
        if self.admits_all or pop.is_marked(block_hash):
            return True
        if not self.output_blocks and pop.is_output(block_hash):
            return False
        return pop.uses(block_hash) >= self.min_uses

    def why_not(self, block_hash: BlockHash) -> str:
        """Why admits() refused a block (for logs and explain)."""
        if not self.output_blocks and self.popularity.is_output(block_hash):
            return "an output block (admit_output_blocks is off)"
        uses = self.popularity.uses(block_hash)
        return f"used {'once' if uses == 1 else f'{uses} times'}, below admit_min_uses={self.min_uses}"


class LFUQueue(Generic[T]):
    """Items by LFU-DA priority (`weight(item)` + the clock at insertion), lowest first, ties in insertion
    order. push, discard and len are O(1) or O(log n); stale heap entries are skipped and compacted away."""

    def __init__(self, weight: Callable[[T], int]):
        self.weight = weight
        self.clock = 0
        self._heap: list[tuple[int, int, T]] = []
        self._live: dict[T, int] = {}  # item -> the sequence number of its live heap entry
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def push(self, item: T) -> None:
        """Inserts the item, or re-ranks it (a hit) at its current weight."""
        seq = next(self._seq)
        self._live[item] = seq
        heapq.heappush(self._heap, (self.weight(item) + self.clock, seq, item))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def discard(self, item: T) -> None:
        self._live.pop(item, None)

    def pop(self) -> T:
        """The item of lowest priority, removed; its priority becomes the clock. IndexError when empty."""
        heap, live = self._heap, self._live
        while heap:
            priority, seq, item = heapq.heappop(heap)
            if live.get(item) == seq:
                del live[item]
                self.clock = max(self.clock, priority)
                return item
        raise IndexError("empty")

    def __iter__(self) -> Iterator[T]:
        """The items, lowest priority first (O(n log n))."""
        return iter([e[2] for e in sorted(self._heap) if self._live.get(e[2]) == e[1]])
