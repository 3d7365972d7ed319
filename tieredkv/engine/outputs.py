"""What the engine hands back: stream chunks, whole results, usage and stats."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tieredkv.config import EngineConfig
from tieredkv.tiers.base import TIER_NAMES, TierStats

if TYPE_CHECKING:
    from tieredkv.core.beam import Hypothesis
    from tieredkv.engine.speculative import SpecCounters
    from tieredkv.core.sequence import Request, Sequence


Output = tuple[Any, "StreamChunk | BaseException"]  # (a request's sink, a chunk or the request's error)


@dataclass(frozen=True)
class Usage:
    """Token counts of one sample, on its final chunk and in `RequestOutput.usage`.

    Attributes:
        prompt_tokens: tokens of the prompt (after the chat template).
        cached_prompt_tokens: of which served from the cache instead of computed.
        completion_tokens: tokens generated.
        cached_tokens_by_tier: `cached_prompt_tokens` by the tier they came from: "hot", "warm", "remote",
            "cold".
        draft_tokens: speculative decoding: tokens proposed for the request's samples and verified.
        accepted_draft_tokens: of which accepted (each is an output token that took no forward of its own).
        cache_decision: where a blocking tier (cold, remote) held or might hold prompt blocks, whether they were
            read or computed and the estimates that decided it ("recomputed up to 2,048 tokens: cold read 1.9 s >
            prefill 0.8 s"); None when none was weighed.
    """

    prompt_tokens: int
    cached_prompt_tokens: int  # the sum of cached_tokens_by_tier
    completion_tokens: int
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    cache_decision: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the top alternatives', from the model's raw distribution.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability.
        top: the `SamplingParams.logprobs` most likely tokens as (token id, log-probability), most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class StreamChunk:
    """New output of one sample of a request, as `AsyncEngine.stream` yields it.

    Attributes:
        request_id: the request's id (`stream(..., request_id=...)` or one made up).
        index: which of the request's `n` samples (or, for beam search, which returned beam, 0 the best).
        text: the text that is new since the sample's previous chunk (never a stop string, never half a
            character).
        token_ids: the tokens that are new since the previous chunk.
        finish_reason: None until the sample's final chunk; then "stop", "length" or "abort".
        usage: on the final chunk only: the request's token counts.
        logprobs: one `TokenLogprob` per token in `token_ids`, when the request asked for them.
        cumulative_logprob: beam search: the beam's summed log-probability.
    """

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
    """One sample's whole output, in `RequestOutput.outputs`.

    Attributes:
        index: which of the request's samples (for beam search: the rank, 0 the best beam).
        text: the output's text, stop strings excluded.
        token_ids: the output's tokens.
        finish_reason: "stop", "length" or "abort".
        logprobs: one `TokenLogprob` per output token, when the request asked for them.
        cumulative_logprob: beam search: the beam's summed log-probability.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # beam search: the beam's summed log-probability


@dataclass
class RequestOutput:
    """What `AsyncEngine.generate` returns: every sample of one request, whole.

    Attributes:
        request_id: the request's id.
        outputs: one `CompletionOutput` per sample (`n`), or the `n` best beams, best first.
        usage: the request's token counts.
    """

    request_id: str
    outputs: list[CompletionOutput]
    usage: Usage

    @property
    def text(self) -> str:
        """The first output's text (the only one unless n > 1)."""
        return self.outputs[0].text


@dataclass(frozen=True)
class EngineInfo:
    """What stays fixed while an engine runs (`AsyncEngine.info`), in the application's process whichever process
    runs the core."""

    model_dir: str  # the checkpoint's folder, as resolved (the default model's converted copy, a hub snapshot)
    device: str
    dtype: str  # the weights' and compute dtype
    num_blocks: int  # the hot pool's KV blocks
    block_size: int
    max_model_len: int
    vocab_size: int
    config: EngineConfig  # as the engine was started
    kv_root: str  # the block-hash chain's seed (hex): engines with the same one can share cached blocks
    shared_tier: bool  # whether a remote tier (remote_url) is shared with other engines


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state, published after every step (`AsyncEngine.stats()`).

    Attributes:
        num_running: sequences running (decoding or prefilling).
        num_waiting: sequences waiting to start or to resume.
        blocks_total: blocks in the hot pool.
        blocks_used: blocks held by a sequence or a pin; the others are free (cached ones included).
        blocks_cached: hot blocks that hold a cached prefix block (free or in use).
        prefix_cache_queries: prompt tokens looked up in the cache, at first admission.
        prefix_cache_hits: of which served from the cache.
        num_preemptions: sequences preempted so far (swapped or to be recomputed).
        cow_copies: partial blocks copied on write so far (shared by `n > 1` samples or beams).
        num_swaps: preemptions swapped to the warm tier (the rest are recomputed).
        num_swapped: waiting sequences whose blocks wait in warm swap slots now.
        tiers: per tier present ("hot", "warm", "remote", "cold"): capacity, use, hits, misses and moves
            (`TierStats`).
        blocks_pinned: hot blocks held by `pin()`.
        blocks_free: `blocks_total - blocks_used`.
        blocks_far: blocks of running sequences kept in the warm tier now (long documents).
        blocks_offloaded: hot blocks of running sequences moved to the warm tier so far.
        prompt_tokens_computed: prompt tokens the forwards computed (after preemption too); the rest hit.
        prefix_blocks_joined: prompt blocks found cached after waiting for the request computing them.
        decode_path: what runs a one-sequence decode: "native" (quantized weights on CPU: one C call),
            "compiled", "compiling" (eager meanwhile) or "eager".
        weights: the weights' format: the dtype, or the quantization ("int4 (float32 activations)").
        weight_bytes: what the weights take in that format (over every rank under tensor parallelism).
        dense_formats: each kind of dense layer (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head) -> the format
            its products read: "float32 packed" (oneDNN's layout), "q4 g32 (gguf:Q4_1)", ...
        dense_arithmetic: each kind of dense layer -> what its products multiply on, on this processor: "float32",
            "int16 rows x q4 to 16 rows, int8 blocks x q4 (AVX2) above", ...
        kv_format: how the cache stores K and V in every tier ("float32", "int8", "k=int8,v=int4"; kv_cache_dtype).
        kv_bytes_per_token: one token's K and V over every layer in that format (scales included).
        speculative: speculative decoding's counters (`SpecCounters`: drafts, draft tokens, accepted tokens,
            acceptance rate, accepted by position), or None without EngineConfig.speculative.
        sleep_level: 0 awake; 1 asleep with the hot pool's memory given back; 2 the weights' too (`sleep()`).
        kernel_calls: "kind: implementation" -> how many calls it served so far, as each was chosen: "forward:
            eager" / "compiled graph" / "native step" per forward; "decode attention: CPU kernel" / "torch
            reference" / "cascade" / "Triton" / ... and "prefill attention: ..." per layer and forward (a call
            that attends some rows as cascades and the others alone counts for both); "quantized product: int16
            rows" / "int8 blocks" / "dequantized float32" / "Triton" per product. Inside a compiled graph or the
            native step nothing more is counted: its forwards are (kernels/calls.py).
    """

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
    decode_path: str = "eager"  # a one-sequence decode: "native", "compiled", "compiling" (eager meanwhile), "eager"
    weights: str = "float32"  # the weights' format: the dtype, or the quantization ("int4 (float32 activations)")
    weight_bytes: int = 0  # what the weights take in that format
    dense_formats: dict[str, str] = field(default_factory=dict)  # layer kind -> the format its products read
    dense_arithmetic: dict[str, str] = field(default_factory=dict)  # layer kind -> what its products multiply on
    kv_format: str = "float32"  # how the cache stores K and V, in every tier
    kv_bytes_per_token: int = 0  # one token's K and V over every layer, in that format
    speculative: "SpecCounters | None" = None  # speculative decoding's counters, when it is configured
    sleep_level: int = 0  # 0 awake; 1 the hot pool's memory given back; 2 the weights' too
    kernel_calls: dict[str, int] = field(default_factory=dict)  # "kind: implementation" -> calls it served


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
    return Usage(len(req.prompt_token_ids), req.num_cached_tokens or 0, completion_tokens, by_tier,
                 req.spec_drafted, req.spec_accepted, req.cache_decision)


def collect_stats(pool, scheduler, kv, tiers: dict[str, TierStats], pinned: int,
                  decode_path: str = "eager", weights: str = "float32", weight_bytes: int = 0,
                  dense_formats: dict[str, str] | None = None, kv_format: str = "float32",
                  kv_bytes_per_token: int = 0, speculative: "SpecCounters | None" = None,
                  sleep_level: int = 0, dense_arithmetic: dict[str, str] | None = None,
                  kernel_calls: dict[str, int] | None = None) -> EngineStats:
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
        blocks_offloaded=scheduler.room.offloaded_blocks,
        prompt_tokens_computed=scheduler.prompt_tokens_computed,
        prefix_blocks_joined=scheduler.prefix_blocks_joined,
        decode_path=decode_path,
        weights=weights,
        weight_bytes=weight_bytes,
        dense_formats=dict(dense_formats or {}),
        dense_arithmetic=dict(dense_arithmetic or {}),
        kv_format=kv_format,
        kv_bytes_per_token=kv_bytes_per_token,
        speculative=None if speculative is None else replace(
            speculative, accepted_per_position=list(speculative.accepted_per_position)),
        sleep_level=sleep_level,
        kernel_calls=dict(kernel_calls or {}),
    )
