"""Shared-prefix (cascade) decode attention equals plain attention, and the engine's outputs on the
shared-system-prompt pattern equal each conversation run alone."""

import asyncio
import random
from dataclasses import replace

import pytest
import torch

from helpers import make_config
from tieredkv.kernels import cascade
from tieredkv.kernels.decode_attention import DecodePlanRef, decode_attention_ref, plan_decode


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def batch(members_per_group, loners, prefix_blocks, bs=16, kv_heads=2, group=3, d=32, seed=0, scattered=False):
    """Block tables where each group's rows start with the same blocks, then their own; loners alone."""
    rng = random.Random(seed)
    next_block = [0]

    def fresh(n):
        ids = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        return ids

    tables, lens, groups = [], [], []
    for g, n in enumerate(members_per_group):
        shared = fresh(prefix_blocks[g])
        if scattered:  # the shared blocks are not one run of the pool: the prefix is gathered
            rng.shuffle(shared)
        rows = []
        for _ in range(n):
            extra = rng.randrange(1, 40)  # the suffix: ends inside a block or on its boundary
            own = fresh(-(-extra // bs))
            rows.append(len(tables))
            tables.append(shared + own)
            lens.append(len(shared) * bs + extra)
        groups.append(rows)
    for _ in range(loners):
        ctx = rng.randrange(5, 120)
        tables.append(fresh(-(-ctx // bs)))
        lens.append(ctx)
    width = max(map(len, tables))
    t = torch.tensor([row + [0] * (width - len(row)) for row in tables], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(next_block[0], bs, kv_heads, d, generator=g)
    vc = torch.randn(next_block[0], bs, kv_heads, d, generator=g)
    q = torch.randn(len(tables), kv_heads * group, d, generator=g)
    return q, kc, vc, t, torch.tensor(lens, dtype=torch.int32), groups


@pytest.mark.parametrize("members, loners, prefix_blocks", [
    ([1], 0, [4]), ([2], 0, [4]), ([16], 0, [8]), ([3, 5], 4, [4, 6]), ([2, 2, 7], 1, [5, 4, 9]),
])
@pytest.mark.parametrize("scattered", [False, True], ids=["one-run", "scattered"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "matmul"])
def test_cascade_equals_plain_attention(members, loners, prefix_blocks, scattered, fused, monkeypatch):
    if not fused:  # the version for torch builds without the fused CPU attention
        monkeypatch.setattr(cascade, "fused_attention_usable", lambda: False)
    elif not cascade.fused_attention_usable():
        pytest.skip("this torch build has no fused CPU attention with log-sum-exp")
    q, kc, vc, tables, lens, groups = batch(members, loners, prefix_blocks, seed=len(members) + loners,
                                            scattered=scattered)
    plain = decode_attention_ref(q, kc, vc, tables, lens, 0.2, plan=DecodePlanRef(
        plan_decode(tables, lens, 16, torch.float32).groups, None))
    prefixes = [(rows, prefix_blocks[i]) for i, rows in enumerate(groups)]
    plan = plan_decode(tables, lens, 16, torch.float32, prefixes)
    assert plan.cascades.num_groups == len(groups)
    got = decode_attention_ref(q, kc, vc, tables, lens, 0.2, plan=plan)
    torch.testing.assert_close(got, plain, atol=2e-6, rtol=0)


def test_shared_prefixes_follows_the_rule():
    bs = 16
    common = list(range(10))
    tables = [common + [100 + i] for i in range(3)] + [[50, 51], common[:2] + [60]]
    lens = [170, 165, 161, 20, 40]
    # rows 0-2 share 10 blocks; row 4 shares only 2 with them (below the minimum): it stays alone
    assert cascade.shared_prefixes(tables, lens, bs) == [([0, 1, 2], 10)]
    assert cascade.shared_prefixes([common + [1], common + [2]], [170, 170], bs) == [([0, 1], 10)]
    assert cascade.shared_prefixes([common + [1]], [170], bs) == []  # a group of one
    assert cascade.shared_prefixes([[1, 2], [1, 3]], [20, 20], bs) == []  # too short to pay


async def test_engine_outputs_on_shared_system_prompts_equal_each_conversation_alone(engines, llama_dir, monkeypatch):
    import asyncio

    from tieredkv import SamplingParams
    from tieredkv.kernels import decode_attention as da

    rng = random.Random(7)
    systems = [[rng.randrange(3, 300) for _ in range(100)] for _ in range(2)]
    convs = [systems[i % 2] + [rng.randrange(3, 300) for _ in range(rng.randrange(3, 20))] for i in range(8)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    formed = []
    real = da.plan_cascades

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        formed.append(out.num_groups if out is not None else 0)
        return out

    monkeypatch.setattr(da, "plan_cascades", counting)
    from tieredkv.runner.model_runner import ModelRunner

    prefill_groups = []
    real_prepare = ModelRunner.prepare

    def prepare(self, scheduled, **kwargs):
        batch, sampled = real_prepare(self, scheduled, **kwargs)
        prefill_groups.append(len(batch.attn.prefill_plan or ()))
        return batch, sampled

    monkeypatch.setattr(ModelRunner, "prepare", prepare)
    cfg = make_config(model=str(llama_dir), num_blocks=256, max_num_seqs=16)
    async with await engines.start(cfg) as engine:
        for s in systems:  # the system prompts are cached first, as a chatbot's are
            await engine.generate(s + [5], SamplingParams(max_tokens=1))
        together = await asyncio.gather(*(engine.generate(c, params) for c in convs))
    assert max(formed) == 2  # both system prompts were attended as cascades
    assert max(prefill_groups) == 2  # the burst of new conversations prefilled against them together
    alone = []
    async with await engines.start(cfg.model_copy(update={"cascade_attention": False})) as engine:
        for c in convs:
            alone.append(await engine.generate(c, params))
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("members, loners, prefix_blocks, split, heads", [
    ([2], 0, [4], 64, (2, 3)), ([5], 2, [6], 32, (1, 3)), ([3, 4], 1, [4, 9], 64, (2, 3)),
    ([2, 2, 7], 0, [5, 4, 3], 16, (1, 3)),
    ([22, 3], 1, [2, 3], 32, (1, 3)), ([64], 0, [2], 64, (1, 2)),  # 66 and 128 query rows: several row tiles
])
def test_triton_cascade_equals_the_reference(members, loners, prefix_blocks, split, heads):
    """The prefix kernel over each group's stacked queries, the split-K kernel over the suffixes, merged:
    equal to plain attention (Triton under its interpreter on CPU), for 2 to 64 members."""
    triton_ops = pytest.importorskip("tieredkv.kernels.triton_ops")
    kv_heads, group = heads
    q, kc, vc, tables, lens, groups = batch(members, loners, prefix_blocks, kv_heads=kv_heads, group=group,
                                            seed=11 + loners, scattered=True)
    q, kc, vc, tables, lens = (t.to(DEVICE) for t in (q, kc, vc, tables, lens))  # on a GPU, run there
    want = decode_attention_ref(q, kc, vc, tables, lens, 0.2)
    prefixes = [(rows, prefix_blocks[i]) for i, rows in enumerate(groups)]
    plan = triton_ops.plan_decode(tables, lens, 16, torch.float32, prefixes)
    assert plan.cascade is not None and plan.cascade.members.shape[0] == len(groups)
    got = triton_ops.decode_attention(q, kc, vc, tables, lens, 0.2, plan=plan, tokens_per_split=split)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    again = triton_ops.decode_attention(q, kc, vc, tables, lens, 0.2, plan=plan, tokens_per_split=split)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=0)  # a second layer reuses the plan's scratch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("members", [[2], [9, 3], [64]])
def test_triton_cascade_in_bf16_on_the_gpu(members):
    """The cascade kernels on a GPU in bf16 (head_dim 128, 4 query heads per KV head), against the fp32
    reference, within the bf16 tolerance of the other kernels (2e-2)."""
    triton_ops = pytest.importorskip("tieredkv.kernels.triton_ops")
    q, kc, vc, tables, lens, groups = batch(members, 2, [5] * len(members), kv_heads=2, group=4, d=128, seed=3)
    q, kc, vc, tables, lens = (t.to("cuda") for t in (q, kc, vc, tables, lens))
    want = decode_attention_ref(q, kc, vc, tables, lens, 128**-0.5)
    plan = triton_ops.plan_decode(tables, lens, 16, torch.bfloat16, [(rows, 5) for rows in groups])
    got = triton_ops.decode_attention(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), tables, lens, 128**-0.5, plan=plan)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)


async def test_engine_cascades_through_triton_match_the_torch_path(engines, llama2_dir):
    pytest.importorskip("tieredkv.kernels.triton_ops")
    from tieredkv import SamplingParams

    rng = random.Random(8)
    system = [rng.randrange(3, 300) for _ in range(80)]
    convs = [system + [rng.randrange(3, 300) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        cfg = make_config(model=str(llama2_dir), num_blocks=64, attention_backend=backend, max_num_seqs=8)
        async with await engines.start(cfg) as engine:
            runner, cascades = engine.core.runner, []
            real = runner.ops.plan_decode

            def recording(*args, **kwargs):
                plan = real(*args, **kwargs)
                cascades.append(getattr(plan, "cascade", getattr(plan, "cascades", None)) is not None)
                return plan

            runner.ops = replace(runner.ops, plan_decode=recording)
            await engine.generate(system + [5], SamplingParams(max_tokens=1))
            results = await asyncio.gather(*(engine.generate(c, params) for c in convs))
            outs[backend] = [r.outputs[0].token_ids for r in results]
            assert any(cascades), backend  # the shared system prompt was attended as a cascade
    assert outs["triton"] == outs["torch"]


def test_prefill_chunks_after_one_cached_prefix_equal_plain_prefill():
    from tieredkv.kernels.prefill_attention import prefill_attention_ref

    bs, hkv, group, d = 16, 2, 3, 32
    g = torch.Generator().manual_seed(3)
    prefix = list(range(6))  # 96 cached tokens, shared
    rows_tables, lens, chunks = [], [], [9, 16, 23, 1]
    nxt = 6
    for i, q_len in enumerate(chunks):
        extra = (5 if i == 2 else 0) + q_len  # one row has more of its own cached before its chunk
        own = list(range(nxt, nxt + -(-extra // bs)))
        nxt += len(own)
        rows_tables.append(prefix + own)
        lens.append(96 + extra)
    width = max(map(len, rows_tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in rows_tables], dtype=torch.int32)
    kc, vc = torch.randn(nxt, bs, hkv, d, generator=g), torch.randn(nxt, bs, hkv, d, generator=g)
    qsl = torch.tensor([0, 9, 25, 48, 49], dtype=torch.int32)
    q = torch.randn(49, hkv * group, d, generator=g)
    ctx = torch.tensor(lens, dtype=torch.int32)
    plain = prefill_attention_ref(q, kc, vc, tables, qsl, ctx, 0.2)
    found = cascade.shared_prefixes(rows_tables, [n - c + 1 for n, c in zip(lens, chunks)], bs)
    assert found == [([0, 1, 2, 3], 6)]
    got = prefill_attention_ref(q, kc, vc, tables, qsl, ctx, 0.2, plan=found)
    torch.testing.assert_close(got, plain, atol=2e-6, rtol=0)


def test_decode_plans_made_from_host_lists_equal_those_read_back_from_the_tensors():
    """The runner hands each plan the lengths and block ids it already holds as lists, so that on CUDA nothing
    is read back from the device to plan a step; the plans must be the ones the tensors alone give."""
    pytest.importorskip("tieredkv.kernels.triton_ops")
    from tieredkv.kernels import triton_ops
    from tieredkv.kernels.decode_attention import plan_decode as plan_ref

    ids = [[3, 4, 5, 9], [3, 4, 5, 11, 12], [3, 4, 7], [20, 21]]
    lens = [60, 75, 40, 30]
    tables = torch.tensor([t + [0] * (5 - len(t)) for t in ids], dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    prefixes = [([0, 1], 3)]
    for prefix in (None, prefixes):
        a = triton_ops.plan_decode(tables, ctx, 16, torch.float32, prefix)
        b = triton_ops.plan_decode(tables, ctx, 16, torch.float32, prefix, host_lens=lens, host_tables=ids)
        assert a.max_context_len == b.max_context_len == 75
        assert (a.cascade is None) == (b.cascade is None)
        if a.cascade is not None:
            assert all(torch.equal(x, y) for x, y in zip(a.cascade[:4], b.cascade[:4]))
            assert a.cascade.max_prefix_len == b.cascade.max_prefix_len
        ra = plan_ref(tables, ctx, 16, torch.float32, prefix)
        rb = plan_ref(tables, ctx, 16, torch.float32, prefix, host_lens=lens, host_tables=ids)
        assert repr(ra.groups) == repr(rb.groups)
        if prefix:
            for x, y in zip(vars(ra.cascades).values(), vars(rb.cascades).values()):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
