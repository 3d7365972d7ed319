"""The CPU decode attention kernel (attention_cpu.c, as torch.ops.tieredkv.paged_decode) against attention
written out per sequence, on each build of the kernels (this processor's, AVX2, plain C): shapes, lengths,
thread counts, bf16 caches, shared-prefix plans, the compiled graph's call, and the inputs it refuses; and the
CPU prefill attention kernel (tkv_prefill_attention) against the torch reference."""

import itertools
import random
from collections import Counter

import pytest
import torch

from helpers import check_pool_clean, hf_greedy, make_config, naive_decode, run_to_end
from tieredkv.kernels.cascade import shared_prefixes
from tieredkv.kernels.decode_attention import (
    decode_attention_compiled,
    decode_attention_cpu,
    decode_attention_dense,
    decode_attention_ref,
    paged_decode_usable,
    plan_decode,
)
from tieredkv.kernels.kv_format import FORMATS, KVLayout, hadamard, rotates
from tieredkv.kernels.prefill_attention import prefill_attention_cpu, prefill_attention_ref, prefill_kernel_takes


def paged(*args):
    return torch.ops.tieredkv.paged_decode(*args)  # registered once the `lib` fixture bound the operators


def paged_batch(lens, bs=16, kv_heads=2, group=3, d=32, dtype=torch.float32, seed=0, spare=3, pad=None):
    """Caches with each sequence's blocks scattered over the pool, and tables wider than the longest
    sequence needs, padded with `pad`, by default ids past the cache's end (the kernel never reads them;
    the torch reference gathers whole tables and needs valid ones)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + spare
    kc = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), max(need) + 2), num_blocks + 1000 if pad is None else pad, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(ids[used : used + n])
        used += n
    q = torch.randn(len(lens), kv_heads * group, d, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


def expected(q, kc, vc, tables, lens, scale):
    return naive_decode(q.float(), kc.float(), vc.float(), tables, lens.tolist(), scale)


@pytest.mark.parametrize("lens, bs, kv_heads, group, d", [
    ([1], 16, 2, 3, 32),  # one position
    ([160], 16, 3, 3, 64),  # the default model's heads
    ([700, 5, 64, 65, 333, 16, 17, 690, 1, 250], 16, 2, 3, 32),  # spread lengths, block boundaries
    ([4000], 16, 1, 8, 128),  # long: many splits
    ([37, 900], 32, 4, 1, 64),  # no grouping, larger blocks
    ([50, 51, 9], 8, 2, 4, 40),  # a head size that is not a multiple of 8: the plain-C loops
    ([100, 3], 5, 2, 2, 16),  # a block size that is not a power of two
    ([300, 120], 16, 1, 32, 256),  # the kernel's largest group and head size
])
def test_kernel_matches_per_sequence_attention(lib, lens, bs, kv_heads, group, d):
    q, kc, vc, tables, ctx = paged_batch(lens, bs, kv_heads, group, d, seed=len(lens) + d)
    got = paged(q, kc, vc, tables, ctx, d**-0.5)
    torch.testing.assert_close(got, expected(q, kc, vc, tables, ctx, d**-0.5), rtol=2e-5, atol=2e-6)


def test_bf16_caches_and_query(lib):
    q, kc, vc, tables, ctx = paged_batch([333, 20, 1], dtype=torch.bfloat16, d=64)
    got = paged(q, kc, vc, tables, ctx, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected(q, kc, vc, tables, ctx, 0.125), rtol=1e-2, atol=1e-2)
    # fp32 queries over bf16 caches: the only rounding is the caches' own
    got = paged(q.float(), kc, vc, tables, ctx, 0.125)
    torch.testing.assert_close(got, expected(q, kc, vc, tables, ctx, 0.125), rtol=2e-5, atol=2e-6)


def test_any_thread_count_gives_the_same_attention_each_call(lib):
    """The positions are split by the thread count (a batch of one still keeps every thread busy); each
    count's result is the reference's, and the same from call to call."""
    q, kc, vc, tables, ctx = paged_batch([2000, 7], kv_heads=3, d=64)
    want = expected(q, kc, vc, tables, ctx, 0.125)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            first = paged(q, kc, vc, tables, ctx, 0.125)
            torch.testing.assert_close(first, want, rtol=2e-5, atol=2e-6)
            assert torch.equal(paged(q, kc, vc, tables, ctx, 0.125), first)
    finally:
        torch.set_num_threads(before)


def test_decode_attention_cpu_with_shared_prefixes_equals_the_reference(lib):
    """Rows sharing a prefix are attended as cascades (the plan's), the others by the kernel in one call."""
    rng = random.Random(0)
    bs, d, group, kv_heads = 16, 32, 3, 2
    common = list(range(6))
    tables_list = [common + [6 + i] for i in range(3)] + [[20 + i, 30 + i] for i in range(2)]
    lens = [6 * bs + rng.randrange(1, bs) for _ in range(3)] + [rng.randrange(17, 32) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(40, bs, kv_heads, d, generator=g), torch.randn(40, bs, kv_heads, d, generator=g)
    q = torch.randn(len(lens), kv_heads * group, d, generator=g)
    padded = [row + [0] * (7 - len(row)) for row in tables_list]
    tables, ctx = torch.tensor(padded, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    prefixes = shared_prefixes(tables_list, lens, bs)
    assert prefixes == [([0, 1, 2], 6)]
    plan = plan_decode(tables, ctx, bs, torch.float32, prefixes)
    assert plan.cascades is not None and plan.alone.tolist() == [3, 4]
    want = decode_attention_ref(q, kc, vc, tables, ctx, 0.2, plan=plan)
    torch.testing.assert_close(decode_attention_cpu(q, kc, vc, tables, ctx, 0.2, plan=plan), want, rtol=2e-5,
                               atol=2e-6)
    torch.testing.assert_close(decode_attention_cpu(q, kc, vc, tables, ctx, 0.2), want, rtol=2e-5, atol=2e-6)


def test_the_compiled_graph_calls_the_kernel(lib):
    """decode_attention_compiled traces to one call of the operator (the scale folded into the query), and
    the compiled function gives the reference's attention."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, kc, vc, tables, ctx = paged_batch([77], kv_heads=3, d=64)
    graph = make_fx(lambda *a: decode_attention_compiled(*a, 0.125))(q, kc, vc, tables, ctx)
    assert [n.target for n in graph.graph.nodes].count(torch.ops.tieredkv.paged_decode.default) == 1
    compiled = torch.compile(lambda *a: decode_attention_compiled(*a, 0.125), fullgraph=True)
    torch.testing.assert_close(compiled(q, kc, vc, tables, ctx), expected(q, kc, vc, tables, ctx, 0.125),
                               rtol=2e-5, atol=2e-6)


def test_a_nan_in_the_cache_spoils_its_heads_as_in_the_reference(lib):
    """A NaN key or value makes the attention of the query heads that read it NaN, as softmax does in the
    reference (the sampler then fails that sequence alone), and leaves the other heads and rows alone."""
    q, kc, vc, tables, ctx = paged_batch([100, 40], kv_heads=2, group=3, d=64)
    want = expected(q, kc, vc, tables, ctx, 0.125)
    for cache in (kc, vc):
        spoiled = cache.clone()
        spoiled[int(tables[0, 2]), 5, 1] = float("nan")  # row 0's position 37, KV head 1
        k, v = (spoiled, vc) if cache is kc else (kc, spoiled)
        got = paged(q, k, v, tables, ctx, 0.125)
        assert got[0, 3:].isnan().all()  # query heads 3..5 read KV head 1
        torch.testing.assert_close(got[0, :3], want[0, :3], rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(got[1], want[1], rtol=2e-5, atol=2e-6)


KV_PAIRS = [("bfloat16", "bfloat16"), ("float16", "float16"), ("int8", "int8"), ("int4", "int4"),
            ("int8", "int4"), ("float16", "int8")]


def stored(kc, vc, kv: KVLayout):
    """The caches as rows in kv's formats, and the values those rows stand for."""
    kr, vr = kv.encode(0, kc), kv.encode(1, vc)
    return kr, vr, kv.decode(0, kr), kv.decode(1, vr)


@pytest.mark.parametrize("k,v", KV_PAIRS)
@pytest.mark.parametrize("d", [64, 48])  # 48: int4 in one group a row, unturned
def test_kernel_reads_every_kv_format_where_it_lies(lib, k, v, d):
    # each format against attention over the values its rows stand for: the kernel dequantizes a chunk at a time
    # as it reads (int4 rows turned: it turns the query, and the output back), and gives what attention over the
    # dequantized cache gives
    q, kc, vc, tables, ctx = paged_batch([70, 9, 33, 1], d=d, pad=0)
    kv = KVLayout.resolve(k, v, d, torch.float32)
    kr, vr, kd, vd = stored(kc, vc, kv)
    assert kr.dtype == (torch.uint8 if kv.storage_dtype == torch.uint8 else FORMATS[k].float_dtype)
    want = expected(q, kd, vd, tables, ctx, 0.2)
    torch.testing.assert_close(decode_attention_cpu(q, kr, vr, tables, ctx, 0.2, kv=kv), want, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(decode_attention_ref(q, kr, vr, tables, ctx, 0.2, kv=kv), want, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(decode_attention_dense(q, kr, vr, tables, ctx, 0.2, kv=kv), want, rtol=2e-5,
                               atol=2e-6)
    torch.testing.assert_close(decode_attention_compiled(q, kr, vr, tables, ctx, 0.2, kv=kv), want, rtol=2e-5,
                               atol=2e-6)
    # the shared-prefix plan reads the same rows (cascades dequantize what they gather)
    shared = tables.clone()
    shared[1, :1] = shared[0, :1]
    lens = torch.tensor([70, 20, 33, 1], dtype=torch.int32)
    plan = plan_decode(shared, lens, 16, torch.float32, shared_prefixes(shared.tolist(), lens.tolist(), 16))
    torch.testing.assert_close(decode_attention_cpu(q, kr, vr, shared, lens, 0.2, plan=plan, kv=kv),
                               expected(q, kd, vd, shared, lens, 0.2), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("group, d", [(1, 32), (2, 64), (2, 48), (4, 64), (3, 128), (5, 64), (3, 40)])
def test_quantized_rows_read_from_their_codes_or_widened_equal_the_reference(lib, group, d):
    # without AVX-512 the kernel reads int8 and int4 rows straight from their codes where a KV head has at most 4
    # query heads and 16 (int8) or 32 (int4) divides the head dim (attention_cpu.c: codes_read), and widens them
    # otherwise (5 heads; d 40; int4 at d 48): every way, as K, as V and as both, gives attention over the values
    # the rows stand for (int4 rows of a power-of-two d turned, several groups a row at d 128)
    q, kc, vc, tables, ctx = paged_batch([70, 9, 33, 1], kv_heads=2, group=group, d=d, pad=0)
    for k, v in [("int8", "int8"), ("int4", "int4"), ("int8", "float16"), ("bfloat16", "int8"), ("int8", "int4")]:
        kv = KVLayout.resolve(k, v, d, torch.float32)
        kr, vr, kd, vd = stored(kc, vc, kv)
        torch.testing.assert_close(decode_attention_cpu(q, kr, vr, tables, ctx, 0.2, kv=kv),
                                   expected(q, kd, vd, tables, ctx, 0.2), rtol=2e-5, atol=2e-6)


def test_kv_rows_written_in_c_are_the_torch_store_bit_for_bit(lib):
    # the native step writes its K/V rows with tkv_kv_store: the same bytes as kv_format's encode (int4's turn
    # included), so a block is the same whichever path computed it; tkv_kv_rows reads them back as kv_format's
    # decode does
    from tieredkv.kernels.quant_cpu import CPU

    g = torch.Generator().manual_seed(1)
    for d in (64, 128, 48):
        rows = [torch.randn(d, generator=g) * 10.0 ** e for e in range(-6, 5)]
        rows += [torch.zeros(d), -torch.zeros(d), torch.full((d,), 3.5), torch.linspace(-1, 1, d) * 60000]
        for fmt in (f for f in FORMATS.values() if f.code <= 4):
            for x in rows:
                want = fmt.encode(x)
                got = torch.zeros(fmt.row_bytes(d), dtype=torch.uint8)
                CPU.lib.tkv_kv_store(x.data_ptr(), fmt.code, d, got.data_ptr())
                assert torch.equal(got, want), (fmt.name, d, x[:4])
                back = torch.empty(d)
                CPU.lib.tkv_kv_rows(got.data_ptr(), fmt.code, fmt.row_bytes(d), 1, d, back.data_ptr())
                if rotates(fmt, d):  # int4 rows are read turned (attention turns the query instead)
                    back = hadamard(back)
                assert torch.equal(back, fmt.decode(got, d, torch.float32)), (fmt.name, d)


@pytest.mark.parametrize("k,v", [("int8", "int8"), ("int4", "int4"), ("int8", "int4"), ("bfloat16", "int8")])
def test_the_c_store_and_read_back_are_the_torch_ones(lib, k, v):
    # the eager forward's store on CPU (store_kv_cpu: one C call for every token and head) writes kv_format's
    # bytes, padding tokens skipped, K and V read from the fused q/k/v output's strided views; the references'
    # rows read back through the C kernel (select_blocks) are kv_format's values
    from tieredkv.kernels.kv_format import select_blocks
    from tieredkv.kernels.store_kv import store_kv_cpu, store_kv_ref

    kv = KVLayout.resolve(k, v, 64, torch.float32)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(37, (9 + 2 * 3) * 64, generator=g) * 3
    key, value = qkv[:, 9 * 64:12 * 64].view(37, 3, 64), qkv[:, 12 * 64:].view(37, 3, 64)
    slots = torch.randperm(8 * 16, generator=g)[:37]
    slots[[3, 20]] = -1
    want = torch.zeros(2, 8, 16, 3, kv.row, dtype=torch.uint8)
    got = want.clone()
    store_kv_ref(key, value, want, slots, kv)
    store_kv_cpu(key, value, got, slots, kv)
    assert torch.equal(got, want)
    ids = torch.tensor([5, 0, 7])
    for side in (0, 1):
        torch.testing.assert_close(select_blocks(got[side], ids, kv, side),
                                   kv.decode(side, torch.index_select(got[side], 0, ids)), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="slot 128 outside"):
        torch.ops.tieredkv.store_kv_rows(key, value, got, torch.full((37,), 128), *kv.codes)


def test_an_fp32_cache_is_stored_by_the_c_kernel_with_the_references_bytes(lib):
    # an fp32 cache (no KV format) takes the same C store, its rows copied as they are: index_copy_'s bytes,
    # padding tokens skipped, V from the fused q/k/v output's strided view
    from tieredkv.kernels.store_kv import store_kv_cpu, store_kv_ref

    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(37, (9 + 2 * 3) * 64, generator=g) * 3
    key, value = qkv[:, 9 * 64:12 * 64].contiguous().view(37, 3, 64), qkv[:, 12 * 64:].view(37, 3, 64)
    slots = torch.randperm(8 * 16, generator=g)[:37]
    slots[[0, 36]] = -1
    want = torch.zeros(2, 8, 16, 3, 64)
    got = want.clone()
    store_kv_ref(key, value, want, slots)
    store_kv_cpu(key, value, got, slots)
    assert torch.equal(got, want) and got.abs().sum() > 0
    with pytest.raises(RuntimeError, match="slot 128 outside"):
        store_kv_cpu(key, value, got, torch.full((37,), 128))


@pytest.mark.parametrize("tokens,heads,dim,row", [(512, 9, 64, 15 * 64), (1, 4, 16, 64), (37, 2, 128, 300 + 256),
                                                  (3, 3, 32, 96)])
def test_the_c_rotary_gives_torchs_bits(lib, tokens, heads, dim, row):
    # the eager forward's rotary embedding on CPU (rotary_cpu: one pass, no fused multiply-add) gives the torch
    # reference's bits, from the queries' strided view of the fused q/k/v output; what it does not take (another
    # dtype, a head dim that is not even, a traced graph) the reference serves
    from tieredkv.kernels.calls import counting
    from tieredkv.kernels.rotary import rotary_cpu, rotary_ref

    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, row, generator=g) * 4)[:, : heads * dim].view(tokens, heads, dim)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.randint(0, 100_000, (tokens,), generator=g).float()[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    calls: Counter = Counter()
    with counting(calls):
        got = rotary_cpu(x, cos, sin)
        assert torch.equal(got, rotary_ref(x, cos, sin)) and got.is_contiguous()
        assert torch.equal(rotary_cpu(x.double(), cos.double(), sin.double()),
                           rotary_ref(x.double(), cos.double(), sin.double()))
    assert calls == {("rotary", "CPU kernel"): 1, ("rotary", "torch"): 1}


def test_where_the_kernel_does_not_serve_torch_does(lib, monkeypatch):
    q, kc, vc, tables, ctx = paged_batch([40, 9], pad=0)
    assert paged_decode_usable(q, kc)
    assert not paged_decode_usable(q, kc.double())  # fp64 caches
    fp8 = KVLayout.resolve("fp8", "fp8", 32, torch.float32, torch.device("cuda"))
    assert not paged_decode_usable(q, fp8.encode(0, kc), fp8)  # a format the kernel does not read
    torch.testing.assert_close(decode_attention_cpu(q, fp8.encode(0, kc), fp8.encode(1, vc), tables, ctx, 0.2, kv=fp8),
                               expected(q, fp8.decode(0, fp8.encode(0, kc)), fp8.decode(1, fp8.encode(1, vc)), tables,
                                        ctx, 0.2), rtol=2e-5, atol=2e-6)
    assert not paged_decode_usable(q, kc.transpose(1, 2))  # not contiguous
    wide = torch.randn(2, 66, 2, 32)
    assert not paged_decode_usable(torch.randn(2, 66, 32), wide[:, :, :1].contiguous())  # 66 heads a KV head
    from tieredkv.kernels.quant_cpu import CPU

    monkeypatch.setattr(CPU, "bound", None)  # the operators not built (no C++ compiler)
    assert not paged_decode_usable(q, kc)
    torch.testing.assert_close(decode_attention_cpu(q, kc, vc, tables, ctx, 0.2),
                               expected(q, kc, vc, tables, ctx, 0.2), rtol=2e-5, atol=2e-6)


def test_bad_input_is_refused_before_anything_is_read(lib):
    q, kc, vc, tables, ctx = paged_batch([40, 9])
    with pytest.raises(RuntimeError, match="context length 0 of row 1"):
        paged(q, kc, vc, tables, torch.tensor([40, 0], dtype=torch.int32), 0.2)
    with pytest.raises(RuntimeError, match="context length 1000 of row 0 outside"):
        paged(q, kc, vc, tables, torch.tensor([1000, 9], dtype=torch.int32), 0.2)
    bad = tables.clone()
    bad[1, 0] = kc.shape[0]
    with pytest.raises(RuntimeError, match=f"block id {kc.shape[0]} outside"):
        paged(q, kc, vc, bad, ctx, 0.2)
    with pytest.raises(RuntimeError, match="do not hold rows of 32 values"):
        paged(q, kc.double(), vc.double(), tables, ctx, 0.2)
    rows = KVLayout.resolve("int8", "int8", 32, torch.float32).encode(0, kc)  # rows of 34 bytes
    with pytest.raises(RuntimeError, match="do not hold rows of 32 values"):
        paged(q, rows, rows, tables, ctx, 0.2, FORMATS["float32"].code, FORMATS["float32"].code)
    with pytest.raises(RuntimeError, match="do not hold rows of 32 values"):
        paged(q, rows, rows, tables, ctx, 0.2)  # bytes with no format named
    with pytest.raises(RuntimeError, match="not a shape the kernel takes"):
        paged(torch.randn(2, 5, 32), kc, vc, tables, ctx, 0.2)  # 5 query heads over 2 KV heads
    with pytest.raises(RuntimeError, match="tables .* and lengths"):
        paged(q, kc, vc, tables[:1], ctx, 0.2)
    # int64 tables and lengths are converted
    torch.testing.assert_close(paged(q, kc, vc, tables.long(), ctx.long(), 0.2), paged(q, kc, vc, tables, ctx, 0.2))


# (cached prefix, chunk) per sequence: a fresh prompt past a chunk of keys, a chunk after a prefix ending mid-block,
# one-token tails, a long prompt (many tiles of queries and chunks of keys)
PREFILL_SEQS = [[(0, 45), (13, 9), (40, 1)], [(0, 300)], [(250, 3), (0, 1), (31, 33)]]


@pytest.mark.parametrize("seqs", PREFILL_SEQS, ids=["mixed", "long", "tails"])
@pytest.mark.parametrize("bs, kv_heads, group, d", [(16, 3, 3, 64), (8, 2, 1, 32), (16, 1, 8, 128), (5, 2, 4, 16),
                                                     (16, 1, 32, 48), (16, 2, 11, 80)])
def test_prefill_kernel_matches_the_reference(lib, seqs, bs, kv_heads, group, d):
    """Chunks attend causally to their cached prefix and themselves: the CPU kernel gives the torch reference's
    attention (scores as small products of tiles of queries and chunks of turned keys, online softmax), for
    groups of 1 to 32 query heads a KV head (tiles of whole positions: 32 vectors, or fewer), head sizes of one to
    eight vectors, block sizes that are not powers of two, and the same result from call to call."""
    lens = [p + n for p, n in seqs]
    _, kc, vc, tables, ctx = paged_batch(lens, bs, kv_heads, group, d, seed=d + len(seqs), pad=0)
    starts = torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), kv_heads * group, d, generator=torch.Generator().manual_seed(5))
    assert prefill_kernel_takes(q, kc, None)
    want = prefill_attention_ref(q, kc, vc, tables, starts, ctx, d**-0.5)
    got = prefill_attention_cpu(q, kc, vc, tables, starts, ctx, d**-0.5)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    assert torch.equal(prefill_attention_cpu(q, kc, vc, tables, starts, ctx, d**-0.5), got)


def test_prefill_kernel_over_a_long_context_lays_it_out_in_memory_of_its_own(lib):
    """A context whose keys and values laid out pass the 32 MB a thread keeps (attention_cpu.c: PF_KEPT) takes an
    allocation of its own, given back after: the same attention as the reference, a chunk of 12 queries after 33,000
    cached positions."""
    _, kc, vc, tables, ctx = paged_batch([33_000], bs=16, kv_heads=1, group=2, d=128, pad=0, spare=0)
    q = torch.randn(12, 2, 128, generator=torch.Generator().manual_seed(4))  # (more than a short chunk's queries)
    starts = torch.tensor([0, 12], dtype=torch.int32)
    torch.testing.assert_close(prefill_attention_cpu(q, kc, vc, tables, starts, ctx, 128**-0.5),
                               prefill_attention_ref(q, kc, vc, tables, starts, ctx, 128**-0.5), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("chunk, context", [(1, 40), (2, 8), (5, 700), (9, 36), (9, 1000), (9, 4097)])
@pytest.mark.parametrize("k, v", [("float32", "float32"), ("int8", "int8")])
def test_a_short_chunk_over_a_long_context_attends_as_decode_rows(lib, chunk, context, k, v):
    """A lone sequence's chunk of at most 9 queries over at least 4 times as many positions (a speculative
    verification: the last token and its drafts) attends as decode rows (attention_cpu.c: chunks_as_decode): query j
    gets exactly what decode attention gives it alone over its L - T + j + 1 positions, bit for bit, and the
    reference's attention; a longer chunk, or a shorter context, takes the prefill items (the reference's too)."""
    d, kv_heads, group = 64, 3, 3
    _, kc, vc, tables, ctx = paged_batch([context], d=d, kv_heads=kv_heads, group=group, pad=0, seed=chunk)
    kv = KVLayout.resolve(k, v, d, torch.float32)
    kr, vr, _, _ = stored(kc, vc, kv)
    q = torch.randn(chunk + 1, kv_heads * group, d, generator=torch.Generator().manual_seed(context))
    for t in (chunk, chunk + 1):
        starts = torch.tensor([0, t], dtype=torch.int32)
        got = prefill_attention_cpu(q[:t], kr, vr, tables, starts, ctx, 0.125, kv=kv)
        torch.testing.assert_close(got, prefill_attention_ref(q[:t], kr, vr, tables, starts, ctx, 0.125, kv=kv),
                                   rtol=2e-5, atol=2e-6)
        if t <= 9 and context >= 4 * t:
            lens = [torch.tensor([context - t + j + 1], dtype=torch.int32) for j in range(t)]
            alone = torch.cat([paged(q[j : j + 1], kr, vr, tables, lens[j], 0.125, *kv.kernel_codes) for j in range(t)])
            assert torch.equal(got, alone), (t, context)


@pytest.mark.parametrize("bs", [3, 8, 16, 48])
@pytest.mark.parametrize("k, v", [("float32", "float32"), ("bfloat16", "int8")])
@pytest.mark.parametrize("kv_heads, d", [(3, 64), (5, 256)], ids=["rows copied", "rows read in place"])
def test_a_chunk_of_positions_spans_blocks_and_each_row_keeps_its_bits(lib, bs, k, v, kv_heads, d):
    """Decode attention reads up to 32 positions a chunk whatever the block size (several blocks of 3, 8 or 16 rows;
    part of a block of 48), copied side by side first (a long item's chunk of at most 128 KiB of K rows: 5 KV heads
    of 256 fp32 values are more, read in the cache), then each block's rows where they lie (fp32) or widened: the
    reference's attention, and a verification's rows (ending mid-block, mid-chunk) each the bits it gets alone."""
    group, t, context = 3, 7, 701
    _, kc, vc, tables, ctx = paged_batch([context], bs=bs, d=d, kv_heads=kv_heads, group=group, pad=0, seed=bs)
    kv = KVLayout.resolve(k, v, d, torch.float32)
    kr, vr, _, _ = stored(kc, vc, kv)
    q = torch.randn(t, kv_heads * group, d, generator=torch.Generator().manual_seed(bs))
    starts = torch.tensor([0, t], dtype=torch.int32)
    got = prefill_attention_cpu(q, kr, vr, tables, starts, ctx, 0.125, kv=kv)
    torch.testing.assert_close(got, prefill_attention_ref(q, kr, vr, tables, starts, ctx, 0.125, kv=kv),
                               rtol=2e-5, atol=2e-6)
    lens = [torch.tensor([context - t + j + 1], dtype=torch.int32) for j in range(t)]
    alone = torch.cat([paged(q[j : j + 1], kr, vr, tables, lens[j], 0.125, *kv.kernel_codes) for j in range(t)])
    assert torch.equal(got, alone)


@pytest.mark.parametrize("seqs, as_decode", [([(9, 600), (5, 1000), (1, 512)], True), ([(9, 600), (9, 128)], False)])
def test_several_short_chunks_over_long_contexts_attend_as_decode_rows(lib, seqs, as_decode):
    """A batch's verifications (chunks of at most 9 queries) over at least 512 positions each attend as decode rows,
    every query decode attention's bits alone; where one context is shorter, the whole batch takes the prefill
    items. The reference's attention either way."""
    d, kv_heads, group = 64, 3, 3
    _, kc, vc, tables, ctx = paged_batch([n for _, n in seqs], d=d, kv_heads=kv_heads, group=group, pad=0)
    starts = torch.tensor([0, *itertools.accumulate(t for t, _ in seqs)], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), kv_heads * group, d, generator=torch.Generator().manual_seed(3))
    got = prefill_attention_cpu(q, kc, vc, tables, starts, ctx, 0.125)
    torch.testing.assert_close(got, prefill_attention_ref(q, kc, vc, tables, starts, ctx, 0.125), rtol=2e-5, atol=2e-6)
    alone = torch.cat([paged(q[int(starts[b]) + j : int(starts[b]) + j + 1], kc, vc, tables[b : b + 1],
                             torch.tensor([n - t + j + 1], dtype=torch.int32), 0.125)
                       for b, (t, n) in enumerate(seqs) for j in range(t)])
    assert torch.equal(got, alone) == as_decode


@pytest.mark.parametrize("k,v", [("bfloat16", "bfloat16"), ("float16", "int8"), ("int8", "int8"), ("int4", "int4")])
@pytest.mark.parametrize("d", [64, 48])  # int4 rows turned at 64 (the reference serves), not at 48
def test_prefill_kernel_reads_the_kv_formats_and_the_shared_prefix_plan(lib, k, v, d):
    """Rows in the KV formats are widened as they are laid out (int4's turned rows go to the reference); a plan's
    group of chunks over shared cached blocks takes the cascade and the other chunks the kernel, in one output."""
    from collections import Counter

    from tieredkv.kernels.calls import counting

    q, kc, vc, tables, ctx = paged_batch([70, 40, 33], d=d, pad=0)
    kv = KVLayout.resolve(k, v, d, torch.float32)
    kr, vr, _, _ = stored(kc, vc, kv)
    tables[1, :2] = tables[0, :2]  # sequences 0 and 1 follow the same 32 cached positions
    starts = torch.tensor([0, 38, 46, 79], dtype=torch.int32)
    qp = torch.randn(79, 6, d, generator=torch.Generator().manual_seed(2))
    takes = not (rotates(kv.k, d) or rotates(kv.v, d))
    assert prefill_kernel_takes(qp, kr, kv) == takes
    for plan in (None, [([0, 1], 2)]):
        calls: Counter = Counter()
        with counting(calls):
            got = prefill_attention_cpu(qp, kr, vr, tables, starts, ctx, 0.2, plan=plan, kv=kv)
        torch.testing.assert_close(got, prefill_attention_ref(qp, kr, vr, tables, starts, ctx, 0.2, plan=plan, kv=kv),
                                   rtol=2e-5, atol=2e-6)
        assert calls["prefill attention", "CPU kernel"] == int(takes)
        assert calls["prefill attention", "cascade"] == int(plan is not None)


def test_prefill_kernel_refuses_what_it_does_not_take(lib):
    """Head sizes that are not whole vectors, fp64 caches, fp8 rows and caches not contiguous go to the
    reference; a block id outside the cache, or a context longer than its table, is refused before anything is
    read; a NaN in a query spoils its own head's outputs only."""
    _, kc, vc, tables, ctx = paged_batch([40, 9], d=32, pad=0)
    q = torch.randn(49, 6, 32)
    starts = torch.tensor([0, 40, 49], dtype=torch.int32)
    assert prefill_kernel_takes(q, kc, None)
    assert not prefill_kernel_takes(torch.randn(49, 6, 40), torch.randn(8, 16, 2, 40), None)
    assert not prefill_kernel_takes(q, kc.double(), None)
    assert not prefill_kernel_takes(q, kc.transpose(1, 2), None)
    fp8 = KVLayout.resolve("fp8", "fp8", 32, torch.float32, torch.device("cuda"))
    assert not prefill_kernel_takes(q, fp8.encode(0, kc), fp8)
    bad = tables.clone()
    bad[1, 0] = kc.shape[0]
    with pytest.raises(IndexError, match="outside its block table or the cache"):
        prefill_attention_cpu(q, kc, vc, bad, starts, ctx, 0.2)
    with pytest.raises(IndexError, match="outside its block table or the cache"):  # more positions than its table
        prefill_attention_cpu(q, kc, vc, tables, starts, torch.tensor([40, tables.shape[1] * 16 + 1]), 0.2)
    q[:, 0, 0] = float("nan")  # a query the reference would attend with turns every output of its head to NaN
    got = prefill_attention_cpu(q, kc, vc, tables, starts, ctx, 0.2)
    assert got[:, 0].isnan().all() and not got[:, 1:].isnan().any()


@pytest.fixture
def hf_outputs(llama_dir):
    """transformers' greedy tokens for prompts of spread lengths, two sharing a 120-token prefix."""
    shared = list(range(3, 123))
    prompts = [shared + [50, 51], shared + [60, 61, 62], list(range(5, 205)), [7, 8, 9], list(range(100, 133))]
    return prompts, hf_greedy(llama_dir, prompts, 10)


def test_the_engine_batch_through_the_kernel_is_transformers_greedy(llama_dir, hf_outputs, monkeypatch):
    """An engine on CPU binds the operators at start for its eager forward (its own build of the kernels);
    decode steps of 5 rows, two sharing a prefix as a cascade, the others through the kernel: every token is
    transformers'."""
    from tieredkv.engine.engine_core import EngineCore
    from tieredkv.kernels import decode_attention as da

    cascades, real = [], da.plan_cascades
    monkeypatch.setattr(da, "plan_cascades", lambda *a, **k: cascades.append(1) or real(*a, **k))
    prompts, want = hf_outputs
    core = EngineCore(make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0, compile_decode=False))
    try:
        assert core.runner.ops.decode_attention is decode_attention_cpu
        assert paged_decode_usable(torch.zeros(1, 4, 16), core.runner.kv_cache[0, 0])
        assert run_to_end(core, prompts, [10] * len(prompts)) == want
        assert cascades  # the shared prefix was attended as a cascade, the other rows by the kernel
        check_pool_clean(core)
    finally:
        core.close()
