"""The dense-layer function: on CPU in fp32 oneDNN (with weights packed at load time) or the swapped
MKL product, F.linear elsewhere."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tieredkv import EngineConfig
from tieredkv.engine_core import EngineCore
from tieredkv.kernels import select_kernels
from tieredkv.kernels.linear import (
    SWAP_MAX_OUT,
    SWAP_MAX_ROWS,
    _cpu_fp32_linear,
    onednn_linear,
    onednn_linear_usable,
    pack_onednn_weight,
    select_linear,
    select_weight_packing,
)

CPU = torch.device("cpu")


def check_against_f_linear(fn, rows, out_features, with_bias, seed=0, pack=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(out_features, 96, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    with torch.inference_mode():
        fw = w if pack is None else pack(w)
        got = fn(x, fw, b)
        assert got.shape == (rows, out_features) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        # a strided view and a 3-d input, as the model may hand them over
        xt = torch.randn(96, rows, generator=g).t()
        torch.testing.assert_close(fn(xt, fw, b), F.linear(xt, w, b), rtol=1e-5, atol=1e-4)
        x3 = x.view(1, rows, 96)
        torch.testing.assert_close(fn(x3, fw, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)


# row counts on both sides of the swapped product's limit, output widths on both sides of the LM-head limit
CASES = [(1, 160), (3, 160), (SWAP_MAX_ROWS, 160), (SWAP_MAX_ROWS + 1, 160), (5, SWAP_MAX_OUT + 1)]


@pytest.mark.parametrize("rows, out_features", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("use_onednn", [False, True])
def test_cpu_linear_matches_f_linear(rows, out_features, with_bias, use_onednn):
    if use_onednn and not onednn_linear_usable():
        pytest.skip("this torch build has no usable oneDNN linear")
    check_against_f_linear(_cpu_fp32_linear(use_onednn), rows, out_features, with_bias, seed=rows)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_onednn_linear_matches_f_linear():
    assert onednn_linear_usable()  # x86 and aarch64 builds of torch carry oneDNN
    check_against_f_linear(onednn_linear, 7, 160, with_bias=True)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows, out_features", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_weights_match_f_linear(rows, out_features, with_bias):
    packed = pack_onednn_weight(torch.randn(out_features, 96))
    assert packed.is_mkldnn and packed.shape == (out_features, 96)
    check_against_f_linear(_cpu_fp32_linear(True), rows, out_features, with_bias, seed=rows, pack=pack_onednn_weight)


def test_packing_is_selected_for_cpu_fp32_only():
    want = pack_onednn_weight if onednn_linear_usable() else None
    assert select_weight_packing(CPU, torch.float32) is want
    assert select_kernels("auto", CPU, torch.float32).pack_linear_weight is want
    assert select_weight_packing(CPU, torch.bfloat16) is None
    assert select_weight_packing(torch.device("cuda"), torch.float32) is None
    assert select_weight_packing(CPU, torch.float32, "torch") is None
    assert select_kernels("auto", CPU, torch.float32, "torch").pack_linear_weight is None


@pytest.mark.parametrize("force", ["auto", "packed", "torch"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_holds_the_weights_once_packed_or_plain_and_the_embedding_plain(llama_dir, force, compiled):
    """"auto" holds the weights once: packed where only the eager forward reads them; plain with the
    compiled decode path, which reads them plain (and the eager forward then does too). "packed" keeps a
    packed copy beside the plain weights the compiled path reads."""
    core = EngineCore(EngineConfig(model=str(llama_dir), num_blocks=16, compile_decode=compiled, cpu_linear=force))
    model, ops = core.model, core.runner.ops
    packed = force != "torch" and onednn_linear_usable() and (force == "packed" or not compiled)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * model.spec.num_layers + (model.lm_head is not None)
    assert all(hasattr(m, "packed_weight") == packed for m in linears)
    assert all(m.weight.is_mkldnn == (packed and not compiled) for m in linears)  # plain beside only if compiled
    assert model.lm_head_weight(ops).is_mkldnn == packed
    assert not model.embed_tokens.weight.is_mkldnn
    if compiled:
        assert not model.lm_head_weight(core.runner.compiled.ops).is_mkldnn
    # nothing is left on the checkpoint's mapping: its pages would stay resident beside the model's copies
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(core.model_dir) not in maps.read_text()


def test_cpu_fp32_gets_cpu_linear_and_others_keep_f_linear():
    cpu_linear = _cpu_fp32_linear(onednn_linear_usable())
    assert select_linear(CPU, torch.float32) is cpu_linear
    assert select_kernels("auto", CPU, torch.float32).linear is cpu_linear
    assert select_linear(CPU, torch.bfloat16) is F.linear
    assert select_linear(torch.device("cuda"), torch.float32) is F.linear
    assert select_linear(CPU, torch.float32, "torch") is F.linear
    assert select_kernels("auto", CPU, torch.float32, "torch").linear is F.linear


def test_bad_cpu_linear_value_is_refused():
    import pydantic

    with pytest.raises(ValueError, match="cpu_linear"):
        select_linear(CPU, torch.float32, "blas")
    with pytest.raises(pydantic.ValidationError, match="cpu_linear"):
        EngineConfig(cpu_linear="blas")
