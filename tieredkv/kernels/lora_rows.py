"""A step's batched LoRA products in torch: the reference of the Triton kernel (kernels/lora_triton.py) and the
CPU path (models/lora.py LoRABatch)."""

from __future__ import annotations

import torch


def padding_mask(index: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[K, M, 1]: 1 on each adapter's rows, 0 on the padding (computed once a step by a caller that runs many)."""
    keep = torch.arange(index.shape[1], device=index.device)[None, :] < counts[:, None]
    return keep.unsqueeze(-1).to(dtype)


def lora_rows_ref(out: torch.Tensor, x: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, a3: torch.Tensor,
                  bt3: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """lora_rows in torch: the rows gathered per adapter (padding: row 0, zeroed), two batched products, one
    indexed add. The CPU path (`keep`: padding_mask, when the caller has it)."""
    num_k, m = index.shape
    flat = index.flatten()
    g = x.index_select(0, flat).view(num_k, m, x.shape[1])
    delta = torch.bmm(torch.bmm(g, a3.transpose(1, 2)), bt3)
    delta.mul_(padding_mask(index, counts, delta.dtype) if keep is None else keep)
    out[:, : delta.shape[2]].index_add_(0, flat, delta.view(num_k * m, -1))
    return out
