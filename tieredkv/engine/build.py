"""Builds an engine's whole object graph from its config and checkpoint (`build_engine`), and the set-up
facts it derives on the way: device, dtype, sizes, fingerprint, tiers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from tieredkv.config import EngineConfig
from tieredkv.core.cache_index import CacheIndex
from tieredkv.core.far_blocks import Room, far_policy
from tieredkv.core.kv_manager import KVCacheManager
from tieredkv.core.pins import PinTable
from tieredkv.core.scheduler import Scheduler
from tieredkv.engine.identity import identity_in_background, model_fingerprint
from tieredkv.engine.kv_events import make_recorder
from tieredkv.engine.lifecycle import Lifecycle
from tieredkv.engine.rank_build import (RankMemory, bind_kernels, data_plane, load_share, make_kv_cache,
                                        prepare_process, shift_keys, total_weight_bytes, weights_label)
from tieredkv.engine.request_factory import RequestFactory
from tieredkv.engine.resolve import (eos_token_ids, max_model_len, quant_settings, resolve_cache_dir,
                                     resolve_kv_layout, resolve_model_dir)
from tieredkv.engine.shared_weights import SharedWeights
from tieredkv.engine.sizing import far_extent, kv_block_bytes, num_kv_blocks, warm_blocks
from tieredkv.engine.speculative import Speculator, make_speculator
from tieredkv.engine.telemetry import Telemetry
from tieredkv.hashing import root_hash
from tieredkv.kernels import KernelOps
from tieredkv.kernels.kv_format import KVLayout
from tieredkv.kernels.quant import int16_rows_most
from tieredkv.models.llama import LlamaModel
from tieredkv.models.loader import QuantSettings
from tieredkv.models.spec import ModelSpec
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.models.tp_group import TPGroup
from tieredkv.models.tp_shard import check_shardable
from tieredkv.platform.process import Hold
from tieredkv.runner.compiled_decode import CompiledDecode, compile_wanted
from tieredkv.runner.key_shift import calibration_ids, shift_key
from tieredkv.runner.model_runner import ModelRunner
from tieredkv.runner.native_decode import NativeDecode
from tieredkv.tiers.base import KVTier
from tieredkv.tiers.block_pool import BlockPool
from tieredkv.tiers.hot import HotTier
from tieredkv.tiers.manager import TierManager
from tieredkv.tiers.policy import Admission, Popularity

log = logging.getLogger("tieredkv")


def build_cache_core(cfg: EngineConfig, spec: ModelSpec, num_blocks: int, kv_cache: torch.Tensor, ops: KernelOps,
                     fingerprint: str, num_warm_blocks: int, far: type[Room], tp: TPGroup | None = None,
                     cold: KVTier | None = None) -> tuple[TierManager, KVCacheManager, CacheIndex, Scheduler]:
    """What the engine keeps below its model, over a KV cache tensor: the tiers (build_tiers), the KV manager, the
    cache index and the scheduler, with the far-block policy `far` (core/far_blocks.py: far_policy). tests/cache
    build theirs here too, with no model."""
    tiers = build_tiers(cfg, spec, num_blocks, kv_cache, ops, fingerprint, num_warm_blocks, far, tp=tp, cold=cold)
    kv = KVCacheManager(tiers.hot.pool, cfg.block_size, cfg.enable_prefix_caching, root_hash(fingerprint),
                        tiers.swap)
    index = CacheIndex(tiers.hot.pool, tiers, root_hash(fingerprint), cfg.block_size)
    scheduler = Scheduler(kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, tiers, index,
                          room=far(kv), policy=cfg.scheduling_policy)
    return tiers, kv, index, scheduler


def build_tiers(cfg: EngineConfig, spec: ModelSpec, num_blocks: int, kv_cache: torch.Tensor, ops: KernelOps,
                fingerprint: str, num_warm_blocks: int, far: type[Room] = Room, tp: TPGroup | None = None,
                cold: KVTier | None = None) -> TierManager:
    """The block pool (lending warm slots as far blocks where the far-block policy `far` says) and hot over it; warm
    when its budget holds a block (the tail of kv_cache when that has room beyond the pool); cold (LMDB,
    imported only then) with a path, or the caller's own tier in its place (`cold`: any KVTier); remote
    (Valkey/Redis, imported only then) with a URL."""
    block_shape = (spec.num_layers, 2, cfg.block_size, spec.num_kv_heads, kv_cache.shape[-1])  # rows as stored
    warm, io = data_plane(kv_cache, ops, num_blocks, num_warm_blocks, spec, tp)  # as every rank builds its own
    read = cfg.eviction_policy == "lfu" or cfg.admit_min_uses > 1 or not cfg.admit_output_blocks
    popularity = Popularity(16 * (num_blocks + num_warm_blocks), active=read)  # counted only where read
    pool = BlockPool(num_blocks, far.lender(warm), cfg.eviction_policy, popularity)
    if warm is not None:
        warm.set_eviction(cfg.eviction_policy, popularity)
    hot = HotTier(pool, kv_cache, ops, io)
    if cfg.cold_path is not None and cold is not None:
        raise ValueError("a cold tier of the caller's own and cold_path: one of them")
    if cfg.cold_path is not None:
        from tieredkv.tiers.cold import ColdTier

        cold = ColdTier(cfg.cold_path, cfg.cold_bytes, fingerprint, block_shape, kv_cache.dtype, cfg.cold_secret_path)
    remote = None
    if cfg.remote_url is not None:
        from tieredkv.tiers.remote import RemoteTier

        remote = RemoteTier(cfg.remote_url, fingerprint, block_shape, kv_cache.dtype, cfg.cold_secret_path,
                            cfg.remote_timeout_s, cfg.remote_retry_s, cfg.remote_ttl_s)
        hot.pool.new_cached = []  # new full blocks are written to the remote tier as they are computed
    return TierManager(hot, warm, cold, cfg.block_size, remote,
                       Admission(popularity, cfg.admit_min_uses, cfg.admit_output_blocks))


@dataclass
class EngineParts:
    """Everything an EngineCore owns, built once; nothing is set on any of them afterwards."""

    device: torch.device
    dtype: torch.dtype
    model_dir: Path
    spec: ModelSpec
    max_model_len: int
    tokenizer: Tokenizer
    model: LlamaModel
    num_blocks: int
    kv_cache: torch.Tensor
    fingerprint: str
    factory: RequestFactory
    tiers: TierManager
    kv: KVCacheManager
    index: CacheIndex
    scheduler: Scheduler
    runner: ModelRunner
    pins: PinTable
    telemetry: Telemetry
    lifecycle: Lifecycle
    weights: str = "float32"  # weights_label()
    tp: TPGroup = field(default_factory=TPGroup)  # rank 0's group under tensor parallelism (engine/ranks.py)
    memory: "RankMemory | list[RankMemory] | None" = None  # what loading the weights took, per rank under TP
    process: Hold | None = None  # the process settings it holds (platform/process.py), released at close
    kv_format: KVLayout | None = None  # how the cache stores K and V (kernels/kv_format.py)
    speculator: Speculator | None = None  # speculative decoding (engine/speculative.py), when configured

    @property
    def pool(self) -> BlockPool:
        return self.tiers.hot.pool


def build_engine(cfg: EngineConfig, shared: SharedWeights | None = None) -> EngineParts:
    """Loads the model and builds the cache, tiers, scheduler, runner and request lifecycle around it;
    compiles what the first request would otherwise wait for. With tensor_parallel_size N > 1, first starts
    ranks 1..N-1 (engine/ranks.py), which load their shares while this process loads its own. With `shared`,
    the model is taken from it where an earlier engine loaded it in the same form (engine/shared_weights.py)."""
    device, dtype, held = prepare_process(cfg)
    tp = None
    try:
        cache_dir = resolve_cache_dir(cfg)
        model_dir = resolve_model_dir(cfg.model, cache_dir)
        spec = ModelSpec.from_file(model_dir / "config.json")
        limit = max_model_len(spec, cfg.max_model_len)
        tokenizer = Tokenizer(model_dir)
        tp = _start_ranks(cfg, spec, model_dir, device)
        return replace(_build(cfg, device, dtype, cache_dir, model_dir, spec, limit, tokenizer, tp, shared),
                       process=held)
    except BaseException:
        if tp is not None:
            tp.abort()
        if held is not None:
            held.release()
        raise


def _start_ranks(cfg: EngineConfig, spec: ModelSpec, model_dir: Path, device: torch.device) -> TPGroup:
    if cfg.tensor_parallel_size == 1:
        return TPGroup()
    from tieredkv.engine.ranks import start_ranks

    check_shardable(spec, cfg.tensor_parallel_size)
    return start_ranks(cfg, model_dir, device)


def _build(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, cache_dir: Path, model_dir: Path,
           spec: ModelSpec, limit: int, tokenizer: Tokenizer, tp: TPGroup,
           shared: SharedWeights | None = None) -> EngineParts:
    quant = quant_settings(cfg, model_dir)
    identity = identity_in_background(model_dir, quant, cache_dir)  # hashed while the weights load
    compiled = compile_wanted(cfg.compile_decode, device) and tp.world == 1
    kv_format = resolve_kv_layout(cfg, spec, dtype, device)
    model, ops, memory = _weights(cfg, device, dtype, model_dir, spec, tokenizer, tp, (compiled, kv_format, quant),
                                  lambda: identity.result(), shared)
    leader = tp if tp.world > 1 else None
    num_warm = warm_blocks(cfg, spec, kv_format)
    far = far_policy(cfg.offload, device.type, num_warm)
    # on CPU every rank's share is in the one machine's memory: the budget counts whole blocks
    num_blocks = num_kv_blocks(cfg, spec if device.type == "cpu" else tp.shard.local_spec(spec), kv_format, device,
                               limit, far.staged_layers(spec.num_layers))
    extent = far.tail(far_extent(cfg, spec, kv_format))
    if leader is not None:
        leader.broadcast((num_blocks, extent, num_warm, far.mode))
    kv_cache = make_kv_cache(tp.shard.local_spec(spec), cfg.block_size, num_blocks, extent, kv_format, device)
    factory = RequestFactory(tokenizer, spec, cfg, limit, eos_token_ids(spec, model_dir, tokenizer.eos_token_id),
                             num_blocks, num_warm, far)
    fingerprint = model_fingerprint(model_dir, dtype, cfg.block_size, quant, identity=identity.result(),
                                    kv=kv_format)
    tiers, kv, index, scheduler = build_cache_core(cfg, spec, num_blocks, kv_cache, ops, fingerprint, num_warm, far,
                                                   tp=tp)
    runner = ModelRunner(model, kv_cache, cfg.block_size, ops, cfg.cascade_attention,
                         _decode_path(model, kv_cache, ops, cache_dir, cfg.native_decode) if compiled else None,
                         far=far.stage_from(num_blocks, tiers.warm), leader=leader)
    tp.drive(tiers.io)
    if leader is not None:
        leader.gather_objects(None)  # every rank has its cache and runner
    runner.compile_now(background=cfg.compile_in_background)
    pinned = int(num_blocks * cfg.max_pinned_fraction)
    pins, telemetry = PinTable(index, pinned, int(pinned * cfg.max_pinned_per_client)), Telemetry()
    speculator = _speculator(cfg, device, spec, model, runner, scheduler)
    lifecycle = Lifecycle(scheduler, kv, factory, tokenizer, pins, telemetry, device, limit, speculator)
    weights = weights_label(model, dtype)
    parts = EngineParts(device, dtype, model_dir, spec, limit, tokenizer, model, num_blocks, kv_cache, fingerprint,
                        factory, tiers, kv, index, scheduler, runner, pins, telemetry, lifecycle, weights, tp, memory,
                        kv_format=kv_format, speculator=speculator)
    events = make_recorder(cfg.kv_events_config, cfg.block_size)  # last: it binds a socket
    parts.tiers.hot.pool.events = events
    for tier in parts.tiers.lower:
        if tier.medium is not None:  # warm and cold; the shared remote tier is no replica's own
            tier.events = events
    _log_ready(cfg, parts, num_warm)
    return parts


def _speculator(cfg: EngineConfig, device: torch.device, spec: ModelSpec, model: LlamaModel, runner: ModelRunner,
                scheduler: Scheduler) -> Speculator | None:
    """The drafts' proposer where cfg.speculative asks for one; on quantized CPU weights a step's draft rows stay
    below where int8 blocks start, and where the native step serves within its rows, so that verifying is plain
    decoding."""
    speculator = make_speculator(cfg, device.type, spec.vocab_size) if cfg.speculative is not None else None
    if speculator is not None and device.type == "cpu" and model.quantization is not None:
        scheduler.max_draft_rows = int16_rows_most(model)  # below where int8 blocks start
    if speculator is not None and isinstance(runner.compiled, NativeDecode):  # as plain decodes of a batch are
        rows = runner.compiled.max_batch
        scheduler.max_draft_rows = rows if scheduler.max_draft_rows is None else min(scheduler.max_draft_rows, rows)
    return speculator


def _weights(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, model_dir: Path, spec: ModelSpec,
             tokenizer: Tokenizer, tp: TPGroup, form: tuple[bool, KVLayout, QuantSettings | None],
             identity: Callable[[], str],
             shared: SharedWeights | None) -> tuple[LlamaModel, KernelOps, "RankMemory | list[RankMemory]"]:
    """This rank's share of the weights as the engine reads them (loaded, held in the kernels' layout, 4-bit keys'
    shifts set) and the kernel set: loaded here, or with `shared` taken from it where an earlier engine of this
    process loaded them in the same form (engine/shared_weights.py). `form`: (compiled decode, the KV formats, the
    quantization settings); `identity`: the checkpoint's identity hash (engine/identity.py), asked only where keys
    are shifted."""
    compiled, kv_format, quant = form

    def load() -> tuple[LlamaModel, KernelOps, "RankMemory | list[RankMemory]"]:
        model, ops, memory = load_share(cfg, model_dir, device, tp, compiled)
        fmt = quant.fingerprint if quant else None
        shift_keys(cfg, model, device, tp, lambda: (shift_key(identity(), fmt, dtype, device),
                                                    calibration_ids(tokenizer.encode, spec.vocab_size)))
        return model, ops, memory

    if shared is None:
        return load()
    ops = bind_kernels(cfg, device, compiled, kv_format)  # first: the CPU kernels' build is part of the key
    key = SharedWeights.key(cfg, model_dir, device, dtype, quant, kv_format, compiled, resolve_cache_dir(cfg))
    model, memory = shared.take(key, load)
    return model, ops, memory


def _log_ready(cfg: EngineConfig, parts: EngineParts, num_warm: int) -> None:
    """The start-up line: model, weights, device, pool and tiers, kernels, decode path, ranks."""
    block_bytes, tp, memory, ops = kv_block_bytes(parts.spec, cfg.block_size, parts.kv_format), parts.tp, \
        parts.memory, parts.runner.ops
    rank_gib = " / ".join(f"{m.weight_bytes / 2**30:.2f}" for m in memory) if isinstance(memory, list) else ""
    log.info("engine ready: %s, weights %s (%.2f GiB) on %s, %d KV blocks of %d tokens in %s (%d bytes a token; "
             "hot %.2f GiB, warm %.2f GiB%s), kernels=%s, dense layers=%s (%s), decode path=%s%s%s",
             parts.model_dir.name, parts.weights, total_weight_bytes(parts.model, memory) / 2**30, parts.device,
             parts.num_blocks, cfg.block_size, parts.kv_format.label, block_bytes // cfg.block_size,
             parts.num_blocks * block_bytes / 2**30, num_warm * block_bytes / 2**30,
             "; taken as written" if parts.device.type == "cpu" else "", ops.name,
             " / ".join(dict.fromkeys(parts.model.dense_formats().values())),
             " / ".join(dict.fromkeys(parts.model.dense_arithmetic().values())), parts.runner.decode_path,
             f", tensor parallel over {tp.world} ranks ({rank_gib} GiB of the weights each)" if tp.world > 1 else "",
             _speculative_label(cfg))


def _speculative_label(cfg: EngineConfig) -> str:
    spec = cfg.speculative
    if spec is None:
        return ""
    what = spec.method if spec.method == "ngram" else f"draft model {spec.model} ({spec.quantization or 'dtype'})"
    return f", speculative decoding: {what}, up to {spec.num_speculative_tokens} drafts"


def _decode_path(model: LlamaModel, kv_cache: torch.Tensor, ops: KernelOps, cache_dir: Path,
                 native: bool = True) -> CompiledDecode | NativeDecode:
    """What serves a step that decodes one sequence: with `native` (EngineConfig.native_decode), the native
    step where it takes the model (quantized weights on CPU: runner/native_decode.py), else the compiled graph."""
    return ((native and NativeDecode.make(model, kv_cache, ops.kv, cache_dir))
            or CompiledDecode(model, kv_cache, ops, cache_dir / "inductor"))
