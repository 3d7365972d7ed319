"""Dense layers (x @ W.T + b). On CPU in fp32 they avoid the default BLAS call, which is slow for our shapes.

Why: a decode step multiplies a few dozen rows by each weight matrix. On the x86 machines this
project is measured on, `F.linear` (MKL sgemm with the weight as the transposed right operand) is
up to twice as slow on such shapes as the alternatives:
  - oneDNN's matmul with the weight reordered once, at load time, into oneDNN's blocked layout
    (`pack_onednn_weight`): no per-call packing of the weight, which for a few rows is most of the
    work. The engine packs every projection and the LM head this way (`LlamaModel.pack_linear_weights`);
  - for a plain weight: with few rows and a layer-sized output, the same MKL product with the operands
    swapped, (W @ x.T).T, which MKL splits across threads along the weight rather than along the few
    rows; otherwise (many rows, or the vocabulary-wide LM head) oneDNN's matmul.
oneDNN ships inside every x86 and aarch64 build of torch, but its linear entry points
(`torch.ops.mkldnn._linear_pointwise`, `_reorder_linear_weight`) are internal, so they are used only
after a self-check on this very torch build. Measured on the engine benchmark's workload: plain
oneDNN/swapped products take about 15% off the engine's time against `F.linear`, and packed weights
another 11% (the numbers are in docs/architecture.md). `F.linear` serves everywhere else: CUDA, other dtypes,
or TIEREDKV_CPU_LINEAR=torch.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[..., torch.Tensor]  # (x [..., K], weight [N, K], bias [N] | None) -> [..., N]
PackFn = Callable[[torch.Tensor], torch.Tensor]  # weight [N, K] -> the same weight in the layout LinearFn reads best
SWAP_MAX_ROWS = 256  # up to this many rows the swapped product wins (decode steps, small prefill chunks)
SWAP_MAX_OUT = 8192  # wider outputs (the LM head) go to oneDNN at any row count


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's matmul; `weight` is a plain tensor or one from pack_onednn_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of `weight` in oneDNN's blocked layout (an opaque mkldnn tensor that only onednn_linear reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _swapped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


def _cpu_linear(large: LinearFn) -> LinearFn:
    def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.is_mkldnn:  # packed at load time
            return onednn_linear(x, weight, bias)
        if x.dim() == 2 and x.shape[0] <= SWAP_MAX_ROWS and weight.shape[0] <= SWAP_MAX_OUT:
            return _swapped_linear(x, weight, bias)
        return large(x, weight, bias)

    cpu_linear.__name__ = f"cpu_linear[swapped|{large.__name__}]"
    return cpu_linear


@functools.cache
def onednn_linear_usable() -> bool:
    """True when this torch build has the oneDNN linear op and it agrees with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 48, generator=gen)
    w = torch.randn(40, 48, generator=gen)
    b = torch.randn(40, generator=gen)
    try:
        with torch.inference_mode():
            packed = pack_onednn_weight(w)
            checks = [(onednn_linear(x, w, b), F.linear(x, w, b)),
                      (onednn_linear(x[0, :1], w), F.linear(x[0, :1], w)),
                      (onednn_linear(x, packed, b), F.linear(x, w, b)),
                      (onednn_linear(x[1], packed), F.linear(x[1], w))]
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return all(got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4) for got, want in checks)


@functools.cache
def _cpu_fp32_linear(use_onednn: bool) -> LinearFn:
    return _cpu_linear(onednn_linear if use_onednn else F.linear)


def _cpu_fp32(device: torch.device, dtype: torch.dtype, cpu_linear: str) -> bool:
    """True when the CPU fp32 dense layers apply (EngineConfig.cpu_linear "auto" or "packed"; "torch" turns
    them off)."""
    if cpu_linear not in ("auto", "packed", "torch"):
        raise ValueError(f"cpu_linear must be auto, packed or torch, got {cpu_linear!r}")
    return cpu_linear != "torch" and device.type == "cpu" and dtype == torch.float32


def select_linear(device: torch.device, dtype: torch.dtype, cpu_linear: str = "auto") -> LinearFn:
    """The dense-layer function for weights of `dtype` on `device`."""
    if _cpu_fp32(device, dtype, cpu_linear):
        return _cpu_fp32_linear(onednn_linear_usable())
    return F.linear


def select_weight_packing(device: torch.device, dtype: torch.dtype, cpu_linear: str = "auto") -> PackFn | None:
    """How to pack weights of `dtype` on `device` once at load time for select_linear's function;
    None where they are best left as they are."""
    if _cpu_fp32(device, dtype, cpu_linear) and onednn_linear_usable():
        return pack_onednn_weight
    return None
