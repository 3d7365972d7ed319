"""The engine with all tiers on: exact outputs under a tiny hot pool, restarts, swaps, cache management."""

import asyncio
import random

import pytest

from helpers import check_pool_clean, make_config, rand_ids
from tieredkv import RequestError, SamplingParams

BS = 16
BLOCK_BYTES = 3 * 2 * BS * 2 * 16 * 4  # tiny llama: layers * k|v * block * kv_heads * head_dim * fp32


SYSTEMS = [rand_ids(160, seed=s) for s in range(4)]  # 4 shared system prompts of 10 blocks each
WORKLOAD = [SYSTEMS[i % 4] + rand_ids(9, seed=100 + i) for i in range(12)]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


async def run(engines, model_dir, prompts, **cfg):
    async with await engines.start(make_config(model=str(model_dir), **cfg)) as engine:
        outs = [await engine.generate(p, PARAMS) for p in prompts]
        check_pool_clean(engine.core)
        return [o.outputs[0].token_ids for o in outs], [o.usage for o in outs], engine.stats()


async def test_tiny_hot_pool_with_all_tiers_matches_unconstrained(engines, llama_dir, tmp_path):
    expected, _, _ = await run(engines, llama_dir, WORKLOAD, num_blocks=512, warm_bytes=0)
    got, usage, stats = await run(engines, llama_dir, WORKLOAD, num_blocks=24, warm_bytes=12 * BLOCK_BYTES,
                                  cold_path=str(tmp_path / "cold"))
    assert got == expected
    warm, cold = stats.tiers["warm"], stats.tiers["cold"]
    assert warm.demotions > 0 and warm.promotions > 0 and warm.evictions > 0
    assert stats.tiers["hot"].evictions >= warm.demotions
    assert cold.demotions > 0 and cold.promotions > 0
    assert sum(u.cached_tokens_by_tier["warm"] for u in usage) == warm.promotions * BS
    assert sum(u.cached_tokens_by_tier["cold"] for u in usage) == cold.promotions * BS
    for u in usage:
        assert u.cached_prompt_tokens == sum(u.cached_tokens_by_tier.values())
    assert stats.tiers["hot"].hits + warm.hits + cold.hits == stats.prefix_cache_hits
    assert cold.failures == 0 and warm.failures == 0


async def test_restart_serves_prefixes_from_disk(engines, llama_dir, tmp_path):
    path = str(tmp_path / "cold")
    first, usage1, _ = await run(engines, llama_dir, WORKLOAD[:4], num_blocks=256, warm_bytes=0, cold_path=path)
    assert all(u.cached_prompt_tokens == 0 for u in usage1)
    again, usage2, stats = await run(engines, llama_dir, WORKLOAD[:4], num_blocks=256, warm_bytes=0, cold_path=path)
    assert again == first
    assert [u.cached_tokens_by_tier["cold"] for u in usage2] == [160] * 4
    assert stats.tiers["cold"].hits == 640 and stats.tiers["cold"].failures == 0


async def test_a_close_writes_back_more_than_the_write_queue_holds(engines, llama_dir, tmp_path, monkeypatch):
    """The close writes every cached block to disk; the cold tier's bound on queued writes (which drops demotions
    while serving rather than slow the steps) makes the close wait for the disk instead of dropping blocks."""
    from tieredkv.tiers import cold, manager

    monkeypatch.setattr(cold, "MAX_PENDING", 3 * BLOCK_BYTES)
    monkeypatch.setattr(manager, "_BATCH", 2)  # the close exports 2 blocks at a time: the third waits for room
    path = str(tmp_path / "cold")
    first, _, stats = await run(engines, llama_dir, WORKLOAD[:4], num_blocks=256, warm_bytes=0, cold_path=path)
    again, usage, stats = await run(engines, llama_dir, WORKLOAD[:4], num_blocks=256, warm_bytes=0, cold_path=path)
    assert again == first
    assert [u.cached_tokens_by_tier["cold"] for u in usage] == [160] * 4
    assert stats.tiers["cold"].failures == 0


@pytest.mark.parametrize("change", [{"block_size": 8}, {"dtype": "bfloat16"}], ids=["block-size", "dtype"])
async def test_other_fingerprint_on_the_same_path_gets_no_hits(engines, llama_dir, tmp_path, change):
    path = str(tmp_path / "cold")
    await run(engines, llama_dir, WORKLOAD[:2], num_blocks=256, warm_bytes=0, cold_path=path)
    _, usage, stats = await run(engines, llama_dir, WORKLOAD[:2], num_blocks=256, warm_bytes=0, cold_path=path,
                                **change)
    assert all(u.cached_tokens_by_tier["cold"] == 0 for u in usage)
    assert stats.tiers["cold"].hits == 0
    # the first model's entries are still there for it
    _, usage, _ = await run(engines, llama_dir, WORKLOAD[:2], num_blocks=256, warm_bytes=0, cold_path=path)
    assert all(u.cached_tokens_by_tier["cold"] == 160 for u in usage)


async def test_demoted_down_to_cold_and_promoted_back(engines, llama_dir, tmp_path):
    cfg = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=32 * BLOCK_BYTES,
                      cold_path=str(tmp_path / "cold"))
    async with await engines.start(cfg) as engine:
        first = await engine.generate(SYSTEMS[1] + [4, 5], PARAMS)
        await engine.clear_cache("hot", demote=True)
        await engine.clear_cache("warm", demote=True)
        await asyncio.to_thread(engine.core.tiers.cold.flush_sync)
        again = await engine.generate(SYSTEMS[1] + [4, 5], PARAMS)
        assert again.usage.cached_tokens_by_tier == {"hot": 0, "warm": 0, "remote": 0, "cold": 160}
        assert again.outputs[0].token_ids == first.outputs[0].token_ids


async def test_preemption_swaps_to_warm_and_restores(engines, llama_dir):
    prompts = [rand_ids(40 + 7 * i, seed=i) for i in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outs = {}
    for label, cfg in (("big", dict(num_blocks=256, warm_bytes=0)),
                       ("swap", dict(num_blocks=14, warm_bytes=64 * BLOCK_BYTES, enable_prefix_caching=False,
                                     offload="off"))):
        async with await engines.start(make_config(model=str(llama_dir), **cfg)) as engine:
            res = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            outs[label] = [r.outputs[0].token_ids for r in res]
            stats = engine.stats()
            check_pool_clean(engine.core)
    assert outs["swap"] == outs["big"]
    assert stats.num_preemptions > 0 and stats.num_swaps == stats.num_preemptions


async def test_prefill_clear_cache_and_pin(engines, llama_dir):
    cfg = make_config(model=str(llama_dir), num_blocks=40, warm_bytes=64 * BLOCK_BYTES, max_pinned_fraction=0.5)
    async with await engines.start(cfg) as engine:
        system = SYSTEMS[0]
        usage = await engine.prefill(system)
        assert usage.completion_tokens == 0 and engine.stats().blocks_cached == 10
        out = await engine.generate(system + [5, 6, 7], PARAMS)
        assert out.usage.cached_tokens_by_tier["hot"] == 160

        assert await engine.clear_cache("hot") == 10
        out = await engine.generate(system + [5, 6, 8], PARAMS)
        assert out.usage.cached_prompt_tokens == 0  # cleared, not demoted
        assert await engine.clear_cache("hot", demote=True) == 10
        out = await engine.generate(system + [5, 6, 9], PARAMS)
        assert out.usage.cached_tokens_by_tier == {"hot": 0, "warm": 160, "remote": 0, "cold": 0}
        await engine.clear_cache("all")

        assert await engine.pin(system) == 160
        assert engine.stats().blocks_pinned == 10
        for i in range(1, 4):  # other prompts churn the rest of the pool; the pinned prefix stays hot
            await engine.generate(SYSTEMS[i] + [9], PARAMS)
        out = await engine.generate(system + [1, 2], PARAMS)
        assert out.usage.cached_tokens_by_tier["hot"] == 160
        with pytest.raises(RequestError, match="pinned budget"):
            await engine.pin(SYSTEMS[1] + SYSTEMS[2])
        assert await engine.unpin(system) == 160
        check_pool_clean(engine.core)
        with pytest.raises(ValueError, match="tier must be"):
            await engine.clear_cache("lukewarm")


@pytest.mark.parametrize("damage", ["flip-payloads", "flip-anywhere", "truncate", "zero"])
async def test_a_damaged_cold_store_never_changes_a_token(engines, llama_dir, tmp_path, damage):
    path = tmp_path / "cold"
    expected, _, _ = await run(engines, llama_dir, WORKLOAD[:6], num_blocks=512, warm_bytes=0,
                               enable_prefix_caching=False)
    await run(engines, llama_dir, WORKLOAD[:6], num_blocks=256, warm_bytes=0, cold_path=str(path))  # persisted at close
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    rng = random.Random(damage)
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "zero":
        raw = bytearray(len(raw))
    else:
        for _ in range(200):
            at = rng.randrange(len(raw)) if damage == "flip-anywhere" else rng.randrange(len(raw) // 2, len(raw))
            raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    got, _, stats = await run(engines, llama_dir, WORKLOAD[:6], num_blocks=256, warm_bytes=0, cold_path=str(path))
    assert got == expected  # served from cache where intact, recomputed where not
