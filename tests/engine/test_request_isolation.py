"""One bad request never hurts another, and every stream ends (reliability attacks, first round)."""

import asyncio
import threading

import pytest
from pydantic import ValidationError

from helpers import check_pool_clean, make_config
from tieredkv import (EngineClosedError, RequestError, SamplingError, SamplingParams,
                      TieredKVError, WrongLoopError)
from tieredkv.core.sequence import Request

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
async def engine(engines, llama_dir):
    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=128, max_num_seqs=64))
    yield engine
    await engine.close()


async def settled(engine):
    """Everything posted to the worker so far has been applied; the pool is clean."""
    await engine.run_in_worker(check_pool_clean, engine.core)


async def greedy(engine, prompt=PROMPT, n=8):
    out = await engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    return out.outputs[0].token_ids


@pytest.mark.parametrize("kwargs", [{"seed": 2**64}, {"seed": 2**64 - 1, "n": 2}, {"seed": 2**70},
                                    {"temperature": float("nan")}, {"temperature": float("inf")},
                                    {"top_p": float("nan")}])
def test_out_of_range_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValidationError):
        SamplingParams(**kwargs)


async def test_largest_seed_is_served(engine):
    out = await engine.generate(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, seed=2**64 - 2, n=2))
    assert [len(o.token_ids) for o in out.outputs] == [4, 4]


async def test_tiny_temperature_is_greedy(engine):
    out = await engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1e-300, ignore_eos=True))
    assert out.outputs[0].token_ids == await greedy(engine)


async def test_an_admission_failure_fails_only_its_request(engine, monkeypatch):
    real = Request.make_generator

    def make_generator(self, index, device):
        if self.request_id == "bad":
            raise RuntimeError("generator broke")
        return real(self, index, device)

    monkeypatch.setattr(Request, "make_generator", make_generator)
    good = asyncio.create_task(greedy(engine))
    with pytest.raises(RequestError, match="generator broke"):
        await engine.generate(PROMPT, SamplingParams(max_tokens=4), request_id="bad")
    assert len(await good) == 8
    await settled(engine)


async def test_nan_logits_in_one_row_fail_only_that_request(engine, monkeypatch):
    expected = await greedy(engine)
    runner = engine.core.runner
    real = runner.execute

    def execute(out):
        logits, sampled = real(out)
        logits = logits.clone()
        for i, seq in enumerate(sampled):
            if seq.request.request_id == "nan":
                logits[i] = float("nan")
        return logits, sampled

    monkeypatch.setattr(runner, "execute", execute)
    others = [asyncio.create_task(greedy(engine)) for _ in range(3)]
    with pytest.raises(SamplingError, match="not finite"):
        await engine.generate(list(range(5, 30)), SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=1),
                              request_id="nan")
    assert [await t for t in others] == [expected] * 3
    await settled(engine)


async def test_a_failed_forward_fails_only_the_requests_in_it(engine, monkeypatch):
    from tieredkv import StepError

    runner = engine.core.runner
    real = runner.execute
    calls = {"n": 0}

    def execute(out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real(out)

    monkeypatch.setattr(runner, "execute", execute)
    with pytest.raises(StepError, match="device lost"):
        await greedy(engine)
    assert len(await greedy(engine)) == 8
    await settled(engine)


async def test_abort_right_after_the_stream_starts_ends_it(engine):
    for delay in (None, 0, 0.001, 0.01):
        stream = engine.stream(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True), request_id="quick")
        first = asyncio.ensure_future(stream.__anext__())
        if delay is not None:
            await asyncio.sleep(delay)
        engine.abort("quick")
        chunks = [await asyncio.wait_for(first, 10)]
        async for chunk in stream:
            chunks.append(chunk)
        assert chunks[-1].finish_reason == "abort"
    await settled(engine)


async def test_abort_before_the_first_iteration_ends_it(engine):
    stream = engine.stream(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True), request_id="early")
    engine.abort("early")
    chunks = [c async for c in stream]
    assert [c.finish_reason for c in chunks] == ["abort"]
    await settled(engine)


async def test_an_id_reused_right_after_an_early_exit_is_served(engine):
    for _ in range(3):
        async for _chunk in engine.stream(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True), request_id="same"):
            break
        out = await asyncio.wait_for(engine.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True),
                                                     request_id="same"), 20)
        assert len(out.outputs[0].token_ids) == 5
    await settled(engine)


async def test_leaving_async_with_aborts_at_once_while_the_stream_is_held(engine):
    async with engine.stream(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True)) as stream:
        async for _chunk in stream:
            break
    await settled(engine)  # the abort was applied although `stream` is still referenced: no block is held
    assert stream.request_id


async def test_aclose_aborts_a_held_stream(engine):
    stream = engine.stream(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
    async for _chunk in stream:
        break
    await stream.aclose()
    await settled(engine)


async def test_an_unread_stream_queues_one_merged_chunk_per_sample(engine):
    params = SamplingParams(max_tokens=40, n=2, ignore_eos=True)
    async with engine.stream(PROMPT, params) as stream:
        first = await stream.__anext__()
        while await engine.run_in_worker(engine.core.has_work):
            await asyncio.sleep(0.02)  # the request runs to the end while nobody reads
        assert len(stream._channel.pending) <= 2
        chunks = [first] + [c async for c in stream]
    tokens = {0: [], 1: []}
    for c in chunks:
        tokens[c.index].extend(c.token_ids)
    assert [len(t) for t in tokens.values()] == [40, 40]
    assert len(chunks) <= 3
    await settled(engine)


async def test_a_lone_surrogate_is_a_clear_request_error(engine):
    with pytest.raises(RequestError, match="surrogate"):
        await engine.generate("abc \ud800 def", SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="surrogate"):
        await engine.generate([{"role": "user", "content": "x\udfff"}], SamplingParams(max_tokens=2))


async def test_a_huge_prompt_is_rejected_without_tokenizing(engine, monkeypatch):
    tokenizer = engine.core.tokenizer

    def refuse(*_):
        raise AssertionError("tokenized")

    monkeypatch.setattr(tokenizer, "encode", refuse)
    with pytest.raises(RequestError, match="characters"):
        engine.stream("x" * 5_000_000)


async def test_prompts_are_tokenized_off_the_event_loop(engine, monkeypatch):
    tokenizer = engine.core.tokenizer
    real, threads = tokenizer.encode, set()

    def encode(text):
        threads.add(threading.get_ident())
        return real(text)

    monkeypatch.setattr(tokenizer, "encode", encode)
    await engine.generate("Paged attention keeps keys", SamplingParams(max_tokens=2))
    assert threads and threading.get_ident() not in threads


async def test_errors_share_one_base():
    for cls in (RequestError, SamplingError, EngineClosedError, WrongLoopError):
        assert issubclass(cls, TieredKVError)


async def test_a_call_from_another_loop_raises_at_once(engine):
    def other_thread():
        async def use():
            return await engine.generate(PROMPT, SamplingParams(max_tokens=2))

        return asyncio.run(asyncio.wait_for(use(), 5))

    with pytest.raises(WrongLoopError):
        await asyncio.wait_for(asyncio.to_thread(other_thread), 1)
    with pytest.raises(WrongLoopError):
        await asyncio.to_thread(engine.stream, PROMPT)
    assert len(await greedy(engine)) == 8


async def test_abort_and_stats_work_from_another_thread(engine):
    stream = engine.stream(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True), request_id="threaded")
    async for chunk in stream:
        stats = await asyncio.to_thread(engine.stats)
        assert stats.num_running == 1
        await asyncio.to_thread(engine.abort, "threaded")
        break
    reasons = [c.finish_reason async for c in stream if c.finish_reason]
    assert reasons in (["abort"], [])
    await settled(engine)


async def test_concurrent_close_calls_all_wait_for_the_close(engines, llama_dir):
    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=32))
    stream = engine.stream(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
    await stream.__anext__()
    first = asyncio.create_task(engine.close())
    await asyncio.sleep(0)
    await engine.close()
    assert not engine._worker.thread.is_alive() or engine._worker.closed.done()
    await first
    with pytest.raises(EngineClosedError):
        async for _ in stream:
            pass
    with pytest.raises(EngineClosedError):
        await engine.generate(PROMPT)


async def test_a_dead_worker_fails_every_call_instead_of_hanging(engines, llama_dir, monkeypatch):
    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=32))
    core = engine.core

    def broken(*_):
        raise SystemError("engine bug")

    monkeypatch.setattr(core, "step", broken)
    monkeypatch.setattr(core, "fail_all", broken)
    with pytest.raises(EngineClosedError, match="engine bug"):
        await asyncio.wait_for(engine.generate(PROMPT, SamplingParams(max_tokens=3)), 10)
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(engine.generate(PROMPT), 1)
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(engine.clear_cache(), 1)
    await asyncio.wait_for(engine.close(), 5)
