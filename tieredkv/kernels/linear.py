"""Dense layers (x @ W.T + b). On CPU in fp32 they go through oneDNN rather than the default BLAS call.

Why: the engine's decode steps multiply a few dozen rows by each weight matrix. On the x86 machines
this project is measured on, the default fp32 path (`F.linear` -> MKL sgemm) runs those shapes at a
third to a half of the speed oneDNN's matmul reaches, and the gap is what separates a batched decode
step from a compute-bound one (see benchmarks/bench_engine.py). oneDNN ships inside every x86 and
aarch64 build of torch, but its linear entry point `torch.ops.mkldnn._linear_pointwise` is internal,
so it is used only after a self-check on this very torch build, and `F.linear` serves everywhere else
(CUDA, other dtypes, builds without oneDNN, or TIEREDKV_CPU_LINEAR=torch).
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[..., torch.Tensor]  # (x [..., K], weight [N, K], bias [N] | None) -> [..., N]
FORCE_ENV = "TIEREDKV_CPU_LINEAR"


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


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


def select_linear(device: torch.device, dtype: torch.dtype) -> LinearFn:
    """The dense-layer function for weights of `dtype` on `device`."""
    forced = os.environ.get(FORCE_ENV, "auto")
    if forced not in ("auto", "torch", "onednn"):
        raise ValueError(f"{FORCE_ENV} must be auto, torch or onednn, got {forced!r}")
    if forced != "torch" and device.type == "cpu" and dtype == torch.float32 and onednn_linear_usable():
        return onednn_linear
    if forced == "onednn":
        raise ValueError(f"{FORCE_ENV}=onednn needs fp32 weights on CPU and a torch build whose oneDNN passes the check")
    return F.linear
