"""Subprocess for the cold-tier reliability tests: writes deterministic blocks in batches forever
(or `count` batches), printing each committed batch number."""

import sys

import torch

from tieredkv.core.hashing import hash_block, root_hash
from tieredkv.tiers.base import BlockKey
from tieredkv.tiers.cold import ColdTier

SHAPE = (2, 2, 4, 2, 8)
FINGERPRINT = "fp-reliability"


def key(i: int) -> BlockKey:
    tokens = (i, i + 1, i + 2, i + 3)
    return BlockKey(hash_block(root_hash(FINGERPRINT), tokens), tokens)


def block(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i)) + torch.arange(SHAPE[-1], dtype=torch.float32)


def open_tier(path: str, budget: int = 1 << 30) -> ColdTier:
    return ColdTier(path, budget, FINGERPRINT, SHAPE, torch.float32)


if __name__ == "__main__":
    path, start, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tier = open_tier(path)
    batch = 0
    while count < 0 or batch < count:
        ids = range(start + batch * 50, start + batch * 50 + 50)
        tier.put_sync([key(i) for i in ids], torch.stack([block(i) for i in ids]))
        print(batch, flush=True)
        batch += 1
    tier.close_sync()
