"""Write new K/V into the paged cache through the slot mapping."""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, -1 marks a padding token that is not stored
) -> None:
    """Plain-torch reference: cache[slot // block_size, slot % block_size] = k/v for slot >= 0."""
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    keep = slot_mapping >= 0
    if bool(keep.all()):
        flat_k.index_copy_(0, slot_mapping, key)
        flat_v.index_copy_(0, slot_mapping, value)
    else:
        slots = slot_mapping[keep]
        flat_k.index_copy_(0, slots, key[keep])
        flat_v.index_copy_(0, slots, value[keep])
