"""Beam search as transformers' `generate(num_beams=k, do_sample=False)` defines it, one request at a time.

Each step every running beam has a row of log-probabilities (after the request's processors); the
candidates are the `keep` = max(2, 1 + stop tokens) x k best (beam, token) pairs by summed
log-probability. In that order, the first k that end nothing become the next running beams; of the first
k, those that end (a stop token, a stop string, the length limit) are offered to the k finished
hypotheses, scored sum / (output tokens ** length_penalty). The search ends when every candidate ended,
when `early_stopping` is True and k hypotheses are finished, or when the best running beam cannot beat
the worst finished one (by its current length, or with early_stopping "never" and a positive penalty, by
the longest it may grow).

This module decides; the caller (engine/lifecycle.py) carries a step out on the sequences: a beam chosen more
than once forks (its blocks shared by reference), one chosen never is freed.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tieredkv.config import SamplingParams

if TYPE_CHECKING:
    from tieredkv.models.detokenizer import IncrementalDetokenizer


class Beam(Protocol):
    """What a search reads of a running beam (core/sequence.py's Sequence is one)."""

    beam_logprob: float
    detokenizer: "IncrementalDetokenizer"

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class Hypothesis:
    """A finished beam: its output tokens, summed log-probability, score and text."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    detokenizer: "IncrementalDetokenizer"


@dataclass
class Survivor:
    """A running beam of the next step: `parent` extended by `token`. `detokenizer` is the parent's with the
    token added, when looking for stop strings needed it (else the caller adds the token)."""

    parent: Beam
    token: int
    cum_logprob: float
    detokenizer: "IncrementalDetokenizer | None" = None


def penalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """sum / length ** penalty, the quotient in float32 as transformers computes it (so ties break the same
    way). The power is taken in float64, where it saturates to inf (the score to -0.0) instead of raising as
    a Python float's power does; SamplingParams bounds length_penalty besides."""
    power = torch.tensor(float(length), dtype=torch.float64).pow(length_penalty)
    return float(torch.tensor([cum_logprob], dtype=torch.float32) / power.to(torch.float32))


class BeamSearch:
    """One request's search state: the finished hypotheses, best first. The running beams are the
    request's live sequences, in rank order, each with its `beam_logprob`."""

    def __init__(self, params: SamplingParams, stop_ids: frozenset[int], num_prompt_tokens: int, max_model_len: int):
        self.params = params
        self.width = params.beam_width
        self.keep = max(2, 1 + len(stop_ids)) * self.width
        self.stop_ids = stop_ids
        self.max_new = min(params.max_tokens, max_model_len - num_prompt_tokens)
        self.finished: list[Hypothesis] = []
        self.started = False
        self.done = False
        self.steps = 0

    def step(self, beams: typing.Sequence[Beam], rows: torch.Tensor) -> list[Survivor]:
        """rows [len(beams), V] processed log-probabilities -> the next running beams (best first); sets
        `done` when the search ends (the survivors are then of no use)."""
        self.started, self.steps = True, self.steps + 1
        cum = torch.tensor([b.beam_logprob for b in beams], dtype=torch.float32)
        flat = (rows + cum[:, None]).flatten()
        top = torch.topk(flat, min(self.keep, flat.numel()))
        vocab, length = rows.shape[1], beams[0].num_output_tokens + 1
        can_finish = not (self.params.early_stopping is True and len(self.finished) == self.width)
        survivors: list[Survivor] = []
        for pos, (score, idx) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            if pos >= self.width and len(survivors) == self.width:
                break  # nothing further can run or finish
            parent, token = beams[idx // vocab], idx % vocab
            reason, detok = self._ends(parent, token, length)
            if reason is None:
                if len(survivors) < self.width:
                    survivors.append(Survivor(parent, token, score, detok))
            elif pos < self.width and can_finish:
                self._offer(parent, token, score, length, reason, detok)
        self.done = not survivors or not self._improvable(survivors[0].cum_logprob, length) or (
            self.params.early_stopping is True and len(self.finished) == self.width)
        return survivors

    def _ends(self, parent: Beam, token: int, length: int) -> tuple[str | None, "IncrementalDetokenizer | None"]:
        """Why parent + token would end ("stop", "length") or None; with stop strings, the detokenizer that
        saw the token."""
        detok = None
        if token in self.stop_ids:
            return "stop", detok
        if self.params.stop:
            detok = parent.detokenizer.fork()
            if detok.add(token, check_stop=length >= self.params.min_tokens):
                return "stop", detok
        return ("length" if length >= self.max_new else None), detok

    def _offer(self, parent: Beam, token: int, cum: float, length: int, reason: str,
               detok: "IncrementalDetokenizer | None") -> None:
        """A finished candidate joins the k best hypotheses when it scores above the worst of them."""
        score = penalized(cum, length, self.params.length_penalty)
        if len(self.finished) == self.width and score <= self.finished[-1].score:
            return
        if detok is None:
            detok = parent.detokenizer.fork()
            detok.add(token, check_stop=False)
        hyp = Hypothesis(parent.output_token_ids + [token], cum, score, reason, detok)
        at = next((i for i, h in enumerate(self.finished) if h.score < score), len(self.finished))
        self.finished.insert(at, hyp)
        del self.finished[self.width :]

    def _improvable(self, best_running: float, length: int) -> bool:
        """Whether the best running beam may still beat the worst of k finished hypotheses."""
        if len(self.finished) < self.width:
            return True
        lp = self.params.length_penalty
        horizon = self.max_new if self.params.early_stopping == "never" and lp > 0 else length
        return penalized(best_running, horizon, lp) > self.finished[-1].score

    def results(self, beams: typing.Sequence[Beam], running_reason: str) -> list[Hypothesis]:
        """The n best hypotheses, best first; when fewer finished (an aborted search), the running beams
        make up the rest, ended with `running_reason`."""
        n = self.params.n
        out = list(self.finished[:n])
        for b in beams[: n - len(out)]:
            length = max(b.num_output_tokens, 1)
            out.append(Hypothesis(b.output_token_ids, b.beam_logprob,
                                  penalized(b.beam_logprob, length, self.params.length_penalty),
                                  running_reason, b.detokenizer))
        return out
