"""The kernel set's type: a leaf module that both the dispatcher and the kernel modules import."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from tieredkv.kernels.rotary import rotary_ref

if TYPE_CHECKING:
    from tieredkv.kernels.kv_format import KVLayout


@dataclass(frozen=True)
class KernelOps:
    """The kernel set one engine uses; every op has the signature of its torch reference.

    Dense layers are not in it: each weight's format carries its product (kernels/dense.py); `graph` says the
    forward runs in the compiled decode graph, where each format's graph_forward serves.
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
    plan_decode: Callable[..., object] | None = None  # per-step decode plan, made once in ModelRunner.prepare
    rotary: Callable[..., torch.Tensor] = rotary_ref  # queries' and keys' rotary embedding (kernels/rotary.py)
    kv: "KVLayout | None" = None
    graph: bool = False  # the dense layers' products as the compiled graph takes them (DenseWeight.graph_forward)


def with_kv(ops: KernelOps, kv: "KVLayout | None") -> KernelOps:
    """`ops` whose store and attention functions read and write the cache in the formats `kv` (each is given
    kv=); `ops` as they are where the cache holds the compute dtype (kv None or plain)."""
    if kv is None or kv.plain:
        return ops
    bind = functools.partial
    return replace(ops, kv=kv, store_kv=bind(ops.store_kv, kv=kv), decode_attention=bind(ops.decode_attention, kv=kv),
                   prefill_attention=bind(ops.prefill_attention, kv=kv))
