"""Greedy outputs are token-identical to transformers' generate on the same checkpoint."""

import asyncio
import json
import random

import pytest

from helpers import check_pool_clean, hf_greedy, make_config, native_takes_fp32
from tieredkv import SamplingParams

MAX_NEW = 24


def make_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731 (skip special ids)
    shared = ids(48)
    return [ids(1), ids(5), shared + ids(3), ids(16), shared + ids(20), shared[:33], ids(100), shared + ids(150)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, llama_dir, qwen2_dir):
    model_dir = llama_dir if request.param == "llama" else qwen2_dir
    prompts = make_prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


async def run_engine(engines, model_dir, prompts, batched: bool, **cfg):
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    async with await engines.start(make_config(model=str(model_dir), **cfg)) as engine:
        if batched:
            results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        else:
            results = [await engine.generate(p, params) for p in prompts]
        check_pool_clean(engine.core)
        return [r.outputs[0].token_ids for r in results], engine.stats(), [r.usage for r in results]


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("batched", [False, True], ids=["one-at-a-time", "batched"])
async def test_greedy_matches_transformers(engines, case, caching, batched):
    model_dir, prompts, expected = case
    got, stats, usage = await run_engine(engines, model_dir, prompts, batched, enable_prefix_caching=caching,
                                         num_blocks=256, max_num_batched_tokens=64)
    assert got == expected
    hits = sum(u.cached_prompt_tokens for u in usage)
    assert hits == stats.prefix_cache_hits
    if caching and not batched:
        assert hits > 0  # the shared 48-token prefix: 32 tokens (2 blocks) served per later prompt
    if not caching:
        assert hits == 0


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
async def test_greedy_matches_transformers_under_preemption(engines, case, caching):
    model_dir, prompts, expected = case
    got, stats, _ = await run_engine(engines, model_dir, prompts, True, enable_prefix_caching=caching,
                                     num_blocks=16, max_num_batched_tokens=128, offload="off")
    assert stats.num_preemptions > 0
    assert got == expected


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
async def test_greedy_matches_transformers_with_old_blocks_offloaded(engines, case, caching):
    """The same squeeze with offloading on: old blocks move to the warm tier instead of preempting."""
    model_dir, prompts, expected = case
    got, stats, _ = await run_engine(engines, model_dir, prompts, True, enable_prefix_caching=caching,
                                     num_blocks=16, max_num_batched_tokens=128, warm_bytes=1 << 20)
    assert stats.blocks_offloaded > 0 and stats.num_preemptions == 0 and stats.blocks_far == 0
    assert got == expected


async def test_block_size_8_and_32(engines, case):
    model_dir, prompts, expected = case
    for bs in (8, 32):
        got, _, _ = await run_engine(engines, model_dir, prompts, True, block_size=bs, num_blocks=128)
        assert got == expected


@pytest.fixture(scope="module", params=["graph", "native"])
async def compiled_engine(engines, case, request):
    """One engine per model on the compiled graph, and one on the CPU default (the suite turns it off elsewhere):
    the native C step where it takes fp32 weights (a build with AVX-512), else the graph again. One compile
    serves both tests below."""
    model_dir = case[0]
    config = make_config(model=str(model_dir), num_blocks=256, max_num_batched_tokens=64, compile_decode=True,
                         native_decode=request.param == "native")
    engine = await engines.start(config)
    yield engine
    await engine.close()


@pytest.mark.parametrize("batched", [False, True], ids=["one-at-a-time", "batched"])
async def test_greedy_matches_transformers_compiled_decode(case, compiled_engine, batched):
    """The same with the compiled decode path."""
    model_dir, prompts, expected = case
    engine = compiled_engine
    await engine.clear_cache("all")  # each variant computes its prompts, as a fresh engine would
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    steps = engine.core.runner.compiled.steps
    if batched:
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    else:
        results = [await engine.generate(p, params) for p in prompts]
    compiled = engine.core.runner.compiled
    assert compiled.steps > steps and getattr(compiled, "graphs", 1) == 1
    native = engine.core.config.native_decode and native_takes_fp32()
    assert engine.core.stats().decode_path == ("native" if native else "compiled")
    assert [r.outputs[0].token_ids for r in results] == expected
    await engine.run_in_worker(check_pool_clean, engine.core)
