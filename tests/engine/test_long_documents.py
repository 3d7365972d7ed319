"""Documents whose KV outgrows the hot pool: old blocks live in the warm tier as far blocks, attention
reads them in place, and the output is the same as with a pool that holds everything (and transformers)."""

import asyncio
import random

import pytest
import torch

from helpers import check_pool_clean, check_pool_consistent, drive, hf_greedy, make_config
from tieredkv import RequestError, SamplingParams

BS = 16
BLOCK_BYTES = 3 * 2 * BS * 2 * 16 * 4  # tiny llama: layers * k|v * block * kv_heads * head_dim * fp32
NEW = 64
SMALL = dict(num_blocks=8, warm_bytes=200 * BLOCK_BYTES, max_num_batched_tokens=256)


def doc(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 440) for _ in range(n)]


DOC_A, DOC_B = doc(1000, 1), doc(1000, 2)


@pytest.fixture(autouse=True, params=["in_place", "staged"])
def far_mode(request):
    """Every test twice: far blocks read in place (CPU), and staged per layer (the CUDA path's logic)."""
    return request.param


@pytest.fixture
def small(far_mode):
    """A hot pool of 8 blocks beside a warm tier of 200, far blocks read as the test's mode says."""
    return dict(SMALL, offload=far_mode)


@pytest.fixture(scope="module")
def expected(llama_dir):
    return hf_greedy(llama_dir, [DOC_A, DOC_B], NEW)


async def generate(engine, prompt, n=1, max_tokens=NEW):
    out = await engine.generate(prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True))
    return out


async def test_a_document_larger_than_the_hot_pool_matches_transformers(engines, llama_dir, expected, far_mode, small):
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=128)) as engine:
        assert (await generate(engine, DOC_A)).outputs[0].token_ids == expected[0]  # unconstrained
        assert engine.stats().blocks_offloaded == 0
    async with await engines.start(make_config(model=str(llama_dir), **small)) as engine:
        core = engine.core
        staged = core.runner.far_base is not None
        # the pool, the far tail in place, and the scratch block
        assert staged == (far_mode == "staged") and core.kv_cache.shape[2] == 8 + (0 if staged else 200) + 1
        out = await generate(engine, DOC_A)
        assert out.outputs[0].token_ids == expected[0]
        assert core.runner.staged_steps > 0 if staged else core.runner.staged_steps == 0
        # every staged layer's far blocks were read ahead (layer 0's as the step was planned, each next one's
        # while the layer before computed), none copied at its own gather
        layers = core.model.spec.num_layers
        assert (core.runner.read_ahead_layers, core.runner.late_layers) == (core.runner.staged_steps * layers, 0)
        stats = engine.stats()
        # 67 blocks of KV in a pool of 8: everything but the last few went to the warm tier, in place
        assert stats.blocks_offloaded >= 67 - 8 and stats.num_preemptions == 0
        assert stats.tiers["warm"].demotions == stats.blocks_offloaded and stats.tiers["warm"].promotions == 0
        check_pool_clean(engine.core)


async def test_two_samples_share_the_offloaded_prompt(engines, llama_dir, expected, small):
    async with await engines.start(make_config(model=str(llama_dir), **small)) as engine:
        out = await generate(engine, DOC_A, n=2)
        assert [o.token_ids for o in out.outputs] == [expected[0], expected[0]]
        # the prompt's far blocks are shared, not copied: 62 full prompt blocks, at most 8 blocks hot
        assert engine.stats().blocks_offloaded < 62 + 2 * (NEW // BS + 1)
        check_pool_clean(engine.core)


async def test_two_long_documents_at_once(engines, llama_dir, expected, far_mode, small):
    async with await engines.start(make_config(model=str(llama_dir), **small)) as engine:
        outs = await asyncio.gather(generate(engine, DOC_A), generate(engine, DOC_B))
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert engine.stats().num_preemptions == 0
        runner = engine.core.runner
        if far_mode == "staged":  # a forward stages the far blocks of one document (8 hot at most besides)
            assert 0 < runner.peak_staged_blocks <= 8 + 67 and runner.far_base == 8  # not 2 x 67
        else:
            assert runner.peak_staged_blocks == 0
        check_pool_clean(engine.core)


async def test_an_abort_midway_releases_every_tier(engines, llama_dir, small):
    async with await engines.start(make_config(model=str(llama_dir), **small)) as engine:
        params = SamplingParams(max_tokens=NEW, n=2, ignore_eos=True)
        seen = 0
        async for _ in engine.stream(DOC_A, params):
            seen += 1
            if seen == 1:  # the document's first blocks are far blocks now, and explain says so
                stats = engine.stats()  # one snapshot (the worker keeps stepping meanwhile)
                assert stats.blocks_far > 0 and stats.tiers["warm"].used_bytes == stats.blocks_far * BLOCK_BYTES
                assert [r.source for r in (await engine.explain(DOC_A))[:3]] == ["warm"] * 3
            if seen == 5:
                break
        await asyncio.sleep(0.2)  # the abort is applied between steps on the worker
        for _ in range(50):
            if not engine.core.has_work():
                break
            await asyncio.sleep(0.05)
        check_pool_clean(engine.core)


async def test_a_repeat_reuses_the_document_from_warm_in_place(engines, llama_dir, expected, small):
    async with await engines.start(make_config(model=str(llama_dir), **small)) as engine:
        first = await generate(engine, DOC_A)
        again = await generate(engine, DOC_A)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids == expected[0]
        by_tier = again.usage.cached_tokens_by_tier
        # the old blocks were found in warm and used where they are, the last ones in hot
        assert by_tier["warm"] >= (len(DOC_A) // BS - 8) * BS and by_tier["cold"] == 0
        assert by_tier["hot"] + by_tier["warm"] == (len(DOC_A) - 1) // BS * BS  # the hot tail too
        warm = engine.stats().tiers["warm"]
        assert warm.promotions == 0 and warm.hits == by_tier["warm"]
        check_pool_clean(engine.core)


async def test_a_repeat_from_cold_after_a_restart_is_placed_in_warm(engines, llama_dir, expected, tmp_path, small):
    cfg = make_config(model=str(llama_dir), cold_path=str(tmp_path / "cold"), **small)
    async with await engines.start(cfg) as engine:
        await generate(engine, DOC_A)  # closing persists every cached block to the cold tier
    async with await engines.start(cfg) as engine:
        again = await generate(engine, DOC_A)
        assert again.outputs[0].token_ids == expected[0]
        # 62 blocks read from disk: more than hot holds, so they went to warm slots as far blocks
        assert again.usage.cached_tokens_by_tier == {"hot": 0, "warm": 0, "remote": 0,
                                                     "cold": (len(DOC_A) - 1) // BS * BS}
        assert engine.stats().tiers["hot"].promotions == 0
        check_pool_clean(engine.core)


async def test_a_request_beyond_hot_and_warm_is_refused_with_the_numbers(engines, llama_dir):
    cfg = make_config(model=str(llama_dir), num_blocks=8, warm_bytes=40 * BLOCK_BYTES)
    async with await engines.start(cfg) as engine:
        with pytest.raises(RequestError, match="needs up to 67 KV blocks but the pool has 8 and the warm tier "
                                               "lends 40 more"):
            engine.stream(DOC_A, SamplingParams(max_tokens=NEW))
        check_pool_clean(engine.core)


def test_pool_consistent_while_offloaded(engines, llama_dir, small):
    """Step by step through two long documents and a fork: reference counts hold in both tiers."""

    core = engines.core(make_config(model=str(llama_dir), **small))
    for i, prompt in enumerate((DOC_A[:300], DOC_B[:400])):
        core.add_request(core.factory.make(prompt, SamplingParams(max_tokens=20, n=1 + i, ignore_eos=True)))
    steps = []
    drive(core, each_step=lambda n, _: (check_pool_consistent(core), steps.append(n)))
    assert core.scheduler.room.offloaded_blocks > 0 and len(steps) > 20
    check_pool_clean(core)


async def test_the_triton_kernels_read_far_blocks(engines, llama2_dir, far_mode, small):
    """The Triton attention kernels (under the interpreter here) over far blocks: in place, by their ids
    in the extended cache tensor, or staged into the per-layer buffer."""
    cfg = make_config(model=str(llama2_dir), attention_backend="triton", **{**small, "num_blocks": 4})
    prompt = DOC_A[:80]  # 5 blocks on a hot pool of 4: the first ones are read as far blocks
    async with await engines.start(cfg) as engine:
        out = await generate(engine, prompt, max_tokens=4)
        assert engine.core.runner.ops.name == "triton" and engine.stats().blocks_offloaded > 0
        check_pool_clean(engine.core)
    async with await engines.start(make_config(model=str(llama2_dir), num_blocks=64)) as engine:
        assert out.outputs[0].token_ids == (await generate(engine, prompt, max_tokens=4)).outputs[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_long_document_on_cuda_streams_far_blocks_from_pinned_memory(engines, llama_dir, expected, far_mode,
                                                                             small):
    cfg = make_config(model=str(llama_dir), device="cuda", dtype="float32", **small)
    async with await engines.start(cfg) as engine:
        assert engine.core.tiers.warm.slab.is_pinned() and engine.core.runner.far_base == 8
        outs = await asyncio.gather(generate(engine, DOC_A), generate(engine, DOC_B, n=2))
        assert outs[0].outputs[0].token_ids == expected[0]
        assert [o.token_ids for o in outs[1].outputs] == [expected[1]] * 2
        runner = engine.core.runner
        assert runner.staged_steps > 0 and runner.far_in_place and runner.stage_stream is not None
        layers = engine.core.model.spec.num_layers
        assert (runner.read_ahead_layers, runner.late_layers) == (runner.staged_steps * layers, 0)
        check_pool_clean(engine.core)


async def test_without_prefix_caching(engines, llama_dir, expected, small):
    """Far blocks without hashes: offloaded, read, and given back to warm as free slots, not cache."""
    cfg = make_config(model=str(llama_dir), enable_prefix_caching=False, **small)
    async with await engines.start(cfg) as engine:
        outs = await asyncio.gather(generate(engine, DOC_A, n=2), generate(engine, DOC_B))
        assert [o.token_ids for o in outs[0].outputs] == [expected[0]] * 2
        assert outs[1].outputs[0].token_ids == expected[1]
        assert engine.stats().blocks_offloaded > 0 and not engine.core.tiers.warm.entries
        # a sequence holding far blocks is never preempted for another's block (it would be recomputed
        # from scratch, its far blocks thrown away): the one short of room offloads its own old blocks
        assert engine.stats().num_preemptions == 0
        check_pool_clean(engine.core)
