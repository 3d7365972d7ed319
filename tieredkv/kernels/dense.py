"""A dense layer's weight as one object: its format chosen once at load, its product in and out of a graph.

Every projection and the LM head hold a DenseWeight (models/llama.py: Projection.format). The formats:

    PlainWeight      the weight as loaded. Eager: on CPU (EngineConfig.cpu_linear) the swapped product for a few
                     fp32 rows and oneDNN's for more (kernels/linear.py says why); elsewhere F.linear. In a graph:
                     F.linear.
    PackedWeight     oneDNN's blocked copy, with the layout quant_cpu.c's one-row kernels read it in. Eager: the
                     one-row kernel for a single row where it reads the layout, else oneDNN's product. In a graph:
                     through its handle (linear.dense_by_handle), or F.linear on a plain copy kept beside it.
    QuantizedWeight  codes and scales ("q8", "q4", and their tiles "q8t", "q4t"), and QuantizedParts (pieces in two
                     formats): quant_linear, in and out of a graph (kernels/quant.py).

`choose_layout` is the one place that decides how full-precision weights are held (from the device, the dtype,
EngineConfig.cpu_linear, whether the compiled decode path runs and what it measured on this processor); a
quantized weight's format is the one it was loaded or quantized in. Each format has a `label` (stats()'s
`dense_formats`), its bytes, and for the native C step its codes (runner/native_decode.py reads QuantizedWeight).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tieredkv.kernels.quant_cpu import CPU
from tieredkv.kernels.linear import (SWAP_MAX_OUT, SWAP_MAX_ROWS, bf16_units, dense_by_handle, graph_reads_packed,
                                     onednn_linear, onednn_linear_usable, one_row_or_onednn, pack_onednn_weight,
                                     packed_handle, swapped_linear, tiled_product, with_row_layout)


class DenseWeight(nn.Module):
    """One dense layer's weight [out_features, in_features] in one format: x [..., K] -> x @ W.T (+ bias)."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def graph_forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The product as a compiled graph takes it (ops it can trace or call as library functions)."""
        return self.forward(x, bias)

    @property
    def label(self) -> str:
        raise NotImplementedError

    @property
    def arithmetic(self) -> str:
        """What its products multiply on (stats()'s `dense_arithmetic`)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PlainWeight(DenseWeight):
    """The weight as loaded (the embedding table's own tensor for a tied LM head). `cpu`: the CPU products
    (the swapped one for a few fp32 rows, `onednn`'s or F.linear for more) in place of F.linear."""

    def __init__(self, weight: torch.Tensor, cpu: bool = False, onednn: bool = False, widen: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.cpu, self.onednn, self.widen = cpu, onednn, widen

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight
        if self.widen and x.numel() >= WIDEN_MIN_ROWS * x.shape[-1]:
            return widened_linear(x, w, bias)
        if not self.cpu:
            return F.linear(x, w, bias)
        if x.dim() == 2 and x.shape[0] <= SWAP_MAX_ROWS and w.shape[0] <= SWAP_MAX_OUT and x.dtype == torch.float32:
            return swapped_linear(x, w, bias)  # bf16 swapped: up to 1.8x slower than oneDNN (AVX512_BF16)
        return onednn_linear(x, w, bias) if self.onednn else F.linear(x, w, bias)

    def graph_forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    @property
    def label(self) -> str:
        return _dtype_name(self.weight.dtype)

    @property
    def arithmetic(self) -> str:
        if self.widen:
            return f"{self.label} to {WIDEN_MIN_ROWS - 1} rows, float32 above (widened)"
        return self.label

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def extra_repr(self) -> str:
        return f"{self.label}, {self.out_features}x{self.in_features}"


class PackedWeight(DenseWeight):
    """oneDNN's blocked copy of a weight (an opaque tensor only oneDNN and the one-row kernels read), with the
    layout those kernels read it in (None: oneDNN's product serves single rows too). For the compiled graph,
    `handle`: a plain tensor standing for the packed copy (linear.packed_handle), or `keep_plain`: the plain
    weight kept beside it (twice the memory), which the graph multiplies with F.linear."""

    def __init__(self, weight: torch.Tensor, keep_plain: bool = False, handle: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = with_row_layout(pack_onednn_weight(weight))
        self.row_layout = self.packed.row_layout
        self.plain = nn.Parameter(weight.detach(), requires_grad=False) if keep_plain else None
        self.register_buffer("handle", packed_handle(self.packed) if handle else None, persistent=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return one_row_or_onednn(x, self.packed, self.row_layout, bias)

    def graph_forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.handle is not None:
            return dense_by_handle(x, self.handle, bias)
        if self.plain is None:
            raise RuntimeError("a packed weight without a handle or a plain copy cannot serve in a graph")
        return F.linear(x, self.plain, bias)

    @property
    def label(self) -> str:
        return f"{_dtype_name(self.packed.dtype)} packed"

    @property
    def arithmetic(self) -> str:
        return _dtype_name(self.packed.dtype)

    @property
    def nbytes(self) -> int:
        copies = 1 if self.plain is None else 2  # (oneDNN's buffer may pad a few rows: not counted)
        return copies * self.out_features * self.in_features * self.packed.element_size()

    def extra_repr(self) -> str:
        # the layout's block and stored inputs, not its buffer's address: the repr is part of what makes two layers
        # alike for the compiled graph (runner/compiled_decode.layer_signature), so it names settings only
        reads = "its handle" if self.handle is not None else "a plain copy" if self.plain is not None else "-"
        layout = "oneDNN's" if self.row_layout is None else f"{self.row_layout[0]} x {self.row_layout[1]}"
        return (f"{self.label}, {self.out_features}x{self.in_features}, one-row layout {layout}, graph "
                f"reads {reads}")


WIDEN_MIN_ROWS = 4  # from this many rows a 16-bit weight without 16-bit units is widened (below: F.linear's loop)
WIDEN_TILE_BYTES = 8 << 20  # widened this many bytes of fp32 rows at a time (an LM head: 113 MB whole)


def widened_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) for a bf16/fp16 weight on a processor without 16-bit units: the weight widened to fp32 a
    tile of rows at a time and multiplied by the fp32 product, the result in x's dtype. Where torch has no fast
    16-bit product (its bf16 F.linear on an AVX2-only AMD EPYC Zen 3 took 46.6 ms for 512 rows of a 1536 x 576
    weight, a loop over rows; widened 5.5 ms, the fp32 weight's own 5.3), 4 rows and more gain."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    out = tiled_product(x2, w.shape[0], lambda n0, n1: w[n0:n1].float(), bias, WIDEN_TILE_BYTES)
    return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])


@dataclass(frozen=True)
class DenseLayout:
    """How one engine holds its full-precision weights: `cpu` products (else F.linear), `onednn` for their many-row
    case, `packed` copies (PackedWeight), for the compiled graph a plain copy beside them (`keep_plain`) or
    `handles` to them."""

    cpu: bool = False
    onednn: bool = False
    packed: bool = False
    keep_plain: bool = False
    handles: bool = False
    widen: bool = False  # 16-bit weights without 16-bit units: widened to fp32 for products of many rows

    def hold(self, weight: torch.Tensor) -> DenseWeight:
        """`weight` in this layout."""
        if self.packed:
            return PackedWeight(weight, keep_plain=self.keep_plain, handle=self.handles)
        return PlainWeight(weight, cpu=self.cpu, onednn=self.onednn, widen=self.widen)

    @property
    def label(self) -> str:
        """For the start-up line: "packed (graph: handles)", "cpu (swapped / oneDNN)", "F.linear"."""
        if self.packed:
            graph = "handles" if self.handles else "plain copies" if self.keep_plain else "-"
            return f"packed (graph: {graph})"
        if self.widen:
            return "F.linear (widened to fp32 for many rows)"
        return f"cpu (swapped / {'oneDNN' if self.onednn else 'F.linear'})" if self.cpu else "F.linear"


PLAIN = DenseLayout()


def cpu_products(device: torch.device, dtype: torch.dtype, cpu_linear: str = "auto") -> bool:
    """True when the CPU products apply (EngineConfig.cpu_linear "auto" or "packed"; "torch" turns them off): fp32
    everywhere, bf16 on processors with bf16 units (AVX512_BF16, AMX) where oneDNN's bf16 product checks out."""
    if cpu_linear not in ("auto", "packed", "torch"):
        raise ValueError(f"cpu_linear must be auto, packed or torch, got {cpu_linear!r}")
    if cpu_linear == "torch" or device.type != "cpu":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_units() and onednn_linear_usable(dtype))


def choose_layout(device: torch.device, dtype: torch.dtype, cpu_linear: str = "auto", compiled: bool = False,
                  shapes: list[tuple[int, int]] | None = None, cache_dir: Path | None = None,
                  native: bool = False) -> DenseLayout:
    """The one choice of how full-precision weights are held (docs/architecture.md: Kernels). On CPU in fp32 (bf16
    with bf16 units) packed for oneDNN and held once; with the compiled decode path, packed too where the native
    step would serve it (`native`: EngineConfig.native_decode; fp32 weights on a build that multiplies several fp32
    rows itself, AVX-512), which reads that layout; else packed (the graph reading them through handles) unless
    the graph's one-row products read the plain weights clearly faster on this processor (measured once per
    processor and shapes: linear.graph_reads_packed), else plain, for it and for the eager steps;
    cpu_linear="packed" keeps a packed copy beside plain weights the graph reads. F.linear elsewhere."""
    if not cpu_products(device, dtype, cpu_linear):
        widen = device.type == "cpu" and cpu_linear != "torch" and dtype in (torch.bfloat16, torch.float16)
        return DenseLayout(widen=True) if widen else PLAIN
    if not onednn_linear_usable():
        return DenseLayout(cpu=True)
    if not compiled:
        return DenseLayout(cpu=True, onednn=True, packed=True)
    if native and shapes and dtype == torch.float32 and CPU.f32_rows:
        # the native step's layout (handles too, for the graph should the step not take the model after all)
        return DenseLayout(cpu=True, onednn=True, packed=True, handles=True)
    graph_packed = bool(shapes) and graph_reads_packed(dtype, shapes, cache_dir)
    if not graph_packed and cpu_linear != "packed":
        return DenseLayout(cpu=True, onednn=True)
    return DenseLayout(cpu=True, onednn=True, packed=True, keep_plain=not graph_packed, handles=graph_packed)
