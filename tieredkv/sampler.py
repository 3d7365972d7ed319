"""Next-token choice per sequence: greedy in one batched argmax, the rest from their own generators."""

from __future__ import annotations

import torch

from tieredkv.config import SamplingParams
from tieredkv.errors import SamplingError


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> the same with everything outside top-k and the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs > top_p  # tokens after the nucleus is already full
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(0, order, outside), float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] fp32 on CPU -> one token id drawn with `generator`."""
    logits = apply_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int | SamplingError]:
    """logits [S, V] fp32 -> S token ids, or a SamplingError for each row that cannot be sampled (NaN or
    +inf logits, nothing finite left): a bad row fails its own sequence, never the batch."""
    out: list[int | SamplingError] = logits.argmax(-1).tolist()
    bad = (logits.isnan() | logits.isposinf()).any(-1) | ~logits.isfinite().any(-1)  # [S]
    for i in bad.nonzero().flatten().tolist():
        out[i] = SamplingError("the model produced logits that are not finite numbers")
    random_rows = [i for i, p in enumerate(params) if not p.greedy and isinstance(out[i], int)]
    if random_rows:
        rows = logits[random_rows].cpu()
        for j, i in enumerate(random_rows):
            try:
                out[i] = sample_row(rows[j], params[i], generators[i])
            except RuntimeError as e:  # e.g. a distribution torch.multinomial rejects
                out[i] = SamplingError(f"sampling failed: {e}")
    return out
