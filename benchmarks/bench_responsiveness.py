"""Event-loop responsiveness while the engine works: a coroutine ticking every 10 ms records how late
each tick is, on the default model, during three loads:

  1. a 6,000-token prompt submitted and prefilled;
  2. 32 streams at once (mixed prompts, 32 new tokens each);
  3. a multi-megabyte string prompt, which is rejected.

    .venv/bin/python benchmarks/bench_responsiveness.py

Prints the maximum and p99 lag per load (the engine's work runs on its worker and tokenizer threads,
so the loop should only see scheduling noise).
"""

from __future__ import annotations

import asyncio
import random
import time

from tieredkv import AsyncEngine, EngineConfig, RequestError, SamplingParams

TICK = 0.010


async def measure(work) -> tuple[float, float, int]:
    lags: list[float] = []
    done = False
    last = time.perf_counter()  # when the ticker last woke

    async def ticker():
        nonlocal last
        while not done:
            await asyncio.sleep(TICK)
            now = time.perf_counter()
            lags.append(now - last - TICK)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    last = time.perf_counter()
    await work()
    stalled = time.perf_counter() - last - TICK  # a loop blocked until the end never woke the ticker
    done = True
    await task
    lags = sorted(lags + [max(stalled, 0.0)])
    return lags[-1] * 1000, lags[max(int(len(lags) * 0.99) - 1, 0)] * 1000, len(lags)


async def main() -> None:
    async with await AsyncEngine.start(EngineConfig(
        compile_in_background=False, model="default", max_num_seqs=64)) as engine:
        rng = random.Random(0)
        vocab = engine.info.vocab_size

        async def long_prompt():
            await engine.generate([rng.randrange(100, vocab) for _ in range(6000)], SamplingParams(max_tokens=1))

        async def many_streams():
            prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(32, 400))] for _ in range(32)]
            await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=32, ignore_eos=True))
                                   for p in prompts))

        words = " ".join(rng.choice(["paged", "attention", "cache", "block", "tier"]) for _ in range(1_000_000))

        async def huge_rejected():
            for text in (words[:3_000_000], words[:1_000_000]):  # rejected before / after tokenizing
                try:
                    await engine.generate(text, SamplingParams(max_tokens=1))
                except RequestError:
                    pass
                else:
                    raise AssertionError("a multi-megabyte prompt was accepted")

        print(f"{'load':<34}{'max lag ms':>12}{'p99 lag ms':>12}{'ticks':>8}")
        for name, work in (("6,000-token prompt prefilled", long_prompt), ("32 concurrent streams", many_streams),
                           ("multi-MB prompts rejected", huge_rejected)):
            worst, p99, n = await measure(work)
            print(f"{name:<34}{worst:>12.1f}{p99:>12.1f}{n:>8}")
        s = engine.stats()
        assert s.num_running == s.num_waiting == 0
        print(f"(a tick every {TICK * 1000:.0f} ms; lag = how late it woke)")


if __name__ == "__main__":
    asyncio.run(main())
