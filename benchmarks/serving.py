"""How a benchmark drives the engine, in one of two modes, with one interface:

  stream      `AsyncEngine.stream` with the engine core in a process of its own (core_process=True, the default):
              what an application embedding the engine gets, and what the figures in README and docs quote;
  core alone  the engine core stepping on the calling thread (`EngineCore.step`), nothing around it: the engine's
              own speed, beside which the stream's overhead is read.

Both serve a list of requests at once and stamp each request's tokens as they arrive (the stream: when its chunk
reaches the application; the core: after the step that produced it). Usage:

    engine = await Served.start(config, "stream")
    got = await engine.serve([(prompt, 48)])
    got.ms_per_token(), got.tok_s(), got.ttft()
    await engine.close()
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from tieredkv import AsyncEngine, EngineConfig, SamplingParams, Usage

MODES = ("stream", "core alone")

Request = tuple[list[int], int]  # (prompt token ids, new tokens: greedy, EOS ignored)


@dataclass
class Timings:
    """One `serve` call: when it started and, per request, when each of its tokens arrived, the tokens and the
    request's usage (cached prompt tokens by tier among them)."""

    t0: float
    stamps: list[list[float]]
    tokens: list[list[int]]
    usage: list[Usage]

    @property
    def cached(self) -> list[int]:
        """Prompt tokens each request found cached."""
        return [u.cached_prompt_tokens for u in self.usage]

    def tok_s(self) -> float:
        """Output tokens per second over the whole call."""
        return sum(map(len, self.stamps)) / (max(s[-1] for s in self.stamps) - self.t0)

    def ms_per_token(self, request: int = 0, skip: int = 1) -> float:
        """Milliseconds a token over a request's tokens after its first `skip` (the first comes with the prompt's
        step)."""
        s = self.stamps[request][skip:]
        return (s[-1] - s[0]) / (len(s) - 1) * 1000

    def ttft(self, request: int = 0) -> float:
        """Seconds from the call to the request's first token."""
        return self.stamps[request][0] - self.t0

    def ttfts(self) -> list[float]:
        return [s[0] - self.t0 for s in self.stamps]

    def gaps_ms(self, start: float, end: float) -> list[float]:
        """Every request's intervals between consecutive tokens that both arrived within [start, end]."""
        return [(b - a) * 1000 for s in self.stamps for a, b in zip(s, s[1:]) if start <= a and b <= end]


class Served:
    """An engine a benchmark drives in one of MODES (see the module's docstring)."""

    def __init__(self, mode: str, engine: AsyncEngine | None = None, core=None):
        self.mode, self.engine, self.core = mode, engine, core
        self.after_step: Callable[[], None] | None = None  # the core alone: called after each of its steps

    @classmethod
    async def start(cls, config: EngineConfig, mode: str = "stream") -> "Served":
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        config = config.model_copy(update={"core_process": mode == "stream"})
        if mode == "stream":
            return cls(mode, engine=await AsyncEngine.start(config))
        from tieredkv.engine.engine_core import EngineCore

        return cls(mode, core=EngineCore(config))

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size if self.engine else self.core.spec.vocab_size

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.engine else self.core.tokenizer

    @property
    def model_dir(self) -> str:
        return self.engine.info.model_dir if self.engine else str(self.core.model_dir)

    def stats(self):
        return self.engine.stats() if self.engine else self.core.stats()

    async def clear_cache(self, tier: str = "all") -> None:
        if self.engine:
            await self.engine.clear_cache(tier)
        else:
            self.core.tiers.clear(tier)

    async def serve(self, requests: list[Request], ignore_eos: bool = True, **params) -> Timings:
        """Serves the requests at once (greedy, `params` added) to their ends: each its tokens, or (ignore_eos
        False) up to them, stopping at the end of a sequence."""
        if self.engine is None:
            return self.serve_sync(requests, ignore_eos, **params)
        made = [SamplingParams(max_tokens=n, ignore_eos=ignore_eos, **params) for _, n in requests]
        return _checked(await self._stream(requests, made), requests, ignore_eos)

    def serve_sync(self, requests: list[Request], ignore_eos: bool = True, **params) -> Timings:
        """`serve` on the engine core alone, for synchronous code."""
        if self.core is None:
            raise ValueError("serve_sync steps the engine core alone; a stream is served by `serve`")
        made = [SamplingParams(max_tokens=n, ignore_eos=ignore_eos, **params) for _, n in requests]
        return _checked(self._step(requests, made), requests, ignore_eos)

    async def _stream(self, requests: list[Request], made: list[SamplingParams]) -> Timings:
        engine = self.engine
        assert engine is not None
        stamps: list[list[float]] = [[] for _ in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        usage: list[Usage] = [None] * len(requests)  # type: ignore[list-item]  # each set by its final chunk

        async def one(i: int) -> None:
            async for chunk in engine.stream(requests[i][0], made[i]):
                stamps[i].extend([time.perf_counter()] * len(chunk.token_ids))
                tokens[i].extend(chunk.token_ids)
                if chunk.usage is not None:
                    usage[i] = chunk.usage

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(requests))))
        return Timings(t0, stamps, tokens, usage)

    def _step(self, requests: list[Request], made: list[SamplingParams]) -> Timings:
        core = self.core
        reqs = [core.factory.make(p, sp) for (p, _), sp in zip(requests, made)]
        stamps: list[list[float]] = [[] for _ in requests]
        t0 = time.perf_counter()
        for r in reqs:
            if core.add_request(r):
                raise RuntimeError("request refused")
        while core.has_work():
            core.step()
            now = time.perf_counter()
            if self.after_step is not None:
                self.after_step()
            for i, r in enumerate(reqs):
                got = len(r.seqs[0].output_token_ids) if r.seqs else 0
                stamps[i].extend([now] * (got - len(stamps[i])))
        from tieredkv.engine.outputs import _usage

        tokens = [list(r.seqs[0].output_token_ids) for r in reqs]
        return Timings(t0, stamps, tokens, [_usage(r, len(t)) for r, t in zip(reqs, tokens)])

    async def close(self) -> None:
        if self.engine:
            await self.engine.close()
        else:
            self.core.close()


def _checked(got: Timings, requests: list[Request], ignore_eos: bool) -> Timings:
    counts = [len(s) for s in got.stamps]
    if any(not 0 < c <= n or (ignore_eos and c != n) for c, (_, n) in zip(counts, requests)):
        raise RuntimeError(f"token counts {counts}, asked {[n for _, n in requests]}")
    return got
