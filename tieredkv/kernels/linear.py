"""Dense layers (x @ W.T + b). On CPU in fp32 they avoid the default BLAS call, which is slow for our shapes.

Why: a decode step multiplies a few dozen rows by each weight matrix. On the x86 machines this
project is measured on, `F.linear` (MKL sgemm with the weight as the transposed right operand) is
up to twice as slow on such shapes as the alternatives:
  - oneDNN's matmul with the weight reordered once, at load time, into oneDNN's blocked layout
    (`pack_onednn_weight`): no per-call packing of the weight, which for a few rows is most of the
    work. The engine packs every projection and the LM head this way (kernels/dense.py: PackedWeight);
  - for a plain weight: with few rows and a layer-sized output, the same MKL product with the operands
    swapped, (W @ x.T).T, which MKL splits across threads along the weight rather than along the few
    rows; otherwise (many rows, or the vocabulary-wide LM head) oneDNN's matmul.
oneDNN ships inside every x86 and aarch64 build of torch, but its linear entry points
(`torch.ops.mkldnn._linear_pointwise`, `_reorder_linear_weight`) are internal, so they are used only
after a self-check on this very torch build. Measured on the engine benchmark's workload: plain
oneDNN/swapped products take about 15% off the engine's time against `F.linear`, and packed weights
another 11% (the numbers are in docs/architecture.md). `F.linear` serves everywhere else: CUDA, other dtypes,
or `EngineConfig(cpu_linear="torch")`. Which of these a weight is held for is chosen once, at load
(kernels/dense.py: choose_layout); this module holds the products and the measurement behind that choice.

One row on a packed weight (a batch-1 decode step in the compiled graph, through its handle) is not
oneDNN's: its one-row product reads the weight well below the memory's speed, so quant_cpu.c's one-row
kernels read the packed buffer as it lies where its layout is one they know (packed_row_layout checks it
weight by weight).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from tieredkv.cache_dir import write_json
from tieredkv.kernels.ops import implement
from tieredkv.kernels.quant_cpu import CPU, handle_outputs
from tieredkv.platform.cpu_features import cpu_info

SWAP_MAX_ROWS = 256  # up to this many rows the swapped product wins (decode steps, small prefill chunks)
SWAP_MAX_OUT = 8192  # wider outputs (the LM head) go to oneDNN at any row count


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's matmul; `weight` is a plain tensor or one from pack_onednn_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of `weight` in oneDNN's blocked layout (an opaque mkldnn tensor that only onednn_linear reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def swapped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(weight @ x.T).T: MKL splits the product across threads along the weight rather than along the few rows."""
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


@functools.cache
def onednn_linear_usable(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has the oneDNN linear op and it agrees with F.linear in `dtype`."""
    if not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 48, generator=gen).to(dtype)
    w = torch.randn(40, 48, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    try:
        with torch.inference_mode():
            packed = pack_onednn_weight(w)
            checks = [(onednn_linear(x, w, b), F.linear(x, w, b)),
                      (onednn_linear(x[0, :1], w), F.linear(x[0, :1], w)),
                      (onednn_linear(x, packed, b), F.linear(x, w, b)),
                      (onednn_linear(x[1], packed), F.linear(x[1], w))]
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return all(got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
               for got, want in checks)


def fp32_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) in fp32: oneDNN's product on CPU where it checks out, else F.linear."""
    b = None if bias is None else bias.float()
    if x.device.type == "cpu" and onednn_linear_usable():
        return onednn_linear(x, w, b)
    return F.linear(x, w.to(x.device), b)


def tiled_product(x2: torch.Tensor, n: int, rows, bias: torch.Tensor | None, tile_bytes: int) -> torch.Tensor:
    """x2 [M, K] (fp32) times a weight of n output rows given as fp32 by rows(n0, n1), at most tile_bytes of it
    at a time, through the fp32 product (+ bias)."""
    tile = max(1, tile_bytes // (4 * x2.shape[1]))
    if tile >= n:
        return fp32_linear(x2, rows(0, n), bias)
    out = torch.empty(x2.shape[0], n)
    for n0 in range(0, n, tile):
        n1 = min(n, n0 + tile)
        out[:, n0:n1] = fp32_linear(x2, rows(n0, n1), None if bias is None else bias[n0:n1])
    return out


def bf16_units() -> bool:
    """True where the processor multiplies bf16 natively (AVX512_BF16 or AMX): there oneDNN's bf16 products
    read half the bytes of fp32 at fp32's arithmetic rate; elsewhere each one converts to fp32 first."""
    info = cpu_info()
    return info.has("avx512_bf16") or info.has("amx_bf16")


# The compiled decode graph cannot take oneDNN's packed tensors (opaque, without storage) as inputs, so it
# reads each packed weight through a handle, a plain tensor whose storage address names the packed weight,
# passed to the ops below, which inductor calls as opaque library functions: where the one-row kernels read the
# packed layout, the packed buffer itself viewed as a plain tensor (a batch-1 step's products then go through
# the C++ operator tieredkv::packed_gemv, no Python in the call); elsewhere a small tensor [out_features, 1].
_HANDLES: dict[int, tuple[torch.Tensor, tuple[int, int, int] | None]] = {}  # packed weight, its one-row layout


ROW_BLOCKS = (64, 48, 32, 24, 16, 8)  # the output block widths the one-row kernels take (quant_cpu.c)


def packed_row_layout(packed: torch.Tensor) -> tuple[int, int, int] | None:
    """(B, Kp, address) where quant_cpu.c's one-row kernels read `packed` (pack_onednn_weight's result) as it lies:
    its buffer, read as fp32 [ceil(N/B)][Kp][B] or bf16 [ceil(N/B)][Kp/2][B][2] (blocks of B outputs, Kp >= K
    inputs stored, the padding zeros), is exactly the weight. oneDNN chooses its layout per processor, dtype
    and shape, so each weight is checked against its unpacked self; None where no such layout fits (another
    processor's choice: oneDNN's product serves), or without the kernels."""
    if CPU.lib is None or not packed.is_mkldnn or packed.dim() != 2 or \
            packed.dtype not in (torch.float32, torch.bfloat16):
        return None
    n, k = packed.shape
    (address, nbytes), item = packed_range(packed), packed.element_size()
    raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8).view(packed.dtype)
    dense = packed.to_dense()
    for b in ROW_BLOCKS:
        nb = -(-n // b)
        kp, rest = divmod(nbytes // item, nb * b)
        if rest or kp < k or (packed.dtype == torch.bfloat16 and kp % 2):
            continue
        if packed.dtype == torch.float32:
            got = raw.view(nb, kp, b).transpose(1, 2).reshape(nb * b, kp)
        else:
            got = raw.view(nb, kp // 2, b, 2).permute(0, 2, 1, 3).reshape(nb * b, kp)
        if torch.equal(got[:n, :k], dense) and not got[:n, k:].any():
            return b, kp, address  # the buffer stays where it is while `packed` lives
    return None


def packed_range(packed: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the buffer that holds a packed weight (pack_onednn_weight's result)."""
    return torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)


def with_row_layout(packed: torch.Tensor) -> torch.Tensor:
    """`packed`, carrying the layout the one-row kernels read it in (packed_row_layout; None: oneDNN's product
    serves its single rows), found once where the weights are packed."""
    packed.row_layout = packed_row_layout(packed)
    return packed


def packed_handle(packed: torch.Tensor) -> torch.Tensor:
    """A plain tensor that stands for `packed` in a compiled graph (dense_by_handle reads it); the packed
    weight is held while the handle lives, with the layout the one-row kernels read it in (if any). Where there
    is such a layout and its blocks cover the outputs exactly, the handle is the packed buffer itself, in the
    weight's dtype: fp32 [blocks, Kp, B], bf16 [blocks, Kp / 2, 2 B] (packed_gemv's argument); else zeros
    [out_features, 1]."""
    layout = packed.row_layout if hasattr(packed, "row_layout") else packed_row_layout(packed)
    if layout is not None and packed.size(0) % layout[0] == 0:
        block, stored, address = layout
        shape = (packed.size(0) // block, stored, block) if packed.dtype == torch.float32 else \
            (packed.size(0) // block, stored // 2, 2 * block)
        nbytes = math.prod(shape) * packed.element_size()
        handle = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=packed.dtype).view(shape)
    else:
        handle = torch.zeros(packed.size(0), 1, dtype=torch.uint8)
    key = handle.data_ptr()
    _HANDLES[key] = (packed, layout)
    weakref.finalize(handle, _HANDLES.pop, key, None)
    return handle


def _dense_packed(x, handle, bias):
    entry = _HANDLES.get(handle.data_ptr())
    if entry is None:  # a copy of a handle (module.to(), a state dict) names no packed weight
        raise RuntimeError("dense_packed: this tensor is not a packed weight's handle (packed_handle made none at "
                           "its address; a copy of a handle does not carry its weight)")
    return one_row_or_onednn(x, *entry, bias)


# up to this many fp32 rows quant_cpu.c's kernel multiplies a packed weight (tkv_f32_packed_rows, AVX-512 builds),
# oneDNN above: on an AMD EPYC (Zen 4, 2 threads) over the default model's products it took 0.48-0.69x oneDNN's time
# for 2-6 rows, 0.74x for 9 (a verification of 8 drafts), 0.85x for 16, 0.90x for 32 (a batched decode step of 32
# streams; past that oneDNN's blocking of many rows is not measured against)
FEW_PACKED_ROWS = 32


def one_row_or_onednn(x, packed, layout, bias):
    """One row (a batch-1 decode step) through the one-row kernel where `layout` (packed_row_layout) is one it
    reads, a few fp32 rows (a batched step, a speculative step's verification) through the kernel of several rows
    on AVX-512 builds, each row the same bits as alone (packed_product); else oneDNN's product. For one row oneDNN
    read the default model's layers at 30-39 GB/s on an AMD EPYC Zen 5, the kernel at 39-59 (fp32), 25-32 against
    36-45 (bf16)."""
    if layout is not None and x.shape[-1] == packed.shape[1] and x.dtype == packed.dtype:
        out = packed_product(x, packed, layout, bias)
        if out is not None:
            return out
    return onednn_linear(x, packed, bias)


def packed_product(x: torch.Tensor, packed: torch.Tensor, layout: tuple[int, int, int], bias: torch.Tensor | None
                   ) -> torch.Tensor | None:
    """x [..., K] times `packed` through quant_cpu.c's kernels for its layout (packed_row_layout): one row (fp32 or
    bf16), or 2 to FEW_PACKED_ROWS fp32 rows on a build with AVX-512; None where they do not serve (then oneDNN's
    product does): more rows, several bf16 rows or without AVX-512, no kernels loaded."""
    rows = x.numel() // x.shape[-1]
    lib = CPU.lib
    several = 1 < rows <= FEW_PACKED_ROWS and x.dtype == torch.float32
    if lib is None or not (rows == 1 or several and CPU.f32_rows):
        return None
    n, k = packed.shape
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    b = None if bias is None else bias.float().contiguous()  # (held while the kernel reads it)
    bp = None if b is None else b.data_ptr()
    block, stored, address = layout
    if rows > 1:
        status = lib.tkv_f32_packed_rows(x.data_ptr(), rows, k, address, n, block, stored, bp, out.data_ptr())
    else:
        fn = lib.tkv_f32_packed_row if x.dtype == torch.float32 else lib.tkv_bf16_packed_row
        status = fn(x.data_ptr(), k, address, n, block, stored, bp, out.data_ptr())
    if status != 0:
        raise RuntimeError(f"packed product of {rows} row(s): blocks of {block} x {stored} not taken by the kernel")
    return out


def _dense_packed_shape(x, handle, bias):
    return x.new_empty((*x.shape[:-1], handle_outputs(handle)))


implement("dense_packed", _dense_packed, ("CPU",), _dense_packed_shape)


def dense_by_handle(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """onednn_linear(x, the packed weight `handle` stands for, bias): one op call, in or out of a graph. One row
    on a handle that is the packed buffer goes through the C++ operator where it is built (kernels/quant_ops.cpp:
    the one-row kernels, without Python in the call; 121 calls a token for the default model: its compiled
    decode 0.92x the time in fp32, 0.89x in bf16, against the Python operator on the same kernels, two engines
    alternating in one process, AMD EPYC Zen 5), anything else through tieredkv::dense_packed."""
    if handle.dim() == 3 and x.dtype == handle.dtype and x.numel() == x.shape[-1] and CPU.operators_bound:
        return torch.ops.tieredkv.packed_gemv.default(x, handle, bias)
    return torch.ops.tieredkv.dense_packed.default(x, handle, bias)


STREAM_BYTES = 96 << 20  # the measurement's weights: more than a processor's last-level cache, as a decode reads
MAX_COPIES = 32  # of a layer's projections (a small model's layers fit in cache anyway: its calls' cost decides)
# The plain weights are held only where their one-row products take at most this share of the packed ones' time:
# the packed weights also serve every batched step, which plain weights make slower (0.91x output tok/s on 32
# mixed requests, AMD EPYC AVX2; 0.79x on an Intel Xeon guest, compiled engines side by side: 56.1/58.8 against
# 70.3/73.7 tok/s, where the graph's batch-1 decode was the same either way, 25.69 against 25.84 ms/token, and the
# measurement had said plain 0.90x)
PLAIN_MARGIN = 0.85


def graph_reads_packed(dtype: torch.dtype, shapes: list[tuple[int, int]], cache_dir: Path | None = None) -> bool:
    """Whether the compiled decode graph's one-row products should read oneDNN's packed weights (through
    handles) rather than the plain ones (a library call on the plain weight, MKL's sgemv in fp32). Which is
    faster depends on the processor: on the AVX2 machines this was first measured on, MKL's single row read
    the plain weights fastest; on an AMD EPYC with AVX-512 (Zen 5), oneDNN's packed product was twice as fast.
    So it is measured, once per processor, torch build, dtype and layer shapes: one row through copies of
    the layer's projections that do not fit in cache, best of five passes each way (the packed weights read
    as the graph reads them: by the one-row kernels where their layout is one those read). The timings are kept
    in `cache_dir`'s kernels/linear-layout.json; plain wins only by a clear margin (PLAIN_MARGIN), as the packed
    weights also make every batched step faster."""
    known = cached_measurement("linear-layout", (str(dtype), sorted(shapes), torch.get_num_threads(),
                                                 "row kernels" if CPU.lib is not None else "oneDNN"),
                               lambda: _measure_layouts(dtype, shapes), cache_dir)
    return known["plain_ms"] > PLAIN_MARGIN * known["packed_ms"]


def best_ms(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of fn(), in milliseconds (the measurements behind a choice of kernels)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def cached_measurement(name: str, what: tuple, measure, cache_dir: Path | None) -> dict:
    """measure() once per processor (model and flags), torch build and `what`, kept in `cache_dir`'s
    kernels/<name>.json (measured again where it cannot be written)."""
    info = cpu_info()
    key = hashlib.sha256(repr((info.model_name, sorted(info.flags), torch.__version__, what)).encode()).hexdigest()
    key = key[:16]
    path = None if cache_dir is None else Path(cache_dir) / "kernels" / f"{name}.json"
    known = _read_json(path)
    if key not in known:
        known[key] = measure()
        if path is not None:
            _write_json(path, {**_read_json(path), key: known[key]})
    return known[key]


def _measure_layouts(dtype: torch.dtype, shapes: list[tuple[int, int]]) -> dict:
    layer_bytes = sum(n * k for n, k in shapes) * torch.tensor([], dtype=dtype).element_size()
    copies = min(MAX_COPIES, max(1, -(-STREAM_BYTES // max(layer_bytes, 1))))
    plain = [torch.full((n, k), 0.01, dtype=dtype) for _ in range(copies) for n, k in shapes]
    packed = [pack_onednn_weight(w) for w in plain]
    layouts = {id(p): packed_row_layout(p) for p in packed}  # the product the graph's handles run
    xs = {k: torch.full((1, k), 0.5, dtype=dtype) for _, k in shapes}

    def passes(run, weights) -> float:
        return best_ms(lambda: [run(xs[w.size(1)], w) for w in weights], 5)

    with torch.inference_mode():
        return {"plain_ms": passes(F.linear, plain),
                "packed_ms": passes(lambda x, p: one_row_or_onednn(x, p, layouts[id(p)], None), packed)}


def _read_json(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict) -> None:
    try:
        write_json(path, data)
    except OSError:
        pass  # measured again next time
