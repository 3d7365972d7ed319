"""Chained block hashes: stable across processes, so the cold tier can outlive the engine."""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple, NewType, Sequence

BlockHash = NewType("BlockHash", bytes)


class BlockKey(NamedTuple):
    """A full block's chained hash and its token ids (compared on every hit)."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Fixed byte encoding: little-endian u32 per token id."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def root_hash(fingerprint: str) -> BlockHash:
    """The chain's seed: everything that changes what a block's K/V bytes mean."""
    return BlockHash(hashlib.sha256(b"tieredkv-root\x00" + fingerprint.encode()).digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """h_i = sha256(h_{i-1} || u32le(token ids of block i))."""
    return BlockHash(hashlib.sha256(parent + encode_token_ids(token_ids)).digest())


def chain_keys(root: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """The keys of every full block of token_ids, hashed in a chain from `root`."""
    keys: list[BlockKey] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        parent = hash_block(parent, block)
        keys.append(BlockKey(parent, block))
    return keys
