"""The full-precision dense-weight formats (kernels/dense.py): on CPU in fp32 (and bf16 where the processor has bf16
units) oneDNN's packed copy or the plain weight's swapped MKL / oneDNN products, F.linear elsewhere, each matching
F.linear in and out of a graph; the compiled graph's reading of packed weights through handles; the one choice of
layout (choose_layout) and the measurement behind it."""

import gc
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tieredkv.engine.engine_core import EngineCore
from helpers import hf_greedy, make_config, run_to_end
from tieredkv.kernels import dense, linear, quant_cpu
from tieredkv.kernels.dense import PLAIN, DenseLayout, PackedWeight, PlainWeight, choose_layout
from tieredkv.kernels.linear import (
    SWAP_MAX_OUT,
    SWAP_MAX_ROWS,
    dense_by_handle,
    graph_reads_packed,
    onednn_linear,
    onednn_linear_usable,
    pack_onednn_weight,
    packed_handle,
)
from tieredkv.models.llama import Projection
from tieredkv.platform.malloc_tuning import PAGE, collapse_into_huge_pages, huge_page_stretches

CPU = torch.device("cpu")


def check_against_f_linear(make, rows, out_features, with_bias, seed=0):
    """make(w): w [out_features, 96] in a format; its eager and graph products match F.linear."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(out_features, 96, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    with torch.inference_mode():
        fw = make(w)
        assert (fw.out_features, fw.in_features) == (out_features, 96) and fw.nbytes >= w.numel() * 4
        for fn in (fw.forward, fw.graph_forward):
            got = fn(x, b)
            assert got.shape == (rows, out_features) and got.is_contiguous()
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
            # a strided view and a 3-d input, as the model may hand them over
            xt = torch.randn(96, rows, generator=g).t()
            torch.testing.assert_close(fn(xt, b), F.linear(xt, w, b), rtol=1e-5, atol=1e-4)
            x3 = x.view(1, rows, 96)
            torch.testing.assert_close(fn(x3, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)


# row counts on both sides of the swapped product's limit, output widths on both sides of the LM-head limit
CASES = [(1, 160), (3, 160), (SWAP_MAX_ROWS, 160), (SWAP_MAX_ROWS + 1, 160), (5, SWAP_MAX_OUT + 1)]


@pytest.mark.parametrize("rows, out_features", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("use_onednn", [False, True])
def test_plain_weights_cpu_products_match_f_linear(rows, out_features, with_bias, use_onednn):
    if use_onednn and not onednn_linear_usable():
        pytest.skip("this torch build has no usable oneDNN linear")
    fmt = lambda w: PlainWeight(w, cpu=True, onednn=use_onednn)  # noqa: E731
    assert fmt(torch.zeros(3, 2)).label == "float32"
    check_against_f_linear(fmt, rows, out_features, with_bias, seed=rows)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_onednn_linear_matches_f_linear():
    assert onednn_linear_usable()  # x86 and aarch64 builds of torch carry oneDNN
    w, x, b = torch.randn(160, 96), torch.randn(7, 96), torch.randn(160)
    torch.testing.assert_close(onednn_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows, out_features", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("graph_reads", ["handle", "plain"])
def test_packed_weights_match_f_linear(rows, out_features, with_bias, graph_reads):
    fmt = lambda w: PackedWeight(w, keep_plain=graph_reads == "plain", handle=graph_reads == "handle")  # noqa: E731
    packed = fmt(torch.randn(out_features, 96))
    assert packed.packed.is_mkldnn and packed.packed.shape == (out_features, 96) and packed.label == "float32 packed"
    assert (packed.plain is None) == (graph_reads == "handle") and (packed.handle is None) == (graph_reads == "plain")
    check_against_f_linear(fmt, rows, out_features, with_bias, seed=rows)
    with pytest.raises(RuntimeError, match="cannot serve in a graph"):
        PackedWeight(torch.randn(8, 16)).graph_forward(torch.randn(1, 16))


@pytest.mark.parametrize("bf16_units", [False, True], ids=["avx2", "avx512_bf16"])
def test_the_layout_is_chosen_once_cpu_products_for_fp32_and_bf16_with_bf16_units_else_f_linear(monkeypatch,
                                                                                               bf16_units):
    monkeypatch.setattr(linear, "bf16_units", lambda: bf16_units)
    monkeypatch.setattr(dense, "bf16_units", lambda: bf16_units)
    usable = onednn_linear_usable()
    packed = DenseLayout(cpu=True, onednn=True, packed=True) if usable else DenseLayout(cpu=True)
    assert choose_layout(CPU, torch.float32) == packed
    widen = DenseLayout(widen=True)  # 16-bit weights without 16-bit products: widened for many rows
    assert choose_layout(CPU, torch.bfloat16) == (packed if bf16_units and onednn_linear_usable(torch.bfloat16)
                                                  else widen)
    assert choose_layout(CPU, torch.float16) == widen
    for device, dtype, cpu_linear in [(torch.device("cuda"), torch.float32, "auto"), (torch.device("cuda"),
                                      torch.bfloat16, "auto"), (CPU, torch.float32, "torch"),
                                      (CPU, torch.bfloat16, "torch")]:
        assert choose_layout(device, dtype, cpu_linear) == PLAIN
    assert PLAIN.label == "F.linear" and isinstance(PLAIN.hold(torch.zeros(2, 3)), PlainWeight)
    assert isinstance(packed.hold(torch.zeros(8, 16)), PackedWeight if usable else PlainWeight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_widened_16_bit_weight_multiplies_many_rows_in_fp32_tiles(dtype, monkeypatch):
    """A 16-bit weight held for widening (no 16-bit products on the processor): fewer than WIDEN_MIN_ROWS rows
    through F.linear in its dtype, more widened to fp32 a tile at a time (here tiles of 16 rows over 37: two
    whole, a ragged one), the result in the activations' dtype, as F.linear's within that dtype's rounding; its
    arithmetic says so."""
    monkeypatch.setattr(dense, "WIDEN_TILE_BYTES", 16 * 64 * 4)
    g = torch.Generator().manual_seed(3)
    w, b = (torch.randn(37, 64, generator=g) * 0.1).to(dtype), torch.randn(37, generator=g).to(dtype)
    held = DenseLayout(widen=True).hold(w)
    assert held.arithmetic == f"{str(dtype)[6:]} to 3 rows, float32 above (widened)"
    for rows in (1, dense.WIDEN_MIN_ROWS, 19):
        x = torch.randn(2, rows, 64, generator=g).to(dtype)
        got = held(x, b)
        want = F.linear(x.float(), w.float(), b.float())
        assert got.dtype == dtype and got.shape == (2, rows, 37)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)
        if rows >= dense.WIDEN_MIN_ROWS:  # the fp32 product, rounded once
            assert torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("graph_packed", [False, True])
@pytest.mark.parametrize("cpu_linear", ["auto", "packed"])
def test_with_the_compiled_path_the_layout_follows_the_measurement(monkeypatch, graph_packed, cpu_linear):
    if not onednn_linear_usable():
        pytest.skip("this torch build has no usable oneDNN linear")
    asked = []
    monkeypatch.setattr(dense, "graph_reads_packed", lambda *a: asked.append(a) or graph_packed)
    got = choose_layout(CPU, torch.float32, cpu_linear, compiled=True, shapes=[(8, 16)])
    assert len(asked) == 1
    if graph_packed:
        assert got == DenseLayout(cpu=True, onednn=True, packed=True, handles=True)
    elif cpu_linear == "packed":
        assert got == DenseLayout(cpu=True, onednn=True, packed=True, keep_plain=True)
    else:
        assert got == DenseLayout(cpu=True, onednn=True)
    assert choose_layout(CPU, torch.float32, cpu_linear, compiled=True, shapes=[]).handles is False  # quantized
    # where the native step would take fp32 weights (a build that multiplies several fp32 rows), packed without
    # measuring: the layout it reads, with handles for the graph should the step not take the model after all
    for f32_rows in (False, True):
        monkeypatch.setattr(quant_cpu.CPU, "f32_rows", f32_rows)
        asked.clear()
        native = choose_layout(CPU, torch.float32, cpu_linear, compiled=True, shapes=[(8, 16)], native=True)
        assert native == (DenseLayout(cpu=True, onednn=True, packed=True, handles=True) if f32_rows else got)
        assert len(asked) == (0 if f32_rows else 1)


@pytest.mark.skipif(not onednn_linear_usable(torch.bfloat16), reason="this torch build has no usable oneDNN bf16")
@pytest.mark.parametrize("rows", [1, 5, SWAP_MAX_ROWS + 1])
def test_bf16_weights_packed_and_plain_match_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((rows, 96), (160, 96), (160,)))
    # packed, and plain (the compiled path's where plain reads faster)
    for weight in (PackedWeight(w, handle=True), PlainWeight(w, cpu=True, onednn=True)):
        got = weight.forward(x, b)
        assert got.dtype == torch.bfloat16 and weight.label.startswith("bfloat16")
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=5e-2)


def test_a_packed_weights_handle_serves_in_and_out_of_a_compiled_graph():
    """dense_by_handle reads the packed weight its handle stands for, eager and inside an inductor graph
    (where the packed tensor itself cannot go), and the handle's entry goes when the handle does."""
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(160, 96, generator=g), torch.randn(40, 160, generator=g)]
    handles = [packed_handle(pack_onednn_weight(w)) for w in ws]
    assert [quant_cpu.handle_outputs(h) for h in handles] == [160, 40]
    b = torch.randn(40, generator=g)

    def two_layers(x, h1, h2, bias):
        return dense_by_handle(torch.relu(dense_by_handle(x, h1)), h2, bias) * 2

    want = lambda x: F.linear(torch.relu(F.linear(x, ws[0])), ws[1], b) * 2  # noqa: E731
    graph = torch.compile(two_layers, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for rows in (1, 3, 7):
            x = torch.randn(rows, 96, generator=g)
            torch.testing.assert_close(two_layers(x, *handles, b), want(x), rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(graph(x, *handles, b), want(x), rtol=1e-5, atol=1e-4)
    unread = pack_onednn_weight(ws[0])
    unread.row_layout = None  # a layout the one-row kernels do not read: the handle is a small tensor of its own
    small = packed_handle(unread)
    assert small.shape == (160, 1) and small.dtype == torch.uint8
    torch.testing.assert_close(dense_by_handle(x, small), F.linear(x, ws[0]), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="not a packed weight's handle"):
        dense_by_handle(torch.randn(1, 96), small.clone())
    keys = [h.data_ptr() for h in handles]
    assert all(k in linear._HANDLES for k in keys)
    del handles, graph
    gc.collect()
    assert not any(k in linear._HANDLES for k in keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(960, 576), (100, 161), (7, 33), (4097, 64)])
def test_one_row_kernels_read_onednns_packed_weights_where_they_lie(lib, dtype, shape):
    """A batch-1 product on a packed weight runs quant_cpu.c's one-row kernel straight on oneDNN's buffer where
    its layout is one the kernel reads (checked weight by weight against the unpacked weight): here on every
    shape the default model has, outputs that are not whole blocks, inputs oneDNN pads; equal to F.linear
    within float rounding (bf16: the rounding of one bf16 result), bias or not, and to oneDNN's own product;
    on each build of the kernels (conftest: this processor's, AVX2, plain C), and bit for bit the same on 1 to 3
    threads."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w, x, b = (torch.randn(n, k, generator=g) * 0.1).to(dtype), torch.randn(1, k, generator=g).to(dtype), \
        torch.randn(n, generator=g).to(dtype)
    if dtype == torch.bfloat16 and not linear.bf16_units():  # (oneDNN's bf16 packing refuses AVX2-only processors)
        pytest.skip("bf16 weights are packed only where the processor has bf16 units")
    packed = pack_onednn_weight(w)
    layout = linear.packed_row_layout(packed)
    assert layout is not None, "oneDNN chose a layout the one-row kernels do not read on this processor"
    for bias in (None, b):
        got = linear.one_row_or_onednn(x, packed, layout, bias)
        before = torch.get_num_threads()
        try:
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(linear.one_row_or_onednn(x, packed, layout, bias), got)
        finally:
            torch.set_num_threads(before)
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert got.dtype == dtype and got.shape == (1, n)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=2e-2)
        torch.testing.assert_close(got.float(), want, **tol)
        torch.testing.assert_close(got.float(), onednn_linear(x, packed, bias).float(), **tol)
    # a layout the kernels are not given (another processor's) leaves the product to oneDNN: the same result
    torch.testing.assert_close(linear.one_row_or_onednn(x, packed, None, b), onednn_linear(x, packed, b))
    with pytest.raises(RuntimeError):  # a row of the wrong width is oneDNN's error, never read past its end
        linear.one_row_or_onednn(torch.randn(1, k + 8).to(dtype), packed, layout, None)
    # two weights of one shape are held alike: equal reprs (part of the compiled graph's layer signature, which
    # decides which layers share a graph), whatever their buffers' addresses
    a, b = PackedWeight(w), PackedWeight(w.clone())
    assert a.row_layout[:2] == b.row_layout[:2] and a.row_layout[2] != b.row_layout[2]
    assert a.extra_repr() == b.extra_repr() and f"{layout[0]} x {layout[1]}" in a.extra_repr()


@pytest.mark.parametrize("shape", [(960, 576), (100, 161), (7, 33), (4097, 64)])
def test_a_few_fp32_rows_on_a_packed_weight_are_each_the_one_row_kernels_bits(lib, shape):
    """A batched step's or a verification's few fp32 rows on a packed weight: on a build with AVX-512 through the
    kernel of several rows, each row the same bits as the one-row kernel gives it alone (so a speculative step's
    verification rows are plain decoding's), every count of rows to FEW_PACKED_ROWS (groups of six and every
    remainder), bias or not; on the other builds oneDNN's product. Both equal F.linear within float rounding;
    past FEW_PACKED_ROWS, oneDNN's product."""
    n, k = shape
    g = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)
    x = torch.randn(linear.FEW_PACKED_ROWS + 3, k, generator=g)
    packed = pack_onednn_weight(w)
    layout = linear.packed_row_layout(packed)
    assert layout is not None
    native = quant_cpu.CPU.f32_rows
    for bias in (None, b):
        alone = torch.cat([linear.one_row_or_onednn(x[i : i + 1], packed, layout, bias) for i in range(len(x))])
        for rows in range(2, linear.FEW_PACKED_ROWS + 1):
            got = linear.one_row_or_onednn(x[:rows], packed, layout, bias)
            if native:
                assert torch.equal(got, alone[:rows]), (rows, bias is None)
            else:
                assert torch.equal(got, onednn_linear(x[:rows], packed, bias))
            torch.testing.assert_close(got, F.linear(x[:rows], w, bias), rtol=1e-5, atol=1e-5)
        many = linear.one_row_or_onednn(x, packed, layout, bias)
        assert torch.equal(many, onednn_linear(x, packed, bias))
    # leading dimensions come back in their own shape; no rows, no outputs
    assert linear.one_row_or_onednn(x[:6].view(2, 3, k), packed, layout, b).shape == (2, 3, n)
    assert linear.one_row_or_onednn(x[:0], packed, layout, b).shape == (0, n)


@pytest.mark.parametrize("shape", [(960, 576), (100, 161), (7, 33)])
def test_the_native_steps_packed_fp32_weight_is_the_one_row_kernels_product(lib, shape):
    """A packed fp32 weight as the native decode step reads it (cpu_kernels.h TKV_F32P): rows prepared and multiplied
    through the step's interface (tkv_rows_prepare / tkv_rows_share, here outside a parallel region, into rows
    `ostride` apart) are each the one-row kernel's bits, bias or not; its rows read back are the weight's rows."""
    import ctypes

    from tieredkv.kernels.dense import PackedWeight
    from tieredkv.runner.native_decode import _Weight

    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)
    x = torch.randn(7, k, generator=g)
    weight = PackedWeight(w)
    block, stored, address = weight.row_layout
    lib = quant_cpu.CPU.lib
    for bias in (None, b):
        qw = _Weight(4, address, None, None, block, n, k, None if bias is None else bias.data_ptr(), stored)
        assert lib.tkv_row_fits(ctypes.byref(qw)) == 1
        prep = torch.empty(lib.tkv_rows_bytes(ctypes.byref(qw), len(x)), dtype=torch.uint8)
        lib.tkv_rows_prepare(ctypes.byref(qw), x.data_ptr(), len(x), prep.data_ptr())
        out = torch.full((len(x), n + 5), float("nan"))
        lib.tkv_rows_share(ctypes.byref(qw), prep.data_ptr(), len(x), n + 5, out.data_ptr())
        alone = torch.cat([linear.one_row_or_onednn(x[i : i + 1], weight.packed, weight.row_layout, bias)
                           for i in range(len(x))])
        assert torch.equal(out[:, :n], alone) and out[:, n:].isnan().all()
    rows = torch.empty(3, k)
    ids = torch.tensor([0, n - 1, n // 2])
    lib.tkv_row_dequantize(ctypes.byref(qw), ids.data_ptr(), 3, rows.data_ptr())
    assert torch.equal(rows, w[ids])
    qw.kp = k - 1  # fewer inputs stored than the weight has: not taken
    assert lib.tkv_row_fits(ctypes.byref(qw)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_buffers_handle_takes_one_row_through_the_cpp_operator(lib, dtype):
    """Where the one-row kernels read the packed layout and its blocks cover the outputs, the handle is the
    packed buffer itself ([blocks, rows, B] in the weight's dtype) and one row goes through
    tieredkv::packed_gemv, bit for bit the Python operator's result (the same kernel); the handle's copy is a
    copy of the weight's bytes and gives the same; a weight whose outputs are not whole blocks keeps the small
    handle; bad input is an error, not a read past a buffer."""
    if dtype == torch.bfloat16 and not linear.bf16_units():
        pytest.skip("bf16 weights are packed only where the processor has bf16 units")
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(960, 576, generator=g) * 0.1).to(dtype)
    b = torch.randn(960, generator=g)
    packed = linear.with_row_layout(pack_onednn_weight(w))
    handle = packed_handle(packed)
    assert handle.dim() == 3 and handle.dtype == dtype and quant_cpu.handle_outputs(handle) == 960
    assert handle.data_ptr() == torch.ops.mkldnn.data_ptr(packed)
    real = torch.ops.tieredkv.dense_packed.default
    x = torch.randn(1, 576, generator=g).to(dtype)
    for bias in (None, b):
        got = dense_by_handle(x, handle, bias)
        assert torch.equal(got, real(x, handle, bias)) and got.dtype == dtype and got.shape == (1, 960)
        assert torch.equal(dense_by_handle(x, handle.clone(), bias), got)
        want = F.linear(x.float(), w.float(), bias)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=2e-2)
        torch.testing.assert_close(got.float(), want, **tol)
    op = torch.ops.tieredkv.packed_gemv.default
    assert torch.equal(op(x, handle, None), dense_by_handle(x, handle))
    two = torch.randn(2, 576, generator=g).to(dtype)  # more rows: the Python operator (oneDNN) serves them
    torch.testing.assert_close(dense_by_handle(two, handle).float(), F.linear(two.float(), w.float()), **tol)
    with pytest.raises(RuntimeError, match="one row"):
        op(two, handle, None)
    with pytest.raises(RuntimeError, match="inputs for a weight"):
        op(torch.randn(1, 2000).to(dtype), handle, None)
    with pytest.raises(RuntimeError, match="a bias of 960"):
        op(x, handle, torch.randn(5))
    with pytest.raises(RuntimeError, match="alike"):
        op(x.to(torch.float16), handle, None)
    small = packed_handle(linear.with_row_layout(pack_onednn_weight(torch.randn(100, 161).to(dtype))))
    assert small.shape == (100, 1) and small.dtype == torch.uint8


def test_the_graphs_layout_is_measured_once_per_processor_and_kept(tmp_path, monkeypatch):
    calls = []

    def measure(dtype, shapes):
        calls.append((dtype, shapes))
        return {"plain_ms": 2.0, "packed_ms": 1.0 if dtype == torch.bfloat16 else 3.0}

    monkeypatch.setattr(linear, "_measure_layouts", measure)
    shapes = [(160, 96), (96, 160)]
    assert graph_reads_packed(torch.bfloat16, shapes, tmp_path) is True
    assert graph_reads_packed(torch.float32, shapes, tmp_path) is False
    assert graph_reads_packed(torch.bfloat16, shapes, tmp_path) is True
    assert graph_reads_packed(torch.float32, shapes[::-1], tmp_path) is False
    assert len(calls) == 2  # the second asks of each were answered from kernels/linear-layout.json
    assert len(json.loads((tmp_path / "kernels" / "linear-layout.json").read_text())) == 2
    (tmp_path / "kernels" / "linear-layout.json").write_text("{not json")
    assert graph_reads_packed(torch.float32, shapes, tmp_path) is False and len(calls) == 3  # measured again


@pytest.mark.parametrize("plain_ms, packed", [(0.80, False), (0.84, False), (0.86, True), (0.95, True), (1.2, True)])
def test_plain_weights_only_where_their_one_row_products_are_clearly_faster(tmp_path, monkeypatch, plain_ms, packed):
    # packed weights also serve the batched steps faster: a plain layout 5-10% ahead at one row does not pay
    monkeypatch.setattr(linear, "_measure_layouts", lambda dtype, shapes: {"plain_ms": plain_ms, "packed_ms": 1.0})
    assert graph_reads_packed(torch.float32, [(64, 32)], tmp_path) is packed


def test_huge_page_stretches_are_the_2mb_spans_the_buffers_cover_whole():
    mb2, page = 2 << 20, PAGE
    base = 100 * mb2
    # three buffers one after another (each 64 bytes past a header), the third ending half way into a 2 MB span;
    # then, past a gap, one that covers no 2 MB span whole
    ranges = [(base + 64, mb2 - 64 - page), (base + mb2 + 64, 3 * mb2), (base + 4 * mb2 + page + 64, mb2 // 2),
              (base + 10 * mb2 + 64, mb2 - 2 * page)]
    assert huge_page_stretches(ranges) == [(base, 4 * mb2)]
    assert huge_page_stretches(ranges[1:2]) == [(base + mb2, 3 * mb2)]
    assert huge_page_stretches([(base + 3 * page, mb2 - 4 * page)]) == [] and huge_page_stretches([]) == []
    assert huge_page_stretches([(base + mb2 + 64, mb2), (base + 64, mb2)]) == [(base, 2 * mb2)]  # any order


def test_collapsing_a_packed_weight_into_huge_pages_keeps_it_as_it_was():
    w = torch.randn(2048, 768)
    packed = pack_onednn_weight(w)
    x = torch.randn(3, 768)
    before = onednn_linear(x, packed)
    moved = collapse_into_huge_pages([linear.packed_range(packed)])
    stretch = sum(n for _, n in huge_page_stretches([linear.packed_range(packed)]))
    assert moved in (0, stretch)  # 0 where the kernel cannot (huge pages off, Linux before 6.1)
    assert torch.equal(packed.to_dense(), w) and torch.equal(onednn_linear(x, packed), before)


def test_the_measurement_times_both_layouts_on_weights_past_the_cache():
    got = linear._measure_layouts(torch.float32, [(64, 32), (32, 64)])
    assert set(got) == {"plain_ms", "packed_ms"} and all(v > 0 for v in got.values())


@pytest.mark.parametrize("force", ["auto", "packed", "torch"])
@pytest.mark.parametrize("compiled, graph_packed", [(False, None), (True, False), (True, True)],
                         ids=["eager", "compiled-plain", "compiled-packed"])
def test_engine_holds_the_weights_once_packed_or_plain_and_the_embedding_plain(llama_dir, monkeypatch, force,
                                                                                 compiled, graph_packed):
    """"auto" holds the weights once: packed where only the eager forward reads them; with the compiled decode
    path plain where its one-row products read plain weights faster on this processor (the eager forward then
    reads them plain too), else packed, the graph reading them through handles. "packed" keeps a packed copy
    beside the plain weights a plain-reading compiled path reads. Every dense layer holds one format object."""
    import tieredkv.engine.rank_build as setup

    monkeypatch.setattr(dense, "graph_reads_packed", lambda dtype, shapes, cache_dir: graph_packed)
    collapsed = []
    monkeypatch.setattr(setup, "collapse_into_huge_pages", lambda ranges: collapsed.append(sorted(ranges)) or 0)
    core = EngineCore(make_config(model=str(llama_dir), num_blocks=16, compile_decode=compiled, cpu_linear=force,
                                  native_decode=False))  # (the native step's layout: the test above)
    for thread in threading.enumerate():
        if thread.name == "tieredkv-huge-pages":
            thread.join()
    model = core.model
    usable = force != "torch" and onednn_linear_usable()
    packed = usable and (force == "packed" or not compiled or graph_packed)
    plain_beside = packed and compiled and not graph_packed
    dense_layers = [m for m in model.modules() if isinstance(m, Projection)]
    assert len(dense_layers) == 4 * model.spec.num_layers + 1 and model.lm_head in dense_layers
    assert all(m.weight is None for m in dense_layers)  # the loaded weight went into the format
    formats = [m.format for m in dense_layers]
    assert all(isinstance(f, PackedWeight if packed else PlainWeight) for f in formats)
    assert all((f.handle is not None) == (usable and bool(graph_packed)) for f in formats if packed)
    assert all((f.plain is not None) == plain_beside for f in formats if packed)
    assert all(f.cpu == usable for f in formats if not packed)
    assert set(core.stats().dense_formats.values()) == {"float32 packed" if packed else "float32"}
    assert not model.embed_tokens.weight.is_mkldnn
    if model.spec.tie_word_embeddings and not packed:  # the tied head is the table itself, counted once
        assert model.lm_head.format.weight is model.embed_tokens.weight
    params = {t.data_ptr(): t.numel() * 4 for t in model.parameters()}
    extra = sum(f.nbytes for f in formats if packed)  # the packed copies are memory of their own
    assert model.weight_bytes() == sum(params.values()) + extra - sum(
        f.plain.numel() * 4 for f in formats if packed and f.plain is not None and f.plain.data_ptr() in params)
    if compiled and usable and graph_packed:  # the graph reads the packed weights through their handles
        assert quant_cpu.handle_outputs(model.lm_head.format.handle) == model.spec.vocab_size
        prompt = list(range(5, 14))
        assert run_to_end(core, [prompt], [8]) == hf_greedy(llama_dir, [prompt], 8)
        assert core.runner.compiled.steps == 7
    if packed:  # each packed weight carries its one-row layout (None where oneDNN chose one the kernels lack)
        weights = [f.packed for f in formats]
        assert collapsed == [sorted(linear.packed_range(w) for w in weights)]  # all asked into huge pages, once
        layouts = [f.row_layout for f in formats]
        assert all(lay is None or lay[2] == torch.ops.mkldnn.data_ptr(w) for lay, w in zip(layouts, weights))
        if not compiled and any(layouts):  # eager batch-1 steps run the one-row kernels, tokens unchanged
            calls = []
            real = linear.packed_product
            monkeypatch.setattr(linear, "packed_product", lambda *a: calls.append(1) or real(*a))
            prompt = list(range(5, 14))
            assert run_to_end(core, [prompt], [6]) == hf_greedy(llama_dir, [prompt], 6)
            assert len(calls) >= 5 * sum(lay is not None for lay in layouts)  # the 5 steps after the prefill
    else:
        assert collapsed == []
    # nothing is left on the checkpoint's mapping: its pages would stay resident beside the model's copies
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(core.model_dir) not in maps.read_text()


def test_bad_cpu_linear_value_is_refused():
    import pydantic

    with pytest.raises(ValueError, match="cpu_linear"):
        choose_layout(CPU, torch.float32, "blas")
    with pytest.raises(pydantic.ValidationError, match="cpu_linear"):
        make_config(cpu_linear="blas")
