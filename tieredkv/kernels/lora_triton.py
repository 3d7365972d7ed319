"""The batched LoRA product of a step on CUDA, in Triton: `out[rows of k] += (x[rows of k] A_k^T) B_k` for every
adapter k of the step at once (what Punica calls a segmented gather matrix-vector product), with the signature
of its torch reference `lora_rows_ref` (kernels/lora_rows.py: the CPU path), which tests/engine/test_lora.py compares it
against through Triton's interpreter.

One program per (adapter, block of its rows, block of output columns): it gathers its rows of x, multiplies them
by the adapter's A in chunks of the input, then the rank-wide result by its block of B^T, and adds into out. Rows
belong to one adapter each and programs of one adapter write disjoint column blocks, so no two programs write the
same element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tieredkv.kernels.triton_ops import _dot_precision, launch

BLOCK_M = 16  # rows of one adapter per program
BLOCK_N = 64  # output columns per program
BLOCK_K = 32  # input columns per step of the first product


@triton.jit
def _lora_rows_kernel(out_ptr, x_ptr, index_ptr, counts_ptr, a_ptr, bt_ptr, M, IN, R, OUT,
                      stride_out, stride_x, stride_ak, stride_ar, stride_bk, stride_br,
                      R_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr):
    k = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    n0 = tl.program_id(2) * BLOCK_N
    count = tl.load(counts_ptr + k)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    valid = offs_m < count
    rows = tl.load(index_ptr + k * M + offs_m, mask=valid, other=0).to(tl.int64)
    offs_r = tl.arange(0, R_P)
    r_ok = offs_r < R
    h = tl.zeros((BLOCK_M, R_P), dtype=tl.float32)
    for c in range(0, IN, BLOCK_K):
        offs_c = c + tl.arange(0, BLOCK_K)
        c_ok = offs_c < IN
        xs = tl.load(x_ptr + rows[:, None] * stride_x + offs_c[None, :], mask=valid[:, None] & c_ok[None, :],
                     other=0.0)
        a = tl.load(a_ptr + k * stride_ak + offs_r[None, :] * stride_ar + offs_c[:, None],
                    mask=r_ok[None, :] & c_ok[:, None], other=0.0)  # A_k^T's chunk [BLOCK_K, R_P]
        h += tl.dot(xs.to(tl.float32), a.to(tl.float32), input_precision=PRECISION)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < OUT
    b = tl.load(bt_ptr + k * stride_bk + offs_r[:, None] * stride_br + offs_n[None, :],
                mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    delta = tl.dot(h, b.to(tl.float32), input_precision=PRECISION)
    ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    ok = valid[:, None] & n_ok[None, :]
    old = tl.load(ptrs, mask=ok, other=0.0)
    tl.store(ptrs, (old.to(tl.float32) + delta).to(old.dtype), mask=ok)


def lora_rows(out: torch.Tensor, x: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, a3: torch.Tensor,
              bt3: torch.Tensor) -> torch.Tensor:
    """out[:, :bt3.shape[2]] += for each adapter k, on its rows index[k, :counts[k]]: (x[rows] a3[k]^T) bt3[k].
    out [T, >= OUT], x [T, IN], index [K, M] int64, counts [K] int32, a3 [K, R, IN], bt3 [K, R, OUT]."""
    num_k, m = index.shape
    _, r, width = bt3.shape
    assert x.shape[1] == a3.shape[2] and a3.shape[:2] == (num_k, r) and out.shape[1] >= width
    assert out.stride(1) == 1 and x.stride(1) == 1 and a3.stride(2) == 1 and bt3.stride(2) == 1
    r_p = max(16, triton.next_power_of_2(r))
    grid = (num_k, triton.cdiv(m, BLOCK_M), triton.cdiv(width, BLOCK_N))
    launch(_lora_rows_kernel, grid, out, x, index.contiguous(), counts, a3, bt3, m, x.shape[1], r, width,
           out.stride(0), x.stride(0), a3.stride(0), a3.stride(1), bt3.stride(0), bt3.stride(1),
           R_P=r_p, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=_dot_precision(x.dtype))
    return out
