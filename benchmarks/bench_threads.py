"""Torch thread count on CPU, with the machine to itself and beside one busy process, in one run.

    .venv/bin/python benchmarks/bench_threads.py

For each setting (torch's default, which is one thread per core, and num_threads=1) it measures the
time to first token of a 512-token prompt and the batch-1 decode ms/token on the default model: alone,
beside one process that keeps a core busy, and beside two. Prints a table and the ratios that pick
EngineConfig.num_threads' default.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time

from tieredkv import AsyncEngine, EngineConfig, SamplingParams

SPIN = "import time\nt = time.time()\nwhile time.time() - t < 600: pass"


async def measure(num_threads: int | None) -> tuple[float, float]:
    cfg = EngineConfig(
        compile_in_background=False, model="default", num_threads=num_threads, kv_cache_bytes=256 << 20, warm_bytes=0)
    async with await AsyncEngine.start(cfg) as engine:
        rng = random.Random(0)
        vocab = engine.info.vocab_size
        await engine.generate([rng.randrange(100, vocab) for _ in range(64)], SamplingParams(max_tokens=4))
        ttfts, decode = [], []
        for _ in range(3):
            prompt = [rng.randrange(100, vocab) for _ in range(512)]
            t0 = time.perf_counter()
            times = []
            async for _ in engine.stream(prompt, SamplingParams(max_tokens=17, ignore_eos=True)):
                times.append(time.perf_counter())
            ttfts.append(times[0] - t0)
            decode.append((times[-1] - times[0]) / (len(times) - 1) * 1000)
        return min(ttfts), min(decode)


async def main() -> None:
    rows = {}
    for busy in (0, 1, 2):
        neighbours = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
        try:
            for threads in (None, 1):
                rows[(busy, threads)] = await measure(threads)
        finally:
            for p in neighbours:
                p.kill()
    cores = len(os.sched_getaffinity(0))
    print(f"{'setting':<38}{'TTFT 512 s':>12}{'decode ms/tok':>15}")
    for (busy, threads), (ttft, dec) in rows.items():
        name = f"{busy} busy neighbours, {threads or f'default ({cores})'} threads"
        print(f"{name:<38}{ttft:>12.3f}{dec:>15.1f}")
    for busy in (0, 1, 2):
        d, one = rows[(busy, None)], rows[(busy, 1)]
        print(f"{busy} busy: default / 1 thread: TTFT {d[0] / one[0]:.2f}x, decode {d[1] / one[1]:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
