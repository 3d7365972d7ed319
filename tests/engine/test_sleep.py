"""An idle engine gives its memory back (engine/sleep.py): sleep levels 1 and 2, waking on the next request with
the same output and the prefix from the tier it went to, idle_sleep_s, and the server's endpoints."""

import asyncio

import aiohttp
import pytest
import torch

from helpers import check_pool_clean, fresh_cache, make_config
from tieredkv import AsyncEngine, RequestError, SamplingParams
from tieredkv.engine.sleep import _host_bytes, release_pages, weight_memory

from test_tiers_engine import BLOCK_BYTES, rand_ids

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT = rand_ids(200, seed=77)  # 12 full blocks


async def answer(engine, prompt=PROMPT):
    out = await engine.generate(prompt, PARAMS)
    return out.outputs[0].token_ids, out.usage


@pytest.mark.parametrize("tiers", ["warm", "cold", "warm+cold"])
async def test_level_1_gives_the_pool_back_and_the_next_request_reads_its_prefix_below(llama_dir, tmp_path, tiers):
    """Without a tier outside memory, hot's blocks go to warm; with cold, hot's and warm's go there (the warm+cold
    case: the prompt's blocks sit in warm, evicted from hot by others, before it sleeps)."""
    extra = {"warm_bytes": 64 * BLOCK_BYTES}
    if tiers != "warm":
        extra = {"warm_bytes": 64 * BLOCK_BYTES if tiers == "warm+cold" else 0, "cold_path": str(tmp_path / "cold")}
    async with await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=64, **extra)) as engine:
        want, _ = await answer(engine)
        if tiers == "warm+cold":
            await engine.clear_cache("hot", demote=True)  # into warm
            assert engine.core.tiers.warm.contains_sync(engine.core.kv.chain_keys(PROMPT)) == 12
        await engine.pin(rand_ids(48, seed=78))
        released = await engine.sleep(1)
        assert released["level"] == 1 and released["pins_released"] == 1
        assert released["blocks_demoted"] >= 12 and released["kv_bytes_released"] > 0
        stats = engine.stats()
        assert stats.sleep_level == 1 and stats.blocks_cached == 0 and stats.blocks_pinned == 0
        assert await engine.sleep(1) == released  # asleep already: nothing more to do
        if tiers == "warm+cold":
            assert not engine.core.tiers.warm.entries
        got, usage = await answer(engine)  # wakes it; the blocks were written before sleep returned
        assert got == want and usage.cached_tokens_by_tier[tiers.split("+")[-1]] == 12 * 16
        assert engine.stats().sleep_level == 0
        check_pool_clean(engine.core)


async def test_level_2_gives_the_weights_back_and_reads_them_back_unchanged(llama_dir, tmp_path):
    cfg = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0,
                      cache_dir=str(fresh_cache(tmp_path / "cache")))
    async with await AsyncEngine.start(cfg) as engine:
        want, _ = await answer(engine)
        regions = weight_memory(engine.core.model)
        assert sum(n for _, n, _ in regions) >= engine.stats().weight_bytes
        before = [bytes(_host_bytes(a, n)) for a, n, _ in regions]
        released = await engine.sleep(2)
        assert released["weight_bytes_released"] >= engine.stats().weight_bytes > 0
        assert list((tmp_path / "cache" / "sleep").glob("weights-*.bin"))  # the spill file, while asleep
        woke = await engine.wake()
        assert woke["was_level"] == 2 and not list((tmp_path / "cache" / "sleep").glob("weights-*.bin"))
        assert [bytes(_host_bytes(a, n)) for a, n, _ in regions] == before
        got, usage = await answer(engine)
        assert got == want and usage.cached_prompt_tokens == 0  # no tier below: the prefix is computed again
        await engine.sleep(1)
        assert (await engine.sleep(2))["level"] == 2  # deeper from level 1
        assert (await answer(engine))[0] == want  # the request wakes it from level 2
        await engine.sleep(2)
    assert not list((tmp_path / "cache" / "sleep").glob("weights-*.bin"))  # closed asleep: the file is gone


async def test_level_2_gives_back_only_the_sleeping_engines_weights(llama_dir, tmp_path):
    """Another model's packed weight in the same process (its handle in kernels/linear.py's process-wide table, as
    every engine's packed weights are where the native step or the graph reads them) reads the same while an engine
    sleeps at level 2, and after that engine is closed asleep (its weights' file discarded, nothing restored)."""
    from tieredkv.kernels.dense import PackedWeight

    g = torch.Generator().manual_seed(5)
    other = PackedWeight(torch.randn(256, 128, generator=g), handle=True)
    x = torch.randn(3, 128, generator=g)
    want = other.forward(x)
    cfg = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0, cache_dir=str(fresh_cache(tmp_path)))
    engine = await AsyncEngine.start(cfg)
    try:
        await answer(engine)
        await engine.sleep(2)
        assert torch.equal(other.forward(x), want)
    finally:
        await engine.close()
    assert torch.equal(other.forward(x), want)


async def test_sleep_is_refused_while_requests_run(llama_dir):
    async with await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0)) as engine:
        async with engine.stream(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True)) as stream:
            await stream.__anext__()
            with pytest.raises(RequestError, match="in flight"):
                await engine.sleep(1)
        with pytest.raises(RequestError, match="level"):
            await engine.sleep(3)


async def test_idle_sleep_then_the_next_request_wakes_it(llama_dir):
    cfg = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=64 * BLOCK_BYTES, idle_sleep_s=0.2)
    async with await AsyncEngine.start(cfg) as engine:
        want, _ = await answer(engine)
        for _ in range(50):
            await asyncio.sleep(0.05)
            if engine.stats().sleep_level:
                break
        assert engine.stats().sleep_level == 1
        got, usage = await answer(engine)
        assert got == want and usage.cached_tokens_by_tier["warm"] == 12 * 16 and engine.stats().sleep_level == 0


def test_a_read_only_file_mapping_is_never_taken_for_memory_to_release(tmp_path):
    import numpy as np
    import torch

    from tieredkv.engine.sleep import writable_private
    from tieredkv.platform.malloc_tuning import anonymous_memory

    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (64 << 10))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")  # as a loader reading a file in place would hold it
    anon, heap = anonymous_memory(64 << 10), torch.ones(1000)
    assert writable_private([(mapped.ctypes.data, 4096), (anon.data_ptr(), 4096), (heap.data_ptr(), 4000)]) == \
        [False, True, True]


def test_released_pages_read_as_zeros_and_stay_usable():
    import mmap

    import torch

    from tieredkv.platform.malloc_tuning import anonymous_memory

    page = mmap.PAGESIZE
    t = anonymous_memory(16 * page)
    t.fill_(7)
    assert release_pages(t.data_ptr() + 100, 8 * page) == 7 * page  # whole pages inside the range only
    assert int(t[:page].sum()) == 7 * page and int(t[page : 8 * page].sum()) == 0
    assert torch.all(t[8 * page :] == 7)
    t[page : 2 * page] = 3
    assert int(t[page : 2 * page].sum()) == 3 * page


@pytest.mark.parametrize("with_warm", [False, True])
def test_sleep_releases_the_hot_range_and_a_warm_slab_in_the_cache_tensors_tail(tmp_path, with_warm):
    """On CPU the warm slab may be the cache tensor's tail (far blocks read in place): the hot range is released by
    itself, the tail too when warm's entries went below it; a block past both (the scratch) keeps its bytes."""
    import mmap
    from types import SimpleNamespace

    import torch

    from tieredkv.engine.sleep import Sleeper, memory_runs
    from tieredkv.platform.malloc_tuning import anonymous_memory

    layers, hot, tail, floats = 3, 4, 5, mmap.PAGESIZE // 4  # a block a page: every range is whole pages
    cache = anonymous_memory(layers * 2 * (hot + tail + 1) * mmap.PAGESIZE).view(torch.float32)
    cache = cache.view(layers, 2, hot + tail + 1, floats).fill_(7)
    slab = cache[:, :, hot : hot + tail]
    runs = memory_runs(slab)
    assert len(runs) == layers * 2 and sum(n for _, n in runs) == slab.numel() * 4
    assert runs[0][0] == slab.data_ptr() and runs[1][0] == cache[0, 1, hot].data_ptr()
    assert memory_runs(cache) == [(cache.data_ptr(), cache.numel() * 4)]
    released = Sleeper(cache, hot, tmp_path).release_cache(SimpleNamespace(slab=slab) if with_warm else None)
    assert released == layers * 2 * (hot + tail * with_warm) * mmap.PAGESIZE
    assert int(cache[:, :, :hot].count_nonzero()) == 0
    assert bool((cache[:, :, hot : hot + tail] == 0).all()) == with_warm
    assert bool((cache[:, :, hot : hot + tail] == 7).all()) == (not with_warm)
    assert bool((cache[:, :, -1] == 7).all())


async def test_the_server_says_it_sleeps_and_wakes_on_a_request(llama_dir):
    from tieredkv.serve import ServerSettings, start_server

    engine = await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0))
    runner, port = await start_server(engine, ServerSettings(model_name="tiny"), port=0)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base}/sleep?level=1") as r:
                assert r.status == 200 and (await r.json())["level"] == 1
            async with http.get(f"{base}/health") as r:
                assert r.status == 200 and await r.json() == {"status": "ok", "sleeping": True, "sleep_level": 1}
            async with http.get(f"{base}/is_sleeping") as r:
                assert (await r.json()) == {"is_sleeping": True}
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as r:
                assert r.status == 200
            async with http.get(f"{base}/is_sleeping") as r:
                assert (await r.json()) == {"is_sleeping": False}
            async with http.post(f"{base}/sleep?level=x") as r:
                assert r.status == 400
            async with http.post(f"{base}/sleep?level=2") as r:
                assert r.status == 200
            async with http.post(f"{base}/wake_up") as r:
                assert r.status == 200 and (await r.json())["was_level"] == 2
            async with http.get(f"{base}/health") as r:
                assert await r.json() == {"status": "ok"}
    finally:
        await runner.cleanup()
        await engine.close()
