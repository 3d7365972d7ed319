"""The OpenAI-compatible server, driven by the official `openai` client (and raw HTTP for what a client
library would not send)."""

import asyncio
import logging

import aiohttp
import openai
import pytest

from helpers import check_pool_clean, make_config
from tieredkv import AsyncEngine, SamplingParams
from tieredkv.serve import ServerSettings, start_server

NAME = "tiny"
SYSTEM = "Paged attention keeps keys and values in fixed-size blocks. " * 8


@pytest.fixture(scope="module")
async def server(llama_dir):
    engine = await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=256, max_num_seqs=8))
    runner, port = await start_server(engine, ServerSettings(model_name=NAME, max_queued=4, max_body_bytes=1 << 16,
                                                             max_prompt_chars=20_000), port=0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    yield engine, client, f"http://127.0.0.1:{port}"
    await client.close()
    await runner.cleanup()
    await engine.close()


def chat(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def test_chat_matches_the_engine_and_reports_usage(server):
    engine, client, _ = server
    got = await client.chat.completions.create(model=NAME, messages=chat("What is a block?"), max_tokens=12)
    want = await engine.generate(chat("What is a block?"), SamplingParams(max_tokens=12))
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


async def test_a_repeated_system_prompt_reports_cached_tokens(server):
    _, client, _ = server
    await client.chat.completions.create(model=NAME, messages=chat("first question"), max_tokens=2)
    again = await client.chat.completions.create(model=NAME, messages=chat("second one"), max_tokens=2)
    details = again.usage.prompt_tokens_details
    assert details.cached_tokens >= 64
    assert sum(details.model_extra["cached_tokens_by_tier"].values()) == details.cached_tokens


async def test_streamed_chat_equals_the_whole_one_with_usage_last(server):
    _, client, _ = server
    whole = await client.chat.completions.create(model=NAME, messages=chat("stream it"), max_tokens=16)
    stream = await client.chat.completions.create(model=NAME, messages=chat("stream it"), max_tokens=16,
                                                  stream=True, stream_options={"include_usage": True})
    text, finish, usage = [], None, None
    async for event in stream:
        if event.choices:
            text.append(event.choices[0].delta.content or "")
            finish = event.choices[0].finish_reason or finish
        if event.usage is not None:
            usage = event.usage
    assert "".join(text) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


async def test_n_and_seed_are_reproducible(server):
    _, client, _ = server
    kwargs = dict(model=NAME, messages=chat("pick words"), max_tokens=10, n=2, temperature=1.0, seed=42)
    a = await client.chat.completions.create(**kwargs)
    b = await client.chat.completions.create(**kwargs)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2 and a.choices[0].index == 0 and a.choices[1].index == 1
    c = await client.chat.completions.create(**{**kwargs, "seed": 43})
    assert [x.message.content for x in c.choices] != [x.message.content for x in a.choices]


async def test_beam_search_as_vllm_clients_ask_for_it(server):
    """use_beam_search with best_of beams (extra_body, as vLLM takes it): the n best come back, best first,
    as the engine's own beam search returns them."""
    engine, client, _ = server
    got = await client.completions.create(model=NAME, prompt="The quick brown", max_tokens=8, n=2, temperature=0,
                                          extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 0.5})
    want = await engine.generate("The quick brown", SamplingParams(max_tokens=8, n=2, beam_width=4,
                                                                   length_penalty=0.5))
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert [c.index for c in got.choices] == [0, 1]
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)


async def test_stop_strings(server):
    engine, client, _ = server
    plain = await client.completions.create(model=NAME, prompt="The quick brown", max_tokens=12, temperature=0)
    text = plain.choices[0].text
    stop = text[4:7]
    assert stop.strip()
    got = await client.completions.create(model=NAME, prompt="The quick brown", max_tokens=12, stop=[stop])
    assert got.choices[0].text == text[: text.index(stop)]
    assert got.choices[0].finish_reason == "stop"


async def test_logprobs_in_chat_and_completions(server):
    _, client, _ = server
    got = await client.chat.completions.create(model=NAME, messages=chat("logprobs"), max_tokens=6, logprobs=True,
                                               top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    done = await client.completions.create(model=NAME, prompt="Paged", max_tokens=4, logprobs=1)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and lp.text_offset == sorted(lp.text_offset)


async def test_completions_stream(server):
    _, client, _ = server
    whole = await client.completions.create(model=NAME, prompt=[5, 6, 7, 8], max_tokens=8)
    parts = [e.choices[0].text async for e in await client.completions.create(model=NAME, prompt=[5, 6, 7, 8],
                                                                               max_tokens=8, stream=True)]
    assert "".join(parts) == whole.choices[0].text


async def test_models_and_health(server):
    _, client, url = server
    models = await client.models.list()
    assert [m.id for m in models.data] == [NAME]
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"


@pytest.mark.parametrize("body, status, param", [
    ({"model": NAME}, 400, "messages"),
    ({"model": NAME, "messages": "hi"}, 400, "messages"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400, "tools"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "best_of": 3}, 400, "best_of"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "best_of": 99}, 400,
     "best_of"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x" * 30_000}]}, 400, "prompt"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "speculative": True}, 400, "speculative"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "speculative": "often"}, 400, "speculative"),
])
async def test_malformed_requests_get_openai_errors_naming_the_field(server, body, status, param):
    engine, _, url = server
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == status
        error = (await r.json())["error"]
        assert error["param"] == param and error["message"] and error["type"]
    await engine.run_in_worker(check_pool_clean, engine.core)


async def test_invalid_json_and_a_huge_body(server):
    _, _, url = server
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
        async with s.post(url + "/v1/completions", data=b"x" * (1 << 17)) as r:
            assert r.status == 413 and (await r.json())["error"]


async def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    engine, _, url = server
    body = {"model": NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + "/v1/completions", json=body)
        events = 0
        while events < 3:  # three tokens have streamed
            line = await r.content.readline()
            assert line, "the stream ended early"
            events += line.startswith(b"data: {")
        assert engine.stats().blocks_used > 0
        r.close()  # the connection is dropped mid-stream
    for _ in range(100):
        await asyncio.sleep(0.05)
        s = engine.stats()
        if s.num_running == 0 and s.blocks_used == 0:
            break
    await engine.run_in_worker(check_pool_clean, engine.core)


async def test_overload_queues_then_answers_429_with_retry_after(server):
    engine, client, url = server
    body = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async def one():
            async with s.post(url + "/v1/completions", json=body) as r:
                return r.status, r.headers.get("Retry-After")

        results = await asyncio.gather(*(one() for _ in range(30)))  # 8 run, 4 may wait, the rest are turned away
    assert {status for status, _ in results} <= {200, 429}
    assert sum(status == 200 for status, _ in results) >= 12
    assert all(retry == "1" for status, retry in results if status == 429)
    assert any(status == 429 for status, _ in results)
    await engine.run_in_worker(check_pool_clean, engine.core)


async def test_an_api_key_is_required_when_set(llama_dir):
    engine = await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=32))
    runner, port = await start_server(engine, ServerSettings(model_name=NAME, api_key="sekret"), port=0)
    try:
        bad = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        good = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sekret", max_retries=0)
        assert (await good.models.list()).data[0].id == NAME
        await bad.close()
        await good.close()
    finally:
        await runner.cleanup()
        await engine.close()


async def test_model_by_id_and_json_errors_on_every_route(server):
    _, client, url = server
    assert (await client.models.retrieve(NAME)).id == NAME
    with pytest.raises(openai.NotFoundError) as e:
        await client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found"
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/nowhere") as r:
            assert r.status == 404 and r.content_type == "application/json"
            assert (await r.json())["error"]["code"] == "not_found"
        async with s.get(url + "/v1/chat/completions") as r:  # a route that only takes POST
            body = await r.json()
            assert r.status == 405 and "POST" in r.headers["Allow"] and "GET /v1/chat/completions" in \
                body["error"]["message"]


async def test_one_created_per_stream(server, monkeypatch):
    """A clock that moves a second at every reading: the chunks still carry one `created`."""
    import itertools
    import time
    import types

    from tieredkv.serve import app as app_module

    ticks = itertools.count(1_700_000_000)
    clock = types.SimpleNamespace(time=lambda: float(next(ticks)), perf_counter=time.perf_counter)
    monkeypatch.setattr(app_module, "time", clock, raising=False)
    _, client, _ = server
    created = set()
    stream = await client.chat.completions.create(model=NAME, messages=chat("count slowly"), max_tokens=12,
                                                  stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        created.add(chunk.created)
    assert len(created) == 1
    whole = await client.completions.create(model=NAME, prompt="one two", max_tokens=4)
    assert whole.created > min(created)  # the clock moved: each response reads it once


async def test_one_access_log_line_per_request(server, caplog):
    engine, client, url = server
    caplog.set_level(logging.DEBUG, logger="tieredkv.access")
    out = await client.chat.completions.create(model=NAME, messages=chat("log me"), max_tokens=3)
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/nowhere") as r:
        assert r.status == 404
    lines = [r for r in caplog.records if r.name == "tieredkv.access"]
    assert len(lines) == 2
    assert lines[0].levelno == logging.INFO and lines[0].getMessage().startswith(
        f"POST /v1/chat/completions 200 {out.id} prompt={out.usage.prompt_tokens} "
        f"cached={out.usage.prompt_tokens_details.cached_tokens} output={out.usage.completion_tokens} ttft=")
    assert lines[1].getMessage().startswith("GET /v1/nowhere 404 ")


async def test_tokenize_and_detokenize_as_vllm_has_them(server):
    engine, _, url = server
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/tokenize", json={"prompt": "the quick brown fox"}) as r:
            body = await r.json()
        ids = engine.tokenizer.to_token_ids("the quick brown fox")
        assert r.status == 200
        assert body == {"tokens": ids, "count": len(ids), "max_model_len": engine.core.max_model_len}
        async with s.post(url + "/tokenize", json={"messages": chat("hi")}) as r:
            assert (await r.json())["tokens"] == engine.tokenizer.to_token_ids(chat("hi"))
        async with s.post(url + "/detokenize", json={"tokens": ids}) as r:
            assert (await r.json())["prompt"] == engine.tokenizer.decode(ids, False)
        async with s.post(url + "/detokenize", json={"tokens": [10**9]}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_beyond_the_context_is_a_400_naming_the_numbers(server, field):
    engine, client, _ = server
    limit = engine.core.max_model_len
    prompt = chat("how long can you go on?")
    n = len(engine.tokenizer.to_token_ids(prompt))
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=NAME, messages=prompt, **{field: limit - n + 1})
    assert e.value.body["param"] == field
    assert f"holds {limit} tokens and the prompt takes {n}, so at most {limit - n} can be generated" in \
        e.value.body["message"]
    out = await client.chat.completions.create(model=NAME, messages=prompt, **{field: 2})  # what fits still runs
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 2
