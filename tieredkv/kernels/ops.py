"""The `tieredkv` library of torch operators, declared in one place: each Python operator's schema, the
implementations and shape functions the modules that own them give it (`implement`), and the C++ operators
of quant_ops.cpp, loaded with theirs (`load_cpp_operators`). No other module calls torch.library
(tests/test_layers.py checks it).

    quant_linear, quant_rows    quantized weights' product and rows (kernels/quant.py)
    dense_packed                a packed weight's product through its handle (kernels/linear.py)
    quant_gemv, paged_decode,   C++ over the CPU library's kernels: one-row quantized and packed products, decode
    packed_gemv, store_kv_rows, attention, the KV formats' store and their rows as values (quant_ops.cpp, bound by
    kv_values                   kernels/quant_cpu.py)

Defined through torch.library's Library rather than custom_op: a call costs ~6 us instead of ~24 (a decode
step of the default model makes 121 of them)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

LIBRARY = torch.library.Library("tieredkv", "DEF")
LIBRARY.define("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group_size, Tensor? bias, "
               "int int8_rows=-1) -> Tensor")
LIBRARY.define("quant_rows(Tensor codes, Tensor scales, Tensor? offsets, int group_size, Tensor ids) -> Tensor")
LIBRARY.define("dense_packed(Tensor x, Tensor handle, Tensor? bias) -> Tensor")


def implement(name: str, fn: Callable, keys: tuple[str, ...], shape: Callable) -> None:
    """tieredkv::name runs `fn` on the dispatch keys given ("CPU", "CUDA"); `shape` gives its output without
    computing it, for the compiler's tracing."""
    for key in keys:
        LIBRARY.impl(name, fn, key)
    torch.library.register_fake(f"tieredkv::{name}", shape)


def load_cpp_operators(path: Path, shapes: dict[str, Callable]) -> None:
    """Loads the C++ operators' library (it registers them) and gives each its shape function."""
    torch.ops.load_library(str(path))
    for name, shape in shapes.items():
        torch.library.register_fake(f"tieredkv::{name}", shape)
