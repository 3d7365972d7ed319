"""The server under hostile clients: limits over every field a chat template renders, no 5xx for any
request body, a write timeout for clients that stop reading, graceful shutdown on SIGTERM."""

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import check_pool_clean, make_checkpoint, make_config, ROOT
from tieredkv import AsyncEngine, EngineClosedError, RequestError, SamplingParams
from tieredkv.serve import ServerSettings, start_server

NAME = "tiny"


class ThreadServer:
    """An engine and its server on an event loop of their own, so that plain blocking clients (and
    hypothesis, which drives synchronous tests) can talk to it."""

    def __init__(self, model_dir: Path, config: dict, **settings):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine, self.runner, self.port = self.call(self._start(model_dir, config, settings))

    async def _start(self, model_dir, config, settings):
        engine = await AsyncEngine.start(make_config(model=str(model_dir), max_num_seqs=8, warm_bytes=0, **config))
        runner, port = await start_server(engine, ServerSettings(model_name=NAME, **settings), port=0)
        return engine, runner, port

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, path: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def open_stream(self, prompt) -> None:
        """engine.stream(prompt) on the engine's loop, closed at once: raises what stream() raises."""
        async def open_and_close():
            async with self.engine.stream(prompt, SamplingParams(max_tokens=1)):
                pass

        self.call(open_and_close())

    def pool_clean(self) -> None:
        for _ in range(100):  # aborts of dropped clients land between steps
            if self.engine.stats().num_running == 0 and self.engine.stats().blocks_used == 0:
                break
            time.sleep(0.02)
        self.call(self.engine.run_in_worker(check_pool_clean, self.engine.core))

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.call(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ThreadServer(llama_dir, dict(num_blocks=64, max_model_len=128), max_prompt_chars=20_000,
                     max_body_bytes=1 << 20)
    yield s
    s.close()


def error_of(status_body):
    status, _, raw = status_body
    return status, json.loads(raw)["error"]


# -- limits over every field -------------------------------------------------------------------------

def test_a_huge_role_is_refused_from_its_size_before_any_tokenizing(server):
    """The limit counts what the template renders, roles included; refused at once, without tokenizing."""
    body = {"model": NAME, "messages": [{"role": "x" * 30_000, "content": "hi"}], "max_tokens": 2}
    status, error = error_of(server.post("/v1/chat/completions", body))
    assert status == 400 and error["param"] == "prompt"  # the content alone is 2 characters
    with pytest.raises(RequestError, match="were not tokenized"):  # the Python API: in stream(), before tokenizing
        server.open_stream([{"role": "x" * 3_000_000, "content": "hi"}])
    with pytest.raises(RequestError, match="were not tokenized"):  # any field a template may render
        server.open_stream([{"role": "user", "content": "hi", "name": "n" * 3_000_000}])
    server.pool_clean()


def test_a_lone_surrogate_in_a_role_is_a_request_error(server):
    raw = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "us\\ud800er", "content": "hi"}]}'
    status, error = error_of(server.post("/v1/chat/completions", raw))
    assert status == 400 and "lone surrogate" in error["message"]
    with pytest.raises(RequestError, match="message 0 role is not valid Unicode"):
        server.open_stream([{"role": "us\ud800er", "content": "hi"}])


# -- no 5xx for any body -----------------------------------------------------------------------------

@pytest.mark.parametrize("raw, param", [
    (b"[" * 100_000 + b"]" * 100_000, None),  # nested past the parser's recursion limit
    (b'{"model": "tiny", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", None),  # past Python's int limit
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 2, "stream": true, "stream_options": "usage"}',
     "stream_options"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 2, "stream": true, "stream_options": [1]}', "stream_options"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 2, "stream": true, '
     b'"stream_options": {"include_usage": "yes"}}', "stream_options"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 2, "stream": "yes"}', "stream"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 2, "stream_options": {"include_usage": true}}',
     "stream_options"),
], ids=["nested-100k-deep", "int-of-5000-digits", "stream_options-string", "stream_options-list",
        "include_usage-string", "stream-string", "stream_options-without-stream"])
def test_bodies_that_once_gave_500_are_400_naming_what_is_wrong(server, raw, param):
    before = server.engine.stats().prefix_cache_queries
    status, error = error_of(server.post("/v1/completions", raw))
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert server.engine.stats().prefix_cache_queries == before  # refused before anything was admitted


json_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(),
                        st.text(max_size=12), st.sampled_from(["\ud800", "", "user", "text"]))
json_values = st.recursive(json_leaves, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
small_ints = st.one_of(st.integers(-3, 5), st.sampled_from([0, 2**63, 2**64, 10**40]))
messages = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["user", "system", "assistant"]), json_values),
    "content": st.one_of(st.text(max_size=30), json_values,
                         st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                         "text": st.one_of(st.text(max_size=10), json_values)}),
                                  max_size=2)),
    "name": json_values}), max_size=3)
fields = {
    "model": st.one_of(st.just(NAME), json_values), "messages": st.one_of(messages, json_values),
    "prompt": st.one_of(st.text(max_size=30), st.lists(small_ints, max_size=5), json_values),
    "max_completion_tokens": st.one_of(small_ints, json_values), "n": st.one_of(small_ints, json_values),
    "temperature": st.one_of(st.floats(), json_values), "top_p": st.one_of(st.floats(), json_values),
    "top_k": st.one_of(small_ints, json_values), "seed": st.one_of(small_ints, json_values),
    "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3), json_values),
    "logprobs": st.one_of(st.booleans(), small_ints, json_values), "top_logprobs": st.one_of(small_ints, json_values),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=4), st.floats(), max_size=2), json_values),
    "stream": st.one_of(st.booleans(), json_values), "stream_options": json_values,
    "presence_penalty": st.one_of(st.floats(), json_values), "min_tokens": st.one_of(small_ints, json_values),
    "response_format": json_values, "ignore_eos": st.one_of(st.booleans(), json_values),
}
bodies = st.fixed_dictionaries({"max_tokens": st.one_of(st.integers(1, 4), small_ints, json_values)}, optional=fields)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans())
def test_no_request_body_gets_a_5xx(server, body, chat):
    """Every body the schema's fields can take, valid or not: a 2xx or a 4xx in OpenAI's error shape,
    a stream that ends with [DONE], never a 5xx; the pool stays clean."""
    status, _, raw = server.post("/v1/chat/completions" if chat else "/v1/completions", body)
    assert status < 500, raw[:300]
    if status >= 400:
        error = json.loads(raw)["error"]
        assert error["message"] and error["type"]
    elif body.get("stream") is True:
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    else:
        assert json.loads(raw)["choices"]
    server.pool_clean()


# -- clients that stop reading -------------------------------------------------------------------------

@pytest.fixture
def roomy_server(llama_dir):
    s = ThreadServer(llama_dir, dict(num_blocks=8 * 128 + 8), write_timeout=1.0)
    yield s
    s.close()


def test_a_client_that_stops_reading_is_aborted_and_its_blocks_freed(roomy_server):
    """A stream whose client reads nothing: once the socket buffers are full (a few MB: the stream would
    send some 25), write_timeout (1 s here) later the request is aborted and its blocks freed, while the
    client still holds its connection."""
    server = roomy_server
    body = json.dumps({"model": NAME, "prompt": [5, 6, 7], "max_tokens": 2000, "n": 8, "ignore_eos": True,
                       "stream": True, "logprobs": 20, "temperature": 1.0, "seed": 1}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        engine = server.engine
        deadline = time.monotonic() + 30
        while engine.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        while (engine.stats().num_running or engine.stats().blocks_used) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats().num_running == 0, "the stalled stream was never aborted"
        server.pool_clean()
        sock.settimeout(2)  # the request was aborted: whatever was sent is buffered already
        received = b""
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        assert b"data: [DONE]" not in received  # it was cut, not finished
        assert received.count(b'"text"') < 8 * 2000
    finally:
        sock.close()


# -- shutdown ------------------------------------------------------------------------------------------

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def read_sse(conn: http.client.HTTPConnection, body: dict) -> http.client.HTTPResponse:
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    return conn.getresponse()


def test_the_cli_serves_and_on_sigterm_drains_writes_the_cold_tier_and_exits_0(tmp_path):
    """`tieredkv serve` answers the official client and serves /metrics; on SIGTERM: /health fails and new requests
    get 503 at once; streams that finish within the grace period end normally, the one that cannot ends with a final
    error event and [DONE]; the cold tier holds every block the hot pool had cached; the process exits 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cold = tmp_path / "cold"
    # a context long enough that the endless stream below cannot finish within the grace period at any speed
    # this tiny model decodes at (0.2 ms a token compiled here: 2,000 tokens would)
    llama_dir = make_checkpoint(tmp_path / "long-context", "llama", max_position_embeddings=1 << 16)
    proc = subprocess.Popen([sys.executable, "-m", "tieredkv", "serve", "--model", str(llama_dir), "--port",
                             str(port), "--served-model-name", NAME, "--cold-path", str(cold),
                             "--shutdown-grace", "2"], env={**ENV, "XDG_CONFIG_HOME": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        while line and "serving" not in line:
            line = proc.stdout.readline()
        assert "serving" in line and "metrics on /metrics" in line, line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        done = client.completions.create(model=NAME, prompt="Paged attention", max_tokens=3)
        assert done.usage.completion_tokens == 3
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert "tieredkv_generated_tokens" in metrics and "tieredkv_requests" in metrics
        prompt = list(range(5, 5 + 64))  # four full blocks, cached in hot as they are computed
        short = {"model": NAME, "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "stream": True}
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for _ in range(4)]
        streams = [read_sse(c, {**short, "prompt": prompt[:-1] + [400 + i]}) for i, c in enumerate(conns[:3])]
        endless = read_sse(conns[3], {**short, "max_tokens": 60_000})  # 12 s at 0.2 ms a token
        for r in streams + [endless]:
            assert r.readline().startswith(b"data: {")  # every stream is running
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        probe = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        probe.request("GET", "/health")
        health = probe.getresponse()
        assert health.status == 503 and json.loads(health.read())["status"] == "draining"
        late = read_sse(probe, short)
        assert late.status == 503 and late.getheader("Retry-After") == "1"
        late.read()
        for r in streams:
            rest = r.read()
            assert rest.endswith(b"data: [DONE]\n\n") and b'"finish_reason": "length"' in rest
        rest = endless.read()
        assert b"engine closed" in rest and rest.endswith(b"data: [DONE]\n\n")
        assert proc.wait(timeout=60) == 0
        assert 1.5 < time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    assert "stopped" in out and "Traceback" not in out, out
    key = tmp_path / "tieredkv" / "cold.key"  # the server's: under its XDG_CONFIG_HOME
    assert asyncio.run(cold_tokens(llama_dir, cold, key, prompt[:-1] + [400])) == 48  # 3 blocks; the 4th: last token


async def cold_tokens(llama_dir, cold, key, prompt) -> int:
    """Prompt tokens a fresh engine on the cold store serves from it."""
    config = make_config(model=str(llama_dir), num_blocks=32, cold_path=str(cold), cold_secret_path=str(key),
                         warm_bytes=0)
    async with await AsyncEngine.start(config) as engine:
        out = await engine.generate(prompt, SamplingParams(max_tokens=1))
        return out.usage.cached_tokens_by_tier.get("cold", 0)


async def test_close_on_signals_drains_an_application_engine(llama_dir, tmp_path):
    """The Python API: close_on_signals(grace) makes SIGTERM refuse new streams at once, let the running
    ones finish, and close (writing the cold tier); closed() returns then."""
    engine = await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=32, cold_path=str(tmp_path),
                                                 warm_bytes=0))
    engine.close_on_signals(grace=30)
    prompt = list(range(5, 5 + 40))
    async with engine.stream(prompt, SamplingParams(max_tokens=30, ignore_eos=True)) as stream:
        chunks = [await stream.__anext__()]
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.05)
        with pytest.raises(EngineClosedError, match="shutting down"):
            engine.stream(prompt)
        chunks += [c async for c in stream]
    assert sum(len(c.token_ids) for c in chunks) == 30 and chunks[-1].finish_reason == "length"
    await asyncio.wait_for(engine.closed(), 30)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second signal would act as usual
    from tieredkv.tiers.cold_format import default_secret_path

    assert await cold_tokens(llama_dir, tmp_path, default_secret_path(), prompt) == 32  # written back on close
