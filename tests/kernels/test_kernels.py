"""Every Triton kernel matches its plain-torch reference (on CPU through Triton's interpreter)."""

import contextlib
import random

import pytest
import torch

from helpers import make_config
from tieredkv.kernels.block_copy import copy_blocks_ref, gather_blocks_ref, scatter_blocks_ref
from tieredkv.kernels.decode_attention import decode_attention_ref
from tieredkv.kernels.kv_format import KVLayout
from tieredkv.kernels.prefill_attention import prefill_attention_ref
from tieredkv.kernels.store_kv import store_kv_ref

triton_ops = pytest.importorskip("tieredkv.kernels.triton_ops")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 1e-5

# (block_size, head_dim, num_kv_heads, group)
SHAPES = [(8, 64, 2, 1), (16, 64, 1, 3), (32, 128, 1, 8), (16, 128, 2, 3)]


def make_cache(num_blocks, block_size, kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE)
    return k, v


def make_tables(context_lens, block_size, num_blocks, seed=0):
    """Random, non-contiguous block tables, padded with zeros."""
    rng = random.Random(seed)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(-(-c // block_size) for c in context_lens)
    rows, used = [], 0
    for c in context_lens:
        n = -(-c // block_size)
        rows.append(ids[used:used + n] + [0] * (width - n))
        used += n
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("block_size, head_dim, kv_heads, group", SHAPES)
def test_store_kv_kernel_matches_reference(block_size, head_dim, kv_heads, group):
    num_blocks, tokens = 6, 11
    k_ref, v_ref = make_cache(num_blocks, block_size, kv_heads, head_dim)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    key = torch.randn(tokens, kv_heads, head_dim, device=DEVICE)
    value = torch.randn(tokens, kv_heads, head_dim, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size)[:tokens].to(DEVICE)
    slots[3] = slots[7] = -1  # padding tokens are not stored
    ref, tri = torch.stack((k_ref, v_ref)), torch.stack((k_tri, v_tri))
    store_kv_ref(key, value, ref, slots)
    triton_ops.store_kv(key, value, tri, slots)
    assert torch.equal(tri, ref)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert torch.equal(ref[0].reshape(num_blocks * block_size, -1)[untouched.to(DEVICE)],
                       k_ref.reshape(num_blocks * block_size, -1)[untouched.to(DEVICE)])


@pytest.mark.parametrize("block_size, head_dim, kv_heads, group", SHAPES)
@pytest.mark.parametrize("context_lens", [[1], [37, 5, 64]], ids=["one-seq", "many-seqs"])
def test_decode_attention_kernel_matches_reference(block_size, head_dim, kv_heads, group, context_lens):
    num_blocks = 24
    kc, vc = make_cache(num_blocks, block_size, kv_heads, head_dim)
    tables = make_tables(context_lens, block_size, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(context_lens), kv_heads * group, head_dim, device=DEVICE)
    ref = decode_attention_ref(q, kc, vc, tables, lens, 0.125)
    out = triton_ops.decode_attention(q, kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_decode_attention_kernel_split_k_merge():
    """Contexts spanning several splits, ending mid-block, merged by log-sum-exp."""
    block_size, head_dim, kv_heads, group = 16, 64, 1, 3
    context_lens = [100, 16, 33]
    kc, vc = make_cache(20, block_size, kv_heads, head_dim, seed=3)
    tables = make_tables(context_lens, block_size, 20, seed=3)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, kv_heads * group, head_dim, device=DEVICE)
    ref = decode_attention_ref(q, kc, vc, tables, lens, 0.125)
    out = triton_ops.decode_attention(q, kc, vc, tables, lens, 0.125, tokens_per_split=32)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size, head_dim, kv_heads, group", SHAPES)
def test_prefill_attention_kernel_matches_reference(block_size, head_dim, kv_heads, group):
    # (cached prefix, chunk length): a fresh prompt, a chunk after a prefix ending mid-block, a 1-token tail
    seqs = [(0, 21), (13, 9), (40, 1)] if group < 8 else [(0, 19), (9, 6)]
    context_lens = [p + q for p, q in seqs]
    num_blocks = 16
    kc, vc = make_cache(num_blocks, block_size, kv_heads, head_dim, seed=1)
    tables = make_tables(context_lens, block_size, num_blocks, seed=1)
    starts = [0]
    for _, q_len in seqs:
        starts.append(starts[-1] + q_len)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(starts[-1], kv_heads * group, head_dim, device=DEVICE)
    ref = prefill_attention_ref(q, kc, vc, tables, qsl, lens, 0.125)
    out = triton_ops.prefill_attention(q, kc, vc, tables, qsl, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size, head_dim", [(8, 64), (16, 128)])
def test_block_copy_kernels_match_reference(block_size, head_dim):
    layers, num_blocks, heads = 2, 10, 2
    kv = torch.randn(layers, 2, num_blocks, block_size, heads, head_dim, device=DEVICE)
    ids = torch.tensor([7, 2, 5], device=DEVICE)
    staged_ref = torch.empty(3, layers, 2, block_size, heads, head_dim, device=DEVICE)
    staged_tri = torch.empty_like(staged_ref)
    gather_blocks_ref(kv, ids, staged_ref)
    triton_ops.gather_blocks(kv, ids, staged_tri)
    assert torch.equal(staged_tri, staged_ref)

    kv_ref, kv_tri = kv.clone(), kv.clone()
    src = torch.randn_like(staged_ref)
    dst_ids = torch.tensor([0, 9, 4], device=DEVICE)
    scatter_blocks_ref(kv_ref, dst_ids, src)
    triton_ops.scatter_blocks(kv_tri, dst_ids, src)
    assert torch.equal(kv_tri, kv_ref)

    copy_blocks_ref(kv_ref, torch.tensor([1, 3], device=DEVICE), torch.tensor([6, 8], device=DEVICE))
    triton_ops.copy_blocks(kv_tri, torch.tensor([1, 3], device=DEVICE), torch.tensor([6, 8], device=DEVICE))
    assert torch.equal(kv_tri, kv_ref)


KV_PAIRS = [("int8", "int8"), ("int4", "int4"), ("int8", "int4"), ("bfloat16", "bfloat16"), ("float16", "int8")]


def stored_cache(num_blocks, block_size, kv_heads, head_dim, kv: KVLayout, seed=0):
    """A K/V pool in kv's formats (the reference store's rows), as [2, blocks, bs, heads, row]."""
    k, v = make_cache(num_blocks, block_size, kv_heads, head_dim, seed)
    return torch.stack((kv.encode(0, k), kv.encode(1, v)))


@pytest.mark.parametrize("k,v", KV_PAIRS)
@pytest.mark.parametrize("head_dim", [64, 96])  # 96: int4's groups of 32, unturned (not a power of two)
def test_store_kernel_writes_each_kv_format_as_the_reference(k, v, head_dim):
    # the quantizing store writes the reference's bytes: codes from the fp16-rounded scale, ties to even
    kv = KVLayout.resolve(k, v, head_dim, torch.float32)
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 40, 2, head_dim, generator=g).to(DEVICE) * torch.logspace(-2, 2, 40)[:, None, None]
    slots = torch.randperm(6 * 16, generator=g)[:40].to(DEVICE)
    slots[5] = -1  # padding: not stored
    ref = torch.zeros(2, 6, 16, 2, kv.row, dtype=kv.storage_dtype, device=DEVICE)
    tri = ref.clone()
    store_kv_ref(key, value, ref, slots, kv=kv)
    triton_ops.store_kv(key, value, tri, slots, kv=kv)
    assert torch.equal(tri, ref)


@pytest.mark.parametrize("k,v", KV_PAIRS + [("fp8", "fp8")])
def test_attention_kernels_read_each_kv_format_as_the_reference(k, v):
    # decode (one split and split-K, with a shared-prefix cascade) and prefill dequantize in registers what the
    # references dequantize after their gather
    kv = KVLayout.resolve(k, v, 64, torch.float32, torch.device("cuda"))
    cache = stored_cache(16, 16, 2, 64, kv)
    lens = [70, 33, 70]
    tables = make_tables(lens, 16, 16)
    tables[2] = tables[0]
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 6, 64, device=DEVICE)
    want = decode_attention_ref(q, cache[0], cache[1], tables, ctx, 0.125, kv=kv)
    for split in (None, 32):
        got = triton_ops.decode_attention(q, cache[0], cache[1], tables, ctx, 0.125, tokens_per_split=split, kv=kv)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    plan = triton_ops.plan_decode(tables, ctx, 16, torch.float32, [([0, 2], 4)])
    torch.testing.assert_close(triton_ops.decode_attention(q, cache[0], cache[1], tables, ctx, 0.125, plan=plan,
                                                           kv=kv), want, atol=ATOL, rtol=1e-5)
    qp = torch.randn(12, 6, 64, device=DEVICE)
    starts = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    plens = torch.tensor([40, 7], dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(triton_ops.prefill_attention(qp, cache[0], cache[1], tables[:2], starts, plens, 0.125,
                                                            kv=kv),
                               prefill_attention_ref(qp, cache[0], cache[1], tables[:2], starts, plens, 0.125, kv=kv),
                               atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
async def test_engine_through_triton_kernels_matches_reference_kernels(engines, llama2_dir, kv_cache_dtype):
    """The whole engine, prefill chunks, prefix hits and decodes, through Triton (interpreted on CPU); with int8
    KV the Triton store and attention against the torch references in the same format."""
    from tieredkv import SamplingParams

    prompts = [[5, 17, 33, 2 + 40, 9] * 4, [7] * 23 + [5, 17, 33, 42, 9], [5, 17, 33, 42, 9] * 4 + [11]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        cfg = make_config(model=str(llama2_dir), num_blocks=32, block_size=8, attention_backend=backend,
                          device=DEVICE, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
        async with await engines.start(cfg) as engine:
            assert engine.core.runner.ops.name == backend
            assert engine.core.runner.warmed_up == (backend == "triton")  # kernels compiled at start-up
            outs[backend] = [(await engine.generate(p, params)).outputs[0].token_ids for p in prompts]
    assert outs["triton"] == outs["torch"]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16_ATOL = 2e-2  # bf16 inputs, fp32 accumulation: documented in docs/architecture.md


@gpu  # Triton's interpreter converts to e4m3 otherwise than the device (it drops mantissa bits)
def test_fp8_store_kernel_writes_the_reference_rows():
    kv = KVLayout.resolve("fp8", "fp8", 64, torch.bfloat16, torch.device("cuda"))
    key, value = torch.randn(2, 24, 2, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64, device="cuda")[:24]
    ref = torch.zeros(2, 4, 16, 2, kv.row, dtype=torch.uint8, device="cuda")
    tri = ref.clone()
    store_kv_ref(key, value, ref, slots, kv=kv)
    triton_ops.store_kv(key, value, tri, slots, kv=kv)
    torch.testing.assert_close(kv.decode(0, tri[0]).float(), kv.decode(0, ref[0]).float(), rtol=0.07, atol=1e-3)


@gpu
@pytest.mark.gpu
def test_bf16_decode_and_prefill_kernels_within_tolerance():
    kc, vc = (t.bfloat16() for t in make_cache(100, 16, 8, 128, seed=5))
    lens = [300, 17, 1000]
    tables = make_tables(lens, 16, 100, seed=5)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    ref = decode_attention_ref(q.float(), kc.float(), vc.float(), tables, lens_t, 128**-0.5)
    out = triton_ops.decode_attention(q, kc, vc, tables, lens_t, 128**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=BF16_ATOL, rtol=0)
    qsl = torch.tensor([0, 300, 317, 1317], dtype=torch.int32, device=DEVICE)
    qp = torch.randn(1317, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    ref = prefill_attention_ref(qp.float(), kc.float(), vc.float(), tables, qsl, lens_t, 128**-0.5)
    out = triton_ops.prefill_attention(qp, kc, vc, tables, qsl, lens_t, 128**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=BF16_ATOL, rtol=0)


@gpu
@pytest.mark.gpu
@pytest.mark.slow
async def test_default_model_on_cuda_kernels_match_references(engines):
    from tieredkv import SamplingParams

    chats = [[{"role": "user", "content": q}] for q in
             ("What is the capital of France? Answer in one sentence.", "Name three primary colours.")]
    outs = {}
    for backend in ("torch", "triton"):
        cfg = make_config(model="default", device="cuda", dtype="float32", attention_backend=backend,
                          kv_cache_bytes=1 << 30)
        async with await engines.start(cfg) as engine:
            outs[backend] = [(await engine.generate(c, SamplingParams(max_tokens=32))).outputs[0].token_ids
                             for c in chats]
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("head_dim", [80, 96, 112])
def test_head_dims_that_are_not_powers_of_two(head_dim):
    block_size, kv_heads, group = 16, 2, 2
    kc, vc = make_cache(12, block_size, kv_heads, head_dim, seed=4)
    lens = [40, 7]
    tables = make_tables(lens, block_size, 12, seed=4)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, kv_heads * group, head_dim, device=DEVICE)
    torch.testing.assert_close(triton_ops.decode_attention(q, kc, vc, tables, ctx, 0.1),
                               decode_attention_ref(q, kc, vc, tables, ctx, 0.1), atol=ATOL, rtol=0)
    torch.testing.assert_close(triton_ops.decode_attention(q, kc, vc, tables, ctx, 0.1, tokens_per_split=16),
                               decode_attention_ref(q, kc, vc, tables, ctx, 0.1), atol=ATOL, rtol=0)
    qp = torch.randn(12, kv_heads * group, head_dim, device=DEVICE)  # 5 + 7 new tokens after 35 and 0 cached
    starts = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    plens = torch.tensor([40, 7], dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(triton_ops.prefill_attention(qp, kc, vc, tables, starts, plens, 0.1),
                               prefill_attention_ref(qp, kc, vc, tables, starts, plens, 0.1), atol=ATOL, rtol=0)


def test_block_offsets_past_2_31_elements():
    """A pool whose `block id * block stride` passes 2**31: the kernels address it in int64. The view is
    cheap: untouched pages of a large allocation cost no memory."""
    block_size, kv_heads, head_dim = 16, 1, 16  # 256 elements a block
    num_blocks = (1 << 31) // 256 + 64
    kv = torch.empty(2, num_blocks, block_size, kv_heads, head_dim, device=DEVICE)  # views, no copy: untouched
    kc, vc = kv[0], kv[1]
    top = [num_blocks - 3, num_blocks - 1]
    g = torch.Generator().manual_seed(5)
    for b in top:
        kc[b] = torch.randn(block_size, kv_heads, head_dim, generator=g).to(DEVICE)
        vc[b] = torch.randn(block_size, kv_heads, head_dim, generator=g).to(DEVICE)
    tables = torch.tensor([top], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 1, head_dim, device=DEVICE)
    torch.testing.assert_close(triton_ops.decode_attention(q, kc, vc, tables, ctx, 0.25),
                               decode_attention_ref(q, kc, vc, tables, ctx, 0.25), atol=ATOL, rtol=0)
    key, value = torch.randn(1, kv_heads, head_dim, device=DEVICE), torch.randn(1, kv_heads, head_dim, device=DEVICE)
    slot = torch.tensor([(num_blocks - 2) * block_size + 5], device=DEVICE)
    triton_ops.store_kv(key, value, kv, slot)
    assert torch.equal(kv[0, num_blocks - 2, 5], key[0]) and torch.equal(kv[1, num_blocks - 2, 5], value[0])


def test_one_plan_per_step_shares_split_size_and_scratch_across_layers():
    block_size, head_dim, kv_heads, group = 16, 64, 1, 3
    num_heads = kv_heads * group
    kc, vc = make_cache(24, block_size, kv_heads, head_dim, seed=6)
    lens = [300, 20]
    tables = make_tables(lens, block_size, 24, seed=6)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    plan = triton_ops.plan_decode(tables, ctx, block_size, torch.float32)
    ref = decode_attention_ref(torch.ones(2, num_heads, head_dim, device=DEVICE), kc, vc, tables, ctx, 0.1)
    outs, scratch = [], []
    for _ in range(3):  # three "layers"
        q = torch.ones(2, num_heads, head_dim, device=DEVICE)
        outs.append(triton_ops.decode_attention(q, kc, vc, tables, ctx, 0.1, plan=plan))
        scratch.append(plan.scratch[0].data_ptr())
    assert len(set(scratch)) == 1 and plan.tokens_per_split % triton_ops.DECODE_BLOCK_N == 0
    for out in outs:
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_split_choice_fills_the_device_and_skips_the_merge_when_one_split_does():
    cpu = torch.device("cpu")
    assert triton_ops.choose_split(64, 4000, cpu) >= 4000  # the batch fills it: one split, no merge
    several = triton_ops.choose_split(1, 4000, cpu)
    assert several < 4000 and several % triton_ops.DECODE_BLOCK_N == 0
    with pytest.raises(AssertionError, match="multiple of"):
        kc, vc = make_cache(4, 16, 1, 64)
        triton_ops.decode_attention(torch.randn(1, 1, 64), kc, vc, torch.zeros(1, 4, dtype=torch.int32),
                                    torch.tensor([30], dtype=torch.int32), 0.1, tokens_per_split=100)


@pytest.mark.parametrize("capability, want", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                              ((8, 0), torch.bfloat16), ((8, 6), torch.bfloat16),
                                              ((9, 0), torch.bfloat16)])
def test_auto_dtype_is_float16_below_ampere(capability, want):
    """V100 (7.0) and T4 (7.5) have no native bf16 (it would be emulated); from Ampere (8.0) on, bf16."""
    from tieredkv.engine.resolve import resolve_dtype

    assert resolve_dtype("auto", torch.device("cuda"), capability) == want
    assert resolve_dtype("auto", torch.device("cpu"), capability) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cuda"), capability) == torch.bfloat16  # asked for: as asked
    if not torch.cuda.is_available():  # planning for a card this machine lacks: as Ampere and later
        assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_far_blocks_read_ahead_on_a_stream_order_their_waits(monkeypatch):
    """The read-ahead's stream protocol, on CPU with stand-ins for CUDA's streams (the order of calls is what a
    GPU would run): each layer's far blocks are copied on the staging stream after it waited for the compute
    stream (the buffer's memory may still be in use there), the buffer is recorded on the staging stream (not
    reused until the copy ends), and the compute stream waits for that copy's event before the layer reads it;
    the data is the host path's."""
    from tieredkv.runner.far_stage import plan_stage

    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append((self.name, "waits for", other.name))

        def wait_event(self, event):
            log.append((self.name, "waits for", event))

        def record_event(self):
            log.append((self.name, "records", f"event {len(log)}"))
            return log[-1][2]

    compute, staging, current = Stream("compute"), Stream("staging"), []

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        log.append((stream.name, "runs", "copy"))
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: log.append(("buffer", "recorded on",
                                                                                     stream.name)), raising=False)
    layers, hot, g = 3, 4, torch.Generator().manual_seed(2)
    slab = torch.randn(6, layers, 2, 8, 2, 16, generator=g)
    pool = torch.randn(layers, 2, hot, 8, 2, 16, generator=g)
    tables = [[0, hot + 2, 3, hot + 5]]
    plan, _ = plan_stage(tables, hot, slab, torch.device("cpu"), in_place=False, stream=staging)
    host, _ = plan_stage(tables, hot, slab, torch.device("cpu"), in_place=False)
    for layer in range(layers):
        assert torch.equal(plan.gather(pool[layer], layer), host.gather(pool[layer], layer))
    per_layer = [("staging", "waits for", "compute"), ("staging", "runs", "copy"), ("buffer", "recorded on", "staging")]
    events = [e for e in log if e[1] == "records"]
    assert len(events) == layers and (plan.read_ahead_layers, plan.late_layers) == (layers, 0)
    expected = []
    for layer in range(layers):  # layer 0 read ahead at planning, each next one at the gather before
        expected += per_layer + [events[layer]]
        if layer:
            expected.insert(len(expected) - 4, ("compute", "waits for", events[layer - 1][2]))
    expected.append(("compute", "waits for", events[-1][2]))
    assert log == expected


def test_far_blocks_read_in_place_from_the_slab_match_the_host_gather():
    """On CUDA the staged far blocks are read by the block-copy kernel straight from the pinned slab (no host
    gather, no staging copy), a layer ahead: here through the interpreter on CPU tensors, against the
    host-gather path, on tables that name hot and far blocks, some twice; and the launch is the pool copies' own
    kernel variant, so the warm-up already compiled it."""
    from tieredkv.runner.far_stage import plan_stage

    layers, capacity, hot, bs, kvh, hd = 3, 10, 6, 8, 2, 64
    g = torch.Generator().manual_seed(7)
    slab = torch.randn(capacity, layers, 2, bs, kvh, hd, generator=g)
    pool = torch.randn(layers, 2, hot, bs, kvh, hd, generator=g)
    tables = [[0, hot + 4, 2, hot + 9], [hot + 4, 1, hot + 0]]
    cpu = torch.device("cpu")
    host, host_tables = plan_stage(tables, hot, slab, cpu, in_place=False)
    kernel, kernel_tables = plan_stage(tables, hot, slab, cpu, in_place=True)
    assert host.far_slots_dev is None and kernel.far_slots_dev is not None and kernel_tables == host_tables
    for layer in range(layers):
        got = kernel.gather(pool[layer], layer)
        assert torch.equal(got, host.gather(pool[layer], layer))
        for table, staged in zip(tables, kernel_tables):
            for block, pos in zip(table, staged):
                want = pool[layer][:, block] if block < hot else slab[block - hot, layer]
                assert torch.equal(got[:, pos], want)
    # each layer's far blocks were read ahead (layer 0's by plan_stage, each next one's at the gather before)
    assert (kernel.read_ahead_layers, kernel.late_layers) == (host.read_ahead_layers, host.late_layers) == (layers, 0)
    again = kernel.gather(pool[0], 0)  # out of order: copied at the gather, still right
    assert torch.equal(again, host.gather(pool[0], 0)) and kernel.late_layers == 1
    with triton_ops.recording(dry_run=True) as from_slab:
        kernel.read_ahead(1)
    with triton_ops.recording(dry_run=True) as pool_copies:
        triton_ops.gather_blocks(pool, torch.tensor([1]), torch.empty(1, layers, 2, bs, kvh, hd))
    assert from_slab == pool_copies and len(from_slab) == 1
