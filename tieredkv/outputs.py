"""What the engine hands back: stream chunks, whole results, usage and stats."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tieredkv.tiers.base import TIER_NAMES, TierStats

if TYPE_CHECKING:
    from tieredkv.core.beam import Hypothesis
    from tieredkv.core.sequence import Request, Sequence


Output = tuple[Any, "StreamChunk | BaseException"]  # (a request's sink, a chunk or the request's error)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int  # the sum of cached_tokens_by_tier
    completion_tokens: int
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the top alternatives' (token id, log-probability)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class StreamChunk:
    """New output of one sample. `usage` is set on that sample's final chunk only; `logprobs` (one per
    token in `token_ids`) when the request asked for them."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort" on the final chunk
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # beam search: the beam's summed log-probability


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # beam search: the beam's summed log-probability


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    usage: Usage

    @property
    def text(self) -> str:
        """The first output's text (the only one unless n > 1)."""
        return self.outputs[0].text


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    blocks_total: int
    blocks_used: int  # held by a sequence or a pin; blocks_total - blocks_used are free (cached ones too)
    blocks_cached: int
    prefix_cache_queries: int  # prompt tokens looked up, at first admission
    prefix_cache_hits: int  # of which served from the cache
    num_preemptions: int
    cow_copies: int
    num_swaps: int = 0  # preemptions swapped to the warm tier (the rest are recomputed)
    num_swapped: int = 0  # waiting sequences whose blocks wait in warm swap slots now
    tiers: dict[str, TierStats] = field(default_factory=dict)  # per tier: capacity, use, hits, moves
    blocks_pinned: int = 0
    blocks_free: int = 0  # blocks_used + blocks_free == blocks_total in every snapshot
    blocks_far: int = 0  # blocks of running sequences kept in the warm tier now (block_pool.py)
    blocks_offloaded: int = 0  # hot blocks of running sequences moved to the warm tier so far
    prompt_tokens_computed: int = 0  # prompt tokens the forwards computed (after preemption too); the rest hit
    prefix_blocks_joined: int = 0  # prompt blocks found cached after waiting for the request computing them
    decode_path: str = "eager"  # what runs a one-sequence decode: "compiled", "compiling" (eager meanwhile), "eager"
    weights: str = "float32"  # the weights' format: the dtype, or the quantization ("int4 (float32 activations)")
    weight_bytes: int = 0  # what the weights take in that format


def make_chunk(seq: "Sequence", token_ids: list[int], final: bool,
               logprobs: list[TokenLogprob] | None = None) -> StreamChunk:
    """The sequence's new text and tokens; on its final chunk, its finish reason and usage."""
    req = seq.request
    usage = _usage(req, seq.num_output_tokens) if final else None
    if logprobs is None and req.params.logprobs is not None:
        logprobs = []
    return StreamChunk(req.request_id, seq.index, seq.detokenizer.take(final), token_ids,
                       seq.finish_reason if final else None, usage, logprobs)


def beam_chunk(req: "Request", rank: int, hyp: "Hypothesis") -> StreamChunk:
    """The whole of one returned beam, as the final chunk of output `rank` (0 is the best)."""
    return StreamChunk(req.request_id, rank, hyp.detokenizer.take(True), list(hyp.token_ids), hyp.finish_reason,
                       _usage(req, len(hyp.token_ids)), None, hyp.cum_logprob)


def _usage(req: "Request", completion_tokens: int) -> Usage:
    by_tier = {name: req.cached_tokens_by_tier.get(name, 0) for name in TIER_NAMES}
    return Usage(len(req.prompt_token_ids), req.num_cached_tokens or 0, completion_tokens, by_tier)


def collect_stats(pool, scheduler, kv, tiers: dict[str, TierStats], pinned: int,
                  decode_path: str = "eager", weights: str = "float32", weight_bytes: int = 0) -> EngineStats:
    """A snapshot of the engine's counters: every field read at one moment, tier stats copied."""
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        blocks_total=pool.num_blocks,
        blocks_used=pool.num_blocks - pool.num_free,
        blocks_free=pool.num_free,
        blocks_cached=len(pool.cached) - pool.num_cached_far,
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        cow_copies=kv.cow_copies,
        num_swaps=scheduler.num_swaps,
        num_swapped=sum(1 for s in scheduler.waiting if s.swapped is not None),
        tiers={name: replace(st) for name, st in tiers.items()},
        blocks_pinned=pinned,
        blocks_far=pool.num_far,
        blocks_offloaded=kv.offloaded_blocks,
        prompt_tokens_computed=scheduler.prompt_tokens_computed,
        prefix_blocks_joined=scheduler.prefix_blocks_joined,
        decode_path=decode_path,
        weights=weights,
        weight_bytes=weight_bytes,
    )
