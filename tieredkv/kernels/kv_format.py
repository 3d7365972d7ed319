"""How the KV cache stores keys and values: one format per side (K, V), written once and read where it lies.

A format turns one token's head_dim values of one KV head (a *row*) into bytes and back:

    float32, bfloat16, float16   the values themselves at that width (16-bit storage under fp32 compute)
    int8                          head_dim int8 codes, then one fp16 scale: x ~ code * scale (q8_0's idea)
    int4                          the row turned by an orthonormal Walsh-Hadamard transform (a power-of-two
                                  head_dim), then head_dim 4-bit codes (byte j: value j low, value j +
                                  head_dim/2 high) and an fp16 scale per 32 values: x ~ IQ4_NL[code] * d,
                                  GGUF's IQ4_NL on the turned values, its scale fitted (_iq4_fit); keys
                                  are stored less the model's key mean (runner/key_shift.py)
    fp8                           head_dim e4m3 codes, then one fp16 scale (CUDA)

so the group that shares a scale is a row of head_dim values of one token and one KV head (int4: 32 of them). The
turn spreads the few channels of large magnitude that keys carry over every value of the row, which 4 bits need:
on the default model int4 rows cost +19.8% perplexity unturned in one group of 64 with an offset, +19.4% unturned
in groups of 32, and +6.5% turned in groups of 32 (benchmarks/bench_quant_quality.py --kv); IQ4_NL's levels, dense
near zero where most turned values lie, and the keys' mean taken away took it under +3% (docs/guide/kv-cache.md).
Attention reads turned rows by turning the query the same way (q . k is unchanged) and the output back. The cache
tensor keeps its layout [layers, 2, blocks, block_size, kv_heads, row]; what changes is the row's element type and
width. When both sides store floats of one width the tensor has that dtype and row = head_dim (no bytes to
reinterpret); otherwise it is uint8 and row = the wider side's bytes (a K/V pair of different widths pads the
narrower side; on CUDA rows are padded to ROW_ALIGN bytes).
Every tier moves these rows as they are: the warm slab, the cold and remote entries and snapshots hold the same
bytes as the pool.

`KVLayout.encode` is what the store kernels write; `decode` turns stored rows back into the compute dtype (the
torch references dequantize what they gathered; the CPU and Triton kernels read the codes themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tieredkv.config import KV_CACHE_DTYPES

INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_CAPABILITY = (8, 9)  # Ada: the first compute capability that converts to and from e4m3


# GGUF's IQ4_NL levels (a code's value, times its group's scale): denser near zero, where most of a turned row's
# values lie (nearly normal); the midpoints between neighbours decide a value's code
IQ4_NL = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32)
IQ4_MIDS = (IQ4_NL[1:] + IQ4_NL[:-1]) / 2
IQ4_FITS = 2  # least-squares refits of a group's scale (kv_cpu.c's tkv_kv_store and the Triton store: the same)


def _iq4_codes(groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each value's nearest level at `scale` (fp32, [..., 1]): the count of midpoints below value / scale."""
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    return ((groups * inv)[..., None] > IQ4_MIDS.to(groups.device)).sum(-1)


def _iq4_fit(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n, g] fp32 -> each group's scale (fp32 of an fp16, [..., n, 1]) and codes (int64, [..., n, g]): the
    value of most magnitude (the first, with its sign) on the level -127 first, then IQ4_FITS times the scale
    that fits the chosen levels best (sum x * level / sum level^2, summed in fp64, each time rounded to fp16), the
    codes taken again each time."""
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))
    scale = (extreme / -127.0 + 0.0).half().float()
    for _ in range(IQ4_FITS):
        levels = IQ4_NL.to(groups.device)[_iq4_codes(groups, scale)].double()
        fit = (groups.double() * levels).sum(-1, keepdim=True) / (levels * levels).sum(-1, keepdim=True)
        scale = (fit.float() + 0.0).half().float()
    return scale, _iq4_codes(groups, scale)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of two) times the orthonormal Walsh-Hadamard matrix along the last dimension, in fp32:
    log2(D) stages of butterflies (a + b, a - b over pairs h apart), then a product by 1 / sqrt(D), in the order of
    kv_cpu.c's tkv_hadamard, so that both give the same bits. Its own inverse."""
    d = x.shape[-1]
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(x.shape) * rotation_scale(d)


def rotation_scale(d: int) -> float:
    """1 / sqrt(d) as the fp32 the C kernels multiply by."""
    return float(torch.tensor(1.0 / d ** 0.5, dtype=torch.float32))


def int4_group(head_dim: int) -> int:
    """Values an int4 scale covers: 32 (as GGUF's IQ4_NL), or the whole row where 32 does not divide head_dim."""
    return 32 if head_dim % 32 == 0 else head_dim


def rotates(fmt: "KVFormat", head_dim: int) -> bool:
    """True where a format's rows are stored rotated: int4 with a power-of-two head_dim (kv_format's int4)."""
    return fmt.name == "int4" and head_dim & (head_dim - 1) == 0


@dataclass(frozen=True)
class KVFormat:
    """One side's storage: `name` (EngineConfig.kv_cache_dtype's), `code` (the C and Triton kernels' enum,
    cpu_kernels.h: TKV_KV_*), bits per value, and the bytes of the scale each row carries (int4's: int4_group)."""

    name: str
    code: int
    bits: int
    extra_bytes: int
    float_dtype: torch.dtype | None  # the torch dtype of a float format; None for codes with a scale

    def row_bytes(self, head_dim: int) -> int:
        if self.name == "int4":
            return head_dim // 2 + 2 * (head_dim // int4_group(head_dim))
        return head_dim * self.bits // 8 + self.extra_bytes

    def check(self, head_dim: int, device: torch.device) -> None:
        """A clear error where this format cannot hold rows of head_dim values on `device`."""
        if self.name == "int4" and head_dim % 4:
            raise ValueError(f"kv_cache_dtype int4 packs two values a byte and needs head_dim divisible by 4; the "
                             f"model's is {head_dim} (int8, bfloat16 and float16 take any)")
        if self.name == "fp8" and device.type != "cuda":
            raise ValueError("kv_cache_dtype fp8 runs on CUDA only; on CPU int8 stores the same bytes per value "
                             f"(supported here: {', '.join(n for n in KV_CACHE_DTYPES if n != 'fp8')})")
        if self.name == "fp8" and torch.cuda.is_available() and \
                torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
            raise ValueError("kv_cache_dtype fp8 needs a GPU that converts e4m3 (compute capability 8.9 on: L4, "
                             "L40S, H100); int8 stores the same bytes per value on this one")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] values -> [..., row_bytes(D)] uint8 (for float formats, the values' own bytes)."""
        if self.float_dtype is not None:
            return x.to(self.float_dtype).contiguous().view(torch.uint8)
        x = hadamard(x) if rotates(self, x.shape[-1]) else x.float()
        if self.name == "int4":  # groups of int4_group(D) values as GGUF's IQ4_NL: x ~ IQ4_NL[code] * d
            d_len = x.shape[-1]
            g = int4_group(d_len)
            groups = x.reshape(*x.shape[:-1], d_len // g, g)
            scale, codes = _iq4_fit(groups)
            codes = codes.to(torch.uint8).reshape(x.shape)
            half = d_len // 2
            packed = codes[..., :half] | (codes[..., half:] << 4)
            return torch.cat((packed, scale.half().reshape(*x.shape[:-1], -1).view(torch.uint8)), dim=-1)
        top = INT8_MAX if self.name == "int8" else FP8_MAX
        scale = (x.abs().amax(-1, keepdim=True) / top).half()
        inv = torch.where(scale != 0, 1.0 / scale.float(), torch.zeros_like(x[..., :1]))
        if self.name == "int8":
            codes = torch.round(x * inv).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        else:
            codes = (x * inv).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8)), dim=-1)

    def decode(self, rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """[..., >= row_bytes(D)] uint8 rows (any strides with the last one 1) -> [..., D] values in `dtype`."""
        if self.float_dtype is not None:
            return _reinterpret(rows[..., : self.row_bytes(head_dim)], self.float_dtype).to(dtype)
        if self.name == "int4":
            half, g = head_dim // 2, int4_group(head_dim)
            packed = rows[..., :half]
            codes = IQ4_NL.to(rows.device)[torch.cat((packed & 15, packed >> 4), dim=-1).long()]
            scales = _reinterpret(rows[..., half : half + 2 * head_dim // g], torch.float16).float()
            stored = (codes.reshape(*codes.shape[:-1], head_dim // g, g) * scales[..., None]).reshape(codes.shape)
            return (hadamard(stored) if rotates(self, head_dim) else stored).to(dtype)
        codes = _reinterpret(rows[..., :head_dim], torch.int8 if self.name == "int8" else torch.float8_e4m3fn)
        scale = _reinterpret(rows[..., head_dim : head_dim + 2], torch.float16).float()
        return (codes.float() * scale).to(dtype)


def _reinterpret(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of uint8 rows as `dtype` (a view where the strides allow, else of a contiguous copy)."""
    try:
        return rows.view(dtype)
    except RuntimeError:
        return rows.contiguous().view(dtype)


FORMATS = {f.name: f for f in (
    KVFormat("float32", 0, 32, 0, torch.float32),
    KVFormat("bfloat16", 1, 16, 0, torch.bfloat16),
    KVFormat("float16", 2, 16, 0, torch.float16),
    KVFormat("int8", 3, 8, 2, None),
    KVFormat("int4", 4, 4, 0, None),  # its scales: int4_group
    KVFormat("fp8", 5, 8, 2, None),
)}
# On CUDA a row of bytes starts on a 16-byte boundary: the Triton kernels' loads of codes are then vectorized.
# Unaligned (an int8 row of 128 values is 130 bytes), Llama-3-70B's decode kernels spilled 2-12 KB per thread
# (kernels/resources.py, sm_80-sm_90); aligned, they fit. The price: int8 at head_dim 128 takes 144 bytes a row
# (bf16 256), at head_dim 64 80 (bf16 128). On CPU rows are packed (the C kernels read bytes where they lie).
ROW_ALIGN = 16
CPU_FORMATS = 4  # the last format code the C kernels read (cpu_kernels.h: TKV_KV_I4): all but fp8
FLOAT_FORMATS = {f.float_dtype: f.code for f in FORMATS.values() if f.float_dtype is not None}  # a float cache's code


@dataclass(frozen=True)
class KVLayout:
    """The K and V formats of one engine's cache, for rows of head_dim values computed in `dtype`."""

    k: KVFormat
    v: KVFormat
    head_dim: int
    dtype: torch.dtype  # the compute dtype: what attention reads the rows as
    align: int = 1  # a row of bytes is padded to a multiple of this (ROW_ALIGN on CUDA)

    @classmethod
    def resolve(cls, k: str, v: str, head_dim: int, dtype: torch.dtype,
                device: torch.device | None = None) -> "KVLayout":
        """From EngineConfig's names ("auto": the compute dtype); raises ValueError naming what is supported."""
        sides = []
        for side, name in (("k", k), ("v", v)):
            if name == "auto":
                name = str(dtype).removeprefix("torch.")
            if name not in FORMATS:
                raise ValueError(f"kv_cache_dtype for {side.upper()} must be one of {', '.join(KV_CACHE_DTYPES)}; "
                                 f"got {name!r}")
            sides.append(FORMATS[name])
        device = device or torch.device("cpu")
        layout = cls(sides[0], sides[1], head_dim, dtype, ROW_ALIGN if device.type == "cuda" else 1)
        for fmt in sides:
            fmt.check(head_dim, device)
        return layout

    @property
    def plain(self) -> bool:
        """True when the cache holds values in the compute dtype itself (the formats read with no conversion)."""
        return self.k == self.v and self.k.float_dtype == self.dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's element type: the shared float dtype, else uint8."""
        if self.k == self.v and self.k.float_dtype is not None:
            return self.k.float_dtype
        return torch.uint8

    @property
    def row(self) -> int:
        """The cache tensor's last dimension, in storage elements."""
        if self.storage_dtype != torch.uint8:
            return self.head_dim
        widest = max(self.k.row_bytes(self.head_dim), self.v.row_bytes(self.head_dim))
        return -(-widest // self.align) * self.align

    @property
    def row_bytes(self) -> int:
        """Bytes one side's row takes in the tensor (padding included)."""
        return self.row * self.storage_dtype.itemsize

    def bytes_per_token(self, num_layers: int, num_kv_heads: int) -> int:
        """The pool's bytes for one token: K and V rows of every KV head of every layer."""
        return num_layers * 2 * num_kv_heads * self.row_bytes

    @property
    def shifts_keys(self) -> bool:
        """Keys are stored less the model's key mean (runner/key_shift.py): where K is stored at 4 bits."""
        return self.k.name == "int4"

    @property
    def identity(self) -> str:
        """What the model fingerprint says of the stored rows: the formats, a row's bytes, int4's levels (rows of
        Q4_0's levels, which earlier versions wrote, are never read as IQ4_NL's) and the key shift."""
        levels = "/iq4_nl" if "int4" in (self.k.name, self.v.name) else ""
        return f"{self.label}/{self.row_bytes}{levels}" + ("/k-mean" if self.shifts_keys else "")

    @property
    def label(self) -> str:
        """"int8" where both sides agree, else "k=int8,v=int4"."""
        return self.k.name if self.k == self.v else f"k={self.k.name},v={self.v.name}"

    @property
    def codes(self) -> tuple[int, int]:
        """The C kernels' codes of K and V."""
        return self.k.code, self.v.code

    @property
    def kernel_codes(self) -> tuple[int, int]:
        """What the attention kernels are told of K and V: their codes for rows of bytes, -1 where the cache holds
        floats (the kernels read them in the cache's dtype)."""
        return self.codes if self.storage_dtype == torch.uint8 else (-1, -1)

    def side(self, side: int) -> KVFormat:
        """K's format (side 0) or V's (side 1)."""
        return self.v if side else self.k

    def encode(self, side: int, x: torch.Tensor) -> torch.Tensor:
        """[..., D] values of K (side 0) or V (side 1) -> [..., row] stored rows."""
        if self.storage_dtype != torch.uint8:
            return x.to(self.storage_dtype)
        out = self.side(side).encode(x)
        pad = self.row - out.shape[-1]
        return torch.nn.functional.pad(out, (0, pad)) if pad else out

    def decode(self, side: int, rows: torch.Tensor) -> torch.Tensor:
        """[..., row] stored rows of K (side 0) or V (side 1) -> [..., D] values in the compute dtype."""
        if self.storage_dtype != torch.uint8:
            return rows.to(self.dtype)
        return self.side(side).decode(rows, self.head_dim, self.dtype)


def values(rows: torch.Tensor, kv: KVLayout | None, side: int) -> torch.Tensor:
    """What a torch reference reads: stored rows as values in the compute dtype (the rows themselves where the
    cache holds the compute dtype, kv None)."""
    return rows if kv is None else kv.decode(side, rows)


def select_blocks(cache: torch.Tensor, ids: torch.Tensor, kv: KVLayout | None, side: int) -> torch.Tensor:
    """The blocks `ids` of one side's cache [num_blocks, bs, Hkv, row] as values [len(ids), bs, Hkv, D]: one
    gather (index_select is faster than cache[ids] on CPU), dequantized after it: on CPU by the C kernel in one
    call (torch.ops.tieredkv.kv_values) where it is bound, outside a compiled graph."""
    rows = torch.index_select(cache, 0, ids)
    if kv is not None and rows.dtype == torch.uint8 and rows.device.type == "cpu" and kv.dtype == torch.float32 \
            and not torch.compiler.is_compiling() and kv.side(side).code <= CPU_FORMATS:
        from tieredkv.kernels.quant_cpu import CPU

        if CPU.operators_bound:
            return torch.ops.tieredkv.kv_values(rows, kv.side(side).code, kv.head_dim)
    return values(rows, kv, side)

