"""Next-token choice per sequence: processors applied batch-wide, greedy in one batched max reduction, the rest
from their own generators; log-probabilities for the rows that ask."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tieredkv.config import SamplingParams
from tieredkv.engine.logits_processors import RowState, apply_min_p, apply_processors
from tieredkv.errors import SamplingError

__all__ = ["RowState", "Sampled", "apply_top_k_top_p", "bad_mask", "bad_rows", "sample", "sample_row"]

NOT_FINITE = "the model produced logits that are not finite numbers"


class Sampled(NamedTuple):
    """A sampled token; with `logprobs` asked, its log-probability and the top alternatives', from the
    model's raw distribution (before penalties, bias and temperature)."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


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


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               draft: int | None = None) -> int:
    """logits [V] fp32 on CPU -> one token id drawn with `generator` (temperature, then top-k, top-p
    and min-p). With a `draft` (speculative decoding, a proposer that guessed one token: q is 1 at it), rejection
    sampling keeps the distribution p: the draft is taken with probability min(1, p/q) = p(draft), else a token
    is drawn from the rest, (p - q)+ renormalised, which is p without the draft."""
    logits = apply_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    probs = apply_min_p(logits, params.min_p).softmax(-1)
    if draft is not None and 0 <= draft < probs.shape[-1]:
        p = float(probs[draft])
        if float(torch.rand((), generator=generator)) < p:
            return draft
        probs = probs.clone()
        probs[draft] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator))


def bad_mask(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> [S] bool, on the logits' device: whether each row cannot be used. A row's max is not
    finite exactly when the row has a NaN (amax propagates it), a +inf, or nothing but -inf."""
    return ~logits.amax(-1).isfinite()


def bad_rows(logits: torch.Tensor) -> list[bool]:
    """bad_mask, as a list on the host."""
    return bad_mask(logits).tolist()


def sample(logits: torch.Tensor, rows: list[RowState],
           generators: list[torch.Generator | None]) -> list[Sampled | SamplingError]:
    """logits [S, V] fp32 -> S sampled tokens, or a SamplingError for each row that cannot be sampled
    (NaN or +inf logits, nothing finite left): a bad row fails its own sequence, never the batch. The greedy
    tokens and the bad-row mask reach the host in one transfer (one device sync a step on CUDA)."""
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    raw = logits[asked].log_softmax(-1) if asked else None  # before any processor changes the logits
    if any(row.has_processors for row in rows):
        bad_t = bad_mask(logits)
        tokens_t = apply_processors(logits, rows).argmax(-1)
    else:  # one reduction gives both: the first maximal value's index, and the max that bad_mask tests
        top, tokens_t = logits.max(-1)
        bad_t = ~top.isfinite()
    tokens, bad = torch.stack((tokens_t, bad_t.to(tokens_t.dtype))).tolist()
    out: list[Sampled | SamplingError] = [
        SamplingError(NOT_FINITE) if bad[i] else Sampled(t)
        for i, t in enumerate(tokens)]
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy and not bad[i]]
    if random_rows:
        picked = logits[random_rows].cpu()
        for j, i in enumerate(random_rows):
            try:
                out[i] = Sampled(sample_row(picked[j], rows[i].params, generators[i], rows[i].draft))
            except RuntimeError as e:  # e.g. a distribution torch.multinomial rejects
                out[i] = SamplingError(f"sampling failed: {e}")
    for j, i in enumerate(asked):
        got = out[i]
        if isinstance(got, Sampled):
            k = rows[i].params.logprobs
            top = raw[j].topk(k) if k else None
            out[i] = Sampled(got.token, float(raw[j, got.token]),
                             list(zip(top.indices.tolist(), top.values.tolist())) if k else [])
    return out
