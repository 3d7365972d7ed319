"""KV cache events in vLLM's format: what a subscriber receives on the ZMQ socket matches the pool's own transitions
(every full block stored once, with its chain; removals when blocks leave), replay, both encodings, bad endpoints."""

import asyncio
import socket
import time

import pytest
import zmq

from helpers import make_config
from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.engine.kv_events import END_SEQ, decode_batch, external_hash
from tieredkv.errors import KVEventsError

PROMPT = list(range(3, 3 + 16 * 5 + 7))  # 5 full blocks and 7 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A SUB socket reading batches as (seq, ts, events, rank)."""

    def __init__(self, endpoint: str, topic: bytes = b""):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.seen: list[tuple[int, float, list, int]] = []

    def drain(self, quiet: float = 0.3) -> list[dict]:
        """Every event that arrives until none has for `quiet` seconds."""
        events = []
        while self.sock.poll(int(quiet * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            ts, batch, rank = decode_batch(payload)
            self.seen.append((int.from_bytes(seq, "big"), ts, batch, rank))
            events += batch
        return events

    def close(self):
        self.sock.close(linger=0)


def stored_hashes(events: list[dict]) -> list[int]:
    return [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]


def config(llama_dir, port: int, **events) -> EngineConfig:
    """Events on the port (a wildcard address binds, vLLM's rule; subscribers connect to 127.0.0.1)."""
    return make_config(model=str(llama_dir), num_blocks=64, max_num_seqs=4, kv_events_config={
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", **events})


async def settle(sub: Subscriber) -> None:
    await asyncio.sleep(0.3)  # a SUB socket misses what is sent before it has joined
    await asyncio.to_thread(sub.drain, 0.1)


async def test_events_follow_the_pool(llama_dir):
    port, replay = free_port(), free_port()
    engine = await AsyncEngine.start(config(llama_dir, port, topic="kv@r1", replay_endpoint=f"tcp://*:{replay}"))
    sub = Subscriber(f"tcp://127.0.0.1:{port}", b"kv@")
    try:
        await settle(sub)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        await engine.generate(PROMPT, params)
        events = await asyncio.to_thread(sub.drain)
        keys = engine.core.kv.chain_keys(PROMPT)  # the 5 full prompt blocks, hashed from the model's root
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored_hashes(stored) == [external_hash(k.block_hash) for k in keys]
        first = stored[0]
        assert first["parent_block_hash"] is None and first["block_size"] == 16 and first["medium"] == "GPU"
        assert [t for e in stored for t in e["token_ids"]] == PROMPT[:80]
        for prev, e in zip(stored, stored[1:]):  # a later event of the chain names its parent
            assert e["parent_block_hash"] == prev["block_hashes"][-1]
        assert not [e for e in events if e["type"] == "BlockRemoved"]

        await engine.generate(PROMPT, params)  # served from cache: nothing stored twice
        assert stored_hashes(await asyncio.to_thread(sub.drain)) == []

        longer = PROMPT + list(range(200, 230))  # the cached chain, extended: only the new blocks, parent linked
        await engine.generate(longer, params)
        more = [e for e in await asyncio.to_thread(sub.drain) if e["type"] == "BlockStored"]
        new_keys = engine.core.kv.chain_keys(longer)[5:]
        assert stored_hashes(more) == [external_hash(k.block_hash) for k in new_keys]
        assert more[0]["parent_block_hash"] == external_hash(keys[-1].block_hash)

        removed = await engine.clear_cache("hot")
        gone = [h for e in await asyncio.to_thread(sub.drain) if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert len(gone) == removed and set(gone) == {external_hash(k.block_hash) for k in keys + new_keys}
        seqs = [s for s, *_ in sub.seen]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # numbered without a gap
        assert all(rank == 0 for *_, rank in sub.seen)

        dealer = zmq.Context.instance().socket(zmq.DEALER)  # replay from the first batch this subscriber saw
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        await asyncio.to_thread(dealer.send_multipart, (b"", seqs[0].to_bytes(8, "big")))
        replayed = []
        while True:
            assert await asyncio.to_thread(dealer.poll, 5000)
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((int.from_bytes(seq, "big"), decode_batch(payload)[1]))
        dealer.close(linger=0)
        assert replayed == [(s, batch) for s, _, batch, _ in sub.seen]
    finally:
        await engine.close()
    last = await asyncio.to_thread(sub.drain)
    sub.close()
    assert last[-1] == {"type": "AllBlocksCleared"}  # a closing engine tells its subscribers it holds nothing


async def test_positional_encoding_and_bad_endpoints(llama_dir):
    port = free_port()
    engine = await AsyncEngine.start(config(llama_dir, port, event_encoding="array"))
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        await settle(sub)
        with pytest.raises(KVEventsError, match="endpoint"):  # the port is this engine's: a clear error at start
            await AsyncEngine.start(config(llama_dir, port))
        await engine.generate(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
        await asyncio.sleep(0.1)
        sub.sock.poll(2000)
        _, _, payload = sub.sock.recv_multipart()
        import msgpack

        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(events[0], list) and events[0][0] == "BlockStored"  # [tag, block_hashes, parent, ...]
        assert events[0][2] is None and events[0][4] == 16 and events[0][6] == "GPU"
        assert abs(ts - time.time()) < 60 and rank == 0
        assert len(events[0][1]) == 5
    finally:
        sub.close()
        await engine.close()
    with pytest.raises(ValueError, match="kv_events_config"):
        make_config(kv_events_config="{not json")
    with pytest.raises(ValueError):
        make_config(kv_events_config={"enable_kv_cache_events": True, "publisher": "kafka"})


SYSTEMS = ["Paged attention keeps keys and values in fixed-size blocks of sixteen tokens. " * 6,
           "A prefix cache serves a long shared system prompt once for every user. " * 6]


async def test_vllm_router_kv_aware_follows_the_events(llama_dir):
    """Each replica holds one system prompt (asked directly, never through the router); vllm-router's kv_aware
    policy, fed by the replicas' events, sends every later chat to the replica that holds its prompt."""
    import openai
    from test_fleet import KEY, NAME, chat, router, serving

    ports = [free_port(), free_port()]
    engines = [await AsyncEngine.start(config(llama_dir, p)) for p in ports]
    try:
        async with serving(engines) as urls:
            sources = [a for url, p in zip(urls, ports) for a in ("--kv-event-source", f"{url}=tcp://127.0.0.1:{p}")]
            async with router("vllm_router.launch_router", ["--worker-urls", *urls, "--api-key", KEY, "--policy",
                                                            "kv_aware", "--kv-event-model", NAME, *sources]) as running:
                await asyncio.sleep(1.0)  # it subscribes as it starts (what was sent before, it never sees)
                for engine, system in zip(engines, SYSTEMS):
                    await engine.generate(chat(system, "warm up"), SamplingParams(max_tokens=1))
                await asyncio.sleep(0.5)
                client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key=KEY, max_retries=0)
                before = [e.stats().prefix_cache_queries for e in engines]
                cached = []
                for i in range(8):
                    got = await client.chat.completions.create(
                        model=NAME, messages=chat(SYSTEMS[i % 2], f"question {i}"), max_tokens=1)
                    cached.append(got.usage.prompt_tokens_details.cached_tokens)
                await client.close()
                served = [e.stats().prefix_cache_queries - b for e, b in zip(engines, before)]
        system_tokens = len(await engines[0].tokenize(chat(SYSTEMS[0], ""))) // 16 * 16
        assert all(c >= system_tokens - 16 for c in cached), (cached, system_tokens)  # each went where its prompt was
        assert served[0] > 0 and served[1] > 0, served  # (prompt tokens each looked up)
    finally:
        for engine in engines:
            await engine.close()


def replay_media(events: list[dict], media: dict[str, set]) -> None:
    """What a subscriber concludes each medium holds, from the events in order."""
    for e in events:
        if e["type"] == "AllBlocksCleared":
            for held in media.values():
                held.clear()
        elif e["type"] == "BlockStored":
            media[e["medium"]].update(e["block_hashes"])
        else:
            media[e["medium"]].difference_update(e["block_hashes"])


async def test_events_describe_every_tier(llama_dir, tmp_path):
    """Under a small hot pool, a warm and a cold tier (demotions, promotions, evictions, far blocks, flushes), what a
    subscriber builds from the events is what each tier holds: GPU the hot pool, CPU the warm tier, DISK cold."""
    from test_tiers_engine import BLOCK_BYTES, PARAMS, WORKLOAD

    port = free_port()
    cfg = config(llama_dir, port).model_copy(update={
        "num_blocks": 24, "warm_bytes": 12 * BLOCK_BYTES, "cold_path": str(tmp_path / "cold"),
        "cold_bytes": 20 * 16384, "cold_secret_path": str(tmp_path / "key")})
    engine = await AsyncEngine.start(cfg)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    media = {"GPU": set(), "CPU": set(), "DISK": set()}
    tiers = engine.core.tiers
    pool, warm, cold = tiers.hot.pool, tiers.tier("warm"), tiers.tier("cold")

    async def check():
        await cold.flush()
        await engine.run_in_worker(lambda: None)  # a command: what the cold writer reported goes out after it
        replay_media(await asyncio.to_thread(sub.drain), media)
        on_disk = {external_hash(k.block_hash) for keys, _ in cold.export_sync(64) for k in keys}
        assert media["GPU"] == {external_hash(h) for h, b in pool.cached.items() if not pool.is_far(b)}
        assert media["CPU"] == ({external_hash(h) for h, b in pool.cached.items() if pool.is_far(b)}
                                | {external_hash(h) for h in warm.entries})
        assert media["DISK"] == on_disk
        return {m: len(held) for m, held in media.items()}

    try:
        await settle(sub)
        for prompt in WORKLOAD:  # 12 prompts on 4 system prompts of 10 blocks: far more than 24 hot blocks hold
            await engine.generate(prompt, PARAMS)
        sizes = await check()
        assert sizes["GPU"] > 0 and sizes["CPU"] > 0 and sizes["DISK"] > 0, sizes
        for prompt in WORKLOAD[:4]:  # promoted back up
            await engine.generate(prompt, PARAMS)
        await check()
        await engine.clear_cache("hot")
        await engine.clear_cache("warm")
        sizes = await check()
        assert sizes["GPU"] == 0 and sizes["CPU"] == 0 and sizes["DISK"] > 0
        assert cold.stats().evictions > 0  # (the disk budget evicted too)
        await engine.clear_cache("cold")
        assert (await check())["DISK"] == 0
    finally:
        sub.close()
        await engine.close()
