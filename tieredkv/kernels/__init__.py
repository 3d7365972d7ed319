"""KV-cache kernels: Triton on CUDA, plain-torch references elsewhere, chosen at one dispatch point."""

from tieredkv.kernels.dispatch import KernelOps, select_kernels

__all__ = ["KernelOps", "select_kernels"]
