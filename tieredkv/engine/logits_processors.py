"""Per-request logits processors applied to a whole batch at once: logit bias, min_tokens, repetition,
frequency and presence penalties. Each is one batched tensor operation over the rows that use it,
not a Python loop over sequences; rows that use none are not touched."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tieredkv.config import SamplingParams


class RowState(NamedTuple):
    """What a row's processors need: its request's parameters and the sequence's tokens so far (the
    list itself, sliced only for the rows whose processors read it)."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids: masked until min_tokens
    draft: int | None = None  # speculative decoding: the proposed token this row verifies (sampler.sample_row)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def has_processors(self) -> bool:
        """True when some processor changes this row's logits now (apply_processors' conditions)."""
        p = self.params
        return bool(p.logit_bias or (self.stop_ids and self.num_output_tokens < p.min_tokens)
                    or p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)


def _padded(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, L] int64 ids (padding 0) and [R, L] bool validity."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.int64)
        valid[r, : len(s)] = True
    return ids.to(device), valid.to(device)


def _counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] how often each token occurs in each row's list."""
    ids, valid = _padded(seqs, device)
    counts = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=device)
    return counts.scatter_add_(1, ids, valid.to(torch.float32))


@torch.inference_mode()
def apply_processors(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """logits [S, V] fp32 -> the same with every row's processors applied (in place where possible).

    Order (as vLLM): logit bias, min_tokens, then penalties: repetition (HF semantics: over prompt and
    output, positive logits divided, negative multiplied), then frequency and presence (OpenAI
    semantics: over the output, `- frequency * count - presence * (count > 0)`)."""
    if not any(row.has_processors for row in rows):
        return logits
    device, vocab = logits.device, logits.shape[-1]
    bias = [(r, t, b) for r, row in enumerate(rows) for t, b in row.params.logit_bias.items() if 0 <= t < vocab]
    if bias:
        r, t, b = zip(*bias)
        logits.index_put_((torch.tensor(r, device=device), torch.tensor(t, device=device)),
                          torch.tensor(b, dtype=logits.dtype, device=device), accumulate=True)
    masked = [(r, t) for r, row in enumerate(rows) if row.num_output_tokens < row.params.min_tokens
              for t in row.stop_ids if 0 <= t < vocab]
    if masked:
        r, t = zip(*masked)
        logits.index_put_((torch.tensor(r, device=device), torch.tensor(t, device=device)),
                          torch.tensor(float("-inf"), dtype=logits.dtype, device=device))
    rep = [r for r, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if rep:
        seen = _counts([rows[r].token_ids for r in rep], vocab, device) > 0
        penalty = torch.tensor([rows[r].params.repetition_penalty for r in rep], device=device)[:, None]
        sub = logits[rep]
        scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[rep] = torch.where(seen, scaled, sub)
    freq = [r for r, row in enumerate(rows) if row.params.frequency_penalty or row.params.presence_penalty]
    if freq:
        counts = _counts([rows[r].output_ids for r in freq], vocab, device)
        f = torch.tensor([rows[r].params.frequency_penalty for r in freq], device=device)[:, None]
        p = torch.tensor([rows[r].params.presence_penalty for r in freq], device=device)[:, None]
        logits[freq] -= f * counts + p * (counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits [V] (after temperature) -> tokens whose probability is below min_p x the top one's at -inf."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
