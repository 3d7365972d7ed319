"""The consumer's end of one request: an async iterator of chunks that always ends."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Protocol

from tieredkv.engine.outputs import StreamChunk


class StreamFront(Protocol):
    """What a stream needs of the engine that made it (AsyncEngine): starting its request, and
    forgetting it (aborting it when it has not ended)."""

    def _start(self, channel: "Channel", prompt, params, flags: dict[str, bool]) -> Any: ...

    def _forget(self, channel: "Channel", abort: bool) -> None: ...


def merge_chunks(first: StreamChunk, then: StreamChunk) -> StreamChunk:
    """Two consecutive chunks of one sample as one."""
    logprobs = None if first.logprobs is None else first.logprobs + (then.logprobs or [])
    return replace(then, text=first.text + then.text, token_ids=first.token_ids + then.token_ids, logprobs=logprobs)


class Channel:
    """Where the worker's outputs for one request land, on the event loop's thread.

    Bounded: chunks of one sample that the consumer has not taken yet are merged into one, so an unread
    stream holds at most n pending chunks (one per sample) however long it is left alone. Ends after
    every sample's final chunk, or with the first error. `closed` (set by the consumer's side)
    discards whatever still arrives.
    """

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.remaining = n
        self.pending: dict[int, StreamChunk] = {}  # sample index -> merged unread chunk, oldest first
        self.error: BaseException | None = None
        self.closed = False
        self.aborted = False  # read by the worker thread: an add that arrives after this is aborted at once
        self._waiter: asyncio.Future | None = None
        self.serial: int | None = None  # the stream's number on the link to a core process (core_client.py)

    def push(self, item: StreamChunk | BaseException) -> None:
        if self.closed:
            return
        if isinstance(item, BaseException):
            self.error = self.error or item
        else:
            prev = self.pending.pop(item.index, None)
            self.pending[item.index] = item if prev is None else merge_chunks(prev, item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> StreamChunk:
        """The next chunk; raises the request's error, or StopAsyncIteration after the last final chunk."""
        while True:
            if self.pending:
                chunk = self.pending.pop(next(iter(self.pending)))
                if chunk.finish_reason is not None:
                    self.remaining -= 1
                return chunk
            if self.remaining == 0:
                raise StopAsyncIteration
            if self.error is not None:
                raise self.error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class RequestStream:
    """What `AsyncEngine.stream` returns: `async for chunk in stream` yields StreamChunk.

    Every stream ends: with each sample's final chunk (finish_reason "stop", "length" or "abort"), or
    by raising the request's error (RequestError, StepError, SamplingError, EngineClosedError).
    The request starts at the first iteration. It is aborted, and its blocks freed before the next
    step, when the consumer leaves early in any of these ways: `await stream.aclose()`, leaving an
    `async with engine.stream(...) as stream` block, cancellation while waiting for a chunk, or the
    stream object being dropped (`async for chunk in engine.stream(...)` followed by `break`).
    """

    def __init__(self, engine: StreamFront, channel: Channel, prompt, params, flags: dict[str, bool]):
        self._engine = engine
        self._channel = channel
        self._prompt, self._params, self._flags = prompt, params, flags
        self._started = False
        self._span = None
        self._completion_tokens = 0
        self._finish_reasons: list[str] = []

    @property
    def request_id(self) -> str:
        """The request's id: what `AsyncEngine.abort` takes."""
        return self._channel.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamChunk:
        channel = self._channel
        if channel.closed:
            raise StopAsyncIteration
        if not self._started:
            self._started = True
            self._span = self._engine._start(channel, self._prompt, self._params, self._flags)
        try:
            chunk = await channel.get()
        except asyncio.CancelledError:
            self._leave(abort=True)
            raise
        except BaseException as e:
            self._leave(abort=False, error=e)
            raise
        if chunk.finish_reason is not None:
            self._finish_reasons.append(chunk.finish_reason)
            self._completion_tokens += chunk.usage.completion_tokens
        if chunk.usage is not None and self._span is not None:
            self._span.set_attributes({"tieredkv.cached_prompt_tokens": chunk.usage.cached_prompt_tokens,
                                       "tieredkv.prompt_tokens": chunk.usage.prompt_tokens,
                                       **{f"tieredkv.cached_tokens.{t}": n
                                          for t, n in chunk.usage.cached_tokens_by_tier.items()}})
        if channel.remaining == 0 and not channel.pending:  # the last chunk: the id is free again
            self._leave(abort=False)
        return chunk

    async def aclose(self) -> None:
        """Aborts the request unless it has already ended."""
        self._leave(abort=True)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self._leave(abort=True)

    def _leave(self, abort: bool, error: BaseException | None = None) -> None:
        channel = self._channel
        if channel.closed:
            return
        ended = channel.remaining == 0 or channel.error is not None
        channel.closed = True
        self._engine._forget(channel, abort=abort and self._started and not ended)
        if self._span is not None:
            if error is not None and not isinstance(error, StopAsyncIteration):
                self._span.record_exception(error)
            self._span.set_attributes({"tieredkv.completion_tokens": self._completion_tokens,
                                       "tieredkv.finish_reasons": self._finish_reasons or ["abort"]})
            self._span.end()

    def __del__(self) -> None:
        try:
            self._leave(abort=True)
        except Exception:  # interpreter shutdown, or a closed loop: nothing left to free
            pass
