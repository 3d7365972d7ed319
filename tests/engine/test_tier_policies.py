"""What the tiers keep (tiers/policy.py, core/pins.py): LFU with dynamic aging for hot and warm, admission to the
tiers below warm, pins with a time to live and a share per client; model-free first, then through the engine."""

import asyncio
import time

import pytest
import torch

from helpers import check_pool_clean, make_config
from tieredkv import AsyncEngine, RequestError, SamplingParams
from tieredkv.hashing import chain_keys, root_hash
from tieredkv.kernels.dispatch import TORCH_OPS
from tieredkv.tiers.block_pool import BlockPool
from tieredkv.tiers.hot import HotTier
from tieredkv.tiers.manager import TierManager
from tieredkv.tiers.policy import Admission, LFUQueue, Popularity
from tieredkv.tiers.warm import WarmTier

from test_tiers_engine import BLOCK_BYTES, SYSTEMS, WORKLOAD, rand_ids, run

ROOT = root_hash("policy")
LONGER = SamplingParams(max_tokens=20, ignore_eos=True)


def keys_of(tokens, bs=4):
    return chain_keys(ROOT, list(tokens), bs)


def compute(pool, keys, uses=1):
    """Blocks for `keys` as a sequence would hold them (cached, `uses` uses counted), freed tail first."""
    blocks, _ = pool.allocate(len(keys))
    for block, key in zip(blocks, keys):
        pool.cache(block, key.block_hash, key.token_ids)
        for _ in range(uses):
            pool.popularity.use([key.block_hash])
    pool.free(reversed(blocks))
    return blocks


def cached(pool, keys):
    return len(pool.cached_prefix(keys))


def test_lfu_queue_orders_by_weight_plus_clock_and_ties_by_arrival():
    weights = {"a": 3, "b": 1, "c": 1, "d": 0}
    q = LFUQueue(weights.get)
    for item in "abcd":
        q.push(item)
    assert [q.pop(), q.pop(), q.pop()] == ["d", "b", "c"] and q.clock == 1
    weights["e"] = 0
    q.push("e")  # weight 0 + clock 1: ranks as an old weight-1 item would, after them
    assert list(q) == ["e", "a"]
    q.discard("a")
    assert len(q) == 1 and q.pop() == "e"
    with pytest.raises(IndexError):
        q.pop()


def test_popularity_halves_its_counts_once_they_add_up_to_the_window():
    pop = Popularity(64)
    pop.use([b"a"] * 40 + [b"b"] * 3)
    pop.computed(b"c", output=True)
    assert (pop.uses(b"a"), pop.uses(b"b"), pop.uses(b"c")) == (40, 3, 1) and pop.is_output(b"c")
    pop.use([b"d"] * 20)  # 64 uses in all: every count halves, ones vanish
    assert (pop.uses(b"a"), pop.uses(b"b"), pop.uses(b"c"), pop.uses(b"d")) == (20, 1, 0, 10)
    assert not pop.is_output(b"c")
    pop.computed(b"e", output=True)
    pop.use([b"e"])  # a prompt found it: a prompt block from now on
    assert not pop.is_output(b"e")


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_a_popular_prefix_survives_a_scan_only_under_lfu(eviction):
    """8 hot blocks: a 3-block prefix used 4 times, then 12 blocks used once each, one request at a time. LRU
    evicts the prefix; LFU keeps it and evicts the scan."""
    pool = BlockPool(8, eviction=eviction)
    popular = keys_of(range(100, 112))
    compute(pool, popular, uses=4)
    for i in range(12):
        compute(pool, keys_of(range(200 + 4 * i, 204 + 4 * i)))
    assert cached(pool, popular) == (3 if eviction == "lfu" else 0)
    assert pool.num_free == 8 and pool.num_cached_free == len(pool.cached)


def test_lfu_evicts_a_chain_tail_first_and_uncached_blocks_before_any():
    pool = BlockPool(6, eviction="lfu")
    chain = keys_of(range(40))[:4]
    blocks = compute(pool, chain)
    pool.popularity.use([chain[0].block_hash, chain[1].block_hash])  # the head found by two more prompts
    got, evicted = pool.allocate(2)  # the two free blocks without a hash go first
    assert not evicted and cached(pool, chain) == 4
    pool.free(got)
    got, evicted = pool.allocate(4)
    assert [e.block_id for e in evicted] == [blocks[3].block_id, blocks[2].block_id]  # the tail, last block first
    assert cached(pool, chain) == 2


def test_warm_lfu_keeps_entries_that_are_found_and_ages_them_out():
    pop = Popularity(1 << 20)
    warm = WarmTier(4, (1, 2, 4, 1, 2), torch.float32, pin=False, eviction="lfu", popularity=pop)
    keys = keys_of(range(4 * 40))
    data = torch.randn(40, 1, 2, 4, 1, 2)
    pop.use(k.block_hash for k in keys)  # each computed once
    warm.admit(keys[:4], data[:4])
    pop.use([keys[0].block_hash] * 3)
    assert warm.slots_of(keys[:1])  # a hit: ranked again with its 3 uses
    _, (victims, _) = warm.admit(keys[4:6], data[4:6])
    assert [v.block_hash for v in victims] == [keys[1].block_hash, keys[2].block_hash]
    assert warm.contains_sync(keys[:1]) == 1
    survived = 0
    for i in range(6, 40):  # new entries outrank it once the clock passes its priority (4)
        warm.admit(keys[i : i + 1], data[i : i + 1])
        survived += warm.contains_sync(keys[:1])
    assert warm.contains_sync(keys[:1]) == 0 and survived == 7  # LRU: 2 (it was the newest but two)
    assert torch.equal(warm.get_sync(keys[39:40]), data[39:40])


def test_admission_keeps_blocks_out_of_the_tiers_below_warm_until_they_earn_it():
    """Warm evicts into a lower tier; with admit_min_uses=2 and admit_output_blocks off, it takes a block used
    twice, a marked one, never an output block, and counts what it refused."""
    from memory_tier import MemoryTier

    pool = BlockPool(4)
    warm = WarmTier(2, (1, 2, 4, 1, 2), torch.float32, pin=False)
    lower = MemoryTier(64, 64)
    tiers = TierManager(HotTier(pool, torch.zeros(1, 2, 4, 4, 1, 2), TORCH_OPS), warm, lower, 4,
                        admission=Admission(pool.popularity, min_uses=2, output_blocks=False))
    keys = keys_of(range(4 * 6))
    pop = pool.popularity
    for key in keys:
        pop.computed(key.block_hash, output=False)
    pop.use([keys[1].block_hash])  # used twice
    pop.mark([keys[2].block_hash])  # pinned or marked by a client
    pop.computed(keys[3].block_hash, output=True)  # computed again, as output: twice, but an output block
    tiers._admit(0, keys[:4], torch.randn(4, 1, 2, 4, 1, 2))  # warm keeps two, evicts two
    tiers._admit(0, keys[4:], torch.randn(2, 1, 2, 4, 1, 2))  # ... and two more: all four go down
    assert lower.contains_sync([keys[1]]) == 1 and lower.contains_sync([keys[2]]) == 1
    assert lower.contains_sync([keys[0]]) == 0 and lower.contains_sync([keys[3]]) == 0
    assert lower.stats().refused == 2 and lower.stats().demotions == 2
    assert tiers._admitted(lower, keys[:1], None, force=True)[0] == keys[:1]  # a write-through asked for


# -- through the engine ------------------------------------------------------------------------------


async def test_lfu_with_every_tier_matches_the_unconstrained_output(engines, llama_dir, tmp_path):
    expected, _, _ = await run(engines, llama_dir, WORKLOAD, num_blocks=512, warm_bytes=0)
    got, usage, stats = await run(engines, llama_dir, WORKLOAD, num_blocks=24, warm_bytes=12 * BLOCK_BYTES,
                                  cold_path=str(tmp_path / "cold"), eviction_policy="lfu")
    assert got == expected
    assert stats.tiers["warm"].evictions > 0 and stats.tiers["cold"].demotions > 0
    assert sum(u.cached_prompt_tokens for u in usage) == stats.prefix_cache_hits > 0


async def test_only_prompt_blocks_used_twice_reach_the_disk(llama_dir, tmp_path):
    """admit_min_uses=2 and admit_output_blocks off: after the run every cached block is pushed down (clear with
    demote); the disk holds exactly the system prompts' blocks (each used 3 times), none of a single question's or
    of the output."""
    path = str(tmp_path / "cold")
    async with await AsyncEngine.start(make_config(
            model=str(llama_dir), num_blocks=256, warm_bytes=0, cold_path=path, admit_min_uses=2,
            admit_output_blocks=False)) as engine:
        for i in range(12):  # a question's block used once, then one holding output (ignore_eos: 20 tokens)
            await engine.generate(SYSTEMS[i % 4] + rand_ids(20, seed=300 + i), LONGER)
        await engine.clear_cache("hot", demote=True)
        cold = engine.core.tiers.cold
        await asyncio.to_thread(cold.flush_sync)
        for system in SYSTEMS:
            keys = engine.core.kv.chain_keys(system)
            assert cold.contains_sync(keys) == len(keys) == 10
        stored = sum(1 for _ in cold.export_sync(1))
        assert stored == 4 * 10
        assert cold.stats().refused == 12 * 2
        reports = await engine.explain(SYSTEMS[0] + rand_ids(20, seed=300))
        assert reports[10].source is None and reports[10].reason == \
            "cold did not admit it: used once, below admit_min_uses=2"
        check_pool_clean(engine.core)


async def test_pins_expire_renew_and_stay_within_each_clients_share(llama_dir):
    cfg = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0, max_pinned_fraction=0.5,
                      max_pinned_per_client=0.5)  # 32 blocks pinned at most, 16 per client
    async with await AsyncEngine.start(cfg) as engine:
        a, b = rand_ids(160, seed=901), rand_ids(160, seed=902)  # 10 blocks each
        assert await engine.pin(a, ttl=0.3, cache_salt="t1") == 160
        with pytest.raises(RequestError, match="share of client 't1'"):
            await engine.pin(b, cache_salt="t1")  # 20 > 16
        assert await engine.pin(b, cache_salt="t2") == 160  # another tenant has its own share
        assert engine.stats().blocks_pinned == 20
        listing = {p["client"]: p for p in await engine.pins()}
        assert listing["t2"]["expires_in_s"] is None and 0 < listing["t1"]["expires_in_s"] <= 0.3
        await asyncio.sleep(0.15)
        assert await engine.pin(a, ttl=0.3, cache_salt="t1") == 160  # renewed: 0.3 s from now
        await asyncio.sleep(0.2)
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=1))  # a step: expiry is checked
        assert engine.stats().blocks_pinned == 20  # not yet
        await asyncio.sleep(0.2)
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=1))
        assert engine.stats().blocks_pinned == 10 and [p["client"] for p in await engine.pins()] == ["t2"]
        with pytest.raises(RequestError, match="ttl"):
            await engine.pin(a, ttl=0)
        assert await engine.unpin(b, cache_salt="t2") == 160
        assert engine.stats().blocks_pinned == 0
        check_pool_clean(engine.core)


async def test_overlapping_pins_count_their_blocks_once(llama_dir):
    cfg = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0, max_pinned_fraction=0.25)  # 16 blocks
    async with await AsyncEngine.start(cfg) as engine:
        system = rand_ids(160, seed=903)
        assert await engine.pin(system) == 160
        assert await engine.pin(system + rand_ids(64, seed=904)) == 224  # 4 blocks more, not 14
        assert engine.stats().blocks_pinned == 14
        await engine.unpin(system)
        assert engine.stats().blocks_pinned == 14  # the longer pin still holds them
        started = time.monotonic()
        await engine.unpin(system + rand_ids(64, seed=904))
        assert engine.stats().blocks_pinned == 0 and time.monotonic() - started < 5
        check_pool_clean(engine.core)


# -- clients say what to keep: the server -------------------------------------------------------------

SYSTEM_TEXT = "Blocks that many prompts share are worth keeping close. " * 12


@pytest.fixture
async def served(llama_dir, tmp_path):
    from tieredkv.serve import ServerSettings, start_server

    engine = await AsyncEngine.start(make_config(
        model=str(llama_dir), num_blocks=128, warm_bytes=0, cold_path=str(tmp_path / "cold"), admit_min_uses=3,
        max_pinned_fraction=0.5, max_pinned_per_client=0.5))  # 64 blocks pinned at most, 32 per client
    runner, port = await start_server(engine, ServerSettings(model_name="tiny"), port=0)
    async with aiohttp_session() as http:
        yield engine, http, f"http://127.0.0.1:{port}/v1/chat/completions"
    await runner.cleanup()
    await engine.close()


def aiohttp_session():
    import aiohttp

    return aiohttp.ClientSession()


def flat(messages):
    """The messages as the engine takes them: text parts joined."""
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in messages]


def marked_chat(question, mark=None, where="part"):
    system = {"type": "text", "text": SYSTEM_TEXT}
    message = {"role": "system", "content": [system]}
    if mark is not None and where == "part":
        system["cache_control"] = mark
    elif mark is not None:
        message["cache_control"] = mark
    return [message, {"role": "user", "content": question}]


async def test_cache_control_pins_the_marked_prefix_for_its_ttl(served):
    engine, http, url = served
    body = {"model": "tiny", "max_tokens": 2, "messages": marked_chat("first?", {"type": "ephemeral"})}
    async with http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
    system_only = await engine.tokenize([{"role": "system", "content": SYSTEM_TEXT}], check=False)
    whole = await engine.tokenize(flat(marked_chat("first?")))
    agree = next(i for i, (a, b) in enumerate(zip(system_only, whole)) if a != b)
    (pin,) = await engine.pins()
    assert pin["tokens"] == agree and pin["blocks"] == agree // 16 > 0 and 290 < pin["expires_in_s"] <= 300
    body["messages"] = marked_chat("second?", {"type": "ephemeral", "ttl": "1h"}, where="message")
    async with http.post(url, json=body) as r:
        assert r.status == 200
        usage = (await r.json())["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= pin["blocks"] * 16
    (renewed,) = await engine.pins()  # the same prefix: renewed to the longer lifetime, counted once
    assert renewed["blocks"] == pin["blocks"] and renewed["expires_in_s"] > 3000
    assert engine.stats().blocks_pinned == pin["blocks"]


@pytest.mark.parametrize("mark", [{"type": "persistent"}, {"type": "ephemeral", "ttl": "2h"}, "yes"])
async def test_a_malformed_cache_control_is_a_400(served, mark):
    engine, http, url = served
    async with http.post(url, json={"model": "tiny", "max_tokens": 2, "messages": marked_chat("q", mark)}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "messages"
    assert await engine.pins() == []


async def test_a_client_past_its_share_gets_a_400_and_nothing_runs(served):
    engine, http, url = served

    def preamble(text):  # about 20 blocks, kept
        return [{"role": "system", "content": [{"type": "text", "text": text * 21,
                                                "cache_control": {"type": "ephemeral"}}]},
                {"role": "user", "content": "q"}]

    async def ask(messages, salt):
        async with http.post(url, json={"model": "tiny", "max_tokens": 2, "messages": messages,
                                        "cache_salt": salt}) as r:
            return r.status, await r.json()

    assert (await ask(preamble("A long shared preamble. "), "tenant-a"))[0] == 200
    held = engine.stats().blocks_pinned
    assert 16 < held <= 32
    status, body = await ask(preamble("Another long preamble. "), "tenant-a")  # past its 32 blocks
    assert status == 400 and "share of client 'tenant-a'" in body["error"]["message"]
    assert engine.stats().blocks_pinned == held and len(await engine.pins()) == 1
    assert (await ask(preamble("Another long preamble. "), "tenant-b"))[0] == 200  # a share of its own
    assert engine.stats().blocks_pinned > held and {p["client"] for p in await engine.pins()} == {"tenant-a",
                                                                                                  "tenant-b"}


async def test_prompt_cache_key_admits_a_prompt_to_the_disk_that_would_not_earn_it(served):
    engine, http, url = served
    plain, keyed = marked_chat("an unmarked question " * 8), marked_chat("a keyed question " * 8)
    plain[0]["content"][0]["text"] = "Another system prompt entirely. " * 12
    async with http.post(url, json={"model": "tiny", "max_tokens": 2, "messages": plain}) as r:
        assert r.status == 200
    async with http.post(url, json={"model": "tiny", "max_tokens": 2, "messages": keyed,
                                    "prompt_cache_key": "support-bot"}) as r:
        assert r.status == 200
    async with http.post(url, json={"model": "tiny", "max_tokens": 2, "messages": keyed,
                                    "prompt_cache_key": 7}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt_cache_key"
    await engine.clear_cache("hot", demote=True)
    cold = engine.core.tiers.cold
    await asyncio.to_thread(cold.flush_sync)
    keyed_keys = engine.core.kv.chain_keys(await engine.tokenize(flat(keyed)))
    plain_keys = engine.core.kv.chain_keys(await engine.tokenize(flat(plain)))
    assert cold.contains_sync(keyed_keys) == len(keyed_keys) > 0  # every prompt block of the keyed request
    assert cold.contains_sync(plain_keys) == 0 and cold.stats().refused >= len(plain_keys)
