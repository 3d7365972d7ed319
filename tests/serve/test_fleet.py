"""Replicas behind the routers people run: the worker endpoints vllm-router and sglang-router call, in their shapes,
and both routers (from PyPI, the `fleet` extra) driving two replicas on loopback."""

import asyncio
import contextlib
import importlib.util
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from helpers import make_config
from tieredkv import AsyncEngine, SamplingParams
from tieredkv.serve import ServerSettings, start_server

NAME = "tiny"
KEY = "fleet-key"
SYSTEMS = ["Paged attention keeps keys and values in fixed-size blocks. " * 8,
           "A prefix cache serves shared system prompts once. " * 9]


@pytest.fixture(scope="module")
async def engines(llama_dir):
    pair = [await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=256, max_num_seqs=8))
            for _ in range(2)]
    yield pair
    for engine in pair:
        await engine.close()


@contextlib.asynccontextmanager
async def serving(engines, **settings):
    """The two engines on loopback, each behind a server of its own; yields their URLs."""
    runners = []
    try:
        urls = []
        for engine in engines:
            runner, port = await start_server(engine, ServerSettings(**{"model_name": NAME, "api_key": KEY,
                                                                        **settings}), port=0)
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


class Access(logging.Handler):
    """The servers' access log lines, as the tests read them."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def access():
    handler, log = Access(), logging.getLogger("tieredkv.access")
    level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    """A router from PyPI in a process of its own: its URL, and its log for the failure messages."""

    def __init__(self, url: str, log: Path):
        self.url, self.log = url, log

    def lines(self) -> list[str]:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace")).splitlines()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.lines()[-lines:])


@contextlib.asynccontextmanager
async def router(module: str, args: list[str], log: Path | None = None):
    """A router from PyPI in a process of its own, ready once it answers; its log goes to `log` (a temporary
    file, removed after, without one)."""
    if log is None:
        with tempfile.TemporaryDirectory() as folder:
            async with router(module, args, Path(folder) / "router.log") as running:
                yield running
        return
    port = free_port()
    cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
           "127.0.0.1", "--prometheus-port", str(free_port()), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
    running = Router(f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession() as s:
            while True:
                assert proc.poll() is None, running.tail()
                assert time.monotonic() < deadline, "the router did not come up\n" + running.tail()
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(f"{running.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as r:
                        if r.status == 200:
                            break
                await asyncio.sleep(0.25)
        yield running
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def test_worker_endpoints_in_the_routers_shapes(engines):
    engine = engines[0]
    async with serving(engines[:1]) as (url,), aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {KEY}"}) as s:
        async def get(path, method="GET", **kw):
            async with s.request(method, url + path, **kw) as r:
                return r.status, await r.json()

        assert await get("/get_load") == (200, {"load": 0})  # vllm-router's shape by default
        status, load = await get("/get_load?format=sglang")  # sglang-router's, per rank
        assert status == 200 and load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        assert await get("/load") == (200, {"server_load": 0})
        status, info = await get("/get_server_info")
        assert status == 200 and info["vllm_config"]["cache_config"]["block_size"] == 16
        assert info["page_size"] == 16 and info["max_model_len"] == engine.core.max_model_len
        assert (await get("/server_info"))[1] == info
        status, model = await get("/get_model_info")
        assert status == 200 and model["is_generation"] is True and model["served_model_name"] == NAME
        assert await get("/health_generate") == (200, {"status": "ok"})
        messages = chat(SYSTEMS[0], "What is a block?")
        status, rendered = await get("/v1/chat/completions/render", "POST", json={"model": NAME, "messages": messages})
        assert status == 200 and rendered["token_ids"] == await engine.tokenize(messages)
        status, rendered = await get("/v1/completions/render", "POST", json={"model": NAME, "prompt": "hello"})
        assert rendered["token_ids"] == await engine.tokenize("hello")
        request = {"model": NAME, "messages": messages, "max_tokens": 2}
        for _ in range(2):
            status, body = await get("/v1/chat/completions", "POST", json=request)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        status, flushed = await get("/flush_cache", "POST")
        assert status == 200 and flushed["blocks_removed"] > 0
        status, body = await get("/v1/chat/completions", "POST", json=request)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # flushed: computed again
        assert (await get("/get_load?format=yaml"))[0] == 400
    async with aiohttp.ClientSession() as s, serving(engines[:1]) as (url,):
        for path in ("/get_server_info", "/get_model_info", "/health_generate"):
            async with s.get(url + path) as r:  # the API key guards them as it guards the rest
                assert r.status == 401
        for method, path in (("POST", "/flush_cache"), ("POST", "/v1/chat/completions/render")):
            async with s.request(method, url + path, json={}) as r:
                assert r.status == 401
        async with s.get(url + "/get_load") as r:  # but the load routers poll without a key: numbers only
            assert r.status == 200


async def test_flush_cache_never_drops_blocks_in_use(engines):
    engine = engines[0]
    async with serving(engines[:1]) as (url,), aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {KEY}"}) as s:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        want = (await engine.generate(chat(SYSTEMS[1], "long, alone"), params)).outputs[0].token_ids
        stream = engine.stream(chat(SYSTEMS[1], "long, alone"), params)
        async with stream:
            chunks = [await stream.__anext__()]  # running: its blocks are in use
            async with s.post(url + "/flush_cache") as r:
                assert r.status == 200
            chunks += [c async for c in stream]
        assert chunks[-1].finish_reason == "length"
        assert [t for c in chunks for t in c.token_ids] == want  # its blocks stayed what they were


ROUTERS = [("vllm_router.launch_router", "vllm", ["--policy", "power_of_two"]),
           ("vllm_router.launch_router", "vllm", ["--policy", "cache_aware"]),
           ("sglang_router.launch_router", "sglang", ["--policy", "power_of_two"]),
           ("sglang_router.launch_router", "sglang", ["--policy", "cache_aware"])]
# sglang-router polls load (and retries a replica that failed to join) every --worker-startup-check-interval
# seconds, 30 by default: every second here, so a test of a few seconds sees both.
SGLANG = ["--worker-startup-check-interval", "1"]


@pytest.mark.parametrize("module, shape, policy", ROUTERS,
                         ids=["vllm-power_of_two", "vllm-cache_aware", "sglang-power_of_two", "sglang-cache_aware"])
async def test_a_router_from_pypi_drives_two_replicas(engines, access, tmp_path, caplog, module, shape, policy):
    """Chats, completions, responses and tokenize through the router; every call it makes to a replica answers
    (no 404), the load it asks for in its own shape; both replicas serve; the replicas log no error (sglang-router's
    gRPC probes among them)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.fail(f"{module.split('.')[0]} is not installed: the fleet extra is part of make install")
    sglang = module.startswith("sglang")
    before = [e.stats().prefix_cache_queries for e in engines]
    async with serving(engines, load_format=shape) as urls, router(module, [
            "--worker-urls", *urls, "--api-key", KEY, *policy, *(SGLANG if sglang else [])],
            tmp_path / "router.log") as running:
        if sglang:  # it answers once one replica has joined: wait until both have joined its routing policy
            deadline = time.monotonic() + 60
            while sum("step_id=update_policies" in line and "succeeded" in line for line in running.lines()) < 2:
                assert time.monotonic() < deadline, (access.lines[-20:], running.tail())
                await asyncio.sleep(0.1)
        client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key=KEY, max_retries=0)
        try:
            # one stream held open on a replica while the rest are routed: a cache-aware router sends a request it
            # finds no cached prefix for to the least loaded replica, and with every request done before the next
            # arrives (a fast replica) its ties all went to the first one
            hold = await client.chat.completions.create(model=NAME, messages=chat(SYSTEMS[0], "a long answer"),
                                                        max_tokens=200, stream=True, extra_body={"ignore_eos": True})
            assert (await hold.__anext__()).choices is not None
            got = await asyncio.gather(*(client.chat.completions.create(
                model=NAME, messages=chat(SYSTEMS[i % 2], f"question {i}"), max_tokens=4) for i in range(8)))
            assert all(g.choices[0].finish_reason in ("stop", "length") for g in got)
            text = await client.completions.create(model=NAME, prompt="hello there", max_tokens=3)
            assert text.choices[0].text is not None
            if not sglang:
                reply = await client.responses.create(model=NAME, input="hi", max_output_tokens=3)
                assert reply.status == "incomplete" and reply.output_text is not None
            await asyncio.sleep(1.5)  # a load poll or two
            assert [chunk async for chunk in hold]
        finally:
            await client.close()
    served = [e.stats().prefix_cache_queries - b for e, b in zip(engines, before)]
    assert all(n > 0 for n in served), (served, running.tail())  # both replicas took requests
    called = [line for line in access.lines if " /v1/" in line or " /get_" in line or " /health" in line]
    assert called and not [line for line in called if " 404 " in line or " 401 " in line], called
    if policy[-1] == "power_of_two":  # the load it balances on, polled in its own shape
        assert any(" /get_load" in line and " 200 " in line for line in access.lines), access.lines[-20:]
    if sglang:  # it reads both replicas' server and model info when they join
        assert sum(_joined(line) for line in access.lines) >= 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [f"{r.name}: {r.getMessage()} {r.exc_info[1] if r.exc_info else ''}" for r in errors]


def _joined(line: str) -> bool:
    """An access line of sglang-router reading a replica's server info, as it does when the replica joins."""
    return " /server_info 200" in line or " /get_server_info 200" in line
