"""GGUF's quantized blocks as the engine holds them: each tensor type a GGUF file may store (llama-quantize's
standard presets) read into kernels/quant.py's formats without going through fp32, every code kept.
read_gguf_weights (models/gguf_convert.py) calls load_gguf_tensor once per tensor of a file."""

from __future__ import annotations

import numpy as np
import torch

from tieredkv.errors import CheckpointError
from tieredkv.kernels.quant import QuantizedWeight

# what load_gguf_tensor reads: every type llama-quantize's standard presets write (Q2_K ... Q8_0, IQ4_NL)
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
              "Q6_K")
# bytes per 32 weights as held: Q8_0 / Q4_1 as stored, Q4_0 with its implied offsets, Q4_K as q4 groups of 32; as
# q8 codes: Q5_0 and IQ4_NL (groups of 32), Q5_1 and Q5_K (groups of 32 with offsets), Q6_K and Q3_K (groups of
# 16), Q2_K (groups of 16 with offsets) (load_gguf_tensor)
GGUF_HELD_BYTES = {"Q8_0": 34, "Q4_0": 20, "Q4_1": 20, "Q5_0": 34, "Q5_1": 36, "IQ4_NL": 34, "Q2_K": 40, "Q3_K": 36,
                   "Q4_K": 20, "Q5_K": 36, "Q6_K": 36}
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL's 16 levels


_LAYOUTS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
            "IQ4_NL": (32, 18), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
            "Q6_K": (256, 210)}  # (inputs, bytes) per block of each quantized type


def load_gguf_tensor(raw: np.ndarray, type_name: str, shape: tuple[int, int], name: str
                     ) -> QuantizedWeight | torch.Tensor:
    """One GGUF tensor [rows, cols]: quantized blocks become a QuantizedWeight without going through fp32;
    F32 / F16 / BF16 come back as a tensor. Q8_0 / Q4_0 / Q4_1 keep the file's codes and scales as they are.
    The types the format does not hold as stored keep every code and are held in the nearest format:
    Q5_0 (5-bit codes q, w = (q - 16) d) as q8 codes q - 16 with the block's own scale, exactly the same
    weights in 34 bytes per 32 instead of 22; Q5_1 (w = q d + m) as q8 codes q with the block's scale and
    offset, exactly; IQ4_NL (w = d v[q], v a fixed table of 16 levels) as q8 codes v[q], exactly; Q6_K (16
    groups of 16 per block of 256, w = d s_j (q - 32)) and Q3_K (w = d s_j q, q in -4..3, 6-bit signed s_j)
    as q8 codes in groups of 16; Q2_K (w = d s_j q - dmin m_j, q in 0..3, groups of 16) as q8 with offsets in
    groups of 16; Q5_K (8 groups of 32, w = d s_j q - dmin m_j, q in 0..31) as q8 with offsets in groups of
    32; Q4_K (the same with 4-bit q) as q4 in groups of 32. For the K types, each group's scale d s_j (and
    offset dmin m_j) is rounded to fp16 (relative error at most 2^-11 of that group's scale). Another type is
    an error that names it and lists what is read."""
    rows, cols = shape
    if type_name in ("F32", "F16", "BF16"):
        return _float_tensor(raw, type_name, rows, cols)
    if type_name not in _LAYOUTS:
        raise CheckpointError(f"GGUF tensor {name} has type {type_name}, which is not supported; supported types: "
                              f"{', '.join(GGUF_TYPES)} (re-quantize the file to one of them with llama-quantize)")
    per_block, nbytes = _LAYOUTS[type_name]
    if cols % per_block or raw.size != rows * cols // per_block * nbytes:
        raise CheckpointError(f"GGUF tensor {name} ({type_name}, {rows}x{cols}) is not whole blocks of {per_block} "
                              f"inputs ({raw.size} bytes)")
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // per_block, nbytes)
    if type_name.endswith("_K"):
        return _k_quant(blocks, type_name, rows, cols)
    d = _f16(blocks[..., 0:2], rows)

    def q8(codes: np.ndarray, offsets: torch.Tensor | None = None) -> QuantizedWeight:
        q = torch.from_numpy(np.ascontiguousarray(codes).view(np.int8).reshape(rows, cols))
        return QuantizedWeight("q8", q, d, offsets, 32, cols, f"gguf:{type_name}")

    if type_name == "Q8_0":
        return q8(blocks[..., 2:])
    if type_name == "IQ4_NL":  # nibbles as Q4_0's, each an index into the table of levels
        return q8(np.array(IQ4_NL_VALUES, np.int8)[_nibbles(blocks[..., 2:])])
    if type_name == "Q5_0":
        return q8(_five_bits(blocks[..., 2:6], blocks[..., 6:]).astype(np.int8) - 16)
    if type_name == "Q5_1":
        return q8(_five_bits(blocks[..., 4:8], blocks[..., 8:]), _f16(blocks[..., 2:4], rows))
    if type_name == "Q4_0":  # w = (q - 8) d: an offset of -8 d, exact in fp16
        m, qs = (-8 * d.float()).half(), blocks[..., 2:]
    else:
        m, qs = _f16(blocks[..., 2:4], rows), blocks[..., 4:]
    q = torch.from_numpy(qs.copy().reshape(rows, cols // 2))
    return QuantizedWeight("q4", q, d, m, 32, cols, f"gguf:{type_name}")


def _float_tensor(raw: np.ndarray, type_name: str, rows: int, cols: int) -> torch.Tensor:
    """An F32 / F16 / BF16 tensor as stored (numpy has no bfloat16: its 16-bit words are read as int16, then
    reinterpreted)."""
    words = np.ascontiguousarray(raw).view({"F32": np.float32, "F16": np.float16, "BF16": np.int16}[type_name])
    t = torch.from_numpy(words.reshape(rows, cols).copy())
    return t.view(torch.bfloat16) if type_name == "BF16" else t


def _f16(words: np.ndarray, rows: int) -> torch.Tensor:
    """[rows, n, 2] bytes -> [rows, n] fp16."""
    return torch.from_numpy(words.copy().view(np.float16).reshape(rows, -1))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes 0..15: input j in byte j's low nibble, input j + 16 in its high one."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's codes 0..31 [..., 32]: low nibbles as Q4_0's, bit j of the 32-bit qh input j's fifth bit."""
    return _nibbles(qs) | (np.unpackbits(qh, axis=-1, bitorder="little") << 4)


def _scale_min_6bit(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> the 8 groups' 6-bit scales and mins."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 64 bytes of 2-bit codes -> 256 codes: two halves of 32 bytes, each four bit pairs in turn
    (code 32 s + j of a half is bits 2s..2s+1 of its byte j)."""
    halves = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    return ((halves >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(*qs.shape[:-1], 256)


def _k_quant(blocks: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedWeight:
    """A K type's blocks [rows, n, bytes] (256 inputs each) in the format load_gguf_tensor names for it."""
    lead = blocks.shape[:2]

    def f32(at: int) -> np.ndarray:  # the block's fp16 at byte `at`, [rows, n, 1]
        return blocks[..., at : at + 2].copy().view(np.float16).astype(np.float32)

    def weight(fmt, codes, scales, offsets, group):
        def half(a):
            return torch.from_numpy(a.astype(np.float16).reshape(rows, -1))

        return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)), half(scales),
                               None if offsets is None else half(offsets), group, cols, f"gguf:{type_name}")

    if type_name == "Q6_K":
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        sc: np.ndarray = blocks[..., 192:208].view(np.int8).astype(np.float32)  # 16 groups of 16
        q = np.empty((*lead, 256), np.int8)
        for half in range(2):  # 128 inputs each: 64 bytes of low nibbles, 32 of high bit pairs
            lo, hi = ql[..., 64 * half : 64 * half + 64], qh[..., 32 * half : 32 * half + 32]
            for k, (nib, shift) in enumerate(((lo[..., :32] & 15, 0), (lo[..., 32:] & 15, 2), (lo[..., :32] >> 4, 4),
                                             (lo[..., 32:] >> 4, 6))):
                start = 128 * half + 32 * k
                q[..., start : start + 32] = (nib | (((hi >> shift) & 3) << 4)).astype(np.int8) - 32
        return weight("q8", q, f32(208) * sc, None, 16)
    if type_name == "Q3_K":  # hmask 32, qs 64, scales 12, d
        s = blocks[..., 96:108]
        low = np.concatenate([s[..., 0:8] & 15, s[..., 0:8] >> 4], axis=-1)  # the 16 scales' low 4 bits
        high = (s[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # [.., byte, shift]: scale 4 shift + byte
        sc = (low | (high.swapaxes(-1, -2).reshape(*lead, 16) << 4)).astype(np.int8) - 32
        # code 32 b + j's high bit is bit b of hmask byte j; a clear bit subtracts 4
        hbit = ((blocks[..., :32, None] >> np.arange(8, dtype=np.uint8)) & 1).swapaxes(-1, -2).reshape(*lead, 256)
        q = _two_bit_planes(blocks[..., 32:96]).astype(np.int8) - 4 * (1 - hbit.astype(np.int8))
        return weight("q8", q, f32(108) * sc, None, 16)
    if type_name == "Q2_K":  # scales 16 (low nibble scale, high nibble min), qs 64, d, dmin
        sc = blocks[..., :16]
        q = _two_bit_planes(blocks[..., 16:80]).astype(np.int8)
        return weight("q8", q, f32(80) * (sc & 15), -f32(82) * (sc >> 4), 16)
    d, dmin = f32(0), f32(2)
    sc, mn = _scale_min_6bit(blocks[..., 4:16])
    if type_name == "Q5_K":  # d, dmin, scales 12, qh 32, qs 128
        qs = blocks[..., 48:].reshape(*lead, 4, 1, 32)
        low = ((qs >> np.array([0, 4], np.uint8)[:, None]) & 15).reshape(*lead, 8, 32)  # groups 2i, 2i + 1
        high = (blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # bit i: group i's fifth bit
        return weight("q8", (low | (high << 4)).astype(np.int8), d * sc, -dmin * mn, 32)
    qs = blocks[..., 16:].reshape(*lead, 4, 32)  # Q4_K: 4 pairs of groups, low nibbles, then high
    values = np.stack([qs & 15, qs >> 4], axis=3).reshape(*lead, 8, 32)  # the 8 groups of 32
    codes = (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)  # this format: input j with j + 16
    return weight("q4", codes, d * sc, -dmin * mn, 32)


# ---- the op -------------------------------------------------------------------------------------------------
