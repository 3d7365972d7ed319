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

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tieredkv.config import SpeculativeConfig
from tieredkv.core.sequence import Sequence
from tieredkv.errors import RequestError

if TYPE_CHECKING:
    from tieredkv.config import EngineConfig

log = logging.getLogger("tieredkv")

BACKOFF_LIMIT = 32  # the most steps a sequence whose drafts do not pay waits before trying again
PRIOR_ACCEPTANCE = 0.7
# a probe drafts as many tokens as pay at this acceptance (text being copied), whatever the sequence's own, and at
# most PROBE_DRAFTS: enough to see copying start (all accepted lifts the acceptance halfway to 1), and a probe of
# text with nothing to copy costs little. In a model of the controller (tests/engine/test_speculative.py,
# _adaptive_rate) over verification rows costing 0.1-1 decode steps and acceptance 0.27-0.9, 3 at most gave
# 0.94-3.14x plain decoding where the whole room (8) gave 0.91-3.14x, at least as much in every case
PROBE_ACCEPTANCE = 0.9
PROBE_DRAFTS = 3
# the draft model's own cache blocks: each call computes again the tokens after its last full block, so small
# blocks keep that short (its cache is its own: the target's block size does not bind it)
DRAFT_BLOCK_SIZE = 4  # a sequence's acceptance before its first verification (a proposer's guess is often right)


class Proposer(Protocol):
    name: str
    free: bool  # whether proposing costs nothing worth weighing (a lookup), or runs a model

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """At most lengths[i] tokens that may follow seqs[i]'s tokens (fewer, or none, where it has no guess)."""


class NgramIndex:
    """Where each n-gram (n in [lo, hi]) of a token list last occurred with a token after it: appended to as
    the list grows, so a step looks its suffix up in O(hi - lo) dict reads whatever the document's length. It also
    follows the match it found last while the list goes on as the text there did (text being copied)."""

    def __init__(self, lo: int, hi: int):
        self.sizes = range(hi, lo - 1, -1)  # longest first: a longer match is the better guess
        # n-gram -> the position of the token that followed it
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # positions whose preceding n-grams are in `last`
        # (position, length): the last lookup found the list's first `length` tokens continued at `position`
        self.follow: tuple[int, int] | None = None

    def extend(self, tokens: list[int]) -> None:
        """Indexes the n-grams that end before each position up to the last token (which has no successor yet)."""
        for p in range(max(self.indexed, 1), len(tokens)):
            for n in self.sizes:
                if p >= n:
                    self.last[n][tuple(tokens[p - n : p])] = p
        self.indexed = max(self.indexed, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens (or fewer) that follow the match of the list's suffix: the match the last lookup found,
        while every token since then went on as the text there did (a passage being copied stays on its own
        line, however often its last few tokens occur elsewhere: project notes whose every line has ", led by"),
        else the latest earlier occurrence of the longest indexed suffix."""
        if self.follow is not None:
            at, upto = self.follow
            while upto < len(tokens) and tokens[at] == tokens[upto]:  # (at < upto: the match lies before)
                at, upto = at + 1, upto + 1
            if upto == len(tokens):
                self.follow = (at, upto)
                return tokens[at : at + k]
        self.follow = None
        for n in self.sizes:
            if len(tokens) < n:
                continue
            p = self.last[n].get(tuple(tokens[-n:]))
            if p is not None:
                self.follow = (p, len(tokens))
                return tokens[p : p + k]
        return []


class NgramProposer:
    """Prompt lookup (transformers' prompt_lookup_num_tokens, vLLM's and llama.cpp's n-gram): the draft is what
    followed the sequence's last n tokens where they occurred before in its own prompt or output, n from
    prompt_lookup_max down to prompt_lookup_min, or what follows the passage the sequence is copying while its
    output goes on as that passage does (NgramIndex.lookup). A long document is the best draft a question about it
    has."""

    name = "ngram"
    free = True  # a lookup costs nothing worth weighing: a back-off may end in a full draft (Speculator)

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
    """One sequence's speculation: its proposer's state, its measured acceptance and back-off."""

    acceptance: float = PRIOR_ACCEPTANCE  # a moving average of the chance that a draft is accepted
    index: NgramIndex | None = None
    skip: int = 0  # steps left without drafts (back-off while drafts do not pay)
    proposals: int = 0  # steps it asked its proposer for drafts
    failures: int = 0  # back-offs in a row
    probe: bool = False  # when the back-off ends: draft in full once, whatever the estimate (measures it again)


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
    proposer_errors: int = 0  # calls of the proposer that raised (their sequences decoded without drafts)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class StepCosts:
    """The measured time of steps that only decode, by how many sequences decode and how many drafts they carry
    (moving averages), and an estimate where none was measured at that batch size (once a plain step of it was:
    Speculator.propose drafts nothing before): on the line between the nearest measured draft counts below and
    above; past the last measured, the slope between the two largest measured counts with drafts (the first
    drafts also pay for the verification itself), or before there are two, `slope` of a decoding sequence's share
    of the plain step per draft (optimistic, so that longer drafts get tried once)."""

    def __init__(self, slope: float = 0.05):
        self.seconds: dict[tuple[int, int], float] = {}  # (decoding sequences, drafts) -> seconds
        self.slope = slope

    def observe(self, batch: int, drafts: int, seconds: float) -> None:
        old = self.seconds.get((batch, drafts))
        self.seconds[(batch, drafts)] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def measured(self, batch: int) -> bool:
        """Whether a plain step (no drafts) of this batch size was measured: what drafts are weighed against."""
        return (batch, 0) in self.seconds

    def estimate(self, batch: int, drafts: int) -> float:
        measured = sorted(d for b, d in self.seconds if b == batch)
        lo, above = max(d for d in measured if d <= drafts), [d for d in measured if d > drafts]
        t_lo = self.seconds[(batch, lo)]
        if above:  # between two measured counts: on the line through them
            hi = above[0]
            return t_lo + (self.seconds[(batch, hi)] - t_lo) * (drafts - lo) / (hi - lo)
        drafting = measured[-2:] if len(measured) > 2 else []  # the two largest counts with drafts: their slope
        if drafting:  # (the first drafts' cost holds a switch of path, a verification's own: not each draft's)
            per_draft = (self.seconds[(batch, drafting[1])] - self.seconds[(batch, drafting[0])]) / (
                drafting[1] - drafting[0])
        else:
            per_draft = self.slope * self.seconds[(batch, 0)] / batch
        return t_lo + (drafts - lo) * max(per_draft, 0.0)


class Speculator:
    """Puts drafts on the decoding sequences that should get them this step, and learns from each verification.

    Adaptive (SpeculativeConfig.adaptive): each sequence keeps a moving average a of its drafts' acceptance, so k
    drafts are expected to give 1 + a + ... + a^k tokens; the time of steps that only decode is measured by batch
    size and drafts (StepCosts: a verification's cost depends on the path that serves it, the native rows, an
    eager chunk beside a compiled decode, a batch of chunks), and each sequence in turn gets the k
    (0..num_speculative_tokens) that gives the step the most tokens a second. Where no k > 0 pays, the sequence
    waits 1, 2, 4, ... steps (at most BACKOFF_LIMIT; the wait keeps growing until drafts pay at its own
    acceptance again) and then, where proposing costs nothing (`free`: prompt lookup), probes once: as many
    drafts as pay where text is being copied (PROBE_ACCEPTANCE; at most PROBE_DRAFTS), whatever its own
    acceptance, which measures it again (a document starts being quoted); where not even that pays
    (verification rows nearly as dear as steps: products bound by arithmetic), it waits again without drafting.
    Text with nothing to copy costs a lookup a step and little else. Above `max_batch` decoding sequences nobody
    drafts (vLLM's disable_by_batch_size): that batch is compute-bound. Not adaptive: every decoding sequence asks
    its proposer for num_speculative_tokens drafts every step."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_batch: int, vocab_size: int):
        self.config = config
        self.vocab_size = vocab_size
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.max_batch = max_batch
        self.costs = StepCosts()
        self.unmeasured = False  # this step's time says nothing of drafts' cost (a proposer's first call for one)
        self.counters = SpecCounters(config.method, accepted_per_position=[0] * self.k)

    @staticmethod
    def wants(seq: Sequence) -> bool:
        """Whether seq's request speculates: not a beam search or a prefill-only request, and not turned off."""
        req = seq.request
        return req.beam is None and not req.prefill_only and req.params.speculative is not False

    def observe(self, batch: int, drafts: int, seconds: float) -> None:
        """A step that only decoded `batch` sequences, with `drafts` drafts among them, took `seconds`."""
        if not self.unmeasured:
            self.costs.observe(batch, drafts, seconds)
        self.unmeasured = False

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
        if self.config.adaptive and not self.costs.measured(len(decoding)):
            return  # a plain step at this batch size first: what drafts are weighed against
        t0 = time.perf_counter()
        seqs, lengths = self._lengths(decoding, max_model_len)
        if seqs:
            self._draft(seqs, lengths)
        self.counters.propose_seconds += time.perf_counter() - t0

    def _lengths(self, decoding: list[Sequence], max_model_len: int) -> tuple[list[Sequence], list[int]]:
        """The sequences that get drafts this step, and how many each: as many as fit (or, adaptive, as pay)."""
        seqs, lengths = [], []
        batch, drafts = len(decoding), 0
        gained = float(batch)  # tokens the step is expected to give
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
            if not self.config.adaptive:
                k = room
            elif state.probe:  # (only where proposing is free) what pays where text is being copied
                k = self._length(PROBE_ACCEPTANCE, min(room, PROBE_DRAFTS), batch, drafts, gained)
                state.probe = False
            else:
                k = self._length(state.acceptance, room, batch, drafts, gained)
                if k:
                    state.failures = 0  # drafts pay at the sequence's own acceptance
            if k == 0 and room > 0:  # nothing pays now: wait, then probe once (text changes: copying starts)
                state.skip = min(1 << state.failures, BACKOFF_LIMIT)
                state.probe = getattr(self.proposer, "free", False)
                state.failures += 1
                continue
            if k > 0:
                seqs.append(seq)
                lengths.append(k)
                drafts += k
                gained += sum(state.acceptance ** i for i in range(1, k + 1))
        return seqs, lengths

    def _draft(self, seqs: list[Sequence], lengths: list[int]) -> None:
        """The proposer's drafts set on `seqs` (at most `lengths` each, cut at the first id outside the vocabulary);
        a proposer that fails costs its drafts, never a request."""
        # a proposer's first call for a sequence reads its prompt (a draft model computes it): a one-time cost
        self.unmeasured = any(seq.spec_state.proposals == 0 for seq in seqs)
        for seq in seqs:
            seq.spec_state.proposals += 1
        try:
            drafts_of = self.proposer.propose(seqs, lengths)
        except Exception:
            self.counters.proposer_errors += 1
            if self.counters.proposer_errors == 1:
                log.exception("the %s proposer failed; those sequences decode without drafts", self.proposer.name)
            drafts_of = [[] for _ in seqs]
        for seq, draft, k in zip(seqs, drafts_of, lengths):
            draft = list(draft[:k])
            bad = next((i for i, t in enumerate(draft) if not 0 <= t < self.vocab_size), None)
            seq.spec_tokens = draft if bad is None else draft[:bad]  # a proposer's id the model has not

    def _length(self, a: float, room: int, batch: int, drafts: int, gained: float) -> int:
        """The k in 0..room that makes the step give the most tokens a second, for a sequence whose drafts are
        accepted with chance a, in a step of `batch` decoding sequences carrying `drafts` drafts so far, expected
        to give `gained` tokens."""
        best, best_rate, expect = 0, gained / self.costs.estimate(batch, drafts), 0.0
        for k in range(1, room + 1):
            expect += a ** k
            rate = (gained + expect) / self.costs.estimate(batch, drafts + k)
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
        # each draft up to the first rejection is one trial of a: accepted successes, one failure unless all passed
        trials = accepted + (accepted < drafted)
        if trials:
            state.acceptance += (accepted / trials - state.acceptance) * min(1.0, 0.25 * trials)


class DraftProposer:
    """A draft model proposes greedily: an engine of its own (`core`, made by the target's EngineCore from
    draft_config: its own pool and prefix cache, no lower tiers) on the same device, driven on the caller's
    thread. Each call asks it, for every sequence at once, for k tokens after the sequence's tokens so far; its
    prefix cache holds each sequence's earlier full blocks (small ones, DRAFT_BLOCK_SIZE), so a call computes the
    tokens after the last of them, then k decode steps. Rejected drafts need no rollback there: the cache finds
    blocks by their tokens. A draft model that fails proposes nothing (logged once); the target's requests go
    on."""

    name = "draft"
    free = False  # each call runs the draft model: no drafts past what the estimate says pays

    def __init__(self, core, target_tokenizer, target_vocab: int, label: str):
        from tieredkv.engine.telemetry import Telemetry

        self.core = core
        core.parts.telemetry = core.parts.lifecycle.telemetry = Telemetry(silent=True)  # its requests are not ours
        check_same_vocabulary(target_tokenizer, target_vocab, core.tokenizer, core.spec.vocab_size, label)
        self.failed: BaseException | None = None

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        from tieredkv.config import SamplingParams

        if self.failed is not None:
            return [[] for _ in seqs]
        core, reqs = self.core, []
        try:
            for seq, k in zip(seqs, lengths):
                try:
                    req = core.factory.make(seq.token_ids, SamplingParams(max_tokens=k, ignore_eos=True))
                except RequestError:  # past the draft model's own limits (its context): no drafts for it
                    req = None
                reqs.append(req if req is not None and not core.add_request(req) else None)
            while core.has_work():
                core.step()
        except Exception as e:  # the draft engine is not the target's: its failure only ends the drafts
            log.exception("the draft model failed; speculative decoding goes on without drafts")
            self.failed = e
            for req in reqs:
                if req is not None:
                    core.abort(req.request_id)
            return [[] for _ in seqs]
        return [req.seqs[0].output_token_ids if req is not None and req.seqs else [] for req in reqs]

    def close(self) -> None:
        self.core.close()


def draft_config(config: "EngineConfig") -> "EngineConfig":
    """The draft model's engine: the target's settings with the draft's model and weights, its own small pool
    blocks and prefix cache, nothing below hot, one rank."""
    spec = config.speculative
    return config.model_copy(update={
        "model": spec.model, "quantization": spec.quantization, "speculative": None, "warm_bytes": 0,
        "cold_path": None, "remote_url": None, "num_blocks": None, "kv_cache_bytes": None,
        "enable_prefix_caching": True, "compile_in_background": False, "tensor_parallel_size": 1,
        "block_size": DRAFT_BLOCK_SIZE, "int8_activations": None,
        "share_cores": False})  # (the target's steps choose the threads its drafts run on)


def check_same_vocabulary(target, target_vocab: int, draft, draft_vocab: int, name: str) -> None:
    """A draft model must number tokens as the target does: the same vocabulary size and the same token strings."""
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft model {name!r} has a vocabulary of {draft_vocab} tokens, the target "
                         f"{target_vocab}: speculative decoding needs a draft model with the target's tokenizer")
    if draft.hf.get_vocab() != target.hf.get_vocab():
        raise ValueError(f"the draft model {name!r} numbers its tokens differently from the target: speculative "
                         "decoding needs a draft model with the target's tokenizer")


def make_speculator(config: "EngineConfig", device_type: str, vocab_size: int) -> Speculator:
    """The controller for an engine's config; for "draft" its proposer comes once the target is built
    (EngineCore: the draft model's engine is an engine like it)."""
    spec = config.speculative
    max_batch = spec.disable_by_batch_size or (32 if device_type == "cuda" else 8)
    proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == "ngram" else None
    return Speculator(spec, proposer, max_batch, vocab_size)
