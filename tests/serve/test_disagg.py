"""A prefill/decode split behind vllm-router (`--vllm-pd-disaggregation`), the KV carried by the shared Valkey tier:
the decode replica computes at most the last partial block and answers as one replica would; bad or late transfers
are computed, never wrong, never stuck."""

import time
import uuid

import aiohttp
import pytest

from test_fleet import KEY, NAME, chat, router, serving
from helpers import make_config
from tieredkv import AsyncEngine, EngineConfig, SamplingParams


def config(llama_dir, valkey=None, key=None) -> EngineConfig:
    extra = {"remote_url": valkey.url, "cold_secret_path": str(key)} if valkey is not None else {}
    return make_config(model=str(llama_dir), num_blocks=128, warm_bytes=0, max_num_seqs=4, **extra)


def system_prompt() -> str:
    """A long system prompt no other test wrote to the shared server."""
    return f"Session {uuid.uuid4().hex}. " + "The decode replica reads the prefill replica's blocks. " * 14


@pytest.fixture(scope="module")
async def pair(llama_dir, valkey_server, fleet_key):
    engines = [await AsyncEngine.start(config(llama_dir, valkey_server, fleet_key)) for _ in range(2)]
    yield engines
    for engine in engines:
        await engine.close()


async def post(session, url, body):
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_vllm_router_splits_prefill_and_decode(pair, stream):
    prefill, decode = pair
    messages = chat(system_prompt(), "Which replica computes the prompt?")
    n_prompt = len(await prefill.tokenize(messages))
    # (vllm-router's P/D mode sends no Authorization header to the replicas: they run without a key here)
    async with serving(pair, kv_transfer_timeout=5.0, api_key=None) as (p_url, d_url), router(
            "vllm_router.launch_router", ["--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url,
                                          "--api-key", KEY, "--policy", "round_robin"]) as running:
        import openai

        client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key=KEY, max_retries=0)
        before = [(e.stats().prefix_cache_queries, e.stats().prefix_cache_hits) for e in pair]
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True,
                stream_options={"include_usage": True})]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            got = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
            text, usage = got.choices[0].message.content, got.usage
        await client.close()
        asked = [e.stats().prefix_cache_queries - b[0] for e, b in zip(pair, before)]
        hits = [e.stats().prefix_cache_hits - b[1] for e, b in zip(pair, before)]
    assert asked == [n_prompt, n_prompt]  # each replica took its part
    assert hits[0] == 0 and hits[1] >= n_prompt - 16  # decode computed at most the last partial block
    assert usage.prompt_tokens == n_prompt  # (the router reports the prefill's usage of the prompt)
    alone = await prefill.generate(messages, SamplingParams(max_tokens=12, temperature=0))
    assert text == alone.outputs[0].text  # what one replica answers


async def test_transfer_parameters_that_cannot_be_used_are_computed(pair, llama_dir):
    prefill, decode = pair
    async with serving(pair, kv_transfer_timeout=0.5) as (p_url, d_url), aiohttp.ClientSession() as s:
        messages = chat(system_prompt(), "hello")
        body = {"model": NAME, "messages": messages, "max_tokens": 3, "temperature": 0}
        status, err = await post(s, f"{d_url}/v1/chat/completions", {**body, "kv_transfer_params": [1, 2]})
        assert status == 400 and err["error"]["param"] == "kv_transfer_params"

        status, first = await post(s, f"{p_url}/v1/chat/completions", {**body, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False}})
        params = first["kv_transfer_params"]
        ours = params["tieredkv"]
        assert status == 200 and params["do_remote_prefill"] is True and ours["ready"] is True
        assert ours["num_blocks"] == len(await prefill.tokenize(messages)) // 16

        alone = (await prefill.generate(messages, SamplingParams(max_tokens=3, temperature=0))).outputs[0].text
        for broken in ({**ours, "num_blocks": "many"}, {**ours, "root": "0" * 32}, "not a dict"):
            status, got = await post(s, f"{d_url}/v1/chat/completions", {
                **body, "kv_transfer_params": {**params, "tieredkv": broken}})  # not waited for: a plain request
            assert status == 200 and got["choices"][0]["message"]["content"] == alone
            await decode.clear_cache("hot")

        # a prefill replica that died before its blocks were written: the decode replica waits its timeout, computes
        lost = chat(system_prompt(), "never prefilled")
        n_lost = len(await decode.tokenize(lost)) // 16
        lost_params = {**params, "tieredkv": {**ours, "ready": False, "num_blocks": n_lost}}
        t0 = time.monotonic()
        status, got = await post(s, f"{d_url}/v1/chat/completions", {**body, "messages": lost,
                                                                     "kv_transfer_params": lost_params})
        assert status == 200 and got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert 0.4 < time.monotonic() - t0 < 10
        lost_alone = await prefill.generate(lost, SamplingParams(max_tokens=3, temperature=0))
        assert got["choices"][0]["message"]["content"] == lost_alone.outputs[0].text

        status, got = await post(s, f"{d_url}/v1/chat/completions", {  # the blocks arrived: read, not computed
            **body, "kv_transfer_params": params})
        assert got["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["remote"] >= ours["num_blocks"] * 16 - 16
        assert got["choices"][0]["message"]["content"] == alone

    async with await AsyncEngine.start(config(llama_dir)) as single:  # no shared tier: it says so; decode computes
        async with serving([single]) as (url,), aiohttp.ClientSession() as s:
            status, got = await post(s, f"{url}/v1/chat/completions", {**body, "max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True}})
            assert status == 200 and got["kv_transfer_params"] is None


async def test_sglang_router_pairs_prefill_and_decode(pair):
    """sglang-router sends each request to both replicas at once with its bootstrap fields; the prefill replica
    (--disaggregation-mode prefill) computes and writes the prompt through, the decode replica waits for it."""
    from tieredkv.serve import ServerSettings, start_server

    prefill, decode = pair
    runners, urls = [], []
    try:
        for engine, mode in zip(pair, ("prefill", "decode")):
            runner, port = await start_server(engine, ServerSettings(model_name=NAME, disaggregation_mode=mode,
                                                                     kv_transfer_timeout=5.0), port=0)
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")
        messages = chat(system_prompt(), "Which replica decodes?")
        n_prompt = len(await prefill.tokenize(messages))
        before = [e.stats().prefix_cache_hits for e in pair]
        async with router("sglang_router.launch_router", ["--pd-disaggregation", "--prefill", urls[0], "--decode",
                                                          urls[1], "--policy", "round_robin"]) as running:
            import openai

            client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key=KEY, max_retries=0)
            got = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
            await client.close()
        hits = [e.stats().prefix_cache_hits - b for e, b in zip(pair, before)]
    finally:
        for runner in runners:
            await runner.cleanup()
    assert hits[1] >= n_prompt - 16, hits  # the decode replica read the prompt the prefill replica computed
    alone = await prefill.generate(messages, SamplingParams(max_tokens=12, temperature=0))
    assert got.choices[0].message.content == alone.outputs[0].text
    assert got.usage.completion_tokens == len(alone.outputs[0].token_ids)
