"""Exact prefix-cache counters, n > 1 block sharing with copy-on-write, and the cache's LRU order."""

import random

import pytest

from helpers import check_pool_clean, make_config
from tieredkv import SamplingParams


@pytest.fixture
async def engine(engines, llama_dir):
    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=512, block_size=16))
    yield engine
    await engine.close()


def random_ids(n, seed=0, vocab=300):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


async def test_second_request_with_same_1000_token_prefix(engine):
    prompt = random_ids(1000)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = await engine.generate(prompt, params)
    second = await engine.generate(prompt, params)
    assert first.usage.cached_prompt_tokens == 0
    assert second.usage.cached_prompt_tokens == (999 // 16) * 16 == 992
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    stats = engine.stats()
    assert stats.prefix_cache_queries == 2000 and stats.prefix_cache_hits == 992
    # a different question after the same prefix shares exactly the prefix's full blocks
    third = await engine.generate(prompt + random_ids(40, seed=7), params)
    assert third.usage.cached_prompt_tokens == 1000 // 16 * 16
    check_pool_clean(engine.core)


async def test_block_aligned_prompt_recomputes_its_last_block(engine):
    prompt = random_ids(64, seed=3)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    await engine.generate(prompt, params)
    again = await engine.generate(prompt, params)
    assert again.usage.cached_prompt_tokens == 48  # never the last token, so never the last full block


async def test_parallel_samples_share_prompt_blocks_and_copy_on_write(engine):
    prompt = random_ids(40, seed=5)  # 2 full blocks + 8 tokens in a shared partial block
    n = 4
    stream = engine.stream(prompt, SamplingParams(max_tokens=6, n=n, temperature=1.0, seed=11, ignore_eos=True))
    seen_blocks = None
    finals = {}
    async for chunk in stream:
        if seen_blocks is None:
            core = engine.core
            seqs = core.requests[chunk.request_id].seqs
            assert len(seqs) == n
            # every sample holds the same two full prompt blocks, each referenced n times
            heads = {tuple(b.block_id for b in s.block_table[:2]) for s in seqs}
            assert len(heads) == 1
            assert all(b.ref_cnt == n for b in seqs[0].block_table[:2])
            seen_blocks = heads
        if chunk.finish_reason:
            finals[chunk.index] = chunk
    assert sorted(finals) == list(range(n))
    assert engine.stats().cow_copies == n - 1  # the last writer of the partial block needs no copy
    assert all(c.usage.completion_tokens == 6 for c in finals.values())
    check_pool_clean(engine.core)


async def test_child_i_uses_seed_plus_i(engine):
    prompt = random_ids(21, seed=9)
    base = SamplingParams(max_tokens=10, temperature=1.0, seed=100, ignore_eos=True)
    together = await engine.generate(prompt, base.model_copy(update={"n": 3}))
    for i in range(3):
        alone = await engine.generate(prompt, base.model_copy(update={"seed": 100 + i}))
        assert together.outputs[i].token_ids == alone.outputs[0].token_ids


async def test_caching_off_hashes_nothing(engines, llama_dir):
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=128,
                                               enable_prefix_caching=False)) as engine:
        prompt = random_ids(100, seed=2)
        for _ in range(2):
            out = await engine.generate(prompt, SamplingParams(max_tokens=3))
            assert out.usage.cached_prompt_tokens == 0
        assert engine.stats().blocks_cached == 0
        assert not engine.core.pool.cached


async def test_freed_chain_is_evicted_tail_first(engines, llama_dir):
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=24, block_size=16,
                                               warm_bytes=0)) as engine:
        prompt = random_ids(16 * 6 + 1, seed=4)  # 6 full blocks get cached
        await engine.generate(prompt, SamplingParams(max_tokens=1))
        pool = engine.core.pool
        chain = [pool.cached[k.block_hash] for k in engine.core.kv.chain_keys(prompt)]
        order = [b.block_id for b in pool.free_queue if b.block_hash is not None]
        assert order == [b.block_id for b in reversed(chain)]
        # demand for most of the pool evicts the tail of the chain, keeping its head usable
        await engine.generate(random_ids(16 * 20, seed=8), SamplingParams(max_tokens=1))
        assert engine.stats().tiers["hot"].evictions == 2
        again = await engine.generate(prompt, SamplingParams(max_tokens=1))
        assert again.usage.cached_prompt_tokens == 64  # 2 tail blocks of 6 were evicted, the head kept
        assert again.usage.cached_tokens_by_tier == {"hot": 64, "warm": 0, "remote": 0, "cold": 0}
