"""The remote tier on a real Valkey server: engines sharing prefixes through it, and every way the server can
fail (killed, restarted, slow, full) or lie (foreign, tampered, wrong-sized entries). The contract suite runs
on it too (test_tier_contract.py)."""

import asyncio
import time

import pytest
import torch
import valkey

from helpers import check_pool_clean, make_config, rand_ids
from tieredkv import RemoteTierError, SamplingParams
from tieredkv.tiers.remote import RemoteTier
from tieredkv.tools.local_valkey import LocalValkey

from test_tier_contract import SHAPE, make_blocks, make_keys

BS = 16
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


SYSTEM = rand_ids(320, seed=1)  # 20 blocks, shared by every conversation below
QUESTIONS = [rand_ids(11, seed=10 + i) for i in range(4)]
FULL = (len(SYSTEM) + 11 - 1) // BS * BS  # prompt tokens a lookup may cover


@pytest.fixture
def server(tmp_path):
    """A server of the test's own, for the tests that kill, pause or fill it."""
    s = LocalValkey(tmp_path / "valkey").start()
    yield s
    s.kill()


def config(model_dir, url, key, **cfg):
    return make_config(model=str(model_dir), num_blocks=128, warm_bytes=0, remote_url=url,
                       cold_secret_path=str(key), **cfg)


async def answers(engine, prompts):
    outs = [await engine.generate(p, PARAMS) for p in prompts]
    return [o.outputs[0].token_ids for o in outs], [o.usage for o in outs]


def remote(engine) -> RemoteTier:
    return engine.core.tiers.tier("remote")


async def flushed(engine):
    await asyncio.to_thread(remote(engine).flush_sync)


@pytest.fixture(scope="module")
async def reference(engines, llama_dir):
    """What the conversations answer with no tier below hot and no prefix caching."""
    cfg = make_config(model=str(llama_dir), num_blocks=128, warm_bytes=0, enable_prefix_caching=False)
    async with await engines.start(cfg) as engine:
        return (await answers(engine, [SYSTEM + q for q in QUESTIONS]))[0]


async def test_a_second_engine_computes_none_of_the_prefix_the_first_computed(engines, llama_dir, valkey_server,
                                                                              fleet_key, reference):
    prompts = [SYSTEM + q for q in QUESTIONS]
    async with await engines.start(config(llama_dir, valkey_server.url, fleet_key)) as first:
        got1, usage1 = await answers(first, prompts[:1])
        await flushed(first)
        published = remote(first).stats()
        assert usage1[0].cached_prompt_tokens == 0
        assert published.demotions == (len(prompts[0]) + PARAMS.max_tokens - 1) // BS  # each full block computed
        assert published.bytes_written > published.demotions * torch.Size(SHAPE).numel()
        async with await engines.start(config(llama_dir, valkey_server.url, fleet_key)) as second:
            report = await second.explain(prompts[1])
            assert [b.source for b in report[: FULL // BS]] == ["remote"] * (FULL // BS)
            got2, usage2 = await answers(second, prompts)
            stats = remote(second).stats()
            check_pool_clean(second.core)
    assert got1 == reference[:1] and got2 == reference
    assert usage2[0].cached_tokens_by_tier == {"hot": 0, "warm": 0, "remote": FULL, "cold": 0}
    assert all(u.cached_tokens_by_tier["hot"] == len(SYSTEM) for u in usage2[1:])  # then hot, as usual
    assert stats.hits == FULL and stats.promotions == FULL // BS and stats.failures == 0
    assert stats.round_trips >= 1 and stats.bytes_read >= stats.promotions * torch.Size(SHAPE).numel()


async def test_remote_beside_cold_both_keep_what_warm_evicts(engines, llama_dir, valkey_server, fleet_key, tmp_path):
    cfg = config(llama_dir, valkey_server.url, fleet_key, cold_path=str(tmp_path / "cold"), remote_ttl_s=None)
    async with await engines.start(cfg) as engine:
        await engine.generate(SYSTEM + QUESTIONS[0], PARAMS)
        await engine.clear_cache("remote")
        await engine.clear_cache("hot", demote=True)  # -> remote and cold, each a copy
        await flushed(engine)
        await asyncio.to_thread(engine.core.tiers.cold.flush_sync)
        keys = engine.core.index.keys(SYSTEM)
        assert engine.core.index.where(keys) == ["remote"] * len(keys)
        assert await engine.core.tiers.cold.contains(keys) == len(keys)
        assert remote(engine).stats().demotions >= len(keys)


async def test_server_killed_mid_run_then_restarted(engines, llama_dir, server, fleet_key, reference):
    prompts = [SYSTEM + q for q in QUESTIONS]
    cfg = config(llama_dir, server.url, fleet_key, remote_timeout_s=0.3, remote_retry_s=0.5)
    async with await engines.start(cfg) as engine:
        got, _ = await answers(engine, prompts[:2])
        server.kill()
        await engine.clear_cache("hot")
        more, usage = await answers(engine, prompts[2:])  # the lookups fail: computed, nothing fails
        assert got + more == reference
        assert usage[0].cached_prompt_tokens == 0 and not remote(engine).available
        assert remote(engine).stats().failures >= 1

        server.start()  # empty, on the same port
        await asyncio.sleep(0.6)  # the circuit breaker's retry_s
        await engine.clear_cache("hot")
        again, usage = await answers(engine, prompts[:1])  # a miss, computed, written again
        await flushed(engine)
        await engine.clear_cache("hot")
        once_more, usage2 = await answers(engine, prompts[:1])
        assert again == once_more == reference[:1]
        assert usage[0].cached_tokens_by_tier["remote"] == 0 and usage2[0].cached_tokens_by_tier["remote"] == FULL


async def test_a_slow_server_delays_no_step_beyond_the_timeout(engines, llama_dir, server, fleet_key, reference):
    cfg = config(llama_dir, server.url, fleet_key, remote_timeout_s=0.3, remote_retry_s=30)
    async with await engines.start(cfg) as engine:
        stamps = []

        async def long_generation():
            params = SamplingParams(max_tokens=60, ignore_eos=True)
            async for _ in engine.stream(rand_ids(40, seed=99), params):
                stamps.append(time.monotonic())

        running = asyncio.create_task(long_generation())
        while len(stamps) < 3:
            await asyncio.sleep(0.01)
        valkey.Valkey.from_url(server.url).execute_command("CLIENT", "PAUSE", 3000, "ALL")
        t0 = time.monotonic()
        got, usage = await answers(engine, [SYSTEM + QUESTIONS[0]])  # its lookup waits on the paused server
        took = time.monotonic() - t0
        await running
        stats = remote(engine).stats()  # given up at the read's deadline (computing is faster), or its timeout
        assert stats.late + stats.failures >= 1
    assert got == reference[:1] and usage[0].cached_prompt_tokens == 0
    assert took < 2.5  # the read gave up after 0.3 s; the pause lasts 3 s
    assert max(b - a for a, b in zip(stamps, stamps[1:])) < 1.5  # steps went on while it waited


def tier_pair(url, tmp_path, fingerprint="fp-faults"):
    writer = RemoteTier(url, fingerprint, SHAPE, torch.float32, tmp_path / "a.key")
    reader = RemoteTier(url, fingerprint, SHAPE, torch.float32, tmp_path / "a.key")
    return writer, reader


@pytest.mark.parametrize("damage", ["foreign-key", "tampered", "wrong-size", "moved", "garbage"])
def test_a_bad_entry_is_a_miss_and_a_failure_never_served(valkey_server, tmp_path, damage):
    keys, blocks = make_keys(3, seed=7), make_blocks(3, seed=7)
    writer, reader = tier_pair(valkey_server.url, tmp_path, f"fp-{damage}")
    raw = valkey_raw(valkey_server)
    try:
        assert writer.put_sync(keys, blocks) == 3
        name = writer._key(keys[1])
        if damage == "foreign-key":  # written by an engine with another secret
            other = RemoteTier(valkey_server.url, f"fp-{damage}", SHAPE, torch.float32, tmp_path / "other.key")
            other.put_sync(keys[1:2], blocks[1:2])
            other.close_sync()
        elif damage == "tampered":
            value = bytearray(raw.get(name))
            value[-5] ^= 0x40
            raw.set(name, bytes(value))
        elif damage == "wrong-size":  # authentic, but not a block of this shape
            raw.set(name, writer._encode(keys[1], blocks[1].flatten()[:-8]))
        elif damage == "moved":  # an authentic entry of another block, copied under this key
            raw.set(name, raw.get(writer._key(keys[2])))
        else:
            raw.set(name, b"\x00" * 100)
        got = reader.get_sync(keys)
        assert got.shape[0] == 1 and torch.equal(got[0], blocks[0])
        assert reader.stats().failures == 1
        # contains reads headers only: an entry whose header names this block counts until it is read
        assert reader.contains_sync(keys) == (1 if damage in ("moved", "garbage") else 3)
    finally:
        writer.close_sync()
        reader.close_sync()
        raw.close()


def valkey_raw(server):
    return valkey.Valkey.from_url(server.url)


async def test_a_tampered_entry_is_computed_and_written_over(engines, llama_dir, valkey_server, fleet_key, reference):
    prompt = SYSTEM + QUESTIONS[1]
    cfg = config(llama_dir, valkey_server.url, fleet_key, remote_ttl_s=3600)
    async with await engines.start(cfg) as engine:
        await engine.clear_cache("remote")
        await answers(engine, [prompt])
        await flushed(engine)
        first = engine.core.index.keys(SYSTEM)[0]
        raw = valkey_raw(valkey_server)
        value = bytearray(raw.get(remote(engine)._key(first)))
        value[len(value) // 2] ^= 1
        raw.set(remote(engine)._key(first), bytes(value))
        raw.close()
        await engine.clear_cache("hot")
        got, usage = await answers(engine, [prompt])
        assert got == reference[1:2] and usage[0].cached_prompt_tokens == 0
        assert remote(engine).stats().failures == 1
        await flushed(engine)
        await engine.clear_cache("hot")
        got, usage = await answers(engine, [prompt])  # the engine that computed it again wrote it over
        assert got == reference[1:2] and usage[0].cached_tokens_by_tier["remote"] == FULL


@pytest.mark.parametrize("policy", ["noeviction", "allkeys-lru"])
async def test_a_full_server_costs_cache_never_a_request(engines, llama_dir, fleet_key, tmp_path, policy, reference):
    with LocalValkey(tmp_path / "valkey", maxmemory="4mb", maxmemory_policy=policy) as server:
        cfg = config(llama_dir, server.url, fleet_key)
        async with await engines.start(cfg) as engine:
            prompts = [rand_ids(600, seed=50 + i) for i in range(16)]  # 600 blocks of 12 KiB: 7.3 MiB
            await answers(engine, prompts)
            await flushed(engine)
            await asyncio.to_thread(remote(engine)._refresh)
            stats = remote(engine).stats()
            got, _ = await answers(engine, [SYSTEM + q for q in QUESTIONS])
        raw = valkey_raw(server)
        info = raw.info()
        raw.close()
    assert got == reference
    assert stats.capacity_bytes == 4 << 20 and stats.used_bytes <= stats.capacity_bytes * 1.1
    if policy == "noeviction":  # the server refused writes: failures, nothing raised
        assert stats.failures > 0 and info["evicted_keys"] == 0
    else:  # the server made room
        assert stats.failures == 0 and info["evicted_keys"] > 0


def test_what_a_call_saw_before_another_threads_trip_is_not_remembered(server, tmp_path, monkeypatch):
    """The server answered a call, then died, and another thread's call tripped the breaker (the server may
    come back empty) before this one noted what it saw: those blocks must stay wanted, or a restarted server
    never gets them again (a lookup then finds one block where it should find all)."""
    tier = RemoteTier(server.url, "fp-race", SHAPE, torch.float32, tmp_path / "k", timeout_s=0.3, retry_s=0.1)
    try:
        keys, blocks = make_keys(4, seed=3), make_blocks(4, seed=3)
        answered = tier._pipeline

        def then_tripped(commands):
            replies = answered(commands)
            tier._trip(ConnectionError("another thread's call, to the killed server"))
            return replies

        monkeypatch.setattr(tier, "_pipeline", then_tripped)
        assert tier.put_sync(keys, blocks) == 4  # the server stored them ...
        assert tier.wanted(keys) == [0, 1, 2, 3]  # ... but after the trip that is not known
        time.sleep(0.15)
        assert tier.get_sync(keys).equal(blocks)
        assert tier.wanted(keys) == [0, 1, 2, 3]
        monkeypatch.undo()
        time.sleep(0.15)
        assert tier.put_sync(keys, blocks) == 4 and tier.wanted(keys) == []
    finally:
        tier.close_sync()


def test_an_unreachable_server_at_start_is_a_miss_not_an_error(tmp_path):
    from tieredkv.tools.local_valkey import free_port

    tier = RemoteTier(f"redis://127.0.0.1:{free_port()}/0", "fp", SHAPE, torch.float32, tmp_path / "k",
                      timeout_s=0.2, retry_s=60)
    try:
        keys, blocks = make_keys(2), make_blocks(2)
        t0 = time.monotonic()
        assert tier.get_sync(keys) is None and tier.contains_sync(keys) == 0
        assert tier.admit(keys, blocks)[0] == 0  # dropped, the breaker is open
        assert time.monotonic() - t0 < 0.1  # no call is made while it is open
        assert not tier.available and tier.stats().failures == 1
    finally:
        tier.close_sync()


def test_the_url_password_never_reaches_a_log(tmp_path, caplog):
    from tieredkv.tools.local_valkey import free_port

    url = f"redis://user:hunter2@127.0.0.1:{free_port()}/0"
    tier = RemoteTier(url, "fp", SHAPE, torch.float32, tmp_path / "k", timeout_s=0.2)
    tier.close_sync()
    assert "hunter2" not in caplog.text and "unreachable" in caplog.text and "***@127.0.0.1" in tier.url


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://user:hunter2@127.0.0.1:notaport/0"])
async def test_a_url_the_client_cannot_take_stops_the_start_with_one_clear_error(engines, llama_dir, url, tmp_path):
    with pytest.raises(RemoteTierError, match="remote_url") as info:
        await engines.start(make_config(model=str(llama_dir), remote_url=url,
                                        cold_secret_path=str(tmp_path / "k")))
    assert "hunter2" not in str(info.value)


async def test_remote_at_the_bottom_keeps_what_it_admits(engines, llama_dir, valkey_server, fleet_key):
    """With no cold tier, remote is the bottom: what it admits stays findable (nothing is noted as dropped)."""
    async with await engines.start(config(llama_dir, valkey_server.url, fleet_key)) as engine:
        prompt = SYSTEM + QUESTIONS[2]
        await engine.generate(prompt, PARAMS)
        await engine.clear_cache("hot", demote=True)
        await flushed(engine)
        keys = engine.core.index.keys(SYSTEM)
        assert not any(remote(engine).dropped(k.block_hash) for k in keys)
        assert [b.source for b in (await engine.explain(prompt))[: len(keys)]] == ["remote"] * len(keys)


def test_a_connect_that_hangs_never_holds_up_the_engine_thread(tmp_path):
    """A server that accepts connections and never answers: the reader thread's reconnect waits out its
    timeout, while admit (what the engine's thread calls after each step) returns at once."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    tier = RemoteTier(url, "fp", SHAPE, torch.float32, tmp_path / "k", timeout_s=1.0, retry_s=0.05)
    try:
        assert not tier.available  # the first connect timed out
        time.sleep(0.1)  # the breaker closes: the next call connects again
        reader = threading.Thread(target=tier.get_sync, args=(make_keys(2),))
        reader.start()
        time.sleep(0.2)  # the reader is inside its connect, which hangs for timeout_s
        t0 = time.monotonic()
        tier.admit(make_keys(3, seed=1), make_blocks(3, seed=1))
        assert time.monotonic() - t0 < 0.3
        reader.join()
    finally:
        tier.close_sync()
        listener.close()


async def test_clearing_all_leaves_the_shared_tier_alone(engines, llama_dir, valkey_server, fleet_key):
    async with await engines.start(config(llama_dir, valkey_server.url, fleet_key)) as engine:
        prompt = SYSTEM + QUESTIONS[3]
        await engine.generate(prompt, PARAMS)
        await flushed(engine)
        keys = engine.core.index.keys(SYSTEM)
        await engine.clear_cache()  # "all": this engine's tiers
        assert await remote(engine).contains(keys) == len(keys)
        assert await engine.clear_cache("remote") >= len(keys)  # named: gone for every engine
        assert await remote(engine).contains(keys) == 0


async def test_a_slow_tier_is_read_only_where_it_beats_computing(engines, llama_dir, valkey_server, fleet_key):
    """Load or recompute (tiers/rates.py): reads of a remote tier made slow (0.4 s a call, injected) pass their
    deadline (the time computing the blocks takes) and are given up; measured slow, the tier is then not read at
    all; once it is fast again and due for a probe, it serves again. Output is the same throughout."""
    prompts = [rand_ids(320, seed=500 + i) + q for i, q in enumerate(QUESTIONS)]  # 20 blocks each, none shared
    async with await engines.start(config(llama_dir, valkey_server.url, fleet_key)) as writer:
        reference, _ = await answers(writer, prompts)
        await flushed(writer)
    async with await engines.start(config(llama_dir, valkey_server.url, fleet_key)) as engine:
        tier, rates = remote(engine), engine.core.tiers.rates
        assert rates.prefill_tokens_per_s > 0  # measured at start: decisions hold from the first request
        fast_get = tier.get_sync

        def slow_get(keys):
            time.sleep(0.4)
            return fast_get(keys)

        tier.get_sync = slow_get
        got, usage = await answers(engine, prompts[:1])  # unmeasured: read, given up at its deadline, computed
        assert got == reference[:1] and usage[0].cached_tokens_by_tier["remote"] == 0
        assert tier.stats().late == 1
        assert usage[0].cache_decision.startswith(f"recomputed up to {20 * BS:,} tokens: the remote read passed")
        await asyncio.sleep(0.5)  # the dropped read finishes in its thread: the tier is measured slow
        assert rates.seconds_per_block["remote"] > 0.01
        reports = await engine.explain(prompts[1])  # explain() says so, with its numbers
        assert reports[0].source is None and "from remote would take" in reports[0].reason
        before = tier.stats()
        got, usage = await answers(engine, prompts[1:3])  # not read at all now
        assert got == reference[1:3] and all(u.cached_tokens_by_tier["remote"] == 0 for u in usage)
        after = tier.stats()
        assert after.late == before.late and after.skipped - before.skipped == 2 * 20
        assert all(u.cache_decision.startswith(f"recomputed up to {20 * BS:,} tokens: remote read ") and " > prefill "
                   in u.cache_decision for u in usage)  # the request says why, with both estimates
        tier.get_sync, rates.probe_s = fast_get, 0.0  # fast again, and due for a probe
        got, usage = await answers(engine, prompts[3:4])
        assert got == reference[3:4] and usage[0].cached_tokens_by_tier["remote"] == 20 * BS
        assert usage[0].cache_decision.startswith(f"read up to {20 * BS:,} tokens from remote")
