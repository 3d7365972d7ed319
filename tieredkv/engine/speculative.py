"""Speculative decoding's proposers and the controller that decides, each step, which decoding sequences get
drafts and how many (EngineConfig.speculative).

A draft is a list of token ids put on `Sequence.spec_tokens` before the step is scheduled. The scheduler then
gives the sequence 1 + len(drafts) tokens (dropping the drafts when they would not fit beside the others),
the runner computes them as one short chunk on the sequence's blocks with a logits row for each, and the
lifecycle verifies them row by row (engine/lifecycle.py): a row is sampled exactly as a plain decode step
samples it, and the next row counts only while the sampled token is the draft. A proposer only reads the
sequences; any object with `name` and `propose(seqs, lengths)` serves (a suffix tree, EAGLE heads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from tieredkv.config import SpeculativeConfig
from tieredkv.core.sequence import Sequence

BACKOFF_LIMIT = 32  # the most steps a sequence whose drafts do not pay waits before trying again
PRIOR_ACCEPTANCE = 0.7  # a sequence's acceptance before its first verification (a proposer's guess is often right)


class Proposer(Protocol):
    name: str

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """At most lengths[i] tokens that may follow seqs[i]'s tokens (fewer, or none, where it has no guess)."""


class NgramIndex:
    """Where each n-gram (n in [lo, hi]) of a token list last occurred with a token after it: appended to as
    the list grows, so a step looks its suffix up in O(hi - lo) dict reads whatever the document's length."""

    def __init__(self, lo: int, hi: int):
        self.sizes = range(hi, lo - 1, -1)  # longest first: a longer match is the better guess
        self.last = {n: {} for n in self.sizes}  # n-gram -> the position of the token that followed it
        self.indexed = 0  # positions whose preceding n-grams are in `last`

    def extend(self, tokens: list[int]) -> None:
        """Indexes the n-grams that end before each position up to the last token (which has no successor yet)."""
        for p in range(max(self.indexed, 1), len(tokens)):
            for n in self.sizes:
                if p >= n:
                    self.last[n][tuple(tokens[p - n : p])] = p
        self.indexed = max(self.indexed, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens (or fewer) that followed the latest earlier occurrence of the longest indexed suffix."""
        for n in self.sizes:
            if len(tokens) < n:
                continue
            p = self.last[n].get(tuple(tokens[-n:]))
            if p is not None:
                return tokens[p : p + k]
        return []


class NgramProposer:
    """Prompt lookup (transformers' prompt_lookup_num_tokens, vLLM's and llama.cpp's n-gram): the draft is what
    followed the sequence's last n tokens where they occurred before in its own prompt or output, n from
    prompt_lookup_max down to prompt_lookup_min. A long document is the best draft a question about it has."""

    name = "ngram"

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, lengths):
            state = seq.spec_state
            if state.index is None:
                state.index = NgramIndex(self.lo, self.hi)
            state.index.extend(seq.token_ids)
            drafts.append(state.index.lookup(seq.token_ids, k))
        return drafts


@dataclass
class SpecState:
    """One sequence's speculation: its proposer's state, its measured acceptance and back-off, its counts."""

    acceptance: float = PRIOR_ACCEPTANCE  # a moving average of the chance that a draft is accepted
    index: NgramIndex | None = None
    skip: int = 0  # steps left without drafts (back-off while drafts do not pay)
    failures: int = 0  # back-offs in a row
    drafted: int = 0
    accepted: int = 0


@dataclass
class SpecCounters:
    """What the engine's speculation did (EngineStats.speculative): vLLM's spec_decode counters."""

    method: str
    num_drafts: int = 0  # verifications: sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # drafts accepted at position 0, 1, ...
    skipped_steps: int = 0  # steps with decoding sequences but no drafts because the batch was too large
    propose_seconds: float = 0.0  # time spent proposing

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class StepCosts:
    """A step's measured time by the tokens it computes (moving averages), and an estimate where none was
    measured: the nearest measured size below plus `slope` of one token's time per token more (optimistic at
    first, so that longer drafts get tried and measured)."""

    def __init__(self, most: int, slope: float = 0.25):
        self.seconds = [0.0] * (most + 1)  # by tokens in the step; 0: not measured yet
        self.slope = slope

    def observe(self, tokens: int, seconds: float) -> None:
        if 0 < tokens < len(self.seconds):
            old = self.seconds[tokens]
            self.seconds[tokens] = seconds if old == 0.0 else 0.8 * old + 0.2 * seconds

    def estimate(self, tokens: int) -> float:
        tokens = min(tokens, len(self.seconds) - 1)
        base = next((n for n in range(tokens, 0, -1) if self.seconds[n]), 0)
        if base == 0:
            return float(tokens)  # nothing measured: relative units
        one = self.seconds[1] or self.seconds[base] / base
        return self.seconds[base] + (tokens - base) * self.slope * one


class Speculator:
    """Puts drafts on the decoding sequences that should get them this step, and learns from each verification.

    Adaptive (SpeculativeConfig.adaptive): each sequence keeps a moving average a of its drafts' acceptance, so k
    drafts are expected to give 1 + a + ... + a^k tokens; each step size's time is measured (StepCosts), and a
    sequence gets the k (0..num_speculative_tokens) that gives the step the most tokens a second. Where no k > 0
    pays, the sequence waits 1, 2, 4, ... steps (at most BACKOFF_LIMIT) and then tries one draft, which measures
    it again: text with nothing to copy costs a lookup a step and little else. Above `max_batch` decoding
    sequences nobody drafts (vLLM's disable_by_batch_size): that batch is compute-bound. Not adaptive: every
    decoding sequence asks its proposer for num_speculative_tokens drafts every step."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_batch: int, vocab_size: int):
        self.config = config
        self.vocab_size = vocab_size
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.max_batch = max_batch
        self.costs = StepCosts(max_batch * (self.k + 1) + 1)
        self.counters = SpecCounters(proposer.name, accepted_per_position=[0] * self.k)

    @staticmethod
    def wants(seq: Sequence) -> bool:
        """Whether seq's request speculates: not a beam search or a prefill-only request, and not turned off."""
        req = seq.request
        return req.beam is None and not req.prefill_only and req.params.speculative is not False

    def observe(self, tokens: int, seconds: float) -> None:
        """A step that computed `tokens` tokens took `seconds` (what drafts cost, for the adaptive lengths)."""
        self.costs.observe(tokens, seconds)

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Sets spec_tokens on every running sequence: drafts on those that decode and should get them, [] on
        the rest."""
        for seq in running:
            seq.spec_tokens = []
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1 and self.wants(s)]
        if not decoding:
            return
        if len(decoding) > self.max_batch:
            self.counters.skipped_steps += 1
            return
        t0 = time.perf_counter()
        seqs, lengths = [], []
        step = len(decoding) + sum(s.num_tokens - s.num_computed_tokens for s in running if s not in decoding)
        gained = float(step)  # tokens the step is expected to give
        for seq in decoding:
            state = seq.spec_state
            if state is None:
                state = seq.spec_state = SpecState()
            if state.skip:
                state.skip -= 1
                continue
            params = seq.request.params
            # room for the drafts and the token sampled after them, within max_tokens and the context
            room = min(params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens, self.k)
            k = room if not self.config.adaptive else self._length(state.acceptance, room, step, gained)
            if k == 0 and room > 0:  # nothing pays now: wait, then try one draft (which measures again)
                state.skip = min(1 << state.failures, BACKOFF_LIMIT)
                state.failures += 1
                continue
            if k > 0:
                seqs.append(seq)
                lengths.append(k)
                step += k
                gained += sum(state.acceptance ** i for i in range(1, k + 1))
        if seqs:
            for seq, draft, k in zip(seqs, self.proposer.propose(seqs, lengths), lengths):
                draft = list(draft[:k])
                bad = next((i for i, t in enumerate(draft) if not 0 <= t < self.vocab_size), None)
                seq.spec_tokens = draft if bad is None else draft[:bad]  # a proposer's id the model has not
        self.counters.propose_seconds += time.perf_counter() - t0

    def _length(self, a: float, room: int, step: int, gained: float) -> int:
        """The k in 0..room that makes the step give the most tokens a second, for a sequence whose drafts are
        accepted with chance a, in a step of `step` tokens expected to give `gained`."""
        best, best_rate, expect = 0, gained / self.costs.estimate(step), 0.0
        for k in range(1, room + 1):
            expect += a ** k
            rate = (gained + expect) / self.costs.estimate(step + k)
            if rate > best_rate * 1.02:  # a clear gain only: an estimate is not a measurement
                best, best_rate = k, rate
        return best

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts accepted the first `accepted`: the counts and the acceptance."""
        c, state = self.counters, seq.spec_state
        c.num_drafts += 1
        c.num_draft_tokens += drafted
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_position[i] += 1
        state.drafted += drafted
        state.accepted += accepted
        # each draft up to the first rejection is one trial of a: accepted successes, one failure unless all passed
        trials = accepted + (accepted < drafted)
        if trials:
            state.acceptance += (accepted / trials - state.acceptance) * min(1.0, 0.25 * trials)
        if accepted:
            state.failures = 0


def make_speculator(config: SpeculativeConfig, device_type: str, vocab_size: int) -> Speculator:
    """The controller for an engine's config (the ngram proposer; the draft model comes through its own
    proposer)."""
    if config.method != "ngram":
        raise ValueError(f'speculative method "{config.method}" is not available in this build; supported: "ngram"')
    max_batch = config.disable_by_batch_size or (32 if device_type == "cuda" else 8)
    return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max), max_batch,
                      vocab_size)
