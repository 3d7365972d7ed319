"""The asyncio front: `async for chunk in engine.stream(prompt)`, many streams on one engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from tieredkv.config import EngineConfig, SamplingParams
from tieredkv.engine_core import EngineCore, StepError
from tieredkv.outputs import CompletionOutput, EngineStats, RequestOutput, StreamChunk, Usage
from tieredkv.sequence import Request
from tieredkv.tokenizer import PromptType

log = logging.getLogger("tieredkv")


def _run_calls(calls: list[tuple]) -> list[tuple[bool, object]]:
    results = []
    for fn, args, _ in calls:
        try:
            results.append((True, fn(*args)))
        except Exception as e:
            results.append((False, e))
    return results


class EngineClosedError(RuntimeError):
    """The engine was closed while the request was pending or running."""


def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredkv-step")


class AsyncEngine:
    """Runs the engine loop as an asyncio task; the engine's torch work runs in one worker thread.

    Only the loop task touches the core between steps: `stream` and `abort` queue their changes and
    the loop applies them before the next step, so a step never races with them.

    Loading, every step and closing run on that same thread. On CPU this matters for speed: torch's
    OpenMP runtime (libgomp) keeps a pool of helper threads per thread that starts parallel work, and
    once the helpers of all pools outnumber the cores it stops spin-waiting between parallel regions
    and puts them to sleep instead. A forward is thousands of short parallel regions, so every one
    then pays a wake-up: steps measured 10-25% slower when the model was loaded on one thread and
    run on another. CPU-heavy torch work an application does next to the engine can go through
    `run_in_worker` for the same reason.
    """

    def __init__(self, core: EngineCore, executor: ThreadPoolExecutor | None = None):
        self._core = core
        self._executor = executor or _worker()
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._pending_calls: list[tuple] = []  # (fn, args, future): run by the loop between steps
        self._wake = asyncio.Event()
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tieredkv-engine")

    @classmethod
    async def start(cls, config: EngineConfig | None = None, **kwargs) -> "AsyncEngine":
        """Loads the model (on the worker thread) and starts the loop. kwargs build an EngineConfig when
        none is given."""
        config = config or EngineConfig(**kwargs)
        executor = _worker()
        try:
            core = await asyncio.get_running_loop().run_in_executor(executor, EngineCore, config)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(core, executor)

    @property
    def core(self) -> EngineCore:
        return self._core

    @property
    def tokenizer(self):
        return self._core.tokenizer

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Stops the loop; open streams end with EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        await self._task
        for queue in self._queues.values():
            queue.put_nowait(EngineClosedError("engine closed"))
        self._queues.clear()
        for _, _, future in self._pending_calls:
            if not future.done():
                future.set_exception(EngineClosedError("engine closed"))
        self._pending_calls.clear()
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._core.close)
        finally:
            self._executor.shutdown(wait=True)

    # -- requests --------------------------------------------------------------------------------

    def stream(
        self, prompt: PromptType, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        """Validates now (raising before anything is allocated); the request starts on first iteration.

        Leaving the `async for` early (break, exception, cancellation) aborts the request.
        """
        if self._closed:
            raise EngineClosedError("engine closed")
        req = self._core.make_request(prompt, params or SamplingParams(), request_id)
        return self._iterate(req)

    async def _iterate(self, req: Request) -> AsyncIterator[StreamChunk]:
        if self._closed:
            raise EngineClosedError("engine closed")
        rid = req.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._pending_adds.append(req)
        self._wake.set()
        remaining = req.params.n
        span = self._core.telemetry.start_request_span(req)
        completion, reasons = 0, []
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    span.record_exception(item)
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                    reasons.append(item.finish_reason)
                    completion += item.usage.completion_tokens
                    span.set_attributes({"tieredkv.cached_prompt_tokens": item.usage.cached_prompt_tokens,
                                         **{f"tieredkv.cached_tokens.{t}": n
                                            for t, n in item.usage.cached_tokens_by_tier.items()}})
                yield item
        finally:
            self._queues.pop(rid, None)
            if remaining:
                self.abort(rid)
            span.set_attributes({"tieredkv.completion_tokens": completion,
                                 "tieredkv.finish_reasons": reasons or ["abort"]})
            span.end()

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> RequestOutput:
        """The whole result of one request (all n samples)."""
        params = params or SamplingParams()
        outputs = [CompletionOutput(i) for i in range(params.n)]
        texts: list[list[str]] = [[] for _ in range(params.n)]
        rid, usage = None, []
        async for chunk in self.stream(prompt, params, request_id=request_id):
            rid = chunk.request_id
            out = outputs[chunk.index]
            texts[chunk.index].append(chunk.text)
            out.token_ids.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                out.finish_reason = chunk.finish_reason
                usage.append(chunk.usage)
        for out, parts in zip(outputs, texts):
            out.text = "".join(parts)
        total = Usage(usage[0].prompt_tokens, usage[0].cached_prompt_tokens,
                      sum(u.completion_tokens for u in usage), usage[0].cached_tokens_by_tier)
        return RequestOutput(rid, outputs, total)

    async def prefill(self, prompt: PromptType) -> Usage:
        """Computes and caches the prompt's KV without generating; returns its usage."""
        if self._closed:
            raise EngineClosedError("engine closed")
        req = self._core.make_request(prompt, SamplingParams(max_tokens=1))
        req.prefill_only = True
        usage = None
        async for chunk in self._iterate(req):
            usage = chunk.usage
        return usage

    async def clear_cache(self, tier: str = "all", demote: bool = False) -> int:
        """Empties a tier ("hot", "warm", "cold" or "all"); returns how many entries left it. With
        demote=True, a hot or warm tier's entries move down to the next tier instead of being dropped."""
        return await self._between_steps(self._core.clear_cache, tier, demote)

    async def pin(self, prompt: PromptType) -> int:
        """Keeps the prompt's full blocks in the hot tier until unpin (prefilling them if needed),
        within max_pinned_fraction of the pool. Returns the number of tokens pinned."""
        ids = self._core.tokenizer.to_token_ids(prompt)
        await self.prefill(ids)
        return await self._between_steps(self._core.pin, ids)

    async def unpin(self, prompt: PromptType) -> int:
        return await self._between_steps(self._core.unpin, self._core.tokenizer.to_token_ids(prompt))

    async def run_in_worker(self, fn, *args):
        """Runs fn(*args) on the engine's worker thread between two steps and returns its result.

        For torch work an application does alongside the engine on CPU (see the class docstring):
        done here it shares the engine's OpenMP threads instead of starting another pool. The engine
        does not step while fn runs, so keep it short while requests are in flight.
        """
        return await self._between_steps(fn, *args)

    async def _between_steps(self, fn, *args):
        if self._closed:
            raise EngineClosedError("engine closed")
        future = asyncio.get_running_loop().create_future()
        self._pending_calls.append((fn, args, future))
        self._wake.set()
        return await future

    def abort(self, request_id: str) -> None:
        """Aborts a request; its blocks are freed before the next step and its stream ends with "abort"."""
        self._pending_aborts.append(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._core.stats()

    # -- the loop --------------------------------------------------------------------------------

    def _deliver(self, chunks: list[StreamChunk]) -> None:
        for chunk in chunks:
            queue = self._queues.get(chunk.request_id)
            if queue is not None:
                queue.put_nowait(chunk)

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        aborts, self._pending_aborts = self._pending_aborts, []
        aborted = set(aborts)
        for req in adds:
            if req.request_id not in aborted:
                self._core.add_request(req)
        for rid in aborts:
            self._deliver(self._core.abort(rid))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            self._apply_pending()
            if self._pending_calls:  # cache management may wait on disk: run it in the step thread
                calls, self._pending_calls = self._pending_calls, []
                results = await loop.run_in_executor(self._executor, _run_calls, calls)
                for (_, _, future), (ok, value) in zip(calls, results):
                    if not future.done():
                        future.set_result(value) if ok else future.set_exception(value)
                continue
            if not self._core.has_work():
                self._wake.clear()
                if not (self._pending_adds or self._pending_aborts or self._pending_calls or self._closed):
                    await self._wake.wait()
                continue
            try:
                chunks = await loop.run_in_executor(self._executor, self._core.step)
            except StepError as e:
                log.exception("engine step failed; aborted %s", e.request_ids)
                for rid in e.request_ids:
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(e)
                continue
            except Exception as e:  # a bug below the engine: fail what is in flight, keep serving
                log.exception("engine step raised; aborting every request in flight")
                for rid in list(self._core.requests):
                    self._core.abort(rid)
                for queue in self._queues.values():
                    queue.put_nowait(e)
                continue
            self._deliver(chunks)
        for rid in list(self._core.requests):
            self._core.abort(rid)
