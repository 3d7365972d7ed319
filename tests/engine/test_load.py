"""1,000 concurrent streams on a 64-block pool, ~30% of them left early (break, task.cancel, abort):
afterwards nothing is held, every other stream is complete, and memory stays bounded."""

import asyncio
import os
import random

from helpers import check_pool_clean, make_config
from tieredkv import AsyncEngine, SamplingParams


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_a_thousand_streams_with_a_third_left_early(llama_dir):
    cfg = make_config(model=str(llama_dir), num_blocks=64, max_num_seqs=64, warm_bytes=0)
    async with await AsyncEngine.start(cfg) as engine:
        rng = random.Random(3)
        peak, base = 0, rss_bytes()
        done = asyncio.Event()

        async def watch():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, rss_bytes())
                await asyncio.sleep(0.05)

        async def complete(i, prompt, n):
            tokens = []
            async for chunk in engine.stream(prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                                             request_id=f"r{i}"):
                tokens.extend(chunk.token_ids)
            return len(tokens) == n

        async def leave_by_break(i, prompt, n):
            async for _ in engine.stream(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
                break
            return True

        async def leave_by_abort(i, prompt, n):
            reasons = []
            async for chunk in engine.stream(prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                                             request_id=f"r{i}"):
                engine.abort(f"r{i}")
                reasons.append(chunk.finish_reason)
            return reasons[-1] in ("abort", "length")

        watcher = asyncio.create_task(watch())
        tasks, kinds = [], []
        for i in range(1000):
            prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))]
            n = rng.randrange(2, 12)
            kind = rng.choices(["complete", "break", "cancel", "abort"], [70, 10, 10, 10])[0]
            fn = {"complete": complete, "break": leave_by_break, "abort": leave_by_abort, "cancel": complete}[kind]
            tasks.append(asyncio.create_task(fn(i, prompt, n)))
            kinds.append(kind)
        await asyncio.sleep(0.2)
        for task, kind in zip(tasks, kinds):
            if kind == "cancel":
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        done.set()
        await watcher
        for kind, result in zip(kinds, results):
            if kind == "cancel":
                assert result is True or isinstance(result, asyncio.CancelledError)
            else:
                assert result is True, (kind, result)
        assert sum(k == "complete" for k in kinds) > 600
        await engine.run_in_worker(check_pool_clean, engine.core)
        s = engine.stats()
        assert s.blocks_used == s.num_running == s.num_waiting == 0
        print(f"\npeak RSS {peak / 2**20:.0f} MiB, {(peak - base) / 2**20:.0f} MiB above the start")
        assert peak - base < 1 << 30  # unbounded queues or leaked requests would blow far past this
