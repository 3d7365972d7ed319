"""The kernel set's type: a leaf module that both the dispatcher and the kernel modules import."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from tieredkv.kernels.kv_format import KVLayout


@dataclass(frozen=True)
class KernelOps:
    """The kernel set one engine uses; every op has the signature of its torch reference.

    `linear` is the dense-layer function (F.linear's signature) picked for the weights' device and dtype;
    `pack_linear_weight`, when not None, turns a weight into the layout `linear` reads best, once at
    load time (see LlamaModel.pack_linear_weights); `packed_attr` names what `linear` is given then (the
    compiled graph reads "packed_handle", kernels/linear.py: dense_by_handle).
    `plan_decode(block_tables, context_lens, block_size, dtype, prefixes)`, when not None, builds what
    `decode_attention(..., plan=)` reuses in every layer of a step; `prefixes` are the decode rows that
    share leading blocks (kernels/cascade.py), for a kernel set that attends them together.
    `kv`: the cache's K/V formats where it does not hold the compute dtype (kernels/kv_format.py), bound into
    store_kv, decode_attention and prefill_attention by `with_kv`; None where it does.
    """

    name: str
    store_kv: Callable[..., None]
    decode_attention: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    gather_blocks: Callable[..., None]
    scatter_blocks: Callable[..., None]
    linear: Callable[..., torch.Tensor] = torch.nn.functional.linear
    pack_linear_weight: Callable[[torch.Tensor], torch.Tensor] | None = None
    packed_attr: str = "packed_weight"  # the layer attribute `linear` reads where weights are packed
    plan_decode: Callable[..., object] | None = None  # per-step decode plan, made once in ModelRunner.prepare
    kv: "KVLayout | None" = None


def with_kv(ops: KernelOps, kv: "KVLayout | None") -> KernelOps:
    """`ops` whose store and attention functions read and write the cache in the formats `kv` (each is given
    kv=); `ops` as they are where the cache holds the compute dtype (kv None or plain)."""
    if kv is None or kv.plain:
        return ops
    bind = functools.partial
    return replace(ops, kv=kv, store_kv=bind(ops.store_kv, kv=kv), decode_attention=bind(ops.decode_attention, kv=kv),
                   prefill_attention=bind(ops.prefill_attention, kv=kv))
