"""Rotary position embedding of queries and keys: the torch reference, which is what the model's forward computes,
and the CPU kernel (decode_cpu.c: tkv_rotary), the same arithmetic in one pass with the same bits (each product
rounded, then their sum: no fused multiply-add), where torch takes five element-wise passes and two temporaries."""

from __future__ import annotations

import torch

from tieredkv.kernels.calls import record


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by its positions' cos and sin [T, 1, D] (each half of D the same frequencies)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotary_ref's contract and bits on CPU, in fp32: a new contiguous [T, H, D] from x's rows, which may be a view
    (the queries and keys are slices of the fused q/k/v product's rows); the reference for anything else, and
    inside a compiled graph."""
    from tieredkv.kernels.quant_cpu import CPU

    T, H, D = x.shape if x.dim() == 3 else (0, 0, 0)
    if (CPU.lib is None or D == 0 or D % 2 or x.device.type != "cpu" or x.dtype != torch.float32
            or x.stride(2) != 1 or x.stride(1) != D or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or cos.shape != (T, 1, D) or sin.shape != (T, 1, D) or not cos.is_contiguous()
            or not sin.is_contiguous() or torch.compiler.is_compiling()):
        record("rotary", "torch")
        return rotary_ref(x, cos, sin)
    record("rotary", "CPU kernel")
    out = torch.empty((T, H, D), dtype=torch.float32)
    CPU.lib.tkv_rotary(x.data_ptr(), T, x.stride(0), H, D, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out
