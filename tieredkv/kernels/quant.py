"""Weight-only quantized dense layers: the formats, the quantizers and the op (GGUF's blocks are read into these
formats by models/gguf_blocks.py).

Two storage formats serve every scheme (the codes row-major by output row, one fp16 scale per group of
`group_size` inputs):
  - "q8": int8 codes [N, K], w = q * d, or w = q * d + m with an fp16 offset per group as well.
    `quantization="int8"` quantizes each output row symmetrically (one group per row); GGUF's Q8_0 is groups
    of 32; its 5-bit, 3-bit, 2-bit and non-linear 4-bit types are held as q8 codes (models/gguf_blocks.py).
  - "q4": 4-bit codes packed two to a byte [N, K/2], and an fp16 offset per group: w = q * d + m, q in 0..15.
    Byte j of a group holds input j (low nibble) and input j + g/2 (high nibble), GGUF's order.
    `quantization="int4"` is asymmetric (m = the group's minimum) or symmetric (m = -8 d); GGUF's Q4_1 and
    Q4_0 are those two with groups of 32, read without a detour through fp32.
With EngineConfig.int8_activations, on a CPU whose kernel build has AVX-512 VNNI, q4 and q8 weights whose groups
are whole blocks of 32 are then held as "q4t" and "q8t" (`tile_quantized_weights`): the same weights, codes and
scales in tiles of 16 output rows that one vpdpbusd multiplies together, the activations in int8 blocks of 32
(quant_cpu.c: "q4 and q8 in tiles"). Each takes the bytes of its untiled layout.

`quant_linear` calls a torch library op (tieredkv::quant_linear, declared in kernels/ops.py), so the compiled
decode graph calls it like any library product. On CPU it runs quant_cpu.c's kernels for up to `kernel_rows`
rows (decode steps: int16 activation rows). Above that (prefill, where the product's arithmetic dominates) q4
and q8 weights in groups of 32 or more multiply on int8 (gemm_cpu.c: the activations as int8 blocks of 32,
vpmaddubsw across 16 output rows; AVX2) where the weight's `int8_rows` lets them (EngineConfig.int8_activations,
and by default a measurement: int8_many_rows_win), and everything else is dequantized into fp32 and run through
the fp32 product. Where a measurement finds the int8 blocks clearly faster than the int16 rows from some number of
rows on (int8_fewest_rows: batched decode steps on a processor whose int16 products are the slower), `int8_rows`
moves the int8 blocks down to that many rows. On CUDA it runs triton_ops.quant_linear (the weight dequantized
tile by tile in registers, the product on the tensor cores in the activations' dtype). Without a C compiler, or without
Triton on CUDA, it runs the reference: dequantize, then F.linear.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from tieredkv.config import INT4_GROUP_SIZES
from tieredkv.errors import CheckpointError
from tieredkv.kernels.calls import record
from tieredkv.kernels.dense import DenseWeight
from tieredkv.kernels.linear import best_ms, cached_measurement, tiled_product
from tieredkv.kernels.ops import implement
from tieredkv.kernels.quant_cpu import CPU, GEMV_MAX_ROWS


class QuantizedWeight(DenseWeight):
    """A dense layer's weight [out_features, in_features] in the "q8" or "q4" format (module docstring), or their
    tiles; its product (in and out of a graph) is quant_linear."""

    codes: torch.Tensor  # buffers (they move with the module)
    scales: torch.Tensor
    offsets: torch.Tensor | None

    def __init__(self, fmt: str, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 group_size: int, in_features: int, scheme: str):
        super().__init__()
        self.fmt, self.group_size, self.in_features, self.scheme = fmt, group_size, in_features, scheme
        # which products multiply on int8 blocks (gemm_cpu.c): -1 those of more rows than the one-row kernels take,
        # 0 none, n > 0 those of n rows or more (the tiles keep their own kernels up to kernel_rows)
        self.int8_rows = -1
        self.out_features = _out_features(codes)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets) if t is not None)

    @property
    def label(self) -> str:
        """ "q4 g32 (gguf:Q4_1)": the codes' format, the inputs a scale covers, the scheme the weights came from."""
        return f"{self.fmt} g{self.group_size} ({self.scheme})"

    @property
    def arithmetic(self) -> str:
        return arithmetic(self)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return quant_linear(x, self, bias)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or its `rows`) in fp32, by the format's definition: the reference every kernel matches."""
        return dequantize(self.codes, self.scales, self.offsets, self.group_size, rows)

    def take_rows(self, rows: torch.Tensor) -> "QuantizedWeight":
        """The same weight with its output rows in the order `rows` (rows are independent in both formats;
        tiles are made after every such step of the load)."""
        if self.fmt in ("q4t", "q8t"):
            raise ValueError(f"a weight in tiles of 16 rows ({self.fmt}) is not reordered by rows")
        offsets = None if self.offsets is None else self.offsets[rows]
        return QuantizedWeight(self.fmt, self.codes[rows], self.scales[rows], offsets, self.group_size,
                               self.in_features, self.scheme)

    def extra_repr(self) -> str:
        return f"{self.scheme} ({self.fmt}, groups of {self.group_size}), {self.out_features}x{self.in_features}"

    def tileable(self) -> bool:
        """A q4 or q8 weight on CPU whose rows make whole tiles of 16 and whose groups whole blocks of 32."""
        return self.fmt in ("q4", "q8") and self.codes.device.type == "cpu" and \
            self.out_features % TILE_ROWS == 0 and self.group_size % 32 == 0

    def tile(self) -> None:
        """In place: this weight in tiles of 16 output rows (quant_cpu.c: "q4 and q8 in tiles"), the same
        weights. q4t codes [T, K/8, 64] (uint8): in tile t and chunk c of 8 inputs, byte 4 r + j holds row r's
        input 8 c + j (low nibble) and 8 c + 4 + j (high); q8t codes [T, K/4, 64] (int8 storage): in chunk c of 4
        inputs, byte 4 r + j holds row r's code of input 4 c + j plus 128 (as an unsigned byte); scales and
        offsets [T, K/g, 16]."""
        assert self.tileable(), self
        k, t = self.in_features, self.out_features // TILE_ROWS
        if self.fmt == "q8":
            unsigned = (self.codes.to(torch.int16) + 128).to(torch.uint8).view(t, TILE_ROWS, k // 4, 4)
            self.codes = unsigned.transpose(1, 2).reshape(t, k // 4, 64).contiguous().view(torch.int8)
        else:
            q = _codes(self.codes, self.group_size).view(t, TILE_ROWS, k // 8, 2, 4)
            low, high = q[:, :, :, 0], q[:, :, :, 1]  # [T, 16, K/8, 4]
            self.codes = (low | (high << 4)).transpose(1, 2).reshape(t, k // 8, 64).contiguous()
        self.scales = _tile_groups(self.scales)
        self.offsets = None if self.offsets is None else _tile_groups(self.offsets)
        self.fmt += "t"


TILE_ROWS = 16  # output rows of a tile (q4t, q8t)


def _tile_groups(t: torch.Tensor) -> torch.Tensor:
    """[N, G] per-row group values -> [N/16, G, 16]"""
    return t.view(-1, TILE_ROWS, t.shape[1]).transpose(1, 2).contiguous()


def _untile_groups(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def _codes(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """A q4 or q4t weight's codes 0..15 as uint8 [N, K]; a q8t weight's as int8 [N, K]."""
    if codes.dim() == 3 and _is_q8(codes):
        q = (codes.view(torch.uint8).to(torch.int16) - 128).to(torch.int8).view(codes.shape[0], -1, TILE_ROWS, 4)
        return q.transpose(1, 2).reshape(codes.shape[0] * TILE_ROWS, -1)
    if codes.dim() == 3:
        b = codes.view(codes.shape[0], -1, TILE_ROWS, 4)  # [T, K/8, 16, 4]
        q = torch.stack([b & 15, b >> 4], dim=3)  # [T, K/8, 16, 2, 4]: inputs 8c + j, then 8c + 4 + j
        return q.permute(0, 2, 1, 3, 4).reshape(codes.shape[0] * TILE_ROWS, -1)
    n = codes.shape[0]
    c = codes.view(n, -1, group_size // 2)
    return torch.cat([c & 15, c >> 4], dim=-1).view(n, -1)


def tile_quantized_weights(model: nn.Module) -> int:
    """Every quantized weight of `model` that can be (QuantizedWeight.tileable) held in tiles, where the loaded
    CPU kernels multiply tiles with AVX-512 VNNI (else nothing changes); returns how many. Before
    gather_quantized_weights and the compiled decode path's trace, which take the tensors as they are then."""
    if CPU.lib is None or not CPU.lib.tkv_tiles_native():
        return 0
    weights = [w for w in model.modules() if isinstance(w, QuantizedWeight) and w.tileable()]
    for w in weights:
        w.tile()
    return len(weights)


def cat_rows(parts: list, what: str) -> "QuantizedWeight | torch.Tensor":
    """Weights stacked along their output rows (q, k and v into one projection): all quantized in one format
    (their schemes may differ: a GGUF file's Q5_0 and Q8_0 are both held as q8 in groups of 32; the fused
    weight's scheme names each, "gguf:Q5_0+Q8_0"), or all plain tensors."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0)
    first = parts[0]
    same = all(isinstance(p, QuantizedWeight) and (p.fmt, p.group_size, p.in_features) ==
               (first.fmt, first.group_size, first.in_features) for p in parts)
    if not same:
        if all(isinstance(p, QuantizedWeight) for p in parts):
            return QuantizedParts(parts)
        kinds = ", ".join(p.scheme if isinstance(p, QuantizedWeight) else str(p.dtype) for p in parts)
        raise CheckpointError(f"{what}: its pieces are stored some quantized, some not ({kinds}); they are "
                              "served fused, so they must all be quantized or all be plain")
    # a q8 piece without offsets beside one with them (Q8_0 beside Q5_1) gets zero offsets: the same weights
    offsets = None if all(p.offsets is None for p in parts) else torch.cat(
        [torch.zeros_like(p.scales) if p.offsets is None else p.offsets for p in parts])
    schemes = list(dict.fromkeys(p.scheme for p in parts))  # in order, each once
    scheme = schemes[0] if len(schemes) == 1 else "gguf:" + "+".join(s.removeprefix("gguf:") for s in schemes)
    return QuantizedWeight(first.fmt, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           offsets, first.group_size, first.in_features, scheme)


class QuantizedParts(DenseWeight):
    """A fused weight (q/k/v, gate/up) whose pieces a GGUF file stores in formats that do not share a layout
    (Q4_K beside Q6_K, as Q4_K_M files have): each piece kept in its own format, their products side by side
    (quant_linear runs one per piece and concatenates the outputs)."""

    def __init__(self, parts: list[QuantizedWeight]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.fmt, self.in_features = "parts", parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.scheme = "gguf:" + "+".join(dict.fromkeys(p.scheme.removeprefix("gguf:") for p in parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def label(self) -> str:
        """The pieces' formats, each once: "q4 g32 (gguf:Q4_K) + q8 g16 (gguf:Q6_K)"."""
        return " + ".join(dict.fromkeys(p.label for p in self.parts))

    @property
    def arithmetic(self) -> str:
        return " + ".join(dict.fromkeys(p.arithmetic for p in self.parts))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return quant_linear(x, self, bias)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def extra_repr(self) -> str:
        return f"{self.scheme}, {self.out_features}x{self.in_features} in {len(self.parts)} parts"


def dequantize(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group_size: int,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    if codes.dim() == 3:  # tiled: as q4 / q8 codes [N, K] and per-row scales
        codes, scales = _codes(codes, group_size), _untile_groups(scales)
        offsets = None if offsets is None else _untile_groups(offsets)
        if rows is not None:
            codes, scales = codes[rows], scales[rows]
            offsets = None if offsets is None else offsets[rows]
        w = codes.float().view(codes.shape[0], -1, group_size) * scales.float()[..., None]
        return (w if offsets is None else w + offsets.float()[..., None]).view(codes.shape[0], -1)
    if rows is not None:
        codes, scales = codes[rows], scales[rows]
        offsets = None if offsets is None else offsets[rows]
    n, g = codes.shape[0], group_size
    d = scales.float()[..., None]
    if codes.dtype == torch.int8:  # q8
        w = codes.float().view(n, -1, g) * d
        return (w if offsets is None else w + offsets.float()[..., None]).view(n, -1)
    q = _codes(codes, g).float().view(n, -1, g)
    return (q * d + offsets.float()[..., None]).view(n, -1)


# ---- quantizing a full-precision weight at load time ------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Per output row, symmetric: d = max|w| / 127 (in fp16), q = round(w / d)."""
    w = w.detach().float()
    d = (w.abs().amax(dim=1, keepdim=True) / 127).half()
    q = torch.round(w / _nonzero(d.float())).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("q8", q, d, None, w.shape[1], w.shape[1], "int8")


def quantize_int4(w: torch.Tensor, group_size: int = 32, symmetric: bool = False) -> QuantizedWeight:
    """Per group of `group_size` inputs: asymmetric (w = q d + m, q in 0..15, the group's range exactly) or
    symmetric (w = (q - 8) d, the group's value of largest magnitude at code 0, as in GGUF's Q4_0). d and m
    are rounded to fp16 before the codes are chosen, so the codes fit the stored scales. (A search over
    clipped ranges for the least squared error was measured on the default model: 2.6% lower perplexity in
    groups of 64, 2.4% higher symmetric, and 8x the load time; not kept.)"""
    n, k = w.shape
    check_group_size(group_size, k)
    wg = w.detach().float().view(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    if symmetric:
        d = (torch.where(hi.abs() > lo.abs(), hi, lo) / -8).half()
        m = (-8 * d.float()).half()
    else:
        d, m = ((hi - lo) / 15).half(), lo.half()
    q = torch.round((wg - m.float()[..., None]) / _nonzero(d.float())[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight("q4", pack_nibbles(q.view(n, k), group_size), d, m, group_size, k,
                           "int4-sym" if symmetric else "int4")


def quantized_bytes(scheme: str, out_features: int, in_features: int, group_size: int = 32) -> int:
    """What quantize_int8 / quantize_int4 make of an [out_features, in_features] weight takes."""
    n, k = out_features, in_features
    if scheme == "int8":
        return n * k + 2 * n
    return n * k // 2 + 4 * n * (k // group_size)


def check_group_size(group_size: int, in_features: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise CheckpointError(f"int4 group size {group_size} does not divide the input dimension {in_features} of "
                              f"a dense layer; choose one of {[g for g in INT4_GROUP_SIZES if in_features % g == 0]}")


def pack_nibbles(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes 0..15 [N, K] -> bytes [N, K/2]: in each group, input j low, input j + g/2 high."""
    n, k = q.shape
    halves = q.view(n, k // group_size, 2, group_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.ones_like(d), d)


def _is_q8(codes: torch.Tensor) -> bool:
    """q8's codes are int8, q4's packed pairs uint8 (both may have offsets)."""
    return codes.dtype == torch.int8


def _in_features(codes: torch.Tensor) -> int:
    if codes.dim() == 3:  # tiles: q8t's chunks of 4 inputs, q4t's of 8
        return codes.shape[1] * (4 if _is_q8(codes) else 8)
    return codes.shape[1] * (1 if _is_q8(codes) else 2)


def _out_features(codes: torch.Tensor) -> int:
    return codes.shape[0] * (TILE_ROWS if codes.dim() == 3 else 1)


def _kernel_fits(codes: torch.Tensor, group_size: int) -> bool:
    return CPU.lib is not None and not codes.is_cuda and \
        group_size % (16 if _is_q8(codes) and codes.dim() == 2 else 32) == 0


@functools.cache
def _triton_quant_linear():
    """triton_ops.quant_linear, or None where Triton cannot be imported."""
    try:
        from tieredkv.kernels.triton_ops import quant_linear
    except ImportError:
        return None
    return quant_linear


def _quant_linear(x, codes, scales, offsets, group_size, bias, int8_rows=-1):
    if codes.is_cuda and _triton_quant_linear() is not None:
        record("quantized product", "Triton")
        return _triton_quant_linear()(x, codes, scales, offsets, group_size, bias)
    k, n = x.shape[-1], _out_features(codes)
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # a decode step's [1, K] as it is (a reshape costs ~2.5 us)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    m = x2.shape[0]
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()  # (the C kernels read it as fp32 [N])
    fewer = 0 < int8_rows <= m and codes.dim() == 2  # int8 blocks asked for within the one-row kernels' rows
    if m <= kernel_rows(codes) and _kernel_fits(codes, group_size) and \
            not (fewer and many_rows_int8(codes, group_size)):
        record("quantized product", "int16 rows")
        out = torch.empty(m, n)
        b = None if bias is None else bias.data_ptr()
        xp, qp, sp, op = x2.data_ptr(), codes.data_ptr(), scales.data_ptr(), out.data_ptr()
        zp = None if offsets is None else offsets.data_ptr()
        if codes.dim() == 3:
            q8 = _is_q8(codes)
            lib = CPU.lib
            gemv, linear = (lib.tkv_q8t_gemv, lib.tkv_q8t_linear) if q8 else (lib.tkv_q4t_gemv, lib.tkv_q4t_linear)
            status = gemv(xp, k, qp, sp, zp, group_size, n, b, op) if m == 1 else \
                linear(xp, m, k, qp, sp, zp, group_size, n, b, op)
        elif _is_q8(codes):
            status = (CPU.lib.tkv_q8_gemv(xp, k, qp, sp, zp, group_size, n, b, op) if m == 1 else
                      CPU.lib.tkv_q8_linear(xp, m, k, qp, sp, zp, group_size, n, b, op))
        else:
            status = (CPU.lib.tkv_q4_gemv(xp, k, qp, sp, zp, group_size, n, b, op) if m == 1 else
                      CPU.lib.tkv_q4_linear(xp, m, k, qp, sp, zp, group_size, n, b, op))
        if status != 0:
            raise MemoryError("quantized linear: no memory for the activations' integer copy")
    elif int8_rows != 0 and many_rows_int8(codes, group_size):
        record("quantized product", "int8 blocks")
        out = torch.empty(m, n)
        if CPU.lib.tkv_quant_gemm(x2.data_ptr(), m, k, codes.data_ptr(), 8 if _is_q8(codes) else 4,
                                  int(codes.dim() == 3), scales.data_ptr(),
                                  None if offsets is None else offsets.data_ptr(), group_size, n,
                                  None if bias is None else bias.data_ptr(), out.data_ptr()) != 0:
            raise MemoryError("quantized linear: no memory for the activations' int8 blocks")
    else:
        record("quantized product", "dequantized float32")
        out = _dequantized_linear(x2, codes, scales, offsets, group_size, bias)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def kernel_rows(codes: torch.Tensor) -> int:
    """The most activation rows the int kernels take for weights in `codes`' format (more are dequantized into
    the fp32 product): GEMV_MAX_ROWS, or for q4 what the loaded build says (quant_cpu.c: tkv_q4_max_rows)."""
    return GEMV_MAX_ROWS if CPU.lib is None or _is_q8(codes) else CPU.q4_rows


def int16_rows_most(model: torch.nn.Module) -> int:
    """The most rows a step multiplies on the one-row kernels' int16 rows (kernel_rows), on CPU: one less than
    where int8 blocks start (engine/rank_build.py: many_rows_arithmetic), or the kernels' most. The native step
    takes at most so many rows of several sequences, and Scheduler.max_draft_rows keeps a step with drafts within
    them (each of its rows then the bits a one-row decode gives it; quant_cpu.c: q4_row)."""
    weights = [w for w in model.modules() if isinstance(w, QuantizedWeight)]
    most = min((kernel_rows(w.codes) for w in weights), default=GEMV_MAX_ROWS)
    starts = [w.int8_rows for w in weights if w.int8_rows > 0]
    return min(most, min(starts) - 1) if starts else most


def many_rows_int8(codes: torch.Tensor, group_size: int) -> bool:
    """True where more than kernel_rows rows on weights in `codes`' format can run on int8 arithmetic (gemm_cpu.c:
    q4, q8 and their tiles, groups whole blocks of 32, a build with AVX2), rather than dequantized into fp32."""
    return bool(CPU.int8_gemm) and not codes.is_cuda and group_size % 32 == 0 and _in_features(codes) % 32 == 0


MEASURE_ROWS = 256  # the many-row products' measurement: a prefill chunk's rows
INT8_MARGIN = 1.1  # int8 blocks serve only where the fp32 product takes 1.1x their time (they cost accuracy)


def int8_many_rows_win(weights: list["QuantizedWeight"], cache_dir: Path | None = None) -> bool:
    """Whether products of many rows on these weights (one layer's quantized ones) are clearly faster on int8 blocks
    than dequantized into the fp32 product, on this processor. The int8 kernel is 256-bit AVX2 code, where fp32 products
    use every width the processor has (AVX-512 doubles their rate), so which wins is measured: once per processor, torch
    build, thread count, kernels' build and layer shapes, MEASURE_ROWS rows through each layer's weight both ways, best
    of three; kept in `cache_dir`'s kernels/many-rows.json. The int8 blocks must win by INT8_MARGIN."""
    shapes = sorted({(w.out_features, w.in_features, w.group_size, w.fmt) for w in weights})
    known = cached_measurement("many-rows", (shapes, torch.get_num_threads(), _kernels_build()),
                               lambda: _measure_many_rows(weights), cache_dir)
    return known["fp32_ms"] > INT8_MARGIN * known["int8_ms"]


def _kernels_build() -> str:
    """The CPU kernels' build (its file's name holds a digest of their sources, flags and compiler): a measurement
    of them is taken again once they change."""
    return "" if CPU.lib is None else Path(CPU.lib._name).name


def _measure_many_rows(weights: list["QuantizedWeight"]) -> dict:
    one = list({(w.out_features, w.in_features, w.group_size, w.fmt): w for w in weights}.values())
    return {"int8_ms": _products_ms(one, MEASURE_ROWS, -1, 3), "fp32_ms": _products_ms(one, MEASURE_ROWS, 0, 3)}


def _products_ms(weights: list["QuantizedWeight"], rows: int, int8_rows: int, repeats: int) -> float:
    """Best time (ms) of `rows` activation rows through each weight in turn, with the weights' int8_rows set so."""
    xs = {w.in_features: torch.full((rows, w.in_features), 0.5) for w in weights}
    with torch.inference_mode():
        return best_ms(lambda: [_LINEAR_OP(xs[w.in_features], w.codes, w.scales, w.offsets, w.group_size, None,
                                           int8_rows) for w in weights], repeats)


FEW_ROWS = (4, 8, 12, 16, 24, 32)  # the row counts where int8_fewest_rows compares the two kernels
# the products' gain the int8 blocks must show there: a step's other work dilutes it (the Q4_1 file on an AMD EPYC
# Zen 3: 1.11x the products at 4 rows was 0.96-0.98x a 4-stream decode's output rate; 1.37x at 8 rows 1.06x)
FEW_ROWS_MARGIN = 1.25


def int8_fewest_rows(weights: list["QuantizedWeight"], cache_dir: Path | None = None) -> int:
    """The fewest rows from which products on these weights (a model's quantized ones, untiled) are clearly faster
    on int8 blocks than on the one-row kernels' int16 rows, at every count of FEW_ROWS from there up to kernel_rows;
    0 where none (then int8 blocks start above kernel_rows, as for every weight by default). The int16 rows take 16
    multiply-adds an instruction and the int8 blocks 32, so where the products are bound by arithmetic (AVX2, a few
    rows) the blocks win; on AVX-512 the int16 rows run twice as wide. Measured through every weight given in turn,
    as a batched decode step reads them (from memory: one layer's weights alone stay in cache, where the blocks
    look faster than a step finds them), once per processor, thread count, kernels' build and weight shapes, kept
    in the cache directory's kernels/few-rows.json. The blocks must win by FEW_ROWS_MARGIN."""
    untiled = [w for w in weights if w.codes.dim() == 2]
    if not untiled or CPU.lib is None:
        return 0
    shapes = sorted({(w.out_features, w.in_features, w.group_size, w.fmt) for w in untiled})
    counts = [m for m in FEW_ROWS if m <= min(kernel_rows(w.codes) for w in untiled)]
    known = cached_measurement("few-rows", (shapes, counts, torch.get_num_threads(), _kernels_build()),
                               lambda: _measure_few_rows(untiled, counts), cache_dir)
    fewest = 0
    for m in reversed(counts):
        if known[str(m)]["int16_ms"] <= FEW_ROWS_MARGIN * known[str(m)]["int8_ms"]:
            break
        fewest = m
    return fewest


def _measure_few_rows(weights: list["QuantizedWeight"], counts: list[int]) -> dict:
    return {str(m): {"int8_ms": _products_ms(weights, m, 1, 5), "int16_ms": _products_ms(weights, m, -1, 5)}
            for m in counts}


def as_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) as the int8 products see it: each block of 32 inputs rounded to codes of
    max|x| / 127 of the block (to nearest even, as the kernels' conversion), times that scale. The reference the
    many-row and tiled kernels are held to: their outputs are this times the dequantized weight."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(blocks * (1 / scale)) * scale).view(x.shape)


def arithmetic(qw: "QuantizedWeight") -> str:
    """What a quantized weight's products multiply on this process's kernels, for stats() and the start-up line:
    "int16 rows x q4 to 16 rows, int8 blocks x q4 (AVX2) above"."""
    if qw.codes.is_cuda:
        return "activations' dtype x dequantized tiles (Triton)" if _triton_quant_linear() else "dequantized, F.linear"
    if CPU.lib is None or not _kernel_fits(qw.codes, qw.group_size):
        return "dequantized float32"
    bits = "q8" if _is_q8(qw.codes) else "q4"
    rows = "int8 blocks (VNNI tiles)" if qw.codes.dim() == 3 else "int16 rows"
    many = qw.int8_rows != 0 and many_rows_int8(qw.codes, qw.group_size)
    above = f"int8 blocks x {bits} ({CPU.int8_gemm})" if many else "dequantized float32"
    last = kernel_rows(qw.codes)
    if many and qw.codes.dim() == 2 and 0 < qw.int8_rows <= last:
        last = qw.int8_rows - 1
    return f"{rows} x {bits} to {last} rows, {above} above"


DEQUANT_TILE_BYTES = 8 << 20  # a larger weight is dequantized and multiplied this many bytes of fp32 rows at a time


def _dequantized_linear(x2, codes, scales, offsets, group_size, bias):
    """x2 @ dequantize(W).T (+ bias) for many rows: the weight dequantized into fp32 and multiplied by the fp32
    product, at most DEQUANT_TILE_BYTES of it at a time. A weight larger than that (an LM head: 113 MB of fp32
    for the default model's) would otherwise be a fresh allocation above malloc's mmap threshold on every
    call, page-faulted in as it is written: 30 ms of the 36 a 32-row step's head took (AMD EPYC, Zen 5), where
    the tiles come from the heap, already mapped."""
    return tiled_product(x2, _out_features(codes), lambda n0, n1: _dequantize_fast(
        codes, scales, offsets, group_size, None if n0 == 0 and n1 == _out_features(codes) else torch.arange(n0, n1)),
        bias, DEQUANT_TILE_BYTES)


def _quant_rows(codes, scales, offsets, group_size, ids):
    return _dequantize_fast(codes, scales, offsets, group_size, ids)


def _quant_linear_shape(x, codes, scales, offsets, group_size, bias, int8_rows=-1):
    return x.new_empty((*x.shape[:-1], _out_features(codes)))


def _quant_rows_shape(codes, scales, offsets, group_size, ids):
    return codes.new_empty((ids.shape[0], _in_features(codes)), dtype=torch.float32)


implement("quant_linear", _quant_linear, ("CPU", "CUDA"), _quant_linear_shape)
implement("quant_rows", _quant_rows, ("CPU", "CUDA"), _quant_rows_shape)
_LINEAR_OP, _ROWS_OP = torch.ops.tieredkv.quant_linear.default, torch.ops.tieredkv.quant_rows.default


def _dequantize_fast(codes, scales, offsets, group_size, ids) -> torch.Tensor:
    """dequantize(), through the C kernel where it fits."""
    if not _kernel_fits(codes, group_size):
        return dequantize(codes, scales, offsets, group_size, ids)
    k = _in_features(codes)
    count = _out_features(codes) if ids is None else ids.shape[0]
    out = torch.empty(count, k, dtype=torch.float32)
    idx = None if ids is None else ids.to(torch.int64).contiguous()
    ptr = None if idx is None else idx.data_ptr()
    if codes.dim() == 3 and _is_q8(codes):
        CPU.lib.tkv_q8t_rows(codes.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                             group_size, k, ptr, count, out.data_ptr())
    elif _is_q8(codes):
        CPU.lib.tkv_q8_rows(codes.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                            group_size, k, ptr, count, out.data_ptr())
    else:
        rows = CPU.lib.tkv_q4t_rows if codes.dim() == 3 else CPU.lib.tkv_q4_rows
        rows(codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(), group_size, k, ptr, count, out.data_ptr())
    return out


def quant_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) for a quantized W, in x's dtype. One row on CPU (a batch-1 decode step)
    goes through the C++ operator tieredkv::quant_gemv where it was built (quant_ops.cpp: the same kernels,
    without Python in the call), anything else through tieredkv::quant_linear."""
    if isinstance(qw, QuantizedParts):
        out = torch.cat([_product(x, p, None) for p in qw.parts], -1)
        return out if bias is None else out + bias
    return _product(x, qw, bias)


def _product(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    op = _linear_op(x, qw)
    if op is _LINEAR_OP:
        return op(x, qw.codes, qw.scales, qw.offsets, qw.group_size, bias, qw.int8_rows)
    record("quantized product", "int16 rows")  # (the one-row kernels, through the C++ operator)
    return op(x, qw.codes, qw.scales, qw.offsets, qw.group_size, bias)


def _linear_op(x: torch.Tensor, qw: QuantizedWeight):
    if CPU.operators_bound and x.numel() == x.shape[-1] and _kernel_fits(qw.codes, qw.group_size):
        return torch.ops.tieredkv.quant_gemv.default
    return _LINEAR_OP


def gather_quantized_weights(model: nn.Module) -> int:
    """Moves the codes, scales and offsets of every quantized weight on CPU into one huge-page arena, in the
    order the forward reads them (the modules' order: layer by layer, the LM head last); returns the bytes
    moved. The compiled decode path must be made after this (its graphs hold the tensors they were given)."""
    from tieredkv.platform.malloc_tuning import huge_page_arena

    held = [(w, name) for w in model.modules() if isinstance(w, QuantizedWeight) and w.codes.device.type == "cpu"
            for name in ("codes", "scales", "offsets") if getattr(w, name) is not None]
    if not held:
        return 0
    for (w, name), copy in zip(held, huge_page_arena([getattr(w, name) for w, name in held])):
        setattr(w, name, copy)
    return sum(getattr(w, name).nbytes for w, name in held)


def quant_embedding(qw: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows `ids` of a quantized embedding table, in `dtype`."""
    return _ROWS_OP(qw.codes, qw.scales, qw.offsets, qw.group_size, ids).to(dtype)
