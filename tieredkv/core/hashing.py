"""Chained block hashes: stable across processes, so the cold tier can outlive the engine."""

from __future__ import annotations

import hashlib
import struct
from typing import NewType, Sequence

BlockHash = NewType("BlockHash", bytes)


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Fixed byte encoding: little-endian u32 per token id."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def root_hash(fingerprint: str) -> BlockHash:
    """The chain's seed: everything that changes what a block's K/V bytes mean."""
    return BlockHash(hashlib.sha256(b"tieredkv-root\x00" + fingerprint.encode()).digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """h_i = sha256(h_{i-1} || u32le(token ids of block i))."""
    return BlockHash(hashlib.sha256(parent + encode_token_ids(token_ids)).digest())
