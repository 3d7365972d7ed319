"""What the engine hands back: stream chunks, whole results, usage and stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from tieredkv.tiers.base import TIER_NAMES, TierStats


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int  # the sum of cached_tokens_by_tier
    completion_tokens: int
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))


@dataclass(frozen=True)
class StreamChunk:
    """New output of one sample. `usage` is set on that sample's final chunk only."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort" on the final chunk
    usage: Usage | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    usage: Usage

    @property
    def text(self) -> str:
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
    tiers: dict[str, TierStats] = field(default_factory=dict)  # per tier: capacity, use, hits, moves
    blocks_pinned: int = 0
    blocks_free: int = 0  # blocks_used + blocks_free == blocks_total in every snapshot
