"""The asyncio front: `async for chunk in engine.stream(prompt)`, many streams on one engine."""

from __future__ import annotations

import asyncio
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ClassVar

from tieredkv.config import EngineConfig, SamplingParams
from tieredkv.engine.engine_core import EngineCore
from tieredkv.engine.explain import BlockReport, explain
from tieredkv.engine.outputs import CompletionOutput, EngineInfo, EngineStats, RequestOutput, Usage
from tieredkv.engine.shared_weights import SharedWeights
from tieredkv.engine.stream import Channel, RequestStream
from tieredkv.engine.worker import EngineWorker
from tieredkv.errors import EngineClosedError, RequestError, WrongLoopError
from tieredkv.models.tokenizer import PromptType

__all__ = ["AsyncEngine", "EngineClosedError"]


class AsyncEngine:
    """An engine served on the event loop that started it.

    Where the core runs: by default (EngineConfig.core_process) in a process of its own, which `start` launches
    and which this object talks to (engine/core_client.py: the same methods, the same errors); with
    core_process=False, in this process, as described below.

    Threads: that event loop (the only one the engine serves: a call from another loop or thread
    raises WrongLoopError at once, except `abort` and `stats`, which work from anywhere); one worker
    thread that owns every piece of engine state (see EngineWorker); one tokenizer thread, so a long
    prompt is tokenized while the loop and the steps go on. Requests, aborts and cache-management
    calls reach the worker through one queue and are applied in order between steps; chunks come back
    through `loop.call_soon_threadsafe`.

    Loading, every step and closing run on the worker thread. On CPU this matters for speed: torch's
    OpenMP runtime (libgomp) keeps a pool of helper threads per thread that starts parallel work, and
    once the helpers of all pools outnumber the cores it stops spin-waiting between parallel regions
    and puts them to sleep instead. A forward is thousands of short parallel regions, so every one
    then pays a wake-up: steps measured 10-25% slower when the model was loaded on one thread and
    run on another. CPU-heavy torch work an application does next to the engine can go through
    `run_in_worker` for the same reason.
    """

    _process_front: ClassVar[Any] = None  # the class serving core_process=True (core_client.py's ProcessEngine)

    def __init_subclass__(cls, process_front: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if process_front:
            AsyncEngine._process_front = cls

    def __init__(self, worker: Any):
        """`worker`: the EngineWorker that runs the core on a thread, or (core_client.py) the link to the core's
        process, which answers alike."""
        self._worker = worker
        self._loop = worker.loop
        self._loop_thread = threading.get_ident()  # start() runs on the loop's thread
        self._streams: dict[str, Channel] = {}  # live streams by request id (loop thread only)
        self._tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredkv-tokenize")
        self._closing = False
        self._draining = False  # close(grace) is waiting for the running streams: new ones are refused
        self._idle = asyncio.Event()  # set while no stream is open
        self._idle.set()
        self._signal_close: asyncio.Task | None = None
        worker.closed.add_done_callback(self._on_closed)

    @classmethod
    async def start(cls, config: EngineConfig | None = None, *, shared_weights: SharedWeights | None = None,
                    **kwargs) -> "AsyncEngine":
        """Loads the model (in the engine's core process, or with core_process=False on the worker thread) and
        starts serving on the running loop. kwargs build an EngineConfig when none is given. `shared_weights`
        (core_process=False only): where the model is taken from if an earlier engine of this process loaded it in
        the same form (engine/shared_weights.py)."""
        config = config or EngineConfig(**kwargs)
        if config.core_process and cls is AsyncEngine:
            if shared_weights is not None:
                raise ValueError("shared_weights needs core_process=False: a core process has memory of its own")
            return await AsyncEngine._process_front.launch(config)
        worker = EngineWorker(config, asyncio.get_running_loop(), shared_weights)
        await worker.started
        return cls(worker)

    @property
    def core(self) -> EngineCore:
        """The worker's engine core (core_process=False only). Read it only through `run_in_worker` while requests
        are in flight."""
        return self._worker.core

    @property
    def tokenizer(self):
        """The model's tokenizer (encode, decode, apply_chat_template), as the engine uses it."""
        return self._factory.tokenizer

    @property
    def info(self) -> EngineInfo:
        """What stays fixed while the engine runs: the model's folder, device, dtype, block size and count,
        max_model_len, the vocabulary's size, the config, whether a shared tier is attached."""
        return self._worker.core.info()

    def precheck(self, prompt: PromptType, params: SamplingParams) -> None:
        """What stream() checks before it returns, without tokenizing: RequestError (or TypeError for a wrong
        type) for a request that cannot be served; a server asks it before it reads the rest of a request."""
        self._factory.precheck(prompt, params)

    @property
    def _factory(self):
        return self._worker.core.factory

    @property
    def _telemetry(self):
        return self._worker.core.telemetry

    def _adapter_paths(self) -> dict[str, str]:
        return self._worker.core.adapters.paths

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, grace: float = 0.0) -> None:
        """Stops the engine; open streams end with EngineClosedError, and the cached blocks that only the
        hot and warm tiers hold are written to the cold tier. With `grace` seconds, it drains first: new
        streams are refused at once (EngineClosedError) while the open ones have up to `grace` seconds to
        finish. Every caller returns once it is closed."""
        self._check_loop()
        if grace > 0 and not self._closing:
            self._draining = True
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                pass
        if not self._closing:
            self._closing = True
            self._stop_core()
        await asyncio.shield(self._worker.closed)
        await self._join_core()
        self._tokenizer.shutdown(wait=False, cancel_futures=True)

    def _stop_core(self) -> None:
        self._worker.post(self._worker.stop)

    async def _join_core(self) -> None:
        self._worker.thread.join(timeout=10)  # it settled `closed` as its last act: this returns at once

    def close_on_signals(self, grace: float = 30.0,
                         signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        """Makes the first of `signals` close the engine as close(grace) does (the handlers are the event
        loop's, so this runs on the main thread's loop); a second signal acts as it would without this.
        For applications run by Docker, Kubernetes or systemd, which stop them with SIGTERM. Returns
        nothing; await `closed()` to wait for the engine to close."""
        self._check_loop()

        def on_signal() -> None:
            for sig in signals:
                self._loop.remove_signal_handler(sig)
            self._signal_close = self._loop.create_task(self.close(grace))

        for sig in signals:
            self._loop.add_signal_handler(sig, on_signal)

    async def closed(self) -> None:
        """Returns once the engine has closed, for whatever reason."""
        await asyncio.shield(self._worker.closed)

    def _on_closed(self, _) -> None:
        """Every stream still open ends, even where the worker could not reach it (a failed core)."""
        reason = self._worker.close_reason or EngineClosedError("engine closed")
        for channel in list(self._streams.values()):
            channel.push(reason)

    def _check_loop(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise WrongLoopError("this engine serves the event loop that started it; call it from that loop "
                                 "(abort() and stats() work from any thread)")

    def _check_open(self) -> None:
        self._check_loop()
        if self._closing or self._worker.closed.done():
            raise EngineClosedError("engine closed")

    # -- requests --------------------------------------------------------------------------------

    def stream(self, prompt: PromptType, params: SamplingParams | None = None, *, request_id: str | None = None,
               adapter: str | None = None, cache_salt: str | None = None,
               keep: list[tuple[int, float | None]] | None = None, mark_prompt: bool = False) -> RequestStream:
        """Checks what can be checked without tokenizing now (raising RequestError or TypeError, nothing
        allocated); the request starts at the first iteration, where a prompt that turns out too long
        once tokenized raises RequestError. See RequestStream for how a stream ends.

        `adapter`: a loaded LoRA adapter's name (None: the base model). `cache_salt`: the request shares cached
        blocks only with requests of the same salt (and adapter); None shares with every request without one.
        `keep`: prefixes of the prompt to pin once it is computed, as (tokens, seconds to live or None), within the
        pinned budget and the client's (cache_salt's) share: a prefix that does not fit is logged, not pinned
        (check_pin() asks first). `mark_prompt`: the prompt's blocks are admitted to the cold and remote tiers
        whatever their uses (the server's prompt_cache_key)."""
        return self._open(prompt, params or SamplingParams(), request_id,
                          {"adapter": adapter, "cache_salt": cache_salt, "keep": keep, "mark_prompt": mark_prompt})

    def _open(self, prompt, params, request_id: str | None, flags: dict[str, Any]) -> RequestStream:
        return RequestStream(self, self._admit(prompt, params, request_id, flags), prompt, params, flags)

    def _admit(self, prompt, params, request_id: str | None, flags: dict[str, Any],
               channel_type: Callable[[str, int], Channel] = Channel) -> Channel:
        """Checks a new stream and registers its channel under its request id (started by _start)."""
        self._check_open()
        if self._draining:
            raise EngineClosedError("engine shutting down: it takes no new requests")
        try:
            self._factory.precheck(prompt, params)
            adapter, salt = flags.get("adapter"), flags.get("cache_salt")
            if adapter is not None and adapter not in self._adapter_paths():
                raise RequestError(f"no LoRA adapter named {adapter!r} is loaded (loaded: "
                                   f"{', '.join(self.adapters()) or 'none'})")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise RequestError("cache_salt must be a non-empty string")
        except (RequestError, TypeError):
            self._telemetry.on_rejected()
            raise
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        channel = channel_type(request_id, params.n)
        self._streams[request_id] = channel
        self._idle.clear()
        return channel

    def _start(self, channel: Channel, prompt, params, flags: dict[str, bool]):
        """A stream's first iteration: tokenize on the tokenizer thread, then queue it for the worker."""
        span = self._telemetry.start_request_span(channel.request_id, params)
        try:
            self._tokenizer.submit(self._prepare, channel, prompt, params, flags, span)
        except RuntimeError:  # the tokenizer pool is shut down: the engine closed
            channel.push(EngineClosedError("engine closed"))
        return span

    def _prepare(self, channel: Channel, prompt, params, flags: dict[str, bool], span) -> None:
        try:
            req = self._worker.core.factory.make(prompt, params, channel.request_id, prechecked=True)
        except Exception as e:
            self._worker.core.telemetry.on_rejected()
            self._worker.call_loop(channel.push, e)
            return
        req.sink, req.span = channel, span
        req.prefill_only = flags.get("prefill_only", False)
        req.keep, req.mark_prompt = flags.get("keep"), flags.get("mark_prompt", False)
        req.adapter_name, req.cache_salt = flags.get("adapter"), flags.get("cache_salt")
        if not self._worker.post(self._worker.add, req):
            self._worker.call_loop(channel.push, EngineClosedError("engine closed"))

    def _forget(self, channel: Channel, abort: bool) -> None:
        """A stream's consumer is done with it: its id is free again; abort the request if it still runs."""
        if self._streams.get(channel.request_id) is channel:
            del self._streams[channel.request_id]
            if not self._streams:
                self._idle.set()
        if abort:
            channel.aborted = True
        self._release(channel, abort)

    def _release(self, channel: Channel, abort: bool) -> None:
        """The core's side of _forget: abort the request if it still runs."""
        if abort:
            self._worker.post(self._worker.abort, channel.request_id, channel)

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None, *,
                       request_id: str | None = None, adapter: str | None = None,
                       cache_salt: str | None = None) -> RequestOutput:
        """The whole result of one request: all n samples, or with beam search the n best beams, best first.
        `adapter` and `cache_salt` as in stream()."""
        params = params or SamplingParams()
        outputs = [CompletionOutput(i) for i in range(params.n)]
        texts: list[list[str]] = [[] for _ in range(params.n)]
        usage = []
        async with self.stream(prompt, params, request_id=request_id, adapter=adapter,
                               cache_salt=cache_salt) as stream:
            async for chunk in stream:
                out = outputs[chunk.index]
                texts[chunk.index].append(chunk.text)
                out.token_ids.extend(chunk.token_ids)
                if chunk.logprobs is not None:
                    out.logprobs = (out.logprobs or []) + chunk.logprobs
                if chunk.finish_reason is not None:
                    out.finish_reason = chunk.finish_reason
                    out.cumulative_logprob = chunk.cumulative_logprob
                    usage.append(chunk.usage)
        for out, parts in zip(outputs, texts):
            out.text = "".join(parts)
        total = Usage(usage[0].prompt_tokens, usage[0].cached_prompt_tokens,
                      sum(u.completion_tokens for u in usage), usage[0].cached_tokens_by_tier,
                      usage[-1].draft_tokens, usage[-1].accepted_draft_tokens,  # (the request's, counted so far)
                      usage[0].cache_decision)
        return RequestOutput(stream.request_id, outputs, total)

    async def _prefill(self, prompt: PromptType, flags: dict[str, Any]) -> Usage:
        usage = None
        async with self._open(prompt, SamplingParams(max_tokens=1), None, {"prefill_only": True, **flags}) as s:
            async for chunk in s:
                usage = chunk.usage
        return usage

    async def prefill(self, prompt: PromptType) -> Usage:
        """Computes and caches the prompt's KV without generating; returns its usage."""
        return await self._prefill(prompt, {})

    async def pin(self, prompt: PromptType, ttl: float | None = None, cache_salt: str | None = None) -> int:
        """Keeps the prompt's full blocks in the hot tier until unpin, or for `ttl` seconds, within
        max_pinned_fraction of the pool and max_pinned_per_client of that for the client (`cache_salt`: pinned
        under it, counted in its share): prefills what is missing and pins in the same step, so nothing can evict
        it in between. Pinning a pinned prompt again renews it. RequestError past the budget or the share.
        Returns the number of tokens pinned."""
        if ttl is not None and not ttl > 0:
            raise RequestError("ttl must be a positive number of seconds (None: until unpin)")
        usage = await self._prefill(prompt, {"cache_salt": cache_salt, "keep": [(1 << 62, ttl)]})
        block_size = self.info.block_size
        return usage.prompt_tokens // block_size * block_size

    async def check_pin(self, token_ids: list[int], cache_salt: str | None = None, adapter: str | None = None) -> None:
        """Raises RequestError when pinning this prefix now would exceed the pinned budget or the client's share;
        what a server asks before a request whose prefix it will pin starts."""
        core = self._worker.core
        await self._submit(core.pins.check, token_ids, self._root(adapter, cache_salt), cache_salt)

    async def pins(self) -> list[dict[str, Any]]:
        """The pinned prefixes: tokens, blocks, client (its cache_salt), seconds left (None: until unpinned)."""
        return await self._submit(self._worker.core.pins.listing)

    async def tokenize(self, prompt: PromptType, check: bool = True) -> list[int]:
        """The prompt's token ids (messages through the chat template), on the engine's tokenizer thread.
        With `check`, checked as a request's are (RequestError when longer than max_model_len allows or
        outside the vocabulary); without, any text is tokenized (ValueError when the template fails)."""
        self._check_open()
        fn = self._factory.token_ids if check else self.tokenizer.to_token_ids
        return await self._loop.run_in_executor(self._tokenizer, fn, prompt)

    async def load_adapter(self, name: str, path) -> dict[str, Any]:
        """Reads a LoRA adapter in PEFT's format (a folder with adapter_config.json and adapter_model.safetensors)
        and serves it under `name` from the next request on; LoRAError when it does not fit the base model, its
        files are missing, or the name is taken. Returns what was loaded (modules, rank, bytes)."""
        adapter = await self._submit(self._worker.core.adapters.register, name, str(path))
        return {"name": adapter.name, "modules": adapter.modules, "rank": adapter.rank, "bytes": adapter.nbytes}

    async def unload_adapter(self, name: str) -> None:
        """Stops serving the adapter (requests running with it finish with it); LoRAError for an unknown name."""
        await self._submit(self._worker.core.adapters.unregister, name)

    def adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return list(self._adapter_paths())

    def adapter_path(self, name: str) -> str | None:
        """The folder a loaded adapter was read from (None: no adapter of that name)."""
        return self._adapter_paths().get(name)

    def _root(self, adapter: str | None, cache_salt: str | None):
        """The block-hash chain seed of requests under this adapter and salt (engine/adapters.py), read without
        changing the registry (an adapter not in memory now: the engine's seed, which finds nothing of it)."""
        adapters = self.core.adapters
        return adapters.root_for(adapters.loaded.get(adapter) if adapter is not None else None, cache_salt)

    async def share_prefix(self, token_ids: list[int], timeout: float, adapter: str | None = None,
                           cache_salt: str | None = None) -> tuple[int, bool]:
        """Makes the full blocks of a computed prompt (under `adapter` and `cache_salt`, as the request ran) available
        to other engines on the shared (remote) tier: the
        cached ones it lacks are written through, and this waits (at most `timeout` seconds) until every queued
        write is sent. Returns (full blocks found cached here, whether the writes were sent in time); (0, False)
        without a shared tier. A prefill/decode split's prefill replica calls it before it answers."""
        core = self._worker.core
        if not core.tiers.shared:
            return 0, False
        found = await self._submit(core.tiers.share, core.kv.chain_keys(token_ids, self._root(adapter, cache_salt)))
        try:
            await asyncio.wait_for(asyncio.gather(*(t.flush() for t in core.tiers.shared)), timeout)
        except asyncio.TimeoutError:
            return found, False
        return found, True

    async def wait_shared(self, token_ids: list[int], num_blocks: int, timeout: float, adapter: str | None = None,
                          cache_salt: str | None = None) -> int:
        """Waits (at most `timeout` seconds) until the shared tier holds the first `num_blocks` full blocks of the
        prompt, another engine's writes; returns how many leading blocks it holds (0 without a shared tier). What
        is still missing when it returns is computed by the request, never waited for again."""
        core = self._worker.core
        shared = core.tiers.shared[0] if core.tiers.shared else None
        keys = core.kv.chain_keys(token_ids, self._root(adapter, cache_salt))[:num_blocks]
        if shared is None or not keys:
            return 0
        deadline = self._loop.time() + timeout
        while True:
            held = await shared.contains(keys)
            if held >= len(keys) or self._loop.time() >= deadline:
                return held
            await asyncio.sleep(min(0.02, max(deadline - self._loop.time(), 0)))

    async def explain(self, prompt: PromptType) -> list[BlockReport]:
        """For each block of the prompt: where a request would take it from (hot, warm, remote, cold), or why it
        would be computed. Changes nothing in the cache."""
        ids = await self.tokenize(prompt)
        return await self._submit(explain, self._worker.core, ids)

    async def export_cache(self, path, prompts: list[PromptType] | None = None, progress=None) -> int:
        """Writes every cached block (or the full blocks of `prompts`) with its hash, token ids and the
        model fingerprint to one file at `path`; returns the number of blocks. `progress(n)` is called
        after each batch. The file is written with aiofiles, the blocks gathered on the worker."""
        from tieredkv.engine.snapshot import blocks_to_export, write_snapshot  # msgpack, aiofiles: only when used

        self._check_open()
        ids = None
        if prompts is not None:
            ids = [await self._loop.run_in_executor(self._tokenizer, self.core.factory.token_ids, p) for p in prompts]
        core = self._worker.core
        batches = await self._submit(blocks_to_export, core, ids)
        return await write_snapshot(path, core.fingerprint, core.kv_cache.dtype, _block_shape(core),
                                    lambda: self._submit(next, batches, None), progress)

    async def import_cache(self, path, progress=None) -> dict[str, int | bool]:
        """Loads a snapshot's blocks into the warm tier (cold below it; hot without either). Raises
        SnapshotError for another model's snapshot; every entry is checked, so a damaged or truncated
        file imports nothing wrong. Returns {"imported", "corrupt", "complete"}."""
        from tieredkv.engine.snapshot import read_snapshot

        self._check_open()
        core = self._worker.core
        batches, report = read_snapshot(path, core.fingerprint, core.kv_cache.dtype, _block_shape(core))
        imported = 0
        async for keys, data in batches:
            await self._submit(core.tiers.import_blocks, keys, data)
            imported += len(keys)
            if progress is not None:
                progress(len(keys))
        return {"imported": imported, **report}

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Gives the engine's memory back while it serves nothing (engine/sleep.py): level 1 the hot pool, whose
        cached blocks go down to the next tier first (pins are released), level 2 the weights too (written to a
        file under cache_dir and read back on wake). The next request, or wake(), wakes it. RequestError with
        requests in flight. Returns what was released and the process's resident memory after."""
        return await self._submit(self._worker.core.sleep, level)

    async def wake(self) -> dict[str, Any]:
        """Takes back what sleep() released (the next request does it too); returns how long it took."""
        return await self._submit(self._worker.core.wake)

    async def unpin(self, prompt: PromptType, cache_salt: str | None = None) -> int:
        """Releases what pin(prompt) pinned, so that its blocks can be evicted again. Returns the number of
        tokens released (0 when the prompt was not pinned)."""
        ids = await self.tokenize(prompt)
        return await self._submit(self._worker.core.pins.unpin, ids, self._root(None, cache_salt))

    async def clear_cache(self, tier: str = "all", demote: bool = False) -> int:
        """Empties a tier ("hot", "warm", "remote", "cold" or "all"); returns how many entries left it. "all"
        is this engine's own tiers: the remote tier, which other engines share, is emptied only when named.
        With demote=True, a tier's entries move down to the next tier instead of being dropped."""
        return await self._submit(self._worker.core.tiers.clear, tier, demote)

    async def run_in_worker(self, fn, *args):
        """Runs fn(*args) on the engine's worker thread between two steps and returns its result.

        For torch work an application does alongside the engine on CPU (see the class docstring):
        done here it shares the engine's OpenMP threads instead of starting another pool. The engine
        does not step while fn runs, so keep it short while requests are in flight.
        """
        return await self._submit(fn, *args)

    async def _submit(self, fn, *args) -> Any:
        self._check_open()
        future = self._loop.create_future()
        if not self._worker.post(fn, *args, future=future):
            raise EngineClosedError("engine closed")
        return await future

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread; its blocks are freed before the next step and its stream ends
        with finish_reason "abort". An unknown id is ignored."""
        if threading.get_ident() != self._loop_thread:
            self._worker.call_loop(self.abort, request_id)
            return
        channel = self._streams.get(request_id)
        if channel is not None:
            channel.aborted = True
            self._abort(request_id, channel)

    def _abort(self, request_id: str, channel: Channel) -> None:
        self._worker.post(self._worker.abort, request_id, channel)

    def stats(self) -> EngineStats:
        """The counters published after the last step or command: from any thread, never blocks."""
        return self._worker.snapshot


def _block_shape(core) -> tuple[int, ...]:
    """One block's data as every tier holds it: [layers, 2, block_size, kv_heads, row] (rows as stored)."""
    layers, kv, _, block_size, heads, row = core.kv_cache.shape
    return (layers, kv, block_size, heads, row)
