"""KV-cache kernels: Triton on CUDA, C kernels of the project's own on CPU where they serve, plain-torch references
elsewhere. The kernel table (KernelOps) is chosen once per engine by select_kernels; each dense layer's weight is
held in a format chosen once at load, which carries its product (kernels/dense.py)."""

from tieredkv.kernels.dispatch import select_kernels
from tieredkv.kernels.kernel_ops import KernelOps

__all__ = ["KernelOps", "select_kernels"]
