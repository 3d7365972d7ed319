"""Engines over one loaded model (tieredkv.SharedWeights): the weights are loaded once per form, every engine keeps
its own cache, tiers and counters, and what would take the weights from another engine is refused."""

import pytest

from helpers import drive, make_config, run_to_end
from tieredkv import AsyncEngine, LoRAError, RequestError, SamplingParams, SharedWeights
from tieredkv.engine import rank_build
from tieredkv.engine.engine_core import EngineCore

PROMPTS = [list(range(5, 40)), [7, 3, 99, 14] * 6]


def test_engines_share_one_load_per_form_and_nothing_else(llama_dir, monkeypatch):
    loads = []
    load = rank_build.load_rank_model
    monkeypatch.setattr(rank_build, "load_rank_model", lambda *a, **k: loads.append(a[0]) or load(*a, **k))
    shared = SharedWeights()
    base = dict(model=str(llama_dir), warm_bytes=0, compile_decode=False)
    own = EngineCore(make_config(**base, num_blocks=64))
    a = EngineCore(make_config(**base, num_blocks=64), shared)
    b = EngineCore(make_config(**base, num_blocks=24, max_num_seqs=2), shared)  # the cache's settings differ
    q = EngineCore(make_config(**base, num_blocks=64, quantization="int8"), shared)  # another form of the weights
    k = EngineCore(make_config(**base, num_blocks=64, kv_cache_dtype="int4"), shared)  # 4-bit keys: shifts set
    try:
        assert len(loads) == 4  # own, a (b took a's), q, k
        assert a.parts.model is b.parts.model and len(shared) == 3
        assert own.parts.model is not a.parts.model and q.parts.model is not a.parts.model
        assert shared.users(a.parts.model) == 2 and shared.users(q.parts.model) == 1
        assert all(layer.self_attn.k_shift is None for layer in a.parts.model.layers)
        assert all(layer.self_attn.k_shift is not None for layer in k.parts.model.layers)
        want = run_to_end(own, PROMPTS, [12, 12])
        assert run_to_end(a, PROMPTS, [12, 12]) == want
        # b starts from an empty cache and zero counters whatever a did
        sb = b.stats()
        assert sb.blocks_cached == 0 and sb.prefix_cache_hits == 0 and sb.kernel_calls == {}
        assert run_to_end(b, PROMPTS, [12, 12]) == want  # two at most at once, in its smaller pool
        assert b.kv_cache.data_ptr() != a.kv_cache.data_ptr() and b.num_blocks == 24
        c = EngineCore(make_config(**base, num_blocks=64), shared)  # a third: the load is still kept
        assert len(loads) == 4 and c.parts.model is a.parts.model and shared.users(a.parts.model) == 3
        c.close()
    finally:
        for core in (own, a, b, q, k):
            core.close()
    assert shared.users(a.parts.model) == 0 and len(shared) == 3  # kept for the next engine
    shared.clear()
    assert len(shared) == 0


def test_what_would_take_the_weights_from_another_engine_is_refused(llama_dir):
    shared = SharedWeights()
    cfg = make_config(model=str(llama_dir), num_blocks=32, warm_bytes=0, compile_decode=False)
    a, b = EngineCore(cfg, shared), EngineCore(cfg, shared)
    try:
        with pytest.raises(RequestError, match="1 other engine"):
            a.sleep(2)  # would release the weights b reads
        assert a.sleep(1)["level"] == 1  # its own cache only
        a.wake()
        want = run_to_end(b, PROMPTS[:1], [8])
        b.close()
        assert a.sleep(2)["level"] == 2 and a.wake()["was_level"] == 2  # alone now: the weights go and come back
        assert run_to_end(a, PROMPTS[:1], [8]) == want
    finally:
        a.close()
    with pytest.raises(LoRAError, match="not a folder"):  # a start that fails once it took the weights: no user left
        EngineCore(make_config(model=str(llama_dir), num_blocks=32, warm_bytes=0, compile_decode=False,
                               lora_adapters={"missing": str(llama_dir / "no-such-adapter")}), shared)
    assert shared.users(a.parts.model) == 0 and len(shared) == 1
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineCore(make_config(model=str(llama_dir), tensor_parallel_size=2, num_threads=1), shared)


async def test_the_async_engine_takes_shared_weights_on_its_worker_thread_only(llama_dir):
    shared = SharedWeights()
    cfg = dict(model=str(llama_dir), num_blocks=32, warm_bytes=0)
    async with await AsyncEngine.start(make_config(**cfg), shared_weights=shared) as one:
        async with await AsyncEngine.start(make_config(**cfg), shared_weights=shared) as two:
            assert one.core.parts.model is two.core.parts.model
            params = SamplingParams(max_tokens=6, ignore_eos=True)
            outs = [await e.generate(PROMPTS[0], params) for e in (one, two)]
            assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="core_process=False"):
        await AsyncEngine.start(make_config(**cfg, core_process=True), shared_weights=shared)


def test_two_compiled_graphs_over_one_model_decode_as_the_eager_forward(llama_dir):
    """Each engine traces its own decode graph over the shared parameters (and its own cache tensor); steps of
    the two alternating give the tokens of an engine that loaded its own weights."""
    shared = SharedWeights()
    cfg = dict(model=str(llama_dir), warm_bytes=0, compile_in_background=False)
    own = EngineCore(make_config(**cfg, num_blocks=64, compile_decode=False))
    a = EngineCore(make_config(**cfg, num_blocks=64, compile_decode=True, native_decode=False), shared)
    b = EngineCore(make_config(**cfg, num_blocks=64, compile_decode=True, native_decode=False), shared)
    try:
        assert a.parts.model is b.parts.model
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        for prompt in PROMPTS:
            want = run_to_end(own, [prompt], [12])[0]
            ra, rb = a.factory.make(prompt, params), b.factory.make(prompt, params)
            assert b.add_request(rb) == []
            drive(a, [ra], each_step=lambda n, _: b.has_work() and b.step())  # a step of each in turn
            drive(b)
            assert ra.seqs[0].output_token_ids == rb.seqs[0].output_token_ids == want
        assert a.runner.compiled.steps == b.runner.compiled.steps == len(PROMPTS) * 11
    finally:
        for core in (own, a, b):
            core.close()
