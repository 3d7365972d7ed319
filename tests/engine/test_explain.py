"""engine.explain(prompt): where each block would come from, or why it would be computed; changes nothing."""

import random

from helpers import make_config
from tieredkv import SamplingParams

BS = 16
BLOCK_BYTES = 3 * 2 * BS * 2 * 16 * 4


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


PROMPT = ids(80, 1)  # exactly 5 blocks


async def test_a_new_prompt_then_the_same_prompt_cached(engines, llama_dir):
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0)) as engine:
        fresh = await engine.explain(PROMPT + [5, 6, 7])
        assert [r.source for r in fresh] == [None] * 6
        assert "never computed" in fresh[0].reason and "first miss" in fresh[1].reason
        assert "partial block" in fresh[5].reason and (fresh[5].start, fresh[5].end) == (80, 83)
        await engine.generate(PROMPT, SamplingParams(max_tokens=1))
        before = engine.stats()
        cached = await engine.explain(PROMPT)
        assert [r.source for r in cached] == ["hot"] * 4 + [None]
        assert "last token" in cached[4].reason
        after = engine.stats()
        assert after.tiers == before.tiers and after.blocks_cached == before.blocks_cached  # nothing changed
        out = await engine.generate(PROMPT, SamplingParams(max_tokens=1))
        assert out.usage.cached_tokens_by_tier["hot"] == 4 * BS  # what explain said


async def test_evicted_and_demoted_blocks(engines, llama_dir):
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=12, warm_bytes=0)) as engine:
        await engine.generate(PROMPT, SamplingParams(max_tokens=1))
        await engine.generate(ids(190, 2), SamplingParams(max_tokens=1))  # needs all 12 blocks: evicts PROMPT
        report = await engine.explain(PROMPT)
        assert report[0].source is None and "evicted from hot" in report[0].reason
    cfg = make_config(model=str(llama_dir), num_blocks=12, warm_bytes=16 * BLOCK_BYTES)
    async with await engines.start(cfg) as engine:
        await engine.generate(PROMPT, SamplingParams(max_tokens=1))
        await engine.generate(ids(190, 2), SamplingParams(max_tokens=1))
        assert [r.source for r in await engine.explain(PROMPT)][:4] == ["warm"] * 4


async def test_cold_entries_damaged_or_of_another_fingerprint(engines, llama_dir, tmp_path):
    path = str(tmp_path / "cold")
    cfg = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0, cold_path=path)
    async with await engines.start(cfg) as engine:
        await engine.generate(PROMPT, SamplingParams(max_tokens=1))  # persisted to cold at close
    async with await engines.start(cfg) as engine:
        assert [r.source for r in await engine.explain(PROMPT)][:4] == ["cold"] * 4
        cold = engine.core.tiers.cold
        key = engine.core.kv.chain_keys(PROMPT)[0]
        with cold.env.begin(write=True, db=cold.db_blocks) as txn:
            value = bytearray(txn.get(cold._key(key)))
            value[-1] ^= 0xFF
            txn.put(cold._key(key), bytes(value))
        report = await engine.explain(PROMPT)
        assert report[0].source is None and "authentication" in report[0].reason
    other = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0, cold_path=path, dtype="bfloat16")
    async with await engines.start(other) as engine:
        report = await engine.explain(PROMPT)
        assert report[0].source is None and "another fingerprint" in report[0].reason
        assert report[1].source is None and "first miss" in report[1].reason
