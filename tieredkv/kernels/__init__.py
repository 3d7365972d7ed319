"""KV-cache kernels: Triton on CUDA, plain-torch references elsewhere, chosen at one dispatch point."""

from tieredkv.kernels.dispatch import select_kernels
from tieredkv.kernels.kernel_ops import KernelOps

__all__ = ["KernelOps", "select_kernels"]
