"""Write new K/V into the paged cache through the slot mapping."""

from __future__ import annotations

import torch

from tieredkv.kernels.kv_format import FLOAT_FORMATS, KVLayout


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # one layer's [2, num_blocks, block_size, Hkv, D]: K then V
    slot_mapping: torch.Tensor,  # [T] int, -1 marks a padding token that is not stored
    kv: KVLayout | None = None,
) -> None:
    """Plain-torch reference: cache[slot // block_size, slot % block_size] = k/v for slot >= 0, as rows in the
    cache's formats (`kv`, kernels/kv_format.py) where it does not hold the values' dtype."""
    if kv is not None:
        key, value = kv.encode(0, key), kv.encode(1, value)
    flat_k = kv_cache[0].view(-1, *kv_cache.shape[3:])
    flat_v = kv_cache[1].view(-1, *kv_cache.shape[3:])
    keep = slot_mapping >= 0
    if bool(keep.all()):
        flat_k.index_copy_(0, slot_mapping, key)
        flat_v.index_copy_(0, slot_mapping, value)
    else:
        slots = slot_mapping[keep]
        flat_k.index_copy_(0, slots, key[keep])
        flat_v.index_copy_(0, slots, value[keep])


def store_kv_dense(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   kv: KVLayout | None = None) -> None:
    """store_kv_ref for a batch without padding (every slot >= 0), written for a compiled graph: no check
    that reads the data, and one index_put_ on the layer's cache itself, which inductor applies in place.
    (A store through a view taken inside the graph, or into K and V passed as two inputs that share
    storage, makes it copy a whole cache.)"""
    if kv is not None:
        key, value = kv.encode(0, key), kv.encode(1, value)
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    which = torch.arange(2, device=slot_mapping.device)[:, None]
    flat.index_put_((which, slot_mapping[None, :]), torch.stack((key, value)))


def store_kv_cpu(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv: KVLayout | None = None) -> None:
    """store_kv_ref's contract on CPU: rows stored by the C kernel in one call (torch.ops.tieredkv.store_kv_rows:
    the KV formats' rows encoded as kv_format's encode does, without its dozen torch calls a layer; an fp32 cache's
    rows copied as they are, where index_copy_ takes two passes of its own a layer); store_kv_ref where the operator
    is not bound, the values are not fp32 on CPU, the cache holds another float, or a graph is traced."""
    from tieredkv.kernels.quant_cpu import CPU

    plain = kv is None or kv.plain
    if (not CPU.operators_bound or key.dtype != torch.float32 or key.device.type != "cpu"
            or torch.compiler.is_compiling() or kv_cache.dtype != (torch.float32 if plain else torch.uint8)):
        store_kv_ref(key, value, kv_cache, slot_mapping, kv)
        return
    codes = (FLOAT_FORMATS[torch.float32],) * 2 if plain else kv.codes
    torch.ops.tieredkv.store_kv_rows(key, value, kv_cache.view(torch.uint8), slot_mapping, *codes)

