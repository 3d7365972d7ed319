"""Tensor parallelism over torch.distributed (gloo, two CPU processes): the shards, token-identical greedy output
against one process and against transformers (GQA, q/k/v bias, the default model's uneven 2 + 1 KV heads), prefix
caching, n > 1, a long document, preemption, whole blocks in the warm and cold tiers (a cold store written at two
ranks read at one), per-rank weight memory, and what happens when a rank dies or cannot start."""

import asyncio
import multiprocessing
import os
import signal

import pytest
import torch

from helpers import check_pool_clean, hf_greedy, run_to_end
from tieredkv import AsyncEngine, EngineClosedError, EngineConfig, SamplingParams
from tieredkv.engine_core import EngineCore
from tieredkv.errors import RankStartError, UnsupportedModelError
from tieredkv.models.loader import load_model
from tieredkv.models.spec import ModelSpec
from tieredkv.parallel.group import TPGroup
from tieredkv.parallel.ranks import _wait_for_hellos, rank_device
from tieredkv.parallel.shard import Shard, check_shardable
from tieredkv.tools.plan import plan

PROMPTS = [list(range(5, 45)), list(range(5, 37)) + [7, 9, 11], [3, 4, 5, 6]]  # the first two share 2 blocks
NEW = 10


def tp_config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), tensor_parallel_size=2, num_threads=1, **kw)


# -- the shards, without processes ------------------------------------------------------------------


def test_shards_cover_every_tensor_once(llama_dir):
    """Each rank's runs of every split tensor, in rank order, are the whole dimension: nothing read twice
    or missed (the default model's 3 KV heads split 2 + 1, the query heads with their groups)."""
    spec = ModelSpec.from_file(llama_dir / "config.json")
    for world in (1, 2):
        shards = [Shard(r, world) for r in range(world)]
        assert sum(s.local_spec(spec).num_kv_heads for s in shards) == spec.num_kv_heads
        assert sum(s.local_spec(spec).vocab_size for s in shards) == spec.vocab_size
    uneven = ModelSpec.from_dict({**spec.raw, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 8})
    assert [Shard(r, 2).kv_heads(uneven) for r in range(2)] == [(0, 2), (2, 3)]
    assert [Shard(r, 2).q_heads(uneven) for r in range(2)] == [(0, 6), (6, 9)]
    d, q, kv = 8, 9 * 8, 3 * 8
    fused = [Shard(r, 2).ranges("layers.0.self_attn.qkv_proj.weight", uneven)[1] for r in range(2)]
    assert fused == [[(0, 48), (q, q + 16), (q + kv, q + kv + 16)],
                     [(48, q), (q + 16, q + kv), (q + kv + 16, q + 2 * kv)]]
    assert Shard(1, 2).ranges("layers.3.self_attn.o_proj.weight", uneven) == (1, [(6 * d, 9 * d)])
    assert Shard(1, 2).ranges("layers.0.self_attn.q_proj.bias", uneven) == (0, [(6 * d, 9 * d)])
    assert Shard(1, 2).ranges("layers.0.input_layernorm.weight", uneven) is None
    with pytest.raises(UnsupportedModelError, match="more than the model's num_key_value_heads"):
        check_shardable(uneven, 4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_each_rank_reads_its_slices(kind, llama_dir, qwen2_dir):
    """A rank's weights are the slices of the whole model's (q/k/v rows with their biases, o columns, the
    vocabulary rows), read as slices from the file."""
    path = llama_dir if kind == "llama" else qwen2_dir
    spec = ModelSpec.from_file(path / "config.json")
    whole = load_model(path, spec, torch.float32, torch.device("cpu"))
    h, qd, kvd = spec.head_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for rank in range(2):
        part = load_model(path, spec, torch.float32, torch.device("cpu"), tp=TPGroup(Shard(rank, 2)))
        (q0, q1), (k0, k1) = Shard(rank, 2).q_heads(spec), Shard(rank, 2).kv_heads(spec)
        rows = torch.cat([torch.arange(q0 * h, q1 * h), qd + torch.arange(k0 * h, k1 * h),
                          qd + kvd + torch.arange(k0 * h, k1 * h)])
        a, b = whole.layers[1].self_attn, part.layers[1].self_attn
        assert torch.equal(b.qkv_proj.weight, a.qkv_proj.weight[rows])
        if spec.attention_bias:
            assert torch.equal(b.qkv_proj.bias, a.qkv_proj.bias[rows])
        assert torch.equal(b.o_proj.weight, a.o_proj.weight[:, q0 * h : q1 * h])
        v0, v1 = Shard(rank, 2).split(spec.vocab_size)
        assert torch.equal(part.lm_head.weight, whole.lm_head.weight[v0:v1])
        assert part.weight_bytes() < 0.6 * whole.weight_bytes()


def test_plan_splits_weights_and_kv(llama_dir):
    one, two = plan(str(llama_dir), device="cpu"), plan(str(llama_dir), device="cpu", tensor_parallel_size=2)
    spec = ModelSpec.from_file(llama_dir / "config.json")
    norms = (2 * spec.num_layers + 1) * spec.hidden_size * 4  # held whole by every rank
    assert sum(two.rank_weight_bytes) == one.weight_bytes + norms and two.weight_bytes == one.weight_bytes
    assert sum(two.rank_kv_bytes_per_block) == one.kv_bytes_per_block
    assert two.hot_blocks == one.hot_blocks  # on CPU every rank's share is in the one memory


def test_bad_settings_are_refused(llama_dir):
    for bad in (dict(compile_decode=True), dict(quantization="gguf")):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(model=str(llama_dir), tensor_parallel_size=2, **bad)


def test_rank_start_failures_are_clear(monkeypatch):
    """A rank whose process dies while starting, or a device that does not exist, is an error that says so."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=os._exit, args=(3,), name="tieredkv-rank-1")
    proc.start()
    with pytest.raises(RankStartError, match="exited with code 3"):
        _wait_for_hellos([proc], ctx.Queue())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(tp_config("x"), 1, torch.device("cuda:0")) == torch.device("cuda:1")
    with pytest.raises(RankStartError, match="needs cuda:2"):
        rank_device(tp_config("x"), 1, torch.device("cuda:1"))


# -- two ranks on tiny models --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_matches_transformers_through_preemption_and_tiers(kind, llama_dir, qwen2_dir, tmp_path):
    """On a tiny GQA model (4 query heads over 2 KV heads; qwen2: with q/k/v biases), two ranks give
    transformers' greedy output: batched with a shared prefix in a pool so small that sequences are preempted
    and swapped to warm and back (whole blocks gathered from and scattered to the ranks); then demoted to warm
    and promoted again, the same outputs served from warm. The cold tier holds whole blocks too: what the two
    ranks persisted at close, one process reads, and its output is still transformers'."""
    path, cold = (llama_dir if kind == "llama" else qwen2_dir), str(tmp_path / "cold")
    expected = hf_greedy(path, PROMPTS, 24)
    core = EngineCore(tp_config(path, num_blocks=7, warm_bytes=1 << 20, cold_path=cold, offload=False))
    try:
        assert core.tp.world == 2 and core.kv_cache.shape[-2] == 1  # one of the two KV heads here
        warm, full = core.tiers.warm, len(PROMPTS[0]) // core.block_size
        assert warm.block_shape[-2] == 2  # whole blocks: both ranks' KV heads
        assert run_to_end(core, PROMPTS, [24] * len(PROMPTS)) == expected
        stats = core.stats()
        assert stats.num_preemptions > 0 and stats.num_swaps > 0
        check_pool_clean(core)
        core.tiers.clear("warm")
        assert core.tiers.clear("hot", demote=True) >= full
        before = warm.stats().promotions
        assert run_to_end(core, PROMPTS[:1], [24]) == expected[:1]
        assert warm.stats().promotions - before == full
    finally:
        core.close()
    one = EngineCore(EngineConfig(model=str(path), num_blocks=24, warm_bytes=0, cold_path=cold))
    try:
        assert run_to_end(one, PROMPTS[:1], [24]) == expected[:1]
        assert one.tiers.cold.stats().promotions == full
    finally:
        one.close()


@pytest.mark.parametrize("far_mode", ["in_place", "staged"])
def test_a_document_larger_than_the_hot_pool(llama_dir, far_mode):
    """A 1,000-token document on a hot pool of 8 blocks: its older blocks go to warm as far blocks, each rank
    keeping its heads of them in its own slab (the tail of its cache tensor, read in place; or a slab its
    runner stages from), and two ranks still give transformers' output."""
    import random

    rng = random.Random(1)
    doc = [rng.randrange(3, 440) for _ in range(1000)]
    block = 3 * 2 * 16 * 2 * 16 * 4  # a whole block of the tiny llama in fp32
    core = EngineCore(tp_config(llama_dir, num_blocks=8, warm_bytes=200 * block, max_num_batched_tokens=256,
                                far_blocks=far_mode))
    try:
        staged = core.runner.far_base is not None
        assert staged == (far_mode == "staged") and core.kv_cache.shape[2] == 8 + (0 if staged else 200) + 1
        assert core.tiers.warm.slab.shape[-2] == 1  # rank 0's KV head of every slot
        assert run_to_end(core, [doc], [32]) == hf_greedy(llama_dir, [doc], 32)
        stats = core.stats()
        assert stats.blocks_offloaded >= 65 - 8 and stats.num_preemptions == 0
        assert core.runner.staged_steps > 0 if staged else core.runner.staged_steps == 0
        check_pool_clean(core)
    finally:
        core.close()


# -- a rank that dies ----------------------------------------------------------------------------------


def test_a_dead_rank_ends_every_stream(llama_dir):
    """Killing rank 1 mid-stream ends the stream with EngineClosedError (no hang); close() still returns and
    the process group is gone, so another engine can start."""

    async def main():
        engine = await AsyncEngine.start(tp_config(llama_dir, num_blocks=48, warm_bytes=0))
        try:
            procs, chunks = engine.core.tp.procs, 0
            with pytest.raises(EngineClosedError):
                async for _ in engine.stream(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True)):
                    chunks += 1
                    if chunks == 2:
                        os.kill(procs[0].pid, signal.SIGKILL)
            assert chunks < 100
            with pytest.raises(EngineClosedError):
                await engine.generate(PROMPTS[1], SamplingParams(max_tokens=4))
        finally:
            await asyncio.wait_for(engine.close(), 60)

    asyncio.run(asyncio.wait_for(main(), 120))
    assert not torch.distributed.is_initialized()


# -- the default model -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_two_ranks_match_one_and_transformers():
    """The default model (9 query heads over 3 KV heads: 2 + 1 at two ranks) token-identical at two ranks to
    one process and to transformers: chats sharing a system prompt (served from the prefix cache, the same
    token counts), two seeded samples of one prompt sharing its blocks, and a document of ~440 tokens
    (prefilled in chunks of 128). Each rank holds at most 0.55x the weights of one process, counted and by the
    growth of its resident memory over the load (against one process's growth, measured the same way)."""
    outputs, cached, memory = {}, {}, {}
    for world in (1, 2):
        cfg = EngineConfig(num_blocks=160, warm_bytes=0, num_threads=1, max_num_batched_tokens=128,
                           tensor_parallel_size=world)
        core = EngineCore(cfg)
        try:
            tok = core.tokenizer
            system = "You are a patient assistant who answers questions about rivers, mountains and cities. " * 3
            chats = [tok.encode(system + q) for q in ("Where is the Nile?", "How high is Mont Blanc?")]
            doc = tok.encode(" ".join(f"Note {i}: the level of river {i % 7} rose by {i} cm." for i in range(25)))
            assert 400 < len(doc) < 600
            outputs[world] = run_to_end(core, chats + [doc], [5, 5, 5])
            stats = core.stats()
            cached[world] = (stats.prefix_cache_hits, stats.prompt_tokens_computed)
            sampled = core.factory.make(chats[0], SamplingParams(max_tokens=5, n=2, temperature=0.8, seed=7), "s")
            core.add_request(sampled)
            while core.has_work():
                core.step()
            outputs[world].append([s.output_token_ids for s in sampled.seqs])
            memory[world] = core.memory
            model_dir = core.model_dir
        finally:
            core.close()
    assert outputs[2] == outputs[1]
    assert cached[2] == cached[1] and cached[1][0] > 0
    assert outputs[1][:2] == hf_greedy(model_dir, chats, 5)
    one = memory[1]
    for rank in memory[2]:
        assert rank.weight_bytes <= 0.55 * one.weight_bytes and rank.resident_growth <= 0.55 * one.resident_growth
