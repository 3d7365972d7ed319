"""A tier that lives in a dict: the smallest KVTier, used only by the tests to show that a new tier is
one class that passes the contract suite and then works under the tier manager."""

from __future__ import annotations

from collections import OrderedDict

import torch

from tieredkv.tiers.base import BlockKey, KVTier


class MemoryTier(KVTier):
    name = "cold"  # it stands in for the bottom tier

    def __init__(self, capacity_blocks: int, block_bytes: int):
        super().__init__(capacity_blocks * block_bytes)
        self.capacity, self.block_bytes = capacity_blocks, block_bytes
        self.data: OrderedDict[BlockKey, torch.Tensor] = OrderedDict()

    def _used_bytes(self) -> int:
        return len(self.data) * self.block_bytes

    def contains_sync(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        return n

    def get_sync(self, keys):
        n = self.contains_sync(keys)
        for key in keys[:n]:
            self.data.move_to_end(key)
        return torch.stack([self.data[k] for k in keys[:n]]) if n else None

    def put_sync(self, keys, blocks):
        for key, block in zip(keys, blocks):
            self.data[key] = block.clone()
            self.data.move_to_end(key)
        while len(self.data) > self.capacity:
            self.data.popitem(last=False)
            self.count(evictions=1)
        return sum(1 for k in keys if k in self.data)

    def remove_sync(self, keys):
        return sum(self.data.pop(k, None) is not None for k in keys)

    def clear_sync(self):
        n = len(self.data)
        self.data.clear()
        return n

    def export_sync(self, batch):
        items = list(self.data.items())
        for i in range(0, len(items), batch):
            part = items[i : i + batch]
            yield [k for k, _ in part], torch.stack([v for _, v in part])
