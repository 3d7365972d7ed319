"""The synchronous engine: requests in, one `step()` at a time, outputs out. Not thread-safe: one thread
(the async engine's worker) owns it and every object below it."""

from __future__ import annotations

import logging
import time
from typing import Any
import torch

from tieredkv.runner.compiled_decode import CompiledDecode, compile_wanted
from tieredkv.config import EngineConfig
from tieredkv.detokenizer import IncrementalDetokenizer
from tieredkv.engine_setup import (build_tiers, eos_token_ids, far_mode, make_kv_cache, max_model_len,
                                   model_fingerprint, num_kv_blocks, warm_blocks,
                                   resolve_device, resolve_dtype, resolve_model_dir)
from tieredkv.errors import RequestError, StepError, TieredKVError
from tieredkv.core.hashing import root_hash
from tieredkv.kernels import select_kernels
from tieredkv.core.kv_manager import KVCacheManager, cdiv
from tieredkv.runner.malloc_tuning import tune_glibc_malloc
from tieredkv.runner.model_runner import ModelRunner
from tieredkv.models.loader import load_model
from tieredkv.models.spec import ModelSpec
from tieredkv.outputs import EngineStats, Output, StreamChunk, TokenLogprob, collect_stats, make_chunk
from tieredkv.core.pins import PinTable
from tieredkv.request_factory import RequestFactory
from tieredkv.runner.sampler import RowState, Sampled, sample
from tieredkv.core.scheduler import Scheduler
from tieredkv.core.sequence import Request, Sequence
from tieredkv.telemetry import Telemetry
from tieredkv.tokenizer import Tokenizer

log = logging.getLogger("tieredkv")


class EngineCore:
    """Owns the model, the KV pool and tiers, the scheduler and the requests; `step()` is
    schedule -> execute (block moves, then one forward) -> update (sample, stop rules, forks)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this (worker) thread's current device: "cuda:N" means N
        if self.device.type == "cpu" and config.cpu_malloc_tuning:
            tune_glibc_malloc()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = resolve_model_dir(config.model)
        self.spec = spec = ModelSpec.from_file(self.model_dir / "config.json")
        self.max_model_len = max_model_len(spec, config.max_model_len)
        self.tokenizer = Tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(spec, self.model_dir, self.tokenizer.eos_token_id)
        self.model = load_model(self.model_dir, spec, self.dtype, self.device)
        self.block_size = config.block_size
        self.num_blocks = num_kv_blocks(config, spec, self.dtype, self.device)
        num_warm = warm_blocks(config, spec, self.dtype)
        mode = far_mode(config, self.device) if num_warm else None
        num_far = num_warm if mode else 0
        self.kv_cache = make_kv_cache(spec, self.block_size, self.num_blocks, num_far if mode == "in place" else 0,
                                      self.dtype, self.device)
        self.factory = RequestFactory(self.tokenizer, spec, config, self.max_model_len, self.eos_token_ids,
                                      self.num_blocks, num_far)
        self.fingerprint = model_fingerprint(self.model_dir, self.dtype, self.block_size)
        ops = select_kernels(config.attention_backend, self.device, self.dtype)
        compile_decode = compile_wanted(config.compile_decode, self.device)
        if ops.pack_linear_weight is not None:
            self.model.pack_linear_weights(ops.pack_linear_weight, keep_plain=compile_decode)
        self.tiers = build_tiers(config, spec, self.num_blocks, self.kv_cache, ops, self.fingerprint, num_warm,
                                 far=mode is not None)
        self.pool = self.tiers.hot.pool
        self.kv = KVCacheManager(self.pool, self.block_size, config.enable_prefix_caching, root_hash(self.fingerprint))
        staged = mode == "staged"  # the staged buffer: this step's hot blocks and at most a pool's worth of far ones
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.tiers,
                                   offload={"in place": "first", "staged": "last"}.get(mode),
                                   stage_cap=self.num_blocks if staged else None)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_size, ops, config.cascade_attention,
                                  CompiledDecode(self.model, self.kv_cache, ops) if compile_decode else None,
                                  far=(self.num_blocks, self.tiers.warm.slab) if staged else None)
        self.runner.compile_now()
        self.pins = PinTable(self.kv, int(self.num_blocks * config.max_pinned_fraction))
        self.requests: dict[str, Request] = {}
        self.telemetry = Telemetry()
        log.info("engine ready: %s, %s on %s, %d KV blocks of %d tokens, kernels=%s, linear=%s, packed=%s, "
                 "compiled decode=%s", self.model_dir.name, self.dtype, self.device, self.num_blocks, self.block_size,
                 ops.name, ops.linear.__name__, ops.pack_linear_weight is not None, compile_decode)

    def close(self) -> None:
        """Persists cached blocks to the cold tier (when there is one) and closes the tiers."""
        self.pins.release_all()
        self.tiers.persist()
        self.tiers.close()

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, req: Request) -> list[Output]:
        """Queues the request. One that cannot be served here gets its error as its only output;
        nothing else is touched."""
        try:
            if req.request_id in self.requests:
                raise RequestError(f"request id {req.request_id!r} is already in use")
            self.factory.check_fits(len(req.prompt_token_ids), req.params, self.pins.num_blocks)
            seq = self._new_sequence(req, 0, req.prompt_token_ids)
        except Exception as e:
            self.telemetry.on_rejected()
            return [(req.sink, e if isinstance(e, TieredKVError) else RequestError(f"cannot admit the request: {e}"))]
        self.telemetry.on_added(req)
        req.seqs.append(seq)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        return []

    def abort(self, request_id: str, sink: Any = None) -> list[Output]:
        """Finishes every sample of the request with "abort" and frees its blocks; returns final chunks.
        With `sink`, only the request delivering there is aborted (an id may have been reused since)."""
        req = self.requests.get(request_id)
        if req is None or (sink is not None and req.sink is not sink):
            return []
        del self.requests[request_id]
        self.telemetry.on_ended(req, "abort")
        outputs = []
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                outputs.append((req.sink, make_chunk(seq, [], final=True)))
        return outputs

    def fail(self, req: Request, error: BaseException) -> list[Output]:
        """Ends a request with an error (its blocks freed); the error is its last output."""
        if self.requests.pop(req.request_id, None) is None:
            return []
        self.telemetry.on_ended(req, "error")
        for seq in req.seqs:
            self.scheduler.finish(seq, "error")
        return [(req.sink, error)]

    def fail_all(self, error: BaseException) -> list[Output]:
        return [out for req in list(self.requests.values()) for out in self.fail(req, error)]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[Output]:
        """Schedules, runs one forward for the whole batch, samples; returns the new outputs. A failure
        that belongs to some requests (a forward error, an unusable logits row, a request that can
        never be scheduled) ends those requests with an error output and nothing else."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        for seq in out.admitted:
            self.telemetry.on_admitted(seq, t0)
        for seq in out.preempted:
            self.telemetry.on_preempted(seq)
        self.tiers.execute(out.moves)
        if not out.scheduled:
            if out.waiting_on_disk:  # nothing to compute until a cold read lands
                self.tiers.wait([s.lookup for s in out.waiting_on_disk if s.lookup], timeout=0.05)
            elif not out.preempted and not self.scheduler.running and self.scheduler.waiting:
                return self._fail_unschedulable(self.scheduler.waiting[0])
            return []
        try:
            logits, sampled = self.runner.execute(out)
        except Exception as e:
            log.exception("engine step failed")
            failed = {s.request.request_id: s.request for s, _ in out.scheduled}
            return [o for rid, req in failed.items() for o in self.fail(req, StepError([rid], e))]
        outputs = self._update(out, logits, sampled)
        self.telemetry.step_duration.record(time.perf_counter() - t0)
        self.telemetry.step_tokens.record(out.num_tokens)
        return outputs

    def _update(self, out, logits: torch.Tensor, sampled: list[Sequence]) -> list[Output]:
        """After the forward: computed tokens, newly full blocks cached, forks, sampling, stop rules."""
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)
        outputs, rows, seqs = [], [], []
        for i, seq in enumerate(sampled):
            req = seq.request
            if req.prefill_only:
                outputs.extend(self._finish_prefill(seq))
                continue
            try:
                family = [seq] + self._fork(seq)
            except Exception as e:
                outputs.extend(self.fail(req, RequestError(f"forking the samples failed: {e}")))
                continue
            rows.extend([i] * len(family))
            seqs.extend(family)
        if rows != list(range(len(sampled))):
            logits = logits[rows]
        if seqs:
            states = [RowState(s.request.params, s.token_ids, s.num_prompt_tokens, s.request.stop_ids) for s in seqs]
            for seq, got in zip(seqs, sample(logits, states, [s.generator for s in seqs])):
                if isinstance(got, Sampled):
                    if seq.request.request_id in self.requests:
                        outputs.append((seq.request.sink, self._append(seq, got)))
                else:
                    outputs.extend(self.fail(seq.request, got))
        return outputs

    def _fail_unschedulable(self, seq: Sequence) -> list[Output]:
        """Nothing runs and the head of the queue still cannot start: it never will, so it fails."""
        return self.fail(seq.request, RequestError(
            f"request {seq.request.request_id!r} cannot be scheduled: it needs {cdiv(seq.num_tokens, self.block_size)}"
            f" KV blocks, the pool has {self.num_blocks} of which {self.pins.num_blocks} are pinned"))

    def _finish_prefill(self, seq: Sequence) -> list[Output]:
        req = seq.request
        if req.pin:
            try:
                self.pins.pin(req.prompt_token_ids)
            except RequestError as e:
                return self.fail(req, e)
        self.scheduler.finish(seq, "prefill")
        self._finish_request(req)
        return [(req.sink, make_chunk(seq, [], final=True))]

    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(req, index, list(token_ids), req.make_generator(index, self.device))
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.stop)
        return seq

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """When sample 0 finishes its prompt, the other n - 1 samples start, sharing its blocks."""
        req = seq.request
        if seq.index != 0 or req.pending_forks == 0:
            return []
        children = []
        for i in range(len(req.seqs), req.params.n):
            child = self._new_sequence(req, i, seq.token_ids)
            self.kv.fork(seq, child)
            req.seqs.append(child)
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def _append(self, seq: Sequence, got: Sampled) -> StreamChunk:
        self.telemetry.on_token(seq, time.perf_counter())
        reason = seq.append(got.token, self.max_model_len)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if seq.request.is_finished:
                self._finish_request(seq.request)
        logprobs = None if got.logprob is None else [TokenLogprob(got.token, got.logprob, got.top)]
        return make_chunk(seq, [got.token], final=reason is not None, logprobs=logprobs)

    def _finish_request(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.telemetry.on_finished(req)

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return collect_stats(self.pool, self.scheduler, self.kv, self.tiers.stats(), self.pins.num_blocks)
