"""Quantized weights: the CPU kernels against the dequantized reference (on this processor's build and on a
build without AVX2), the quantizers' error bounds, GGUF's blocks read as they are, the engine end to end."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import check_pool_clean, drive, make_config, run_to_end
from tieredkv import SamplingParams
from tieredkv.engine.engine_core import EngineCore
from tieredkv.errors import CheckpointError
from tieredkv.kernels import quant
from tieredkv.kernels.quant_cpu import CPU
from tieredkv.models import gguf_blocks
from tieredkv.models.llama import Projection
from tieredkv.platform.cpu_features import cpu_info


def weights(fmt: str, n: int, k: int, seed: int = 0) -> quant.QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, :3] = 0.4  # an outlier row segment, as real weights have
    return {"int8": lambda: quant.quantize_int8(w), "int4-g32": lambda: quant.quantize_int4(w, 32),
            "int4-g128": lambda: quant.quantize_int4(w, 128), "int4-sym": lambda: quant.quantize_int4(w, 64, True),
            "q8-g32": lambda: quant.QuantizedWeight("q8", *_q8_groups(w, 32), None, 32, k, "test"),
            **{f"gguf-{t}": (lambda t=t: gguf_tensor(t, n, k, seed)) for t in K_BLOCKS}}[fmt]()


# inputs, bytes per block; where each fp16 block scale (and min) lies and a plausible size for it
K_BLOCKS = {"Q4_K": (256, 144, {0: 0.002, 2: 0.0007}), "Q6_K": (256, 210, {208: 0.0005}),
            "Q5_0": (32, 22, {0: 0.004}), "Q5_1": (32, 24, {0: 0.004, 2: -0.06}), "IQ4_NL": (32, 18, {0: 0.0005}),
            "Q2_K": (256, 84, {80: 0.003, 82: 0.001}), "Q3_K": (256, 110, {108: 0.0008}),
            "Q5_K": (256, 176, {0: 0.001, 2: 0.0005}), "Q8_0": (32, 34, {0: 0.0004})}


def k_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a GGUF type (gguf's Python package dequantizes these types but does not quantize
    the K-quants): every code and 6-bit scale random, the fp16 block scales set to plausible sizes."""
    per, nbytes, scales = K_BLOCKS[type_name]
    raw = np.random.default_rng(seed).integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    for at, value in scales.items():
        raw[..., at : at + 2] = np.array([value], np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def gguf_tensor(type_name: str, n: int, k: int, seed: int = 0):
    return gguf_blocks.load_gguf_tensor(k_blocks(type_name, n, k, seed), type_name, (n, k), "blk.0.ffn_down.weight")


def _q8_groups(w, g):
    d = (w.view(w.shape[0], -1, g).abs().amax(-1) / 127).half()
    q = torch.round(w.view(w.shape[0], -1, g) / d.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(w.shape), d


# one of each layout the kernels take: q8 per row, in groups of 32 and 16, with offsets in groups of 32 (Q5_K)
# and 16 (Q2_K); q4 in groups of 32 to 128, asymmetric and symmetric
FORMATS = ["int8", "int4-g32", "int4-g128", "int4-sym", "q8-g32", "gguf-Q4_K", "gguf-Q6_K", "gguf-Q5_0", "gguf-Q5_K",
           "gguf-Q2_K"]
K_QUANTS = ("gguf-Q4_K", "gguf-Q6_K", "gguf-Q5_K", "gguf-Q2_K")


def int8_block_bound(x: torch.Tensor, w: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """What activations rounded to int8 in blocks of 32 (scale max|x| / 127 of the block) may move each output:
    half a step of each block times the block's sum of |w|, plus fp32 rounding."""
    rows, k = x.shape
    step = x.view(rows, k // 32, 32).abs().amax(-1) / 127  # [rows, blocks]
    wsum = w.abs().view(w.shape[0], k // 32, 32).sum(-1)  # [n, blocks]
    return 0.5 * step @ wsum.T + 1e-4 * want.abs() + 1e-4


def int8_blocks_on(lib: str) -> str:
    """What the `lib` build of the kernels multiplies many rows on with int8 blocks (CPU.int8_gemm): 512-bit VNNI
    where the native build has it, AVX2 in the native build of any other x86 processor with AVX2 and in the
    -march=haswell one, nothing without AVX2."""
    if lib == "no-avx2" or not cpu_info().has("avx2"):
        return ""
    vnni = lib == "native" and cpu_info().has("avx512_vnni") and cpu_info().has("avx512bw")
    return "AVX-512 VNNI" if vnni else "AVX2"


def check_against_reference(qw, rows: int, seed: int = 1) -> None:
    """quant_linear on `rows` activation rows (one outlier channel) against F.linear on the dequantized weight."""
    n, k = qw.codes.shape[0], qw.in_features
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[:, 5] = 40.0  # an outlier activation channel
    bias = torch.randn(n)
    w = qw.dequantize()
    want = F.linear(x, w, bias)
    got = quant.quant_linear(x, qw, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    if rows > quant.kernel_rows(qw.codes) and quant.many_rows_int8(qw.codes, qw.group_size):
        bound = int8_block_bound(x, w, want)  # more rows on q4: int8 activation blocks (gemm_cpu.c)
    else:  # the kernels quantize each activation row to int16: error <= half a step times sum |w|, per output
        step = x.abs().amax(dim=1, keepdim=True) / 32767
        bound = 0.5 * step * w.abs().sum(dim=1)[None, :] + 1e-4 * want.abs() + 1e-5
    assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())


# 320 inputs: groups of 32 past the last eight, for the formats whose groups divide it (the K-quants' 256 do not)
@pytest.mark.parametrize("fmt, k", [(f, k) for f in FORMATS
                                    for k in ((256, 320) if f not in ("int4-g128", *K_QUANTS) else (256,))])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 19, "past the kernels"])
def test_kernel_matches_dequantized_reference(lib, fmt, k, rows):
    n = 37  # 37 output rows: a block of 4 with a ragged tail
    qw = weights(fmt, n, k)
    if rows == "past the kernels":  # dequantized into the fp32 product
        rows = quant.kernel_rows(qw.codes) + 3
    check_against_reference(qw, rows)
    # leading dimensions and bf16 activations come back in their own shape and dtype
    got3 = quant.quant_linear(torch.randn(1, rows, k).bfloat16(), qw)
    assert got3.shape == (1, rows, n) and got3.dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", [*FORMATS, "gguf-Q5_1"])
def test_a_row_is_the_same_bits_alone_or_among_others(lib, fmt):
    """The one-row kernels and the blocks of several rows take each row's sums in one order (quant_cpu.c: q4_row,
    q8_row, row_out): a decode step's row is the same bits alone or batched, and a speculative step's verification
    rows the same as decoding them one at a time (greedy output must not change). Every format, groups past the
    last eight (320 inputs), with and without a bias, on this processor's build and the plain C one."""
    k = 256 if fmt in ("int4-g128", *K_QUANTS) else 320
    qw = weights(fmt, 37, k)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2)) * 3
    for bias in (None, torch.randn(37)):
        alone = torch.cat([quant.quant_linear(x[i : i + 1], qw, bias) for i in range(6)])
        for rows in (2, 3, 5, 6):
            assert torch.equal(quant.quant_linear(x[:rows], qw, bias), alone[:rows]), (rows, bias is None)


MODEL_512 = Path(__file__).with_name("avx512_model")


def c_function(source: str, name: str) -> str:
    """The text of C function `name` in `source` (its definition line to its closing brace)."""
    import re

    start = re.search(rf"^(INLINE|static)[^\n]*\b{name}\(", source, re.M)
    assert start is not None, f"{name} is not defined in quant_cpu.c"
    depth = 0
    for at in range(source.index("{", start.start()), len(source)):
        depth += {"{": 1, "}": -1}.get(source[at], 0)
        if depth == 0:
            return source[start.start() : at + 1]
    raise AssertionError(f"{name}: no closing brace")


def c_typedef(source: str, name: str) -> str:
    """The text of the C `typedef struct { ... } name;` in `source`."""
    import re

    found = re.search(rf"^typedef struct \{{[^}}]*\}} {name};", source, re.M)
    assert found is not None, f"{name} is not a typedef of the source"
    return found.group(0)


def run_on_the_model(tmp_path, pieces: list[str], main: str) -> str:
    """C functions of the kernels (`pieces`, with the macros they need) and a harness (`main`, a file of
    tests/kernels/avx512_model) compiled for AVX2 with the model of the 512-bit intrinsics, run; its output."""
    import subprocess

    from tieredkv.kernels.quant_cpu import compiler
    from tieredkv.platform.cpu_features import cpu_info

    if not cpu_info().has("avx2") or compiler() is None:
        pytest.skip("the model runs the kernels' 256-bit steps as they are: it needs AVX2 and a C compiler")
    harness = tmp_path / "model.c"
    harness.write_text("\n\n".join([f'#include "{MODEL_512 / "emu512.h"}"', "#include <stdio.h>", "#include <stdlib.h>",
                                     *pieces, (MODEL_512 / main).read_text()]))
    built = subprocess.run([compiler(), "-O2", "-mavx2", "-mfma", "-mf16c", "-o", str(tmp_path / "model"),
                            str(harness), "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    ran = subprocess.run([str(tmp_path / "model")], capture_output=True, text=True)
    assert ran.returncode in (0, 1), ran.stderr[-2000:]
    return ran.stdout


def test_the_512_bit_int4_kernels_give_a_row_the_same_bits_alone_or_among_others(tmp_path):
    """The AVX-512 kernels for int4 groups of 32 (q4_row512 for one row, q4_block512 for several) run on a software
    model of their 512-bit intrinsics (tests/kernels/avx512_model: each lane as the instruction defines it), so that
    a processor without AVX-512 checks them too: a row's output is the same bits from either (and near a double sum
    of the same codes) at 256 to 3,072 inputs (chunks of eight groups, and groups past them)."""
    from tieredkv.kernels.quant_cpu import SOURCES

    source = SOURCES[0].read_text()
    names = ["hsum", "q4_nibbles256", "q4_group", "q4_block_rows", "q4_nibbles512", "q4_pair", "halves_sum",
             "q4_out512", "q4_block512", "q4_row512", "pair_order", "quantize_rows"]
    out = run_on_the_model(tmp_path, ["#define INLINE static inline", "#define RB 4", "#define TKV_AVX2 1",
                                      "static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }",
                                      *(c_function(source, n) for n in names)], "main.c")
    assert out.strip().endswith("0 of 175 outputs differ"), out[-2000:]


def test_the_vnni_products_of_many_rows_give_the_avx2_ones_bits(tmp_path, kernel_cache):
    """gemm_cpu.c's VNNI path (panel_rows512: vpdpbusd on 512-bit registers, q8 codes held plus 128 and the
    activation blocks' code sums taken off) gives its AVX2 path's outputs bit for bit: on the model of the 512-bit
    intrinsics everywhere (q4 and q8, row-major and tiled, groups of 32 and 64, offsets or none, 11 rows: the
    kernels' steps of 4 and 8 and their tails), and where this processor has AVX-512 VNNI on its real builds too
    (the native build's products of 5 to 70 rows against the -march=haswell build's)."""
    from tieredkv.kernels.quant_cpu import HEADERS, SOURCES, load, NATIVE

    source = next(s for s in SOURCES if s.name == "gemm_cpu.c").read_text()
    pieces = ["#define INLINE static inline", "#define BLOCK 32", "#define PANEL_ROWS 16",
              "#define PANEL_BLOCK (BLOCK * PANEL_ROWS)", "#define MR512 8", "#define Q8_PANEL_BIAS 128",
              "static inline float tkv_h2f(uint16_t h) { return _cvtsh_ss(h); }",
              c_typedef(HEADERS[0].read_text(), "tkv_int8_rows"), c_typedef(source, "rows512"),
              *(c_function(source, n) for n in ("transpose8", "row_block_codes", "panel_rows", "rows512_bytes",
                                                "rows512_at", "lay_out_rows512", "panel_rows512"))]
    for width, bias in (("256", "0"), ("512", "128")):  # each path's packing, with its q8 codes
        for name in ("pack_rows", "pack_tile"):
            pieces.append(c_function(source, name).replace(f"{name}(", f"{name}_{width}(", 1)
                          .replace("Q8_PANEL_BIAS", bias))
    out = run_on_the_model(tmp_path, pieces, "gemm_main.c")
    assert out.strip().endswith("0 of 14960 outputs differ"), out[-2000:]

    if not (cpu_info().has("avx512_vnni") and cpu_info().has("avx512bw")):
        return  # (the model above is this processor's check)
    builds = {"vnni": load(kernel_cache, NATIVE), "avx2": load(kernel_cache, ("-march=haswell",))}
    before = CPU.lib
    try:
        for fmt in ("int4-g32", "gguf-Q8_0", "int8"):
            qw = weights(fmt, 37, 576)
            x = torch.randn(70, 576, generator=torch.Generator().manual_seed(3)) * 3
            got = {}
            for name, built in builds.items():
                CPU.serve_with(built, kernel_cache, operators=False)
                assert CPU.int8_gemm == {"vnni": "AVX-512 VNNI", "avx2": "AVX2"}[name]
                got[name] = [quant._quant_linear(x[:m], qw.codes, qw.scales, qw.offsets, qw.group_size, None, 1)
                             for m in (5, 33, 70)]
            assert all(torch.equal(a, b) for a, b in zip(got["vnni"], got["avx2"])), fmt
    finally:
        CPU.serve_with(before, kernel_cache)


def test_int8_blocks_serve_many_rows_only_where_measured_clearly_faster(monkeypatch, tmp_path):
    """The choice for many rows on 4-bit weights (quant.int8_many_rows_win) is measured once per processor and
    shapes, kept in the cache directory, and goes to int8 blocks only by a clear margin (they cost accuracy)."""
    layer = [weights("int4-g32", 32, 64), weights("int4-g32", 48, 64)]
    real = quant._measure_many_rows(layer)
    assert set(real) == {"int8_ms", "fp32_ms"} and min(real.values()) > 0
    calls = []
    timings = {"int8_ms": 10.0, "fp32_ms": 10.0 * quant.INT8_MARGIN * 1.01}
    monkeypatch.setattr(quant, "_measure_many_rows", lambda weights: calls.append(1) or dict(timings))
    assert quant.int8_many_rows_win(layer, tmp_path) and quant.int8_many_rows_win(layer, tmp_path)
    assert len(calls) == 1 and (tmp_path / "kernels" / "many-rows.json").exists()  # the second one read the file
    timings["fp32_ms"] = 10.0 * quant.INT8_MARGIN * 0.99  # faster, but not by the margin
    assert not quant.int8_many_rows_win(layer[:1], tmp_path) and len(calls) == 2  # other shapes: measured again


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g128", "int4-sym", "gguf-Q4_K", "int8", "q8-g32", "gguf-Q5_1",
                                 "gguf-Q8_0"])
@pytest.mark.parametrize("tiles", [False, True])
def test_many_rows_on_4bit_weights_are_int8_blocks_times_the_weight(lib, fmt, tiles):
    """Past the one-row kernels' rows, q4 and q8 weights (row-major or in tiles; with offsets or not) multiply on
    int8 (gemm_cpu.c): the activations as int8 blocks of 32 (quant.as_int8_blocks, the reference) times the
    dequantized weight, to fp32's rounding; a short last panel of output rows (37), rows not a multiple of the
    kernel's four, a bias. A build without AVX2 dequantizes into the fp32 product instead: F.linear's result."""
    n = 48 if tiles else 37
    qw = tiled_weights(fmt, n, 512)[1] if tiles else weights(fmt, n, 512)
    w = qw.dequantize().double()
    bias = torch.randn(n)
    for rows in (quant.kernel_rows(qw.codes) + 1, quant.kernel_rows(qw.codes) + 6, 70):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
        x[:, 7] = 30.0  # an outlier channel
        got = quant.quant_linear(x, qw, bias).double()
        assert CPU.int8_gemm == int8_blocks_on(lib)
        assert quant.many_rows_int8(qw.codes, qw.group_size) == bool(CPU.int8_gemm)
        seen = quant.as_int8_blocks(x) if CPU.int8_gemm else x
        want = F.linear(seen.double(), w, bias.double())
        bound = 2e-6 * (seen.double().abs() @ w.abs().T) + 1e-5
        assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())
    bits = "q8" if qw.codes.dtype == torch.int8 else "q4"
    assert (f"int8 blocks x {bits} ({CPU.int8_gemm}) above" in quant.arithmetic(qw)) == bool(CPU.int8_gemm)


@pytest.mark.parametrize("fmt", ["int4-g32", "gguf-Q8_0"])
def test_a_weight_takes_int8_blocks_from_its_int8_rows_on(lib, fmt):
    """QuantizedWeight.int8_rows: products of at least that many rows take the int8 blocks (as_int8_blocks times the
    weight), fewer the one-row kernels' int16 rows (exactly what the default gives them); 0 none at all; the
    arithmetic label names the last row count on int16."""
    qw = weights(fmt, 37, 512)
    bits = "q8" if qw.codes.dtype == torch.int8 else "q4"
    w = qw.dequantize().double()
    int16 = {m: quant.quant_linear(torch.randn(m, 512, generator=torch.Generator().manual_seed(m)) * 3, qw)
             for m in (2, 3, 4, 9)}
    qw.int8_rows = 4
    for m, before in int16.items():
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)) * 3
        got = quant.quant_linear(x, qw)
        if m < 4 or not CPU.int8_gemm:
            assert torch.equal(got, before), m
        else:
            want = F.linear(quant.as_int8_blocks(x).double(), w)
            assert not torch.equal(got, before)
            assert bool(((got.double() - want).abs() <= 2e-6 * (x.abs().double() @ w.abs().T) + 1e-5).all()), m
    if CPU.int8_gemm:
        assert quant.arithmetic(qw) == f"int16 rows x {bits} to 3 rows, int8 blocks x {bits} ({CPU.int8_gemm}) above"
    qw.int8_rows = 0  # never: past the kernels' rows the dequantized fp32 product
    rows = quant.kernel_rows(qw.codes) + 2
    x = torch.randn(rows, 512)
    assert torch.allclose(quant.quant_linear(x, qw), F.linear(x, qw.dequantize()), rtol=1e-4, atol=1e-4)
    assert quant.arithmetic(qw).endswith("dequantized float32 above")


def test_int8_blocks_take_batched_steps_from_the_measured_row_count(monkeypatch, tmp_path, llama_dir):
    """quant.int8_fewest_rows: the fewest rows from which the int8 blocks win by the margin at every measured count up
    to the kernels' rows (0 where any count above loses), measured once per shapes and kept; an engine without
    speculative decoding starts its weights' int8 blocks there, one with it keeps them above the int16 rows (its
    verification steps must multiply as its plain steps do)."""
    from tieredkv.engine.engine_core import EngineCore
    from tieredkv.engine.rank_build import many_rows_arithmetic
    from tieredkv.kernels.quant import int16_rows_most
    from tieredkv.kernels.quant import QuantizedWeight

    core = EngineCore(make_config(model=str(llama_dir), quantization="int4", num_blocks=16, warm_bytes=0))
    try:  # (the engine loads the CPU kernels, whose rows the measurement counts up to)
        layer = [weights("int4-g32", 32, 64), weights("int4-g32", 48, 64)]
        win, lose = quant.FEW_ROWS_MARGIN * 1.05, quant.FEW_ROWS_MARGIN * 0.95  # int16 rows' time over the blocks'
        timing = {4: lose, 8: win, 12: win, 16: win, 24: win, 32: win}
        calls = []
        monkeypatch.setattr(quant, "_measure_few_rows", lambda ws, counts: calls.append(counts) or {
            str(m): {"int8_ms": 1.0, "int16_ms": timing[m]} for m in counts})
        top = quant.kernel_rows(layer[0].codes)
        assert quant.int8_fewest_rows(layer, tmp_path) == 8 and quant.int8_fewest_rows(layer, tmp_path) == 8
        assert len(calls) == 1 and calls[0][-1] <= top and (tmp_path / "kernels" / "few-rows.json").exists()
        timing[12] = lose  # a count above 8 that does not win by the margin: from 16 on
        assert quant.int8_fewest_rows(layer[:1], tmp_path) == 16
        timing[top] = lose
        assert quant.int8_fewest_rows(layer[1:], tmp_path) == 0  # the last count loses: none
        timing.update({12: win, top: win})
        model = core.model

        def rows() -> set[int]:
            return {w.int8_rows for w in model.modules() if isinstance(w, QuantizedWeight)}

        monkeypatch.setattr(quant, "_measure_many_rows", lambda ws: {"int8_ms": 1.0, "fp32_ms": 2.0})
        blocks = quant.CPU.int8_gemm  # a build with AVX2
        most = min(quant.kernel_rows(w.codes) for w in model.modules() if isinstance(w, QuantizedWeight))
        many_rows_arithmetic(model, None, tmp_path / "engine")
        assert rows() == ({8} if blocks else {0})
        assert int16_rows_most(model) == (7 if blocks else most)  # a step with drafts stays below the blocks
        many_rows_arithmetic(model, False, tmp_path / "engine")
        assert rows() == {0} and int16_rows_most(model) == most
    finally:
        core.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_row_cpp_operator_is_the_python_operator_bit_for_bit(lib, fmt):
    """A one-row product goes through the C++ operator tieredkv::quant_gemv (no Python in the call, for the
    compiled graph's C++ wrapper): the same kernels as the Python operator, so the same bits, with and without
    bias, from fp32 or bf16 activations and any leading dimensions; more rows take the Python operator."""
    qw = weights(fmt, 37, 256)
    g = torch.Generator().manual_seed(3)
    x, bias = torch.randn(1, 1, 256, generator=g), torch.randn(37, generator=g)
    gemv, python = torch.ops.tieredkv.quant_gemv.default, torch.ops.tieredkv.quant_linear.default
    assert quant._linear_op(x, qw) is gemv and quant._linear_op(torch.randn(2, 256), qw) is python
    for b in (None, bias):
        for xx in (x, x.bfloat16()):
            got = quant.quant_linear(xx, qw, b)
            want = python(xx, qw.codes, qw.scales, qw.offsets, qw.group_size, b)
            assert got.shape == (1, 1, 37) and got.dtype == xx.dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="one row of activations"):
        gemv(torch.randn(2, 256), qw.codes, qw.scales, qw.offsets, qw.group_size, None)
    with pytest.raises(RuntimeError, match="do not take 128 inputs"):
        gemv(torch.randn(1, 128), qw.codes, qw.scales, qw.offsets, qw.group_size, None)
    with pytest.raises(RuntimeError, match="do not take 256 inputs"):  # scales of fewer rows than the codes
        gemv(x, qw.codes, qw.scales[:5], None if qw.offsets is None else qw.offsets[:5], qw.group_size, None)
    if qw.offsets is not None:
        with pytest.raises(RuntimeError, match="not shaped as the scales"):
            gemv(x, qw.codes, qw.scales, qw.offsets[:5], qw.group_size, None)
    with pytest.raises(RuntimeError, match="a bias of 37 outputs"):
        gemv(x, qw.codes, qw.scales, qw.offsets, qw.group_size, bias[:3])


def test_without_a_cpp_compiler_the_python_operator_serves_one_row(lib, monkeypatch, tmp_path):
    """The C++ operator is an addition: where it cannot be built (here no C++ compiler) the build says why, and a
    library it is not bound to serves one row through the Python operator."""
    from tieredkv.kernels import quant_cpu

    monkeypatch.setattr(quant_cpu, "compiler", lambda cxx=False: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        quant_cpu.build_ops(tmp_path)
    qw, x = weights("int4-g32", 8, 64), torch.randn(1, 64)
    monkeypatch.setattr(CPU, "bound", None)
    assert quant._linear_op(x, qw) is torch.ops.tieredkv.quant_linear.default
    check_against_reference(qw, 1)


def test_a_build_compiles_each_source_apart_and_a_failure_says_why_and_leaves_nothing(tmp_path):
    """The kernels' library is built a compiler process a source, then linked: a source that does not compile fails
    the build with the compiler's message, leaving no library and no build directory; sources that compile give one
    library with every source's functions."""
    import ctypes

    from tieredkv.kernels import quant_cpu

    one, two, bad = tmp_path / "one.c", tmp_path / "two.c", tmp_path / "bad.c"
    one.write_text("int tkv_one(void) { return 1; }\n")
    two.write_text("int tkv_two(void) { return 2; }\n")
    bad.write_text("int tkv_bad(void) { return not_declared_anywhere; }\n")
    out, command = tmp_path / "cache" / "test-0.so", [quant_cpu.compiler(), "-O1", "-fPIC", "-shared"]
    with pytest.raises(RuntimeError, match="not_declared_anywhere"):
        quant_cpu._compile(out, command, (one, bad, two), [], "a test build")
    assert not out.exists() and not [p for p in out.parent.iterdir() if not p.name.endswith(".lock")]
    built = ctypes.CDLL(str(quant_cpu._compile(out, command, (one, two), [], "a test build")))
    assert built.tkv_one() + built.tkv_two() == 3


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-sym", "q8-g32"])
@pytest.mark.parametrize("k", [320, 4160])
def test_batch_one_kernel_over_chunks_tails_and_long_rows(lib, fmt, k):
    """One activation row runs the row-streaming kernels, which take groups eight at a time: 320 inputs are one
    chunk and a tail of two groups of 32 (or five of 64); 4160 make int8's one-scale row longer than the 2048
    inputs an int32 sum may take (summed in pieces)."""
    qw = weights(fmt, 19, k)
    check_against_reference(qw, 1)
    check_against_reference(qw, 2)  # the blocks of four rows, on the same weight


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_dequantize_like_the_reference(lib, fmt):
    qw = weights(fmt, 21, 256)  # 256: a whole K-quant block
    ids = torch.tensor([20, 0, 7, 7])
    assert torch.equal(quant.quant_embedding(qw, ids, torch.float32), qw.dequantize()[ids])


def test_calls_from_many_threads_each_keep_their_own_scratch(lib):
    """The kernels keep each calling thread's activation codes in scratch memory of that thread's own, grown
    as needed (quant_cpu.c: tkv_scratch): threads calling at once, with widths that make each grow and reuse
    its scratch, get what one thread alone gets, bit for bit (one buffer shared by all would mix them)."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [(weights(fmt, 24, k, seed=k), rows) for fmt in ("int8", "int4-g32") for k in (64, 1024, 256)
             for rows in (1, 3)]
    xs = [torch.randn(rows, qw.in_features, generator=torch.Generator().manual_seed(i)) * 3
          for i, (qw, rows) in enumerate(cases)]
    python = torch.ops.tieredkv.quant_linear.default  # through ctypes, which lets go of the GIL for the call
    alone = [python(x, qw.codes, qw.scales, qw.offsets, qw.group_size, None) for x, (qw, _) in zip(xs, cases)]

    def worker(shift: int) -> bool:
        order = [(i + shift) % len(cases) for i in range(len(cases))] * 25
        return all(torch.equal(python(xs[i], qw.codes, qw.scales, qw.offsets, qw.group_size, None), alone[i])
                   for i in order for qw in [cases[i][0]])

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(worker, range(4)))


# layouts tiled (quant.QuantizedWeight.tile): q4 in groups of 32 to 128, asymmetric, symmetric, Q4_K's; q8 per
# row (int8), in groups of 32, with offsets (Q5_1)
TILED = ["int4-g32", "int4-g128", "int4-sym", "gguf-Q4_K", "int8", "q8-g32", "gguf-Q5_1"]


def tiled_weights(fmt: str, n: int, k: int) -> tuple[quant.QuantizedWeight, quant.QuantizedWeight]:
    """A q4 or q8 weight and the same weight tiled."""
    plain, tiled = weights(fmt, n, k), weights(fmt, n, k)
    tiled.tile()
    assert tiled.fmt == plain.fmt + "t" and tiled.out_features == n and tiled.nbytes == plain.nbytes
    return plain, tiled


@pytest.mark.parametrize("fmt", TILED)
@pytest.mark.parametrize("rows", [1, 2, 5, 19, "past the kernels"])
def test_tiled_kernels_match_the_dequantized_reference(lib, fmt, rows):
    """q4t and q8t (EngineConfig.int8_activations): the same weights as q4 and q8, bit for bit once dequantized;
    their products against F.linear on them within what int8 activation blocks allow, one row, several, and
    past the kernels' rows (q4t: the many-row int8 products; q8t: dequantized into the fp32 product); every row
    dequantized exactly."""
    n, k = 48, 512
    plain, tiled = tiled_weights(fmt, n, k)
    w = plain.dequantize()
    assert torch.equal(tiled.dequantize(), w)
    ids = torch.tensor([47, 0, 17, 17, 30])
    assert torch.equal(quant.quant_embedding(tiled, ids, torch.float32), w[ids])
    if rows == "past the kernels":
        rows = quant.kernel_rows(tiled.codes) + 3
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)) * 3
    x[:, 5] = 40.0  # an outlier channel: its block's other inputs get coarse steps
    bias = torch.randn(n)
    want = F.linear(x, w, bias)
    got = quant.quant_linear(x, tiled, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert bool(((got - want).abs() <= int8_block_bound(x, w, want)).all()), float((got - want).abs().max())
    if rows <= quant.kernel_rows(tiled.codes):  # the int8 blocks are coarser than the untiled int16 rows
        assert (got - want).norm() > 5 * (quant.quant_linear(x, plain, bias) - want).norm()
    # the C++ one-row operator is the Python operator, bit for bit
    one = x[:1]
    gemv, python = torch.ops.tieredkv.quant_gemv.default, torch.ops.tieredkv.quant_linear.default
    assert quant._linear_op(one, tiled) is gemv
    assert torch.equal(gemv(one, tiled.codes, tiled.scales, tiled.offsets, tiled.group_size, bias),
                       python(one, tiled.codes, tiled.scales, tiled.offsets, tiled.group_size, bias))
    with pytest.raises(RuntimeError, match="do not take 256 inputs"):
        gemv(torch.randn(1, 256), tiled.codes, tiled.scales, tiled.offsets, tiled.group_size, None)


@pytest.mark.parametrize("fmt", ["int4-g32", "int8", "q8-g32"])
@pytest.mark.parametrize("tiles", [False, True])
def test_products_carry_a_non_finite_activation_to_their_outputs(lib, fmt, tiles):
    """A NaN or an infinity among a row's activations makes every output of that row non-finite, in the int16
    rows' kernels and the tiled ones, one row or several (as the float product's would be), so the sampler's
    bad-row test sees it; the other rows of the step are untouched."""
    plain, tiled = tiled_weights(fmt, 32, 128)
    for bad in (float("nan"), float("inf")):
        for rows in (1, 3):
            x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(5))
            x[0, 70] = bad
            got = quant.quant_linear(x, tiled if tiles else plain)
            assert not bool(got[0].isfinite().any()) and bool(got[1:].isfinite().all())


def test_tiled_products_are_the_same_bits_on_every_build(kernel_cache):
    """The AVX-512 VNNI kernels and the plain C ones do the same operations in the same order (quant_cpu.c:
    "q4 in tiles"), so a weight gives the same outputs on every processor, one row or several."""
    from conftest import CPU_KERNEL_BUILDS

    from tieredkv.kernels.quant_cpu import load

    x = torch.randn(6, 320, generator=torch.Generator().manual_seed(4))  # a group of four rows and two more
    bias = torch.randn(32)
    for fmt, g in (("int4-sym", 64), ("gguf-Q5_1", 32)):  # q4 in groups of 64; q8 with offsets
        _, tiled = tiled_weights(fmt, 32, 320)
        offsets = None if tiled.offsets is None else tiled.offsets.data_ptr()
        outs = []
        for flags in CPU_KERNEL_BUILDS.values():
            lib = load(kernel_cache, flags)
            q8 = tiled.fmt == "q8t"
            for rows, call in ((1, lib.tkv_q8t_gemv if q8 else lib.tkv_q4t_gemv),
                               (6, lib.tkv_q8t_linear if q8 else lib.tkv_q4t_linear)):
                out = torch.empty(rows, 32)
                args = (x.data_ptr(), 320) if rows == 1 else (x.data_ptr(), rows, 320)
                assert call(*args, tiled.codes.data_ptr(), tiled.scales.data_ptr(), offsets, g, 32, bias.data_ptr(),
                            out.data_ptr()) == 0
                outs.append(out)
        assert all(torch.equal(o, outs[0] if o.shape[0] == 1 else outs[1]) for o in outs), fmt
        assert torch.equal(outs[0][0], outs[1][0])  # a row alone or among others


@pytest.mark.parametrize("fmt", TILED)
def test_a_tiled_row_is_the_same_bits_alone_or_among_others(lib, fmt):
    """The tiled products of several rows (a batched step, a speculative step's verification rows) take the rows
    four at a time, each block's codes unpacked once for the four (quant_cpu.c: tile_group_outputs), and each row's
    outputs are still those of the one-row product: every count of rows up to the kernels' most (whole groups of
    four and every remainder), with and without a bias, on this processor's build and the plain C one."""
    k = 256 if fmt in K_QUANTS else 384
    _, tiled = tiled_weights(fmt, 48, k)
    most = quant.kernel_rows(tiled.codes)
    x = torch.randn(most, k, generator=torch.Generator().manual_seed(7)) * 3
    x[:, 9] = 30.0  # an outlier channel
    for bias in (None, torch.randn(48)):
        alone = torch.cat([quant.quant_linear(x[i : i + 1], tiled, bias) for i in range(most)])
        for rows in range(2, most + 1):
            assert torch.equal(quant.quant_linear(x[:rows], tiled, bias), alone[:rows]), (rows, bias is None)


def test_tiles_only_where_they_fit(lib):
    """Weights whose rows are not whole tiles of 16 and q8 weights in groups of 16 stay as they are;
    a tiled weight is not reordered by rows (tiles are made after every step of the load that does)."""
    assert not weights("int4-g32", 40, 64).tileable() and not weights("gguf-Q6_K", 48, 256).tileable()  # groups of 16
    _, tiled = tiled_weights("int4-g32", 32, 64)
    with pytest.raises(ValueError, match="not reordered"):
        tiled.take_rows(torch.arange(32))


def test_quantizers_error_bounds():
    w = torch.randn(64, 256) * 0.1
    q8 = quant.quantize_int8(w)
    d8 = q8.scales.float()
    assert bool(((q8.dequantize() - w).abs() <= 0.5 * d8 + 1e-7).all())
    for g, sym in ((32, False), (128, False), (64, True)):
        q4 = quant.quantize_int4(w, g, sym)
        wg = w.view(64, -1, g)
        deq = q4.dequantize().view(64, -1, g)
        d, m = q4.scales.float()[..., None], q4.offsets.float()[..., None]
        inside = (wg - m) / d
        inside = (inside >= 0) & (inside <= 15)  # values the chosen range did not clip (d < 0 for some sym groups)
        slack = 2**-10 * wg.abs().amax(-1, keepdim=True)  # d and m are rounded to fp16 before the codes
        assert bool(((deq - wg).abs() <= 0.5 * d.abs() + slack)[inside].all()), (g, sym)
        assert bool(((deq - wg).abs() <= d.abs() + slack).all()), (g, sym)  # symmetric clips at most one step
        if not sym:  # the asymmetric range is the group's own: nothing is clipped beyond fp16 rounding
            assert bool(((deq - wg).abs() <= 0.5 * d + slack).all()), g
        assert q4.codes.dtype == torch.uint8 and q4.codes.shape == (64, 128) and q4.nbytes < w.numel() * 4 / 6


def test_group_size_and_activation_errors(llama_dir):
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        make_config(quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="int8_activations applies to quantized weights"):
        make_config(int8_activations=True)  # full-precision weights: nothing it could change
    with pytest.raises(CheckpointError, match="does not divide the input dimension 64"):  # hidden_size 64
        EngineCore(make_config(model=str(llama_dir), quantization="int4", quantization_group_size=128,
                               num_blocks=16, warm_bytes=0))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_read_as_they_are(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[type_name]
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = quantize(w, qtype)
    qw = gguf_blocks.load_gguf_tensor(raw, type_name, (6, 96), "blk.0.attn_q.weight")
    assert isinstance(qw, quant.QuantizedWeight) and qw.group_size == 32
    assert torch.equal(qw.dequantize(), torch.from_numpy(dequantize(raw, qtype)))
    # the file's bytes, nothing widened; Q4_0 also holds its implied offset (-8 d) as an fp16 per block
    assert qw.nbytes == raw.nbytes + (2 * 6 * 96 // 32 if type_name == "Q4_0" else 0)


HELD_AS = {"Q5_0": ("q8", 32), "Q5_1": ("q8", 32), "IQ4_NL": ("q8", 32), "Q2_K": ("q8", 16), "Q3_K": ("q8", 16),
           "Q4_K": ("q4", 32), "Q5_K": ("q8", 32), "Q6_K": ("q8", 16)}


@pytest.mark.parametrize("type_name", list(HELD_AS))
def test_gguf_k_quants_and_5_bit_types_keep_every_code(type_name):
    """Q5_0, Q5_1 and IQ4_NL held as q8 give the very weights gguf dequantizes; the K types (Q4_K as q4, the
    others as q8, in groups of 32 or 16, with offsets where they have mins) keep every code, and their per-group
    scales rounded to fp16 are the only difference: at most 2^-11 of each group's scale per code step, and of
    its offset."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 6, 512
    raw = k_blocks(type_name, n, k)
    qw = gguf_blocks.load_gguf_tensor(raw, type_name, (n, k), "blk.0.ffn_down.weight")
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).copy())
    got = qw.dequantize()
    assert qw.scheme == f"gguf:{type_name}" and got.shape == want.shape == (n, k)
    assert (qw.fmt, qw.group_size) == HELD_AS[type_name]
    assert (qw.offsets is not None) == (type_name in ("Q5_1", "Q2_K", "Q4_K", "Q5_K"))
    assert qw.nbytes == n * k // 32 * gguf_blocks.GGUF_HELD_BYTES[type_name]
    if not type_name.endswith("_K"):
        assert torch.equal(got, want)
        return
    g = qw.group_size
    codes = qw.dequantize().view(n, -1, g) - (0 if qw.offsets is None else qw.offsets.float()[..., None])
    step = qw.scales.float().abs()[..., None]
    offset = 0 if qw.offsets is None else qw.offsets.float().abs()[..., None]
    bound = 2**-11 * (codes.abs() + step + offset) + 1e-7  # the scale's rounding times the code, the offset's
    assert bool(((got - want).view(n, -1, g).abs() <= bound).all()), float((got - want).abs().max())


def test_fused_pieces_in_different_formats_are_served_side_by_side(lib):
    """q/k/v stored as Q4_K, Q4_K and Q6_K (as Q4_K_M files store them) cannot share one layout: they are
    kept apart (QuantizedParts) and their products concatenated, equal to the dequantized reference."""
    parts = [gguf_tensor("Q4_K", 8, 256, 1), gguf_tensor("Q4_K", 4, 256, 2), gguf_tensor("Q6_K", 4, 256, 3)]
    fused = quant.cat_rows(parts, "layers.0.self_attn.qkv_proj.weight")
    assert isinstance(fused, quant.QuantizedParts) and fused.scheme == "gguf:Q4_K+Q6_K"
    assert fused.label == "q4 g32 (gguf:Q4_K) + q8 g16 (gguf:Q6_K)"  # stats().dense_formats names it so
    assert fused.out_features == 16 and fused.nbytes == sum(p.nbytes for p in parts)
    w = fused.dequantize()
    assert torch.equal(w, torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(16)
    want, got = F.linear(x, w, bias), quant.quant_linear(x, fused, bias)
    step = x.abs().amax(dim=1, keepdim=True) / 32767
    assert bool(((got - want).abs() <= 0.5 * step * w.abs().sum(dim=1)[None, :] + 1e-4 * want.abs() + 1e-5).all())
    mixed = [parts[0], torch.zeros(4, 256)]
    with pytest.raises(CheckpointError, match="some quantized, some not"):
        quant.cat_rows(mixed, "layers.0.self_attn.qkv_proj.weight")


@pytest.mark.parametrize("rows", [1, 3])
def test_q8_pieces_with_and_without_offsets_fuse_into_one(lib, rows):
    """Q8_0 and Q5_0 (q8, no offsets) beside Q5_1 (q8 with offsets), as Q5_K_M files store q/k/v: one q8
    weight, the pieces without offsets given zero offsets (the same weights), one kernel call."""
    parts = [gguf_tensor("Q5_1", 8, 256, 1), gguf_tensor("Q5_0", 4, 256, 2),
             gguf_tensor("Q8_0", 4, 256, 3)]
    fused = quant.cat_rows(parts, "layers.0.self_attn.qkv_proj.weight")
    assert isinstance(fused, quant.QuantizedWeight) and fused.scheme == "gguf:Q5_1+Q5_0+Q8_0"
    assert fused.offsets is not None and not fused.offsets[8:].any()
    w = fused.dequantize()
    assert torch.equal(w, torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(5))
    want, got = F.linear(x, w), quant.quant_linear(x, fused)
    step = x.abs().amax(dim=1, keepdim=True) / 32767
    assert bool(((got - want).abs() <= 0.5 * step * w.abs().sum(dim=1)[None, :] + 1e-4 * want.abs() + 1e-5).all())


def test_gguf_unsupported_type_is_named():
    with pytest.raises(CheckpointError, match=r"blk\.3\.ffn_down\.weight has type IQ4_XS.*supported types: F32, "
                                              r"F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, "
                                              r"Q5_K, Q6_K \(re-quantize"):
        gguf_blocks.load_gguf_tensor(np.zeros((2, 136), np.uint8), "IQ4_XS", (2, 256), "blk.3.ffn_down.weight")


def _dequantized_checkpoint(src: Path, out: Path, scheme: str) -> Path:
    """src with every projection and the LM head replaced by what the engine's quantization of it holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in tensors.items():
        if name.endswith("proj.weight"):
            qw = quant.quantize_int8(w) if scheme == "int8" else quant.quantize_int4(w, 32)
        elif name == "lm_head.weight":
            qw = quant.quantize_int8(w)
        else:
            continue
        tensors[name] = qw.dequantize().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_engine_matches_transformers_on_the_dequantized_weights(scheme, llama_dir, tmp_path):
    """Quantized at load, the engine's greedy output with the activations never rounded to int8 is transformers'
    on the weights it holds, dequantized."""
    from helpers import hf_greedy

    ref_dir = _dequantized_checkpoint(llama_dir, tmp_path / "ref", scheme)
    prompts = [[5, 9, 33, 2, 71] * 3, list(range(3, 40)), [200, 17]]
    want = hf_greedy(ref_dir, prompts, 16)
    core = EngineCore(make_config(model=str(llama_dir), quantization=scheme, num_blocks=32, warm_bytes=0,
                                  int8_activations=False))
    try:
        reqs = [core.factory.make(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
        drive(core, reqs)
        assert [r.seqs[0].output_token_ids for r in reqs] == want
        # the quantized weights lie in one arena, in the order the forward reads them, the LM head last
        held = [t for m in core.model.modules() if isinstance(m, quant.QuantizedWeight)
                for t in (m.codes, m.scales, m.offsets) if t is not None]
        assert len({t.untyped_storage().data_ptr() for t in held}) == 1
        assert [t.data_ptr() for t in held] == sorted(t.data_ptr() for t in held)
        head = core.model.quantized_head
        assert held[-1] is [t for t in (head.codes, head.scales, head.offsets) if t is not None][-1]
        stats = core.stats()
        assert stats.weights == f"{scheme} (float32 activations)"
        full = EngineCore(make_config(model=str(llama_dir), num_blocks=8, warm_bytes=0))
        mats = [(m.out_features, m.in_features) for m in full.model.layers.modules() if isinstance(m, Projection)]
        head = (full.model.lm_head.out_features, full.model.lm_head.in_features)
        per = (lambda n, k: n * k + 2 * n) if scheme == "int8" else (lambda n, k: n * k // 2 + 4 * n * k // 32)
        expected = (full.stats().weight_bytes - 4 * sum(n * k for n, k in [*mats, head])
                    + sum(per(n, k) for n, k in mats) + head[0] * head[1] + 2 * head[0])
        assert stats.weight_bytes == expected
        assert full.fingerprint != core.fingerprint  # KV computed by other weights is never shared through a tier
        full.close()
        check_pool_clean(core)
    finally:
        core.close()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_plan_counts_the_weights_in_their_format(scheme, llama_dir):
    from tieredkv.tools.plan import plan

    p = plan(str(llama_dir), device="cpu", quantization=scheme)
    core = EngineCore(make_config(model=str(llama_dir), quantization=scheme, num_blocks=8, warm_bytes=0))
    try:
        assert p.weight_bytes == core.stats().weight_bytes and p.weights == ("int8" if scheme == "int8" else
                                                                              "int4-g32-asym")
    finally:
        core.close()
    assert plan(str(llama_dir), device="cpu").weight_bytes > 2.5 * p.weight_bytes


@pytest.mark.parametrize("path", ["native", "compiled"])
def test_one_sequence_decode_paths_serve_quantized_weights(llama_dir, monkeypatch, path):
    """A one-sequence decode of int4 weights runs through the native C step (runner/native_decode.py) or, with it
    off, the compiled graph, which calls the quantized op like any product: greedy token for token the eager
    forward's, and every one-sequence decode ran through that path."""
    prompts = [[7, 3, 99, 14] * 4, list(range(20, 60))]
    outs, cores = [], []
    for compiled in (False, True):
        core = EngineCore(make_config(model=str(llama_dir), quantization="int4", num_blocks=32, warm_bytes=0,
                                      compile_decode=compiled, native_decode=path == "native"))
        cores.append(core)
        got = []
        for p in prompts:  # one at a time: every step after the prefill decodes one sequence
            req = core.factory.make(p, SamplingParams(max_tokens=12, ignore_eos=True))
            drive(core, [req])
            got.append(req.seqs[0].output_token_ids)
        outs.append(got)
    try:
        assert outs[0] == outs[1]
        assert cores[1].stats().decode_path == path and cores[1].runner.compiled.steps == 2 * 11
        if path == "compiled":  # the compile bound the C++ one-row operator before its trace (inductor's compiler)
            assert CPU.bound is CPU.lib is not None
    finally:
        for core in cores:
            core.close()


def test_int8_activations_hold_4bit_weights_in_tiles_where_the_processor_can(llama_dir):
    """EngineConfig.int8_activations: where the kernels multiply tiles with AVX-512 VNNI, every quantized weight
    is held in tiles of 16 rows (4-bit projections, the int8 LM head), stats() says so and the KV fingerprint is one of
    its own (other keys and values). The compiled graph serves its decode steps, its logits within what int8
    blocks move (rounded from inputs the graph's fused norms compute a few ulps apart from the eager forward's:
    tokens may part at near-ties). Without AVX-512 VNNI the weights stay as they are; the default keeps int16."""
    prompt = list(range(20, 60))
    cfg = dict(model=str(llama_dir), quantization="int4", num_blocks=32, warm_bytes=0)
    plain = EngineCore(make_config(**cfg, compile_decode=False))
    cores, logits = [], []
    try:
        for compiled in (False, True):
            core = EngineCore(make_config(**cfg, int8_activations=True, compile_decode=compiled))
            cores.append(core)
            captured, inner = [], core.runner.execute
            core.runner.execute = lambda out, inner=inner, captured=captured: captured.append(inner(out)) or \
                captured[-1]
            req = core.factory.make(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            drive(core, [req])
            logits.append(captured[1][0][-1].float())  # the first decode step's, after the same prefill token
        assert cores[1].runner.compiled.steps == 1
        assert (logits[0] - logits[1]).abs().max() <= 0.05 * logits[0].abs().max()
        native = bool(CPU.lib.tkv_tiles_native())
        for core in cores:
            formats = {m.fmt for m in core.model.layers.modules() if isinstance(m, quant.QuantizedWeight)}
            assert formats == ({"q4t"} if native else {"q4"})
            assert core.model.quantized_head.fmt == ("q8t" if native else "q8")
            assert core.stats().weights == ("int4 (float32 activations; int8 blocks in tiled products)" if native
                                            else "int4 (float32 activations)")
            assert core.fingerprint != plain.fingerprint and core.stats().weight_bytes == plain.stats().weight_bytes
        assert {m.fmt for m in plain.model.layers.modules() if isinstance(m, quant.QuantizedWeight)} == {"q4"}
    finally:
        for core in [plain, *cores]:
            core.close()


def test_gguf_header_index_is_cached_and_reads_the_same(tmp_path):
    """The GGUF header is parsed once per file (gguf's reader takes seconds on a real vocabulary); later reads
    take the cached index and give the same tensors: q rows back in Hugging Face's order, blocks as stored."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    from tieredkv.models.gguf_convert import _unpermute, gguf_index, read_gguf_weights

    rng = np.random.default_rng(1)
    q_w, norm = rng.standard_normal((8, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", 2)
    writer.add_uint32("llama.attention.head_count_kv", 1)
    raw = quantize(q_w, GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    first = read_gguf_weights(path, cache)
    assert len(list((cache / "gguf-index").glob("tiny-*.json"))) == 1
    assert gguf_index(path, cache)["head_count"] == 2
    second = read_gguf_weights(path, cache)
    q = first["layers.0.self_attn.q_proj.weight"]
    want = _unpermute(dequantize(raw, GGMLQuantizationType.Q4_1).reshape(8, 64), 2)
    assert q.scheme == "gguf:Q4_1" and torch.equal(q.dequantize(), torch.from_numpy(np.ascontiguousarray(want)))
    assert torch.equal(second["layers.0.self_attn.q_proj.weight"].codes, q.codes)
    assert torch.equal(first["layers.0.input_layernorm.weight"], torch.from_numpy(norm))


@pytest.mark.parametrize("type_name, dtype", [("F32", torch.float32), ("F16", torch.float16),
                                              ("BF16", torch.bfloat16)])
def test_gguf_float_tensors_read_as_stored(type_name, dtype):
    t = torch.randn(3, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = gguf_blocks.load_gguf_tensor(t.view(torch.uint8).numpy(), type_name, (3, 8), "blk.0.attn_norm.weight")
    assert got.dtype == dtype and torch.equal(got, t)


def test_engine_serves_a_k_quant_gguf_as_transformers_does_its_dequantized_weights(tmp_path, monkeypatch):
    """A GGUF file of a tiny Llama whose projections are Q4_K, Q6_K and Q5_0 as a Q4_K_M file mixes them (q and k
    Q4_K with v Q6_K, gate Q4_K with up Q5_0: fused pieces in two formats; one layer's down projection Q6_K,
    the other's Q5_0), the LM head Q8_0: the engine's greedy output (activations never rounded to int8) is
    transformers' on the weights read from that file (q/k rows back in Hugging Face's rotary order), and the
    weights stay quantized (none in fp32). The native decode step serves it, and so does the compiled graph with
    that step off, one graph per kind of layer (a graph traced on one layer and run on the other failed at
    start)."""
    import shutil

    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    from helpers import hf_greedy, make_checkpoint, run_to_end
    from tieredkv.models.gguf_convert import _LAYER_NAMES, _TOP_NAMES, _unpermute
    from tieredkv.runner import compiled_decode

    src = make_checkpoint(tmp_path / "src", "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
    tensors = load_file(str(src / "model.safetensors"))
    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
             "ffn_up": "Q5_0", "ffn_down": "Q6_K", "output": "Q8_0"}
    gguf_names = {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{short}.weight"
                  for i in range(2) for short, hf in _LAYER_NAMES.items()}
    gguf_names.update({f"{hf}.weight": f"{short}.weight" for short, hf in _TOP_NAMES.items()})
    model_dir = tmp_path / "gguf-model"
    shutil.copytree(src, model_dir)
    writer = GGUFWriter(str(model_dir / "tiny.gguf"), "llama")
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_uint32("llama.attention.head_count_kv", 2)
    for seed, (name, w) in enumerate(sorted(tensors.items())):
        gname = gguf_names[name]
        kind = "Q5_0" if gname == "blk.1.ffn_down.weight" else types.get(gname.split(".")[-2])
        if kind is None:  # norms and the embedding table: float, as stored
            writer.add_tensor(gname, w.numpy())
            continue
        n, k = w.shape
        raw = quantize(w.numpy(), GGMLQuantizationType.Q8_0) if kind == "Q8_0" else k_blocks(kind, n, k, seed)
        writer.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[kind])
        # the weights as the engine holds them: gguf's dequantization with the K types' scales rounded to fp16
        # (within 2^-11, test_gguf_k_quants_and_q5_0_keep_every_code); with these random blocks' large weights
        # that rounding alone moves a logit by a few hundredths, past a near tie in transformers' own output
        value = gguf_blocks.load_gguf_tensor(raw, kind, (n, k), gname).dequantize().numpy()
        exact = dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)
        assert np.abs(value - exact).max() <= 2**-11 * np.abs(exact).max()
        heads = {"attn_q": 4, "attn_k": 2}.get(gname.split(".")[-2])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(_unpermute(value, heads) if heads else value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref = tmp_path / "reference"
    shutil.copytree(src, ref)
    save_file(tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})
    prompts = [list(range(5, 40)), [3, 4, 5, 6]]
    expected = hf_greedy(ref, prompts, 12)
    monkeypatch.setattr(compiled_decode, "MAX_LAYERS_PER_GRAPH", 1)  # a run per layer: runs of two kinds
    for path in ("native", "compiled"):  # the native step takes the parts too; with it off, the graphs
        core = EngineCore(make_config(model=str(model_dir), quantization="gguf", num_blocks=32, warm_bytes=0,
                                      compile_decode=True, compile_in_background=False,
                                      native_decode=path == "native", int8_activations=False))
        try:
            attn, mlp = core.model.layers[0].self_attn, core.model.layers[0].mlp
            assert isinstance(attn.qkv_proj.format, quant.QuantizedParts) and attn.qkv_proj.weight is None
            assert attn.qkv_proj.format.scheme == "gguf:Q4_K+Q6_K"
            assert mlp.gate_up_proj.format.scheme == "gguf:Q4_K+Q5_0"
            assert core.model.quantization == "gguf:Q4_K+Q6_K+Q5_0"
            assert core.stats().decode_path == path
            assert path == "native" or core.runner.compiled.graphs == 2
            assert run_to_end(core, prompts, [12, 12]) == expected
            check_pool_clean(core)
            # one at a time: every decode through the path (and with the native step, each prompt's tail after
            # its cached blocks, at most native_decode.MAX_ROWS tokens: the whole 4-token prompt, the long one's 3)
            before = core.runner.compiled.steps
            assert [run_to_end(core, [p], [12]) for p in prompts] == [[e] for e in expected]
            assert core.runner.compiled.steps - before == 2 * 11 + 2 * (path == "native")
        finally:
            core.close()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_triton_kernel_matches_dequantized_reference(fmt, rows):
    """The CUDA kernel (here through Triton's interpreter) against F.linear on the dequantized weight, every
    format (q8 groups of 16 and 32 and whole rows, q4 groups of 32 to 128, symmetric, K-quant blocks): 70
    output rows are a tile of 64 and a ragged one, 20 activation rows a tile of 16 and a ragged one."""
    triton_ops = pytest.importorskip("tieredkv.kernels.triton_ops")
    qw = weights(fmt, 70, 256)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 256, generator=g) * 3, torch.randn(70, generator=g)
    want = F.linear(x, qw.dequantize(), bias)
    got = triton_ops.quant_linear(x, qw.codes, qw.scales, qw.offsets, qw.group_size, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    x3 = x.view(1, rows, 256)  # leading dimensions, no bias
    torch.testing.assert_close(triton_ops.quant_linear(x3, qw.codes, qw.scales, qw.offsets, qw.group_size),
                               F.linear(x3, qw.dequantize()), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_quantized_op_on_cuda_runs_the_triton_kernel_within_bf16_tolerance(fmt, rows):
    """On CUDA the op (the engine's path) runs the Triton kernel: bf16 activations against the fp32 product on
    the dequantized weight, within bf16's rounding of the operands (fp32 accumulation)."""
    qw = weights(fmt, 70, 256).to("cuda")
    x = torch.randn(rows, 256, device="cuda")
    want = F.linear(x, qw.dequantize().float())
    got = quant.quant_linear(x.bfloat16(), qw)
    assert got.dtype == torch.bfloat16 and got.device.type == "cuda"
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    torch.testing.assert_close(quant.quant_linear(x, qw), want, rtol=1e-4, atol=1e-3)  # fp32: ieee products


@pytest.mark.parametrize("fmt", ["gguf-Q6_K", "gguf-Q2_K"])
def test_many_rows_dequantize_a_large_weight_in_tiles(lib, fmt, monkeypatch):
    """Above kernel_rows a weight larger than DEQUANT_TILE_BYTES of fp32 (an LM head) that does not multiply on
    int8 (groups of 16, as these K types are held; any weight without AVX2: test_many_rows_on_4bit_weights_...)
    is dequantized and multiplied a tile of rows at a time (here tiles of 16 rows over 37: two whole and a ragged
    one), bias included, with the same result as the whole weight at once."""
    qw = weights(fmt, 37, 256)
    monkeypatch.setattr(quant, "DEQUANT_TILE_BYTES", 16 * 256 * 4)
    calls = []
    inner = quant._dequantize_fast
    monkeypatch.setattr(quant, "_dequantize_fast", lambda *a: calls.append(a[-1]) or inner(*a))
    check_against_reference(qw, quant.kernel_rows(qw.codes) + 3)
    assert [None if ids is None else ids.tolist() for ids in calls] == [
        list(range(0, 16)), list(range(16, 32)), list(range(32, 37))]


@pytest.mark.parametrize("faster", [True, False])
def test_stats_name_the_format_each_kind_of_dense_layer_reads(llama_dir, monkeypatch, faster):
    """stats() names each kind of dense layer's format and what its products multiply on here: by default int8
    blocks past the one-row kernels' rows on 4-bit weights where the CPU kernels have AVX2 and they were measured
    clearly faster (here: said to be, or not), from fewer rows where measured faster than the int16 rows too (here:
    said to be from 8), never with int8_activations=False; the two compute other keys and
    values, so their prefix caches' identities differ."""
    from tieredkv.engine import rank_build
    from tieredkv.engine.identity import model_fingerprint
    from tieredkv.engine.resolve import quant_settings

    monkeypatch.setattr(rank_build, "int8_many_rows_win", lambda weights, cache_dir: faster)
    monkeypatch.setattr(rank_build, "int8_fewest_rows", lambda weights, cache_dir: 8)  # blocks from 8 rows on
    kinds = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    prints = set()
    for setting in (None, False):
        cfg = make_config(model=str(llama_dir), quantization="int4", num_blocks=16, warm_bytes=0,
                          int8_activations=setting)
        core = EngineCore(cfg)
        try:
            # (asked of the build the engine serves with: before a worker's first engine none may be loaded)
            rows = quant.kernel_rows(torch.zeros(1, 1, dtype=torch.uint8))
            stats = core.stats()
            assert stats.dense_formats == {**{k: "q4 g32 (int4)" for k in kinds}, "lm_head": "q8 g64 (int8)"}
            int8 = setting is None and CPU.int8_gemm and faster
            above = f"int8 blocks x {{}} ({CPU.int8_gemm})" if int8 else "dequantized float32"
            assert stats.dense_arithmetic == {
                **{k: f"int16 rows x q4 to {7 if int8 else rows} rows, {above.format('q4')} above" for k in kinds},
                "lm_head": f"int16 rows x q8 to {7 if int8 else 16} rows, {above.format('q8')} above"}
            prints.add(model_fingerprint(llama_dir, torch.float32, 16, quant_settings(cfg, llama_dir)))
        finally:
            core.close()
    assert len(prints) == 2
    core = EngineCore(make_config(model=str(llama_dir), num_blocks=16, warm_bytes=0, cpu_linear="torch"))
    try:
        stats = core.stats()
        assert stats.dense_formats == stats.dense_arithmetic == {k: "float32" for k in (*kinds, "lm_head")}
    finally:
        core.close()


@pytest.mark.parametrize("faster", [True, False])
def test_stats_count_what_served_each_call(llama_dir, monkeypatch, faster):
    """stats().kernel_calls counts each forward by what ran it, and each attention and quantized product by the
    implementation that served it: a 40-token prompt's products take int8 blocks where they were measured faster
    (here: said to be, or not) and the dequantized product where not, its last row's LM head the int16 rows, its
    attention the CPU prefill kernel;
    the lone sequence's decodes are native steps (their calls are the C step's own); two short prompts in one
    batch are a native step too (rows within the native step's, fewer than the int8 blocks' 8), and so are their
    decodes."""
    from tieredkv.engine import rank_build

    monkeypatch.setattr(rank_build, "int8_many_rows_win", lambda weights, cache_dir: faster)
    monkeypatch.setattr(rank_build, "int8_fewest_rows", lambda weights, cache_dir: 8)
    core = EngineCore(make_config(model=str(llama_dir), quantization="int4", num_blocks=32, warm_bytes=0,
                                  compile_decode=True))
    try:
        assert core.stats().decode_path == "native" and core.stats().kernel_calls == {}
        layers = core.spec.num_layers
        run_to_end(core, [list(range(5, 45))], [3])  # one prefill forward, two native steps
        run_to_end(core, [[7, 8, 9], [10, 11, 12]], [2, 2])  # two native steps: both prompts, then both decodes
        many = "int8 blocks" if CPU.int8_gemm and faster else "dequantized float32"
        assert core.stats().kernel_calls == {
            "forward: eager": 1, "forward: native step": 4, "prefill attention: CPU kernel": layers,
            "rotary: CPU kernel": 2 * layers, f"quantized product: {many}": 4 * layers,
            "quantized product: int16 rows": 1}
    finally:
        core.close()
