"""Per-request state: a request owns one sequence per sample (n), which the scheduler runs."""

from __future__ import annotations

import enum
import functools
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tieredkv.config import SamplingParams
from tieredkv.hashing import BlockHash

if TYPE_CHECKING:
    from tieredkv.core.beam import BeamSearch
    from tieredkv.tiers.block_pool import KVBlock
    from tieredkv.models.detokenizer import IncrementalDetokenizer
    from tieredkv.tiers.lookup import Lookup
    from tieredkv.tiers.moves import Restore


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


def step_tokens(token_ids: list[int], spec_tokens: list[int], start: int, n: int) -> list[int]:
    """The n tokens a step computes from position `start` on: the sequence's own, then its drafts."""
    own = token_ids[start : start + n]
    return own + spec_tokens[: n - len(own)] if len(own) < n else own


class Sequence:
    """One stream of tokens: the prompt plus what this sample has generated.

    Invariants: `num_computed_tokens <= len(token_ids)`; `block_table` covers at least the computed
    tokens; `block_hashes[i]` is the chained hash of full block i of `token_ids` (computed lazily).
    """

    def __init__(self, request: "Request", index: int, token_ids: list[int], generator: torch.Generator | None):
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[KVBlock] = []
        self.block_hashes: list[BlockHash] = []
        self.num_cached_blocks = 0  # leading blocks of block_table already registered in the hash map
        self.status = SeqStatus.WAITING
        self.generator = generator
        self.detokenizer: IncrementalDetokenizer | None = None
        self.finish_reason: str | None = None
        # structured output: the grammar's state over this sequence's output (engine/grammar.py)
        self.matcher: Any = None
        self.digits: Any = None  # a JSON schema's output: the run of digits it ends in (engine/grammar.py DigitRun)
        self.admit_order = 0
        self.lookup: Lookup | None = None  # a walk of the lower tiers in progress while waiting
        self.swapped: Restore | None = None  # where a preempted sequence's blocks wait in warm
        self.passed_over = 0  # later arrivals admitted before it while it waited
        self.joined_from: int | None = None  # cached prefix blocks when it began waiting for a sharer's blocks
        self.last_token_time: float | None = None
        self.beam_logprob = 0.0  # beam search: summed log-probability of the output so far
        self.beam_row: torch.Tensor | None = None  # beam search: next-token log-probabilities, until the step
        self.spec_tokens: list[int] = []  # drafts to verify this step after the last token (engine/speculative.py)
        self.spec_state: Any = None  # the speculator's state for this sequence (its proposer's, its draft length)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def step_token_ids(self, n: int) -> list[int]:
        return step_tokens(self.token_ids, self.spec_tokens, self.num_computed_tokens, n)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def parked(self) -> bool:
        """A beam whose next token waits for its siblings' rows (a beam search steps all its beams at once)."""
        return self.request.beam is not None and self.num_computed_tokens == self.num_tokens

    def append(self, token: int, max_model_len: int) -> str | None:
        """Adds a sampled token; returns why the sequence ends now ("stop" or "length"), or None."""
        self.token_ids.append(token)
        params = self.request.params
        if token in self.request.stop_ids:
            return "stop"
        if self.detokenizer.add(token, check_stop=self.num_output_tokens >= params.min_tokens):
            return "stop"
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request.request_id}, idx={self.index}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )


@dataclass
class Request:
    """What a caller asked for. Until its prompt is computed it has one sequence; then `n` (forks)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache at first admission
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    cache_decision: str | None = None  # load or recompute below hot, in words (tiers/lookup.describe)
    prefill_only: bool = False  # compute and cache the prompt, generate nothing
    keep: list[tuple[int, float | None]] | None = None  # prefixes (tokens, time to live or None) to pin once the
    # prompt is computed (pin(), cache_control); a prefill-only request fails when they cannot be pinned
    mark_prompt: bool = False  # a client's hint (prompt_cache_key): its prompt blocks are admitted below warm
    sink: Any = None  # where the async front delivers this request's chunks (opaque to the core)
    span: Any = None  # the request's trace span, when the async front made one
    arrival_time: float | None = None  # perf_counter at add; then first admission, first token
    admitted_time: float | None = None
    first_token_time: float | None = None
    beam: "BeamSearch | None" = None  # with beam_width > 1: the search; seqs are then its running beams
    spec_drafted: int = 0  # speculative decoding: drafts verified for this request's samples
    spec_accepted: int = 0  # of which accepted
    adapter_name: str | None = None  # the LoRA adapter asked for (None: the base model)
    cache_salt: str | None = None  # blocks are shared only among requests with the same salt (and adapter)
    adapter: Any = None  # models/lora.LoRAAdapter: the LoRA adapter its rows take, None for the base model
    root: BlockHash | None = None  # its block-hash chain's seed, when not the engine's (an adapter, a cache salt)

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a sample: stop_token_ids, and EOS unless ignore_eos."""
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        return frozenset(self.params.stop_token_ids) | eos

    @property
    def pending_forks(self) -> int:
        """Sequences still to start beside the first: the other samples, or the other beams."""
        if self.beam is not None:
            return 0 if self.beam.started else self.params.beam_width - 1
        return self.params.n - len(self.seqs)

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return self.pending_forks == 0 and all(s.is_finished for s in self.seqs)

    def make_generator(self, index: int, device: torch.device) -> torch.Generator | None:
        """Sample i draws from its own generator seeded seed + i, so batching never changes its draws."""
        if self.params.greedy:
            return None
        gen = torch.Generator(device="cpu")
        if self.params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.params.seed + index)
        return gen
