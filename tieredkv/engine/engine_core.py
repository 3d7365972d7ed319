"""The synchronous engine: requests in, one `step()` at a time, outputs out. Not thread-safe: one thread
(the async engine's worker) owns it and every object below it."""

from __future__ import annotations

import logging
import time
from typing import Any

from tieredkv.config import EngineConfig
from tieredkv.core.sequence import Request
from tieredkv.engine.adapters import Adapters
from tieredkv.engine.build import build_engine
from tieredkv.engine.outputs import EngineInfo, EngineStats, Output, collect_stats
from tieredkv.engine.rank_build import total_weight_bytes
from tieredkv.engine.resolve import resolve_cache_dir
from tieredkv.engine.shared_weights import SharedWeights
from tieredkv.engine.sleep import Sleeper
from tieredkv.engine.sizing import kv_token_bytes
from tieredkv.engine.speculative import DraftProposer, draft_config
from tieredkv.errors import EngineClosedError, LoRAError, RequestError
from tieredkv.kernels.calls import labelled
from tieredkv.kernels.quant_cpu import CPU
from tieredkv.platform.cpu_share import CpuShare
from tieredkv.platform.malloc_tuning import release_free_memory
from tieredkv.platform.process import PROCESS
from tieredkv.tiers.rates import RATE_TOKENS

log = logging.getLogger("tieredkv")


class EngineCore:
    """Owns what build.build_engine makes (`parts`: the model, the KV pool and tiers, the scheduler, the runner,
    the request lifecycle, read through the core by name: `core.scheduler` is `core.parts.scheduler`) and the
    live requests; `step()` is schedule -> execute (block moves, then one forward) -> update."""

    def __init__(self, config: EngineConfig, shared_weights: SharedWeights | None = None):
        """`shared_weights`: where the model is taken from if an earlier engine of this process loaded it in the
        same form, and kept for the next (engine/shared_weights.py); None loads it for this engine alone."""
        self.config = config
        self.shared_weights = shared_weights
        self.parts = build_engine(config, shared_weights)
        parts = self.parts
        if shared_weights is not None:
            shared_weights.hold(parts.model)  # given back at close (also a close because the rest of this failed)
        self.cpu_share = CpuShare(on_start=CPU.set_split_threads) if (  # only in a core process: on a thread of
            config.share_cores and PROCESS.engine_owned and parts.device.type == "cpu" and parts.tp.world == 1
        ) else None  # the application's, its work is this process's and torch's threads are its too
        self.sleeper = Sleeper(parts.kv_cache, parts.num_blocks, resolve_cache_dir(config) / "sleep")
        self.adapters = Adapters(parts.spec, parts.dtype, parts.device, parts.kv.root, config.max_loras,
                                 config.max_lora_rank, parts.tp.shard, parts.tp if parts.tp.world > 1 else None)
        parts.runner.lora_stack = self.adapters.stack
        if any(t.blocking for t in parts.tiers.lower) and parts.tp.world == 1:  # load or recompute: a prefill rate
            parts.tiers.rates.prefill(*parts.runner.time_prefill(RATE_TOKENS))  # from the first request on
            # (under tensor parallelism a forward needs every rank: the first request's forward measures it)
        try:
            for name, path in (config.lora_adapters or {}).items():
                self.adapters.register(name, path)
        except BaseException:
            self.close()
            raise
        if config.speculative is not None and config.speculative.method == "draft":
            self._add_draft_model(config)
        self.block_size = config.block_size
        self.requests = self.parts.lifecycle.requests  # live requests by id

        self.dense_formats = self.parts.model.dense_formats()  # fixed once built
        self.dense_arithmetic = self.parts.model.dense_arithmetic()
        # fixed once built too (the formats' bytes, asleep or not); summed over every tensor it took 0.4 ms, which
        # the stats published after every step paid: 3% of a default-model decode step on an AMD EPYC Zen 5
        self.weight_bytes = total_weight_bytes(self.parts.model, self.parts.memory)

    def _add_draft_model(self, config: EngineConfig) -> None:
        """Speculative decoding's draft model: an engine of its own, checked to share the target's tokenizer."""
        try:
            draft = EngineCore(draft_config(config), self.shared_weights)
            try:
                self.parts.speculator.proposer = DraftProposer(draft, self.parts.tokenizer, self.parts.spec.vocab_size,
                                                               config.speculative.model)
            except BaseException:
                draft.close()
                raise
        except BaseException:
            self.close()
            raise

    def info(self) -> EngineInfo:
        parts = self.parts
        return EngineInfo(str(parts.model_dir), str(parts.device), str(parts.dtype).removeprefix("torch."),
                          parts.num_blocks, self.block_size, parts.max_model_len, parts.spec.vocab_size, self.config,
                          parts.kv.root.hex(), bool(parts.tiers.shared))

    def __getattr__(self, name: str) -> Any:  # for readers outside; the core's own methods read self.parts
        parts = self.__dict__.get("parts")
        if parts is None:
            raise AttributeError(name)
        return getattr(parts, name)

    def close(self) -> None:
        """Persists cached blocks to the cold tier (when there is one) and closes the tiers; under tensor
        parallelism then ends the other ranks (also when persisting failed because one is gone)."""
        try:
            speculator = self.parts.speculator
            if speculator is not None and hasattr(speculator.proposer, "close"):
                speculator.proposer.close()  # a draft model's engine
            self.sleeper.discard()
            if self.cpu_share is not None and self.cpu_share.active:
                self.cpu_share.close()
                CPU.set_split_threads(0)
            self.parts.pins.release_all()
            self.parts.tiers.persist()
            self.parts.tiers.close()
            if self.parts.runner.compiled is not None:
                self.parts.runner.compiled.finish()
        finally:
            self._close_events()
            self.parts.tp.close()
            if self.shared_weights is not None:
                self.shared_weights.give_back(self.parts.model)
            if self.parts.process is not None:
                self.parts.process.release()  # torch's threads as the process had them

    # -- sleep (engine/sleep.py) -------------------------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self.sleeper.asleep

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Gives the engine's memory back while it has no request: level 1 the KV cache's (pins released; the
        cached blocks of hot, and of warm, go to the tiers outside this process's memory, cold and remote, written
        before this returns; with none, hot's go to warm, which keeps its memory), level 2 the weights' too.
        RequestError with requests in flight, under tensor parallelism, or at level 2 while another engine uses the
        same weights (shared_weights). Returns what it released and the process's resident memory after."""
        if level not in (1, 2):
            raise RequestError(f"sleep level must be 1 or 2, got {level!r}")
        if self.parts.tp.world > 1:
            raise RequestError("sleep is not supported with tensor_parallel_size > 1")
        if self.requests:
            raise RequestError(f"cannot sleep with {len(self.requests)} requests in flight")
        others = self.shared_weights.users(self.parts.model) - 1 if self.shared_weights is not None else 0
        if level == 2 and others > 0:
            raise RequestError(f"sleep level 2 releases the weights, which {others} other engine(s) use "
                               "(shared_weights): sleep at level 1")
        sleeper, released = self.sleeper, {}
        if sleeper.level >= level:
            return sleeper.last
        if sleeper.level == 0:
            tiers = self.parts.tiers
            released["pins_released"] = len(self.parts.pins.pins)
            self.parts.pins.release_all()
            released["blocks_demoted"] = tiers.clear("hot", demote=True)
            outside = [t for t in tiers.lower if t is not tiers.warm]  # tiers outside this process's memory
            with_warm = tiers.warm is not None and bool(outside)
            if with_warm:  # warm's memory goes back too, its entries to the tiers outside
                released["blocks_demoted"] += tiers.clear("warm", demote=True)
            # the blocks' copies on their way down: trimmed now, the heap's top stays free (the collection of
            # cycles is settle()'s, once: a full collection takes 0.1-0.4 s in a process holding many objects)
            release_free_memory(collect=False)
            for tier in outside:
                tier.flush_sync()  # the next request finds them there
            released["kv_bytes_released"] = sleeper.release_cache(tiers.warm if with_warm else None)
        if level == 2:
            compiled = self.parts.runner.compiled
            if compiled is not None and hasattr(compiled, "wait_ready"):
                compiled.wait_ready()  # a compile still running reads the weights
            released["weight_bytes_released"] = sleeper.release_weights(self.parts.model)
        return sleeper.settle(level, released)

    def wake(self) -> dict[str, Any]:
        """Takes back what sleep released (level 2: reads the weights back); a no-op when awake. Returns how long
        it took."""
        if not self.sleeper.asleep:
            return {"level": 0, "wake_s": 0.0}
        t0, level = time.perf_counter(), self.sleeper.level
        self.sleeper.restore_weights()
        self.sleeper.restore_cache()
        self.sleeper.level = 0
        seconds = time.perf_counter() - t0
        log.info("engine awake (from level %d) in %.3f s", level, seconds)
        return {"level": 0, "was_level": level, "wake_s": seconds}

    def flush_events(self) -> None:
        """Hands the KV events recorded since the last call to their publisher (after each step and command)."""
        if self.parts.pool.events is not None:
            self.parts.pool.events.flush()

    def _close_events(self) -> None:
        """Tells subscribers this engine holds nothing any more, then sends what is queued and closes."""
        events = self.parts.pool.events
        if events is not None:
            events.cleared()
            events.flush()
            events.publisher.close()

    # -- requests (see engine/lifecycle.py) --------------------------------------------------------------

    def add_request(self, req: Request) -> list[Output]:
        if req.adapter_name is not None:
            try:
                req.adapter = self.adapters.acquire(req.adapter_name)
            except LoRAError as e:  # unloaded after the request was checked, or its folder is gone
                self.parts.telemetry.on_rejected()
                return [(req.sink, RequestError(str(e)))]
        req.root = self.adapters.root_for(req.adapter, req.cache_salt)
        return self.parts.lifecycle.add(req)

    def abort(self, request_id: str, sink: Any = None) -> list[Output]:
        return self.parts.lifecycle.abort(request_id, sink)

    def fail(self, req: Request, error: BaseException) -> list[Output]:
        return self.parts.lifecycle.fail(req, error)

    def fail_all(self, error: BaseException) -> list[Output]:
        return self.parts.lifecycle.fail_all(error)

    def has_work(self) -> bool:
        return self.parts.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[Output]:
        """Schedules, runs one forward for the whole batch, samples; returns the new outputs. A failure
        that belongs to some requests (a forward error, an unusable logits row, a request that can
        never be scheduled) ends those requests with an error output and nothing else."""
        t0 = time.perf_counter()
        if self.sleeper.asleep:  # a request came: everything it needs comes back first
            self.wake()
        self.parts.pins.expire()
        if self.parts.speculator is not None:  # drafts onto the decoding sequences, for the scheduler to fit
            self.parts.speculator.propose(self.parts.scheduler.running, self.parts.max_model_len)
        out = self.parts.scheduler.schedule()
        decode_only = self.parts.speculator is not None and all(  # (for the speculator's costs)
            n == 1 + len(s.spec_tokens) and s.num_computed_tokens + 1 == s.num_tokens for s, n in out.scheduled)
        self.parts.telemetry.on_scheduled(out, t0)
        self.parts.tiers.execute(out.moves)
        if not out.scheduled:
            self.parts.tiers.io.flush()  # (tensor parallelism: the moves' ops go in a step without rows)
            return self._idle(out)
        try:
            threads = self._threads_for(out)
            t_forward = time.perf_counter()
            logits, sampled = self.parts.runner.execute(out)
            forward_s = time.perf_counter() - t_forward
            self.parts.tiers.rates.prefill(out.num_tokens, forward_s)
            if threads:
                self.cpu_share.after(out.num_tokens, forward_s)
        except EngineClosedError:  # a tensor-parallel rank is gone: the engine cannot go on
            raise
        except Exception as e:
            log.exception("engine step failed")
            return self.parts.lifecycle.fail_step(out, e)
        outputs = self.parts.lifecycle.update(out, logits, sampled)
        self._publish()
        seconds = time.perf_counter() - t0
        self.parts.telemetry.on_step(out, seconds)
        if decode_only:
            self.parts.speculator.observe(len(out.scheduled), out.num_tokens - len(out.scheduled), seconds)
        return outputs

    def _threads_for(self, out) -> int:
        """Sets the threads this step's forward runs on (platform/cpu_share.py); 0 where nothing chooses them."""
        share = self.cpu_share
        if share is None:
            return 0
        threads = share.before(out.num_tokens, lambda: self.parts.runner.same_bits_on_fewer_threads(out.scheduled))
        if not share.active:
            return 0
        self.parts.runner.kernel_calls["step threads", f"{threads} of {share.threads}"] += 1
        return threads

    def _publish(self) -> None:
        """Blocks that became full this step go to the shared tier (when there is one), while their data
        is surely still theirs."""
        new = self.parts.pool.new_cached
        if new:
            self.parts.tiers.publish([b for b in new if b.block_hash is not None])
            new.clear()

    def _idle(self, out) -> list[Output]:
        """A step that computes nothing: wait briefly for a cold read, or fail a request that never fits."""
        if out.waiting_on_disk:  # nothing to compute until a cold read lands
            self.parts.tiers.wait([s.lookup for s in out.waiting_on_disk if s.lookup], timeout=0.05)
        elif not out.preempted and not self.parts.scheduler.running and self.parts.scheduler.waiting:
            return self.parts.lifecycle.fail_unschedulable(self.parts.scheduler.waiting[0])
        return []

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        parts = self.parts
        return collect_stats(parts.pool, parts.scheduler, parts.kv, parts.tiers.stats(), parts.pins.num_blocks,
                             parts.runner.decode_path, parts.weights, self.weight_bytes,
                             self.dense_formats, parts.kv_format.label,
                             kv_token_bytes(parts.spec, parts.kv_format),
                             parts.speculator.counters if parts.speculator is not None else None,
                             self.sleeper.level, self.dense_arithmetic, labelled(parts.runner.kernel_calls))
