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

from helpers import check_pool_clean, hf_greedy, make_config, rand_ids, run_to_end
from tieredkv import AsyncEngine, EngineClosedError, EngineConfig, SamplingParams
from tieredkv.engine.engine_core import EngineCore
from tieredkv.engine.ranks import _wait_for_hellos, rank_device
from tieredkv.errors import RankLostError, RankStartError, UnsupportedModelError
from tieredkv.models.loader import load_model
from tieredkv.models.spec import ModelSpec
from tieredkv.models.tp_group import TPGroup
from tieredkv.models.tp_shard import Shard, check_shardable
from tieredkv.tools.plan import plan

PROMPTS = [list(range(5, 45)), list(range(5, 37)) + [7, 9, 11], [3, 4, 5, 6]]  # the first two share 2 blocks
NEW = 10


def tp_config(path, **kw) -> EngineConfig:
    return make_config(model=str(path), tensor_parallel_size=2, num_threads=1, **kw)


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


def test_int4_shards_are_the_whole_models_codes(llama_dir):
    """int4's groups lie within each rank's slice: a rank's codes, scales and offsets are the slices of one
    process's (so its weights are the same at any rank count). int8 has one scale per output row: a
    row-parallel slice gets a scale of its own, never coarser than the whole row's."""
    from tieredkv.models.loader import QuantSettings

    spec = ModelSpec.from_file(llama_dir / "config.json")
    cpu = torch.device("cpu")
    for scheme in ("int4", "int8"):
        whole = load_model(llama_dir, spec, torch.float32, cpu, QuantSettings(scheme)).layers[1]
        for rank in range(2):
            part = load_model(llama_dir, spec, torch.float32, cpu, QuantSettings(scheme),
                              tp=TPGroup(Shard(rank, 2))).layers[1]
            (q0, q1), d = Shard(rank, 2).q_heads(spec), spec.head_dim
            a, b = whole.self_attn.o_proj.format, part.self_attn.o_proj.format  # row-parallel: input columns
            if scheme == "int4":
                cols = slice(q0 * d // 2, q1 * d // 2)  # two codes a byte
                groups = slice(q0 * d // 32, q1 * d // 32)
                assert torch.equal(b.codes, a.codes[:, cols]) and torch.equal(b.scales, a.scales[:, groups])
                assert torch.equal(b.offsets, a.offsets[:, groups])
            else:
                assert bool((b.scales.float() <= a.scales.float()).all())
                assert torch.allclose(b.dequantize(), a.dequantize()[:, q0 * d : q1 * d], atol=float(a.scales.max()))


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
            make_config(model=str(llama_dir), tensor_parallel_size=2, **bad)


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


def test_a_load_that_fails_on_every_rank_ends_the_start_with_rank_0s_error(llama_dir, tmp_path):
    """Every rank loads its share, then reports to rank 0 in one gather (engine/rank_build.py load_share): a
    truncated weights file fails each rank's load, and the start ends with rank 0's own CheckpointError, the
    other ranks gone, nothing left waiting in a collective."""
    import shutil

    from tieredkv.errors import CheckpointError

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size * 3 // 4])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        EngineCore(tp_config(broken))
    children = multiprocessing.active_children()
    assert not [c for c in children if c.name.startswith("tieredkv-rank")], children


def test_greedy_matches_transformers_through_preemption_and_tiers(llama_dir, tmp_path):
    """On a tiny GQA model (4 query heads over 2 KV heads), two ranks give transformers' greedy output: batched
    with a shared prefix in a pool so small that sequences are preempted and swapped to warm and back (each
    rank between its pool and its slab); then demoted to warm and promoted again, the same outputs served from
    warm. The cold tier holds whole blocks: what the two ranks persisted at close, one process reads, and its
    output is still transformers'. Speculative decoding is on: the other ranks compute the drafts rank 0's plan
    carries, and no rejected draft's KV reaches a tier (the one process's output from cold would show it)."""
    cold = str(tmp_path / "cold")
    expected = hf_greedy(llama_dir, PROMPTS, 24)
    core = EngineCore(tp_config(llama_dir, num_blocks=7, warm_bytes=1 << 20, cold_path=cold, offload="off",
                                speculative={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}))
    try:
        assert core.tp.world == 2 and core.kv_cache.shape[-2] == 1  # one of the two KV heads here
        assert core.stats().weight_bytes == sum(m.weight_bytes for m in core.memory)  # both ranks' weights
        warm, full = core.tiers.warm, len(PROMPTS[0]) // core.block_size
        assert warm.block_shape[-2] == 2 and warm.slab.shape[-2] == 1  # whole blocks in and out, a rank's heads kept
        sent = [core.tp.messages["step"]]  # messages sent by the end of each step
        assert run_to_end(core, PROMPTS, [24] * len(PROMPTS), lambda n, _: sent.append(core.tp.messages["step"])) \
            == expected
        stats = core.stats()
        assert stats.num_preemptions > 0 and stats.num_swaps > 0 and stats.speculative.num_accepted_tokens > 0
        io = core.tiers.io  # swaps and evictions to warm stayed on each rank: no block crossed processes
        assert io.counts["hot_to_slab"] > 0 and io.counts["slab_to_hot"] > 0 and not io.exchanged
        assert set(core.tp.messages) == {"step"}  # the steps' block ops went with their rows: one message each
        assert {b - a for a, b in zip(sent, sent[1:])} == {1}
        check_pool_clean(core)
        core.tiers.clear("warm")
        assert core.tiers.clear("hot", demote=True) >= full
        before = warm.stats().promotions
        assert run_to_end(core, PROMPTS[:1], [24]) == expected[:1]
        assert warm.stats().promotions - before == full
    finally:
        core.close()
    one = EngineCore(make_config(model=str(llama_dir), num_blocks=24, warm_bytes=0, cold_path=cold))
    try:
        assert run_to_end(one, PROMPTS[:1], [24]) == expected[:1]
        assert one.tiers.cold.stats().promotions == full
    finally:
        one.close()


def test_two_ranks_keep_their_heads_as_int4_keys_and_int8_values(llama_dir, tmp_path):
    """int4 K and int8 V over two ranks: each rank measures its KV head's key mean in one forward both take at
    start (runner/key_shift.py), and its pool and warm slab hold its head as rows of int8's width (16 codes and a
    scale; int4 keys take 10 of those bytes), swaps move them between the two on each rank, whole blocks reach the
    cold tier; the outputs are one process's in the same formats, which reads what the two ranks persisted."""
    formats = dict(kv_cache_dtype="int4", kv_cache_dtype_v="int8")
    one = EngineCore(make_config(model=str(llama_dir), num_blocks=24, warm_bytes=0, **formats))
    try:
        expected = run_to_end(one, PROMPTS, [16] * len(PROMPTS))
        one_shift = one.model.layers[1].self_attn.k_shift.clone()
    finally:
        one.close()
    cold = str(tmp_path / "cold")
    core = EngineCore(tp_config(llama_dir, num_blocks=7, warm_bytes=1 << 20, cold_path=cold, offload="off",
                                **formats))
    try:
        assert core.kv_cache.dtype == torch.uint8 and core.kv_cache.shape[-2:] == (1, 16 + 2)
        assert core.tiers.warm.block_shape[-2:] == (2, 18) and core.tiers.cold.block_shape[-2:] == (2, 18)
        assert run_to_end(core, PROMPTS, [16] * len(PROMPTS)) == expected
        assert core.stats().num_swaps > 0 and core.stats().kv_format == "k=int4,v=int8"
        # rank 0's head of the one process's key mean (up to the last bits of the ranks' arithmetic)
        torch.testing.assert_close(core.model.layers[1].self_attn.k_shift, one_shift[:1], atol=2e-3, rtol=0)
        check_pool_clean(core)
    finally:
        core.close()
    again = EngineCore(make_config(model=str(llama_dir), num_blocks=24, warm_bytes=0, cold_path=cold,
                                   **formats))
    try:  # what the two ranks persisted, one process reads
        assert run_to_end(again, PROMPTS[:1], [16]) == expected[:1]
        assert again.tiers.cold.stats().promotions == len(PROMPTS[0]) // again.block_size
    finally:
        again.close()


def test_two_ranks_publish_whole_blocks_to_the_shared_tier(llama_dir, valkey_server, tmp_path):
    """Publishing to the remote tier under tensor parallelism: each new full block is gathered from both ranks (a
    block op outside a step, sent as a step message without rows) and written whole; one process then reads those
    blocks from the server and answers as it would have computed."""
    key, prompts = tmp_path / "key", [rand_ids(40, seed=71), rand_ids(33, seed=72)]
    one = EngineCore(make_config(model=str(llama_dir), num_blocks=24, warm_bytes=0))
    try:
        expected = run_to_end(one, prompts, [6, 6])
    finally:
        one.close()
    core = EngineCore(tp_config(llama_dir, num_blocks=24, warm_bytes=1 << 20, remote_url=valkey_server.url,
                                cold_secret_path=str(key)))
    try:
        assert run_to_end(core, prompts, [6, 6]) == expected
        core.tiers.tier("remote").flush_sync()
        assert core.tiers.io.exchanged["gather"] > 0 and set(core.tp.messages) == {"step"}
        assert core.tiers.tier("remote").stats().demotions >= (40 + 33) // core.block_size
    finally:
        core.close()
    again = EngineCore(make_config(model=str(llama_dir), num_blocks=24, warm_bytes=0, remote_url=valkey_server.url,
                                   cold_secret_path=str(key)))
    try:
        assert run_to_end(again, prompts[:1], [6]) == expected[:1]
        assert again.tiers.tier("remote").stats().promotions == 40 // again.block_size
    finally:
        again.close()


def long_doc() -> list[int]:
    import random

    rng = random.Random(1)
    return [rng.randrange(3, 440) for _ in range(1000)]


BLOCK = 3 * 2 * 16 * 2 * 16 * 4  # a whole block of the tiny models in fp32
FAR = dict(num_blocks=8, warm_bytes=200 * BLOCK, max_num_batched_tokens=256)


def check_far(core, staged: bool) -> None:
    """Far blocks as the mode says: each rank's heads of them in its own slab (the tail of its cache tensor,
    read in place; or a slab its runner stages from)."""
    assert (core.runner.far_base is not None) == staged
    assert core.kv_cache.shape[2] == 8 + (0 if staged else 200) + 1 and core.tiers.warm.slab.shape[-2] == 1
    stats = core.stats()
    assert stats.blocks_offloaded >= (1000 + 24) // 16 - 8  # all but the hot pool's blocks went to warm
    assert core.runner.staged_steps > 0 if staged else core.runner.staged_steps == 0


def test_qwen2_biases_and_a_document_larger_than_the_hot_pool_staged(qwen2_dir):
    """q/k/v biases split with their rows: the prompts batched with a shared prefix, then a 1,000-token
    document on a hot pool of 8 blocks, its older blocks staged per layer from each rank's slab, equal
    transformers. Then a forward that fails on rank 0 mid-step ends the engine (RankLostError) rather than
    leave rank 1 waiting in that step's collectives, and close() returns at once."""
    doc = long_doc()
    expected = hf_greedy(qwen2_dir, PROMPTS + [doc], 24)
    core = EngineCore(tp_config(qwen2_dir, offload="staged", **FAR))
    try:
        assert run_to_end(core, PROMPTS, [24] * len(PROMPTS)) == expected[:3]
        assert run_to_end(core, [doc], [24]) == expected[3:]
        check_far(core, staged=True)
        check_pool_clean(core)
        # rank 0's forward failing while rank 1 runs the step: the ranks are out of step, the engine ends
        core.runner.model.forward = lambda *args: 1 / 0
        with pytest.raises(RankLostError, match="out of step"):
            run_to_end(core, PROMPTS[:1], [4])
    finally:
        core.close()


# -- a rank that dies ----------------------------------------------------------------------------------


def test_a_document_in_place_then_a_dead_rank(llama_dir):
    """A 1,000-token document on a hot pool of 8 blocks, its older blocks read in place from each rank's
    tail, equals transformers; then killing rank 1 mid-stream ends the stream with EngineClosedError (no
    hang), and the next request too; close() still returns and the process group is gone."""
    doc = long_doc()
    expected = hf_greedy(llama_dir, [doc], 24)

    async def main():
        engine = await AsyncEngine.start(tp_config(llama_dir, **FAR))
        try:
            out = await engine.generate(doc, SamplingParams(max_tokens=24, ignore_eos=True))
            assert out.outputs[0].token_ids == expected[0]
            check_far(engine.core, staged=False)
            procs, chunks = engine.core.tp.procs, 0
            with pytest.raises(EngineClosedError):
                async for _ in engine.stream(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True)):
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
