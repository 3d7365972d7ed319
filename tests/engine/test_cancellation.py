"""Leaving a stream early frees its blocks within one step; many concurrent streams leave the pool clean."""

import asyncio
import random

import pytest

from helpers import cancel_midstream, check_pool_clean, make_config
from tieredkv import SamplingParams


@pytest.fixture
async def engine(engines, llama_dir):
    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=256, max_num_seqs=64))
    yield engine
    await engine.close()


async def wait_idle(engine):
    """Everything posted to the worker so far (aborts included) has been applied, and it is idle."""
    assert not await engine.run_in_worker(engine.core.has_work), "engine did not go idle"


async def test_break_frees_blocks(engine):
    n = 0
    async for chunk in engine.stream(list(range(3, 60)), SamplingParams(max_tokens=200, ignore_eos=True)):
        n += 1
        if n == 3:
            assert engine.stats().blocks_used > 0
            break
    await wait_idle(engine)
    assert engine.stats().blocks_used == 0
    check_pool_clean(engine.core)


async def test_cancelled_task_frees_blocks(engine):
    await cancel_midstream(engine, list(range(3, 40)), SamplingParams(max_tokens=500, ignore_eos=True))
    await wait_idle(engine)
    check_pool_clean(engine.core)


async def test_exception_in_consumer_frees_blocks(engine):
    with pytest.raises(RuntimeError, match="consumer failed"):
        async for _ in engine.stream(list(range(3, 40)), SamplingParams(max_tokens=500, ignore_eos=True)):
            raise RuntimeError("consumer failed")
    await wait_idle(engine)
    check_pool_clean(engine.core)


async def test_engine_abort_ends_the_stream(engine):
    stream = engine.stream(list(range(3, 30)), SamplingParams(max_tokens=500, ignore_eos=True, n=2),
                           request_id="victim")
    reasons = {}
    async for chunk in stream:
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
        elif not reasons:
            engine.abort("victim")
    assert reasons == {0: "abort", 1: "abort"}
    await wait_idle(engine)
    check_pool_clean(engine.core)


async def test_64_concurrent_streams(engine):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 80))] for _ in range(64)]
    lengths = [rng.randrange(1, 20) for _ in range(64)]
    loop_lag = []

    async def probe():  # the event loop stays responsive while forwards run in the worker thread
        while True:
            t = asyncio.get_running_loop().time()
            await asyncio.sleep(0.005)
            loop_lag.append(asyncio.get_running_loop().time() - t)

    async def one(prompt, n):
        tokens = []
        async for chunk in engine.stream(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
            tokens.extend(chunk.token_ids)
        return tokens

    probe_task = asyncio.create_task(probe())
    results = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))
    probe_task.cancel()
    assert [len(r) for r in results] == lengths
    assert engine.stats().num_running == 0
    check_pool_clean(engine.core)
    assert len(loop_lag) > 5


async def test_close_ends_open_streams(engines, llama_dir):
    from tieredkv import EngineClosedError

    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=64))
    with pytest.raises(EngineClosedError):
        async for chunk in engine.stream([5, 6, 7], SamplingParams(max_tokens=10_000 // 16, ignore_eos=True)):
            await engine.close()
    with pytest.raises(EngineClosedError):
        engine.stream([5, 6, 7])
    with pytest.raises(EngineClosedError):
        await engine.clear_cache("hot")
