"""A request's failure stays its own: a fault injected into each per-request stage after the forward fails
the request it belongs to, with an error naming the stage, while streams in flight beside it finish with
the tokens they get without the fault; a fault in the shared step ends every stream with a clear error, in
Python and over HTTP (an SSE error event, then [DONE], then the connection closes)."""

import asyncio
import http.client
import json
import threading
import time

import pytest
from pydantic import ValidationError

from helpers import check_pool_clean, make_config
from test_serve_hardening import ThreadServer
from tieredkv import SamplingError, SamplingParams, StepError
from tieredkv.core import beam
from tieredkv.core.sequence import Sequence
from tieredkv.engine import sampler
from tieredkv.engine.lifecycle import Lifecycle

MARK = 424242  # the seed that marks the request a fault is injected into (greedy rows never read it)
PROMPTS = [list(range(3, 40)), list(range(50, 71)), list(range(90, 130))]
BYSTANDERS = [SamplingParams(max_tokens=64, ignore_eos=True),
              SamplingParams(max_tokens=64, ignore_eos=True, repetition_penalty=1.3, logit_bias={17: 3.0}),
              SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.9, seed=7)]


@pytest.fixture(scope="module")
async def engine(engines, llama_dir):
    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=128, max_num_seqs=16))
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
async def expected(engine):
    """What each bystander gets with no fault anywhere (run together, as they run beside the victim)."""
    outs = await asyncio.gather(*[engine.generate(p, s) for p, s in zip(PROMPTS, BYSTANDERS)])
    return [o.outputs[0].token_ids for o in outs]


def marked(rows) -> bool:
    return any(getattr(r, "params", r).seed == MARK for r in rows)


def raise_in_sampling(monkeypatch):
    real = sampler.sample

    def sample(logits, rows, generators):
        if marked(rows):
            raise RuntimeError("injected: sampling")
        return real(logits, rows, generators)

    monkeypatch.setattr("tieredkv.engine.lifecycle.sample", sample)


def raise_in_processors(monkeypatch):
    """Changes the rows in place first, as a processor that fails half-way would."""
    real = sampler.apply_processors

    def apply(logits, rows):
        out = real(logits, rows)
        if marked(rows):
            raise ValueError("injected: processors")
        return out

    monkeypatch.setattr(sampler, "apply_processors", apply)
    monkeypatch.setattr("tieredkv.engine.lifecycle.apply_processors", apply)


def raise_in_grammar(monkeypatch):
    real = Lifecycle._mask_by_grammar

    def mask(self, logits, seqs, rows):
        if any(seqs[i].request.params.seed == MARK for i in rows):
            raise RuntimeError("injected: grammar")
        return real(self, logits, seqs, rows)

    monkeypatch.setattr(Lifecycle, "_mask_by_grammar", mask)


def raise_in_beam_scoring(monkeypatch):
    """As length_penalty=1100 did: a Python float's power overflowing inside the beam step."""
    real = beam.BeamSearch.step

    def step(self, beams, rows):
        if self.params.seed == MARK:
            return float(len(beams) + 1) ** 1100.0
        return real(self, beams, rows)

    monkeypatch.setattr(beam.BeamSearch, "step", step)


def raise_in_stop_rules(monkeypatch):
    real = Sequence.append

    def append(self, token, max_model_len):
        if self.request.params.seed == MARK and self.num_output_tokens >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected: stop rules")
        return real(self, token, max_model_len)

    monkeypatch.setattr(Sequence, "append", append)


def raise_in_caching(monkeypatch, kv, at_call: int):
    """A fault in what every request shares: the KV manager's caching of full blocks, at its Nth call."""
    real, calls = kv.cache_full_blocks, [0]

    def cache_full_blocks(seq):
        calls[0] += 1
        if calls[0] == at_call:
            raise KeyError("injected: the block pool's books")
        return real(seq)

    monkeypatch.setattr(kv, "cache_full_blocks", cache_full_blocks)


STAGES = {
    "sampling": (raise_in_sampling, dict(temperature=0.7), "sampling", "injected: sampling"),
    "logits processors": (raise_in_processors, dict(repetition_penalty=1.1), "sampling", "injected: processors"),
    "structured output": (raise_in_grammar, dict(json_schema={"type": "object"}), "structured output",
                          "injected: grammar"),
    "beam search": (raise_in_beam_scoring, dict(beam_width=2, length_penalty=2.0), "beam search", "OverflowError"),
    "beam processors": (raise_in_processors, dict(beam_width=2, repetition_penalty=1.1), "logits processors",
                        "injected: processors"),
    "stop rules": (raise_in_stop_rules, dict(stop=["zz"]), "stop rules", "injected: stop rules"),
}


@pytest.mark.parametrize("stage", list(STAGES))
async def test_a_fault_in_one_requests_stage_fails_that_request_alone(engine, expected, monkeypatch, stage):
    if stage == "structured output":
        pytest.importorskip("llguidance")
    inject, victim_params, error_stage, cause = STAGES[stage]
    inject(monkeypatch)
    streams = [asyncio.create_task(engine.generate(p, s)) for p, s in zip(PROMPTS, BYSTANDERS)]
    while engine.stats().num_running < len(streams):  # the bystanders are running
        await asyncio.sleep(0.001)
    params = SamplingParams(max_tokens=16, seed=MARK, **victim_params)
    with pytest.raises(SamplingError, match=cause) as failed:
        await engine.generate(list(range(200, 230)), params)
    assert failed.value.stage == error_stage
    assert f"the request's {error_stage} failed" in str(failed.value)
    named = [f for f in failed.value.fields if f in params.model_fields_set]
    assert named == list(failed.value.fields) and (named or error_stage == "stop rules")
    assert [o.outputs[0].token_ids for o in await asyncio.gather(*streams)] == expected
    await engine.run_in_worker(check_pool_clean, engine.core)


async def test_a_fault_in_the_shared_step_ends_every_stream_with_a_step_error(engine, monkeypatch):
    """Not the forward (fail_step covers that) but what every request shares: here, caching full blocks."""
    raise_in_caching(monkeypatch, engine.core.kv, at_call=40)
    results = await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=40, ignore_eos=True))
                                     for p in PROMPTS], return_exceptions=True)
    assert all(isinstance(r, StepError) and "injected" in str(r) for r in results), results
    monkeypatch.undo()
    await engine.run_in_worker(check_pool_clean, engine.core)
    assert len((await engine.generate(PROMPTS[0], SamplingParams(max_tokens=4))).outputs[0].token_ids) >= 1


async def test_a_failed_forward_ends_every_stream_in_it_and_the_engine_serves_on(engine, monkeypatch):
    """The shared forward is the one failure that fails a batch: every stream in it ends with a StepError
    naming the cause; the next request is served."""
    runner = engine.core.runner
    real, calls = runner.execute, [0]

    def execute(out):
        calls[0] += 1
        if calls[0] == 10:
            raise RuntimeError("injected: the device is gone")
        return real(out)

    monkeypatch.setattr(runner, "execute", execute)
    results = await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=40, ignore_eos=True))
                                     for p in PROMPTS], return_exceptions=True)
    assert all(isinstance(r, StepError) and "injected" in str(r) for r in results), results
    await engine.run_in_worker(check_pool_clean, engine.core)
    assert len((await engine.generate(PROMPTS[0], SamplingParams(max_tokens=4))).outputs[0].token_ids) >= 1


def test_length_penalty_is_bounded_and_scores_never_overflow():
    with pytest.raises(ValidationError, match="length_penalty"):
        SamplingParams(beam_width=2, length_penalty=1100)
    SamplingParams(beam_width=2, length_penalty=-10.0)
    assert beam.penalized(-3.0, 100_000, 1100.0) == 0.0  # the power saturates: no OverflowError
    assert beam.penalized(-3.0, 4, 1.0) == -0.75


# -- over HTTP ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llama_dir):
    s = ThreadServer(llama_dir, dict(num_blocks=128, max_model_len=256))
    yield s
    s.close()


def stream_events(port: int, body: dict, out: dict, key: str) -> None:
    """POSTs a streaming completion and reads it to the end of the body: the events, and whether the server
    closed the stream properly ([DONE] as the last event, then the end of the chunked body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read().decode()  # returns only once the body ended
        events = [line[6:] for line in raw.split("\n\n") if line.startswith("data: ")]
        out[key] = (r.status, [e if e == "[DONE]" else json.loads(e) for e in events])
    finally:
        conn.close()


def run_streams(server: ThreadServer, bodies: dict) -> dict:
    """Each body streamed on a thread of its own; "victim" starts once the others run."""
    out: dict = {}
    threads = {key: threading.Thread(target=stream_events, args=(server.port, body, out, key))
               for key, body in bodies.items()}
    for key, t in threads.items():
        deadline = time.monotonic() + 30
        while key == "victim" and server.engine.stats().num_running < len(bodies) - 1:
            assert time.monotonic() < deadline, "the other streams never ran"
            time.sleep(0.001)
        t.start()
    for t in threads.values():
        t.join(90)
    return out


def test_over_http_a_failing_request_gets_an_error_event_and_bystanders_finish(server, monkeypatch):
    raise_in_beam_scoring(monkeypatch)
    bystander = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 150, "ignore_eos": True,
                 "stream_options": {"include_usage": True}}
    victim = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 30, "use_beam_search": True, "n": 2,
              "best_of": 2, "seed": MARK}
    got = run_streams(server, {"a": bystander, "b": {**bystander, "prompt": PROMPTS[2]}, "victim": victim})
    for key in ("a", "b"):
        status, events = got[key]
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 150
        assert not any("error" in e for e in events if isinstance(e, dict))
    status, events = got["victim"]
    assert status in (200, 500)
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e] if status == 200 else []
    if status == 200:
        assert events[-1] == "[DONE]" and len(errors) == 1 and "beam search" in errors[0]["message"]
    server.pool_clean()


def test_over_http_a_failed_shared_step_ends_every_stream_with_an_error_event(server, monkeypatch):
    raise_in_caching(monkeypatch, server.engine.core.kv, at_call=60)
    bodies = {str(i): {"model": "tiny", "prompt": p, "max_tokens": 60, "ignore_eos": True}
              for i, p in enumerate(PROMPTS)}
    got = run_streams(server, bodies)
    assert set(got) == set(bodies)  # every connection ended (read() returned)
    for status, events in got.values():
        assert status == 200 and events[-1] == "[DONE]"
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and "injected" in errors[0]["message"] and errors[0]["type"] == "server_error"
    monkeypatch.undo()
    server.pool_clean()


def test_over_http_an_unbounded_length_penalty_is_a_400(server):
    status, _, raw = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4,
                                                     "use_beam_search": True, "n": 2, "length_penalty": 1100})
    assert status == 400 and "length_penalty" in json.loads(raw)["error"]["message"]


async def test_a_client_gone_mid_write_is_a_499_not_a_failure(engine, caplog):
    """The app mounted in a program's own aiohttp runner (handlers not cancelled on disconnect): the client
    closes its connection mid-stream; the next write finds it gone, the request is aborted and logged 499."""
    import logging

    from aiohttp import web

    from tieredkv.serve import ServerSettings, create_app

    caplog.set_level(logging.INFO, logger="tieredkv.access")
    runner = web.AppRunner(create_app(engine, ServerSettings(model_name="tiny")))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True,
                           "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        assert b"data: " in await reader.readuntil(b"data: ")
        writer.close()
        await writer.wait_closed()
        for _ in range(500):
            if any(" 499 " in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.01)
        assert any(r.name == "tieredkv.access" and " 499 " in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        await engine.run_in_worker(check_pool_clean, engine.core)
    finally:
        await runner.cleanup()
