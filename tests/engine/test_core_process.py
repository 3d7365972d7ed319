"""The engine core in a process of its own (EngineConfig.core_process, the default outside these tests): the same
outputs, the same errors and every public call of AsyncEngine through the socket; cancellation that frees blocks
in the core; a core that dies fails every stream at once; an application that exits, however, leaves no core
behind, and a core that is closed (by close(), by its application's exit or by SIGTERM) writes its cold tier back."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from helpers import cancel_midstream, make_config
from tieredkv import (AsyncEngine, EngineClosedError, EngineConfig, LoRAError, RequestError, SamplingParams,
                      SnapshotError)
from tieredkv.engine.explain import BlockReport
from tieredkv.engine.outputs import EngineInfo

PROMPTS = [list(range(3, 40)), list(range(50, 71)), [7, 8, 9, 10, 11]]


def config(model, **kw) -> EngineConfig:
    return make_config(model=str(model), num_blocks=96, max_num_seqs=8, **kw)


@pytest.fixture(scope="module")
async def engine(llama_dir, tmp_path_factory):
    cold = tmp_path_factory.mktemp("core-process-cold")
    engine = await AsyncEngine.start(config(llama_dir, core_process=True, warm_bytes=1 << 20, cold_path=str(cold)))
    yield engine
    await engine.close()


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is not alive
        return f.read().split(")")[-1].split()[0] != "Z"


async def test_the_core_runs_in_another_process_with_the_same_outputs(engine, llama_dir):
    assert type(engine).__name__ == "ProcessEngine" and isinstance(engine, AsyncEngine)
    assert await engine.run_in_worker(os.getpid) != os.getpid()
    with pytest.raises(RuntimeError, match="process of its own"):
        engine.core
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=5, ignore_eos=True)
    async with await AsyncEngine.start(config(llama_dir)) as local:
        want = [(await local.generate(p, params)).outputs[0].token_ids for p in PROMPTS]
        want_sampled = [o.token_ids for o in (await local.generate(PROMPTS[0], sampled)).outputs]
        local_info = local.info
    got = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
    assert [r.outputs[0].token_ids for r in got] == want
    assert [o.token_ids for o in (await engine.generate(PROMPTS[0], sampled)).outputs] == want_sampled
    assert isinstance(engine.info, EngineInfo)
    assert (engine.info.model_dir, engine.info.block_size, engine.info.max_model_len, engine.info.vocab_size,
            engine.info.kv_root) == (local_info.model_dir, local_info.block_size, local_info.max_model_len,
                                     local_info.vocab_size, local_info.kv_root)
    assert engine.tokenizer.decode(engine.tokenizer.encode("hello")) == local.tokenizer.decode(
        local.tokenizer.encode("hello"))


async def test_errors_are_the_same_types_with_their_fields(engine):
    with pytest.raises(RequestError, match="max_model_len"):  # checked here, before anything is sent
        engine.stream(list(range(3, 10)) * 5000, SamplingParams(max_tokens=4))
    with pytest.raises(TypeError):
        engine.stream("hi", {"max_tokens": 3})
    with pytest.raises(RequestError, match="exceeds max_num_seqs"):
        engine.precheck("hi", SamplingParams(n=9))
    with pytest.raises(RequestError, match="no LoRA adapter named 'nope'"):
        engine.stream("hi", adapter="nope")
    with pytest.raises(RequestError, match="already in use"):
        s = engine.stream(PROMPTS[0], request_id="dup")
        engine.stream(PROMPTS[0], request_id="dup")
    await s.aclose()
    with pytest.raises(RequestError, match="vocabulary"):
        engine.stream([10**6])
    with pytest.raises(SnapshotError):  # raised in the core process
        await engine.import_cache(__file__)
    with pytest.raises(LoRAError):
        await engine.load_adapter("bad", "/nonexistent/adapter")
    with pytest.raises(RequestError, match="ttl"):
        await engine.pin(PROMPTS[0], ttl=-1)
    with pytest.raises(ValueError):
        await engine.clear_cache("nowhere")
    assert (await engine.generate(PROMPTS[2], SamplingParams(max_tokens=2))).outputs[0].token_ids  # still serving


async def test_cancellation_frees_the_cores_blocks(engine):
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    async for i, _ in _enumerate(engine.stream(list(range(3, 60)), params)):
        if i == 3:
            assert engine.stats().blocks_used > 0
            break
    await wait_for(lambda: engine.stats().blocks_used == 0)

    await cancel_midstream(engine, list(range(5, 50)), params)
    await wait_for(lambda: engine.stats().blocks_used == 0 and engine.stats().num_running == 0)

    reasons = {}
    async for chunk in engine.stream(list(range(3, 30)), SamplingParams(max_tokens=400, n=2, ignore_eos=True),
                                     request_id="victim"):
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
        elif not reasons:
            threading.Thread(target=engine.abort, args=("victim",)).start()  # from another thread, too
    assert reasons == {0: "abort", 1: "abort"}
    await wait_for(lambda: engine.stats().blocks_used == 0)

    early = engine.stream(list(range(3, 30)), SamplingParams(max_tokens=400, ignore_eos=True), request_id="early")
    engine.abort("early")  # before its first iteration: it ends as soon as it starts
    assert [c.finish_reason async for c in early][-1] == "abort"
    await wait_for(lambda: engine.stats().blocks_used == 0)


async def _enumerate(stream):
    i = 0
    async for chunk in stream:
        yield i, chunk
        i += 1


async def test_every_cache_call_goes_through(engine, tmp_path):
    prompt = list(range(100, 181))  # 81 tokens: 5 full blocks of 16
    usage = await engine.prefill(prompt)
    assert usage.prompt_tokens == 81
    assert await engine.tokenize(prompt) == prompt
    assert await engine.tokenize("abc", check=False) == engine.tokenizer.to_token_ids("abc")
    reports = await engine.explain(prompt)
    assert all(isinstance(r, BlockReport) for r in reports) and [r.source for r in reports[:5]] == ["hot"] * 5
    assert await engine.pin(prompt, ttl=60) == 80
    await engine.check_pin(prompt)
    listed = await engine.pins()
    assert [(p["tokens"], p["blocks"]) for p in listed] == [(81, 5)]
    assert engine.stats().blocks_pinned == 5
    assert await engine.unpin(prompt) in (80, 81)
    assert await engine.pins() == []

    seen = []
    path = tmp_path / "cache.snap"
    exported = await engine.export_cache(path, prompts=[prompt], progress=seen.append)
    assert exported == 5 and sum(seen) == 5
    assert await engine.clear_cache("all") > 0
    assert [r.source for r in await engine.explain(prompt)][:5] == [None] * 5
    seen.clear()
    report = await engine.import_cache(path, progress=seen.append)
    assert report == {"imported": 5, "corrupt": 0, "complete": True} and sum(seen) == 5
    assert [r.source for r in await engine.explain(prompt)][:5] == ["warm"] * 5

    await engine.sleep(1)
    assert engine.stats().sleep_level == 1
    await engine.wake()
    assert engine.stats().sleep_level == 0
    assert await engine.share_prefix(prompt, 1.0) == (0, False)  # no shared tier
    assert await engine.wait_shared(prompt, 2, 0.1) == 0
    assert engine.adapters() == []
    with pytest.raises(LoRAError, match="unknown|no adapter|not loaded"):
        await engine.unload_adapter("nope")


async def test_adapters_load_and_serve_through_the_process(engine, llama_dir, tmp_path):
    from test_lora import make_adapter

    folder = make_adapter(llama_dir, tmp_path / "a", seed=1, r=4, target_modules=["q_proj", "v_proj"])
    loaded = await engine.load_adapter("a1", folder)
    assert loaded["name"] == "a1" and loaded["rank"] == 4
    assert engine.adapters() == ["a1"] and engine.adapter_path("a1") == str(folder)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    base = (await engine.generate(PROMPTS[0], params)).outputs[0].token_ids
    tuned = (await engine.generate(PROMPTS[0], params, adapter="a1")).outputs[0].token_ids
    assert tuned != base
    await engine.unload_adapter("a1")
    assert engine.adapters() == []


async def test_stats_and_abort_from_any_thread(engine):
    got = []
    t = threading.Thread(target=lambda: got.append(engine.stats()))
    t.start()
    t.join()
    assert got[0].blocks_total == 96


async def test_a_killed_core_fails_every_stream_and_call_at_once(llama_dir):
    engine = await AsyncEngine.start(config(llama_dir, core_process=True))
    pid = await engine.run_in_worker(os.getpid)
    stream = engine.stream(list(range(3, 50)), SamplingParams(max_tokens=10_000, ignore_eos=True))
    first = await stream.__anext__()
    assert first.token_ids
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineClosedError, match="core process ended"):
        async for _ in stream:
            pass
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(EngineClosedError):
        await engine.pins()
    with pytest.raises(EngineClosedError):
        engine.stream("again")
    await asyncio.wait_for(engine.closed(), 1.0)
    await engine.close()  # returns: the process is reaped
    assert not alive(pid)
    async with await AsyncEngine.start(config(llama_dir, core_process=True)) as again:  # the next start works
        assert (await again.generate(PROMPTS[2], SamplingParams(max_tokens=2))).outputs[0].token_ids


APP = textwrap.dedent("""
    import asyncio, os, sys
    from tieredkv import AsyncEngine, EngineConfig, SamplingParams

    async def main():
        engine = await AsyncEngine.start(EngineConfig(model=sys.argv[1], num_blocks=64, cold_path=sys.argv[2],
                                                      warm_bytes=0, core_process=True, compile_decode=False))
        print(await engine.run_in_worker(os.getpid), flush=True)
        await engine.generate(list(range(100, 165)), SamplingParams(max_tokens=2))
        print("ready", flush=True)
        if sys.argv[3] == "hang":
            await asyncio.sleep(3600)
        # else: returns without close()

    asyncio.run(main())
""")


@pytest.mark.parametrize("how", ["exit without close", "SIGKILL", "SIGTERM to the core"])
async def test_no_core_outlives_its_application_and_each_end_writes_cold_back(llama_dir, tmp_path, how):
    cold = tmp_path / "cold"
    app = subprocess.Popen([sys.executable, "-c", APP, str(llama_dir), str(cold),
                            "return" if how == "exit without close" else "hang"],
                           stdout=subprocess.PIPE, text=True)
    try:
        pid = int(app.stdout.readline())
        assert app.stdout.readline().strip() == "ready"
        if how == "SIGKILL":
            app.kill()
        elif how == "SIGTERM to the core":
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while alive(pid):
            assert time.monotonic() < deadline, f"the core process {pid} outlived its application ({how})"
            await asyncio.sleep(0.05)
    finally:
        app.kill()
        app.wait()
    # the blocks it computed reached the cold tier on its way out
    async with await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=64, cold_path=str(cold),
                                                   warm_bytes=0)) as engine:
        sources = [r.source for r in await engine.explain(list(range(100, 165)))]
    assert sources[:4] == ["cold"] * 4


async def test_close_writes_back_and_ends_the_process(llama_dir, tmp_path):
    engine = await AsyncEngine.start(config(llama_dir, core_process=True, cold_path=str(tmp_path / "c"), warm_bytes=0))
    pid = await engine.run_in_worker(os.getpid)
    stream = engine.stream(list(range(3, 50)), SamplingParams(max_tokens=1000, ignore_eos=True))
    await stream.__anext__()
    await engine.close()
    assert not alive(pid)
    with pytest.raises(EngineClosedError):
        async for _ in stream:
            pass
    with pytest.raises(EngineClosedError):
        await engine.pins()


def rank_pids(core_pid: int) -> list[int]:
    """The tensor-parallel ranks a core process started (its children that multiprocessing spawned)."""
    found = []
    for task in os.listdir(f"/proc/{core_pid}/task"):
        with open(f"/proc/{core_pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    ranks = []
    for pid in found:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                ranks.append(pid)
    return ranks


async def test_tensor_parallel_ranks_live_in_the_core_process_and_end_with_it(engine, llama_dir):
    """Under tensor parallelism the core process starts the ranks (one construction path): outputs equal one
    rank's; close() ends the core and its ranks, and a core killed outright takes its ranks with it (each loses
    rank 0's connection), no process left behind."""
    tp = dict(tensor_parallel_size=2, num_threads=1, compile_decode=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [(await engine.generate(p, params)).outputs[0].token_ids for p in PROMPTS]  # one rank
    for end in ("close", "SIGKILL"):
        split = await AsyncEngine.start(config(llama_dir, core_process=True, **tp))
        core = await split.run_in_worker(os.getpid)
        ranks = rank_pids(core)
        assert len(ranks) == 1 and split.info.config.tensor_parallel_size == 2
        outs = await asyncio.gather(*(split.generate(p, params) for p in PROMPTS))
        assert [o.outputs[0].token_ids for o in outs] == want
        if end == "close":
            await split.close()
        else:
            os.kill(core, signal.SIGKILL)
            await asyncio.wait_for(split.closed(), 5)
            await split.close()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in [core, *ranks]):
            assert time.monotonic() < deadline, f"left behind after {end}: {[p for p in ranks if alive(p)]}"
            await asyncio.sleep(0.1)


async def test_a_late_chunk_of_a_forgotten_stream_does_not_reach_a_new_one_under_its_id():
    """The application may forget a stream and open another under the same request id before the core has seen
    "forget": chunks the core sent for the first in the meantime carry its number and are dropped."""
    from tieredkv.engine.core_client import CoreLink
    from tieredkv.engine.outputs import StreamChunk
    from tieredkv.engine.stream import Channel

    link = CoreLink(asyncio.get_running_loop(), None)
    new = Channel("x", 1)
    new.serial = next(link.serials) + 1  # the second stream the link opened under "x"
    link.sinks["x"] = new
    late = StreamChunk("x", 0, "old", [5], None)
    link._handle(["chunk", "x", late, new.serial - 1])
    assert not new.pending
    mine = StreamChunk("x", 0, "new", [6], None)
    link._handle(["chunk", "x", mine, new.serial])
    assert list(new.pending.values()) == [mine]
