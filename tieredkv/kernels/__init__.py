"""KV-cache kernels: Triton on CUDA, C kernels of the project's own on CPU where they serve, plain-torch references
elsewhere, chosen at one dispatch point."""

from tieredkv.kernels.dispatch import select_kernels
from tieredkv.kernels.kernel_ops import KernelOps

__all__ = ["KernelOps", "select_kernels"]
