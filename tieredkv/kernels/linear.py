"""Dense layers (x @ W.T + b). On CPU in fp32 they avoid the default BLAS call, which is slow for our shapes.

Why: a decode step multiplies a few dozen rows by each weight matrix. On the x86 machines this
project is measured on, `F.linear` (MKL sgemm with the weight as the transposed right operand) is
up to twice as slow on such shapes as two alternatives:
  - for few rows and a layer-sized output, the same MKL product with the operands swapped,
    (W @ x.T).T, which MKL splits across threads along the weight rather than along the few rows;
  - otherwise (many rows, or the vocabulary-wide LM head), oneDNN's matmul. oneDNN ships inside every
    x86 and aarch64 build of torch, but its linear entry point `torch.ops.mkldnn._linear_pointwise`
    is internal, so it is used only after a self-check on this very torch build.
On the engine benchmark's workload this takes about 15% off the engine's time (the numbers are in
the README). `F.linear` serves everywhere else: CUDA, other dtypes, or TIEREDKV_CPU_LINEAR=torch.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[..., torch.Tensor]  # (x [..., K], weight [N, K], bias [N] | None) -> [..., N]
FORCE_ENV = "TIEREDKV_CPU_LINEAR"
SWAP_MAX_ROWS = 256  # up to this many rows the swapped product wins (decode steps, small prefill chunks)
SWAP_MAX_OUT = 8192  # wider outputs (the LM head) go to oneDNN at any row count


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _swapped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


def _cpu_linear(large: LinearFn) -> LinearFn:
    def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
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
            checks = [(onednn_linear(x, w, b), F.linear(x, w, b)), (onednn_linear(x[0, :1], w), F.linear(x[0, :1], w))]
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return all(got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4) for got, want in checks)


@functools.cache
def _cpu_fp32_linear(use_onednn: bool) -> LinearFn:
    return _cpu_linear(onednn_linear if use_onednn else F.linear)


def select_linear(device: torch.device, dtype: torch.dtype) -> LinearFn:
    """The dense-layer function for weights of `dtype` on `device`."""
    forced = os.environ.get(FORCE_ENV, "auto")
    if forced not in ("auto", "torch"):
        raise ValueError(f"{FORCE_ENV} must be auto or torch, got {forced!r}")
    if forced == "auto" and device.type == "cpu" and dtype == torch.float32:
        return _cpu_fp32_linear(onednn_linear_usable())
    return F.linear
