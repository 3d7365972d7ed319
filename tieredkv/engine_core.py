"""The synchronous engine: requests in, one `step()` at a time, stream chunks out. Not thread-safe:
the async engine calls it from one thread at a time."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path

import torch

from tieredkv.block_pool import BlockPool
from tieredkv.config import EngineConfig, SamplingParams
from tieredkv.detokenizer import IncrementalDetokenizer
from tieredkv.hashing import root_hash
from tieredkv.kernels import select_kernels
from tieredkv.kv_manager import KVCacheManager, cdiv
from tieredkv.malloc_tuning import tune_glibc_malloc
from tieredkv.model_runner import ModelRunner
from tieredkv.models.gguf_convert import default_model_dir
from tieredkv.models.loader import fingerprint_weights, load_model, weight_files
from tieredkv.models.spec import ModelSpec
from tieredkv.outputs import EngineStats, StreamChunk, Usage
from tieredkv.sampler import sample
from tieredkv.scheduler import Scheduler
from tieredkv.sequence import Request, Sequence
from tieredkv.telemetry import Telemetry
from tieredkv.tiers.base import TIER_NAMES
from tieredkv.tiers.cold import ColdTier
from tieredkv.tiers.hot import HotTier
from tieredkv.tiers.manager import TierManager
from tieredkv.tiers.warm import WarmTier
from tieredkv.tokenizer import PromptType, Tokenizer

log = logging.getLogger("tieredkv")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_LAYOUT = "L2NBHD"  # kv_cache[layer, k|v, block, slot, kv_head, dim]


class RequestError(ValueError):
    """A request was rejected before anything was allocated for it."""


class StepError(RuntimeError):
    """A forward pass failed; the requests in it were aborted and their blocks freed."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def default_warm_bytes() -> int:
    """10% of the memory available now, at most 4 GiB."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8 << 30
    return min(available // 10, 4 << 30)


def resolve_model_dir(model: str) -> Path:
    if model == "default":
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r} is neither \"default\" nor a local checkpoint directory")
    return path


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.cpu_malloc_tuning:
            tune_glibc_malloc()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = resolve_model_dir(config.model)
        self.spec = ModelSpec.from_file(self.model_dir / "config.json")
        self.max_model_len = self._max_model_len()
        self.tokenizer = Tokenizer(self.model_dir)
        self.eos_token_ids = self._eos_token_ids()
        self.model = load_model(self.model_dir, self.spec, self.dtype, self.device, self.max_model_len)
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks()
        spec = self.spec
        shape = (spec.num_layers, 2, self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.fingerprint = self._fingerprint()
        self.pool = BlockPool(self.num_blocks)
        self.kv = KVCacheManager(self.pool, self.block_size, config.enable_prefix_caching, root_hash(self.fingerprint))
        ops = select_kernels(config.attention_backend, self.device, self.dtype)
        if ops.pack_linear_weight is not None:
            self.model.pack_linear_weights(ops.pack_linear_weight)
        self.tiers = self._build_tiers(ops)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.tiers)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_size, ops)
        self.pins: dict[tuple[int, ...], list] = {}
        self.requests: dict[str, Request] = {}
        self.telemetry = Telemetry()
        log.info("engine ready: %s, %s on %s, %d KV blocks of %d tokens, kernels=%s, linear=%s%s",
                 self.model_dir.name, self.dtype, self.device, self.num_blocks, self.block_size, ops.name,
                 ops.linear.__name__, "" if ops.pack_linear_weight is None else " (packed weights)")

    # -- set-up ----------------------------------------------------------------------------------

    def _max_model_len(self) -> int:
        limit = self.spec.max_position_embeddings
        if self.spec.sliding_window is not None:
            limit = min(limit, self.spec.sliding_window)
        wanted = self.config.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds what the model supports ({limit})")
        return wanted or limit

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.spec.eos_token_ids)
        gen = self.model_dir / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        block_bytes = self.spec.kv_elements_per_token * self.block_size * self.dtype.itemsize
        budget = cfg.kv_cache_bytes
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - cfg.gpu_memory_utilization))
        elif budget is None:
            budget = cfg.cpu_kv_cache_bytes
        num = budget // block_bytes
        if num < 2:
            raise ValueError(f"the KV cache budget ({budget} bytes) holds fewer than 2 blocks of {block_bytes} bytes")
        return num

    def _build_tiers(self, ops) -> TierManager:
        cfg, spec = self.config, self.spec
        block_shape = (spec.num_layers, 2, self.block_size, spec.num_kv_heads, spec.head_dim)
        hot = HotTier(self.pool, self.kv_cache, ops)
        warm_bytes = default_warm_bytes() if cfg.warm_bytes is None else cfg.warm_bytes
        warm_blocks = warm_bytes // hot.block_bytes
        warm = None
        if warm_blocks > 0:
            warm = WarmTier(warm_blocks, block_shape, self.dtype, pin=self.device.type == "cuda")
        cold = None
        if cfg.cold_path is not None:
            cold = ColdTier(cfg.cold_path, cfg.cold_bytes, self.fingerprint, block_shape, self.dtype)
        return TierManager(hot, warm, cold, self.block_size)

    def close(self) -> None:
        """Persists cached blocks to the cold tier (when there is one) and closes the tiers."""
        for blocks in self.pins.values():
            self.pool.free(reversed(blocks))
        self.pins.clear()
        self.tiers.persist()
        self.tiers.close()

    def _fingerprint(self) -> str:
        """Everything that changes the meaning of a block's bytes: model, dtype, block size, layout."""
        config_bytes = (self.model_dir / "config.json").read_bytes()
        identity = hashlib.sha256(config_bytes + fingerprint_weights(weight_files(self.model_dir)).encode())
        return f"{identity.hexdigest()}|{self.dtype}|bs={self.block_size}|{KV_LAYOUT}"

    # -- requests --------------------------------------------------------------------------------

    def make_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None) -> Request:
        """Tokenizes and validates; raises RequestError (or TypeError) naming the problem. Allocates nothing."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        try:
            ids = self.tokenizer.to_token_ids(prompt)
        except ValueError as e:
            raise RequestError(str(e)) from None
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {self.spec.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                               "(the prompt must leave room for at least one new token)")
        if params.n > self.config.max_num_seqs:
            raise RequestError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        shared = len(ids) // self.block_size
        needed = shared + params.n * (cdiv(total, self.block_size) - shared)
        if needed > self.num_blocks:
            raise RequestError(f"request needs up to {needed} KV blocks but the pool has {self.num_blocks}; "
                               "lower max_tokens or n, or give the engine more KV memory")
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        return Request(rid, ids, params, self.eos_token_ids)

    def add_request(self, req: Request) -> None:
        seq = Sequence(req, 0, list(req.prompt_token_ids), req.make_generator(0, self.device))
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.stop)
        req.seqs.append(seq)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[StreamChunk]:
        """Finishes every sample of the request with "abort" and frees its blocks; returns final chunks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        chunks = []
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                chunks.append(self._chunk(seq, [], final=True))
        return chunks

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[StreamChunk]:
        """Schedules, runs one forward for the whole batch, samples, and returns the new chunks."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.preempted:
            self.telemetry.preemptions.add(len(out.preempted))
        for restore, blocks in out.restores:
            self.tiers.apply(restore, blocks)
        if not out.scheduled:
            if out.waiting_on_disk:  # nothing to compute until a cold read lands
                self.tiers.wait([s.lookup for s in out.waiting_on_disk if s.lookup], timeout=0.05)
            return []
        try:
            logits, sampled = self.runner.execute(out)
        except Exception as e:
            failed = sorted({s.request.request_id for s, _ in out.scheduled})
            for rid in failed:
                self.abort(rid)
            raise StepError(failed, e) from e
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)
        rows, seqs, chunks = [], [], []
        for i, seq in enumerate(sampled):
            if seq.request.prefill_only:
                self.scheduler.finish(seq, "prefill")
                self._finish_request(seq.request)
                chunks.append(self._chunk(seq, [], final=True))
                continue
            family = [seq] + self._fork(seq)
            rows.extend([i] * len(family))
            seqs.extend(family)
        if rows != list(range(len(sampled))):
            logits = logits[rows]
        if seqs:
            tokens = sample(logits, [s.request.params for s in seqs], [s.generator for s in seqs])
            chunks.extend(self._append(seq, tok) for seq, tok in zip(seqs, tokens))
        self.telemetry.step_duration.record(time.perf_counter() - t0)
        self.telemetry.step_tokens.record(out.num_tokens)
        return chunks

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """When sample 0 finishes its prompt, the other n - 1 samples start, sharing its blocks."""
        req = seq.request
        if seq.index != 0 or req.pending_forks == 0:
            return []
        children = []
        for i in range(len(req.seqs), req.params.n):
            child = Sequence(req, i, list(seq.token_ids), req.make_generator(i, self.device))
            child.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.stop)
            self.kv.fork(seq, child)
            req.seqs.append(child)
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def _append(self, seq: Sequence, token: int) -> StreamChunk:
        seq.token_ids.append(token)
        params = seq.request.params
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in seq.request.eos_token_ids):
            reason = "stop"
        elif seq.detokenizer.add(token):
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if seq.request.is_finished:
                self._finish_request(seq.request)
        return self._chunk(seq, [token], final=reason is not None)

    def _chunk(self, seq: Sequence, token_ids: list[int], final: bool) -> StreamChunk:
        req = seq.request
        usage = None
        if final:
            by_tier = {name: req.cached_tokens_by_tier.get(name, 0) for name in TIER_NAMES}
            usage = Usage(len(req.prompt_token_ids), req.num_cached_tokens or 0, seq.num_output_tokens, by_tier)
        return StreamChunk(req.request_id, seq.index, seq.detokenizer.take(final), token_ids,
                           seq.finish_reason if final else None, usage)

    def _finish_request(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        t = self.telemetry
        t.requests.add(1)
        t.prompt_tokens.add(len(req.prompt_token_ids))
        t.cached_prompt_tokens.add(req.num_cached_tokens or 0)
        t.generated_tokens.add(sum(s.num_output_tokens for s in req.seqs))

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool, sched = self.pool, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            blocks_total=pool.num_blocks,
            blocks_used=pool.num_blocks - pool.num_free,
            blocks_cached=len(pool.cached),
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            cow_copies=self.kv.cow_copies,
            num_swaps=sched.num_swaps,
            tiers={name: replace(st) for name, st in self.tiers.tiers().items()},
            blocks_pinned=sum(len(b) for b in self.pins.values()),
        )

    # -- cache management (between steps) ---------------------------------------------------------

    def clear_cache(self, tier: str, demote: bool = False) -> int:
        """Empties "hot" (cached free blocks), "warm", "cold" or "all"; returns the entries removed.
        demote=True moves hot or warm entries to the next tier down instead (not with "all")."""
        if tier not in (*TIER_NAMES, "all"):
            raise ValueError(f"tier must be one of hot, warm, cold, all; got {tier!r}")
        if demote and tier == "all":
            raise ValueError('demote=True needs a single tier, not "all"')
        return sum(self.tiers.clear(t, demote) for t in (TIER_NAMES if tier == "all" else (tier,)))

    def pin(self, token_ids: list[int]) -> int:
        """Holds a reference on the hot blocks of token_ids' full blocks, so they are never evicted.
        They must be cached already (the async engine prefills first). Returns the tokens pinned."""
        key = tuple(token_ids)
        if key in self.pins:
            return len(self.pins[key]) * self.block_size
        keys = self.kv.chain_keys(list(token_ids))
        blocks = self.pool.cached_prefix(keys)
        if len(blocks) < len(keys):
            raise RequestError("the prefix is not in the hot tier; prefill it first")
        budget = int(self.num_blocks * self.config.max_pinned_fraction)
        pinned = sum(len(b) for b in self.pins.values())
        if pinned + len(blocks) > budget:
            raise RequestError(f"pinning {len(blocks)} blocks would exceed the pinned budget "
                               f"({pinned} of {budget} blocks in use; see max_pinned_fraction)")
        self.pool.touch(blocks)
        self.pins[key] = blocks
        return len(blocks) * self.block_size

    def unpin(self, token_ids: list[int]) -> int:
        blocks = self.pins.pop(tuple(token_ids), [])
        self.pool.free(reversed(blocks))
        return len(blocks) * self.block_size
