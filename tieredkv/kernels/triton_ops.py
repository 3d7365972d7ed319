"""Triton kernels for the paged KV cache. Each wrapper checks shapes, dtypes and strides, and has the
signature of its torch reference (see the sibling modules), which the tests compare it against.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tieredkv.kernels.calls import record
from tieredkv.kernels.kernel_ops import KernelOps
from tieredkv.kernels.kv_format import hadamard, rotates

if TYPE_CHECKING:
    from tieredkv.kernels.kv_format import KVLayout

DECODE_BLOCK_N = 64  # keys per inner iteration of the decode kernel (from Ampere on: see Tiles)
DECODE_TOKENS_PER_SPLIT = 512  # split-K: one program per (sequence, kv head, 512 keys)
MERGE_SLOT_TILE = 16  # partial results the merge reads at a time


class Tiles(NamedTuple):
    """Tile sizes of the decode and cascade kernels on one GPU generation, chosen so that every variant
    fits its registers (no spills) and shared memory, as kernels/resources.py measures offline: on
    Turing (sm_75), 64-key tiles spill 700-800 bytes per thread in the decode kernel and 32-row cascade
    tiles ~1.7 KB at head_dim 128; from Ampere on, 64-key tiles and 32-row cascade tiles fit."""

    decode_block_n: int  # keys per inner iteration (decode, cascade prefix)
    prefix_rows: int  # queries (member x query head) per cascade prefix program


def tiles_for(cc: int) -> Tiles:
    """The tiles for compute capability `cc` (75 for sm_75, ...)."""
    return Tiles(DECODE_BLOCK_N, 32) if cc >= 80 else Tiles(32, 16)


_target_cc: list[int] = []  # set by for_target: the offline checks lay kernels out for another device


@contextlib.contextmanager
def for_target(cc: int):
    """Within the block, kernels are laid out for compute capability `cc` whatever the tensors' device."""
    _target_cc.append(cc)
    try:
        yield
    finally:
        _target_cc.pop()


@functools.lru_cache(maxsize=None)
def _device_cc(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def device_tiles(device: torch.device) -> Tiles:
    """The tiles for `device` (on CPU, where the interpreter runs them, Ampere's)."""
    if _target_cc:
        return tiles_for(_target_cc[-1])
    return tiles_for(_device_cc(device) if device.type == "cuda" else 80)
PREFILL_BLOCK_M = 16
PREFILL_BLOCK_N = 32
COPY_BLOCK = 1024


# -- launches, and the variants they compile ------------------------------------------------------------

_hooks: list[Callable] = []  # each sees every launch as (kernel, grid, args, constexprs); False: skip it


def launch(kernel, grid, *args, **constexprs) -> None:
    """Every kernel launch goes through here: the hooks see it first (variant_key, the tests), then it
    runs unless a hook said not to (a dry run that records which variants a workload asks for)."""
    run = True
    for hook in _hooks:
        run = hook(kernel, grid, args, constexprs) is not False and run
    if run:
        kernel[grid](*args, **constexprs)


@contextlib.contextmanager
def recording(dry_run: bool = False):
    """Collects the variant (variant_key) of every launch inside the block into the set it yields; with
    `dry_run`, no kernel runs (outputs are left as allocated)."""
    seen: set = set()

    def hook(kernel, grid, args, constexprs):
        seen.add(variant_key(kernel, args, constexprs))
        return not dry_run

    _hooks.append(hook)
    try:
        yield seen
    finally:
        _hooks.remove(hook)


def jit_function(kernel) -> JITFunction:
    """The kernel as a JITFunction, also when TRITON_INTERPRET made it an InterpretedFunction."""
    if isinstance(kernel, JITFunction):
        return kernel
    options = {k: v for k, v in kernel.kwargs.items() if k.startswith("do_not_specialize") and v}
    return JITFunction(kernel.fn, **options)


@functools.lru_cache(maxsize=None)
def _binder(kernel):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = jit_function(kernel)
    return fn, create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 80, 32)))


def variant_key(kernel, args: tuple, constexprs: dict) -> tuple:
    """What Triton compiles one binary per: the kernel, each argument's type and specialisation (pointer
    alignment, integer "== 1" and "divisible by 16" classes, except the arguments a kernel does not
    specialise on) and the constexpr values; computed by Triton's own binder, so it is the key its cache
    uses (without a device: the classes do not depend on the target)."""
    fn, binder = _binder(kernel)
    _, specialization, _ = binder(*args, **constexprs)
    return (fn.fn.__name__, tuple(specialization))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape, (key_cache.shape, value_cache.shape)
    assert key_cache.dtype == value_cache.dtype
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "head_dim must be contiguous"


def _formats(kv: "KVLayout | None") -> dict:
    """The kernels' K_FMT / V_FMT (KVLayout.kernel_codes; -1 where the cache's elements are values, read in their
    dtype)."""
    k, v = (-1, -1) if kv is None else kv.kernel_codes
    return dict(K_FMT=k, V_FMT=v)


def _turned(x: torch.Tensor, fmt, head_dim: int) -> torch.Tensor:
    """x turned (kv_format.hadamard, in x's dtype, contiguous) where rows in `fmt` are stored turned, else x: what
    the store quantizes, the query that meets turned keys, and the output of turned values turned back."""
    return hadamard(x).to(x.dtype) if rotates(fmt, head_dim) else x


def _values_dtype(query: torch.Tensor, key_cache: torch.Tensor, kv: "KVLayout | None") -> None:
    """The cache's rows hold the query's values: its own dtype, or rows in kv's formats for that dtype."""
    if kv is None:
        assert query.dtype == key_cache.dtype and key_cache.shape[3] == query.shape[-1]
    else:
        assert kv.dtype == query.dtype and kv.head_dim == query.shape[-1] and key_cache.shape[3] == kv.row


@triton.jit
def _iq4_level(code):
    """IQ4_NL's level of each int32 code 0..15 (kv_format.IQ4_NL) as fp32, from four words of four signed bytes:
    integer arithmetic in registers, no table in memory."""
    word = tl.where(code < 4, -1079142271, tl.where(code < 8, -152379953, tl.where(code < 12, 639175937, 1901675829)))
    byte = (word >> ((code & 3) * 8)) & 255
    return ((byte ^ 128) - 128).to(tl.float32)


@triton.jit
def _row_values(rows, d, valid, d_ok, FMT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[len(rows), D_PAD] values of the cache rows that `rows` point at, in fp32 unless FMT is -1 (the cache's
    elements are values: read as they are). FMT names a row's format (kv_format.py): 0-2 fp32/bf16/fp16 values,
    3 int8 codes and an fp16 scale, 4 4-bit codes of IQ4_NL's levels (byte j: value j low, value j + D/2 high)
    with an fp16 scale per group, 5 e4m3 codes and an fp16 scale. The codes are dequantized in registers as they
    are read."""
    mask = valid[:, None] & d_ok[None, :]
    if FMT == -1:
        out = tl.load(rows[:, None] + d[None, :], mask=mask, other=0.0)
    elif FMT == 0:
        out = tl.load(rows.to(tl.pointer_type(tl.float32))[:, None] + d[None, :], mask=mask, other=0.0)
    elif FMT == 1:
        out = tl.load(rows.to(tl.pointer_type(tl.bfloat16))[:, None] + d[None, :], mask=mask, other=0.0)
        out = out.to(tl.float32)
    elif FMT == 2:
        out = tl.load(rows.to(tl.pointer_type(tl.float16))[:, None] + d[None, :], mask=mask, other=0.0)
        out = out.to(tl.float32)
    elif FMT == 4:  # turned values (the wrappers turn the query and the output): IQ4_NL's level * group scale
        half: tl.constexpr = HEAD_DIM // 2
        group: tl.constexpr = 32 if HEAD_DIM % 32 == 0 else HEAD_DIM
        byte = tl.load(rows[:, None] + (d % half)[None, :], mask=mask, other=0)
        code = _iq4_level(tl.where(d[None, :] < half, byte & 15, byte >> 4).to(tl.int32))
        scale = tl.load((rows[:, None] + half + 2 * (d // group)[None, :]).to(tl.pointer_type(tl.float16)),
                        mask=mask, other=0.0).to(tl.float32)
        out = code * scale
    else:
        raw = tl.load(rows[:, None] + d[None, :], mask=mask, other=0)
        if FMT == 3:
            code = raw.to(tl.int8, bitcast=True).to(tl.float32)
        else:
            code = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load((rows + HEAD_DIM).to(tl.pointer_type(tl.float16)), mask=valid, other=0.0).to(tl.float32)
        out = code * scale[:, None]
    return out


# -- 1. store K/V through the slot mapping ----------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HD_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = (slot // BLOCK_SIZE).to(tl.int64)  # block * stride passes 2**31 in a large pool
        off = slot % BLOCK_SIZE
        i = tl.arange(0, HD_PAD)
        h = i // HEAD_DIM
        d = i % HEAD_DIM
        mask = i < NUM_HEADS * HEAD_DIM
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(key_cache_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d, k, mask=mask)
        tl.store(value_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, v, mask=mask)


@triton.jit
def _rne(x):
    """x rounded to the nearest integer, ties to even (as torch.round), for |x| < 2**22: the fp32 addition rounds."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _store_row_q4(src, dst, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr):
    """A turned row (store_kv turns it) stored as GGUF's IQ4_NL in groups of 32 (or the whole row), each group's
    scale fitted as kv_format._iq4_fit fits it: the codes of the row's halves side by side in each byte, then a
    scale per group. A value's code is the count of midpoints between neighbouring levels below it, and its level
    the lowest plus the steps to each of them, both from one comparison with all 15; the halves are the two rows
    of one [2, HALF_PAD] tensor. So each step is one operation over the row (under Triton's interpreter, where the
    tests run it, every operation costs about the same)."""
    half: tl.constexpr = HEAD_DIM // 2
    group: tl.constexpr = 32 if HEAD_DIM % 32 == 0 else HEAD_DIM
    k = tl.arange(0, 16)
    level, above = _iq4_level(k), _iq4_level(k + 1)
    mids = tl.where(k < 15, (level + above) * 0.5, float("inf"))[None, None, :]
    steps = tl.where(k < 15, above - level, 0.0)[None, None, :]
    side = tl.arange(0, 2)[:, None]
    j = tl.arange(0, HALF_PAD)
    ok = (j < half)[None, :]
    at = side * half + j[None, :]  # each value's place in the row
    x = tl.load(src + at, mask=ok, other=0.0).to(tl.float32)
    mag = tl.where(ok, tl.abs(x), -1.0)
    scale = tl.zeros([2, HALF_PAD], tl.float32)
    for gi in tl.static_range(HEAD_DIM // group):
        in_g = ok & (at // group == gi)
        top = tl.max(tl.where(in_g, mag, -1.0))
        # the first value of most magnitude, with its sign (torch's argmax takes the first)
        first = tl.min(tl.where(in_g & (mag == top), at, 2 * HEAD_DIM))
        scale16 = (tl.sum(tl.where(at == first, x, 0.0)) / -127.0 + 0.0).to(tl.float16)
        for _ in tl.static_range(2):  # kv_format.IQ4_FITS least-squares refits, summed in fp64
            s32 = scale16.to(tl.float32)
            v = x * tl.where(s32 != 0.0, 1.0 / s32, 0.0)
            levels = (tl.sum(tl.where(v[:, :, None] > mids, steps, 0.0), axis=2) - 127.0).to(tl.float64)
            num = tl.sum(tl.where(in_g, x.to(tl.float64) * levels, 0.0))
            den = tl.sum(tl.where(in_g, levels * levels, 0.0))
            scale16 = ((num / den).to(tl.float32) + 0.0).to(tl.float16)
        tl.store((dst + half + 2 * gi).to(tl.pointer_type(tl.float16)), scale16)
        scale = tl.where(in_g, scale16.to(tl.float32), scale)
    v = x * tl.where(scale != 0.0, 1.0 / scale, 0.0)
    codes = tl.sum((v[:, :, None] > mids).to(tl.int32), axis=2)
    tl.store(dst + j, tl.sum(codes << (side * 4), axis=0).to(tl.uint8), mask=j < half)


@triton.jit
def _store_row(src, dst, FMT: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
               HD_PAD: tl.constexpr):
    """One row of HEAD_DIM values at `src` stored at byte pointer `dst` in format FMT, as kv_format.py's encode
    writes it (the scale rounded to fp16 first, the codes from the rounded scale)."""
    if FMT == 4:
        _store_row_q4(src, dst, HEAD_DIM, HALF_PAD)
    else:
        d = tl.arange(0, HD_PAD)
        ok = d < HEAD_DIM
        x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        if FMT == 0:
            tl.store(dst.to(tl.pointer_type(tl.float32)) + d, x, mask=ok)
        elif FMT == 1:
            tl.store(dst.to(tl.pointer_type(tl.bfloat16)) + d, x.to(tl.bfloat16), mask=ok)
        elif FMT == 2:
            tl.store(dst.to(tl.pointer_type(tl.float16)) + d, x.to(tl.float16), mask=ok)
        else:
            top: tl.constexpr = 127.0 if FMT == 3 else 448.0
            scale16 = (tl.max(tl.abs(x), 0) / top).to(tl.float16)
            scale = scale16.to(tl.float32)
            inv = tl.where(scale != 0.0, 1.0 / scale, 0.0)
            if FMT == 3:
                code = tl.minimum(tl.maximum(_rne(x * inv), -127.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
            else:
                code = tl.minimum(tl.maximum(x * inv, -448.0), 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
                code = code.to(tl.uint8, bitcast=True)
            tl.store(dst + d, code, mask=ok)
            tl.store((dst + HEAD_DIM).to(tl.pointer_type(tl.float16)), scale16)


@triton.jit
def _store_kv_rows_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, HD_PAD: tl.constexpr,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,
):
    """Program (t, h) stores token t's K and V rows of KV head h as rows of bytes in K_FMT / V_FMT."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = (slot // BLOCK_SIZE).to(tl.int64)
        off = slot % BLOCK_SIZE
        _store_row(key_ptr + t * stride_kt + h * stride_kh,
                   key_cache_ptr + blk * stride_cb + off * stride_cs + h * stride_ch, K_FMT, HEAD_DIM, HALF_PAD, HD_PAD)
        _store_row(value_ptr + t * stride_vt + h * stride_vh,
                   value_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch, V_FMT, HEAD_DIM, HALF_PAD,
                   HD_PAD)


def store_kv(key, value, kv_cache, slot_mapping, kv: "KVLayout | None" = None) -> None:
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _check_cache(key_cache, value_cache)
    num_tokens, num_heads, head_dim = key.shape
    assert value.shape == key.shape and key.stride(-1) == 1 and value.stride(-1) == 1
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.is_floating_point()
    formats = _formats(kv)
    if formats["K_FMT"] >= 0:
        assert key_cache.shape[2:] == (num_heads, kv.row) and kv.head_dim == head_dim, (key_cache.shape, key.shape)
        key, value = _turned(key, kv.k, head_dim), _turned(value, kv.v, head_dim)
        if num_tokens:
            launch(_store_kv_rows_kernel, (num_tokens, num_heads),
                   key, value, key_cache, value_cache, slot_mapping,
                   key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                   key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                   value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                   BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=head_dim, HALF_PAD=triton.next_power_of_2(head_dim // 2),
                   HD_PAD=triton.next_power_of_2(head_dim), **formats)
        return
    if kv is not None:  # floats of another width than the values': converted, then stored as they are
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    assert key_cache.shape[2:] == (num_heads, head_dim), (key_cache.shape, key.shape)
    if num_tokens == 0:
        return
    launch(_store_kv_kernel, (num_tokens,),
           key, value, key_cache, value_cache, slot_mapping,
           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
           key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
           value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
           BLOCK_SIZE=key_cache.shape[1], NUM_HEADS=num_heads, HEAD_DIM=head_dim,
           HD_PAD=triton.next_power_of_2(num_heads * head_dim))


# -- shared by both attention kernels ----------------------------------------------------------------


@triton.jit
def _scores(q, k, allowed, m_i, l_i, scale, PRECISION: tl.constexpr):
    """The online softmax's scores of q [M, D] against k [N, D] where `allowed`: (new max, new sum, the
    weights p [M, N], the old accumulator's factor)."""
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _attend_tile(q, key_cache_ptr, value_cache_ptr, table_ptr, offs, valid, allowed, kv_head, d, d_ok, m_i, l_i, acc,
                 scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE: tl.constexpr,
                 PRECISION: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One online-softmax step: q [M, D] against the keys and values of one KV head at token positions offs
    (read through a block table; columns past the head dim, d_ok false, read as zeros) where `allowed` [M, N].
    Block offsets in int64: a large pool's `block id * stride` passes 2**31. Rows stored in a format of their own
    (K_FMT, V_FMT >= 0) are dequantized as they are read, into q's dtype (_row_values), V only once the scores
    are done, so that the two dequantized tiles are never held at once (values in q's dtype are both loaded
    first: the loads overlap the product, and the variants fit as they are)."""
    blk = tl.load(table_ptr + offs // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = offs % BLOCK_SIZE
    k_rows = key_cache_ptr + blk * stride_kb + slot * stride_ks + kv_head * stride_kh
    v_rows = value_cache_ptr + blk * stride_vb + slot * stride_vs + kv_head * stride_vh
    if V_FMT == -1:
        k = _row_values(k_rows, d, valid, d_ok, K_FMT, HEAD_DIM).to(q.dtype)
        v = _row_values(v_rows, d, valid, d_ok, V_FMT, HEAD_DIM).to(q.dtype)
        m_new, l_i, p, alpha = _scores(q, k, allowed, m_i, l_i, scale, PRECISION)
    else:
        k = _row_values(k_rows, d, valid, d_ok, K_FMT, HEAD_DIM).to(q.dtype)
        m_new, l_i, p, alpha = _scores(q, k, allowed, m_i, l_i, scale, PRECISION)
        v = _row_values(v_rows, d, valid, d_ok, V_FMT, HEAD_DIM).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _attend_range(q, key_cache_ptr, value_cache_ptr, table_ptr, start, end, kv_head, d, d_ok, scale,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  ROWS: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  PRECISION: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Online softmax of q [ROWS, HD_PAD] over key positions [start, end) read through a block table:
    (running max, running sum, unnormalised output)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HD_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        m_i, l_i, acc = _attend_tile(q, key_cache_ptr, value_cache_ptr, table_ptr, offs, valid, valid[None, :],
                                     kv_head, d, d_ok, m_i, l_i, acc, scale, stride_kb, stride_ks, stride_kh,
                                     stride_vb, stride_vs, stride_vh, BLOCK_SIZE, PRECISION, K_FMT, V_FMT, HEAD_DIM)
    return m_i, l_i, acc


# -- 2. decode attention, split-K with a log-sum-exp merge ------------------------------------------


# Arguments whose values change with the batch, the context lengths or the cascades: passed at run time
# and never specialised on (Triton would otherwise compile a variant per "== 1" / "divisible by 16"
# class of each), so that a kernel's variants are fixed per model and device (see warm_up).
_SPLIT_RUNTIME = ["stride_bt", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh", "tokens_per_split"]


@triton.jit(do_not_specialize=_SPLIT_RUNTIME)
def _decode_split_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, first_key_ptr, part_out_ptr,
    part_lse_ptr, out_ptr, scale,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, tokens_per_split,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HD_PAD: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,
):
    """Program (b, kv head, split) attends its split of the context; with DIRECT (one split) it writes
    the output itself and no merge runs."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    start = tl.load(first_key_ptr + b) + split * tokens_per_split  # cascade members start after the prefix
    if start < ctx:
        end = tl.minimum(start + tokens_per_split, ctx)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HD_PAD)
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUP + g
        g_mask = g < GROUP
        qmask = g_mask[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
        m_i, l_i, acc = _attend_range(q, key_cache_ptr, value_cache_ptr, block_tables_ptr + b * stride_bt, start, end,
                                      kv_head, d, d_ok, scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                      stride_vh, GROUP_PAD, HD_PAD, BLOCK_N, BLOCK_SIZE, PRECISION, K_FMT, V_FMT,
                                      HEAD_DIM)
        out = acc / l_i[:, None]
        if DIRECT:
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=qmask)
        else:
            tl.store(part_out_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :],
                     out, mask=qmask)
            tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, m_i + tl.log(l_i), mask=g_mask)


@triton.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh", "slots"])
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, slots,
    HEAD_DIM: tl.constexpr, HD_PAD: tl.constexpr, SLOT_TILE: tl.constexpr,
):
    """Merges the `slots` partial results of (b, h) by log-sum-exp, SLOT_TILE at a time: the largest
    log-sum-exp first, then the weighted sum. A slot no program wrote holds lse -inf and weighs nothing."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HD_PAD)
    d_ok = d < HEAD_DIM
    lse_row = part_lse_ptr + b * stride_lb + h * stride_lh
    top = tl.full([SLOT_TILE], float("-inf"), tl.float32)
    for s0 in range(0, slots, SLOT_TILE):
        s = s0 + tl.arange(0, SLOT_TILE)
        top = tl.maximum(top, tl.load(lse_row + s, mask=s < slots, other=float("-inf")))
    top_lse = tl.max(top, 0)
    acc = tl.zeros([HD_PAD], tl.float32)
    total = tl.zeros([SLOT_TILE], tl.float32)
    for s0 in range(0, slots, SLOT_TILE):
        s = s0 + tl.arange(0, SLOT_TILE)
        lse = tl.load(lse_row + s, mask=s < slots, other=float("-inf"))
        live = lse > float("-inf")
        weight = tl.where(live, tl.exp(lse - top_lse), 0.0)
        parts = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                        mask=live[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(parts * weight[:, None], 0)
        total += weight
    out = acc / tl.sum(total, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=["stride_pt", "stride_mg", "stride_pb", "stride_ph", "stride_ps", "stride_lb",
                                "stride_lh", "first_slot", "width", "row_tiles", "tokens_per_split"])
def _prefix_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, prefix_tables_ptr, prefix_lens_ptr, members_ptr, part_out_ptr,
    part_lse_ptr, scale,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_pt, stride_mg,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, first_slot, width, row_tiles, tokens_per_split,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HD_PAD: tl.constexpr, GROUP: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
):
    """Program (cascade group x row tile, kv head, split) attends ROWS of the group's queries (rows = member
    x query head of this KV head, `width` members at most) to its split of the shared prefix, whose K/V it
    reads once for all of them. However many members, the tile is ROWS: one variant, bounded resources."""
    grp = tl.program_id(0) // row_tiles
    tile = tl.program_id(0) % row_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    plen = tl.load(prefix_lens_ptr + grp)
    start = split * tokens_per_split
    if start < plen:
        end = tl.minimum(start + tokens_per_split, plen)
        r = tile * ROWS + tl.arange(0, ROWS)
        inside = r < width * GROUP
        member = tl.load(members_ptr + grp * stride_mg + r // GROUP, mask=inside, other=-1)
        ok = (member >= 0) & inside
        head = kv_head * GROUP + r % GROUP
        d = tl.arange(0, HD_PAD)
        d_ok = d < HEAD_DIM
        row = tl.where(ok, member, 0)
        qmask = ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + row[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
        m_i, l_i, acc = _attend_range(q, key_cache_ptr, value_cache_ptr, prefix_tables_ptr + grp * stride_pt, start,
                                      end, kv_head, d, d_ok, scale, stride_kb, stride_ks, stride_kh, stride_vb,
                                      stride_vs, stride_vh, ROWS, HD_PAD, BLOCK_N, BLOCK_SIZE, PRECISION, K_FMT,
                                      V_FMT, HEAD_DIM)
        out = acc / l_i[:, None]
        slot = first_slot + split
        tl.store(part_out_ptr + row[:, None] * stride_pb + head[:, None] * stride_ph + slot * stride_ps + d[None, :],
                 out, mask=qmask)
        tl.store(part_lse_ptr + row * stride_lb + head * stride_lh + slot, m_i + tl.log(l_i), mask=ok)


class DecodePlan:
    """One step's split-K layout and scratch, made by plan_decode and reused by every layer: the split
    size is chosen once (from the batch and the device), the partial-result buffers allocated once.
    `cascade` holds the shared-prefix groups (their prefix is attended once per group by _prefix_kernel,
    into extra partial-result slots that the merge folds in)."""

    def __init__(self, max_context_len: int, cascade: "TritonCascade | None" = None):
        self.max_context_len = max_context_len
        self.cascade = cascade
        self.tokens_per_split: int | None = None
        self.scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.no_offsets: torch.Tensor | None = None


class TritonCascade(NamedTuple):
    members: torch.Tensor  # [groups, max members] int32 batch rows, -1 padding
    prefix_tables: torch.Tensor  # [groups, max prefix blocks] int32
    prefix_lens: torch.Tensor  # [groups] int32 tokens
    first_key: torch.Tensor  # [B] int32: where each row's own keys start (its prefix's length, or 0)
    max_prefix_len: int


def plan_decode(block_tables, context_lens, block_size, dtype, prefixes=None, host_lens=None,
                host_tables=None) -> DecodePlan:
    """The step's split layout and cascades. `host_lens` / `host_tables` are the same lengths and block ids as
    host lists (the runner has them): given, nothing is read back from the device (no sync per step)."""
    max_len = max(context_lens.tolist() if host_lens is None else host_lens, default=0)
    if not prefixes:
        return DecodePlan(max_len)
    width = max(len(rows) for rows, _ in prefixes)
    blocks = max(n for _, n in prefixes)
    members = torch.full((len(prefixes), width), -1, dtype=torch.int32)
    tables = torch.zeros(len(prefixes), blocks, dtype=torch.int32)
    first = torch.zeros(block_tables.shape[0], dtype=torch.int32)
    ids = block_tables.tolist() if host_tables is None else host_tables
    for g, (rows, n) in enumerate(prefixes):
        members[g, : len(rows)] = torch.tensor(rows, dtype=torch.int32)
        tables[g, :n] = torch.tensor(ids[rows[0]][:n], dtype=torch.int32)
        first[rows] = n * block_size
    dev = block_tables.device
    lens = torch.tensor([n * block_size for _, n in prefixes], dtype=torch.int32)
    return DecodePlan(max_len, TritonCascade(members.to(dev), tables.to(dev), lens.to(dev), first.to(dev),
                                             blocks * block_size))


def choose_split(programs: int, max_context_len: int, device: torch.device) -> int:
    """Tokens per split so that the grid has about two programs per multiprocessor (one split when the
    batch alone fills the device), a multiple of the kernel's tile."""
    cores = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    tile = device_tiles(device).decode_block_n
    splits = max(1, min(triton.cdiv(2 * cores, max(programs, 1)), triton.cdiv(max_context_len, tile)))
    return triton.cdiv(triton.cdiv(max(max_context_len, 1), splits), tile) * tile


def decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len=None,
                     plan: DecodePlan | None = None, tokens_per_split: int | None = None,
                     kv: "KVLayout | None" = None):
    _check_decode_args(query, key_cache, value_cache, block_tables, context_lens, kv)
    record("decode attention", "Triton")
    if kv is not None:  # int4 keys and values are stored turned: the query turned alike, the output turned back
        query = _turned(query, kv.k, kv.head_dim)
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    plan = plan or DecodePlan(max_context_len if max_context_len is not None else int(context_lens.max()))
    if tokens_per_split is None:
        tokens_per_split = _split_size(plan, batch * num_kv_heads, query.device)
    tiles = device_tiles(query.device)
    tile = tiles.decode_block_n
    assert tokens_per_split > 0 and (tokens_per_split % tile == 0 or tokens_per_split < tile), \
        f"tokens_per_split must be a multiple of {tile} (or below it), got {tokens_per_split}"
    group, cascade = num_heads // num_kv_heads, plan.cascade
    num_splits = max(triton.cdiv(plan.max_context_len, tokens_per_split), 1)
    prefix_splits = triton.cdiv(cascade.max_prefix_len, tokens_per_split) if cascade is not None else 0
    slots = num_splits + prefix_splits
    out = torch.empty_like(query)
    part_out, part_lse = _scratch(plan, (batch, num_heads, slots, head_dim), query.device)
    direct = slots == 1
    if not direct:
        part_lse.fill_(float("-inf"))  # slots no program writes (past a short context) weigh nothing
    meta = dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HD_PAD=triton.next_power_of_2(head_dim), GROUP=group,
                BLOCK_N=tile, PRECISION=_dot_precision(query.dtype), **_formats(kv))
    first_key = cascade.first_key if cascade is not None else plan.no_offsets
    launch(_decode_split_kernel, (batch, num_kv_heads, num_splits),
           query, key_cache, value_cache, block_tables, context_lens, first_key, part_out, part_lse, out, scale,
           query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
           value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
           part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
           out.stride(0), out.stride(1), tokens_per_split, GROUP_PAD=max(16, triton.next_power_of_2(group)),
           DIRECT=direct, **meta)
    if cascade is not None:
        record("decode attention", "Triton cascade")
        _launch_prefix(query, key_cache, value_cache, cascade, part_out, part_lse, scale, num_splits, prefix_splits,
                       tokens_per_split, tiles.prefix_rows if meta["V_FMT"] < 0 else tiles.prefix_rows // 2, meta)
    if not direct:
        launch(_decode_merge_kernel, (batch, num_heads),
               part_out, part_lse, out,
               part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
               out.stride(0), out.stride(1), slots, HEAD_DIM=head_dim, HD_PAD=meta["HD_PAD"], SLOT_TILE=MERGE_SLOT_TILE)
    return _turned(out, kv.v, kv.head_dim) if kv is not None else out


def _check_decode_args(query, key_cache, value_cache, block_tables, context_lens, kv=None) -> None:
    _check_cache(key_cache, value_cache)
    batch, num_heads, head_dim = query.shape
    _values_dtype(query, key_cache, kv)
    assert num_heads % key_cache.shape[2] == 0 and query.stride(-1) == 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.stride(-1) == 1
    assert context_lens.shape == (batch,) and not block_tables.is_floating_point()


def _split_size(plan: DecodePlan, rows: int, device: torch.device) -> int:
    """The plan's tokens per split, chosen once per step for its rows (sequences x KV heads)."""
    if plan.tokens_per_split is None:
        plan.tokens_per_split = choose_split(rows, plan.max_context_len, device)
    return plan.tokens_per_split


def _scratch(plan: DecodePlan, shape: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's split outputs [batch, heads, slots, head_dim] and log-sum-exps, reused across layers."""
    if plan.scratch is None or plan.scratch[0].shape != shape or plan.scratch[0].device != device:
        plan.scratch = (torch.empty(shape, dtype=torch.float32, device=device),
                        torch.empty(shape[:3], dtype=torch.float32, device=device))
        plan.no_offsets = torch.zeros(shape[0], dtype=torch.int32, device=device)
    return plan.scratch


def _launch_prefix(query, key_cache, value_cache, cascade, part_out, part_lse, scale, num_splits: int,
                   prefix_splits: int, tokens_per_split: int, rows: int, meta: dict) -> None:
    """The cascade's shared-prefix partials, into the slots after each member's own splits."""
    width, num_kv_heads = cascade.members.shape[1], key_cache.shape[2]
    row_tiles = triton.cdiv(width * meta["GROUP"], rows)
    launch(_prefix_kernel, (cascade.members.shape[0] * row_tiles, num_kv_heads, prefix_splits),
           query, key_cache, value_cache, cascade.prefix_tables, cascade.prefix_lens, cascade.members,
           part_out, part_lse, scale,
           query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
           value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), cascade.prefix_tables.stride(0),
           cascade.members.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
           part_lse.stride(0), part_lse.stride(1), num_splits, width, row_tiles, tokens_per_split,
           ROWS=rows, **meta)


# -- 3. prefill attention over the cached prefix and the chunk itself -------------------------------


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr, out_ptr,
    scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HD_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if m_tile * BLOCK_M < q_len:
        ctx = tl.load(context_lens_ptr + b)
        prefix = ctx - q_len
        kv_head = h // GROUP
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = prefix + rows
        d = tl.arange(0, HD_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD_PAD], tl.float32)
        key_end = tl.minimum(prefix + (m_tile + 1) * BLOCK_M, ctx)
        for n0 in range(0, key_end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            valid = offs < key_end
            allowed = valid[None, :] & (offs[None, :] <= q_pos[:, None])
            m_i, l_i, acc = _attend_tile(q, key_cache_ptr, value_cache_ptr, block_tables_ptr + b * stride_bt, offs,
                                         valid, allowed, kv_head, d, d_ok, m_i, l_i, acc, scale, stride_kb, stride_ks,
                                         stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, PRECISION, K_FMT,
                                         V_FMT, HEAD_DIM)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                      max_query_len=None, plan=None, kv: "KVLayout | None" = None):
    """(`plan`, the chunks that share a cached prefix, is for the torch path; each chunk runs alone here.)"""
    _check_cache(key_cache, value_cache)
    record("prefill attention", "Triton")
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    batch = context_lens.shape[0]
    assert query_start_loc.shape == (batch + 1,) and block_tables.shape[0] == batch
    assert query.stride(-1) == 1 and block_tables.stride(-1) == 1
    _values_dtype(query, key_cache, kv)
    assert num_heads % num_kv_heads == 0
    formats = _formats(kv)
    if kv is not None:  # int4 keys and values are stored turned: the query turned alike, the output turned back
        query = _turned(query, kv.k, kv.head_dim)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    out = torch.empty_like(query)
    launch(_prefill_kernel, (batch, num_heads, triton.cdiv(max_query_len, PREFILL_BLOCK_M)),
           query, key_cache, value_cache, block_tables, query_start_loc, context_lens, out, scale,
           query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
           value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
           out.stride(0), out.stride(1),
           BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HD_PAD=triton.next_power_of_2(head_dim),
           GROUP=num_heads // num_kv_heads, BLOCK_M=PREFILL_BLOCK_M,
           BLOCK_N=PREFILL_BLOCK_N if formats["K_FMT"] < 0 else PREFILL_BLOCK_N // 2,  # dequantizing takes registers
           PRECISION=_dot_precision(query.dtype), **formats)
    return _turned(out, kv.v, kv.head_dim) if kv is not None else out


# -- 4. whole-block copies: copy-on-write, gather to and scatter from a staging buffer --------------


@triton.jit
def _copy_chunks_kernel(
    src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr,
    src_stride_idx, src_stride_chunk, dst_stride_idx, dst_stride_chunk,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (i, j) copies CHUNK contiguous elements: src[src_idx[i], j] -> dst[dst_idx[i], j]."""
    i = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)
    s = tl.load(src_idx_ptr + i).to(tl.int64)
    t = tl.load(dst_idx_ptr + i).to(tl.int64)
    src = src_ptr + s * src_stride_idx + j * src_stride_chunk
    dst = dst_ptr + t * dst_stride_idx + j * dst_stride_chunk
    for start in range(0, CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < CHUNK
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _check_pool(kv_cache: torch.Tensor) -> int:
    assert kv_cache.dim() == 6, "kv_cache must be [L, 2, num_blocks, block_size, H, D]"
    assert kv_cache.is_contiguous()
    return kv_cache.shape[3] * kv_cache.shape[4] * kv_cache.shape[5]


def _copy(src, dst, src_idx, dst_idx, src_strides, dst_strides, chunk: int, num_chunks: int) -> None:
    n = src_idx.shape[0]
    if n == 0:
        return
    launch(_copy_chunks_kernel, (n, num_chunks),
           src, dst, src_idx, dst_idx, src_strides[0], src_strides[1], dst_strides[0], dst_strides[1],
           CHUNK=chunk, BLOCK=min(COPY_BLOCK, triton.next_power_of_2(chunk)))


def copy_blocks(kv_cache, src, dst) -> None:
    chunk = _check_pool(kv_cache)
    assert src.shape == dst.shape and src.dim() == 1
    layers = kv_cache.shape[0] * 2
    strides = (kv_cache.stride(2), kv_cache.stride(1))
    _copy(kv_cache, kv_cache, src.to(kv_cache.device), dst.to(kv_cache.device), strides, strides, chunk, layers)


def gather_blocks(kv_cache, block_ids, out) -> None:
    chunk = _check_pool(kv_cache)
    n = block_ids.shape[0]
    assert out.shape == (n, kv_cache.shape[0], 2, *kv_cache.shape[3:]) and out.is_contiguous()
    assert out.dtype == kv_cache.dtype and out.device == kv_cache.device
    idx = torch.arange(n, device=kv_cache.device)
    _copy(kv_cache, out, block_ids.to(kv_cache.device), idx, (kv_cache.stride(2), kv_cache.stride(1)),
          (out.stride(0), out.stride(2)), chunk, kv_cache.shape[0] * 2)


def gather_from_slab(slab_layer, slots, out, dst) -> None:
    """out[:, dst[i]] = slab_layer[slots[i]] (K and V) for each i: one layer's far blocks staged for attention
    (runner/far_stage.py). slab_layer [capacity, 2, block_size, kv_heads, head_dim] is a view of the warm
    tier's slab, which on CUDA is pinned host memory that the kernel reads where it lies; the same kernel
    variant as the pool's block copies (same chunk), so nothing new compiles."""
    assert slab_layer.dim() == 5 and slab_layer.shape[1] == 2 and out.dim() == 5 and out.shape[0] == 2
    assert slab_layer.shape[2:] == out.shape[2:] and slab_layer.dtype == out.dtype and out.is_contiguous()
    assert slab_layer[0, 0].is_contiguous() and slots.shape == dst.shape
    chunk = out.shape[2] * out.shape[3] * out.shape[4]
    _copy(slab_layer, out, slots, dst, (slab_layer.stride(0), slab_layer.stride(1)), (out.stride(1), out.stride(0)),
          chunk, 2)


def scatter_blocks(kv_cache, block_ids, src) -> None:
    chunk = _check_pool(kv_cache)
    n = block_ids.shape[0]
    assert src.shape == (n, kv_cache.shape[0], 2, *kv_cache.shape[3:]) and src.is_contiguous()
    src = src.to(kv_cache.device, kv_cache.dtype)
    idx = torch.arange(n, device=kv_cache.device)
    _copy(src, kv_cache, idx, block_ids.to(kv_cache.device), (src.stride(0), src.stride(2)),
          (kv_cache.stride(2), kv_cache.stride(1)), chunk, kv_cache.shape[0] * 2)



# -- quantized dense layers (kernels/quant.py's formats) --------------------------------------------------

QUANT_BLOCK_M, QUANT_BLOCK_N, QUANT_BLOCK_K = 16, 64, 32


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])
def _quant_matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, offsets_ptr, bias_ptr, out_ptr, M, N, K, group_size,
    stride_xm, stride_cn, stride_sn, stride_om,
    IS_Q4: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (row tile, output tile) computes out[rows, cols] = x @ dequantize(W)[cols].T (+ bias): each
    BLOCK_K slice of the weight is dequantized in registers (q8: code x scale, + offset where it has them;
    q4: the nibble GGUF's order puts input j of a group in byte j's low half and input j + g/2 in its high
    half, x scale + offset, the group of each input found by division, so any group size serves) and multiplied on
    the tensor cores in x's dtype, accumulating in fp32. Decode steps (up to 16 rows) are one row tile: each
    weight is read once, as a GEMV reads it."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        grp = kk // group_size  # the weight slice is laid out [BLOCK_K, BLOCK_N], as the product takes it
        w_ok = k_ok[:, None] & n_ok[None, :]
        d = tl.load(scales_ptr + rn[None, :] * stride_sn + grp[:, None], mask=w_ok, other=0.0).to(tl.float32)
        if IS_Q4:
            half = group_size // 2
            j = kk % group_size
            byte = tl.load(codes_ptr + rn[None, :] * stride_cn + (grp * half + j % half)[:, None], mask=w_ok, other=0)
            code = (byte.to(tl.int32) >> ((j // half) * 4)[:, None]) & 15
        else:
            code = tl.load(codes_ptr + rn[None, :] * stride_cn + kk[:, None], mask=w_ok, other=0)
        w = code.to(tl.float32) * d
        if HAS_OFFSETS:
            w += tl.load(offsets_ptr + rn[None, :] * stride_sn + grp[:, None], mask=w_ok, other=0.0).to(tl.float32)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def quant_linear(x, codes, scales, offsets, group_size, bias=None) -> torch.Tensor:
    """x [..., K] @ dequantize(codes, scales, offsets, group_size).T (+ bias) in x's dtype: kernels/quant.py's
    q8 (int8 codes, offsets or not) and q4 (uint8 codes, offsets) formats, the reference being its dequantize()
    then F.linear."""
    k, n = x.shape[-1], codes.shape[0]
    q4 = codes.dtype == torch.uint8
    assert codes.shape[1] * (2 if q4 else 1) == k and k % group_size == 0 and (not q4 or group_size % 2 == 0)
    assert codes.dtype in (torch.uint8, torch.int8) and codes.is_contiguous() and scales.is_contiguous()
    assert scales.shape == (n, k // group_size) and (not q4 or offsets is not None)
    assert offsets is None or (offsets.is_contiguous() and offsets.shape == scales.shape)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, QUANT_BLOCK_M), triton.cdiv(n, QUANT_BLOCK_N))
        launch(_quant_matmul_kernel, grid, x2, codes, scales, offsets if offsets is not None else scales,
               bias if bias is not None else out, out, m, n, k, group_size, x2.stride(0), codes.stride(0),
               scales.stride(0), out.stride(0), IS_Q4=q4, HAS_OFFSETS=offsets is not None,
               HAS_BIAS=bias is not None, BLOCK_M=QUANT_BLOCK_M, BLOCK_N=QUANT_BLOCK_N, BLOCK_K=QUANT_BLOCK_K,
               PRECISION=_dot_precision(x.dtype))
    return out.view(*x.shape[:-1], n)

TRITON_OPS = KernelOps(
    name="triton",
    store_kv=store_kv,
    decode_attention=decode_attention,
    prefill_attention=prefill_attention,
    copy_blocks=copy_blocks,
    gather_blocks=gather_blocks,
    scatter_blocks=scatter_blocks,
    plan_decode=plan_decode,
)
