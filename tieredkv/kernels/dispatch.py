"""The one place that picks Triton kernels, the CPU kernels or their torch references."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from tieredkv.kernels.block_copy import copy_blocks_ref, gather_blocks_ref, scatter_blocks_ref
from tieredkv.kernels.decode_attention import decode_attention_cpu, decode_attention_ref, plan_decode
from tieredkv.kernels.kernel_ops import KernelOps, with_kv
from tieredkv.kernels.kv_format import KVLayout
from tieredkv.kernels.prefill_attention import prefill_attention_cpu, prefill_attention_ref
from tieredkv.kernels.rotary import rotary_cpu
from tieredkv.kernels.store_kv import store_kv_cpu, store_kv_ref


TORCH_OPS = KernelOps(
    name="torch",
    store_kv=store_kv_ref,
    decode_attention=decode_attention_ref,
    prefill_attention=prefill_attention_ref,
    copy_blocks=copy_blocks_ref,
    gather_blocks=gather_blocks_ref,
    scatter_blocks=scatter_blocks_ref,
    plan_decode=plan_decode,
)
# on CPU attention, the rotary embedding and the KV cache's store go through the CPU kernels where they serve
CPU_OPS = replace(TORCH_OPS, name="cpu", decode_attention=decode_attention_cpu, store_kv=store_kv_cpu,
                  prefill_attention=prefill_attention_cpu, rotary=rotary_cpu)


def select_kernels(backend: str, device: torch.device, kv: KVLayout | None = None) -> KernelOps:
    """"auto" takes Triton on CUDA, the CPU kernels on CPU and torch elsewhere (EngineConfig.attention_backend).
    `kv`: the cache's formats (kernels/kv_format.py), bound into the store and attention ops. (Dense layers are
    chosen per weight at load: kernels/dense.py.)"""
    return with_kv(_attention_kernels(backend, device), kv)


def _attention_kernels(backend: str, device: torch.device) -> KernelOps:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, got {backend!r}")
    if backend == "auto" and device.type == "cpu":
        return CPU_OPS
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TORCH_OPS
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1)")
    from tieredkv.kernels.triton_ops import TRITON_OPS

    return TRITON_OPS
